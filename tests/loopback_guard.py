"""Tests reach nothing but this machine: every Python-level socket connect or datagram in the test process must go
to a loopback address (127.0.0.0/8, ::1, "localhost") or a Unix socket. Anything else raises `NonLoopbackError`,
naming the address, before a packet leaves.

It covers what Python opens (aiohttp, httpx, urllib, the SDK's helpers, raw sockets); gRPC's C core resolves and
connects on its own, and there the scheduler's own rule holds (it dials only the hosts the node allows,
`services/trust.py`). Services a test starts are separate processes: they bind and dial 127.0.0.1 by
construction, and vLLM is told its host (`VLLM_HOST_IP`) so it does not probe a public address for its own.
"""

from __future__ import annotations

import ipaddress
import socket


class NonLoopbackError(ConnectionRefusedError):
    """A test tried to reach beyond this machine."""


def is_loopback(address: object) -> bool:
    if not isinstance(address, tuple):
        return True  # AF_UNIX: a path (or an abstract name), never a network
    host = address[0]
    if isinstance(host, bytes):
        host = host.decode()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False  # a host name other than localhost would be resolved: not this machine's to promise


def _checked(method):
    def guarded(self: socket.socket, address, *args):
        if self.family in (socket.AF_INET, socket.AF_INET6) and not is_loopback(address):
            raise NonLoopbackError(f"tests reach 127.0.0.1 only: {method.__name__} to {address!r} refused "
                                   f"(tests/loopback_guard.py)")
        return method(self, address, *args)

    guarded.__name__ = method.__name__
    return guarded


def _checked_sendto(method):
    def sendto(self: socket.socket, data, *args):
        address = args[-1]  # sendto(data, address) or sendto(data, flags, address)
        if self.family in (socket.AF_INET, socket.AF_INET6) and not is_loopback(address):
            raise NonLoopbackError(f"tests reach 127.0.0.1 only: sendto {address!r} refused (tests/loopback_guard.py)")
        return method(self, data, *args)

    return sendto


def install() -> None:
    """Guard `socket.socket` for the rest of the process (idempotent)."""
    if getattr(socket.socket, "_loopback_guarded", False):
        return
    socket.socket.connect = _checked(socket.socket.connect)
    socket.socket.connect_ex = _checked(socket.socket.connect_ex)
    socket.socket.sendto = _checked_sendto(socket.socket.sendto)
    socket.socket._loopback_guarded = True
