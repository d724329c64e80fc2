"""``tiercake lab up`` as a child process: what the tests, ``bench hosts`` and ``chaos --lab`` drive a
lab through, as a user would (the command as printed, Ctrl-C to end it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from .cluster import CONTROL_PORT, STATE
from .hosts import Host, HostsState


class LabProcess:
    def __init__(self, root: Path, args: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        from tiercake.up import _die_with_parent

        self.root = root
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tiercake.cli", "lab", "up", "--data-dir", str(root), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env=dict(os.environ if env is None else env),
            preexec_fn=_die_with_parent(os.getpid()),  # a test that dies takes its lab along
        )
        threading.Thread(target=self._read, daemon=True).start()
        self.state: HostsState | None = None
        self.url = ""

    def _read(self) -> None:
        assert self.proc.stdout is not None  # PIPE
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_ready(self, timeout: float = 300.0) -> LabProcess:
        """Until it prints ``tiercake lab is up: URL``."""
        deadline = time.monotonic() + timeout
        while not any(line.startswith("tiercake lab is up: ") for line in self.lines):
            if self.proc.poll() is not None:
                time.sleep(0.2)  # the rest of its output
                raise RuntimeError(f"tiercake lab up exited with {self.proc.returncode}:\n{self.output[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the lab was not up in {timeout:.0f} s:\n{self.output[-3000:]}")
            time.sleep(0.2)
        self.url = next(line for line in self.lines if line.startswith("tiercake lab is up: ")).split(": ", 1)[1]
        self.state = HostsState.load(self.root / STATE)
        return self

    @property
    def made(self) -> HostsState:
        """The hosts' state, once the lab is up."""
        if self.state is None:
            raise RuntimeError("the lab is not up yet: wait_ready() first")
        return self.state

    @property
    def hosts(self) -> list[Host]:
        return self.made.hosts

    @property
    def pids(self) -> list[int]:
        """The process groups the lab has started, restarts included (read afresh from its state)."""
        return HostsState.load(self.root / STATE).pids

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    @property
    def control_urls(self) -> list[str]:
        return [f"http://{h.address}:{CONTROL_PORT}" for h in self.hosts[:2]]

    @property
    def token(self) -> str:
        return (self.root / "control-token").read_text().strip()

    @property
    def secret(self) -> str:
        return (self.root / "cluster-secret").read_text().strip()

    def config_path(self, host: str = "h1") -> Path:
        return self.root / host / "node.yaml"

    def stop(self, timeout: float = 60.0) -> str:
        """Ctrl-C, as a user would; what it printed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        time.sleep(0.2)
        if (self.root / STATE).exists():  # it was killed before it took its hosts away
            from .hosts import remove

            remove(HostsState.load(self.root / STATE))
            (self.root / STATE).unlink(missing_ok=True)
        return self.output
