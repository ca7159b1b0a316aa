"""`python -m octoserve.prefill_worker --instance ID ...`: serve one prefill instance (see octoserve.services.rpc.worker_main)."""

import sys

from octoserve.prefill_worker.servicer import PrefillWorkerServicer
from octoserve.services.rpc.worker_main import worker_main

if __name__ == "__main__":
    sys.exit(worker_main(None, PrefillWorkerServicer, "prefill_worker"))
