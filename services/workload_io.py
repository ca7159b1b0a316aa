"""Users' own workloads: a profile as YAML (`--workload`) or a recorded trace as JSON lines (`--trace`), and the
check that the node serves every model they ask for. Shared by `simulate`, `bench`, `plan` and `bench-suite`.

Workload YAML: the fields of `workload.WorkloadProfile`, `ModelTraffic`, `LengthDist` and `TierShare` by name
(`tier:` names a tier: INTERACTIVE, STANDARD or BATCH). `profile_to_dict(PROFILES["seed-000"])` is the seed
profile in this form, and `load_workload` of its YAML gives the same profile back.

Trace JSONL, one request a line:
    arrival_s   seconds from the start of the run (required, >= 0; lines may come in any order)
    model       served model name (required)
    one prompt: prompt (text), prompt_token_ids (a list), or prompt_len (that many random token ids)
    output_len  tokens the request generates (the sim engine stops there); default max_tokens
    max_tokens  the request's max_tokens; default output_len (at least one of the two)
    tier        INTERACTIVE | STANDARD | BATCH (default STANDARD; `priority` is read as a synonym)
    ttft_slo_ms the request's TTFT deadline (default: its tier's SLO from the node config)
    request_id  optional (default r<line index>); two lines with the same id are an error
A text prompt is counted as one token per UTF-8 byte in the simulator (what a tokenizer-less sim engine does with
text); `bench` sends it as text, so a real engine tokenizes it with the model's tokenizer.

Invariants:
- Every problem is a `UsageError` naming the file, the line (JSONL) or key (YAML) and what to change.
- A trace loads the same for every run: prompt_len ids come from `random.Random` seeded by the line's index.
- A length in a workload (fixed value, uniform bounds, min/max) is a whole number of tokens >= 1: what the sampler
  would clip is refused, naming the key. A trace line the node can never serve (prompt, or prompt + max_tokens, over
  its model's context window) is replayed and refused like any other, and named in a warning on stderr.
- A workload that asks for a model the node does not serve is refused before any run (`check_served`), unless
  the caller asks to drop those requests (`--only-served`), which is reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import random
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import yaml

from octoserve.services.config import config_file
from octoserve.services.core.types import Priority
from octoserve.services.flags import check_faults, check_warmup, check_workload_flags
from octoserve.services.metrics import SloSpec, slo_spec_of
from octoserve.services.usage import UsageError
from octoserve.services.workload import (
    PROFILES,
    LengthDist,
    ModelTraffic,
    TierShare,
    TraceRequest,
    WorkloadProfile,
    scaled,
)

DEFAULT_TIER_TTFT_MS = {Priority.INTERACTIVE: 200.0, Priority.STANDARD: 250.0, Priority.BATCH: 10_000.0}
TRACE_KEYS = ("arrival_s", "model", "prompt", "prompt_token_ids", "prompt_len", "output_len", "max_tokens", "tier",
              "priority", "ttft_slo_ms", "request_id", "prefix_group", "prompt_text")
_TIERS = ", ".join(p.name for p in Priority)


def read_utf8(path: str | Path) -> str:
    """The text of a user's file; bytes that are not UTF-8 are bad input naming the file and where."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise UsageError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); save the "
                         "file as UTF-8") from None


# --- workload YAML -------------------------------------------------------------------------------------------


