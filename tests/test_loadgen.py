"""`octoserve bench` against a real grpc.aio server on 127.0.0.1.

`TokenServer` is a deterministic Generation peer: it streams exactly the requested output length in messages
of up to `chunk_tokens` tokens, refuses BATCH-tier requests and one model with RESOURCE_EXHAUSTED + RetryInfo,
fails another model with INTERNAL, and holds chosen request ids open forever (to exercise the drain timeout).
So every record's outcome and token count is known in advance and asserted exactly.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
from dataclasses import dataclass, field

import grpc
import grpc.aio
import pytest
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from octoserve.services.core.types import Priority
from octoserve.services.loadgen import (
    DRAIN_TIMEOUT,
    SIM_OUTPUT_LEN_KEY,
    BenchOptions,
    add_arguments,
    count_ignored_hints,
    run,
    run_bench,
)
from octoserve.services.metrics import SloSpec, summarize
from octoserve.v1 import generate_pb2 as pb
from octoserve.v1 import generate_pb2_grpc as pb_grpc
from octoserve.services.workload import PROFILES, TraceRequest, generate_trace, scaled

REFUSE_MS = 400
CACHED_TOKENS = 16


def _refusal_trailers() -> tuple:
    status = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message="shed")
    status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(nanos=REFUSE_MS * 10**6)))
    return (("grpc-status-details-bin", status.SerializeToString()),)


@dataclass
class TokenServer(pb_grpc.GenerationServicer):
    refuse_model: str = "llama-3-70b-refused"
    broken_model: str = "broken"
    infeasible_model: str = "llama-3-70b-infeasible"
    hang_ids: frozenset = frozenset()
    chunk_tokens: int = 2
    requests: list = field(default_factory=list)  # (request, metadata dict, peer)
    cancelled: list = field(default_factory=list)
    any_cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    async def ListModels(self, request, context):  # `octoserve bench` checks the workload's models first
        return pb.ListModelsResponse(models=[pb.Model(name=name, state=pb.READY, num_instances=1)
                                             for name in ("llama-3-8b", "llama-3-70b")])

    async def Generate(self, request, context):
        metadata = dict(context.invocation_metadata())
        self.requests.append((request, metadata, context.peer()))
        if request.priority == pb.BATCH or request.model == self.refuse_model:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "shed", trailing_metadata=_refusal_trailers())
        if request.model == self.infeasible_model:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the prompt alone takes 300 ms, over its SLO")
        if request.model == self.broken_model:
            await context.abort(grpc.StatusCode.INTERNAL, "worker lost")
        if request.request_id in self.hang_ids:
            yield pb.GenerateResponse(token_ids=[1], request_id=request.request_id)
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append(request.request_id)
                self.any_cancelled.set()
                raise
        n = int(metadata.get(SIM_OUTPUT_LEN_KEY, request.max_tokens))
        for start in range(0, n, self.chunk_tokens):
            yield pb.GenerateResponse(token_ids=range(start, min(n, start + self.chunk_tokens)),
                                      request_id=request.request_id if start == 0 else "")
        yield pb.GenerateResponse(finish_reason=pb.STOP, usage=pb.Usage(
            prompt_tokens=len(request.token_ids.ids), completion_tokens=n, cached_prompt_tokens=CACHED_TOKENS))


@contextlib.asynccontextmanager
async def serve(servicer):
    server = grpc.aio.server()
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=None)


def trace_req(i: int, arrival_s: float, model="llama-3-8b", output_len=5, priority=Priority.STANDARD) -> TraceRequest:
    return TraceRequest(f"r{i:07d}", arrival_s, model, tuple(range(1000, 1000 + 20 + i)), output_len,
                        4 * output_len, priority, 250.0)


HAND_TRACE = [
    trace_req(0, 0.000, output_len=5),
    trace_req(1, 0.002, model="llama-3-70b", output_len=3),
    trace_req(2, 0.004, priority=Priority.BATCH),
    trace_req(3, 0.006, output_len=1, priority=Priority.INTERACTIVE),
    trace_req(4, 0.008, priority=Priority.BATCH),
    trace_req(5, 0.010, model="broken"),
]


async def test_records_one_per_request_with_exact_outcomes():
    server = TokenServer()
    async with serve(server) as target:
        records = await run_bench(target, HAND_TRACE, time_scale=2.0)
    assert [r.request_id for r in records] == [t.request_id for t in HAND_TRACE]
    assert [r.refused for r in records] == [False, False, True, False, True, False]
    assert [r.num_output_tokens for r in records] == [5, 3, 0, 1, 0, 0]
    assert [r.retry_after_ms for r in records] == [None, None, REFUSE_MS / 2.0, None, REFUSE_MS / 2.0, None]
    assert records[5].error == "INTERNAL: worker lost" and all(not r.error for r in records[:5])
    done = records[0]
    # 5 tokens in messages of 2: times come in equal pairs, then a single
    assert done.token_times_s[0] == done.token_times_s[1] and done.token_times_s[2] == done.token_times_s[3]
    assert done.first_token_s == done.token_times_s[0] <= done.finish_s
    assert (done.num_prompt_tokens, done.num_cached_prompt_tokens) == (20, CACHED_TOKENS)
    for record, req in zip(records, HAND_TRACE):
        assert record.arrival_s >= req.arrival_s  # never sent early (modelled clock)
        assert (record.model, record.priority, record.ttft_slo_ms) == (req.model, req.priority, req.ttft_slo_ms)
    summary = summarize(records, SloSpec(), duration_s=0.01)
    o = summary.overall
    assert (o.num_offered, o.num_refused, o.num_completed, o.num_errors) == (6, 2, 3, 1)


async def test_a_prompt_no_idle_instance_serves_in_time_is_a_refusal_without_a_hint():
    # FAILED_PRECONDITION (SloInfeasible / ItlInfeasible) is refused at admission, as the simulator records it: not
    # an error of an admitted request, and with no retry hint (retrying cannot help).
    trace = [trace_req(0, 0.0, model="llama-3-70b-infeasible"), trace_req(1, 0.001)]
    async with serve(TokenServer()) as target:
        records = await run_bench(target, trace, time_scale=1.0)
    assert [(r.refused, r.retry_after_ms, r.error) for r in records] == [(True, None, ""), (False, None, "")]
    o = summarize(records, SloSpec(), duration_s=0.01).overall
    assert (o.num_offered, o.num_refused, o.num_completed, o.num_errors) == (2, 1, 1, 0)


async def test_wire_requests_carry_the_trace():
    server = TokenServer()
    async with serve(server) as target:
        await run_bench(target, HAND_TRACE[:2], time_scale=1.0)
        await run_bench(target, HAND_TRACE[:1], time_scale=1.0, options=BenchOptions(output_len_mode="max-tokens"))
    (exact, exact_meta, _) = server.requests[-1]
    by_id = {request.request_id: (request, meta) for request, meta, _ in server.requests[:2]}
    (first, meta), (second, _) = by_id["r0000000"], by_id["r0000001"]
    assert list(first.token_ids.ids) == list(HAND_TRACE[0].prompt_token_ids)
    assert (first.request_id, first.max_tokens, first.ttft_slo_ms, first.priority) == ("r0000000", 20, 250, pb.STANDARD)
    assert meta[SIM_OUTPUT_LEN_KEY] == "5" and second.model == "llama-3-70b"
    assert (exact.max_tokens, exact.ignore_eos, SIM_OUTPUT_LEN_KEY in exact_meta) == (5, True, False)


async def test_generated_trace_counts_refusals_exactly():
    trace = generate_trace(scaled(PROFILES["seed-000"], rate_rps=400.0, duration_s=0.1), seed=5)
    server = TokenServer(refuse_model="llama-3-70b", chunk_tokens=64)
    async with serve(server) as target:
        records = await run_bench(target, trace, time_scale=1.0, options=BenchOptions(num_channels=3))
    num_large = sum(t.model == "llama-3-70b" for t in trace)
    assert len(records) == len(trace) > 10 and 0 < num_large < len(trace)
    assert sum(r.refused for r in records) == num_large
    assert all(r.retry_after_ms == REFUSE_MS for r in records if r.refused)
    assert [r.num_output_tokens for r in records if not r.refused] == [
        t.output_len for t in trace if t.model != "llama-3-70b"]
    assert len({peer for _, _, peer in server.requests}) == 3  # one connection per channel


async def test_drain_timeout_cuts_off_unfinished_streams():
    server = TokenServer(hang_ids=frozenset({"r0000001"}))
    async with serve(server) as target:
        records = await run_bench(target, HAND_TRACE[:3], time_scale=1.0,
                                  options=BenchOptions(drain_timeout_s=0.3))
        await asyncio.wait_for(server.any_cancelled.wait(), 5.0)
    assert [r.error for r in records] == ["", DRAIN_TIMEOUT, ""]
    assert records[1].num_output_tokens == 1 and records[1].finish_s is None
    assert server.cancelled == ["r0000001"]


async def test_bench_command_writes_summary_and_plots(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    server = TokenServer(refuse_model="llama-3-70b", chunk_tokens=64)
    async with serve(server) as target:
        args = parser.parse_args([
            "--target", target, "--profile", "seed-000", "--rate", "300", "--duration", "1", "--seed", "2",
            "--max-requests", "8", "--time-scale", "1", "--json", str(tmp_path / "s.json"),
            "--plots", str(tmp_path / "plots"), "--no-progress", "--warmup", "0s",  # 8 requests: measure them all
        ])
        # the command runs its own (uv)loop, so it runs in a thread while this loop serves
        assert await asyncio.to_thread(run, args) == 0
    doc = json.loads((tmp_path / "s.json").read_text())
    trace = generate_trace(scaled(PROFILES["seed-000"], rate_rps=300.0, duration_s=1.0), 2)[:8]
    assert doc["num_requests"] == 8 and len(server.requests) == 8
    assert doc["summary"]["overall"]["num_offered"] == 8
    assert doc["summary"]["window"]["start_s"] == 0.0 and doc["summary"]["window"]["warmup_rule"] == "none"
    assert doc["occupancy"][0][0] == 0.0  # the harness's in-flight series, sampled each second from t0
    assert doc["summary"]["overall"]["num_refused"] == sum(t.model == "llama-3-70b" for t in trace)
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["attainment_over_time.png", "latency_cdfs.png"]
    assert "by model" in capsys.readouterr().out


def test_options_are_validated():
    with pytest.raises(ValueError):
        BenchOptions(time_scale=0)
    with pytest.raises(ValueError):
        BenchOptions(output_len_mode="guess")


# --- against the real node ------------------------------------------------------------------------------------


def one_small_instance(tier_queue_bound: int) -> dict:
    return {
        "models": {"llama-3-8b": "llama-3-8b"},
        "instances": [{"id": "sm-0", "model": "llama-3-8b", "role": "colocated", "tp": 1, "gpu_ids": [0]}],
        "policies": {"tier_queue_bound": {"interactive": tier_queue_bound, "standard": tier_queue_bound,
                                          "batch": tier_queue_bound}},
    }


@contextlib.contextmanager
def real_node(config, time_scale: float, run_dir):
    from octoserve.services.node.launcher import start_node

    node = start_node(config, time_scale, run_dir=run_dir)
    try:
        yield node
    finally:
        node.stop()


async def test_bench_against_the_real_node_records_every_request(tmp_path):
    trace = generate_trace(scaled(PROFILES["seed-000"], rate_rps=30.0, duration_s=0.5), 3)
    # short outputs keep the run to seconds; exact lengths via max_tokens + ignore_eos (no sim-length hint needed)
    trace = [dataclasses.replace(t, output_len=min(t.output_len, 16), max_tokens=min(t.max_tokens, 64)) for t in trace]
    with real_node(None, 5.0, tmp_path) as node:
        records = await run_bench(node.router_address, trace, time_scale=5.0,
                                  options=BenchOptions(drain_timeout_s=60.0, output_len_mode="max-tokens"))
    assert [r.request_id for r in records] == [t.request_id for t in trace] and len(records) > 8
    # Which requests are shed depends on timing (the one 70B instance sheds a 70B request arriving during another's
    # ~170 ms prefill); that every request ends completed or refused, and completed ones exactly, does not.
    assert all(r.completed or r.refused for r in records), [r.error for r in records if r.error]
    done = [(r, t) for r, t in zip(records, trace) if r.completed]
    assert done
    assert [r.num_output_tokens for r, _ in done] == [t.output_len for _, t in done]
    assert [r.num_prompt_tokens for r, _ in done] == [len(t.prompt_token_ids) for _, t in done]
    assert all(0 < r.ttft_s < 5.0 and r.finish_s >= r.token_times_s[-1] for r, _ in done)
    assert all(r.retry_after_ms > 0 for r in records if r.refused)


async def test_real_node_refusals_are_counted_not_retried(tmp_path):
    # One outstanding request per tier: of a simultaneous burst, the first is admitted and the rest are shed
    # while its prefill runs (40x dilated: hundreds of ms, against a few ms to send the burst).
    burst = [dataclasses.replace(trace_req(i, 0.0, output_len=2), prompt_token_ids=tuple(range(2000, 3000 + i)))
             for i in range(5)]
    with real_node(one_small_instance(1), 40.0, tmp_path) as node:
        records = await run_bench(node.router_address, burst, time_scale=40.0,
                                  options=BenchOptions(drain_timeout_s=60.0, output_len_mode="max-tokens"))
    assert sum(r.refused for r in records) == 4 and sum(r.completed for r in records) == 1
    assert all(r.retry_after_ms is not None and r.retry_after_ms > 0 for r in records if r.refused)
    summary = summarize(records, SloSpec(), duration_s=1.0)
    assert (summary.overall.num_offered, summary.overall.num_refused, summary.overall.num_errors) == (5, 4, 0)


def test_ignored_sim_length_hints_are_counted():
    trace = HAND_TRACE[:3]
    records = [trace[0].record(num_output_tokens=5), trace[1].record(num_output_tokens=12), trace[2].record()]
    assert count_ignored_hints(trace, records) == 1


def test_drain_timeout_is_modelled_seconds_dilated_by_the_time_scale():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    from octoserve.services.loadgen import bench_options

    args = parser.parse_args(["--target", "x:1", "--time-scale", "4"])
    assert bench_options(args).drain_timeout_s == 480.0  # the default, simulate's 120 modelled s, x 4
    args = parser.parse_args(["--target", "x:1", "--time-scale", "2", "--drain-timeout", "5"])
    assert bench_options(args).drain_timeout_s == 10.0


def test_the_default_drain_covers_the_traces_longest_request_at_its_slos():
    """The reported DRAIN_TIMEOUT: a default `bench --rate 20 --duration 60` (seed-000, seed 0) sends a 70B request
    at 55.9 s with 2,480 output tokens; at its SLOs (250 ms, then 30 ms a token) it streams until ~70 s after the
    last send, past the old 30 s default, while `simulate` (120 s) counts it served."""
    from octoserve.services.loadgen import SIM_DRAIN_S, bench_options, default_drain_timeout_s

    profile = scaled(PROFILES["seed-000"], rate_rps=20.0, duration_s=60.0)
    trace = generate_trace(profile, 0)
    last_s = max(r.arrival_s for r in trace)
    longest = max(trace, key=lambda r: r.arrival_s + r.output_len * 0.030)
    assert (longest.model, longest.output_len) == ("llama-3-70b", 2480)
    assert longest.arrival_s + 0.250 + 2480 * 0.030 - last_s > 30.0
    assert default_drain_timeout_s(trace, profile.slo) == SIM_DRAIN_S == 120.0
    # A trace whose last request needs longer than simulate's drain gets that long.
    slow = SloSpec(itl_ms=100.0)
    assert default_drain_timeout_s(trace, slow) == pytest.approx(
        max(r.arrival_s + r.ttft_slo_ms / 1000.0 + r.output_len * 0.100 for r in trace) - last_s)
    assert default_drain_timeout_s(trace, slow) > SIM_DRAIN_S
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--target", "x:1", "--time-scale", "3"])
    assert bench_options(args, trace, slow).drain_timeout_s == pytest.approx(3 * default_drain_timeout_s(trace, slow))


async def test_bench_table_breaks_errors_down_by_cause(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    trace = generate_trace(scaled(PROFILES["seed-000"], rate_rps=300.0, duration_s=1.0), 2)[:40]
    hung = trace[0].request_id if trace[0].model == "llama-3-8b" else next(
        t.request_id for t in trace if t.model == "llama-3-8b")
    server = TokenServer(broken_model="llama-3-70b", hang_ids=frozenset({hung}))
    async with serve(server) as target:
        args = parser.parse_args([
            "--target", target, "--profile", "seed-000", "--rate", "300", "--duration", "1", "--seed", "2",
            "--max-requests", "40", "--drain-timeout", "3", "--no-progress", "--warmup", "0s",
            "--json", str(tmp_path / "s.json"),
        ])
        assert await asyncio.to_thread(run, args) == 0
    out = capsys.readouterr().out
    n_broken = sum(t.model == "llama-3-70b" for t in trace)
    assert n_broken > 0
    expected = sorted([("INTERNAL", n_broken), ("DRAIN_TIMEOUT", 1)], key=lambda kv: (-kv[1], kv[0]))
    line = next(x for x in out.splitlines() if x.startswith("errors by cause: "))
    hint = " (still streaming when the drain timeout expired: raise --drain-timeout (modelled seconds))"
    assert line == "errors by cause: " + "; ".join(
        f"{c} {n}" + (hint if c == "DRAIN_TIMEOUT" else "") for c, n in expected)
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["summary"]["overall"]["num_errors"] == n_broken + 1
