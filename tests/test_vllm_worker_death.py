"""A worker killed under the vllm engine (what `octoserve up --engine vllm` runs: scheduler, vLLM workers, router as
processes), mirroring tests/test_faults_live.py's sim-engine kill:

- with two instances, every greedy stream on the killed worker is continued on the other (prompt plus the tokens it
  had) and ends with exactly the tokens an uninterrupted run gives (the survivor's own run of the same prompts),
  usage counting the original prompt and every completion token; a stop string spanning a resumed stream's seam
  ends it where the uninterrupted run stops;
- with one instance (supervisor on), a stream that had tokens when its worker was SIGKILLed cannot be continued
  (no healthy instance): it ends UNAVAILABLE with a retry hint and the router's reason, short of its max_tokens;
  what it received is exactly the start of the model's greedy output (checked against the restarted worker: no
  token lost in the middle, none repeated);
- while the only instance is down, a new request is refused at once, RESOURCE_EXHAUSTED with a retry hint naming
  why (no healthy instance), not left waiting;
- the supervisor restarts the worker on its port, the router routes to it again, and every KV block is free after;
- the node then stops cleanly, the restarted worker included (exit codes all 0).

Engine budget: four vLLM starts in all (two instances, no restart; then one instance and its restart); no offline
reference run (a surviving or restarted worker's own greedy output is the reference).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import yaml

import grpc
import pytest
from vllm_fixtures import MODEL_NAME, PROMPTS, import_vllm_or_reason, vllm_skip_reason

from octoserve.services.node.launcher import REPO_ROOT, start_node
from octoserve.services.node.processes import group_members
from octoserve.v1 import generate_pb2 as gen_pb
from octoserve.v1 import generate_pb2_grpc as gen_grpc
from tests.fault_fixtures import Stream, access_log, load, until, wait_all_free

_SKIP = vllm_skip_reason()
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or ""),
              pytest.mark.asyncio(loop_scope="function")]

TINY_CONFIG = REPO_ROOT / "services" / "configs" / "tiny-vllm.yaml"
PROMPT = list(PROMPTS[0])  # 200 tokens
LONG = 600  # the longest prompt used (390) + 600 fits the 1,024-token window: ~2-3 s of streaming to kill in
SLO_MS = 10_000  # admission must not refuse on a slow, shared CPU
# A kill closes the worker's connections: the router's crash path. Its hang watchdog (a worker silent for 3 s) is
# not under test here, and on a loaded 2-core machine a vLLM worker's event loop can be starved that long: a stream
# moved off a stalled, live worker would leave the kill nothing of the router's to continue.
ROUTER_ARGS = ("--access-log", "all", "--hung-after-s", "60")
REFUSED = ("; the request had already streamed tokens, and continuing it on another instance was refused "
           f"({MODEL_NAME} is overloaded for STANDARD requests (no healthy instance serves it right now); retry after ")


@pytest.fixture
def model_dir(tmp_path_factory):
    if (reason := import_vllm_or_reason()) is not None:
        pytest.skip(reason)
    from octoserve.services.engine.test_model import build_test_model

    return build_test_model(tmp_path_factory.mktemp("tiny-llama"))


def request(max_tokens: int, prompt=PROMPT) -> gen_pb.GenerateRequest:
    return gen_pb.GenerateRequest(model=MODEL_NAME, token_ids=gen_pb.TokenIds(ids=prompt), max_tokens=max_tokens,
                                  ignore_eos=True, ttft_slo_ms=SLO_MS)


async def _kill_mid_stream(node, stub, worker) -> list[Stream]:
    """Four long streams, each with tokens at the client; then SIGKILL to the worker while vLLM still runs some of
    them (its own load report says so just before the kill). A machine so slow that the client sees its first tokens
    only after every stream finished on the worker tries again (bounded): the kill must land mid-stream."""
    for _ in range(3):
        streams = [Stream(request(LONG, prompt=list(PROMPTS[i]))) for i in range(4)]
        tasks = [asyncio.create_task(s.run(stub)) for s in streams]
        for s in streams:
            await asyncio.wait_for(s.first_token.wait(), 120)
        assert all(s.code is None or s.code == grpc.StatusCode.OK for s in streams), [s.details for s in streams]
        if (await load(worker.address)).num_running > 0:
            os.kill(worker.pid, signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            return streams
        await asyncio.gather(*tasks)  # all done on the worker already: again
    raise AssertionError("the worker finished every stream before it could be killed, three times")


async def test_vllm_worker_killed_mid_stream_fails_the_stream_then_is_restarted_and_serves(model_dir, tmp_path):
    node = start_node(str(TINY_CONFIG), engine="vllm", model_path=str(model_dir), run_dir=tmp_path,
                      startup_timeout_s=300.0, grace_s=10.0, router_args=ROUTER_ARGS, supervise=True,
                      extra_env={"OCTOSERVE_VLLM_DTYPE": "float32", "HF_HUB_OFFLINE": "1"})
    try:
        worker = node.workers["tiny-0"]
        old_pid = worker.pid
        async with grpc.aio.insecure_channel(node.router_address) as channel:
            stub = gen_grpc.GenerationStub(channel)
            streams = await _kill_mid_stream(node, stub, worker)

            # A stream still running: UNAVAILABLE, a retry hint, the router's reason, short of max_tokens. (One the
            # worker had finished before the kill is whole.)
            lost = [s for s in streams if s.code != grpc.StatusCode.OK]
            assert lost, [(s.code, len(s.tokens)) for s in streams]
            for s in streams:
                if s in lost:
                    assert s.code == grpc.StatusCode.UNAVAILABLE, (s.code, s.details)
                    assert s.details.startswith("token stream from tiny-0 failed: UNAVAILABLE ") and \
                        REFUSED in s.details and s.details.endswith(" ms): retry it"), s.details
                    assert s.retry_after_ms is not None and s.retry_after_ms > 0
                    assert 1 <= len(s.tokens) < LONG
                else:
                    assert len(s.tokens) == LONG

            # While the only instance is down: refused at once, with the reason and a hint that agree.
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in stub.Generate(request(4), timeout=30):
                    pass
            refusal = caught.value
            assert refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (refusal.code(), refusal.details())
            found = re.fullmatch(rf"{MODEL_NAME} is overloaded for STANDARD requests \(no healthy instance serves it "
                                 r"right now\); retry after (\d+) ms", refusal.details())
            assert found, refusal.details()
            assert int(dict(refusal.trailing_metadata())["retry-after-ms"]) == int(found[1]) > 0

            # Restarted on its port by the supervisor (a second vLLM start-up), and routed to again.
            await asyncio.to_thread(node.supervisor.wait_for, "worker:tiny-0", "ready", 1, 300)
            events = [(e.event, e.detail) for e in node.supervisor.events if e.service == "worker:tiny-0"]
            # vLLM's engine core can outlive a SIGKILLed worker; the supervisor kills what is left of the worker's
            # process group before the restart ("reaped"), so the new engine does not share the machine with it.
            reaped = [("reaped", "killed what the exited process left running in its process group")]
            assert events in ([("exited", f"exit code {-signal.SIGKILL}"), *extra,
                               ("restarting", f"port {worker.port}, restart 1 in a row"),
                               ("ready", f"pid {worker.pid} port {worker.port}")] for extra in (reaped, [])), events
            assert worker.pid != old_pid
            await until(lambda: not group_members(old_pid), 10, "the killed worker's process group is gone")

            async def served() -> bool:
                probe = Stream(request(2, prompt=list(PROMPTS[7])))
                await probe.run(stub, timeout_s=60)
                return probe.code == grpc.StatusCode.OK
            await until(served, 120, "the restarted worker serves through the router")

            # What a killed stream received is the start of its greedy output: nothing lost, nothing repeated.
            s = lost[0]
            again = Stream(request(len(s.tokens) + 8, prompt=list(s.request.token_ids.ids)))
            await again.run(stub, timeout_s=120)
            assert (again.code, len(again.tokens)) == (grpc.StatusCode.OK, len(s.tokens) + 8), again.details
            assert again.tokens[:len(s.tokens)] == s.tokens
            await wait_all_free(node, timeout_s=60)
        assert node.supervisor.restarts("worker:tiny-0") == 1
    finally:
        codes = node.stop()
    assert codes == {"router": 0, "worker:tiny-0": 0, "scheduler": 0}


def _what_the_streams_saw(victim: str, killed: tuple, streams: list[Stream], log: dict) -> str:
    """A failure message: when and where the kill landed, and each stream's end as the client and the router saw it."""
    at, running, tokens = killed
    lines = [f"{victim} killed at {at:.3f} (running per instance {running}, client tokens per stream {tokens})"]
    for s in streams:
        line = log.get(s.request_id, {})
        router = {k: line.get(k) for k in ("ts", "instances", "outcome", "code", "tokens_out", "reason",
                                           "continued_causes")}
        lines.append(f"{s.request_id}: {s.code} {s.details!r} {len(s.tokens)} tokens; router: {router}")
    return "\n".join(lines)


