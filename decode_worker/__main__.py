"""`python -m octoserve.decode_worker --instance ID ...`: serve one decode or colocated instance (see octoserve.services.rpc.worker_main)."""

import sys

from octoserve.decode_worker.servicer import DecodeWorkerServicer
from octoserve.services.rpc.worker_main import worker_main

if __name__ == "__main__":
    sys.exit(worker_main(None, DecodeWorkerServicer, "decode_worker"))
