"""A live vLLM worker changes role through its `SetRole` RPC without a restart, on the same running engine.

One worker process (`octoserve.decode_worker --engine vllm --flippable`, the tiny Llama, colocated) on 127.0.0.1,
driven over gRPC: three requests run, SetRole(PREFILL) drains them (each finishes with all its tokens), the worker
then serves a Prefill and refuses a Generate as the wrong role; SetRole(COLOCATED) flips it back and a Generate is
served again. The process and its vLLM engine-core child are the same throughout (the engine was neither stopped
nor started). Engine budget: one vLLM instance, shared by the module's tests (`_Engines`): one engine start in
file order.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
import pytest
from vllm_fixtures import PROMPTS, import_vllm_or_reason, vllm_skip_reason

from octoserve.services.core.types import FinishReason, RequestSpec, Role, SamplingParams
from octoserve.services.node.launcher import WORKER_MODULES
from octoserve.services.node.processes import REPO_ROOT, spawn, wait_ready
from octoserve.services.rpc import convert
from octoserve.services.rpc.gen import worker_pb2 as w_pb
from octoserve.services.rpc.gen import worker_pb2_grpc as w_grpc

_SKIP = vllm_skip_reason()
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]

TINY_CONFIG = REPO_ROOT / "services" / "configs" / "tiny-vllm.yaml"  # tiny-0: colocated
MODEL = "tiny-llama"
MAX_TOKENS = 384  # a request's output; its prompt + this <= 1,024 (the engine's max_model_len) for every prompt used
# The three requests that must still run when the next RPC arrives: ~4 s of decoding at three a step. 96 tokens once
# finished before the drain began on a loaded machine, and 384 did once too (the vLLM phase beside the live tests: one
# of three done before SetRole arrived, the drain then took 2.4 s for the other two). Prompts 0-2 + this <= 1,024.
LONG_MAX_TOKENS = 700


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if (reason := import_vllm_or_reason()) is not None:
        pytest.skip(reason)
    from octoserve.services.engine.test_model import build_test_model

    return build_test_model(tmp_path_factory.mktemp("tiny-llama"))


class _Engines:
    """The module's one worker process (and vLLM engine), started on first use and shared by the tests.

    Each test gets it in a known state: colocated, resumed, nothing running, waiting or reserved, every KV block free
    (`_restore` after every test). A test that ends the process (the role flip test checks a clean SIGTERM exit) or
    leaves it in a state `_restore` cannot undo gets a fresh worker for the next test, so every test passes alone
    and in any order; in file order the module starts one engine."""

    def __init__(self, model_dir: Path, tmp_path_factory) -> None:
        self.model_dir, self.tmp_path_factory = model_dir, tmp_path_factory
        self.sp = None
        self.kv_dir: Path | None = None
        self.starts = 0

    def get(self):
        if self.sp is None or self.sp.proc.poll() is not None:
            self.stop()
            run_dir = self.tmp_path_factory.mktemp("worker")
            self.kv_dir = run_dir / "kv"
            env = {**os.environ, "OCTOSERVE_VLLM_DTYPE": "float32", "HF_HUB_OFFLINE": "1",
                   "VLLM_CPU_KVCACHE_SPACE": "1", "OCTOSERVE_KV_DIR": str(self.kv_dir)}
            args = ["--config", str(TINY_CONFIG), "--instance", "tiny-0", "--engine", "vllm", "--model",
                    str(self.model_dir), "--flippable", "--port", "0", "--grace-s", "10"]
            self.sp = spawn("worker:tiny-0", WORKER_MODULES[Role.COLOCATED], args, run_dir, env)
            self.starts += 1
            try:
                wait_ready(self.sp, time.monotonic() + 300.0)
            except BaseException:
                self.stop()
                raise
        return self.sp

    def restore_or_stop(self) -> None:
        """After a test: the worker back to the known state, or stopped (the next test starts a fresh one)."""
        if self.sp is None or self.sp.proc.poll() is not None:
            return
        try:
            clean = asyncio.run(_restore(self.sp.address))
        except Exception:
            clean = False
        if not clean:
            self.stop()

    def stop(self) -> None:
        sp, self.sp = self.sp, None
        if sp is not None and sp.proc.poll() is None:
            sp.proc.send_signal(signal.SIGTERM)  # this process only, by its PID
            try:
                sp.proc.wait(timeout=60)
            except Exception:
                sp.proc.kill()
                sp.proc.wait()


def _is_known_state(load) -> bool:
    return (load.role == convert.ROLE_TO_PB[Role.COLOCATED] and not load.paused and load.healthy
            and (load.num_running, load.num_waiting, load.num_reserved) == (0, 0, 0)
            and load.num_free_blocks == load.num_total_blocks)


async def _restore(address: str, timeout_s: float = 60.0) -> bool:
    """Resume, back to colocated (draining what still runs), then wait for nothing running and every KV block
    free; True once the worker is in that state, False if it is not by the deadline."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = w_grpc.WorkerStub(channel)
        load = await stub.GetLoad(w_pb.GetLoadRequest(), timeout=30)
        if load.paused:
            await stub.Resume(w_pb.ResumeRequest(), timeout=30)
        if load.role != convert.ROLE_TO_PB[Role.COLOCATED]:
            await stub.SetRole(w_pb.SetRoleRequest(role=convert.ROLE_TO_PB[Role.COLOCATED], drain_timeout_ms=30_000),
                               timeout=60)
        deadline = time.monotonic() + timeout_s
        while not _is_known_state(load := await stub.GetLoad(w_pb.GetLoadRequest(), timeout=30)):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.2)
        return True


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory):
    e = _Engines(model_dir, tmp_path_factory)
    try:
        yield e
    finally:
        e.stop()
        print(f"\n{__name__}: {e.starts} vLLM engine start(s)")


