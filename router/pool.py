"""The router's connections to the workers: one channel, one Attach session and one WatchLoad stream per worker.

- Attach: the worker's per-step token batches for every request this router submitted there; each delta is handed
  to `on_delta` (a dict lookup and a list append in the router). A broken session fails that worker's requests
  (`on_down`) and is re-opened with bounded backoff.
- Submit: colocated requests start as messages on one open stream (services/rpc/submit.py), opened on first use.
- WatchLoad: pushed `EngineLoad` snapshots (and KV events for the prefix index) kept in `loads`; while the stream
  is down the worker's snapshot is marked unhealthy, so routing skips it, and its prefix-index entries are dropped
  (`on_kv_lost`): the next stream reports only new events.
- A lost worker (its process died: either stream breaks at once) is unroutable from that moment (`mark_down`)
  until both streams are back; a snapshot that arrives while the token session is still down stays unhealthy,
  so a request is never placed on a worker that has no session to stream it back on. Reconnects back off from
  50 ms to 2 s, and the channel's own reconnect backoff is capped at 1 s, so a restarted worker rejoins within
  about a second of serving again.
Invariant: `ready()` only once every worker confirmed its session and sent a first load snapshot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from octoserve.services import trust
from octoserve.services.core.types import EngineLoad, KVEvent
from octoserve.services.rpc import convert
from octoserve.services.rpc.submit import SubmitStream
from octoserve.services.rpc.gen import worker_pb2 as w_pb
from octoserve.services.rpc.gen import worker_pb2_grpc as w_grpc

log = logging.getLogger("octoserve.router.pool")

# The token session's HTTP/2 window is bounded (no BDP probing, 64 KiB per stream, a few steps of StepBatches):
# grpc.aio hands the router one message per event-loop cycle, so when the router is behind, an open window lets the
# worker park seconds of steps in this process's gRPC buffers, invisible to Python, where every new request's first
# token queues behind them (scripts/bench_router.py measured ~1 s added TTFT at 128 streams). A bounded window
# keeps that backlog on the worker, where it can be sent as fewer, larger messages, and router latency bounded.
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", 64 * 1024),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
RECONNECT_BACKOFF_S = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
LOAD_INTERVAL_MS = 10  # modelled ms: the router's view of a worker is at most this old
MAX_LOAD_INTERVAL_WALL_MS = 250  # a dozen reports within the hang watchdog's default 3 s, however dilated the clock
REPORTS_PER_HANG_LIMIT = 12  # a worker sends at least this many reports inside the watchdog's silence limit


def load_interval_ms(time_scale: float, hung_after_s: float | None = None) -> int:
    """The wall interval the router asks of a worker's load stream: LOAD_INTERVAL_MS of the modelled clock, so a
    node dilated K times sees each worker as often per modelled step as an undilated one (and its processes do not
    spend K times the CPU on reports per step), at most MAX_LOAD_INTERVAL_WALL_MS, and at most a
    REPORTS_PER_HANG_LIMIT-th of the hang watchdog's `hung_after_s` (a watchdog set tighter than its default must
    not take a healthy but dilated worker's gap between reports for silence)."""
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    cap_ms = float(MAX_LOAD_INTERVAL_WALL_MS)
    if hung_after_s is not None:
        if not hung_after_s > 0:
            raise ValueError(f"hung_after_s must be > 0 seconds, got {hung_after_s}")
        cap_ms = min(cap_ms, hung_after_s * 1000.0 / REPORTS_PER_HANG_LIMIT)
    return max(1, int(min(cap_ms, round(LOAD_INTERVAL_MS * time_scale))))


@dataclass(frozen=True, slots=True)
class WorkerEndpoint:
    instance_id: str
    address: str
    streams_tokens: bool  # colocated / decode: it has an Attach session; prefill workers only answer unary calls


