"""The live load harness, `octoserve bench`: replays a workload trace against a running router, open loop.

The trace comes from the same `octoserve.services.workload.generate_trace` as `octoserve simulate`, and the report from
the same `octoserve.services.metrics` / `octoserve.services.plots`, so a live run and a virtual run of one (profile, seed) compare
number for number.

Invariants:
- Open loop: request i is sent at t0 + arrival_s(i) * time_scale on the real clock whatever the node is doing;
  each request is one task on one asyncio loop, sharing `num_channels` channels.
- Every dispatched request yields exactly one `RequestRecord`, in trace order: completed, refused (with the
  retry hint it carried; a prompt no idle instance can serve within its SLOs, FAILED_PRECONDITION, is refused with
  none, as the simulator counts it), failed (`error` says how), or cut off at the drain timeout (`error` = DRAIN_TIMEOUT).
- Times are measured on `time.monotonic` from t0 and divided by `time_scale`, so records are on the modelled
  clock of the simulator. A record's arrival is when its request was actually sent: harness lag is not
  charged to the node.
- No retries by default: a refusal is an outcome to count, not to hide. `--retry` turns on the SDK's policy.
- The run is bounded: by the trace (duration, `max_requests`) and by `drain_timeout_s` after the last send; the
  command's default is what `octoserve simulate` waits (`SIM_DRAIN_S`), or longer where a request of the trace
  needs longer served at its SLOs (`default_drain_timeout_s`), so a request the simulator counts is not cut off here.
- Steady state: the harness samples its own in-flight count (requests sent and not yet answered in full) every
  modelled second; `metrics.detect_window` finds the warm-up on it (or `--warmup` states it), and the report covers
  arrivals after the warm-up only, as `octoserve simulate` does.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from octoserve.client import AsyncClient, OctoserveClientError, OverloadedError, RetryPolicy, SloInfeasibleError
from octoserve.services.rpc.convert import SIM_OUTPUT_LEN_KEY  # one definition, shared with the router
from octoserve.services.metrics import (
    RequestRecord,
    detect_window,
    format_summary,
    scale_record_times,
    summarize,
    summary_to_dict,
)
from octoserve.services.flags import check_positive, check_warmup, check_workload_flags, parse_duration_s
from octoserve.services.workload import TraceRequest, WorkloadProfile, generate_trace
from octoserve.services.workload_io import add_workload_arguments, profile_from_args

# The workload's true output length, for the sim engine (the public API has no field for it: a real model
# decides by itself when to stop). The router copies it into RequestSpec.sim_output_len.
DRAIN_TIMEOUT = "DRAIN_TIMEOUT: unfinished when the drain timeout expired"
SIM_DRAIN_S = 120.0  # modelled seconds `octoserve simulate` follows the last arrival (run_simulation's drain_s)
OUTPUT_LEN_MODES = ("hint", "max-tokens")
_SEPARATE_CONNECTIONS = (("grpc.use_local_subchannel_pool", 1),)  # each channel gets its own HTTP/2 connection


@dataclass(frozen=True, slots=True)
class BenchOptions:
    time_scale: float = 1.0  # real seconds per modelled second
    drain_timeout_s: float = 30.0  # real seconds to wait for streams after the last send
    num_channels: int = 1
    retry: RetryPolicy | None = None
    request_timeout_s: float | None = None  # real seconds, per request
    # "hint": max_tokens as the trace says, true length in SIM_OUTPUT_LEN_KEY (sim engines);
    # "max-tokens": max_tokens = true length and ignore_eos (real engines, like `vllm bench serve`).
    output_len_mode: str = "hint"

    def __post_init__(self) -> None:
        if self.time_scale <= 0 or self.drain_timeout_s < 0 or self.num_channels < 1:
            raise ValueError("need time_scale > 0, drain_timeout_s >= 0 and num_channels >= 1")
        if self.output_len_mode not in OUTPUT_LEN_MODES:
            raise ValueError(f"output_len_mode must be one of {OUTPUT_LEN_MODES}, got {self.output_len_mode!r}")


class _Stream:
    """What one request's stream has shown so far, on the real clock relative to t0."""

    __slots__ = ("sent_s", "token_times_s", "num_cached_prompt_tokens", "num_prompt_tokens", "finish_s")

    def __init__(self, sent_s: float, num_prompt_tokens: int) -> None:
        self.sent_s = sent_s
        self.token_times_s: list[float] = []
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_prompt_tokens = 0
        self.finish_s: float | None = None

    def record(self, req: TraceRequest, time_scale: float, **outcome) -> RequestRecord:
        times = tuple(self.token_times_s)
        live = req.record(
            arrival_s=self.sent_s, num_prompt_tokens=self.num_prompt_tokens,
            num_cached_prompt_tokens=self.num_cached_prompt_tokens, num_output_tokens=len(times),
            first_token_s=times[0] if times else None, token_times_s=times, finish_s=self.finish_s, **outcome,
        )
        return scale_record_times(live, time_scale)


