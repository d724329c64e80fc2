"""What the lab's links do: each host's delay (``delay.py``, a relay its outgoing TCP connections to
other hosts are redirected through), loss (iptables' ``statistic`` match dropping arriving packets at
random), rate (a token bucket on the host's end of its link), and the nemesis's cuts: whole hosts
isolated, pairs split, one direction only (asymmetric), each in a chain of its own in every host's
namespace (``TCLAB-CUT``), so that healing is one flush. All of it in the hosts' namespaces: the
machine's own never changes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from .hosts import RUN, Host, HostsState

DELAY_PORT = 7399  # the relay's port inside every host's namespace
MARK = 0x7C1AB  # the relay's own sockets: not redirected again
CUT = "TCLAB-CUT"
# A connection through a relay is made with the relay at once, before the relay reaches the far end:
# across a cut, a client would take it for made (gRPC even calls the channel ready). So a cut also
# drops the connection attempts towards the far side where they start, before the redirect (the raw
# table), and they hang as they do across a real partition; connections made before go on as the
# cut dictates (one way only, for an asymmetric one).
SYN = "TCLAB-SYN"
DELAY = "TCLAB-DELAY"


def _inside(host: Host, *args: str) -> None:
    done = host.run(*args, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{host.name}: {' '.join(args)}: {done.stderr.strip()}")


def shape(state: HostsState, host: Host, *, loss: float = 0.0, rate_gbit: float | None = None) -> None:
    """The host's link, once: its outgoing connections to the other hosts through its delay relay
    (started by the caller: ``delay_command``), packets dropped at random with probability ``loss``,
    and at most ``rate_gbit`` leaving it; the cut chain, empty."""
    subnet = f"198.18.{state.net}.0/24"
    nat = ("iptables", "-t", "nat")
    _inside(host, *nat, "-N", DELAY)
    _inside(host, *nat, "-A", DELAY, "-d", host.address, "-j", "RETURN")
    _inside(host, *nat, "-A", DELAY, "-m", "mark", "--mark", str(MARK), "-j", "RETURN")
    _inside(host, *nat, "-A", DELAY, "-p", "tcp", "-j", "REDIRECT", "--to-ports", str(DELAY_PORT))
    _inside(host, *nat, "-A", "OUTPUT", "-p", "tcp", "-d", subnet, "-j", DELAY)
    _inside(host, "iptables", "-N", CUT)
    _inside(host, "iptables", "-I", "INPUT", "-j", CUT)
    _inside(host, "iptables", "-I", "OUTPUT", "-j", CUT)
    _inside(host, "iptables", "-t", "raw", "-N", SYN)
    _inside(host, "iptables", "-t", "raw", "-A", "OUTPUT", "-p", "tcp", "--syn", "-j", SYN)
    if loss:
        set_loss(host, loss)
    if rate_gbit:
        set_rate(host, rate_gbit)


def set_rate(host: Host, rate_gbit: float | None) -> None:
    """At most ``rate_gbit`` leaving ``host`` (a token bucket on its link; None: no limit), replacing
    any rate set."""
    if rate_gbit is None:
        host.run("tc", "qdisc", "del", "dev", host.veth, "root", check=False)  # none set: nothing to do
        return
    if not (0 < rate_gbit <= 400) or rate_gbit != rate_gbit:
        raise ValueError(f"a rate is over 0 and at most 400 Gbit/s, got {rate_gbit}")
    burst = max(16 << 10, int(rate_gbit * 1e9 / 8 / 1000))  # a millisecond's worth, at least 16 KiB
    _inside(
        host,
        *("tc", "qdisc", "replace", "dev", host.veth, "root", "tbf"),
        *("rate", f"{rate_gbit}gbit", "burst", str(burst), "latency", "50ms"),
    )


def delay_file(host: Host) -> Path:
    """Where the host's relay reads its one-way delay (milliseconds) from."""
    return RUN / f"{Path(host.mountns).name.removesuffix('.mnt')}.delay"


def delay_command(host: Host) -> list[str]:
    """The relay's command line (run on the host: ``Host.prefix``), its delay 0 until ``set_rtt``."""
    delay_file(host).write_text("0\n")
    return [sys.executable, "-m", "tiercake.lab.delay", str(DELAY_PORT), str(MARK), str(delay_file(host))]


PROBE = """
import socket, statistics, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
c.settimeout(5)
rtts = []
for _ in range(int(sys.argv[3])):
    t = time.perf_counter()
    c.sendall(b"x")
    c.recv(1)
    rtts.append(time.perf_counter() - t)
print(statistics.median(rtts))
"""


