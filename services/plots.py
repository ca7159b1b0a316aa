"""PNG plots of a run's metrics, shared by `octoserve simulate`, `bench` and `bench-suite`.

Invariants: the Agg backend only (no display needed, safe in CI and on servers); every function writes one PNG
at `path`, closes its figure (long benchmark loops must not leak figures) and returns the path. Metric
definitions come from `octoserve.services.metrics`, never recomputed differently here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen before pyplot loads)
import numpy as np  # noqa: E402

from octoserve.services.metrics import RequestRecord, SloSpec, attainment_over_time, itl_gaps_s  # noqa: E402


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _cdf(ax, values_ms: Sequence[float], label: str) -> None:
    if len(values_ms) == 0:
        return
    xs = np.sort(np.asarray(values_ms, dtype=float))
    ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=f"{label} (n={len(xs)})")


def plot_latency_cdfs(records: Iterable[RequestRecord], path: str | Path, slo: SloSpec = SloSpec()) -> Path:
    """TTFT and ITL CDFs per model (completed requests), with the SLO and the P95 line marked."""
    done = [r for r in records if r.completed]
    fig, (ax_ttft, ax_itl) = plt.subplots(1, 2, figsize=(11, 4))
    for model in sorted({r.model for r in done}):
        mine = [r for r in done if r.model == model]
        _cdf(ax_ttft, [r.ttft_s * 1000.0 for r in mine], model)
        _cdf(ax_itl, [g * 1000.0 for r in mine for g in itl_gaps_s(r.token_times_s)], model)
    for ax, slo_ms, name in ((ax_ttft, slo.ttft_ms, "TTFT"), (ax_itl, slo.itl_ms, "ITL")):
        ax.axvline(slo_ms, color="red", linestyle="--", label=f"SLO {slo_ms:g} ms")
        ax.axhline(0.95, color="grey", linestyle=":", linewidth=0.8)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_title(f"{name} CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_attainment_over_time(
    records: Iterable[RequestRecord], slo: SloSpec, path: str | Path, bin_s: float = 1.0
) -> Path:
    """SLO attainment per arrival-time bin, of admitted and of offered (refused = miss), plus offered load."""
    bins = attainment_over_time(records, slo, bin_s)
    xs = [b.start_s for b in bins]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(xs, [100 * b.attainment_admitted for b in bins], label="of admitted")
    ax.plot(xs, [100 * b.attainment_offered for b in bins], label="of offered (refused = miss)")
    ax.set_ylim(0, 105)
    ax.set_xlabel("arrival time (s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.grid(alpha=0.3)
    load = ax.twinx()
    load.plot(xs, [b.num_offered / bin_s for b in bins], color="grey", alpha=0.5, label="offered req/s")
    load.set_ylabel("offered req/s")
    ax.legend(loc="lower left", fontsize=8)
    load.legend(loc="lower right", fontsize=8)
    return _save(fig, path)


def plot_goodput_vs_load(rows: Iterable[tuple[str, float, float]], path: str | Path) -> Path:
    """Goodput against offered rate, one line per policy; rows are (policy, offered_rps, goodput_rps)."""
    by_policy: dict[str, list[tuple[float, float]]] = {}
    for policy, offered_rps, goodput_rps in rows:
        by_policy.setdefault(policy, []).append((offered_rps, goodput_rps))
    fig, ax = plt.subplots(figsize=(7, 5))
    top = 0.0
    for policy, points in sorted(by_policy.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=policy)
        top = max(top, max(p[0] for p in points))
    ax.plot([0, top], [0, top], color="grey", linestyle=":", label="goodput = offered")
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel("goodput (req/s meeting every SLO)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_timeseries(series: dict[str, list[tuple[float, float]]], path: str | Path, ylabel: str) -> Path:
    """Named (time_s, value) series on one axis, e.g. KV utilisation or GPU busy fraction per instance."""
    fig, ax = plt.subplots(figsize=(10, 4))
    for name, points in sorted(series.items()):
        ax.plot([p[0] for p in points], [p[1] for p in points], label=name)
    ax.set_xlabel("time (s)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    return _save(fig, path)