def _request_kwargs(req: TraceRequest, options: BenchOptions) -> dict:
    kwargs = dict(priority=req.priority, ttft_slo_ms=round(req.ttft_slo_ms), request_id=req.request_id,
                  timeout_s=options.request_timeout_s)
    if options.output_len_mode == "hint":
        return kwargs | dict(max_tokens=req.max_tokens, metadata=((SIM_OUTPUT_LEN_KEY, str(req.output_len)),))
    return kwargs | dict(max_tokens=req.output_len, ignore_eos=True)


async def send_request(client: AsyncClient, req: TraceRequest, t0: float, options: BenchOptions,
                       out: list, index: int) -> None:
    """Run one request and put its record at `out[index]`, also when the drain timeout cancels it."""
    stream = _Stream(time.monotonic() - t0, len(req.prompt_token_ids))
    try:
        prompt = req.prompt_text if req.prompt_text is not None else req.prompt_token_ids  # text: the node tokenizes
        async for chunk in client.generate(req.model, prompt, **_request_kwargs(req, options)):
            now_s = time.monotonic() - t0
            stream.token_times_s.extend([now_s] * len(chunk.token_ids))
            if chunk.usage is not None:
                stream.num_prompt_tokens = chunk.usage.prompt_tokens
                stream.num_cached_prompt_tokens = chunk.usage.cached_prompt_tokens
        stream.finish_s = time.monotonic() - t0
        out[index] = stream.record(req, options.time_scale)
    except OverloadedError as e:
        out[index] = stream.record(req, options.time_scale, refused=True, retry_after_ms=e.retry_after_ms)
    except SloInfeasibleError:  # refused at admission like the simulator's; retrying cannot help, so no hint
        out[index] = stream.record(req, options.time_scale, refused=True)
    except OctoserveClientError as e:
        out[index] = stream.record(req, options.time_scale, error=f"{e.code.name}: {e.message}")
    except asyncio.CancelledError:
        out[index] = stream.record(req, options.time_scale, error=DRAIN_TIMEOUT)
        raise
    except Exception as e:  # a harness bug must not lose the request from the counts
        out[index] = stream.record(req, options.time_scale, error=f"{type(e).__name__}: {e}")


@dataclass(frozen=True, slots=True)
class BenchRun:
    records: list[RequestRecord]  # one per request, in trace order, modelled clock
    occupancy: list[tuple[float, float]]  # (modelled s, requests sent and not yet answered in full), each second


async def run_bench(
    target: str,
    trace: Sequence[TraceRequest],
    *,
    time_scale: float = 1.0,
    options: BenchOptions | None = None,
    progress=None,
) -> list[RequestRecord]:
    """Replay `trace` against the router at `target`; one record per request, in trace order, modelled clock.

    `options.time_scale` is replaced by `time_scale`. `progress` (a `octoserve.services.progress.Progress`) is advanced as
    requests finish."""
    return (await run_bench_series(target, trace, time_scale=time_scale, options=options, progress=progress)).records