def _fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _check_keys(where: str, data, cls, renames: Mapping[str, str] = {}) -> dict:
    if not isinstance(data, dict):
        raise UsageError(f"{where}: expected a mapping with keys {', '.join(_fields(cls))}, got {data!r}")
    known = [renames.get(k, k) for k in _fields(cls)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise UsageError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; known keys: {', '.join(known)}")
    return data


def _tier(where: str, name) -> Priority:
    if isinstance(name, str) and name.upper() in Priority.__members__:
        return Priority[name.upper()]
    raise UsageError(f"{where}: {name!r} is not a tier; use one of {_TIERS}")


def _build(where: str, cls, **kwargs):
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise UsageError(f"{where}: {e}") from None


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _length(where: str, data) -> LengthDist:
    d = _check_keys(where, data, LengthDist)
    # A length is a number of tokens, at least one: a value the sampler would clip (a fixed -10 read as 1) is a
    # mistake to point at, not a request to serve.
    kind = d.get("kind")
    needed = {"fixed": ("value",), "uniform": ("lo", "hi")}.get(kind, ())
    for key in needed:
        if key not in d:
            raise UsageError(f"{where}: a {kind} length needs {' and '.join(needed)}; {key} is missing")
        if not _whole(d[key]) or d[key] < 1:
            raise UsageError(f"{where}: {key} is {d[key]!r}; a {kind} length's {key} is a whole number of tokens >= 1")
    for key in ("min_tokens", "max_tokens"):
        if key in d and (not _whole(d[key]) or d[key] < 1):
            raise UsageError(f"{where}: {key} is {d[key]!r}; it is a whole number of tokens >= 1")
    return _build(where, LengthDist, **d)


def _traffic(where: str, data) -> ModelTraffic:
    d = dict(_check_keys(where, data, ModelTraffic))
    for key in ("model", "share", "prompt_len", "output_len"):
        if key not in d:
            raise UsageError(f"{where}: missing key {key!r}")
    d["prompt_len"] = _length(f"{where}.prompt_len", d["prompt_len"])
    d["output_len"] = _length(f"{where}.output_len", d["output_len"])
    if "tiers" in d:
        tiers = []
        for j, t in enumerate(d["tiers"] or ()):
            w = f"{where}.tiers[{j}]"
            t = dict(_check_keys(w, t, TierShare, {"priority": "tier"}))
            if "tier" not in t or "share" not in t:
                raise UsageError(f"{w}: needs tier and share")
            tiers.append(_build(w, TierShare, priority=_tier(w, t.pop("tier")), **t))
        d["tiers"] = tuple(tiers)
    return _build(where, ModelTraffic, **d)


def workload_from_dict(data, source: str) -> WorkloadProfile:
    """A `WorkloadProfile` from its plain form (what `profile_to_dict` writes); `source` names it in errors."""
    d = dict(_check_keys(source, data, WorkloadProfile))
    for key in ("rate_rps", "duration_s", "traffic"):
        if key not in d:
            raise UsageError(f"{source}: missing key {key!r}")
    d.setdefault("name", Path(source).stem)
    if not isinstance(d["traffic"], list) or not d["traffic"]:
        raise UsageError(f"{source}: traffic must be a list of models with their share and lengths")
    d["traffic"] = tuple(_traffic(f"{source}: traffic[{i}]", t) for i, t in enumerate(d["traffic"]))
    if "slo" in d:
        d["slo"] = _build(f"{source}: slo", SloSpec, **_check_keys(f"{source}: slo", d["slo"], SloSpec))
    return _build(source, WorkloadProfile, **d)


def load_workload(path: str | Path) -> WorkloadProfile:
    from octoserve.services.config import parse_yaml_mapping
    from octoserve.services.core.placement import PlacementError

    text = read_utf8(path)
    try:
        data = parse_yaml_mapping(text, str(path))
    except PlacementError as e:  # the YAML parse error, naming the file and line
        raise UsageError(e.problems[0].replace("gpu, models, instances, slo, policies", "rate_rps, duration_s, "
                                               "traffic")) from None
    return workload_from_dict(data, str(path))


def profile_to_dict(profile: WorkloadProfile) -> dict:
    """The plain form of a profile, as a workload YAML holds it (defaults left out)."""

    def plain(obj) -> dict:
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if f.default is not dataclasses.MISSING and value == f.default:
                continue  # a default is left out, so the file says only what differs
            if isinstance(value, (LengthDist, SloSpec)):
                value = plain(value)
            elif f.name == "tiers":
                value = [{"tier": t.priority.name, "share": t.share,
                          **({"ttft_slo_ms": t.ttft_slo_ms} if t.ttft_slo_ms is not None else {})} for t in value]
            elif f.name == "traffic":
                value = [plain(t) for t in value]
            out[f.name] = value
        return out

    return plain(profile)


def dump_workload(profile: WorkloadProfile) -> str:
    return yaml.safe_dump(profile_to_dict(profile), sort_keys=False)


# --- trace JSONL ---------------------------------------------------------------------------------------------


def _row_tokens(where: str, row: dict, index: int, token_range: tuple[int, int]) -> tuple[tuple[int, ...], str | None]:
    given = [k for k in ("prompt", "prompt_token_ids", "prompt_len") if k in row]
    if len(given) != 1:
        raise UsageError(f"{where}: give exactly one of prompt (text), prompt_token_ids or prompt_len, got "
                         f"{given or 'none'}")
    key = given[0]
    value = row[key]
    if key == "prompt":
        if not isinstance(value, str) or not value:
            raise UsageError(f"{where}: prompt must be non-empty text")
        from octoserve.services.rpc.convert import text_to_token_ids

        return text_to_token_ids(value), value
    if key == "prompt_token_ids":
        if (not isinstance(value, list) or not value
                or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in value)):
            raise UsageError(f"{where}: prompt_token_ids must be a non-empty list of token ids >= 0")
        return tuple(value), None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{where}: prompt_len must be an integer >= 1, got {value!r}")
    rng = random.Random(index)
    lo, hi = token_range
    return tuple(rng.randrange(lo, hi) for _ in range(value)), None


