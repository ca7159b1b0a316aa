"""Kubernetes manifests for a fleet of octoserve nodes, generated from one placement and a node count, and checked.

    octoserve k8s [--config node.yaml] [--nodes N] [--out deploy/k8s/default] [--check]

Writes three files into --out: `octoserve.yaml` (core Kubernetes kinds only: ConfigMap, StatefulSet, Services,
PodDisruptionBudgets, the cluster picker's Deployment), `podmonitor.yaml` (a Prometheus Operator PodMonitor,
for clusters that run the operator; the pods also carry the plain `prometheus.io/*` scrape annotations) and
`inference-pool.yaml` (the Gateway API Inference Extension's InferencePool with the picker as its endpoint picker,
and an HTTPRoute to it: CRD kinds, for clusters with a gateway that implements the extension).
`--check` exits 1 when the files in --out differ from what the generator writes now.

Why plain YAML rather than a Helm chart: the placement file is already the one source of truth and this module is
the template; a chart would be a second template language whose values could drift from the placement, and a
generated file can be diffed, reviewed and validated offline as it will be applied (tests validate every object
against the Kubernetes JSON schemas). Image, namespace and labels are overlaid with kustomize if needed.

The shape, and why:
- One pod per GPU node: a StatefulSet `octoserve-node` with `--nodes` replicas. Its containers are the node's
  processes: `scheduler`, `router`, and one `worker-<instance>` per engine instance, each requesting exactly its
  instance's TP GPUs (`nvidia.com/gpu`), so the pod asks for all 8 GPUs of a node and the device plugin gives each
  worker its own. Containers of a pod share the network namespace (they reach each other on 127.0.0.1, as on one
  machine) and the IPC namespace (NCCL/CUDA IPC between prefill and decode workers); /dev/shm is a memory
  emptyDir because the runtime's 64 MB default is too small. A required pod anti-affinity on the hostname keeps
  two node pods off one machine. The StatefulSet gives each node a stable DNS name through the headless Service
  `octoserve-nodes` (octoserve-node-0.octoserve-nodes:50051), which is what the cluster picker watches.
- Every process listens on 0.0.0.0 inside the pod (`--host 0.0.0.0`; the scheduler and workers also
  `--allow-insecure`, as services/trust.py demands without `tls:`), so the kubelet's native gRPC probes
  (`grpc.health.v1`, service "") reach it on the pod IP. Readiness drops the moment a process starts draining
  (it reports NOT_SERVING), so the endpoint leaves the Services first; liveness tolerates failureThreshold x
  period (60 s) of NOT_SERVING, longer than the drain, so the kubelet never restarts a draining container; a
  startup probe gives workers up to 15 minutes to load weights.
- Termination: each process drains in-flight streams for `drain_grace_s` after SIGTERM (new work gets
  UNAVAILABLE, which clients retry elsewhere), and `terminationGracePeriodSeconds` = drain + 15 s so the kill
  comes after the drain. PodDisruptionBudgets allow one node (and one picker) down at a time.
- Security: runAsNonRoot (uid 10001), read-only root filesystem, no privilege escalation, every capability
  dropped, RuntimeDefault seccomp. Writable paths are emptyDirs: /tmp and /dev/shm.
- Configuration: the placement is a ConfigMap mounted at /etc/octoserve/node.yaml; model weights come from the
  read-only PersistentVolumeClaim `octoserve-models` (one subdirectory per served model name) at /models.
- mTLS: the Secret `octoserve-mtls` holding what `octoserve certs DIR` writes (ca.pem and <service>.pem/.key for
  scheduler, worker, router) is mounted read-only at /etc/octoserve/tls in every container; `tls: {dir:
  /etc/octoserve/tls}` in the placement turns it on. The volume is optional, so a cluster without it starts with
  plaintext inside the pod. With mTLS on (the placement's tls.dir must then be /etc/octoserve/tls), the Secret
  is required, the scheduler and workers drop --allow-insecure, and since their ports demand client certificates,
  which the kubelet's native gRPC probe cannot present, their probes are exec probes running
  `python -m octoserve.services.health` (the same grpc.health.v1 Check, presenting the container's own key pair);
  the router's public port stays plaintext, so it keeps the native probe.
- The cluster picker (`python -m octoserve.services.cluster`) runs as its own Deployment `octoserve-picker`
  with its Service; it reads each node router's headroom summary (the node list is fixed at generation time:
  regenerate with the new --nodes when the StatefulSet is scaled) and picks a node per request. With `--epp` its
  port also speaks Envoy ext_proc: it is the endpoint picker (EPP) of the InferencePool in inference-pool.yaml, so
  a standard gateway proxies the requests and asks it where to (services/cluster/epp.py, docs/CLUSTER.md).
- Metrics: every container exposes Prometheus metrics on a named port `m-<container>`; the pod annotations point
  at the router's (`prometheus.io/scrape`, `/port`, `/path`), the PodMonitor scrapes them all.

Invariants of `manifests(config, nodes)`: exactly one worker container per instance, requesting len(gpu_ids)
GPUs; the pod's GPU total equals the placement's num_gpus; every port unique in the pod; every container has
readiness, liveness and startup probes on its own port (native gRPC, or the mTLS health exec), a read-only root filesystem and non-root user.
`check_manifests` checks exactly these and returns the problems found.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from octoserve.services.config import config_file
from octoserve.services.core.placement import InstanceConfig, NodeConfig
from octoserve.services.core.types import Role

DEFAULT_CONFIG_PATH = "services/configs/node-default.yaml"  # the embedded default, as the manifests' header names it
DEFAULT_OUT_DIR = "deploy/k8s/default"
MANIFEST_FILE = "octoserve.yaml"
PODMONITOR_FILE = "podmonitor.yaml"
INFERENCE_POOL_FILE = "inference-pool.yaml"
INFERENCE_API = "inference.networking.k8s.io/v1"
GATEWAY_NAME = "inference-gateway"  # the Gateway the HTTPRoute attaches to: the cluster operator's, not generated
APP = "octoserve"
NODE_NAME = "octoserve-node"
PICKER_NAME = "octoserve-picker"
GPU_RESOURCE = "nvidia.com/gpu"
CONFIG_DIR = "/etc/octoserve"
TLS_DIR = "/etc/octoserve/tls"
MODELS_DIR = "/models"
DEFAULT_IMAGE = "octoserve:latest"


@dataclass(frozen=True, slots=True)
class K8sSettings:
    image: str = DEFAULT_IMAGE
    engine: str = "vllm"
    scheduler_port: int = 50050
    router_port: int = 50051  # public gRPC (octoserve.v1.Generation)
    http_port: int = 8000  # public HTTP: the OpenAI-compatible front of the router
    first_worker_port: int = 50100  # worker i (placement order) listens on first_worker_port + i
    first_metrics_port: int = 9400  # scheduler, router, then workers in placement order
    picker_port: int = 9002  # the cluster picker's gRPC port (the Inference Extension's endpoint-picker port)
    picker_metrics_port: int = 9090
    drain_grace_s: int = 45  # --grace-s: a 400-token stream at 30 ms/token finishes in 12 s; BATCH waits up to 10 s
    worker_startup_s: int = 900  # weights load before a worker reports SERVING
    models_claim: str = "octoserve-models"
    tls_secret: str = "octoserve-mtls"
    run_as_user: int = 10001
    picker_replicas: int = 2
    mtls: bool = False  # the placement's `tls:` is on: scheduler and workers demand client certificates

    @property
    def termination_grace_s(self) -> int:
        return self.drain_grace_s + 15


def container_name(instance: InstanceConfig) -> str:
    """The container of an instance: `worker-<id>` lower-cased, with characters Kubernetes rejects replaced."""
    return "worker-" + re.sub(r"[^a-z0-9-]", "-", instance.id.lower()).strip("-")


def _labels(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": component}


def _security_context(s: K8sSettings) -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": s.run_as_user,
        "runAsGroup": s.run_as_user,
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


HEALTH_CHECK_TIMEOUT_S = 3  # `octoserve health --timeout`; the exec probe's own timeout is 2 s longer (Python start)


def health_command(port: int, cert: str) -> list[str]:
    """The exec probe of a container whose port demands client certificates: one grpc.health.v1 Check over mTLS
    with the container's own key pair from the mounted Secret (services/health.py)."""
    return ["python", "-m", "octoserve.services.health", "--port", str(port), "--tls-dir", TLS_DIR, "--cert", cert,
            "--timeout", str(HEALTH_CHECK_TIMEOUT_S)]