async def run_bench_series(
    target: str,
    trace: Sequence[TraceRequest],
    *,
    time_scale: float = 1.0,
    options: BenchOptions | None = None,
    progress=None,
) -> BenchRun:
    """`run_bench`, with the harness's in-flight series for warm-up detection (`metrics.detect_window`)."""
    options = dataclasses.replace(options or BenchOptions(), time_scale=time_scale)
    clients = [AsyncClient(target, retry=options.retry, channel_options=_SEPARATE_CONNECTIONS)
               for _ in range(options.num_channels)]
    records: list = [None] * len(trace)
    tasks: list[asyncio.Task] = []
    occupancy: list[tuple[float, float]] = []
    t0 = time.monotonic()
    sampler = asyncio.get_running_loop().create_task(_sample_in_flight(tasks, t0, time_scale, occupancy))
    try:
        await _dispatch(clients, trace, options, records, progress, t0, tasks)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=options.drain_timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    finally:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in clients))
    return BenchRun(records, occupancy)


async def _sample_in_flight(tasks: list[asyncio.Task], t0: float, time_scale: float, out: list) -> None:
    """Every modelled second from t0 (absolute targets, so no drift): how many request tasks are still running."""
    k = 0
    while True:
        while (delay_s := t0 + k * time_scale - time.monotonic()) > 0:
            await asyncio.sleep(delay_s)
        out.append((float(k), float(sum(not t.done() for t in tasks))))
        k += 1


async def _dispatch(clients, trace, options: BenchOptions, records: list, progress, t0: float,
                    tasks: list[asyncio.Task]) -> None:
    """Send every request at its (dilated) arrival time, appending its task to `tasks` as it goes."""
    loop = asyncio.get_running_loop()
    for i, req in enumerate(trace):
        send_at_s = t0 + req.arrival_s * options.time_scale
        while (delay_s := send_at_s - time.monotonic()) > 0:  # loop: asyncio timers may fire a tick early
            await asyncio.sleep(delay_s)
        task = loop.create_task(send_request(clients[i % len(clients)], req, t0, options, records, i))
        if progress is not None:
            task.add_done_callback(lambda _t: progress.update(1))
        tasks.append(task)


# --- the command ---------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="router address, e.g. 127.0.0.1:50051")
    add_workload_arguments(parser)
    parser.add_argument("--rate", type=float, default=None, help="modelled req/s (default: the profile's)")
    parser.add_argument("--duration", type=parse_duration_s, default=None,
                        help="modelled arrival window, e.g. 60s (default: the profile's)")
    parser.add_argument("--burstiness", type=float, default=None, help="gamma shape: <1 burstier than Poisson")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="real seconds per modelled second; use the node's --time-scale (default 1)")
    parser.add_argument("--seed", type=int, default=0,
                        help="trace seed (default 0); `simulate --seed` with the same seed runs the same requests")
    parser.add_argument("--max-requests", type=int, default=None, help="send at most the trace's first N")
    parser.add_argument("--drain-timeout", type=parse_duration_s, default=None,
                        help="modelled seconds to wait for streams after the last send (default: 120, as simulate, "
                             "or what the trace's longest request needs at its SLOs if more; the real wait is this x "
                             "--time-scale, so a dilated node gets the same modelled time to finish)")
    parser.add_argument("--warmup", type=parse_duration_s, default=None,
                        help="modelled warm-up to leave out of every metric, e.g. 10s "
                             "(default: detected on the harness's in-flight count, MSER-5, >= 5 s)")
    parser.add_argument("--channels", type=int, default=1,
                        help="gRPC channels, each its own HTTP/2 connection, the requests are spread over (default 1)")
    parser.add_argument("--request-timeout", type=parse_duration_s, default=None,
                        help="real time per request, e.g. 30s (default: none)")
    parser.add_argument("--retry", action="store_true", help="let the SDK retry refusals (default: count them)")
    parser.add_argument("--output-len-mode", choices=OUTPUT_LEN_MODES, default="hint",
                        help="hint (default): max_tokens as the trace says, the true output length passed as a hint "
                             "a sim engine stops at; max-tokens: max_tokens = the true length with ignore_eos, for "
                             "a real engine (as `vllm bench serve`)")
    parser.add_argument("--json", type=Path, default=None, help="write the summary as JSON here")
    parser.add_argument("--plots", type=Path, default=None, help="write PNG plots into this directory")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def build_trace(args: argparse.Namespace, served: Sequence[str] | None = None,
                ) -> tuple[list[TraceRequest], WorkloadProfile]:
    """The trace `octoserve simulate` would replay for the same arguments, cut to `--max-requests`; with
    `served` (the target's models), a workload asking for another model is refused before the run."""
    profile, trace = profile_from_args(args, served=served)
    if trace is None:
        trace = generate_trace(profile, args.seed)
    if args.max_requests is not None:
        trace = trace[: args.max_requests]
    check_warmup(getattr(args, "warmup", None), measurement_window_s(trace),
                 "a longer trace" if getattr(args, "trace", None) else "a longer --duration")
    return trace, profile


