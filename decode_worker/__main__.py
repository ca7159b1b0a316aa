"""`python -m decode_worker --instance ID ...`: serve one decode or colocated instance (see services.rpc.worker_main)."""

import sys

from decode_worker.servicer import DecodeWorkerServicer
from services.rpc.worker_main import worker_main

if __name__ == "__main__":
    sys.exit(worker_main(None, DecodeWorkerServicer, "decode_worker"))
