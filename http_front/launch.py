"""How `octoserve up` (services/node/launcher.py) starts the HTTP front and knows it serves; kept here so the launcher
needs only a hook."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path

POLL_S = 0.05


def http_front_args(router: str, http_port: int, model_path: str | None, grace_s: float,
                    startup_timeout_s: float, config_path: str | None = None) -> list[str]:
    return ["--router", router, "--port", str(http_port), "--grace-s", str(grace_s),
            *(["--config", str(config_path)] if config_path else []),
            "--startup-timeout-s", str(startup_timeout_s), *(["--model", model_path] if model_path else [])]


def wait_http_healthy(address: str, deadline: float) -> None:
    """Polls GET /health until 200 or the deadline (raises the launcher's LaunchError)."""
    from octoserve.services.node.processes import LaunchError

    while True:
        try:
            with urllib.request.urlopen(f"http://{address}/health", timeout=2.0) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise LaunchError(f"the HTTP front at {address} is not healthy after the startup timeout")
        time.sleep(POLL_S)


def inside_ready_file(run_dir) -> Path:
    return Path(run_dir) / "http_front.ready.json"


def inside_router_args(http_port: int, model_path: str | None, run_dir) -> list[str]:
    """The router's flags that make it serve the front itself (see octoserve.http_front.local)."""
    return ["--http-port", str(http_port), "--http-ready-file", str(inside_ready_file(run_dir)),
            *(["--http-model", model_path] if model_path else [])]
