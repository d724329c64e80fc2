"""A real network partition on one machine, for fault injection (``tiercake chaos``) and tests: a
network namespace joined to the host by a veth pair. A process started with ``prefix`` runs inside
it, reachable from the host at ``ns_ip``; it reaches the host at ``host_ip``. ``cut`` takes the
namespace's end of the link down (established connections black-hole, new ones find no route, as a
failed switch port would), ``heal`` brings it back. Needs root (or CAP_NET_ADMIN) and iproute2."""

from __future__ import annotations

import random
import subprocess
import uuid


class PartitionUnavailable(RuntimeError):
    """This machine cannot make network namespaces (not root, or no iproute2)."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _free_octet() -> int:
    """A /24 of 198.19.0.0/16 (within 198.18.0.0/15, the range set aside for network tests; the
    lab uses 198.18.0.0/16) that no interface here has an address in."""
    used = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
    free = [o for o in range(1, 255) if f" 198.19.{o}." not in used]
    if not free:
        raise PartitionUnavailable("every 198.19.x.0/24 is in use here")
    return random.choice(free)


class Partition:
    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.ns, self.host_if, self.ns_if = f"tc-part-{tag}", f"tch{tag}", f"tcn{tag}"
        octet = _free_octet()
        self.host_ip, self.ns_ip = f"198.19.{octet}.1", f"198.19.{octet}.2"
        try:
            _ip("netns", "add", self.ns)
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            raise PartitionUnavailable(
                f"no network namespaces here (root or CAP_NET_ADMIN and iproute2 are "
                f"needed): {exc} {detail.decode(errors='replace').strip()}"
            ) from None
        try:
            _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            _ip("link", "set", self.ns_if, "netns", self.ns)
            _ip("addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
            _ip("link", "set", self.host_if, "up")
            self.inside("ip", "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if)
            self.inside("ip", "link", "set", "lo", "up")
            self.heal()
        except BaseException:
            self.close()
            raise

    @property
    def prefix(self) -> list[str]:
        """What to put before a command to run it inside the namespace."""
        return ["ip", "netns", "exec", self.ns]

    def inside(self, *args: str) -> None:
        subprocess.run([*self.prefix, *args], check=True, capture_output=True, timeout=10)

    def cut(self) -> None:
        self.inside("ip", "link", "set", self.ns_if, "down")

    def heal(self) -> None:
        self.inside("ip", "link", "set", self.ns_if, "up")

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=10)

    def __enter__(self) -> Partition:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
