"""Fault injection for tests and drills: faults named in the OCTOSERVE_FAULTS environment variable, consulted by
the code that would meet them in production. Empty (the default): nothing is injected and the cost is one
attribute check.

    OCTOSERVE_FAULTS="kv_transfer=slow:8,corrupt,ok"
    OCTOSERVE_FAULTS="engine_stall=c0@150"

`kv_transfer` is a cycle of outcomes applied to a decode worker's KV transfers in arrival order: `ok`, `slow:S`
(the transfer takes S seconds longer) or `corrupt` (the transfer arrives and fails verification).
`engine_stall=INSTANCE@N`: the sim engine of that instance stops stepping after its N-th step (its step loop stuck;
the process, its gRPC server and its load reports carry on), in every life of the process that reaches N steps. Process faults
(a worker, the scheduler or the router killed) need no plan: tests and the soak send SIGKILL to the process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

ENV = "OCTOSERVE_FAULTS"


@dataclass(frozen=True, slots=True)
class KVTransferFault:
    kind: str  # "ok", "slow", "corrupt"
    delay_s: float = 0.0


class FaultPlan:
    def __init__(self, kv_transfer: tuple[KVTransferFault, ...] = (),
                 engine_stall: tuple[str, int] | None = None) -> None:
        self.kv_transfer = kv_transfer
        self.engine_stall = engine_stall  # (instance id, steps) or None
        self._next_transfer = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> FaultPlan:
        return cls.parse(environ.get(ENV, ""))

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        transfers: list[KVTransferFault] = []
        engine_stall = None
        for part in filter(None, (p.strip() for p in text.split(";"))):
            name, _, value = part.partition("=")
            if name.strip() == "engine_stall":
                instance, _, steps = value.strip().partition("@")
                if not instance or not steps.isdigit():
                    raise ValueError(f"{ENV}: engine_stall needs INSTANCE@STEPS, as engine_stall=c0@150; got {value!r}")
                engine_stall = (instance, int(steps))
                continue
            if name.strip() != "kv_transfer":
                raise ValueError(f"{ENV}: unknown fault {name.strip()!r}; known: kv_transfer, engine_stall")
            for item in (v.strip() for v in value.split(",")):
                kind, _, arg = item.partition(":")
                if kind == "slow":
                    try:
                        transfers.append(KVTransferFault("slow", float(arg)))
                    except ValueError:
                        raise ValueError(f"{ENV}: kv_transfer slow needs seconds, as slow:8; got {item!r}") from None
                elif kind in ("ok", "corrupt") and not arg:
                    transfers.append(KVTransferFault(kind))
                else:
                    raise ValueError(f"{ENV}: kv_transfer outcomes are ok, slow:S or corrupt; got {item!r}")
        return cls(tuple(transfers), engine_stall)

    def apply_to_engine(self, engine) -> None:
        """Arms `engine_stall` on the engine it names (a sim engine; other engines have no such hook)."""
        if self.engine_stall is not None and self.engine_stall[0] == engine.instance_id:
            if not hasattr(engine, "stall_after_steps"):
                raise ValueError(f"{ENV}: engine_stall is a sim-engine fault; {engine.instance_id} runs another engine")
            engine.stall_after_steps = self.engine_stall[1]

    def next_kv_transfer(self) -> KVTransferFault | None:
        """The outcome of the next KV transfer, or None when no transfer fault is planned."""
        if not self.kv_transfer:
            return None
        fault = self.kv_transfer[self._next_transfer % len(self.kv_transfer)]
        self._next_transfer += 1
        return fault
