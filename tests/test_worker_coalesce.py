"""A worker folds step batches queued behind the one it is sending into one message, in order."""

import asyncio

from octoserve.decode_worker.servicer import _coalesce
from octoserve.services.rpc.gen import worker_pb2 as w_pb


def batch(seq, *ids):
    return w_pb.StepBatch(seq=seq, deltas=[w_pb.TokenDelta(request_id=r, token_ids=[seq]) for r in ids])


def test_queued_batches_fold_into_one_message_in_order():
    q: asyncio.Queue = asyncio.Queue()
    q.put_nowait(batch(2, "a"))
    q.put_nowait(batch(3, "a", "b"))
    merged, closed = _coalesce(batch(1, "a", "b"), q)
    assert not closed and q.empty()
    assert merged.seq == 3
    assert [(d.request_id, list(d.token_ids)) for d in merged.deltas] == [
        ("a", [1]), ("b", [1]), ("a", [2]), ("a", [3]), ("b", [3])
    ]


def test_a_close_behind_the_batch_is_reported_and_nothing_after_it_is_read():
    q: asyncio.Queue = asyncio.Queue()
    q.put_nowait(batch(2, "a"))
    q.put_nowait(None)
    q.put_nowait(batch(9, "z"))
    merged, closed = _coalesce(batch(1, "a"), q)
    assert closed and merged.seq == 2 and len(merged.deltas) == 2 and q.qsize() == 1


def test_an_empty_queue_leaves_the_batch_alone():
    merged, closed = _coalesce(batch(5, "a"), asyncio.Queue())
    assert (merged.seq, len(merged.deltas), closed) == (5, 1, False)
