"""Support for the hypothesis fuzz tests: an in-process node on its own event-loop thread, and the rules every answer
of a fuzzed API must follow.

The node (real router, real workers, real SimEngines, real gRPC on 127.0.0.1) runs on a background thread so
hypothesis' synchronous `@given` tests can drive it with `run(coro)`. Example counts come from
OCTOSERVE_FUZZ_EXAMPLES (`make fuzz` sets 10,000 per API; `make test` runs the seeded default sample).
"""

from __future__ import annotations

import asyncio
import os
import threading

import grpc
from hypothesis import HealthCheck, settings

from tests.service_fixtures import InProcessNode, start_inprocess_node

FUZZ_EXAMPLES = int(os.environ.get("OCTOSERVE_FUZZ_EXAMPLES", "150"))
FULL_RUN = "OCTOSERVE_FUZZ_EXAMPLES" in os.environ

# A seeded, bounded sample in CI; a random, long one under `make fuzz`.
FUZZ_SETTINGS = settings(
    max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=not FULL_RUN, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
                           HealthCheck.function_scoped_fixture],
)

# Codes a fuzzed request may get: each is a typed answer the client can act on. Never INTERNAL / UNKNOWN (a bug),
# never a crash (UNAVAILABLE from a dead service), and never a hang: DEADLINE_EXCEEDED is the client's own deadline
# running out on a call the node did not answer, so it is a failure, not an answer.
TYPED_CODES = {
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.ABORTED, grpc.StatusCode.PERMISSION_DENIED,
}
# Words an INVALID_ARGUMENT message uses to say what to change.
ADVICE = ("set ", "send", "use ", "shorten", "lower", "remove", "re-tokenize", "leave it", "give it", "choose",
          "raise", "at most", "at least")


class NodeThread:
    """An InProcessNode living on its own loop thread."""

    def __init__(self, **kwargs) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-node", daemon=True)
        self.thread.start()
        self.node: InProcessNode = self.run(start_inprocess_node(**kwargs), timeout_s=60.0)

    def run(self, coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        self.run(self.node.stop(), timeout_s=60.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10.0)


def assert_typed(code: grpc.StatusCode, details: str, what: str) -> None:
    assert code in TYPED_CODES, f"{what}: {code.name} {details!r}"
    if code != grpc.StatusCode.OK:
        assert details, f"{what}: {code.name} without a message"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert any(word in details for word in ADVICE), f"{what}: the message does not say what to change: {details!r}"
