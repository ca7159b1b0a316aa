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

A process configures itself once (`configure(section, service)`, at start); `channel()` / `sync_channel()` then
open internal channels with the right credentials. Tests pass credentials explicitly instead.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
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
    parser.add_argument("--days", type=int, default=CERT_DAYS)


def run(args: argparse.Namespace) -> int:
    for path in make_certs(args.dir, args.host, args.days):
        print(path)
    print(f"set `tls: {{dir: {args.dir}}}` in the node config to require these certificates between services")
    return 0