def _probes(port: int, startup_s: int, exec_cert: str | None = None) -> dict[str, Any]:
    """Startup, readiness and liveness: the kubelet's native gRPC probe, or with `exec_cert` (mTLS on) an exec probe
    running the same standard health check with that service's client certificate."""
    def check() -> dict[str, Any]:  # a fresh object per probe: shared ones would be YAML anchors in the output
        if exec_cert is None:
            return {"grpc": {"port": port, "service": ""}}
        return {"exec": {"command": health_command(port, exec_cert)}}

    quick, slow = (3, 5) if exec_cert is None else (HEALTH_CHECK_TIMEOUT_S + 2, HEALTH_CHECK_TIMEOUT_S + 2)
    return {
        "startupProbe": {**check(), "periodSeconds": 5, "failureThreshold": max(1, startup_s // 5),
                         "timeoutSeconds": slow},
        "readinessProbe": {**check(), "periodSeconds": 5, "failureThreshold": 1, "timeoutSeconds": quick},
        "livenessProbe": {**check(), "periodSeconds": 10, "failureThreshold": 6, "timeoutSeconds": slow},
    }


def _mounts(models: bool) -> list[dict[str, Any]]:
    mounts = [
        {"name": "config", "mountPath": CONFIG_DIR + "/node.yaml", "subPath": "node.yaml", "readOnly": True},
        {"name": "tls", "mountPath": TLS_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if models:
        mounts += [{"name": "models", "mountPath": MODELS_DIR, "readOnly": True}, {"name": "shm", "mountPath": "/dev/shm"}]
    return mounts


def _container(s: K8sSettings, name: str, command: list[str], ports: Sequence[tuple[str, int]], metrics_port: int,
               resources: Mapping[str, Any], startup_s: int, models: bool = False,
               exec_cert: str | None = None) -> dict[str, Any]:
    grpc_port = ports[0][1]
    return {
        "name": name,
        "image": s.image,
        "command": [*command, "--grace-s", str(s.drain_grace_s)],
        "ports": [{"name": pname, "containerPort": p, "protocol": "TCP"} for pname, p in ports]
        + [{"name": _port_name("m", name), "containerPort": metrics_port, "protocol": "TCP"}],
        "resources": dict(resources),
        "volumeMounts": _mounts(models),
        "securityContext": _security_context(s),
        **_probes(grpc_port, startup_s, exec_cert),
    }


def _port_name(prefix: str, container: str) -> str:
    """IANA_SVC_NAME: at most 15 characters, lower-case alphanumerics and '-', no '--'."""
    name = re.sub(r"-+", "-", f"{prefix}-{container.removeprefix('worker-')}")[:15].strip("-")
    return name


# Internal services listen on the pod IP so the kubelet's probes and Prometheus reach them. Without `tls:` in the
# placement that needs --allow-insecure (services/trust.py); the pod's network namespace is the boundary, and a
# NetworkPolicy should close these ports to the rest of the cluster.
_INTERNAL_BIND = ("--host", "0.0.0.0", "--allow-insecure")
_INTERNAL_BIND_MTLS = ("--host", "0.0.0.0")  # with tls: the certificates are the boundary


def _internal_bind(s: K8sSettings) -> tuple[str, ...]:
    return _INTERNAL_BIND_MTLS if s.mtls else _INTERNAL_BIND

_SMALL = {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}}


def _scheduler(s: K8sSettings) -> dict[str, Any]:
    command = ["python", "-m", "octoserve.services.scheduler", "--config", CONFIG_DIR + "/node.yaml",
               "--port", str(s.scheduler_port), "--metrics-port", str(s.first_metrics_port), *_internal_bind(s)]
    return _container(s, "scheduler", command, [("grpc-sched", s.scheduler_port)], s.first_metrics_port, _SMALL, 60,
                      exec_cert="scheduler" if s.mtls else None)


def _router(s: K8sSettings) -> dict[str, Any]:
    metrics_port = s.first_metrics_port + 1
    command = ["python", "-m", "octoserve.router", "--config", CONFIG_DIR + "/node.yaml",
               "--scheduler", f"127.0.0.1:{s.scheduler_port}", "--port", str(s.router_port),
               "--metrics-port", str(metrics_port), "--host", "0.0.0.0"]
    resources = {"requests": {"cpu": "4", "memory": "4Gi"}, "limits": {"memory": "8Gi"}}
    ports = [("grpc", s.router_port), ("http", s.http_port)]
    return _container(s, "router", command, ports, metrics_port, resources, s.worker_startup_s)


def _worker(s: K8sSettings, index: int, instance: InstanceConfig) -> dict[str, Any]:
    port, metrics_port = s.first_worker_port + index, s.first_metrics_port + 2 + index
    module = "octoserve.prefill_worker" if instance.role == Role.PREFILL else "octoserve.decode_worker"
    command = ["python", "-m", module, "--instance", instance.id, "--config", CONFIG_DIR + "/node.yaml",
               "--engine", s.engine, "--model", f"{MODELS_DIR}/{instance.model}",
               "--scheduler", f"127.0.0.1:{s.scheduler_port}", "--port", str(port), "--metrics-port", str(metrics_port),
               *_internal_bind(s)]
    gpus = str(instance.tp)
    # Host memory for pinned KV buffers and weight loading scales with the GPUs; 2 CPU cores per GPU feed it.
    resources = {
        "requests": {"cpu": str(2 * instance.tp), "memory": f"{32 * instance.tp}Gi", GPU_RESOURCE: gpus},
        "limits": {"memory": f"{48 * instance.tp}Gi", GPU_RESOURCE: gpus},
    }
    name = container_name(instance)
    return _container(s, name, command, [(_port_name("g", name), port)], metrics_port, resources,
                      s.worker_startup_s, models=True, exec_cert="worker" if s.mtls else None)


def _volumes(s: K8sSettings) -> list[dict[str, Any]]:
    return [
        {"name": "config", "configMap": {"name": "octoserve-config"}},
        # Optional while mTLS is off (the pod starts without the Secret); required once the placement turns it on.
        {"name": "tls", "secret": {"secretName": s.tls_secret, "optional": not s.mtls, "defaultMode": 0o440}},
        {"name": "models", "persistentVolumeClaim": {"claimName": s.models_claim, "readOnly": True}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
    ]


def _node_statefulset(config: NodeConfig, nodes: int, s: K8sSettings) -> dict[str, Any]:
    labels = _labels("node")
    containers = [_scheduler(s), _router(s)] + [_worker(s, i, inst) for i, inst in enumerate(config.instances)]
    pod_spec = {
        "terminationGracePeriodSeconds": s.termination_grace_s,
        "securityContext": {"runAsNonRoot": True, "runAsUser": s.run_as_user, "fsGroup": s.run_as_user,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": labels}, "topologyKey": "kubernetes.io/hostname"}]}},
        "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
        "containers": containers,
        "volumes": _volumes(s),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": NODE_NAME, "labels": labels},
        "spec": {
            "serviceName": "octoserve-nodes",
            "replicas": nodes,
            "podManagementPolicy": "Parallel",  # nodes are independent; start them together
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels, "annotations": {
                    "prometheus.io/scrape": "true", "prometheus.io/port": str(s.first_metrics_port + 1),
                    "prometheus.io/path": "/metrics"}},
                "spec": pod_spec,
            },
        },
    }


def _picker_deployment(nodes: int, s: K8sSettings) -> dict[str, Any]:
    labels = _labels("picker")
    targets = ",".join(f"{NODE_NAME}-{i}.octoserve-nodes:{s.router_port}" for i in range(nodes))
    # --epp: the same port also speaks Envoy ext_proc, the Inference Extension's endpoint-picker protocol, and names
    # the node's HTTP port as the destination (the InferencePool's target port).
    command = ["python", "-m", "octoserve.services.cluster", "--nodes", targets, "--config", CONFIG_DIR + "/node.yaml",
               "--port", str(s.picker_port), "--metrics-port", str(s.picker_metrics_port), "--host", "0.0.0.0",
               "--epp", "--target-port", str(s.http_port)]
    resources = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
    container = _container(s, "picker", command, [("grpc", s.picker_port)], s.picker_metrics_port, resources, 60)
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] in ("config", "tls", "tmp")]
    container["ports"][-1]["name"] = "metrics"
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": PICKER_NAME, "labels": labels},
        "spec": {
            "replicas": s.picker_replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels, "annotations": {
                    "prometheus.io/scrape": "true", "prometheus.io/port": str(s.picker_metrics_port),
                    "prometheus.io/path": "/metrics"}},
                "spec": {
                    "terminationGracePeriodSeconds": s.termination_grace_s,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": s.run_as_user,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [container],
                    "volumes": [v for v in _volumes(s) if v["name"] in ("config", "tls", "tmp")],
                },
            },
        },
    }


