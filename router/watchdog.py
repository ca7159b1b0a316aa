"""The router's progress watchdog: a worker whose process lives but says nothing (stopped by SIGSTOP, an event loop
wedged in a blocking call) is treated as lost within `hung_after_s`.

A worker pushes a load snapshot over its WatchLoad stream every 10 ms of the modelled clock, at most every 250 ms
of wall (router/pool.py `load_interval_ms`). A broken stream is the crash path
(router/pool.py, router/failover.py); a silent stream that stays open is this one. (A worker whose engine loop is
stuck while the rest of the process runs exits by its own progress check, services/rpc/stall_watch.py: the crash
path.) When an instance that was reporting has sent
nothing for `hung_after_s` wall seconds:
- it is unroutable (`mark_down`) and its prefix-index entries are dropped;
- every request placed on it is ended or moved as on a crash: a worker RPC still waiting on it (a submission, a
  reservation, a prefill) is cancelled first, since a stopped peer never fails it; then a request with no token yet
  is placed again elsewhere, and one that has streamed is continued on another instance (router/failover.py);
- the ids of those requests are remembered: any delta the instance sends for them later (it resumed, SIGCONT) is
  dropped, so the client never receives a token twice, and when its reports resume the router Aborts them there
  (freeing their KV) before forgetting them.
Counted in `octoserve_router_hung_workers_total{instance}`. The launcher's supervisor kills and restarts a stopped
or unresponsive worker on its side (services/node/hang_watch.py); this watchdog only routes around it.
"""

from __future__ import annotations

import asyncio
import logging
import time

import prometheus_client as prom

from octoserve.services.rpc.gen import worker_pb2 as w_pb

log = logging.getLogger("octoserve.router.watchdog")

DEFAULT_HUNG_AFTER_S = 3.0  # 300 missed load reports undilated, 30 at 10x, 12 at the slowest interval
CHECK_EVERY_S = 0.1
LATE_WAKEUP_S = 0.5  # the watchdog itself woke this late: the router was stalled, not (only) the worker
ABORT_TIMEOUT_S = 5.0


class HangWatchdog:
    def __init__(self, servicer, hung_after_s: float = DEFAULT_HUNG_AFTER_S) -> None:
        if not hung_after_s > 0:
            raise ValueError(f"hung_after_s must be > 0 seconds, got {hung_after_s}")
        self.s = servicer
        self.hung_after_s = hung_after_s
        self.hung_total = prom.Counter("octoserve_router_hung_workers", "workers declared hung (no load report for "
                                       "the watchdog's limit while their stream stayed open), count", ["instance"],
                                       registry=servicer.metrics.registry)
        self._task: asyncio.Task | None = None
        self._recoveries: set[asyncio.Task] = set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="hang-watchdog")

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._recoveries) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self) -> None:
        last = time.monotonic()
        quiet_until = 0.0
        while True:
            await asyncio.sleep(CHECK_EVERY_S)
            now = time.monotonic()
            if now - last > CHECK_EVERY_S + LATE_WAKEUP_S:
                # This process did not run for a while (a CPU-starved machine, a long GC): the reports wait in its
                # buffers. Give it a whole limit to read them before judging any worker.
                quiet_until = now + self.hung_after_s
            last = now
            if now >= quiet_until:
                for client in self.suspects(now):
                    await self.declare_hung(client, now - client.last_report_s)

    def suspects(self, now: float) -> list:
        """Instances silent past the limit while another instance reported within half of it (when the router
        has several): if every instance fell silent at once, the router, not the workers, is the likelier cause."""
        clients = list(self.s.pool.clients.values())
        live = [c for c in clients if not c.hung and c.reachable and c.last_report_s is not None]
        silent = [c for c in live if now - c.last_report_s > self.hung_after_s]
        if not silent:
            return []
        if len(clients) > 1 and not any(now - c.last_report_s <= self.hung_after_s / 2 for c in live if c not in silent):
            return []
        return silent

    async def declare_hung(self, client, silent_s: float) -> None:
        iid = client.instance_id
        reason = (f"worker {iid} sent no load report for {silent_s:.1f} s while its connection stayed open "
                  f"(hung or stopped)")
        client.hung = True
        client.mark_down()
        self.hung_total.labels(iid).inc()
        placed = [st for st in self.s.requests.values() if iid in st.instance_ids and not st.closed]
        client.ignored.update(st.spec.request_id for st in placed)
        waiting = [st.dispatch for st in placed if st.dispatch is not None and not st.dispatch.done()]
        for task in waiting:  # a stopped peer never fails these RPCs: cancel them so the requests can move
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        log.warning("worker hung: routing around it", extra={"fields": {
            "instance": iid, "silent_s": round(silent_s, 2), "requests": len(placed)}})
        self.s.failover.worker_down(iid, reason, "hang")

    def resumed(self, client) -> None:
        """A client's `on_resumed`: its instance reports again after it was declared hung."""
        # Without having restarted (or after a restart, on the same session): free what it still holds.
        client.hung = False
        if client.ignored:
            task = asyncio.create_task(self._abort_orphans(client, set(client.ignored)))
            self._recoveries.add(task)
            task.add_done_callback(self._recoveries.discard)

    async def _abort_orphans(self, client, request_ids: set[str]) -> None:
        results = await asyncio.gather(
            *(client.stub.Abort(w_pb.AbortRequest(request_id=rid), timeout=ABORT_TIMEOUT_S) for rid in request_ids),
            return_exceptions=True)
        log.info("requests moved off a hung worker aborted there", extra={"fields": {
            "instance": client.instance_id, "requests": len(request_ids),
            "failed": sum(1 for r in results if isinstance(r, BaseException))}})
        client.ignored.difference_update(request_ids)
