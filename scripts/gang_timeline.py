"""A gang group's lease timeline in the simulator: which member held which GPU, step by step, per lease shape.

    .venv/bin/python scripts/gang_timeline.py docs/bench/gang_timeline.png

Seed 000 at 8 req/s on node-gang.yaml (default cost profile), 12 s of arrivals; the plot shows 150 ms from 10 s on:
one row per GPU, LM steps (all eight GPUs at once) in one colour, SM steps in another, idle GPU time white. The
white before each LM step is the barrier: GPUs whose SM step ended early wait for the slowest.
"""

from __future__ import annotations

import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402

from octoserve.services.config import default_config_text  # noqa: E402
from octoserve.services.core.placement import node_config_from_dict  # noqa: E402
from octoserve.services.sim.driver import NodeSimulator  # noqa: E402
from octoserve.services.workload import PROFILES, generate_trace, scaled  # noqa: E402

WINDOW_S = (10.0, 10.15)


class _Logged(NodeSimulator):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.steps: list[tuple[str, float, float]] = []

    def _start_capped_step(self, inst, step_cap_s):
        t = super()._start_capped_step(inst, step_cap_s)
        if t is not None:
            self.steps.append((inst.cfg.id, self.now, self.now + t))
        return t


def main(path: str) -> int:
    shapes = ("interleave", "periodic", "slack")
    fig, axes = plt.subplots(len(shapes), 1, figsize=(11, 2.6 * len(shapes)), sharex=True)
    trace = generate_trace(scaled(PROFILES["seed-000"], rate_rps=8.0, duration_s=12.0), 0)
    for ax, shape in zip(axes, shapes):
        raw = yaml.safe_load(default_config_text("node-gang.yaml"))
        raw["gang"]["shape"] = shape
        config = node_config_from_dict(raw)
        sim = _Logged(config)
        sim.run(trace, drain_s=1.0)
        lm = config.gang.groups[0].lm
        gpus = {i.id: i.gpu_ids for i in config.instances}
        for member, start, end in sim.steps:
            if end < WINDOW_S[0] or start > WINDOW_S[1]:
                continue
            colour = "tab:red" if member == lm else "tab:blue"
            for g in gpus[member]:
                ax.broken_barh([((start - WINDOW_S[0]) * 1e3, (end - start) * 1e3)], (g - 0.4, 0.8), color=colour)
        ax.set_xlim(0, (WINDOW_S[1] - WINDOW_S[0]) * 1e3)
        ax.set_ylabel("GPU")
        ax.set_title(f"{shape}: 70B TP=8 steps (red) and 8B steps (blue); white = idle (barrier or no work)")
    axes[-1].set_xlabel(f"ms after {WINDOW_S[0]:g} s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "docs/bench/gang_timeline.png"))