def _service(name: str, component: str, ports: Sequence[tuple[str, int]], headless: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": _labels(component),
        "ports": [{"name": n, "port": p, "targetPort": n, "protocol": "TCP",
                   **({"appProtocol": "kubernetes.io/h2c"} if n.startswith("grpc") else {})} for n, p in ports],
    }
    if headless:
        spec |= {"clusterIP": "None", "publishNotReadyAddresses": False}
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": _labels(component)}, "spec": spec}


def _pdb(name: str, component: str) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "labels": _labels(component)},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _labels(component)}},
    }


def _configmap(config_text: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "octoserve-config", "labels": _labels("node")},
            "data": {"node.yaml": config_text}}


def manifests(config: NodeConfig, nodes: int, config_text: str, s: K8sSettings = K8sSettings()) -> list[dict[str, Any]]:
    """Every core-kind object, in apply order: config, nodes, their Services and budget, then the picker."""
    if nodes < 1:
        raise ValueError(f"--nodes must be at least 1, got {nodes}")
    public = [("grpc", s.router_port), ("http", s.http_port)]
    return [
        _configmap(config_text),
        _node_statefulset(config, nodes, s),
        _service("octoserve-nodes", "node", public, headless=True),
        _service("octoserve", "node", public),
        _pdb(NODE_NAME, "node"),
        _picker_deployment(nodes, s),
        _service(PICKER_NAME, "picker", [("grpc", s.picker_port), ("metrics", s.picker_metrics_port)]),
        _pdb(PICKER_NAME, "picker"),
    ]


