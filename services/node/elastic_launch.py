"""The launcher's part of a model change (elastic pools): it follows the scheduler's placement and keeps one worker
process per instance.

- An instance that left the placement (a model change retired it after its drain) has its worker stopped:
  SIGTERM, its grace, then SIGKILL, by PID. It is taken out of `node.workers` first, so the supervisor does not
  start it again.
- An instance that appeared (STARTING, no worker yet) gets a worker process on its GPUs, started like the others,
  with a node config file that holds the live placement (`elastic-<version>.yaml` in the run directory). The
  scheduler publishes it SERVING once it registered and its weights loaded.
Role changes need nothing here: the worker changes role in its process (services/rpc/role_switch.py).
Runs in a daemon thread of the launcher, started by `start_node`, stopped first by `Node.stop()`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import grpc
import yaml

from octoserve.services import trust
from octoserve.services.rpc.gen import scheduler_pb2 as s_pb
from octoserve.services.rpc.gen import scheduler_pb2_grpc as s_grpc

log = logging.getLogger("octoserve.launcher.elastic")

RESUBSCRIBE_S = 0.5


class PlacementKeeper:
    """`spawn_worker(instance_id, role, config_path)` starts one worker process and returns its ServiceProcess;
    `stop_worker(sp)` stops one."""

    def __init__(self, node, base_config: dict, spawn_worker, stop_worker) -> None:
        self.node = node
        self.base_config = base_config
        self.spawn_worker, self.stop_worker = spawn_worker, stop_worker
        self.events: list[tuple[float, str, str]] = []  # (time.monotonic(), "started" | "stopped", instance id)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="octoserve-placement-keeper", daemon=True)
        self._channel = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._channel is not None:
            self._channel.close()  # ends the blocking stream read
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with trust.sync_channel(self.node.scheduler.address) as channel:
                    self._channel = channel
                    for placement in s_grpc.SchedulerStub(channel).WatchPlacement(s_pb.WatchPlacementRequest()):
                        if self._stop.is_set():
                            return
                        self.apply(placement)
            except (grpc.RpcError, ValueError):
                pass  # the scheduler restarts (the supervisor brings it back) or the node stops
            except Exception:
                log.exception("following the placement failed; subscribing again")
            self._stop.wait(RESUBSCRIBE_S)

    def apply(self, placement: s_pb.Placement) -> None:
        ids = {p.instance_id for p in placement.instances}
        supervisor = getattr(self.node, "supervisor", None)
        for iid in [i for i in self.node.workers if i not in ids]:
            with getattr(supervisor, "_lock", None) or _NoLock():
                sp = self.node.workers.pop(iid)
            self.stop_worker(sp)
            self.events.append((time.monotonic(), "stopped", iid))
            log.info("worker of a retired instance stopped", extra={"fields": {"instance": iid}})
        new = [p for p in placement.instances if p.instance_id not in self.node.workers
               and p.state == s_pb.INSTANCE_STARTING]
        if not new:
            return
        config = dict(self.base_config)
        config["instances"] = [json.loads(p.instance_config_json) for p in placement.instances]
        path = Path(self.node.run_dir) / f"elastic-{placement.version}.yaml"
        path.write_text(yaml.safe_dump(config))
        for p in new:
            sp = self.spawn_worker(p.instance_id, p.role, str(path))
            self.node.workers[p.instance_id] = sp
            self.events.append((time.monotonic(), "started", p.instance_id))
            log.info("worker of a new instance started", extra={"fields": {"instance": p.instance_id}})


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None
