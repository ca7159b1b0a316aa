"""The test run reaches nothing but this machine (tests/loopback_guard.py, installed by conftest.py): connects and
datagrams beyond loopback fail before a packet leaves, loopback works. The addresses refused here are
documentation and private ranges; nothing is sent."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest

from loopback_guard import NonLoopbackError, is_loopback


@pytest.mark.parametrize("address, loopback", [
    (("127.0.0.1", 80), True), (("127.3.2.1", 80), True), (("::1", 80, 0, 0), True), (("localhost", 80), True),
    ("/tmp/octoserve.sock", True), (("10.0.0.7", 80), False), (("0.0.0.0", 80), False), (("192.0.2.1", 9), False),
    (("2001:db8::1", 80, 0, 0), False), (("example.com", 443), False), ((b"127.0.0.1", 80), True),
])
def test_loopback_is_told_from_everything_else(address, loopback):
    assert is_loopback(address) is loopback


def test_a_connect_beyond_loopback_is_refused_before_anything_is_sent():
    with pytest.raises(NonLoopbackError, match=r"tests reach 127.0.0.1 only: connect to \('192.0.2.1', 9\)"):
        socket.create_connection(("192.0.2.1", 9), timeout=1)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, pytest.raises(NonLoopbackError):
        s.connect_ex(("10.255.255.1", 9))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s, pytest.raises(NonLoopbackError, match="sendto"):
        s.sendto(b"x", ("192.0.2.1", 9))
    with pytest.raises(urllib.error.URLError) as e:
        urllib.request.urlopen("http://192.0.2.1:9/", timeout=1)
    assert isinstance(e.value.reason, NonLoopbackError)


def test_loopback_traffic_flows():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        with socket.create_connection(server.getsockname(), timeout=5) as client:
            peer, _ = server.accept()
            with peer:
                client.sendall(b"ping")
                assert peer.recv(4) == b"ping"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as a, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as b:
        b.bind(("127.0.0.1", 0))
        a.sendto(b"pong", b.getsockname())
        assert b.recv(4) == b"pong"
