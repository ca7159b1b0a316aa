"""Shared pieces of the service tests: a small node config and an in-process node on 127.0.0.1.

The in-process node runs the real servicers, the real SimEngine and the real router over real gRPC sockets in the
test's event loop (cheap on a 2-core machine); the process-level tests (`start_node`) cover the launcher, the
scheduler's placement and SIGTERM drain.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from octoserve.decode_worker.servicer import DecodeWorkerServicer
from octoserve.prefill_worker.servicer import PrefillWorkerServicer
from octoserve.router.app import router_spec
from octoserve.router.servicer import GenerationServicer, RouterSettings
from octoserve.services.core.placement import NodeConfig, node_config_from_dict
from octoserve.services.core.types import Role
from octoserve.services.engine.factory import make_engine
from octoserve.v1 import generate_pb2 as gen_pb
from octoserve.v1 import generate_pb2_grpc as gen_grpc
from octoserve.services.rpc.gen import worker_pb2 as w_pb
from octoserve.services.rpc.gen import worker_pb2_grpc as w_grpc
from octoserve.services.rpc.server import RunningService, ServiceSpec, start_service
from octoserve.services.rpc.hardening import add_servicer
from octoserve.services.rpc.worker_main import WORKER_SERVICE

WORKER_DESCRIPTOR = w_pb.DESCRIPTOR.services_by_name["Worker"]

COLOCATED_MODEL = "llama-3-8b"
DISAGG_MODEL = "llama-3-8b-pd"
NUM_KV_BLOCKS = 703  # what gpu_memory_utilization 0.22 leaves an 8B on an H100 (exact: the sizing is pure)
MAX_CONTEXT = 16384  # so a valid prompt (12,000 tokens = 750 blocks) can exceed every instance's KV


def small_config_dict() -> dict:
    """One colocated 8B and one disaggregated 8B (prefill + decode), each instance with 703 KV blocks."""
    inst = {"tp": 1, "gpu_memory_utilization": 0.22}
    return {
        "gpu": "h100-sxm-80gb",
        "num_gpus": 8,
        "models": {
            COLOCATED_MODEL: {"preset": "llama-3-8b", "max_context_len": MAX_CONTEXT},
            DISAGG_MODEL: {"preset": "llama-3-8b", "max_context_len": MAX_CONTEXT},
        },
        "instances": [
            {"id": "c0", "model": COLOCATED_MODEL, "role": "colocated", "gpu_ids": [0], **inst},
            {"id": "p0", "model": DISAGG_MODEL, "role": "prefill", "gpu_ids": [1], "max_num_batched_tokens": 2048, **inst},
            {"id": "d0", "model": DISAGG_MODEL, "role": "decode", "gpu_ids": [2], **inst},
        ],
    }


def small_config() -> NodeConfig:
    return node_config_from_dict(small_config_dict())


def request(model: str = COLOCATED_MODEL, *, num_prompt_tokens: int = 32, max_tokens: int = 8, **kw):
    """A GenerateRequest with a deterministic token prompt; ignore_eos so max_tokens is exact."""
    prompt = gen_pb.TokenIds(ids=[100 + i for i in range(num_prompt_tokens)])
    kw.setdefault("ignore_eos", True)
    return gen_pb.GenerateRequest(model=model, token_ids=prompt, max_tokens=max_tokens, **kw)


@dataclass
class InProcessNode:
    config: NodeConfig
    router: RunningService
    router_servicer: GenerationServicer
    workers: dict[str, RunningService]
    servicers: dict[str, object]
    channels: list[grpc.aio.Channel] = field(default_factory=list)

    def channel(self, address: str | None = None, options=()) -> grpc.aio.Channel:
        ch = grpc.aio.insecure_channel(address or self.router.address, options=options)
        self.channels.append(ch)
        return ch

    def generation(self, options=()) -> gen_grpc.GenerationStub:
        return gen_grpc.GenerationStub(self.channel(options=options))

    def worker(self, instance_id: str) -> w_grpc.WorkerStub:
        return w_grpc.WorkerStub(self.channel(self.workers[instance_id].address))

    async def load(self, instance_id: str) -> w_pb.LoadReport:
        return await self.worker(instance_id).GetLoad(w_pb.GetLoadRequest(), timeout=5.0)

    async def wait_all_free(self, timeout_s: float = 10.0) -> dict[str, int]:
        """Polls every worker's load until every KV block is free and nothing runs (bounded)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            loads = {iid: await self.load(iid) for iid in self.workers}
            if all(l.num_free_blocks == l.num_total_blocks and l.num_running == 0 and l.num_waiting == 0
                   for l in loads.values()):
                return {iid: l.num_free_blocks for iid, l in loads.items()}
            if loop.time() > deadline:
                raise AssertionError(f"KV not freed within {timeout_s} s: {loads}")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        for ch in self.channels:
            await ch.close()
        await self.router.shutdown()
        for running in self.workers.values():
            await running.shutdown()


async def start_inprocess_node(config: NodeConfig | None = None, *, time_scale: float = 1.0,
                               settings: RouterSettings | None = None, grace_s: float = 5.0) -> InProcessNode:
    config = config or small_config()
    workers, servicers = await start_workers(config, time_scale=time_scale, grace_s=grace_s)
    endpoints = {iid: running.address for iid, running in workers.items()}

    async def get_endpoints():
        return endpoints

    spec, router_servicer = router_spec(config, get_endpoints, settings=settings or RouterSettings(time_scale=time_scale),
                                        metrics_port=None, grace_s=grace_s, startup_timeout_s=20.0)
    router = await start_service(spec)
    return InProcessNode(config, router, router_servicer, workers, servicers)


async def start_workers(config: NodeConfig, *, time_scale: float = 1.0,
                        grace_s: float = 5.0) -> tuple[dict[str, RunningService], dict[str, object]]:
    """One sim-engine worker service per instance of `config`, on 127.0.0.1: (services, servicers) by id."""
    workers, servicers = {}, {}
    for inst in config.instances:
        engine = make_engine(config, inst.id, engine="sim", time_scale=time_scale)
        servicer = (PrefillWorkerServicer if inst.role is Role.PREFILL else DecodeWorkerServicer)(engine)
        servicer.model_spec = config.models[inst.model]
        spec = ServiceSpec(
            name=f"worker:{inst.id}", metrics_port=None, grace_s=grace_s, service_names=(WORKER_SERVICE,),
            add_servicers=lambda server, s=servicer: add_servicer(s, WORKER_DESCRIPTOR, server),
            start=servicer.start, drain=servicer.drain, close=servicer.close, registry=servicer.metrics.registry,
        )
        workers[inst.id] = await start_service(spec)
        servicers[inst.id] = servicer
    return workers, servicers


async def collect(call) -> list[gen_pb.GenerateResponse]:
    return [response async for response in call]
