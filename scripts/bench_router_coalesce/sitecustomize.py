"""Experiment for scripts/bench_router.py --worker-coalesce (never imported by the services themselves).

Put on PYTHONPATH of a node started by the bench, it patches the decode worker's Attach so that every StepBatch
queued behind the one about to be sent leaves in the same message: when the router lags, it reads several steps per
read and writes several tokens per client message. It is what decode_worker/servicer.py would do; the bench measures
it before that file changes.
"""
import os

def _is_decode_worker() -> bool:
    try:
        return b"decode_worker" in open("/proc/self/cmdline", "rb").read()
    except OSError:
        return False

if os.environ.get("OCTOSERVE_BENCH_COALESCE") == "1" and _is_decode_worker():
    from octoserve.decode_worker import servicer as ds
    from octoserve.services.rpc.gen import worker_pb2 as w_pb

    async def Attach(self, request, context):
        session = ds.Session(request.session_id)
        old = self.sessions.pop(request.session_id, None)
        if old is not None:
            old.close()
        self.sessions[request.session_id] = session
        try:
            yield w_pb.StepBatch(seq=0)
            done = False
            while not done and (batch := await session.batches.get()) is not None:
                deltas, seq = list(batch.deltas), batch.seq
                while not session.batches.empty():
                    nxt = session.batches.get_nowait()
                    if nxt is None:
                        done = True
                        break
                    deltas.extend(nxt.deltas)
                    seq = nxt.seq
                self.metrics.step_batch.observe(len(deltas))
                yield w_pb.StepBatch(seq=seq, deltas=deltas)
        finally:
            await self._detach(session)

    ds.DecodeWorkerServicer.Attach = Attach