class WorkerClient:
    """One worker as the router sees it."""

    def __init__(
        self,
        endpoint: WorkerEndpoint,
        session_id: str,
        on_delta: Callable[[w_pb.TokenDelta], None],
        on_down: Callable[[str, str, str], None],  # (instance id, reason, cause: router/failover.py CAUSES)
        on_kv_events: Callable[[str, Sequence[KVEvent]], None],
        on_kv_lost: Callable[[str], None] = lambda instance_id: None,
        load_interval_ms: int = LOAD_INTERVAL_MS,
    ) -> None:
        self.instance_id = endpoint.instance_id
        self.address = endpoint.address
        self.streams_tokens = endpoint.streams_tokens
        self.session_id = session_id
        self.load_interval_ms = load_interval_ms
        self.channel = trust.channel(endpoint.address, options=CHANNEL_OPTIONS)
        self.stub = w_grpc.WorkerStub(self.channel)
        self.submits = SubmitStream(self.stub, endpoint.instance_id)  # colocated requests start here
        self.load: EngineLoad | None = None
        self.attached = asyncio.Event()
        self.reachable = True  # False from a broken stream until the next snapshot: no cleanup RPCs are sent there
        # The hang watchdog's view (router/watchdog.py): when the last snapshot came, whether the instance was
        # declared hung, and the requests moved off it then, whose late deltas are dropped.
        self.last_report_s: float | None = None
        self.hung = False
        self.ignored: set[str] = set()
        self.on_resumed: Callable[[WorkerClient], None] = lambda client: None
        self.retiring = False  # changed role or left the placement: the token stream ends when the worker ends it
        self._on_delta = on_delta
        self._on_down = on_down
        self._on_kv_events = on_kv_events
        self._on_kv_lost = on_kv_lost
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._load_loop(), name=f"load-{self.instance_id}")]
        if self.streams_tokens:
            self._tasks.append(asyncio.create_task(self._attach_loop(), name=f"attach-{self.instance_id}"))

    async def close(self) -> None:
        self.stop_streams()
        self.submits.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.channel.close()

    def stop_streams(self) -> None:
        """Ends the token session and load stream for good (a session replaced by a new one to the same worker must
        not reconnect: both use this router's session id, and the worker keeps one session per id)."""
        for task in self._tasks:
            task.cancel()

    def retire(self) -> None:
        """A graceful end, for an instance that drained and then changed role or left the placement: the load
        stream stops now; the token stream is read until the worker ends it, so the last tokens of requests that
        finished in the drain still arrive (they may be behind the placement change), and its end is neither
        reported as a lost worker nor reconnected (a new session to the same worker uses this router's session
        id). `close` ends whatever is left."""
        self.retiring = True
        for task in self._tasks:
            if task.get_name().startswith("load-"):
                task.cancel()

    async def _attach_loop(self) -> None:
        attempt = 0
        while True:
            try:
                async for batch in self.stub.Attach(w_pb.AttachRequest(session_id=self.session_id)):
                    if batch.seq == 0:
                        self.attached.set()
                        attempt = 0
                    ignored = self.ignored
                    for delta in batch.deltas:
                        if ignored and delta.request_id in ignored:
                            continue  # moved off this instance while it was hung: the client has it elsewhere
                        self._on_delta(delta)
                # A killed process cannot end the stream cleanly: this worker ended it itself (it drained and
                # stopped, with requests its grace did not cover).
                reason, cause = "the worker closed the token stream", "drain"
            except grpc.aio.AioRpcError as e:
                reason, cause = f"token stream from {self.instance_id} failed: {e.code().name} {e.details()}", "crash"
            except Exception:  # a bug in delta handling must not silently end the session for every request
                log.exception("token session handling failed", extra={"fields": {"instance": self.instance_id}})
                reason, cause = f"the router failed handling tokens from {self.instance_id}", "crash"
            if self.retiring:
                return
            self.attached.clear()
            self.mark_down()
            self._on_down(self.instance_id, reason, cause)
            await asyncio.sleep(RECONNECT_BACKOFF_S[min(attempt, len(RECONNECT_BACKOFF_S) - 1)])
            attempt += 1

    async def _load_loop(self) -> None:
        attempt = 0
        while True:
            try:
                async for report in self.stub.WatchLoad(w_pb.WatchLoadRequest(interval_ms=self.load_interval_ms)):
                    load = convert.load_from_pb(report)
                    if self.streams_tokens and not self.attached.is_set() and load.healthy:
                        load = dataclasses.replace(load, healthy=False)  # no session to stream tokens back yet
                    self.load = load
                    self.reachable = True
                    self.last_report_s = time.monotonic()
                    if self.hung:
                        self.on_resumed(self)
                    attempt = 0
                    if report.kv_events:
                        self._on_kv_events(self.instance_id, convert.kv_events_from_pb(report.kv_events))
            except grpc.aio.AioRpcError as e:
                log.warning("load stream down", extra={"fields": {"instance": self.instance_id, "code": e.code().name}})
            # A new stream carries only the KV events from its start (a restarted worker's cache is empty): what
            # the router knew of this instance's cache is stale, and would otherwise be kept forever.
            self._on_kv_lost(self.instance_id)
            self.mark_down()
            await asyncio.sleep(RECONNECT_BACKOFF_S[min(attempt, len(RECONNECT_BACKOFF_S) - 1)])
            attempt += 1

    def mark_down(self) -> None:
        """Unroutable from now until fresh snapshots arrive over a live session."""
        self.reachable = False
        if self.load is not None and self.load.healthy:
            self.load = dataclasses.replace(self.load, healthy=False)

    def ready(self) -> bool:
        attached = self.attached.is_set() or not self.streams_tokens
        return attached and self.load is not None and self.load.healthy


class WorkerPool:
    def __init__(self, clients: dict[str, WorkerClient]) -> None:
        self.clients = clients
        self.retired: dict[str, WorkerClient] = {}  # left the placement, closed soon (router/placement_watch.py)

    def start(self) -> None:
        for client in self.clients.values():
            client.start()

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients.values()))

    def loads(self) -> dict[str, EngineLoad]:
        return {iid: c.load for iid, c in self.clients.items() if c.load is not None}

    def ready(self) -> bool:
        return all(c.ready() for c in self.clients.values())

    def __getitem__(self, instance_id: str) -> WorkerClient:
        client = self.clients.get(instance_id)
        return client if client is not None else self.retired[instance_id]
