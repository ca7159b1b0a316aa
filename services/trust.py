"""Trust between the node's services: mTLS for the internal APIs, and the `octoserve certs DIR` helper.

Config (the `tls:` section of the node config file; absent = plaintext, which is allowed on loopback only):
    tls:
      dir: /etc/octoserve/certs   # made by `octoserve certs DIR`: ca.pem, and <service>.pem / <service>.key for
                                  # scheduler, worker and router (each service's certificate serves as its client
                                  # certificate too)
With `tls` set, every internal server (scheduler, workers) requires a client certificate signed by that CA, and every
internal client (router -> workers and scheduler, worker -> scheduler, scheduler -> workers, the launcher's health
checks) presents its service's certificate and verifies the server's against the CA.

Binding: a scheduler or worker asked to listen beyond loopback (`--host`) refuses to start without `tls`, unless
started with `--allow-insecure` (say so on purpose, e.g. inside an isolated network namespace).

Dialing: the scheduler opens a channel to every address a worker registers, so a registration must not be a way to
make it reach another host. `WorkerHosts` is the set of hosts a worker may register at: loopback always, the hosts
of the `network:` section, and with `tls` the names the worker certificate carries (its subjectAltNames):
    network:
      worker_hosts: [10.0.0.7, gpu-node-1]   # hosts (IP literals or names) workers may register at besides loopback
A registration at any other host is refused before anything is resolved or dialed.

A process configures itself once (`configure(section, service)`, at start); `channel()` / `sync_channel()` then
open internal channels with the right credentials. Tests pass credentials explicitly instead.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

SERVICES = ("scheduler", "worker", "router")
LOOPBACK_NAMES = ("localhost",)
CERT_DAYS = 365


class TrustError(RuntimeError):
    """The service's trust settings do not allow what it was asked to do; the message says what to change."""


@dataclass(frozen=True, slots=True)
class TlsFiles:
    ca: bytes
    cert: bytes
    key: bytes

    @classmethod
    def load(cls, directory: str | Path, service: str) -> TlsFiles:
        d = Path(directory)
        paths = (d / "ca.pem", d / f"{service}.pem", d / f"{service}.key")
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise TrustError(f"tls.dir {d} lacks {', '.join(missing)}; create them with `octoserve certs {d}`")
        return cls(*(p.read_bytes() for p in paths))

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


_process_tls: TlsFiles | None = None


def configure(section: Mapping | None, service: str) -> TlsFiles | None:
    """Load this process's certificates from the `tls:` section (None: plaintext); done once at start."""
    global _process_tls
    if service not in SERVICES:
        raise ValueError(f"service must be one of {SERVICES}")
    if not section:
        _process_tls = None
        return None
    if unknown := sorted(set(section) - {"dir"}):
        raise TrustError(f"unknown key(s) {unknown} in tls; known: dir")
    if not section.get("dir"):
        raise TrustError("tls.dir is not set; point it at the directory `octoserve certs DIR` wrote")
    _process_tls = TlsFiles.load(section["dir"], service)
    return _process_tls


def process_tls() -> TlsFiles | None:
    return _process_tls


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class WorkerHosts:
    """The hosts a worker may register at; the check is literal (no name is resolved to decide)."""

    hosts: frozenset[str] = frozenset()  # lower-case names and IP literals allowed besides loopback

    def check(self, address: str) -> None:
        """Raise `WorkerAddressError` unless `address` is host:port on an allowed host with a port in 1..65535."""
        host, port = split_host_port(address)
        if host is None or not port.isdigit() or not 0 < int(port) < 65536:
            raise WorkerAddressError(
                f"worker address {address[:80]!r} is not host:port with a port in 1..65535; send the host:port this "
                "worker serves at", malformed=True)
        if is_loopback(host) or host.lower() in self.hosts:
            return
        allowed = ", ".join(["loopback", *sorted(self.hosts)])
        raise WorkerAddressError(
            f"worker host {host[:80]!r} is not one this node dials (allowed: {allowed}); register at one of them, or "
            "add the host to network.worker_hosts in the node config (with tls: to the worker certificate, "
            "`octoserve certs DIR --host H`)", malformed=False)


class WorkerAddressError(TrustError):
    """A worker registered at an address the scheduler will not dial: malformed, or on a host the node does not allow."""

    def __init__(self, message: str, *, malformed: bool) -> None:
        super().__init__(message)
        self.malformed = malformed


def split_host_port(address: str) -> tuple[str | None, str]:
    """(host, port) of "host:port" or "[v6]:port"; host None when the address has no such shape."""
    if address.startswith("["):
        host, sep, port = address[1:].partition("]:")
        if not sep or not host or "]" in host:
            return None, ""
        return host, port
    host, sep, port = address.rpartition(":")
    if not sep or not host or ":" in host or "/" in host or any(c.isspace() for c in host):
        return None, ""
    return host, port


