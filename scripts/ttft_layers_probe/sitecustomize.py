"""Stage timestamps inside the decode_worker process, for scripts/ttft_layers.py (put this folder first on PYTHONPATH).

  TTFT_LAYERS_STAGE_LOG=bench-out/stagelog/client.txt PYTHONPATH=scripts/ttft_layers_probe \\
      .venv/bin/python scripts/ttft_layers.py --phase node --n 24
Writes worker.txt next to that client log (request_id stage monotonic_s): Generate received, engine call, first engine output,
Session flush, Attach yield. A diagnostic patch, never loaded by octoserve itself.
"""
import time
try:
    _cmd = open("/proc/self/cmdline", "rb").read().split(b"\0")
except OSError:
    _cmd = []
if any(c.endswith(b"decode_worker") for c in _cmd):
    import os as _os
    _dir = _os.path.dirname(_os.path.abspath(_os.environ.get("TTFT_LAYERS_STAGE_LOG", "bench-out/stagelog/client.txt")))
    _f = _os.makedirs(_dir, exist_ok=True) or open(_os.path.join(_dir, "worker.txt"), "a", buffering=1)
    import octoserve.decode_worker.servicer as ds
    import octoserve.services.engine.vllm_engine as ve
    _gen = ds.DecodeWorkerServicer.Generate
    async def Generate(self, request, context):
        _f.write(f"{request.spec.request_id} recv {time.monotonic():.6f}\n")
        return await _gen(self, request, context)
    ds.DecodeWorkerServicer.Generate = Generate
    _raw = ve.VllmEngine._raw_stream
    async def _raw_stream(self, spec, prompt, params):
        _f.write(f"{spec.request_id} engine_call {time.monotonic():.6f}\n")
        first = True
        async for out in _raw(self, spec, prompt, params):
            if first:
                _f.write(f"{spec.request_id} engine_first {time.monotonic():.6f}\n")
                first = False
            yield out
    ve.VllmEngine._raw_stream = _raw_stream
    _flush = ds.Session._flush
    def _flush2(self):
        for d in self._pending:
            if d.token_ids and d.num_output_tokens == len(d.token_ids):
                _f.write(f"{d.request_id} flush {time.monotonic():.6f}\n")
        return _flush(self)
    ds.Session._flush = _flush2
    _att = ds.DecodeWorkerServicer.Attach
    async def Attach(self, request, context):
        async for b in _att(self, request, context):
            t = time.monotonic()
            for d in b.deltas:
                if d.token_ids and d.num_output_tokens == len(d.token_ids):
                    _f.write(f"{d.request_id} attach_yield {t:.6f}\n")
            yield b
    ds.DecodeWorkerServicer.Attach = Attach