def measurement_window_s(trace: Sequence[TraceRequest]) -> float:
    """The end of the arrival window, as the simulator measures it (the last arrival); the measurement window
    runs from the warm-up's end to here."""
    return max(trace[-1].arrival_s if trace else 0.0, 1e-9)


def served_models(target: str, timeout_s: float = 10.0) -> list[str]:
    """The models the router at `target` serves (ListModels); a UsageError when nothing answers there."""
    from octoserve.client import Client
    from octoserve.services.usage import UsageError

    with Client(target) as client:
        try:
            return [m.name for m in client.list_models(timeout_s=timeout_s)]
        except OctoserveClientError as e:
            raise UsageError(f"--target {target}: no router answered ListModels ({e.code.name}: {e.message}); "
                             "start one with `octoserve up`") from None


def default_drain_timeout_s(trace: Sequence[TraceRequest], slo) -> float:
    """Modelled seconds to wait after the last send: `SIM_DRAIN_S`, as `octoserve simulate` does, or longer when a
    request of the trace, served at its SLOs (its TTFT SLO, then its output at its model's ITL SLO), would still
    stream past that (`slo`: the workload's `metrics.SloSpec`)."""
    if not trace:
        return SIM_DRAIN_S
    last_s = max(r.arrival_s for r in trace)
    need_s = max(r.arrival_s - last_s + (r.ttft_slo_ms or slo.ttft_ms_for(r.model)) / 1000.0
                 + r.output_len * slo.itl_ms_for(r.model) / 1000.0 for r in trace)
    return max(SIM_DRAIN_S, need_s)


def bench_options(args: argparse.Namespace, trace: Sequence[TraceRequest] = (), slo=None) -> BenchOptions:
    """The harness options of the command line; the drain timeout is given in modelled seconds, so it is dilated
    by --time-scale like every other modelled duration (without --drain-timeout: `default_drain_timeout_s` of the
    trace and its SLOs)."""
    from octoserve.services.metrics import SloSpec

    drain_s = args.drain_timeout
    if drain_s is None:
        drain_s = default_drain_timeout_s(trace, slo or SloSpec())
    return BenchOptions(
        time_scale=args.time_scale, drain_timeout_s=drain_s * args.time_scale, num_channels=args.channels,
        retry=RetryPolicy() if args.retry else None, request_timeout_s=args.request_timeout,
        output_len_mode=args.output_len_mode,
    )