@pytest.fixture
def worker(engines):
    sp = engines.get()
    assert _is_known_state(asyncio.run(_get_load(sp.address)))  # what every test starts from
    try:
        yield sp
    finally:
        engines.restore_or_stop()


async def _get_load(address: str):
    async with grpc.aio.insecure_channel(address) as channel:
        return await w_grpc.WorkerStub(channel).GetLoad(w_pb.GetLoadRequest(), timeout=30)


def children(pid: int) -> set[int]:
    """The child processes of `pid` (the vLLM engine core among them)."""
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out |= {int(c) for c in (task / "children").read_text().split()}
    return out


def spec_pb(request_id: str, prompt, max_tokens: int = MAX_TOKENS):
    spec = RequestSpec(request_id, MODEL, tuple(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       arrival_s=time.monotonic(), ttft_slo_ms=60_000)
    return convert.spec_to_pb(spec)


async def attach(stub, session_id: str):
    call = stub.Attach(w_pb.AttachRequest(session_id=session_id))
    stream = call.__aiter__()
    assert (await stream.__anext__()).seq == 0
    return call, stream


async def read_until_finished(stream, request_ids: set[str]) -> dict[str, list]:
    """request_id -> its deltas, until every one of them finished."""
    deltas: dict[str, list] = {i: [] for i in request_ids}
    open_ids = set(request_ids)
    while open_ids:
        batch = await asyncio.wait_for(stream.__anext__(), timeout=120)
        for d in batch.deltas:
            deltas[d.request_id].append(d)
            if d.finish_reason:
                open_ids.discard(d.request_id)
    return deltas


def assert_complete(deltas: dict[str, list], prompts: dict[str, tuple], max_tokens: int = MAX_TOKENS) -> None:
    for rid, ds in deltas.items():
        last = ds[-1]
        assert (last.error_code, last.error_message) == (0, ""), rid
        assert convert.FINISH_FROM_PB[last.finish_reason] is FinishReason.LENGTH, rid
        assert sum(len(d.token_ids) for d in ds) == max_tokens, rid
        assert (last.num_output_tokens, last.num_prompt_tokens) == (max_tokens, len(prompts[rid])), rid


async def generate_three(stub, session_id: str, prefix: str) -> dict[str, tuple]:
    """Three long Generates on the session (still running when the next RPC arrives); request_id -> prompt."""
    prompts = {f"{prefix}{k}": PROMPTS[k] for k in range(3)}
    for rid, prompt in prompts.items():
        await stub.Generate(w_pb.WorkerGenerateRequest(session_id=session_id,
                                                        spec=spec_pb(rid, prompt, LONG_MAX_TOKENS)))
    return prompts


async def _in_place_under_load(address: str, pid: int) -> None:
    engine_children = children(pid)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = w_grpc.WorkerStub(channel)
        call, stream = await attach(stub, "inplace")
        prompts = await generate_three(stub, "inplace", "i")
        reading = asyncio.create_task(read_until_finished(stream, set(prompts)))
        # Colocated -> decode in place while the three run: nothing drains, the reply comes before they finish.
        reply = await stub.SetRole(w_pb.SetRoleRequest(role=convert.ROLE_TO_PB[Role.DECODE], in_place=True), timeout=30)
        assert (reply.drained_requests, reply.drain_s, reply.migrated_requests) == (0, 0.0, 0)
        assert not reading.done()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Generate(w_pb.WorkerGenerateRequest(session_id="inplace", spec=spec_pb("g1", PROMPTS[3])))
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE
        assert info.value.details() == "tiny-0 now serves the decode role; route elsewhere (the placement changed)"
        # The three stream on over the same session to their last token.
        assert_complete(await reading, prompts, LONG_MAX_TOKENS)
        # A prefill role cannot be reached in place: refused, naming what to send, and nothing changed.
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await stub.SetRole(w_pb.SetRoleRequest(role=convert.ROLE_TO_PB[Role.PREFILL], in_place=True), timeout=30)
        assert bad.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert bad.value.details() == ("only decode <-> colocated changes run in place, not decode -> prefill; "
                                       "send in_place false to drain")
        # Back to colocated in place: a Generate is served again on the same session.
        await stub.SetRole(w_pb.SetRoleRequest(role=convert.ROLE_TO_PB[Role.COLOCATED], in_place=True), timeout=30)
        await stub.Generate(w_pb.WorkerGenerateRequest(session_id="inplace", spec=spec_pb("c1", PROMPTS[4])))
        assert_complete(await read_until_finished(stream, {"c1"}), {"c1": PROMPTS[4]})
        call.cancel()
        assert children(pid) == engine_children  # the same engine core throughout


def test_vllm_worker_changes_role_in_place_while_its_requests_run(worker):
    pid = worker.pid
    asyncio.run(_in_place_under_load(worker.address, pid))
    assert worker.proc.poll() is None and worker.pid == pid


async def _flip_under_load(address: str, pid: int, kv_dir: Path) -> None:
    engine_children = children(pid)
    assert engine_children, "the vLLM engine core runs as a child of the worker process"
    async with grpc.aio.insecure_channel(address) as channel:
        stub = w_grpc.WorkerStub(channel)
        call, stream = await attach(stub, "flip")
        prompts = await generate_three(stub, "flip", "r")
        reply, deltas = await asyncio.gather(
            stub.SetRole(w_pb.SetRoleRequest(role=convert.ROLE_TO_PB[Role.PREFILL], drain_timeout_ms=120_000),
                         timeout=180),
            read_until_finished(stream, set(prompts)),
        )
        call.cancel()
        assert reply.drained_requests == 3  # all three were running when the drain began ...
        assert_complete(deltas, prompts, LONG_MAX_TOKENS)  # ... and each finished with its full token count

        # Now a prefill worker, same process, same engine core: a Prefill is served, a Generate is the wrong role.
        assert children(pid) == engine_children
        spec = spec_pb("p0", PROMPTS[3])
        handoff = (await stub.Prefill(w_pb.PrefillRequest(spec=spec), timeout=120)).handoff
        assert (handoff.request_id, handoff.num_prompt_tokens, handoff.source_instance_id) == (
            "p0", len(PROMPTS[3]), "tiny-0")
        await stub.Release(w_pb.ReleaseRequest(request_id="p0"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Generate(w_pb.WorkerGenerateRequest(session_id="flip", spec=spec_pb("g0", PROMPTS[0])))
        # A Generate for the role it no longer serves is sent back to the router to place elsewhere (no token yet).
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE
        assert info.value.details() == "tiny-0 now serves the prefill role; route elsewhere (the placement changed)"

        # And back to colocated, still on the same engine: a Generate is served with all its tokens.
        back = await stub.SetRole(w_pb.SetRoleRequest(role=convert.ROLE_TO_PB[Role.COLOCATED]), timeout=60)
        assert back.drained_requests == 0
        call, stream = await attach(stub, "back")
        await stub.Generate(w_pb.WorkerGenerateRequest(session_id="back", spec=spec_pb("c0", PROMPTS[4])))
        assert_complete(await read_until_finished(stream, {"c0"}), {"c0": PROMPTS[4]})
        call.cancel()
        assert children(pid) == engine_children
    # A flippable engine's connector stores every prompt's KV it computes: what the colocated requests stored and
    # the released hand-off are gone from the model's folder, nothing piles up on disk.
    assert sorted(p.name for p in (kv_dir / MODEL).iterdir()) == []


# Last in the file: it ends the worker (a clean SIGTERM exit is part of what it checks), so the tests before it share
# one engine; run alone or in another order, the next test gets a fresh worker.
def test_vllm_worker_flips_role_by_set_role_on_the_same_engine(worker, engines):
    pid = worker.pid
    asyncio.run(_flip_under_load(worker.address, pid, engines.kv_dir))
    assert worker.proc.poll() is None and worker.pid == pid  # no restart
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.proc.wait(timeout=60) == 0
