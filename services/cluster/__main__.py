"""`python -m octoserve.services.cluster --nodes HOST:PORT,... [--config node.yaml] [--port 9002]`: the picker.

Polls every node router's headroom summary and serves octoserve.cluster.v1.Picker/Pick (services/cluster/
service.py), with the standard health service, reflection, Prometheus metrics and the SIGTERM drain of every
octoserve process. The node config gives the tier SLOs, retry floor and KV reservation (the nodes' own).
"""

from __future__ import annotations

import argparse
import random
import sys

from octoserve.services.cluster.picker import ClusterPicker, policy_from_node
from octoserve.services.cluster.service import PICKER_SERVICE, PickerService
from octoserve.services.config import config_file
from octoserve.services.rpc.server import ServiceSpec, run_main, setup_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m octoserve.services.cluster", description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", required=True, help="comma-separated node router addresses, host:port")
    parser.add_argument("--config", type=config_file, default=None,
                        help="node config YAML (default: the embedded placement)")
    parser.add_argument("--port", type=int, default=9002)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in a Kubernetes pod)")
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--ready-file", default=None)
    parser.add_argument("--grace-s", type=float, default=5.0)
    parser.add_argument("--poll-s", type=float, default=0.1, help="how often each node's summary is read")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-node-tries", type=int, default=4,
                        help="nodes a request may be offered to: the pick and up to this - 1 fallbacks, tried in "
                             "order when a node's own admission refuses (1: no fallbacks)")
    parser.add_argument("--epp", action="store_true", help="also serve the Gateway API Inference Extension's "
                        "endpoint-picker protocol (Envoy ext_proc) on --port (services/cluster/epp.py)")
    parser.add_argument("--target-port", type=int, default=8000,
                        help="with --epp: the node port the gateway sends to (the InferencePool's target port)")
    parser.add_argument("--model-dir", action="append", default=[], metavar="MODEL=DIR",
                        help="with --epp: a checkpoint whose tokenizer turns MODEL's prompts into token ids "
                             "(prefix locality); without one, the front's byte rule")
    parser.add_argument("--log-level", default="INFO")
    return parser


def main(argv: list[str] | None = None) -> int:
    from octoserve.services.config import load_node_config

    args = build_parser().parse_args(argv)
    setup_logging("picker", args.log_level)
    config = load_node_config(args.config)
    nodes = [n.strip() for n in args.nodes.split(",") if n.strip()]
    if not nodes:
        print("--nodes needs at least one host:port", file=sys.stderr)
        return 2
    if args.max_node_tries < 1:
        print(f"--max-node-tries must be >= 1 (the pick itself), got {args.max_node_tries}", file=sys.stderr)
        return 2
    picker = ClusterPicker(policy_from_node(config.policies, config.slo.tier_ttft_ms, config.slo.itl_ms,
                                            max_node_tries=args.max_node_tries), random.Random(args.seed))
    service = PickerService(picker, nodes, poll_s=args.poll_s)
    add, names = service.add_to_server, (PICKER_SERVICE,)
    if args.epp:
        from octoserve.services.cluster import epp  # noqa: PLC0415 - the Envoy protos only when asked for

        try:
            add, names = epp.with_endpoint_picker(service, args.target_port, args.model_dir), names + (epp.EXT_PROC_SERVICE,)
        except (epp.EppUnavailable, ValueError) as e:
            print(f"picker: {e}", file=sys.stderr)
            return 2
    spec = ServiceSpec(name="picker", host=args.host, port=args.port, metrics_port=args.metrics_port, grace_s=args.grace_s,
                       ready_file=args.ready_file, service_names=names, add_servicers=add,
                       start=service.start, close=service.close)
    return run_main(spec)


if __name__ == "__main__":
    sys.exit(main())