def podmonitor(config: NodeConfig, s: K8sSettings = K8sSettings()) -> dict[str, Any]:
    """A Prometheus Operator PodMonitor scraping every container's metrics port of the node pods."""
    names = ["scheduler", "router"] + [container_name(i) for i in config.instances]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": APP, "labels": _labels("node")},
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/name": APP}},
            "podMetricsEndpoints": [{"port": _port_name("m", n), "path": "/metrics", "interval": "15s"} for n in names]
            + [{"port": "metrics", "path": "/metrics", "interval": "15s"}],
        },
    }


def inference_pool(s: K8sSettings = K8sSettings()) -> list[dict[str, Any]]:
    """The Gateway API Inference Extension objects: an InferencePool of the node pods (their OpenAI-compatible HTTP
    port) whose endpoint picker is the octoserve picker, and an HTTPRoute sending the gateway's traffic to it.
    CRD kinds (the Inference Extension's and Gateway API's), so they live in their own file: apply it where those
    CRDs and a gateway implementing the extension are installed, with the Gateway named `inference-gateway`."""
    pool = {
        "apiVersion": INFERENCE_API,
        "kind": "InferencePool",
        "metadata": {"name": APP, "labels": _labels("node")},
        "spec": {
            "selector": {"matchLabels": _labels("node")},
            "targetPorts": [{"number": s.http_port}],
            "endpointPickerRef": {"kind": "Service", "name": PICKER_NAME, "portNumber": s.picker_port,
                                  "failureMode": "FailClose"},
        },
    }
    route = {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": APP, "labels": _labels("node")},
        "spec": {
            "parentRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": GATEWAY_NAME}],
            "rules": [{
                "matches": [{"path": {"type": "PathPrefix", "value": "/v1/"}}],
                "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": APP}],
                "timeouts": {"request": "300s"},  # streamed generations outlive a default route timeout
            }],
        },
    }
    return [pool, route]