def worker_hosts(section: Mapping | None, worker_cert_pem: bytes | None = None) -> WorkerHosts:
    """The `network:` section's worker hosts, plus the names a worker certificate carries (with `tls`)."""
    section = section or {}
    if unknown := sorted(set(section) - {"worker_hosts"}):
        raise TrustError(f"unknown key(s) {unknown} in network; known: worker_hosts")
    listed = section.get("worker_hosts") or []
    if not isinstance(listed, list) or not all(isinstance(h, str) and h and split_host_port(f"{h}:1")[0]
                                               for h in listed):
        raise TrustError("network.worker_hosts must be a list of host names or IP literals (no ports), "
                         "e.g. [10.0.0.7, gpu-node-1]")
    hosts = {h.lower() for h in listed}
    if worker_cert_pem is not None:
        hosts |= certificate_hosts(worker_cert_pem)
    return WorkerHosts(frozenset(hosts))


def certificate_hosts(cert_pem: bytes) -> set[str]:
    """The DNS names and IP addresses a PEM certificate's subjectAltName extension carries, lower-case."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return ({n.lower() for n in sans.get_values_for_type(x509.DNSName)}
            | {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)})


def worker_certificate(section: Mapping | None, tls: TlsFiles | None) -> bytes | None:
    """The worker certificate of the `tls:` directory (the scheduler's own when that has none); None without tls."""
    if tls is None:
        return None
    path = Path(section["dir"]) / "worker.pem" if section and section.get("dir") else None
    return path.read_bytes() if path is not None and path.is_file() else tls.cert


def check_bind(host: str, tls: TlsFiles | None, allow_insecure: bool, service: str) -> None:
    if tls is None and not is_loopback(host) and not allow_insecure:
        raise TrustError(
            f"{service} would listen on {host} without authentication; set tls.dir in the node config (make the "
            "certificates with `octoserve certs DIR`), bind 127.0.0.1, or pass --allow-insecure on purpose")


def channel(address: str, options: Sequence = (), tls: TlsFiles | None = None) -> grpc.aio.Channel:
    """An internal channel: mTLS when this process (or `tls`) has certificates, plaintext otherwise."""
    tls = tls or _process_tls
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)


def sync_channel(address: str, tls: TlsFiles | None = None) -> grpc.Channel:
    tls = tls or _process_tls
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.channel_credentials())


# ---- `octoserve certs DIR` ------------------------------------------------------------------------------------------


def make_certs(directory: str | Path, hosts: Sequence[str] = (), days: int = CERT_DAYS) -> list[Path]:
    """A development CA and one key pair per service, valid for localhost, 127.0.0.1 and `hosts`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "octoserve development"),
                          x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def key_pem(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (x509.CertificateBuilder().subject_name(name("octoserve development CA")).issuer_name(
        name("octoserve development CA")).public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256()))
    sans: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    written = []
    _write(d / "ca.pem", ca_cert.public_bytes(serialization.Encoding.PEM), written)
    _write(d / "ca.key", key_pem(ca_key), written, private=True)
    for service in SERVICES:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(f"octoserve {service}")).issuer_name(ca_cert.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(end)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        _write(d / f"{service}.pem", cert.public_bytes(serialization.Encoding.PEM), written)
        _write(d / f"{service}.key", key_pem(key), written, private=True)
    return written


def _write(path: Path, data: bytes, written: list[Path], private: bool = False) -> None:
    path.write_bytes(data)
    if private:
        path.chmod(0o600)
    written.append(path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="directory to write ca.pem and <service>.pem/.key into")
    parser.add_argument("--host", action="append", default=[],
                        help="a host name or IP the services are reached at, besides localhost (repeatable)")
    parser.add_argument("--days", type=int, default=CERT_DAYS, help="days each certificate is valid (default %(default)s)")
    parser.add_argument("--force", action="store_true",
                        help="replace the CA already in DIR (every certificate it signed stops being trusted)")


def run(args: argparse.Namespace) -> int:
    from octoserve.services.usage import UsageError

    ca = Path(args.dir) / "ca.pem"
    # A new CA invalidates every certificate the old one signed, those of a node running on them included.
    if ca.exists() and not getattr(args, "force", False):  # getattr: callers may pass a Namespace of their own
        raise UsageError(f"{ca} exists: a new CA would invalidate the certificates it signed (a running node's too); "
                         "pass --force to replace it")
    for path in make_certs(args.dir, args.host, args.days):
        print(path)
    print(f"set `tls: {{dir: {os.path.abspath(args.dir)}}}` in the node config to require these certificates between "
          "services (a relative dir is read from the config file's folder)")
    return 0
