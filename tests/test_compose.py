"""docker-compose generation and validation against the placement (services/compose.py).

The health-check command is run for real against a grpc.aio health server on 127.0.0.1, so a compose file
that passes here probes the way a container would.
"""

from __future__ import annotations

import asyncio
import copy
import subprocess
import sys
from pathlib import Path

import grpc.aio
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from octoserve.services.compose import (
    DEFAULT_CONFIG_PATH,
    DEFAULT_OUT_PATH,
    ComposeSettings,
    compose_dict,
    render,
    service_name,
    validate_compose,
)
from octoserve.services.core.placement import node_config_from_dict

REPO = Path(__file__).resolve().parents[1]

PLACEMENT = node_config_from_dict({
    "models": {"llama-3-70b": "llama-3-70b", "llama-3-8b": "llama-3-8b"},
    "instances": [
        {"id": "llama-3-70b-0", "model": "llama-3-70b", "role": "colocated", "gpu_ids": [0, 1, 2, 3]},
        {"id": "llama-3-8b-p0", "model": "llama-3-8b", "role": "prefill", "gpu_ids": [4]},
        {"id": "llama-3-8b-d0", "model": "llama-3-8b", "role": "decode", "gpu_ids": [5]},
        {"id": "llama-3-8b/c:1", "model": "llama-3-8b", "role": "colocated", "gpu_ids": [7]},
    ],
})


def test_one_service_per_process_with_its_gpus():
    doc = compose_dict(PLACEMENT)
    services = doc["services"]
    assert list(services) == ["scheduler", "router", "worker-llama-3-70b-0", "worker-llama-3-8b-p0",
                              "worker-llama-3-8b-d0", "worker-llama-3-8b-c-1"]
    devices = {n: s["deploy"]["resources"]["reservations"]["devices"] for n, s in services.items() if "deploy" in s}
    assert devices["worker-llama-3-70b-0"] == [{"driver": "nvidia", "device_ids": ["0", "1", "2", "3"],
                                                "capabilities": ["gpu"]}]
    assert [d[0]["device_ids"] for d in devices.values()] == [["0", "1", "2", "3"], ["4"], ["5"], ["7"]]
    assert [s["command"][2] for s in services.values()] == [
        "octoserve.services.scheduler", "octoserve.router", "octoserve.decode_worker", "octoserve.prefill_worker",
        "octoserve.decode_worker", "octoserve.decode_worker"]
    assert services["worker-llama-3-8b-p0"]["command"][3:5] == ["--instance", "llama-3-8b-p0"]
    ports = [int(s["labels"]["octoserve.port"]) for s in services.values()]
    assert ports == [50050, 50051, 50100, 50101, 50102, 50103]
    router = services["router"]  # serves the OpenAI-compatible front too, with each model's tokenizer from /models
    assert router["command"][-6:-2] == ["--http-port", "8000", "--http-models-root", "/models"]
    assert router["labels"]["octoserve.http_port"] == "8000" and router["volumes"][-1].endswith(":/models:ro")
    assert all(s["ipc"] == "host" and s["network_mode"] == "host" for n, s in services.items() if n.startswith("w"))
    assert validate_compose(doc, PLACEMENT) == []


def test_validation_names_every_mismatch():
    doc = compose_dict(PLACEMENT)
    broken = copy.deepcopy(doc)
    services = broken["services"]
    del services["worker-llama-3-8b-d0"]
    services["worker-llama-3-8b-p0"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] = ["0"]
    services["router"]["labels"]["octoserve.port"] = "50050"
    del services["scheduler"]["healthcheck"]
    services["worker-stale"] = copy.deepcopy(services["worker-llama-3-8b-c-1"])
    assert validate_compose(broken, PLACEMENT) == [
        "worker-llama-3-8b-p0: reserves GPUs ['0'], the placement gives llama-3-8b-p0 ['4']",
        "instance llama-3-8b-d0 has no service; add 'worker-llama-3-8b-d0'",
        "worker-stale: no instance of the placement runs here; remove it",
        "GPU 0 is used by both worker-llama-3-70b-0 and worker-llama-3-8b-p0",
        "GPU 7 is used by both worker-llama-3-8b-c-1 and worker-stale",
        "port 50050 is used by both scheduler and router",
        "port 50103 is used by both worker-llama-3-8b-c-1 and worker-stale",
        "port 9405 is used by both worker-llama-3-8b-c-1 and worker-stale",
        "scheduler: add a healthcheck",
    ]


def test_rendered_yaml_round_trips():
    doc = compose_dict(PLACEMENT, ComposeSettings(image="registry.local/octoserve:1"))
    assert yaml.safe_load(render(doc)) == doc


@pytest.mark.parametrize("status, exit_code", [
    (health_pb2.HealthCheckResponse.SERVING, 0),
    (health_pb2.HealthCheckResponse.NOT_SERVING, 1),
])
async def test_health_check_command_probes_grpc_health(status, exit_code):
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        await servicer.set("", status)
        settings = ComposeSettings(router_port=port)
        test = compose_dict(PLACEMENT, settings)["services"]["router"]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"]
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", test[3], cwd=REPO)
        assert await asyncio.wait_for(proc.wait(), 60) == exit_code
    finally:
        await server.stop(grace=None)


def test_committed_compose_file_is_the_generated_one_for_the_default_placement():
    if not (REPO / DEFAULT_CONFIG_PATH).exists():
        pytest.skip(f"{DEFAULT_CONFIG_PATH} has not landed yet")
    from octoserve.services.config import load_node_config

    config = load_node_config(REPO / DEFAULT_CONFIG_PATH)
    text = (REPO / DEFAULT_OUT_PATH).read_text()
    assert text == render(compose_dict(config))
    doc = yaml.safe_load(text)
    assert validate_compose(doc, config) == []
    assert {service_name(i) for i in config.instances} <= set(doc["services"])


def test_check_mode_detects_a_stale_file(tmp_path):
    from octoserve.services.compose import main

    out = tmp_path / "docker-compose.yml"
    config = str(REPO / DEFAULT_CONFIG_PATH)
    assert main(["--config", config, "--out", str(out), "--check"]) == 1  # missing
    assert main(["--config", config, "--out", str(out)]) == 0
    assert main(["--config", config, "--out", str(out), "--check"]) == 0
    out.write_text(out.read_text().replace("ipc: host", "ipc: private", 1))
    assert main(["--config", config, "--out", str(out), "--check"]) == 1
