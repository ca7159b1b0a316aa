"""Kubernetes manifests (services/k8s.py): schema-valid offline, consistent with the placement, committed fresh.

Every generated object is validated against the Kubernetes JSON schemas bundled in `kubernetes-validate` (strict:
unknown fields fail), for the default and the disaggregated placement. The probes are checked against a real
grpc.aio service started the way a pod starts it (listening on 0.0.0.0), speaking grpc.health.v1 exactly
as the kubelet's native gRPC probe does.
"""

from __future__ import annotations

import copy
from pathlib import Path

import grpc.aio
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from octoserve.services import k8s
from octoserve.services.config import load_node_config
from octoserve.services.rpc import server as rpc_server

REPO = Path(__file__).resolve().parents[1]
KUBERNETES_VERSION = "1.33.0"  # native gRPC probes are GA since 1.27
PLACEMENTS = {"default": "services/configs/node-default.yaml", "disagg": "services/configs/node-disagg.yaml"}


def _generated(name: str, nodes: int = 2) -> list[dict]:
    path = REPO / PLACEMENTS[name]
    return k8s.manifests(load_node_config(str(path)), nodes, path.read_text())


@pytest.mark.parametrize("name", sorted(PLACEMENTS))
def test_every_manifest_validates_against_the_kubernetes_schemas(name):
    docs = _generated(name, nodes=3)
    kinds = [d["kind"] for d in docs]
    assert kinds == ["ConfigMap", "StatefulSet", "Service", "Service", "PodDisruptionBudget", "Deployment", "Service",
                     "PodDisruptionBudget"]
    for doc in docs:
        assert kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True) == "1.33"


def test_schema_validation_rejects_a_broken_object():
    """The validator is not a no-op: an unknown field and a string port both fail."""
    sts = copy.deepcopy(_generated("default")[1])
    sts["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "fifty"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, KUBERNETES_VERSION, strict=True)
    sts = copy.deepcopy(_generated("default")[1])
    sts["spec"]["template"]["spec"]["containers"][0]["gpus"] = 8
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("name", sorted(PLACEMENTS))
def test_committed_files_are_the_generator_output(name):
    out = REPO / "deploy" / "k8s" / name
    path = PLACEMENTS[name]
    files = k8s.render_files(load_node_config(str(REPO / path)), 2, path, (REPO / path).read_text())
    for file_name, text in files.items():
        assert (out / file_name).read_text() == text, f"regenerate: octoserve k8s --config {path} --out {out}"
    assert sorted(p.name for p in out.iterdir()) == sorted(files)


def test_check_flag_fails_on_a_stale_file_and_passes_on_a_fresh_one(tmp_path, capsys):
    args = ["--config", str(REPO / PLACEMENTS["default"]), "--out", str(tmp_path / "k")]
    assert k8s.main([*args, "--check"]) == 1  # nothing written yet
    assert k8s.main(args) == 0
    assert k8s.main([*args, "--check"]) == 0
    manifest = tmp_path / "k" / k8s.MANIFEST_FILE
    manifest.write_text(manifest.read_text().replace("replicas: 2", "replicas: 3", 1))
    assert k8s.main([*args, "--check"]) == 1
    assert "differs from the generator" in capsys.readouterr().err
    assert k8s.main([*args, "--nodes", "0"]) == 2


def test_one_pod_per_gpu_node_with_each_worker_on_its_instances_gpus():
    sts = _generated("disagg", nodes=4)[1]
    pod = sts["spec"]["template"]["spec"]
    assert sts["spec"]["replicas"] == 4 and sts["spec"]["serviceName"] == "octoserve-nodes"
    names = [c["name"] for c in pod["containers"]]
    assert names == ["scheduler", "router", "worker-lm-prefill-0", "worker-lm-decode-0", "worker-sm-0", "worker-sm-1"]
    gpus = [c["resources"]["limits"].get("nvidia.com/gpu") for c in pod["containers"]]
    assert gpus == [None, None, "2", "4", "1", "1"]  # TP of each instance; 8 in all, so one pod fills one node
    assert [c["resources"]["requests"].get("nvidia.com/gpu") for c in pod["containers"]] == gpus
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert pod["containers"][2]["command"][:5] == ["python", "-m", "octoserve.prefill_worker", "--instance",
                                                   "lm-prefill-0"]
    assert all(c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"] for c in pod["containers"])


def test_probes_security_drain_metrics_and_tls():
    docs = _generated("default")
    sts = docs[1]
    pod = sts["spec"]["template"]["spec"]
    s = k8s.K8sSettings()
    assert pod["terminationGracePeriodSeconds"] == s.drain_grace_s + 15
    for c in pod["containers"]:
        port = c["ports"][0]["containerPort"]
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert c[probe]["grpc"] == {"port": port, "service": ""}
        # Liveness tolerates NOT_SERVING for longer than the drain: the kubelet never restarts a draining process.
        assert c["livenessProbe"]["periodSeconds"] * c["livenessProbe"]["failureThreshold"] > s.drain_grace_s
        assert c["command"][-2:] == ["--grace-s", str(s.drain_grace_s)]
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["allowPrivilegeEscalation"] is False and sc["runAsUser"] != 0
        assert c["command"][c["command"].index("--host") + 1] == "0.0.0.0"
        assert {"name": "tls", "mountPath": "/etc/octoserve/tls", "readOnly": True} in c["volumeMounts"]
    tls = next(v for v in pod["volumes"] if v["name"] == "tls")
    assert tls["secret"]["secretName"] == "octoserve-mtls"
    annotations = sts["spec"]["template"]["metadata"]["annotations"]
    router = next(c for c in pod["containers"] if c["name"] == "router")
    metrics_port = next(p["containerPort"] for p in router["ports"] if p["name"] == "m-router")
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(metrics_port),
                           "prometheus.io/path": "/metrics"}
    public = docs[3]
    assert [(p["name"], p["port"]) for p in public["spec"]["ports"]] == [("grpc", 50051), ("http", 8000)]
    assert docs[2]["spec"]["clusterIP"] == "None"
    assert [d["spec"]["maxUnavailable"] for d in docs if d["kind"] == "PodDisruptionBudget"] == [1, 1]
    picker = docs[5]
    assert picker["metadata"]["name"] == "octoserve-picker"
    cmd = picker["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--nodes") + 1] == ("octoserve-node-0.octoserve-nodes:50051,"
                                             "octoserve-node-1.octoserve-nodes:50051")


