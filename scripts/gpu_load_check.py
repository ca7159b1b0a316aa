"""Measure what a model change costs in weight movement on this machine: host memory -> GPU over PCIe (pinned and
pageable) and local disk -> host memory (cold, after dropping the page cache where allowed, and warm).

Usage: python scripts/gpu_load_check.py --out DIR [--gib 4]     (CUDA; ~1 min)
Writes load_bandwidth.json in DIR and prints GB/s per path, and the implied load time of the 8B (16.1 GB) and of a
70B TP=4 shard (35.3 GB per GPU, each GPU of the group loading its own shard in parallel).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

GB = 1e9


def timed(fn, repeats: int, sync) -> float:
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--gib", type=float, default=4.0, help="size of the copied buffer")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    n = int(args.gib * 2**30)
    nbytes = n
    result: dict = {"device": torch.cuda.get_device_name(0), "bytes": nbytes}
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    sync = torch.cuda.synchronize
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pinned.random_(0, 255)
    result["h2d_pinned_GBps"] = nbytes / timed(lambda: dev.copy_(pinned, non_blocking=True), args.repeats, sync) / GB
    print(f"host (pinned) -> GPU: {result['h2d_pinned_GBps']:.1f} GB/s", flush=True)
    pageable = torch.empty(n, dtype=torch.uint8)
    pageable.copy_(pinned)
    result["h2d_pageable_GBps"] = nbytes / timed(lambda: dev.copy_(pageable), args.repeats, sync) / GB
    print(f"host (pageable) -> GPU: {result['h2d_pageable_GBps']:.1f} GB/s", flush=True)
    path = Path("/tmp") / "octoserve-weights.bin"
    with open(path, "wb") as f:
        f.write(pageable.numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    buf = pageable.numpy()

    def read_file() -> None:
        with open(path, "rb", buffering=0) as f:
            view = memoryview(buf)
            done = 0
            while done < nbytes:
                got = f.readinto(view[done:done + (256 << 20)])
                if not got:
                    break
                done += got

    result["page_cache_dropped"] = drop_page_cache()
    t0 = time.perf_counter()
    read_file()
    result["disk_cold_GBps"] = nbytes / (time.perf_counter() - t0) / GB
    print(f"disk -> host (cold: page cache dropped={result['page_cache_dropped']}): "
          f"{result['disk_cold_GBps']:.2f} GB/s", flush=True)
    result["disk_warm_GBps"] = nbytes / timed(read_file, 3, lambda: None) / GB
    print(f"disk -> host (page cache): {result['disk_warm_GBps']:.2f} GB/s", flush=True)
    path.unlink()
    for name, size in (("llama-3-8b", 16.06e9), ("llama-3-70b TP=4 shard", 141.1e9 / 4)):
        pcie = size / (result["h2d_pinned_GBps"] * GB)
        disk = size / (min(result["disk_cold_GBps"], result["h2d_pinned_GBps"]) * GB)
        result[f"load_s {name}"] = {"from_host_pinned": pcie, "from_disk_cold": disk}
        print(f"{name}: {pcie:.2f} s from pinned host memory, {disk:.1f} s from local disk (cold)", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "load_bandwidth.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