def _two_instances() -> dict:
    config = yaml.safe_load(TINY_CONFIG.read_text())
    config["num_gpus"] = 2
    config["instances"].append({**config["instances"][0], "id": "tiny-1", "gpu_ids": [1]})
    return config


async def _stop_across_a_seam(stub, model_dir, tokens: list[int]) -> tuple[Stream, Stream]:
    """A stop string of two characters, the last of token k-1's text and the first of token k's, at the first k where
    it first occurs there in the whole greedy text; then the uninterrupted request with it, and the same request
    resumed from the first k tokens (its prompt ends with them: vLLM's own stop check cannot see the seam)."""
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(str(model_dir))

    def text(ids) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=True)
    whole = text(tokens)
    for k in range(4, len(tokens) - 1):
        before, after = text(tokens[:k]), text(tokens[:k + 1])
        if before and len(after) > len(before) and after.startswith(before):
            stop = before[-1] + after[len(before)]
            if whole.find(stop) == len(before) - 1:
                break
    else:
        raise AssertionError("no token boundary whose two characters occur first there")
    plain = Stream(gen_pb.GenerateRequest(model=MODEL_NAME, token_ids=gen_pb.TokenIds(ids=PROMPT), max_tokens=LONG,
                                          ignore_eos=True, ttft_slo_ms=SLO_MS, stop=[stop]))
    resumed = Stream(gen_pb.GenerateRequest(model=MODEL_NAME, token_ids=gen_pb.TokenIds(ids=PROMPT), max_tokens=LONG,
                                            ignore_eos=True, ttft_slo_ms=SLO_MS, stop=[stop],
                                            resume_from=gen_pb.TokenIds(ids=tokens[:k])))
    await plain.run(stub)
    await resumed.run(stub)
    return plain, resumed