def test_podmonitor_scrapes_every_container_metrics_port():
    config = load_node_config(str(REPO / PLACEMENTS["disagg"]))
    pod = _generated("disagg")[1]["spec"]["template"]["spec"]
    metric_ports = [p["name"] for c in pod["containers"] for p in c["ports"] if p["name"].startswith("m-")]
    monitor = k8s.podmonitor(config)
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == [*metric_ports, "metrics"]


def test_check_manifests_names_each_mismatch():
    config = load_node_config(str(REPO / PLACEMENTS["default"]))
    docs = _generated("default")
    assert k8s.check_manifests(docs, config) == []
    broken = copy.deepcopy(docs)
    containers = broken[1]["spec"]["template"]["spec"]["containers"]
    containers[2]["resources"]["limits"]["nvidia.com/gpu"] = "2"
    del containers[3]
    containers[4]["readinessProbe"] = {"exec": {"command": ["true"]}}
    containers[4]["securityContext"]["readOnlyRootFilesystem"] = False
    containers[1]["ports"][0]["containerPort"] = 50050
    assert k8s.check_manifests(broken, config) == [
        "worker-lm-0: requests 2 GPUs, the placement gives lm-0 4",
        "instance sm-0 has no container; add 'worker-sm-0'",
        "the node pod requests 5 GPUs, the placement uses 8; one pod per node",
        "port 50050 is used by both scheduler and router; rename the instance",
        "worker-sm-2: add a gRPC readinessProbe (grpc.health.v1)",
        "worker-sm-2: run as non-root with a read-only root filesystem",
    ]


async def test_pod_binding_serves_grpc_health_as_the_kubelet_probes_it():
    """`--host 0.0.0.0` (what the pod passes) makes the standard health service answer on every address;
    Check(service="") is SERVING while up and NOT_SERVING once the drain starts (readiness drops first)."""
    drained = []

    async def drain(grace_s: float) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
            drained.append(reply.status)

    running = await rpc_server.start_service(rpc_server.ServiceSpec(name="probe-test", metrics_port=None, grace_s=2.0,
                                                                    drain=drain, host="0.0.0.0"))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await running.shutdown()
    assert drained == [health_pb2.HealthCheckResponse.NOT_SERVING]


