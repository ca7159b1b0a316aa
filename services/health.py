"""`octoserve health`: one standard gRPC health check (grpc.health.v1.Health/Check), as an exec probe runs it.

    octoserve health --port 50050 [--host 127.0.0.1] [--service ""] [--tls-dir DIR --cert scheduler] [--timeout 3]
    python -m octoserve.services.health ...   (the same, without the subcommand table: what the manifests run)

Exit status: 0 when the server answers SERVING; 1 when it answers anything else (NOT_SERVING while draining,
SERVICE_UNKNOWN) or cannot be reached within --timeout; 2 for bad input (a missing certificate file). One line on
stdout says which.

Why it exists: with mTLS on (`tls:` in the node config) the scheduler and the workers accept only clients that
present a certificate signed by the node's CA. The kubelet's native gRPC probe cannot present one, so the
Kubernetes manifests run this command inside the container instead (an exec probe), with the certificates
mounted there: `--tls-dir` names the directory `octoserve certs` wrote and `--cert` which service's key pair to
present (each container presents its own). Without `--tls-dir` the check is plaintext.

It imports grpc and the health stubs only, so a probe costs one short Python start (about 0.3 s of CPU).
"""

from __future__ import annotations

import argparse
import sys

from octoserve.services.flags import parse_duration_s

SERVING_EXIT, NOT_SERVING_EXIT, BAD_INPUT_EXIT = 0, 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="server host (inside the pod: 127.0.0.1)")
    parser.add_argument("--port", type=int, required=True, help="the server's gRPC port")
    parser.add_argument("--service", default="", help="health service name ('' = the whole server)")
    parser.add_argument("--tls-dir", default=None, help="directory of ca.pem and <cert>.pem/.key: check over mTLS")
    parser.add_argument("--cert", default="router", help="whose key pair to present with --tls-dir: scheduler, "
                        "worker or router")
    parser.add_argument("--timeout", type=parse_duration_s, default=3.0, help="time for the whole check, e.g. 3s")


def check(host: str, port: int, service: str = "", *, tls=None, timeout_s: float = 3.0) -> tuple[bool, str]:
    """(serving, what happened) for one Health/Check call; `tls` is a `trust.TlsFiles` or None (plaintext)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    address = f"{host}:{port}"
    channel = (grpc.secure_channel(address, tls.channel_credentials()) if tls is not None
               else grpc.insecure_channel(address))
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                          timeout=timeout_s)
    except grpc.RpcError as e:
        return False, f"{address}: {e.code().name}: {e.details()}"
    finally:
        channel.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {status}"


def run(args: argparse.Namespace) -> int:
    tls = None
    if args.tls_dir:
        from octoserve.services.trust import SERVICES, TlsFiles, TrustError

        if args.cert not in SERVICES:
            print(f"octoserve health: --cert must be one of {', '.join(SERVICES)}, got {args.cert!r}", file=sys.stderr)
            return BAD_INPUT_EXIT
        try:
            tls = TlsFiles.load(args.tls_dir, args.cert)
        except TrustError as e:
            print(f"octoserve health: {e}", file=sys.stderr)
            return BAD_INPUT_EXIT
    serving, what = check(args.host, args.port, args.service, tls=tls, timeout_s=args.timeout)
    print(what)
    return SERVING_EXIT if serving else NOT_SERVING_EXIT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="octoserve health", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
