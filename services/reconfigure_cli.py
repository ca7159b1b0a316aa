"""`octoserve reconfigure`: carry out one reconfiguration of a running node by hand (elastic pools).

    octoserve reconfigure --scheduler 127.0.0.1:P --role d1=prefill
    octoserve reconfigure --scheduler 127.0.0.1:P --model c1,c2=llama-3-70b:colocated:2

--role ID=ROLE changes an instance's role (colocated, prefill, decode) in its worker process. --model IDS=MODEL
[:ROLE[:TP]] retires the listed instances and starts instances of MODEL (TP GPUs each, default 1; role default
colocated) on the GPUs they free; the launcher (`octoserve up`) starts their workers. Either way the retired
instances drain first (their running decodes migrate to other instances of the model by KV hand-off when that is
faster, unless --drain-only): no request is dropped. --in-place (with --role, decode <-> colocated only) skips the
drain: the instance serves throughout and keeps what it holds. Prints what happened (drain and switch times, requests drained).
The scheduler's address is in its ready file (`scheduler.ready.json` in the node's run directory).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import grpc

from octoserve.services import trust
from octoserve.services.config import config_file
from octoserve.services.flags import parse_duration_s
from octoserve.services.rpc.gen import scheduler_pb2 as s_pb
from octoserve.services.rpc.gen import scheduler_pb2_grpc as s_grpc
from octoserve.services.rpc.gen import worker_pb2 as w_pb
from octoserve.services.usage import UsageError

ROLES = {"colocated": w_pb.COLOCATED, "prefill": w_pb.PREFILL, "decode": w_pb.DECODE}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--scheduler", help="scheduler host:port")
    where.add_argument("--run-dir", help="the node's run directory (octoserve up --run-dir): its scheduler is used")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--role", metavar="ID=ROLE", help="change an instance's role: colocated, prefill or decode")
    what.add_argument("--model", metavar="IDS=MODEL[:ROLE[:TP]]",
                      help="retire the comma-separated instances; start MODEL instances on their GPUs")
    parser.add_argument("--reason", default="", help="logged with the reconfiguration")
    parser.add_argument("--drain-timeout-s", type=parse_duration_s, default=0.0,
                        help="abort (and keep the old placement) if the drain takes longer (0: the scheduler's 60 s)")
    parser.add_argument("--in-place", action="store_true",
                        help="with --role, decode <-> colocated only: no drain; the instance serves throughout and "
                             "keeps its running requests")
    parser.add_argument("--drain-only", action="store_true",
                        help="wait for every running request; migrate none to another instance by KV hand-off")
    parser.add_argument("--config", type=config_file, default=None,
                        help="node config YAML with a tls section (mTLS between services)")


def request_from_args(args: argparse.Namespace) -> s_pb.ReconfigureRequest:
    request = s_pb.ReconfigureRequest(reason=args.reason, drain_timeout_ms=int(args.drain_timeout_s * 1000),
                                      drain_only=args.drain_only)
    if args.role:
        iid, sep, role = args.role.partition("=")
        if not sep or not iid or role not in ROLES:
            raise UsageError(f"--role {args.role!r}: give ID=ROLE with ROLE one of {', '.join(ROLES)}, e.g. d1=prefill")
        request.role_change.CopyFrom(s_pb.RoleChange(instance_id=iid, role=ROLES[role], in_place=args.in_place))
        return request
    if args.in_place:
        raise UsageError("--in-place goes with --role (a decode <-> colocated change); a model change always drains")
    ids, sep, target = args.model.partition("=")
    parts = target.split(":")
    retire = [i for i in ids.split(",") if i]
    if not sep or not retire or not parts[0] or len(parts) > 3:
        raise UsageError(f"--model {args.model!r}: give IDS=MODEL[:ROLE[:TP]], e.g. c1=llama-3-70b or "
                         "c1,c2=llama-3-70b:colocated:2")
    role = parts[1] if len(parts) > 1 else "colocated"
    if role not in ROLES:
        raise UsageError(f"--model {args.model!r}: role {role!r} is not one of {', '.join(ROLES)}")
    tp = parts[2] if len(parts) > 2 else "1"
    if not tp.isdigit() or int(tp) < 1:
        raise UsageError(f"--model {args.model!r}: TP {tp!r} must be a positive integer")
    request.model_change.CopyFrom(s_pb.ModelChange(retire=retire, model=parts[0], role=ROLES[role],
                                                   tensor_parallel=int(tp)))
    return request


def scheduler_address(args: argparse.Namespace) -> str:
    if args.scheduler:
        return args.scheduler
    ready = Path(args.run_dir) / "scheduler.ready.json"
    if not ready.exists():
        raise UsageError(f"{ready} does not exist: is a node running with --run-dir {args.run_dir}?")
    return f"127.0.0.1:{json.loads(ready.read_text())['port']}"


def run(args: argparse.Namespace) -> int:
    from octoserve.services.config import load_service_sections

    request = request_from_args(args)
    address = scheduler_address(args)
    trust.configure(load_service_sections(args.config).get("tls"), "router")
    with trust.sync_channel(address) as channel:
        try:
            reply = s_grpc.SchedulerStub(channel).Reconfigure(request, timeout=600)
        except grpc.RpcError as e:
            if e.code() is grpc.StatusCode.INVALID_ARGUMENT:  # the scheduler refused what the flags asked for
                flag = f"--role {args.role!r}" if args.role else f"--model {args.model!r}"
                raise UsageError(f"{flag}: {e.details()}") from None
            print(f"reconfigure failed: {e.code().name}: {e.details()}")
            return 1
    print(f"reconfiguration {reply.reconfig_id} done: serving {', '.join(reply.started)}; drained "
          f"{reply.drained_requests} running requests ({reply.migrated_requests} migrated by KV hand-off) in "
          f"{reply.drain_s:.3f} s, switched in {reply.switch_s:.3f} s (total {reply.total_s:.3f} s wall)")
    return 0
