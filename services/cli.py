"""The `octoserve` command: one subcommand per module, imported only when it runs.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`. Bad input (`services/usage.py`:
a config or workload error, a missing file) prints its message alone and exits 2; `--debug` adds the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("octoserve.services.lab.demo", "start the node live, drive it with the seed-000 peak, report live vs simulated"),
    "simulate": ("octoserve.services.sim.cli_simulate", "run the node in the discrete-event simulator and report SLO metrics"),
    "elastic-day": ("octoserve.services.sim.cli_elastic_day", "simulate the mix-shift day: best static vs hourly oracle vs the elastic balancer"),
    "plan": ("octoserve.services.sim.cli_plan", "size the node for a workload: roofline bound, verdict, ranked placements"),
    "up": ("octoserve.services.node.launcher", "start the whole node as separate gRPC services on 127.0.0.1"),
    "bench": ("octoserve.services.loadgen", "drive a running router with an open-loop workload and report SLO metrics"),
    "bench-suite": ("octoserve.services.lab.bench_command", "run the policy-comparison matrix and write BENCHMARKS.md sections"),
    "make-test-model": ("octoserve.services.engine.test_model", "build a tiny random-weight Llama with a local tokenizer"),
    "calibrate": ("octoserve.services.lab.calibrate", "measure step times and write a cost-model profile"),
    "certs": ("octoserve.services.trust", "make a development CA and per-service certificates for mTLS between services"),
    "compose": ("octoserve.services.compose", "write or check docker-compose.yml for a placement"),
    "k8s": ("octoserve.services.k8s", "write or check Kubernetes manifests for a placement and a node count"),
    "health": ("octoserve.services.health", "one gRPC health check of a server (mTLS with --tls-dir): exit 0 if SERVING"),
    "reconfigure": ("octoserve.services.reconfigure_cli", "change an instance's role or model on a running node, without downtime"),
}

# Simulator commands: their numpy work is summaries of small arrays, yet numpy's BLAS starts one thread per core when
# it is imported, which then spin idle (~0.1 s of CPU per run on a 2-core machine). One thread is enough for them;
# a value already in the environment wins.
ONE_BLAS_THREAD = ("simulate", "plan", "elastic-day")


def build_parser(every_command: bool = False) -> argparse.ArgumentParser:
    """The command line's parser. Only the subcommand named on the command line imports its module and gets its
    arguments (so `octoserve up` never imports the simulator); `every_command` builds all of them, for the
    reference `scripts/cli_reference.py` generates."""
    parser = argparse.ArgumentParser(prog="octoserve", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    if chosen in ONE_BLAS_THREAD:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before the subcommand imports numpy
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module_name)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the Python traceback of an error")
        if every_command or name == chosen:
            importlib.import_module(module_name).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. With `argv` None (the process's own command line: the `octoserve` script, `python -m`),
    a subcommand may end the process itself once its output is out (`usage.exit_process`); given `argv`, it returns."""
    whole_process = argv is None
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    args = build_parser().parse_args()
    args.whole_process = whole_process
    from octoserve.services.usage import BAD_INPUT, report

    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except BAD_INPUT as error:  # input the user can fix: the message alone, exit 2 (traceback with --debug)
        return report(args.command, error, args.debug)


if __name__ == "__main__":
    sys.exit(main())