# --- mTLS on: exec probes with the mounted certificates -------------------------------------------------------


def _generated_mtls(name: str, nodes: int = 2) -> list[dict]:
    path = REPO / PLACEMENTS[name]
    return k8s.manifests(load_node_config(str(path)), nodes, path.read_text(), k8s.K8sSettings(mtls=True))


@pytest.mark.parametrize("name", sorted(PLACEMENTS))
def test_with_mtls_the_internal_ports_get_exec_probes_that_present_the_containers_certificate(name):
    docs = _generated_mtls(name, nodes=3)
    for doc in docs:
        assert kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True) == "1.33"
    assert k8s.check_manifests(docs, load_node_config(str(REPO / PLACEMENTS[name]))) == []
    pod = docs[1]["spec"]["template"]["spec"]
    for c in pod["containers"]:
        port = c["ports"][0]["containerPort"]
        if c["name"] == "router":  # the public port is not behind mTLS: the native probe still reaches it
            assert c["readinessProbe"]["grpc"] == {"port": port, "service": ""}
            continue
        cert = "scheduler" if c["name"] == "scheduler" else "worker"
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert "grpc" not in c[probe]
            assert c[probe]["exec"]["command"] == [
                "python", "-m", "octoserve.services.health", "--port", str(port), "--tls-dir", "/etc/octoserve/tls",
                "--cert", cert, "--timeout", "3"]
            assert c[probe]["timeoutSeconds"] == 5  # longer than the check's own deadline plus a Python start
        assert "--allow-insecure" not in c["command"]  # the certificates are the boundary now
    tls = next(v for v in pod["volumes"] if v["name"] == "tls")
    assert tls["secret"]["optional"] is False  # with mTLS on, a pod without the Secret must not start
    plain = _generated(name)[1]["spec"]["template"]["spec"]
    assert next(v for v in plain["volumes"] if v["name"] == "tls")["secret"]["optional"] is True


def test_mtls_needs_the_certificates_where_the_secret_is_mounted(tmp_path):
    assert k8s.mtls_from_sections({}) is False
    assert k8s.mtls_from_sections({"tls": {"dir": "/etc/octoserve/tls"}}) is True
    with pytest.raises(ValueError, match="set `tls: {dir: /etc/octoserve/tls}`"):
        k8s.mtls_from_sections({"tls": {"dir": "/srv/certs"}})
    config = tmp_path / "node.yaml"
    config.write_text((REPO / PLACEMENTS["default"]).read_text() + "\ntls: {dir: /srv/certs}\n")
    assert k8s.main(["--config", str(config), "--out", str(tmp_path / "k")]) == 2
    config.write_text((REPO / PLACEMENTS["default"]).read_text() + "\ntls: {dir: /etc/octoserve/tls}\n")
    assert k8s.main(["--config", str(config), "--out", str(tmp_path / "k")]) == 0
    text = (tmp_path / "k" / k8s.MANIFEST_FILE).read_text()
    assert "command: *" not in text and "exec: *" not in text  # each probe spelled out, not a YAML alias
    docs = list(yaml.safe_load_all(text))
    scheduler = docs[1]["spec"]["template"]["spec"]["containers"][0]
    assert scheduler["readinessProbe"]["exec"]["command"][2] == "octoserve.services.health"


def test_check_manifests_accepts_the_health_exec_only_on_the_containers_own_port():
    config = load_node_config(str(REPO / PLACEMENTS["default"]))
    docs = copy.deepcopy(_generated_mtls("default"))
    worker = docs[1]["spec"]["template"]["spec"]["containers"][2]
    command = worker["livenessProbe"]["exec"]["command"]
    command[command.index("--port") + 1] = "50050"  # the scheduler's port: it would probe the wrong process
    assert k8s.check_manifests(docs, config) == [f"{worker['name']}: add a gRPC livenessProbe (grpc.health.v1)"]


