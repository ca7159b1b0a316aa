"""Gang-lease figures in the simulator, steady state, under both cost profiles (BENCHMARKS.md, "Gang leases").

    nice -n 10 .venv/bin/python scripts/gang_figures.py --json docs/bench/gang_figures.json

1. Lease shapes compared on seed 000 at a fixed rate: per model goodput and attainment, the two bounds as
   measured, lease switches per second.
2. Seed-000 SLO capacity of the gang node (each shape) and of vllm-default on the static split, by bisection to
   1 req/s, three seeds a probe for the shipped shape and vllm-default (a probe passes on a majority), one for the
   other shapes; a run passes when the capacity criterion holds (`capacity.passes`) AND each model's offered
   requests are >= 90 % good.
3. The 300 req/s peak: each model's attained fraction of its offered requests on the gang node (20 s, 5 s warm-up).
4. Seed 003 with one model only at the seed's peaks (100 LM req/s, 1,500 SM req/s; 10 s after 3 s of warm-up):
   goodput and attainment of the gang node and of the static split.
5. Drain vs checkpoint at lease starts (seed 003's first follow-up): what draining cost per paused SM with chunked
   prefill (measured), what checkpointing its KV to host would have cost, and what draining would cost without
   chunked prefill (a whole 8B prompt in one step, by the cost model over the trace's prompts).
Progress goes to stderr; the figures to stdout as markdown and, with --json, to a file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import statistics
import sys
import time

import yaml

from octoserve.services.lab.baselines import BASELINES, configure
from octoserve.services.config import default_config_text, load_node_config
from octoserve.services.core.placement import node_config_from_dict
from octoserve.services.sim.capacity import passes
from octoserve.services.sim.driver import run_simulation
from octoserve.services.workload import PROFILES, generate_trace, scaled

SHAPES = ("interleave", "periodic", "slack")
SEEDS = (0, 1, 2)
# (config, seeds, bracket top): the shipped shape and vllm-default with three seeds a probe, other shapes with one;
# the pessimistic brackets are lower (nothing passes above a few req/s there).
CAPACITY_SEARCHES = {
    "default": (("gang-interleave", SEEDS, 16.0), ("gang-periodic", SEEDS[:1], 16.0), ("gang-slack", SEEDS[:1], 16.0),
                ("vllm-default", SEEDS, 32.0)),
    "pessimistic": (("gang-interleave", SEEDS, 4.0), ("vllm-default", SEEDS, 4.0)),
}


def gang_config(cost_profile: str, shape: str | None = None):
    raw = yaml.safe_load(default_config_text("node-gang.yaml"))
    if shape:
        raw["gang"]["shape"] = shape
    raw["cost_profile"] = cost_profile
    return configure(BASELINES["octoserve-gang"], node_config_from_dict(raw))


def static_config(cost_profile: str, policy: str):
    node = dataclasses.replace(load_node_config(None), cost_profile=cost_profile)
    return configure(BASELINES[policy], node)


def profile_only(name: str, model: str | None):
    p = PROFILES[name]
    if model is None:
        return p
    return dataclasses.replace(p, traffic=tuple(t for t in p.traffic if t.model == model))


def run_one(args):
    """(key, rate, seed) -> figures of one steady-state run."""
    key, config, profile_name, model, rate, seed, duration_s, warmup_s = args
    profile = scaled(profile_only(profile_name, model), rate_rps=rate, duration_s=duration_s)
    res = run_simulation(config, generate_trace(profile, seed), seed=seed, drain_s=30.0, warmup_s=warmup_s)
    s = res.summary
    per_model = {g.name: dict(goodput=g.goodput_rps, att_off=g.attainment_offered, att_adm=g.attainment_admitted,
                              refused=g.refused_fraction, offered=g.num_offered, ttft_p95=g.ttft.p95_ms,
                              itl_p95=g.itl.p95_ms) for g in s.per_model}
    ok = passes(s.overall) and all(m["att_off"] >= 0.9 for m in per_model.values())
    gangs = [dict(max_lm_wait_ms=g.stats.max_lm_wait_s * 1e3, max_sm_stall_ms=g.stats.max_sm_stall_s * 1e3,
                  switches_per_s=g.switches_per_s, overruns=g.stats.num_overruns,
                  lm_held=g.stats.lm_held_s / max(g.virtual_s, 1e-9), barrier_idle_gpu_s=g.stats.barrier_idle_gpu_s,
                  lease_states=dict(g.stats.lease_states), drain_s=g.drain_s, checkpoint_s=g.checkpoint_s,
                  pauses=g.num_sm_pauses, fills=g.stats.num_fill_steps) for g in res.gangs]
    return dict(key=key, rate=rate, seed=seed, passes=ok, goodput=s.overall.goodput_rps,
                att_off=s.overall.attainment_offered, per_model=per_model, gangs=gangs)


def bisect(pool, jobs_for, lo: float, hi: float, min_gap: float, log) -> tuple[float, list]:
    """Highest passing rate in [lo, hi) by bisection; each probe runs every seed (majority passes)."""
    probes = []
    while hi - lo >= min_gap:
        rate = round((lo + hi) / 2, 1)
        results = pool.map(run_one, jobs_for(rate))
        ok = 2 * sum(r["passes"] for r in results) > len(results)
        probes.append((rate, ok, results))
        log(f"  probe {rate:g} req/s: {sum(r['passes'] for r in results)}/{len(results)} pass")
        lo, hi = (rate, hi) if ok else (lo, rate)
    return lo, probes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", nargs="+", default=["default", "pessimistic"])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--parts", default="12345", help="which parts to run (digits)")
    ap.add_argument("--only-gang", action="store_true", help="skip the static-split runs (their code is unchanged)")
    args = ap.parse_args()
    start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - start:6.0f} s] {msg}", file=sys.stderr, flush=True)

    out: dict = {}
    with multiprocessing.get_context("fork").Pool(args.workers) as pool:
        for cp in args.profiles:
            fig = out[cp] = {}
            configs = {f"gang-{s}": gang_config(cp, s) for s in SHAPES}
            configs["vllm-default"] = static_config(cp, "vllm-default")
            configs["octoserve-static"] = static_config(cp, "octoserve")
            if "1" in args.parts:
                log(f"{cp}: shapes at 8 req/s (seed 0, 60 s, 20 s warm-up)")
                jobs = [(k, configs[k], "seed-000", None, 8.0, 0, 60.0, 20.0) for k in configs
                        if not (args.only_gang and not k.startswith("gang"))]
                fig["shapes_8rps"] = {r["key"]: r for r in pool.map(run_one, jobs)}
            if "2" in args.parts:
                fig["capacity"] = {}
                # The shipped shape and vllm-default with three seeds a probe, the other shapes with one.
                for key, seeds, hi in CAPACITY_SEARCHES[cp]:
                    if args.only_gang and not key.startswith("gang"):
                        continue
                    log(f"{cp}: seed-000 capacity of {key}")
                    cap, probes = bisect(pool, lambda r, k=key, ss=seeds: [
                        (k, configs[k], "seed-000", None, r, s, 60.0, 20.0) for s in ss], 0.0, hi, 1.0, log)
                    fig["capacity"][key] = dict(capacity=cap, probes=[(r, ok, [x["per_model"] for x in res])
                                                                      for r, ok, res in probes])
            if "3" in args.parts:
                log(f"{cp}: the 300 req/s peak (20 s, 5 s warm-up)")
                jobs = [(k, configs[k], "seed-000", None, 300.0, 0, 20.0, 5.0) for k in ("gang-interleave", "gang-slack")]
                fig["peak"] = {r["key"]: r for r in pool.map(run_one, jobs)}
            if "4" in args.parts:
                log(f"{cp}: seed 003 with one model only at the seed's peaks (100 LM / 1,500 SM req/s)")
                jobs = [(f"{k} {m}", configs[k], "seed-003", m, rate, 0, 10.0, 3.0)
                        for k in (("gang-interleave",) if args.only_gang else ("gang-interleave", "octoserve-static"))
                        for m, rate in (("llama-3-70b", 100.0), ("llama-3-8b", 1500.0))]
                fig["seed003_one_model"] = {r["key"]: r for r in pool.map(run_one, jobs)}
            if "5" in args.parts:
                fig["drain_vs_checkpoint"] = drain_vs_checkpoint(fig.get("shapes_8rps"), cp)
            log(f"{cp}: done")
            if args.json:  # after every profile, so a long run leaves what it has
                with open(args.json, "w") as f:
                    json.dump(out, f, indent=1, default=str)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    print(json.dumps(out, indent=1, default=str)[:4000])
    return 0


def drain_vs_checkpoint(shapes: dict | None, cost_profile: str) -> dict:
    """Per paused SM: measured drain and checkpoint costs (chunked prefill), and the drain cost a whole-prompt
    prefill step would have had (no chunking): the step of a seed-000 8B prompt, mean and P95 over the trace."""
    from octoserve.services.core.placement import node_config_from_dict as _n  # noqa: F401

    cfg = gang_config(cost_profile, "interleave")
    sm = cfg.instance("sm-0")
    cost = cfg.cost_model(sm)
    trace = generate_trace(scaled(profile_only("seed-000", "llama-3-8b"), rate_rps=8.0, duration_s=60.0), 0)
    whole = sorted(cost.prefill_time_s(len(r.prompt_token_ids)) for r in trace)
    # A lease request lands uniformly inside a running whole-prompt step: it waits half the step on average.
    out = dict(unchunked_step_mean_ms=statistics.mean(whole) * 1e3,
               unchunked_wait_mean_ms=statistics.mean(whole) * 1e3 / 2,
               unchunked_step_p95_ms=whole[int(0.95 * (len(whole) - 1))] * 1e3)
    if shapes:
        for key in ("gang-interleave", "gang-slack"):
            g = shapes[key]["gangs"][0]
            n = max(g["pauses"], 1)
            out[key] = dict(drain_per_pause_ms=g["drain_s"] / n * 1e3, checkpoint_per_pause_ms=g["checkpoint_s"] / n * 1e3,
                            pauses=g["pauses"], lease_states=g["lease_states"])
    return out


if __name__ == "__main__":
    sys.exit(main())
