"""`python -m octoserve.decode_worker --instance ID ...`: serve one decode or colocated instance (see octoserve.services.rpc.worker_main).

Injected KV-transfer faults (tests and drills) come from the OCTOSERVE_FAULTS environment variable, read here (engine
faults are armed in octoserve.services.rpc.worker_main)."""

import sys

from octoserve.decode_worker.servicer import DecodeWorkerServicer
from octoserve.services.faults import FaultPlan
from octoserve.services.rpc.worker_main import worker_main

if __name__ == "__main__":
    faults = FaultPlan.from_env()
    sys.exit(worker_main(None, lambda engine: DecodeWorkerServicer(engine, faults=faults), "decode_worker"))