def _header(config_path: str, nodes: int) -> str:
    return (f"# Generated by `octoserve k8s --config {config_path} --nodes {nodes}`; do not edit by hand.\n"
            "# tests/test_k8s.py validates every object against the Kubernetes schemas and checks it against the "
            "placement.\n")


def render(docs: Sequence[Mapping[str, Any]], header: str) -> str:
    return header + yaml.safe_dump_all([dict(d) for d in docs], sort_keys=False, width=1000)


def render_files(config: NodeConfig, nodes: int, config_path: str, config_text: str,
                 s: K8sSettings = K8sSettings()) -> dict[str, str]:
    """File name -> text, for --out."""
    header = _header(config_path, nodes)
    return {MANIFEST_FILE: render(manifests(config, nodes, config_text, s), header),
            PODMONITOR_FILE: render([podmonitor(config, s)], header),
            INFERENCE_POOL_FILE: render(inference_pool(s), header)}


# --- checks against the placement ---------------------------------------------------------------------------


def _pod_containers(docs: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    sts = next((d for d in docs if d.get("kind") == "StatefulSet"), None)
    return [] if sts is None else sts["spec"]["template"]["spec"]["containers"]


def _gpus(container: Mapping[str, Any]) -> int:
    return int(container.get("resources", {}).get("limits", {}).get(GPU_RESOURCE, 0))


def _is_health_exec(probe: Mapping[str, Any], port: int | None) -> bool:
    """An exec probe running the standard health check (`octoserve.services.health`) on the container's own port."""
    command = probe.get("exec", {}).get("command", [])
    return (command[:3] == ["python", "-m", "octoserve.services.health"] and "--port" in command
            and command[command.index("--port") + 1:][:1] == [str(port)])


def check_manifests(docs: Sequence[Mapping[str, Any]], config: NodeConfig) -> list[str]:
    """Every mismatch between the node pod and the placement, each saying what to change."""
    containers = {c["name"]: c for c in _pod_containers(docs)}
    problems = [f"missing container {n!r}" for n in ("scheduler", "router") if n not in containers]
    for inst in config.instances:
        name = container_name(inst)
        if name not in containers:
            problems.append(f"instance {inst.id} has no container; add {name!r}")
        elif _gpus(containers[name]) != inst.tp:
            problems.append(f"{name}: requests {_gpus(containers[name])} GPUs, the placement gives {inst.id} {inst.tp}")
    extra = sorted(set(n for n in containers if n.startswith("worker-")) - {container_name(i) for i in config.instances})
    problems += [f"{n}: no instance of the placement runs here; remove it" for n in extra]
    total = sum(_gpus(c) for c in containers.values())
    if containers and total != config.num_gpus:
        problems.append(f"the node pod requests {total} GPUs, the placement uses {config.num_gpus}; one pod per node")
    seen: dict[Any, str] = {}
    for name, c in containers.items():
        for port in c.get("ports", []):
            for key in (port["containerPort"], port["name"]):
                if key in seen:
                    problems.append(f"port {key} is used by both {seen[key]} and {name}; rename the instance")
                seen.setdefault(key, name)
        own_port = c.get("ports", [{}])[0].get("containerPort")
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if "grpc" not in c.get(probe, {}) and not _is_health_exec(c.get(probe, {}), own_port):
                problems.append(f"{name}: add a gRPC {probe} (grpc.health.v1)")
        sc = c.get("securityContext", {})
        if not (sc.get("readOnlyRootFilesystem") and sc.get("runAsNonRoot")):
            problems.append(f"{name}: run as non-root with a read-only root filesystem")
    return problems


# --- command ------------------------------------------------------------------------------------------------


def mtls_from_sections(sections: Mapping[str, Any]) -> bool:
    """Whether the placement turns mTLS on; its certificates must then be where the pod mounts the Secret."""
    tls = sections.get("tls")
    if not tls:
        return False
    if tls.get("dir") != TLS_DIR:
        raise ValueError(f"tls.dir is {tls.get('dir')!r}; in the pods the Secret is mounted at {TLS_DIR}: set "
                         f"`tls: {{dir: {TLS_DIR}}}` in the placement")
    return True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=config_file, default=None,
                        help="node config YAML, the placement of every node (default: the embedded default placement)")
    parser.add_argument("--nodes", type=int, default=2, help="number of GPU nodes (pods, one per 8-GPU machine)")
    parser.add_argument("--out", default=DEFAULT_OUT_DIR, help="directory to write the manifests into; '-' for stdout")
    parser.add_argument("--image", default=DEFAULT_IMAGE, help="container image")
    parser.add_argument("--check", action="store_true", help="exit 1 when the files in --out differ from the generated ones")


