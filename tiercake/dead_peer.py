"""A peer that stops answering is noticed in seconds, not minutes: every connection between hosts
sends TCP keepalives each second once idle and aborts when what it sent (data or keepalive) has gone
unacknowledged for ``DEAD_PEER_S`` (``TCP_USER_TIMEOUT``). Without it, a host whose packets to us
are dropped (a one-way partition) left a request waiting for the whole read timeout, and a
connection made before a cut waited for the kernel's retransmissions (about 15 minutes).

A peer that is alive but slow is not affected: its kernel acknowledges whatever its process has not
read yet. One stopped (SIGSTOP) is not noticed here either; its membership lease lapses instead."""

from __future__ import annotations

import socket
import ssl

import aiohttp

DEAD_PEER_S = 4.0


def watch(sock: socket.socket, after_s: float = DEAD_PEER_S) -> None:
    """Set ``sock`` (TCP, connected or not) to abort once its peer has acknowledged nothing for
    ``after_s``. Other sockets are left as they are."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, int(after_s)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(after_s * 1000))


def _watched_socket(addr_info) -> socket.socket:
    family, kind, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=kind, proto=proto)
    watch(sock)
    return sock


def connector(ssl_context: ssl.SSLContext | None = None) -> aiohttp.TCPConnector:
    """An aiohttp connector whose every connection is watched."""
    if ssl_context is not None:
        return aiohttp.TCPConnector(ssl=ssl_context, socket_factory=_watched_socket)
    return aiohttp.TCPConnector(socket_factory=_watched_socket)