async def test_vllm_streams_on_a_killed_worker_continue_on_the_other_with_the_uninterrupted_greedy_tokens(
        model_dir, tmp_path):
    node = start_node(_two_instances(), engine="vllm", model_path=str(model_dir), run_dir=tmp_path,
                      startup_timeout_s=300.0, grace_s=10.0, router_args=ROUTER_ARGS, supervise=False,
                      extra_env={"OCTOSERVE_VLLM_DTYPE": "float32", "HF_HUB_OFFLINE": "1"})
    try:
        async with grpc.aio.insecure_channel(node.router_address) as channel:
            stub = gen_grpc.GenerationStub(channel)
            victim = None
            for _ in range(3):  # bounded: a machine so slow every stream ended before the kill tries again
                streams = [Stream(request(LONG, prompt=list(PROMPTS[i]))) for i in range(4)]
                tasks = [asyncio.create_task(s.run(stub)) for s in streams]
                await until(lambda: all(len(s.tokens) >= 8 or s.code is not None for s in streams), 120,
                            "every stream has tokens")
                running = {iid: (await load(sp.address)).num_running for iid, sp in node.workers.items()}
                busiest = max(sorted(running), key=lambda iid: running[iid])
                if running[busiest] > 0:
                    victim = busiest
                    os.kill(node.workers[victim].pid, signal.SIGKILL)
                    killed = (time.time(), running, [len(s.tokens) for s in streams])
                    await asyncio.wait_for(asyncio.gather(*tasks), 180)
                    break
                await asyncio.gather(*tasks)
            assert victim is not None, "the workers finished every stream before one could be killed, three times"
            survivor = next(iid for iid in node.workers if iid != victim)

            # The same prompts, uninterrupted, on the survivor (the killed worker is not restarted here).
            reference = [Stream(request(LONG, prompt=list(PROMPTS[i]))) for i in range(4)]
            await asyncio.wait_for(asyncio.gather(*(r.run(stub) for r in reference)), 180)
            plain, resumed = await _stop_across_a_seam(stub, model_dir, reference[0].tokens)
        log = access_log(node, wait_for=[*streams, *reference])
        assert all(log[r.request_id]["instances"] == [survivor] for r in reference)
        continued = [s for s in streams if log[s.request_id].get("continued")]
        assert continued, _what_the_streams_saw(victim, killed, streams, log)
        for s, r in zip(streams, reference):
            assert (s.code, r.code) == (grpc.StatusCode.OK, grpc.StatusCode.OK), (s.details, r.details)
            assert len(s.tokens) == LONG and s.tokens == r.tokens, s.request_id
            assert s.usage == r.usage == (len(s.request.token_ids.ids), LONG)
        for s in continued:
            line = log[s.request_id]
            assert (line["instances"], line["continued_causes"]) == ([victim, survivor], ["crash"]), line
        # A stop string spanning the seam of a resumed stream ends it where the uninterrupted run stops.
        k = len(resumed.request.resume_from.ids)
        assert (plain.code, plain.tokens, plain.usage) == (grpc.StatusCode.OK, reference[0].tokens[:k + 1],
                                                           (len(PROMPT), k + 1)), plain.details
        assert (resumed.code, resumed.tokens, resumed.usage) == (grpc.StatusCode.OK, reference[0].tokens[k:k + 1],
                                                                 (len(PROMPT), k + 1)), resumed.details
    finally:
        codes = node.stop()
    assert {k: v for k, v in codes.items() if k != f"worker:{victim}"} == {
        "router": 0, f"worker:{survivor}": 0, "scheduler": 0}
