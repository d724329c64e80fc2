"""A lab host's link delay: every TCP connection the host opens to another lab host is redirected here
(iptables REDIRECT in the host's namespace, ``links.py``) and relayed to where it was going, each
direction's bytes held ``delay`` seconds, so that a request and its answer take ``2 * delay`` more
than on the bridge alone: the link's round trip. This kernel has no ``netem`` (no qdisc here can
delay), so the delay is made at the transport layer; loss, rate and partitions stay in the kernel
(iptables, tbf).

Threads, not an event loop: a loop's timers wake at millisecond granularity (epoll), and a lab link
of 0.2 ms must not become 1.2 ms; a thread's ``time.sleep`` wakes within tens of microseconds. Each
direction keeps its bytes in order and stops reading while it holds ``WINDOW`` bytes (a slow reader
slows its writer, as TCP's window does). The relay's own sockets carry the mark the redirect skips.

The delay is read from a file (``DELAY_FILE``, milliseconds one way), again whenever it changes, so a
link's round trip can be set while connections run through it. A connection that reaches the relay's
port without being redirected (another host's probe, relayed by that host's own relay) is echoed: the
lab measures each link's round trip with it (``links.measure_rtt``).

Run inside the host's namespaces: ``python -m tiercake.lab.delay PORT MARK DELAY_FILE``."""

from __future__ import annotations

import collections
import contextlib
import socket
import struct
import sys
import threading
import time
from pathlib import Path

SO_ORIGINAL_DST = 80
CHUNK = 256 << 10
WINDOW = 8 << 20  # bytes one direction may hold in flight (the link's bandwidth-delay product, and more)


_delay_s = 0.0  # one way, as the file last said


def _watch(path: Path) -> None:
    global _delay_s
    seen = None
    while True:
        with contextlib.suppress(OSError, ValueError):
            stat = path.stat()
            if (stat.st_mtime_ns, stat.st_size) != seen:
                seen = (stat.st_mtime_ns, stat.st_size)
                _delay_s = max(0.0, float(path.read_text().strip() or 0) / 1e3)
        time.sleep(0.05)


class _Direction:
    """Bytes from ``src`` to ``dst``, each chunk sent the link's delay after it arrived."""

    def __init__(self, src: socket.socket, dst: socket.socket) -> None:
        self.src, self.dst = src, dst
        self.held: collections.deque[tuple[float, bytes]] = collections.deque()
        self.in_flight = 0
        self.done = False
        self.cond = threading.Condition()

    def read(self) -> None:
        try:
            while True:
                with self.cond:
                    while self.in_flight >= WINDOW:
                        self.cond.wait()
                data = self.src.recv(CHUNK)
                if not data:
                    break
                with self.cond:
                    self.held.append((time.monotonic() + _delay_s, data))
                    self.in_flight += len(data)
                    self.cond.notify_all()
        except OSError:
            pass
        finally:
            with self.cond:
                self.done = True
                self.cond.notify_all()

    def write(self) -> bool:
        """Until the source ended and everything held is sent (True), or the destination failed (False)."""
        while True:
            with self.cond:
                while not self.held and not self.done:
                    self.cond.wait()
                if not self.held:
                    break
                due, data = self.held[0]
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                self.dst.sendall(data)
            except OSError:
                return False
            with self.cond:
                self.held.popleft()
                self.in_flight -= len(data)
                self.cond.notify_all()
        with contextlib.suppress(OSError):
            self.dst.shutdown(socket.SHUT_WR)
        return True


def _relay(client: socket.socket, mark: int) -> None:
    upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        raw = client.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
        port, packed = struct.unpack_from("!H4s", raw, 2)
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        target = (socket.inet_ntoa(packed), port)
        if target == client.getsockname()[:2]:  # not redirected: a probe from another host's relay
            upstream.close()
            _echo(client)
            return
        upstream.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)  # past the redirect: straight out
        time.sleep(2 * _delay_s)  # the handshake's round trip
        upstream.settimeout(30)
        upstream.connect(target)
        upstream.settimeout(None)
    except OSError:
        # the attempt fails as a direct one would have: a reset (the client's connect had succeeded)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()
        upstream.close()
        return
    ways = [_Direction(client, upstream), _Direction(upstream, client)]
    readers = [threading.Thread(target=way.read, daemon=True) for way in ways]
    for reader in readers:
        reader.start()
    writers_ok: list[bool] = []
    other = threading.Thread(target=lambda: writers_ok.append(ways[1].write()), daemon=True)
    other.start()
    writers_ok.append(ways[0].write())
    if not writers_ok[-1]:  # one side is gone: so is the connection, for the other too
        _abort(client, upstream)
    other.join()
    if not all(writers_ok):
        _abort(client, upstream)
    for reader in readers:
        reader.join()
    client.close()
    upstream.close()


def _echo(client: socket.socket) -> None:
    with contextlib.suppress(OSError), client:
        while data := client.recv(CHUNK):
            client.sendall(data)


def _abort(*socks: socket.socket) -> None:
    for s in socks:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)


def serve(port: int, mark: int, delay_file: Path) -> None:
    with contextlib.suppress(OSError, AttributeError):  # sleeps that end when asked, not 50 us later
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(29, 1)  # PR_SET_TIMERSLACK: 1 ns
    threading.Thread(target=_watch, args=(delay_file,), daemon=True).start()
    threading.stack_size(512 << 10)  # four threads a connection: their stacks small
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", port))
    listener.listen(1024)
    print("ready", flush=True)
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_relay, args=(client, mark), daemon=True).start()


if __name__ == "__main__":
    port_arg, mark_arg, file_arg = sys.argv[1:4]
    with contextlib.suppress(KeyboardInterrupt):
        serve(int(port_arg), int(mark_arg), Path(file_arg))
