"""The placements the elastic balancer can choose from, and whether and in which order a node can reach one.

- `candidate_layouts`: every placement of the node's models on its GPUs (TP groups, roles, colocated or split);
- `diff_components`: the groups of GPUs that change hands between two placements, one reconfiguration each;
- `reachable`, `reach_order`, `stranded_models`: whether some order of those changes keeps every model served at
  each step (a model with no instance taking requests for a moment is stranded), and which model blocks it;
- `arrange_near`: a shape laid out on the GPUs so that it moves as few instances as it can from the current one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from octoserve.services.core.placement import InstanceConfig, NodeConfig, num_kv_blocks_for
from octoserve.services.core.reconfig import in_place_role
from octoserve.services.core.types import Role


def _role_splits(n: int) -> list[tuple[Role, ...]]:
    """Roles of n same-shaped instances, in canonical order (prefill, decode, colocated): every (p, d, c) with
    p + d + c = n (the model as a whole must have both sides or neither: `_model_instances` checks that)."""
    out = []
    for p in range(n + 1):
        for d in range(n + 1 - p):
            out.append((Role.PREFILL,) * p + (Role.DECODE,) * d + (Role.COLOCATED,) * (n - p - d))
    return out


def _tp_groups(num_gpus: int, tps: Sequence[int]) -> list[tuple[int, ...]]:
    """Multisets of TP degrees (largest first) that add up to `num_gpus`."""
    if num_gpus == 0:
        return [()]
    out = []
    for tp in sorted(tps, reverse=True):
        if tp <= num_gpus:
            out += [(tp, *rest) for rest in _tp_groups(num_gpus - tp, [t for t in tps if t <= tp])]
    return out


def _model_instances(model: str, tps: tuple[int, ...], first_gpu: int,
                     smallest_first: bool = False) -> list[list[InstanceConfig]]:
    """Every role assignment of instances of TP degrees `tps` laid out from `first_gpu`, the largest TP first (or,
    with `smallest_first`, the smallest; same-TP instances in canonical role order), as lists of instances."""
    by_tp: dict[int, int] = {}
    for tp in tps:
        by_tp[tp] = by_tp.get(tp, 0) + 1
    per_tp = [[(tp, roles) for roles in _role_splits(n)]
              for tp, n in sorted(by_tp.items(), reverse=not smallest_first)]
    combos: list[list[tuple[int, tuple[Role, ...]]]] = [[]]
    for options in per_tp:
        combos = [c + [o] for c in combos for o in options]
    out = []
    for combo in combos:
        roles_all = [r for _, roles in combo for r in roles]
        if (Role.PREFILL in roles_all) != (Role.DECODE in roles_all):
            continue
        insts, gpu = [], first_gpu
        for tp, roles in combo:
            for role in roles:
                insts.append(_instance(model, role, tp, tuple(range(gpu, gpu + tp))))
                gpu += tp
        out.append(insts)
    return out


def candidate_layouts(node: NodeConfig, small_tps: Sequence[int] = (1,)) -> list[tuple[InstanceConfig, ...]]:
    """The placements the balancer may move to, for two models: the larger on the first (or the last, its instances
    then in either TP order) GPUs as instances of any mix of TP degrees (2, 4, 8) whose weights leave KV room, the
    smaller on the rest at
    `small_tps`, every role split of each model (`_role_splits`); each model keeps at least one instance. One model alone: its layouts on
    every GPU. Layouts that fail `check_placement` are left out."""
    from octoserve.services.core.placement import check_placement  # noqa: PLC0415 (a cycle-free local import)

    names = sorted(node.models, key=lambda n: -node.models[n].num_params)
    large = names[0]

    def tps_of(model: str, options: Sequence[int]) -> list[int]:
        spec = node.models[model]
        ok = []
        for tp in options:
            if tp > node.num_gpus or spec.num_attention_heads % tp:
                continue
            probe = InstanceConfig("probe", model, Role.PREFILL, tp, tuple(range(tp)), max_num_batched_tokens=8192)
            if num_kv_blocks_for(replace(node, instances=(probe,)), probe) > 0:
                ok.append(tp)
        return ok

    large_tps = tps_of(large, (1, 2, 4, 8))
    layouts: list[tuple[InstanceConfig, ...]] = []
    if len(names) == 1:
        for groups in _tp_groups(node.num_gpus, large_tps):
            layouts += [tuple(l) for l in _model_instances(large, groups, 0)]
    else:
        small = names[1]
        s_tps = tps_of(small, small_tps)
        for large_gpus in range(1, node.num_gpus):
            small_gpus = node.num_gpus - large_gpus
            for lg in _tp_groups(large_gpus, large_tps):
                for sg in _tp_groups(small_gpus, s_tps):
                    for li in _model_instances(large, lg, 0):
                        layouts += [tuple(li + si) for si in _model_instances(small, sg, large_gpus)]
                    # and mirrored (the smaller model first), so a pool can grow or shrink from either end; there
                    # the larger model's instances also in the other order, so that it grows and shrinks at its
                    # inner edge too (a TP 4 on GPUs 4-7 gains a TP 2 on GPUs 2-3 without moving)
                    orders = (False, True) if len(set(lg)) > 1 else (False,)
                    for si in _model_instances(small, sg, 0):
                        layouts += [tuple(si + li) for o in orders for li in _model_instances(large, lg, small_gpus, o)]
    return [l for l in layouts if not check_placement(replace(node, instances=l, gang=None))]


def _signature(inst: InstanceConfig) -> tuple:
    return (inst.model, inst.role, inst.tp, inst.gpu_ids)


def diff_components(current: Sequence[InstanceConfig], target: Sequence[InstanceConfig]
                    ) -> list[tuple[tuple[InstanceConfig, ...], tuple[InstanceConfig, ...]]]:
    """Groups of (current instances, target instances) that hold the same GPUs and differ; unchanged ones left out.

    Two instances are in one group when their GPUs overlap, transitively; a group is unchanged when its current and
    target instances have the same model, role, TP and GPUs. Ordered by first GPU."""
    cur_sig = {_signature(i) for i in current}
    tgt_sig = {_signature(i) for i in target}
    cur = [i for i in current if _signature(i) not in tgt_sig]
    tgt = [i for i in target if _signature(i) not in cur_sig]
    groups: list[tuple[set[int], list[InstanceConfig], list[InstanceConfig]]] = []
    for inst, side in [(i, 0) for i in cur] + [(i, 1) for i in tgt]:
        gpus = set(inst.gpu_ids)
        merged = [g for g in groups if g[0] & gpus]
        new = (gpus, [], [])
        for g in merged:
            groups.remove(g)
            new[0].update(g[0])
            new[1].extend(g[1])
            new[2].extend(g[2])
        new[1 + side].append(inst)
        groups.append(new)
    out = [(tuple(sorted(c, key=lambda i: i.gpu_ids)), tuple(sorted(t, key=lambda i: i.gpu_ids)))
           for _, c, t in sorted(groups, key=lambda g: min(g[0]))]
    return [(c, t) for c, t in out if c and t]


def serving_models(instances: Sequence[InstanceConfig]) -> set[str]:
    """Models that `instances` can serve a request of: a colocated instance, or a prefill and a decode instance."""
    roles: dict[str, set[Role]] = {}
    for i in instances:
        roles.setdefault(i.model, set()).add(i.role)
    return {m for m, r in roles.items() if Role.COLOCATED in r or {Role.PREFILL, Role.DECODE} <= r}


def layout_key(layout: Sequence[InstanceConfig]) -> tuple:
    return tuple(sorted(_signature(i) for i in layout))


def layout_shape(layout: Sequence[InstanceConfig]) -> tuple:
    """A layout up to where its instances sit: each instance's model, TP degree and role (what the capacity estimate
    scores)."""
    return tuple(sorted((i.model, i.tp, i.role.value) for i in layout))


def arrange_near(current: Sequence[InstanceConfig], shape: tuple, num_gpus: int, in_place: bool = False,
                 keep_low: bool = True) -> tuple[InstanceConfig, ...] | None:
    """A layout of `shape` (`layout_shape`) built around `current`: the instances that already have a place in it
    stay as they are; then those of a model and TP degree it still needs change role where they are (decode <->
    colocated first, when such changes run in place); what is left is laid out on the GPUs freed and unused, largest
    TP first, each on the lowest contiguous run that fits. `keep_low`: of equal instances, the lowest-numbered GPUs'
    stay (else the highest's). None when the freed GPUs do not fit what is left."""
    want = Counter(shape)
    order = sorted(current, key=lambda i: i.gpu_ids, reverse=not keep_low)
    kept: list[InstanceConfig] = []
    rest = []
    for inst in order:
        key = (inst.model, inst.tp, inst.role.value)
        if want[key] > 0:
            want[key] -= 1
            kept.append(inst)
        else:
            rest.append(inst)
    freed: set[int] = set(range(num_gpus)) - {g for i in current for g in i.gpu_ids}
    for inst in rest:
        roles = [Role(k[2]) for k, n in want.items() if n > 0 and k[:2] == (inst.model, inst.tp)]
        if not roles:
            freed.update(inst.gpu_ids)
            continue
        role = min(roles, key=lambda r: (not (in_place and in_place_role(inst.role, r)), r.value))
        want[(inst.model, inst.tp, role.value)] -= 1
        kept.append(_instance(inst.model, role, inst.tp, inst.gpu_ids))
    for model, tp, role in sorted(want.elements(), key=lambda k: (-k[1], k)):
        free = sorted(freed)
        run = next((free[k:k + tp] for k in range(len(free) - tp + 1) if free[k + tp - 1] - free[k] == tp - 1), None)
        if run is None:
            return None
        kept.append(_instance(model, Role(role), tp, tuple(run)))
        freed.difference_update(run)
    return tuple(sorted(kept, key=lambda i: i.gpu_ids))


def _instance(model: str, role: Role, tp: int, gpus: tuple[int, ...]) -> InstanceConfig:
    """A candidate layout's instance, as `_model_instances` builds them."""
    tokens = 8192 if role is Role.PREFILL else 2048
    return InstanceConfig(f"{model}-{role.value}-g{gpus[0]}", model, role, tp, tuple(gpus), max_num_batched_tokens=tokens)


def layout_distance(current: Sequence[InstanceConfig], target: Sequence[InstanceConfig], in_place: bool) -> tuple:
    """How far `target` is from `current`, to order layouts of one shape: the GPUs whose weights would load (model
    changes), then the GPUs that would change role with a drain, then those changing role in place, then the
    number of changes."""
    loads = drains = flips = 0
    comps = diff_components(current, target)
    for cur, tgt in comps:
        gpus = len({g for i in cur for g in i.gpu_ids})
        if not role_only(cur, tgt):
            loads += gpus
        elif in_place and runs_in_place(cur, tgt):
            flips += gpus
        else:
            drains += gpus
    return loads, drains, flips, len(comps)


def orphaned_by(cur: Sequence[InstanceConfig], tgt: Sequence[InstanceConfig], others: Sequence[InstanceConfig],
                in_place: bool = False) -> set[str]:
    """The models of `cur` that no instance would serve while the change `cur` -> `tgt` is out, `others` serving
    beside it. An in-place role change (`in_place_role`, with `in_place`) keeps its instance serving: in its old
    role until the switch, then in the new one, so `others` with the new role must serve its model."""
    keep = list(tgt) if in_place and runs_in_place(cur, tgt) else []
    return {i.model for i in cur} - serving_models([*others, *keep])


def reachable(current: Sequence[InstanceConfig], target: Sequence[InstanceConfig], in_place: bool = False) -> bool:
    """Whether `target` can be reached from `current` one change (`diff_components`) at a time with every model
    served throughout: each change, started once the ones before it are done, leaves the models of the instances it
    retires served by the rest (`orphaned_by`). Without in-place role changes (`in_place` False), a 70B whose only
    decoding instance must change role while its other instance goes cannot (it would be unserved for a moment):
    such a target is never chosen, rather than started halfway. With them, the decoding instance changes role in
    place first and the other goes after."""
    return reach_order(current, target, in_place) is not None


def reach_order(current: Sequence[InstanceConfig], target: Sequence[InstanceConfig], in_place: bool = False
                ) -> list[tuple[tuple[InstanceConfig, ...], tuple[InstanceConfig, ...]]] | None:
    """The changes from `current` to `target` in an order that keeps every model served (`reachable`); None when
    there is none."""
    placement = list(current)
    comps = diff_components(current, target)
    out = []
    while comps:
        for k, (cur, tgt) in enumerate(comps):
            rest = [i for i in placement if i not in cur]
            if not orphaned_by(cur, tgt, rest, in_place):
                placement = rest + list(tgt)
                out.append(comps.pop(k))
                break
        else:
            return None
    return out


def stranded_models(current: Sequence[InstanceConfig], target: Sequence[InstanceConfig], in_place: bool = False
                    ) -> list[str]:
    """The models that block `target` (`reachable` False): once the changes that can go first are done, each change
    left would leave one of these without a serving instance (`serving_models`). Empty when `target` is reachable."""
    placement = list(current)
    comps = diff_components(current, target)
    progress = True
    while comps and progress:
        progress = False
        for k, (cur, tgt) in enumerate(comps):
            rest = [i for i in placement if i not in cur]
            if not orphaned_by(cur, tgt, rest, in_place):
                placement = rest + list(tgt)
                comps.pop(k)
                progress = True
                break
    return sorted({m for cur, tgt in comps for m in orphaned_by(cur, tgt, [i for i in placement if i not in cur],
                                                                 in_place)})


def layout_text(layout: Sequence[InstanceConfig]) -> str:
    return " | ".join(f"{m} {shape_text(shape_of(layout, m))}" for m in sorted({i.model for i in layout}))


def role_only(cur: Sequence[InstanceConfig], tgt: Sequence[InstanceConfig]) -> bool:
    """A change of one instance's role on the same GPUs, model and TP (no weights move)."""
    return (len(cur) == len(tgt) == 1 and cur[0].gpu_ids == tgt[0].gpu_ids and cur[0].model == tgt[0].model
            and cur[0].tp == tgt[0].tp)


def runs_in_place(cur: Sequence[InstanceConfig], tgt: Sequence[InstanceConfig]) -> bool:
    """A role change that may run in place: one instance, same GPUs, model and TP, decode <-> colocated."""
    return role_only(cur, tgt) and in_place_role(cur[0].role, tgt[0].role)


def shape_of(instances: Sequence[InstanceConfig], model: str) -> tuple:
    """One model's placement shape: how many instances of each (TP, role) it has (where they sit does not matter)."""
    return tuple(sorted(Counter((i.tp, i.role.value) for i in instances if i.model == model).items()))


def shape_gpus(shape: tuple) -> int:
    return sum(tp * n for (tp, _), n in shape)


def shape_text(shape: tuple) -> str:
    return " ".join(f"TP{tp}{role[0].upper()}x{n}" for (tp, role), n in shape)

