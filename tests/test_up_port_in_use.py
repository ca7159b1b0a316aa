"""A port already in use: `octoserve up` says so in one line naming the flag and the port, exit 2, before it starts
anything; and a service that fails to start anyway (its port taken after the check) is reported with the cause its
log gives, not only the log's path.

The ports are taken by a socket this test listens on at 127.0.0.1 (an ephemeral port the kernel hands out, so no
other test's port); `up` runs as a subprocess from a temporary directory outside the checkout.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys

import pytest

from octoserve.services.node.launcher import LaunchError, start_node
from octoserve.services.node.processes import cause_in_log
from tests.fault_fixtures import two_replica_config

ENV = {**os.environ, "OCTOSERVE_PURE_PYTHON": "1"}  # stderr is compared whole


@contextlib.contextmanager
def listening():
    """A port on 127.0.0.1 held by a listening socket of this process."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def up(*argv: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "octoserve.services.cli", "up", *argv, "--run-dir", "run"],
                          capture_output=True, text=True, timeout=120, cwd=cwd, env=ENV)


@pytest.mark.parametrize("flag, extra, advice", [
    ("--port", ("--no-http",), "stop what listens there or give the router another --port (0: any free port)"),
    ("--http-port", ("--port", "0"), "stop what listens there, give the HTTP front another --http-port (0: any "
                                     "free port), or pass --no-http"),
])
def test_up_on_a_port_in_use_is_one_line_naming_the_flag_and_exit_2(tmp_path, flag, extra, advice):
    with listening() as port:
        done = up(flag, str(port), *extra, cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (
        2, "", f"octoserve up: error: {flag} {port}: 127.0.0.1:{port} is already in use; {advice}\n")
    assert list(tmp_path.iterdir()) == []  # nothing started: not even the run directory


def test_up_with_the_same_port_twice_or_no_port_number_is_bad_input(tmp_path):
    with listening() as port:  # held, so that no other process can be listening there meanwhile; freed for `up`
        pass
    done = up("--port", str(port), "--http-port", str(port), cwd=tmp_path)
    assert (done.returncode, done.stderr) == (
        2, f"octoserve up: error: --http-port {port}: --port is {port} too; give them different ports\n")
    done = up("--port", "70000", cwd=tmp_path)
    assert (done.returncode, done.stderr) == (
        2, "octoserve up: error: --port 70000: not a port number; give one in 1-65535 (0: any free port)\n")
    assert list(tmp_path.iterdir()) == []


def test_a_service_that_cannot_bind_its_port_is_reported_with_the_cause_from_its_log(tmp_path):
    # The launcher's API has no port check of its own (the check is `up`'s): the router starts, fails to bind the
    # taken port and exits; the launcher stops what it started and says why, from the router's log.
    with listening() as port:
        with pytest.raises(LaunchError) as caught:
            start_node(two_replica_config(), port=port, run_dir=tmp_path, startup_timeout_s=60, grace_s=1)
    log = tmp_path / "router.log"
    assert str(caught.value) == (
        f"router exited with code 1 while starting: OSError: router: cannot bind 127.0.0.1:{port} (Address already "
        f"in use); choose a free port or 0; see {log}")


@pytest.mark.parametrize("text, cause", [
    ("Traceback (most recent call last):\n  File \"x\", line 1\nValueError: bad value\n", "ValueError: bad value"),
    ('{"level": "info", "msg": "starting"}\n{"level": "error", "msg": "no scheduler at 127.0.0.1:1"}\n'
     '{"level": "info", "msg": "stopped"}\n', "no scheduler at 127.0.0.1:1"),
    ('{"level": "error", "msg": "first"}\nTraceback (most recent call last):\nKeyboardInterrupt\n', "KeyboardInterrupt"),
    ('{"level": "info", "msg": "serving"}\n', None),
])
def test_the_cause_is_the_last_exception_line_or_error_message_of_the_log(tmp_path, text, cause):
    (tmp_path / "x.log").write_text(text)
    assert cause_in_log(tmp_path / "x.log") == cause
    assert cause_in_log(tmp_path / "missing.log") is None