def check_arguments(args: argparse.Namespace) -> None:
    """The flag values, before the target is asked anything."""
    check_workload_flags(args)
    check_positive("--time-scale", args.time_scale, "the time scale (real seconds per modelled second)",
                   "--time-scale 10")
    check_positive("--channels", args.channels, "the number of channels", "--channels 4")


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    trace, profile = build_trace(args, served_models(args.target))
    options = bench_options(args, trace, profile.slo)
    progress = None
    if not args.no_progress:
        from octoserve.services.progress import Progress

        progress = Progress(len(trace), f"bench {profile.name}")
    bench = _run_loop(run_bench_series(args.target, trace, time_scale=args.time_scale, options=options,
                                       progress=progress))
    records = bench.records
    if progress is not None:
        progress.close()
    window = detect_window(bench.occupancy, measurement_window_s(trace), warmup_s=args.warmup)
    summary = summarize(records, profile.slo, window)
    print(format_summary(summary))
    print(format_error_causes(records, window))
    if options.output_len_mode == "hint" and (overrun := count_ignored_hints(trace, records)):
        print(f"warning: {overrun} requests generated more tokens than their {SIM_OUTPUT_LEN_KEY} hint: the node "
              "ignores it, so outputs run to max_tokens; use --output-len-mode max-tokens", file=sys.stderr)
    _write_outputs(args, records, summary, profile, bench.occupancy)
    return 0


def error_causes(records: Sequence[RequestRecord], window=None) -> dict[str, int]:
    """Failed requests (admitted, then an error) by cause: the status or DRAIN_TIMEOUT before the message, most
    frequent first; with `window`, only the requests it measures (the summary's `errors`)."""
    counts: dict[str, int] = {}
    for r in records:
        if r.error and not r.refused and (window is None or window.contains(r)):
            cause = r.error.partition(":")[0]
            counts[cause] = counts.get(cause, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


ERROR_CAUSE_HINTS = {
    "DRAIN_TIMEOUT": "still streaming when the drain timeout expired: raise --drain-timeout (modelled seconds)",
    "DEADLINE_EXCEEDED": "the per-request --request-timeout or the node's deadline passed",
    "UNAVAILABLE": "the router or a worker went away",
}


def format_error_causes(records: Sequence[RequestRecord], window=None) -> str:
    """One line under the summary table: the `errors` figure broken down by cause, with what each means."""
    causes = error_causes(records, window)
    if not causes:
        return "errors by cause: none"
    parts = [f"{cause} {n}" + (f" ({ERROR_CAUSE_HINTS[cause]})" if cause in ERROR_CAUSE_HINTS else "")
             for cause, n in causes.items()]
    return "errors by cause: " + "; ".join(parts)


def count_ignored_hints(trace: Sequence[TraceRequest], records: Sequence[RequestRecord]) -> int:
    """Requests that streamed past their true output length: the node did not apply the sim-length hint."""
    return sum(r.num_output_tokens > t.output_len for r, t in zip(records, trace))


def _run_loop(coro):
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency; this only keeps the harness usable where it will not build
        return asyncio.run(coro)
    return uvloop.run(coro)


def _write_outputs(args: argparse.Namespace, records, summary, profile, occupancy=()) -> None:
    if args.json is not None:
        doc = {"target": args.target, "profile": profile.name, "seed": args.seed, "time_scale": args.time_scale,
               "num_requests": len(records), "summary": summary_to_dict(summary), "occupancy": list(occupancy),
               "records": [dataclasses.asdict(r) for r in records]}
        args.json.write_text(json.dumps(doc, default=str))
    if args.plots is not None:
        from octoserve.services.plots import plot_attainment_over_time, plot_latency_cdfs

        args.plots.mkdir(parents=True, exist_ok=True)
        plot_latency_cdfs(records, args.plots / "latency_cdfs.png", profile.slo)
        plot_attainment_over_time(records, profile.slo, args.plots / "attainment_over_time.png")
        print(f"plots in {args.plots}", file=sys.stderr)