def measure_rtt(a: Host, b: Host, count: int = 60) -> float:
    """The median round trip of a byte from ``a`` to ``b`` and back over the link as a connection
    sees it (through ``a``'s relay, echoed by ``b``'s), in seconds."""
    done = a.run(sys.executable, "-c", PROBE, b.address, str(DELAY_PORT), str(count), check=False)
    if done.returncode != 0:
        raise RuntimeError(f"no round trip from {a.name} to {b.name}: {done.stderr.strip()[-300:]}")
    return float(done.stdout)


def set_rtt(state: HostsState, rtt_s: float) -> float:
    """Every link's round trip set to ``rtt_s``, less what the relays themselves take (measured with no
    delay between the first two hosts); returns the round trip then measured (the lab's real one)."""
    if not (0 <= rtt_s <= 10) or rtt_s != rtt_s:
        raise ValueError(f"a round trip is 0 to 10 s, got {rtt_s}")
    for host in state.hosts:
        delay_file(host).write_text("0\n")
    if len(state.hosts) < 2:
        return 0.0
    time.sleep(0.2)  # the relays read the files every 50 ms
    a, b = state.hosts[:2]
    base = measure_rtt(a, b)
    for host in state.hosts:
        delay_file(host).write_text(f"{max(0.0, rtt_s - base) / 2 * 1e3:.4f}\n")
    time.sleep(0.2)
    return measure_rtt(a, b)


LOSS = "TCLAB-LOSS"


def set_loss(host: Host, loss: float) -> None:
    """Drop arriving packets from the bridge with probability ``loss`` (0: none), replacing any loss set."""
    if not 0 <= loss < 1:
        raise ValueError(f"a loss is a probability in [0, 1), got {loss}")
    done = host.run("iptables", "-N", LOSS, check=False)
    if done.returncode == 0:
        _inside(host, "iptables", "-I", "INPUT", "-i", host.veth, "-j", LOSS)
    _inside(host, "iptables", "-F", LOSS)
    if loss:
        _inside(
            host,
            *("iptables", "-A", LOSS, "-m", "statistic", "--mode", "random"),
            *("--probability", f"{loss:.4f}", "-j", "DROP"),
        )


def isolate(state: HostsState, host: Host) -> None:
    """Nothing between ``host`` and any other host or the machine itself, either way."""
    subnet = f"198.18.{state.net}.0/24"
    # what a host sends itself stays (its processes talk to each other, and to its delay relay)
    _inside(host, "iptables", "-A", CUT, "-s", host.address, "-d", host.address, "-j", "RETURN")
    _inside(host, "iptables", "-A", CUT, "-s", subnet, "-d", subnet, "-j", "DROP")
    _inside(host, "iptables", "-t", "raw", "-A", SYN, "-d", host.address, "-j", "RETURN")
    _inside(host, "iptables", "-t", "raw", "-A", SYN, "-d", subnet, "-j", "DROP")
    for other in state.hosts:
        if other is not host:
            _no_new_connections(other, host)


def cut(a: Host, b: Host, *, both: bool = True) -> None:
    """What ``b`` sends ``a`` is dropped (and, ``both``, what ``a`` sends ``b``): one direction alone is
    an asymmetric partition (``a`` reaches ``b``, ``b``'s replies never arrive)."""
    _inside(a, "iptables", "-A", CUT, "-s", b.address, "-j", "DROP")
    if both:
        _inside(b, "iptables", "-A", CUT, "-s", a.address, "-j", "DROP")
    # either way, no new connection is made: a handshake needs both directions
    _no_new_connections(a, b)
    _no_new_connections(b, a)


def _no_new_connections(src: Host, dst: Host) -> None:
    _inside(src, "iptables", "-t", "raw", "-A", SYN, "-d", dst.address, "-j", "DROP")


def heal(state: HostsState) -> None:
    """Every cut undone."""
    for host in state.hosts:
        _inside(host, "iptables", "-F", CUT)
        _inside(host, "iptables", "-t", "raw", "-F", SYN)


def rtt_probe(a: Host, b: Host, port: int) -> subprocess.CompletedProcess:
    """Connect from ``a`` to ``b``'s ``port`` once (a reachability probe for tests)."""
    script = f"import socket; socket.create_connection(('{b.address}', {port}), timeout=2).close()"
    return a.run(sys.executable, "-c", script, check=False)