def _positive_int(where: str, row: dict, key: str) -> int | None:
    value = row.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{where}: {key} must be an integer >= 1, got {value!r}")
    return value


def trace_request_from_row(row, index: int, where: str,
                           tier_ttft_ms: Mapping[Priority, float] = DEFAULT_TIER_TTFT_MS,
                           token_range: tuple[int, int] = (1000, 30000)) -> TraceRequest:
    if not isinstance(row, dict):
        raise UsageError(f"{where}: expected a JSON object, got {row!r}")
    unknown = sorted(set(row) - set(TRACE_KEYS))
    if unknown:
        raise UsageError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; known keys: "
                         f"{', '.join(k for k in TRACE_KEYS if k != 'prompt_text')}")
    arrival = row.get("arrival_s")
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not math.isfinite(arrival) or arrival < 0:
        raise UsageError(f"{where}: arrival_s must be a number of seconds >= 0, got {arrival!r}")
    model = row.get("model")
    if not isinstance(model, str) or not model:
        raise UsageError(f"{where}: model must name a served model, got {model!r}")
    tokens, text = _row_tokens(where, {k: v for k, v in row.items() if k != "prompt_text"}, index, token_range)
    if text is None and isinstance(row.get("prompt_text"), str):
        text = row["prompt_text"]
    output_len, max_tokens = _positive_int(where, row, "output_len"), _positive_int(where, row, "max_tokens")
    if output_len is None and max_tokens is None:
        raise UsageError(f"{where}: give output_len (tokens generated) or max_tokens (or both)")
    output_len = output_len or max_tokens
    max_tokens = max_tokens or output_len
    if output_len > max_tokens:
        raise UsageError(f"{where}: output_len {output_len} exceeds max_tokens {max_tokens}")
    prefix_group = row.get("prefix_group", -1)
    if isinstance(prefix_group, bool) or not isinstance(prefix_group, int) or prefix_group < -1:
        raise UsageError(f"{where}: prefix_group must be an integer (a group id >= 0 that requests with the same "
                         f"prompt prefix share, or -1 for none), got {prefix_group!r}")
    tier = _tier(where, row.get("tier", row.get("priority", "STANDARD")))
    slo = row.get("ttft_slo_ms", tier_ttft_ms[tier])
    if isinstance(slo, bool) or not isinstance(slo, (int, float)) or not slo > 0:
        raise UsageError(f"{where}: ttft_slo_ms must be a positive number of ms, got {slo!r}")
    return TraceRequest(str(row.get("request_id", f"r{index:07d}")), float(arrival), model, tokens, output_len,
                        max_tokens, tier, float(slo), prefix_group, text)


