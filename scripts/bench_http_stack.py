"""Which HTTP stack for the OpenAI-compatible front: the same SSE endpoint on aiohttp, starlette+uvicorn and a
bare asyncio protocol, measured side by side in one run.

    .venv/bin/python scripts/bench_http_stack.py [--requests 300] [--streams 32] [--events 200]

Each server runs in its own process (uvloop) and answers `POST /stream` with `--events` SSE events of an
OpenAI-sized chunk (~150 bytes of JSON). Measured from a client process (aiohttp client):
1. time to the first event of a request, sequential requests, P50 and P99: the per-request latency the stack adds;
2. server CPU per streamed event with `--streams` concurrent streams (utime+stime from /proc): the per-token cost.
Nothing asserts a time; the figures are printed side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

CLK_TCK = os.sysconf("SC_CLK_TCK")
CHUNK = ("data: " + json.dumps({
    "id": "cmpl-0123456789abcdef", "object": "text_completion", "created": 1700000000, "model": "llama-3-8b",
    "choices": [{"index": 0, "text": " token", "logprobs": None, "finish_reason": None}],
}, separators=(",", ":")) + "\n\n").encode()


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


# ---- servers ---------------------------------------------------------------------------------------------------


async def serve_aiohttp(events: int) -> None:
    from aiohttp import web

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(events):
            await resp.write(CHUNK)
            await asyncio.sleep(0)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/stream", stream)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(site._server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()


def serve_starlette(events: int) -> None:
    import socket

    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def gen():
        for _ in range(events):
            yield CHUNK
            await asyncio.sleep(0)
        yield b"data: [DONE]\n\n"

    async def stream(request):
        await request.body()
        return StreamingResponse(gen(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/stream", stream, methods=["POST"])])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(app, loop="uvloop", http="httptools", log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])


async def serve_asyncio(events: int) -> None:
    """A bare HTTP/1.1 server: just enough parsing for this endpoint (httptools), chunked SSE out."""
    import httptools

    class Proto(asyncio.Protocol):
        def connection_made(self, transport):
            self.t = transport
            self.p = httptools.HttpRequestParser(self)

        def data_received(self, data):
            self.p.feed_data(data)

        def on_message_complete(self):
            asyncio.get_running_loop().create_task(self.respond())

        async def respond(self):
            self.t.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(events):
                self.t.write(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
                await asyncio.sleep(0)
            done = b"data: [DONE]\n\n"
            self.t.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))

    server = await asyncio.get_running_loop().create_server(Proto, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()


# ---- client ----------------------------------------------------------------------------------------------------


async def client_main(port: int, requests: int, streams: int, duration_s: float, server_pid: int) -> dict:
    import aiohttp

    url = f"http://127.0.0.1:{port}/stream"
    async with aiohttp.ClientSession() as session:
        async def first_event_s() -> float:
            t0 = time.perf_counter()
            async with session.post(url, data=b"{}") as resp:
                first = None
                async for _ in resp.content:
                    if first is None:
                        first = time.perf_counter() - t0
                return first

        for _ in range(20):
            await first_event_s()
        ttfe = [await first_event_s() for _ in range(requests)]
        count = 0
        end = time.perf_counter() + duration_s

        async def stream() -> None:
            nonlocal count
            while time.perf_counter() < end:
                async with session.post(url, data=b"{}") as resp:
                    async for line in resp.content:
                        if line.startswith(b"data:"):
                            count += 1

        c0, t0 = cpu_s(server_pid), time.perf_counter()
        await asyncio.gather(*(stream() for _ in range(streams)))
        cpu = cpu_s(server_pid) - c0
        elapsed = time.perf_counter() - t0
    s = sorted(ttfe)
    return {"p50_ms": statistics.median(s) * 1e3, "p99_ms": s[int(0.99 * (len(s) - 1))] * 1e3,
            "events_per_s": count / elapsed, "us_per_event": cpu / count * 1e6 if count else float("nan")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--events", type=int, default=200)
    p.add_argument("--duration-s", type=float, default=4.0)
    p.add_argument("--server", choices=("aiohttp", "starlette", "asyncio"))
    args = p.parse_args()
    import uvloop

    if args.server == "starlette":
        serve_starlette(args.events)
        return 0
    if args.server:
        uvloop.run({"aiohttp": serve_aiohttp, "asyncio": serve_asyncio}[args.server](args.events))
        return 0
    rows = []
    for name in ("aiohttp", "starlette", "asyncio"):
        proc = subprocess.Popen([sys.executable, __file__, "--server", name, "--events", str(args.events)],
                                stdout=subprocess.PIPE, text=True)
        try:
            port = int(proc.stdout.readline())
            time.sleep(0.5)
            r = uvloop.run(client_main(port, args.requests, args.streams, args.duration_s, proc.pid))
        finally:
            proc.kill()  # this child only, by its PID
            proc.wait()
        rows.append((name, r))
        print(f"{name:10s} first event P50 {r['p50_ms']:.3f} ms P99 {r['p99_ms']:.3f} ms; "
              f"{r['us_per_event']:.1f} us server CPU per event ({r['events_per_s']:,.0f} events/s)", flush=True)
    print("\n| stack | first event P50 ms | P99 ms | server CPU us per SSE event | events per server CPU-s |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows:
        print(f"| {name} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['us_per_event']:.1f} | "
              f"{1e6 / r['us_per_event']:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