async def test_the_generated_exec_probe_checks_a_real_mtls_server(tmp_path):
    """The exact command of the worker's probe, run as the kubelet runs it (python from this venv, the certificate
    directory where the test wrote it): exit 0 while SERVING over mTLS; 1 without a client certificate (the
    server refuses the handshake) and 1 once the server drains (NOT_SERVING); 2 for a missing key pair."""
    import asyncio
    import sys

    from octoserve.services import trust

    certs = tmp_path / "tls"
    trust.make_certs(certs)
    server_tls = trust.TlsFiles.load(certs, "worker")
    running = await rpc_server.start_service(rpc_server.ServiceSpec(
        name="mtls-probe-test", metrics_port=None, grace_s=2.0, server_credentials=server_tls.server_credentials()))

    async def probe(command: list[str]) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(sys.executable, *command[1:], stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode, out.decode()

    command = [str(certs) if a == "/etc/octoserve/tls" else a for a in k8s.health_command(running.port, "worker")]
    try:
        assert await probe(command) == (0, f"127.0.0.1:{running.port}: SERVING\n")
        plaintext = command[:command.index("--tls-dir")]
        code, out = await probe(plaintext)
        assert code == 1 and "UNAVAILABLE" in out
        code, out = await probe([*command[:-4], "--cert", "nobody"])
        assert code == 2 and "--cert must be one of" in out
        (certs / "scheduler.key").unlink()
        code, out = await probe([a if a != "worker" else "scheduler" for a in command])
        assert code == 2 and "scheduler.key" in out
        await running.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert await probe(command) == (1, f"127.0.0.1:{running.port}: NOT_SERVING\n")
    finally:
        await running.shutdown()


# --- the Gateway API Inference Extension objects (CRD kinds: checked here, not by kubernetes-validate) ---------


def test_inference_pool_selects_the_node_pods_http_port_and_names_the_picker_as_its_endpoint_picker():
    """kubernetes-validate bundles only the core schemas, so the InferencePool (inference.networking.k8s.io/v1) and
    the HTTPRoute are checked against the fields their v1 APIs require and against the objects they refer to."""
    s = k8s.K8sSettings()
    docs = _generated("default")
    pool, route = k8s.inference_pool(s)
    sts, picker_deploy, picker_svc = docs[1], docs[5], docs[6]
    assert (pool["apiVersion"], pool["kind"]) == ("inference.networking.k8s.io/v1", "InferencePool")
    assert set(pool["spec"]) == {"selector", "targetPorts", "endpointPickerRef"}
    # selector: plain matchLabels (the v1 LabelSelector) that select exactly the node pods.
    assert set(pool["spec"]["selector"]) == {"matchLabels"}
    assert pool["spec"]["selector"]["matchLabels"] == sts["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"] != picker_deploy["spec"]["template"]["metadata"]["labels"]
    # targetPorts: exactly one, the router container's HTTP port, which is also where the EPP says to send.
    (port,) = pool["spec"]["targetPorts"]
    router = next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "router")
    assert port == {"number": next(p["containerPort"] for p in router["ports"] if p["name"] == "http")}
    cmd = picker_deploy["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--epp" in cmd and cmd[cmd.index("--target-port") + 1] == str(port["number"])
    # endpointPickerRef: the picker's Service and one of its ports; FailClose (no silent bypass of backpressure).
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["kind"] == "Service" and ref["name"] == picker_svc["metadata"]["name"]
    assert ref["portNumber"] in [p["port"] for p in picker_svc["spec"]["ports"]]
    assert ref["failureMode"] in ("FailOpen", "FailClose") and ref["failureMode"] == "FailClose"
    picker_port = next(p for p in picker_svc["spec"]["ports"] if p["port"] == ref["portNumber"])
    assert picker_port["appProtocol"] == "kubernetes.io/h2c"  # ext_proc is gRPC: HTTP/2 without TLS
    # HTTPRoute: attached to a Gateway, its backend is the pool.
    assert (route["apiVersion"], route["kind"]) == ("gateway.networking.k8s.io/v1", "HTTPRoute")
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                           "name": "inference-gateway"}]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": pool["metadata"]["name"]}]
    # Object metadata is still core metadata: names are DNS labels.
    for doc in (pool, route):
        assert kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]},
                                            KUBERNETES_VERSION, strict=True) == "1.33"