def run(args: argparse.Namespace) -> int:
    """Write (or, with --check, compare) the manifests for the placement in --config and --nodes nodes."""
    from octoserve.services.config import default_config_text, load_node_config, load_service_sections

    config = load_node_config(args.config)  # None: the embedded default, so this runs from any directory
    config_text = default_config_text() if args.config is None else Path(args.config).read_text()
    problems = []
    try:
        settings = K8sSettings(image=args.image, mtls=mtls_from_sections(load_service_sections(args.config)))
        files = render_files(config, args.nodes, args.config or DEFAULT_CONFIG_PATH, config_text, settings)
    except ValueError as e:
        print(f"octoserve k8s: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if args.check:
        problems = [name for name, text in files.items() if not (out / name).exists() or (out / name).read_text() != text]
        for name in problems:
            if (out / name).exists():
                print(f"{out / name}: differs from the generator; regenerate it with the command in its header",
                      file=sys.stderr)
            else:
                print(f"{out / name}: missing; write it with `octoserve k8s --out {out}` and the same --config and "
                      "--nodes", file=sys.stderr)
        if not problems:
            print(f"{out}: up to date", file=sys.stderr)
        return 1 if problems else 0
    if args.out == "-":
        sys.stdout.write("".join(files.values()))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="octoserve k8s", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