MAX_WINDOW_WARNINGS = 10  # lines named one by one; past that, a count


def unservable_reason(request: TraceRequest, window: int) -> str | None:
    """Why `request` can never be served in a `window`-token context (what the router refuses it for), or None."""
    n = len(request.prompt_token_ids)
    if n >= window:
        return f"the prompt of {n} tokens does not fit the {window}-token context window of {request.model}"
    if n + request.max_tokens > window:
        return (f"max_tokens {request.max_tokens} + prompt {n} tokens exceeds the {window}-token context window of "
                f"{request.model}")
    return None


def load_trace(path: str | Path, tier_ttft_ms: Mapping[Priority, float] = DEFAULT_TIER_TTFT_MS,
               context_windows: Mapping[str, int] | None = None) -> list[TraceRequest]:
    """The requests of a JSONL trace, sorted by arrival (stable); an empty trace is an error, and so is a
    request_id used twice. With `context_windows` (model -> tokens), each request that can never be served there
    (prompt, or prompt + max_tokens, over its model's window) is named on stderr, line by line: a trace is recorded
    data, so it is still replayed (and refused, as the router refuses it), but not without a word."""
    trace = []
    lines: dict[str, int] = {}  # request_id -> its line
    unservable: list[str] = []
    # universal newlines, as open() reads text; str.splitlines() would also split at U+2028 inside a JSON string
    for number, line in enumerate(io.StringIO(read_utf8(path), newline=None), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        request = trace_request_from_row(row, len(trace), where, tier_ttft_ms)
        if request.request_id in lines:
            raise UsageError(f"{where}: request_id {request.request_id!r} is already the id of line "
                             f"{lines[request.request_id]}; give each request its own request_id (or leave it out)")
        lines[request.request_id] = number
        window = (context_windows or {}).get(request.model)
        reason = None if window is None else unservable_reason(request, window)
        if reason is not None:
            unservable.append(f"{where}: {reason}")
        trace.append(request)
    if not trace:
        raise UsageError(f"{path}: the trace has no requests; write one JSON object a line")
    for problem in unservable[:MAX_WINDOW_WARNINGS]:
        print(f"warning: {problem}: it can never be served, so it is refused (counted in refused%)",
              file=sys.stderr)
    if len(unservable) > MAX_WINDOW_WARNINGS:
        print(f"warning: {path}: {len(unservable) - MAX_WINDOW_WARNINGS} more requests can never be served (over "
              "their model's context window); they are refused too", file=sys.stderr)
    trace.sort(key=lambda r: r.arrival_s)
    return trace


def profile_of_trace(trace: Sequence[TraceRequest], name: str, slo: SloSpec = SloSpec()) -> WorkloadProfile:
    """A profile fitted to a trace (per model: its share, lognormal prompt and output lengths with the trace's
    mean and log-spread, its tier shares): what `plan` sizes and probes at other rates. The run itself replays
    the trace, not this profile."""
    by_model: dict[str, list[TraceRequest]] = {}
    for r in trace:
        by_model.setdefault(r.model, []).append(r)
    duration = max(trace[-1].arrival_s, 1e-3)

    def fit(values: list[int]) -> LengthDist:
        mean = sum(values) / len(values)
        logs = [math.log(v) for v in values]
        mu = sum(logs) / len(logs)
        sigma = math.sqrt(sum((x - mu) ** 2 for x in logs) / len(logs))
        return LengthDist.lognormal(mean, sigma, min_tokens=min(values), max_tokens=max(values))

    traffic = []
    for model, reqs in sorted(by_model.items()):
        tiers = {}
        for r in reqs:
            tiers.setdefault((r.priority, r.ttft_slo_ms), 0)
            tiers[(r.priority, r.ttft_slo_ms)] += 1
        longest = max(len(r.prompt_token_ids) + r.max_tokens for r in reqs)
        traffic.append(ModelTraffic(
            model=model, share=len(reqs) / len(trace),
            prompt_len=fit([len(r.prompt_token_ids) for r in reqs]), output_len=fit([r.output_len for r in reqs]),
            tiers=tuple(TierShare(p, n / len(reqs), slo_ms) for (p, slo_ms), n in sorted(tiers.items())),
            max_context_len=max(longest, 16),
        ))
    return WorkloadProfile(name=name, rate_rps=max(len(trace) / duration, 1e-6), duration_s=duration,
                           traffic=tuple(traffic), slo=slo)


# --- served models -------------------------------------------------------------------------------------------


def unserved_models(models: Iterable[str], served: Iterable[str]) -> list[str]:
    return sorted(set(models) - set(served))


def check_served(asked: Iterable[str], served: Iterable[str], what: str) -> None:
    """A `UsageError` before the run when the workload asks for a model the node does not serve."""
    missing, served = unserved_models(asked, served), sorted(set(served))
    if missing:
        raise UsageError(
            f"{what} asks for {', '.join(missing)}, which the node does not serve (it serves {', '.join(served)}); "
            "serve them in the config, give a workload with only served models (--workload / --trace), or pass "
            "--only-served to drop their requests")


def only_served_profile(profile: WorkloadProfile, served: Iterable[str]) -> WorkloadProfile:
    """The profile without the unserved models' traffic; each served model keeps its own request rate."""
    served = set(served)
    kept = tuple(t for t in profile.traffic if t.model in served)
    if not kept:
        raise UsageError(f"workload {profile.name} asks for no model the node serves ({', '.join(sorted(served))})")
    total = sum(t.share for t in profile.traffic)
    fraction = sum(t.share for t in kept) / total
    return dataclasses.replace(profile, traffic=kept, rate_rps=profile.rate_rps * fraction)


# --- the command-line arguments ------------------------------------------------------------------------------


def add_workload_arguments(parser: argparse.ArgumentParser, default_profile: str = "seed-000") -> None:
    """--profile NAME | --workload FILE.yaml | --trace FILE.jsonl, and --only-served."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--profile", default=default_profile, choices=sorted(PROFILES),
                       help=f"built-in workload profile (default {default_profile})")
    group.add_argument("--workload", type=config_file, metavar="FILE.yaml",
                       help="your own workload profile (format: docs/WORKLOADS.md)")
    group.add_argument("--trace", metavar="FILE.jsonl", help="your own requests, one JSON object a line (docs/WORKLOADS.md)")
    parser.add_argument("--only-served", action="store_true",
                        help="drop the workload's requests for models the node does not serve (default: refuse to run)")


def profile_from_args(args: argparse.Namespace, served: Iterable[str] | None = None,
                      tier_ttft_ms: Mapping[Priority, float] = DEFAULT_TIER_TTFT_MS,
                      slo: SloSpec = SloSpec(), context_windows: Mapping[str, int] | None = None,
                      ) -> tuple[WorkloadProfile, list[TraceRequest] | None]:
    """(profile, trace): the trace is the user's own (`--trace`) or None (generate it from the profile, which has
    --rate / --duration / --burstiness applied when the command has them). With
    `served`, a workload asking for unserved models is refused, or with `--only-served` trimmed (on stderr)."""
    check_workload_flags(args)  # before a file is read or a trace generated
    trace = None
    if getattr(args, "trace", None):
        trace = load_trace(args.trace, tier_ttft_ms, context_windows)
        profile = profile_of_trace(trace, Path(args.trace).stem, slo)
    else:
        profile = load_workload(args.workload) if getattr(args, "workload", None) else PROFILES[args.profile]
        # --rate is the whole workload's rate, so it applies before unserved models are dropped
        profile = scaled(profile, rate_rps=getattr(args, "rate", None), duration_s=getattr(args, "duration", None),
                         burstiness=getattr(args, "burstiness", None))
    if served is not None:
        asked = [t.model for t in profile.traffic]
        if unserved_models(asked, served):
            if not getattr(args, "only_served", False):
                check_served(asked, served, f"workload {profile.name}")
            dropped = unserved_models(asked, served)
            print(f"--only-served: dropping the requests for {', '.join(dropped)} (not served)", file=sys.stderr)
            profile = only_served_profile(profile, served)
            if trace is not None:
                trace = [r for r in trace if r.model in set(served)]
    return profile, trace


def with_workload_slos(node, profile: WorkloadProfile):
    """`node` with the per-model SLOs the workload sets (a model's `ttft_ms` / `itl_ms`) over its own, so its
    instances are sized and its requests admitted and judged against them."""
    own = {t.model: t for t in profile.traffic if t.ttft_ms is not None or t.itl_ms is not None}
    if not own:
        return node
    models = dict(node.slo.models)
    for name, t in own.items():
        base = node.slo.for_model(name)
        tiers = dict(base.tier_ttft_ms)
        if t.ttft_ms is not None:
            tiers[Priority.STANDARD] = t.ttft_ms
        models[name] = dataclasses.replace(base, ttft_ms=t.ttft_ms or base.ttft_ms, itl_ms=t.itl_ms or base.itl_ms,
                                           tier_ttft_ms=tiers, models={})
    return dataclasses.replace(node, slo=dataclasses.replace(node.slo, models=models))


def node_workload(args: argparse.Namespace, node, replays: bool = True,
                  ) -> tuple[WorkloadProfile, list[TraceRequest] | None]:
    """`profile_from_args` for a node config: its served models, tier SLOs and SLO. A command that `replays` a user
    trace ignores --rate / --duration / --burstiness (the trace says when each request arrives), which it states on
    stderr when they are given; `plan` fits a profile to the trace instead (replays=False), at --rate if given."""
    check_faults(getattr(args, "faults", ()), [i.id for i in node.instances])  # simulate's, before its trace
    node_slo = slo_spec_of(node.slo)
    profile, trace = profile_from_args(args, served=list(node.models), tier_ttft_ms=node.slo.tier_ttft_ms,
                                       slo=node_slo,
                                       context_windows={m: spec.max_context_len for m, spec in node.models.items()})
    if trace is None and node_slo.per_model:  # the node's per-model SLOs over the profile's own
        profile = dataclasses.replace(profile, slo=dataclasses.replace(
            profile.slo, model_ttft_ms=node_slo.model_ttft_ms, model_itl_ms=node_slo.model_itl_ms))
    if trace is not None and not replays and getattr(args, "rate", None) is not None:
        profile = scaled(profile, rate_rps=args.rate)  # the fitted profile at the rate asked for
    elif trace is not None and not replays and trace[-1].arrival_s == 0:  # no span: the fit would be n / 1 ms
        raise UsageError(f"--trace {args.trace}: every request arrives at 0 s, so the trace has no arrival rate to "
                         "plan for; give one with --rate R (req/s)")
    # Each run's arrival window: a replayed trace's own; else --duration (plan's simulations) or the profile's.
    # `plan --top 0` simulates nothing, so its --warmup (default 10 s) does not have to fit a short --duration.
    window_s = profile.duration_s if replays else getattr(args, "duration", None) or profile.duration_s
    if replays or getattr(args, "top", 0) > 0:
        check_warmup(getattr(args, "warmup", None), window_s,
                     "a longer trace" if trace is not None and replays else "a longer --duration")
    if trace is not None and replays:
        ignored = [f"--{k}" for k in ("rate", "duration", "burstiness") if getattr(args, k, None) is not None]
        if ignored:
            print(f"--trace replays the trace's own arrivals: {', '.join(ignored)} ignored", file=sys.stderr)
    return profile, trace
