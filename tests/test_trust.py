"""Trust between services: `octoserve certs`, mTLS on the internal APIs (real gRPC servers on 127.0.0.1 with
certificates), the refusal to listen beyond loopback without it, and a whole node started over mTLS."""

from __future__ import annotations

import argparse
import subprocess
import sys

import grpc
import pytest

from octoserve.decode_worker.servicer import DecodeWorkerServicer
from octoserve.services import trust
from octoserve.services.engine.factory import make_engine
from octoserve.services.rpc.gen import worker_pb2 as w_pb
from octoserve.services.rpc.gen import worker_pb2_grpc as w_grpc
from octoserve.services.rpc.hardening import add_servicer
from octoserve.services.rpc.server import ServiceSpec, start_service
from octoserve.v1 import generate_pb2 as gen_pb
from octoserve.v1 import generate_pb2_grpc as gen_grpc
from tests.service_fixtures import small_config, small_config_dict

WORKER = w_pb.DESCRIPTOR.services_by_name["Worker"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    trust.make_certs(d)
    return d


def test_certs_command_writes_a_ca_and_one_pair_per_service(tmp_path, capsys):
    assert trust.run(argparse.Namespace(dir=str(tmp_path), host=["10.1.2.3", "node-a"], days=30)) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["ca.key", "ca.pem", "router.key", "router.pem", "scheduler.key", "scheduler.pem",
                     "worker.key", "worker.pem"]
    assert oct((tmp_path / "worker.key").stat().st_mode & 0o777) == "0o600"
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((tmp_path / "worker.pem").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "10.1.2.3"}
    assert set(sans.get_values_for_type(x509.DNSName)) == {"localhost", "node-a"}
    assert "tls: {dir:" in capsys.readouterr().out


async def _worker_with_tls(tls: trust.TlsFiles):
    config = small_config()
    engine = make_engine(config, "c0", engine="sim", time_scale=1.0)
    servicer = DecodeWorkerServicer(engine)
    spec = ServiceSpec(name="worker:c0", metrics_port=None, grace_s=1.0, service_names=(WORKER.full_name,),
                       add_servicers=lambda server: add_servicer(servicer, WORKER, server),
                       start=servicer.start, drain=servicer.drain, close=servicer.close,
                       registry=servicer.metrics.registry, server_credentials=tls.server_credentials())
    return await start_service(spec)


async def _get_load(channel: grpc.aio.Channel) -> grpc.StatusCode:
    try:
        await w_grpc.WorkerStub(channel).GetLoad(w_pb.GetLoadRequest(), timeout=5.0)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as e:
        return e.code()
    finally:
        await channel.close()


async def test_worker_over_mtls_accepts_only_peers_with_a_certificate_from_its_ca(certs, tmp_path):
    worker = await _worker_with_tls(trust.TlsFiles.load(certs, "worker"))
    try:
        address = worker.address
        router_tls = trust.TlsFiles.load(certs, "router")
        assert await _get_load(trust.channel(address, tls=router_tls)) == grpc.StatusCode.OK
        # plaintext: the TLS server does not speak it
        assert await _get_load(grpc.aio.insecure_channel(address)) == grpc.StatusCode.UNAVAILABLE
        # TLS without a client certificate
        no_cert = grpc.ssl_channel_credentials(root_certificates=router_tls.ca)
        assert await _get_load(grpc.aio.secure_channel(address, no_cert)) == grpc.StatusCode.UNAVAILABLE
        # a client certificate from another CA
        other = tmp_path / "other"
        trust.make_certs(other)
        rogue = trust.TlsFiles.load(other, "router")
        rogue_creds = grpc.ssl_channel_credentials(root_certificates=router_tls.ca, private_key=rogue.key,
                                                   certificate_chain=rogue.cert)
        assert await _get_load(grpc.aio.secure_channel(address, rogue_creds)) == grpc.StatusCode.UNAVAILABLE
    finally:
        await worker.shutdown()


def test_binding_beyond_loopback_needs_tls_or_an_explicit_override(certs):
    tls = trust.TlsFiles.load(certs, "worker")
    for host in ("127.0.0.1", "localhost", "::1"):
        trust.check_bind(host, None, False, "worker")
    for host in ("0.0.0.0", "10.0.0.5", "node-a"):
        with pytest.raises(trust.TrustError, match="without authentication; set tls.dir"):
            trust.check_bind(host, None, False, "worker")
        trust.check_bind(host, tls, False, "worker")
        trust.check_bind(host, None, True, "worker")


def test_missing_certificate_files_name_the_command_that_makes_them(tmp_path):
    with pytest.raises(trust.TrustError, match="octoserve certs"):
        trust.TlsFiles.load(tmp_path, "worker")


@pytest.mark.parametrize("address,allowed", [
    ("127.0.0.1:50051", True), ("127.9.9.9:1", True), ("localhost:80", True), ("LOCALHOST:80", False),
    ("[::1]:7", True), ("10.0.0.7:50051", True), ("gpu-node-1:9000", True), ("GPU-Node-1:9000", True),
    ("10.0.0.8:50051", False), ("example.com:443", False), ("[2001:db8::1]:1", False), ("0.0.0.0:1", False),
    ("127.0.0.1.nip.io:80", False),
])
def test_worker_hosts_allow_loopback_and_the_configured_hosts_only(address, allowed):
    hosts = trust.worker_hosts({"worker_hosts": ["10.0.0.7", "gpu-node-1"]})
    if allowed:
        hosts.check(address)
        return
    with pytest.raises(trust.WorkerAddressError, match="is not one this node dials") as e:
        hosts.check(address)
    assert not e.value.malformed
    assert "(allowed: loopback, 10.0.0.7, gpu-node-1)" in str(e.value)


@pytest.mark.parametrize("address", ["", "garbage", "127.0.0.1", "127.0.0.1:", "127.0.0.1:0", "127.0.0.1:65536",
                                     "unix:/tmp/x", ":5", "::1:5", "[::1]5", "a b:1", "127.0.0.1:+5"])
def test_malformed_worker_addresses_are_refused_as_malformed(address):
    with pytest.raises(trust.WorkerAddressError, match="is not host:port with a port in 1..65535") as e:
        trust.WorkerHosts().check(address)
    assert e.value.malformed


def test_worker_hosts_section_errors_say_what_to_change():
    with pytest.raises(trust.TrustError, match=r"unknown key\(s\) \['hosts'\] in network; known: worker_hosts"):
        trust.worker_hosts({"hosts": ["a"]})
    for bad in ("10.0.0.7", ["10.0.0.7:50051"], [""], [7], ["a b"]):
        with pytest.raises(trust.TrustError, match="network.worker_hosts must be a list of host names or IP literals"):
            trust.worker_hosts({"worker_hosts": bad})
    assert trust.worker_hosts(None) == trust.WorkerHosts()


def test_with_tls_the_worker_certificate_names_are_allowed(tmp_path):
    trust.make_certs(tmp_path, ["10.1.2.3", "Node-A"])
    tls = trust.TlsFiles.load(tmp_path, "scheduler")
    pem = trust.worker_certificate({"dir": str(tmp_path)}, tls)
    assert pem == (tmp_path / "worker.pem").read_bytes()
    assert trust.worker_hosts(None, pem).hosts == {"localhost", "127.0.0.1", "10.1.2.3", "node-a"}
    assert trust.worker_certificate(None, None) is None


@pytest.mark.parametrize("module,extra", [("octoserve.services.scheduler", []),
                                          ("octoserve.decode_worker", ["--instance", "sm-0"])])
def test_services_refuse_a_public_address_without_tls(module, extra):
    proc = subprocess.run([sys.executable, "-m", module, "--host", "0.0.0.0", *extra], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert "without authentication" in proc.stderr and "--allow-insecure" in proc.stderr


@pytest.mark.slow
def test_whole_node_over_mtls(certs, tmp_path):
    """start_node with `tls:` in the config: every internal hop is mTLS, and the node serves."""
    from octoserve.services.node.launcher import start_node

    config = {**small_config_dict(), "tls": {"dir": str(certs)}}
    node = start_node(config, 1.0, run_dir=tmp_path / "run", startup_timeout_s=90.0)
    try:
        with grpc.insecure_channel(node.router_address) as ch:
            req = gen_pb.GenerateRequest(model="llama-3-8b", token_ids=gen_pb.TokenIds(ids=list(range(1, 33))),
                                         max_tokens=4, ignore_eos=True)
            responses = list(gen_grpc.GenerationStub(ch).Generate(req, timeout=30.0))
        assert sum(len(r.token_ids) for r in responses) == 4 and responses[-1].finish_reason == gen_pb.LENGTH
        with grpc.insecure_channel(node.workers["c0"].address) as ch:  # the worker refuses plaintext peers
            with pytest.raises(grpc.RpcError) as err:
                w_grpc.WorkerStub(ch).GetLoad(w_pb.GetLoadRequest(), timeout=5.0)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        codes = node.stop()
        trust.configure(None, "router")  # start_node configured this test process's client side
    assert all(c == 0 for c in codes.values()), codes
