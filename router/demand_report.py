"""The router's arrivals and admission refusals per model, reported to the scheduler every `REPORT_S`
(`Scheduler.ReportDemand`): the elastic balancer's demand input (services/core/live_balancer.py). Arrivals are
counted where the policy sees every request it routes (`RouterPolicy.observers`), refused ones included; refusals
where it refuses one (`RouterPolicy.refusal_observers`), by the refusal's reason (`Refuse.reason`), so each report's
refusals are among its arrivals. A report that fails (the scheduler restarts) is dropped, not retried: the
balancer's window is about the recent past.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from octoserve.services import trust
from octoserve.services.rpc.gen import scheduler_pb2 as s_pb
from octoserve.services.rpc.gen import scheduler_pb2_grpc as s_grpc

log = logging.getLogger("octoserve.router.demand")

REPORT_S = 1.0


class DemandReporter:
    def __init__(self, scheduler_address: str, policy) -> None:
        self.address = scheduler_address
        self.counts: dict[str, list[int]] = {}  # model -> [arrivals, prompt tokens, output tokens]
        self.refused: dict[str, dict[str, int]] = {}  # model -> reason -> refusals
        self._task: asyncio.Task | None = None
        policy.observers.append(self.observe)
        policy.refusal_observers.append(self.observe_refusal)

    def observe(self, spec) -> None:
        c = self.counts.setdefault(spec.model, [0, 0, 0])
        c[0] += 1
        c[1] += spec.num_prompt_tokens
        c[2] += spec.sim_output_len or spec.sampling.max_tokens

    def observe_refusal(self, spec, refusal) -> None:
        mine = self.refused.setdefault(spec.model, {})
        mine[refusal.reason] = mine.get(refusal.reason, 0) + 1

    def report(self, interval_s: float) -> s_pb.DemandReport:
        """The counts since the previous report, as a report; the counts start again from zero."""
        counts, self.counts = self.counts, {}
        refused, self.refused = self.refused, {}
        return s_pb.DemandReport(interval_s=interval_s, models=[
            s_pb.ModelArrivals(model=m, arrivals=c[0], prompt_tokens=c[1], output_tokens=c[2],
                               refused=refused.get(m, {}))
            for m, c in sorted(counts.items())])

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="demand-report")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        async with trust.channel(self.address) as channel:
            stub = s_grpc.SchedulerStub(channel)
            last = time.monotonic()
            while True:
                await asyncio.sleep(REPORT_S)
                now = time.monotonic()
                report = self.report(now - last)
                last = now
                try:
                    await stub.ReportDemand(report, timeout=REPORT_S)
                except grpc.aio.AioRpcError as e:
                    log.debug("demand report dropped", extra={"fields": {"code": e.code().name}})
