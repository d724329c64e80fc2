"""The lab's hosts: each a network namespace with an address of its own on one bridge, and a mount
namespace with a /dev/shm of its own and a boot id of its own (so no two hosts share memory, nor
believe they do: the shm transport and the same-host key-value path compare boot ids). Addresses are
from 198.18.0.0/15 (RFC 2544's range for network benchmarks), used only inside what the lab makes:
the bridge holds ``198.18.<net>.1`` in the machine's own namespace (where ``tiercake ask`` reaches
the front from), host ``i`` holds ``198.18.<net>.<10+i>``.

Every namespace, link, mount and file is named with the lab's tag and recorded in its state file as it
is made, so that ``Hosts.remove`` (``tiercake lab down``, Ctrl-C of ``lab up``, a test's teardown)
takes away exactly what was made, also after a crash of the process that made it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

RUN = Path("/run/tiercake-lab")  # the mount namespaces' files and the hosts' boot ids
PREFIX = "tclab"
SHM_BYTES = 2 << 30  # each host's /dev/shm (a tmpfs: only what is written takes memory)


class LabUnavailable(RuntimeError):
    """This machine cannot make the lab (not root, or no iproute2 / util-linux)."""


@dataclass
class Host:
    name: str  # h1, h2, ...
    address: str
    netns: str
    mountns: str  # the file the mount namespace is bound to
    veth: str  # the host's end, inside its namespace
    peer: str  # the bridge's end, in the machine's namespace

    def prefix(self) -> list[str]:
        """What runs a command on this host."""
        return ["nsenter", f"--net=/run/netns/{self.netns}", f"--mount={self.mountns}", "--"]

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix(), *args], check=check, capture_output=True, text=True, timeout=30)


@dataclass
class HostsState:
    tag: str
    net: int
    bridge: str
    gateway: str
    hosts: list[Host] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)  # process groups the lab started
    owner: int = 0  # the process of ``lab up`` that made it
    url: str = ""  # the front's, once it serves

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> HostsState:
        data = json.loads(path.read_text())
        return cls(**{**data, "hosts": [Host(**h) for h in data["hosts"]]})


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def require_root() -> None:
    if os.geteuid() != 0:
        raise LabUnavailable("the lab makes network namespaces, links and mounts: it needs root")
    for tool in ("ip", "nsenter", "unshare", "iptables", "tc"):
        if not any((Path(d) / tool).exists() for d in os.environ.get("PATH", "/usr/sbin:/usr/bin").split(":")):
            raise LabUnavailable(f"the lab needs {tool} (iproute2, util-linux, iptables)")


def make_hosts(count: int, state_path: Path, net: int | None = None) -> HostsState:
    """``count`` hosts on a new bridge, recorded in ``state_path`` as each part is made."""
    require_root()
    if not 1 <= count <= 200:
        raise ValueError(f"a lab has 1 to 200 hosts, got {count}")
    tag = uuid.uuid4().hex[:5]
    net = net if net is not None else _free_net()
    state = HostsState(tag=tag, net=net, bridge=f"{PREFIX}{tag}br", gateway=f"198.18.{net}.1")
    state.save(state_path)
    try:
        _ip("link", "add", state.bridge, "type", "bridge")
        _ip("addr", "add", f"{state.gateway}/24", "dev", state.bridge)
        _ip("link", "set", state.bridge, "up")
        for i in range(1, count + 1):
            state.hosts.append(_make_host(state, i))
            state.save(state_path)
    except BaseException:
        remove(state)
        state_path.unlink(missing_ok=True)
        raise
    return state


def _make_host(state: HostsState, i: int) -> Host:
    host = Host(
        name=f"h{i}",
        address=f"198.18.{state.net}.{10 + i}",
        netns=f"{PREFIX}{state.tag}h{i}",
        mountns=str(RUN / f"{state.tag}-h{i}.mnt"),
        veth=f"{PREFIX}{state.tag}v{i}",
        peer=f"{PREFIX}{state.tag}p{i}",
    )
    _ip("netns", "add", host.netns)
    _ip("link", "add", host.peer, "type", "veth", "peer", "name", host.veth)
    _ip("link", "set", host.veth, "netns", host.netns)
    _ip("link", "set", host.peer, "master", state.bridge)
    _ip("link", "set", host.peer, "up")
    inside = ["ip", "netns", "exec", host.netns]
    for args in (
        ["ip", "addr", "add", f"{host.address}/24", "dev", host.veth],
        ["ip", "link", "set", host.veth, "up"],
        ["ip", "link", "set", "lo", "up"],
    ):
        subprocess.run([*inside, *args], check=True, capture_output=True, timeout=30)
    RUN.mkdir(parents=True, exist_ok=True)
    boot_id = RUN / f"{state.tag}-h{i}.boot_id"
    boot_id.write_text(str(uuid.uuid4()) + "\n")
    Path(host.mountns).touch()
    # its own mount namespace: a /dev/shm of its own, and a boot id of its own over the kernel's
    setup = (
        f"mount -t tmpfs -o size={SHM_BYTES},mode=1777 tclab-shm /dev/shm && "
        f"mount --bind {boot_id} /proc/sys/kernel/random/boot_id"
    )
    subprocess.run(
        ["unshare", f"--mount={host.mountns}", "--propagation", "private", "sh", "-c", setup],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return host


def _free_net() -> int:
    """A /24 of 198.18.0.0/15 no link of this machine uses yet."""
    used = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, timeout=30).stdout
    for net in range(100, 250):
        if f"198.18.{net}." not in used:
            return net
    raise LabUnavailable("every 198.18.x.0/24 the lab uses is taken (other labs running?)")


def remove(state: HostsState) -> list[str]:
    """Take away everything ``state`` records: its processes, each host's namespaces and link, the
    bridge and the files; what could not be removed, named (empty: all gone)."""
    import signal

    for pid in state.pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    left = []
    for host in state.hosts:
        with contextlib.suppress(OSError):
            subprocess.run(["umount", "-l", host.mountns], capture_output=True, timeout=30)
        for made in RUN.glob(f"{state.tag}-{host.name}.*"):  # its mount namespace, boot id, link delay
            made.unlink(missing_ok=True)
        subprocess.run(["ip", "link", "del", host.peer], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, timeout=30)
        if Path(f"/run/netns/{host.netns}").exists():
            left.append(f"network namespace {host.netns}")
    subprocess.run(["ip", "link", "del", state.bridge], capture_output=True, timeout=30)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=30).stdout
    left += [
        f"link {name}"
        for name in [state.bridge, *(h.peer for h in state.hosts)]
        if f" {name}:" in links or f" {name}@" in links
    ]
    return left
