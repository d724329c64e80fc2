"""The worker contract: what tiercake's front and router need from an inference engine.

A worker process is an HTTP shell (``worker.py``) around one ``ServingEngine``. The shell registers
the worker with the conductor, serves ``/generate`` (NDJSON ``TokenEvent`` lines), ``/load`` and
``/health``, and turns the engine's typed errors into HTTP statuses; the engine does the compute.
tiercake's reference engine (``reference.py``) implements it; a vLLM or SGLang instance implements the
same class and nothing in the front changes.

The front relies on exactly this:

- ``generate(request)`` streams ``TokenEvent``s. The first carries ``PrefillStats`` (how much of the
  prompt was reused and from where, where the time went). With ``request.handoff`` (a prefill for a
  separate decode worker) the last carries a ``KVHandoff``, sent only once the prompt's full blocks
  are on the node it names, so a decode worker can pull them at once. With ``request.source`` the
  engine loads the prefix from that node without asking the index. Leaving the iteration early (a
  client that went away) frees the request's resources.
- Before the first event, a bad request raises ``RequestRejected`` (400: sending it elsewhere will
  not help) and a full engine ``EngineBusy`` (503: another worker may take it). After it, a failure
  ends the stream with an error line.
- ``perf`` (fitted timings the router predicts TTFT and TBT with) and ``load()``.
- ``store``: the gpu tier's ``TieredStore`` whose committed blocks the worker's ``ConductorLink``
  reports to the index (what it caches, so routing can prefer it), or None when tiercake does not own
  the engine's cache; then ``held`` may still say what the engine caches (vLLM: ``PrefixMirror``).
- ``kv_space``: how the engine keys its blocks, when not as the serving config says.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator
from typing import ClassVar

from tiercake.messages import GenerateRequest, KVSpace, SessionCommand, TokenEvent, WorkerLoadReply, WorkerPerf
from tiercake.tiers import TieredStore

from .conductor_link import HeldBlocks


class RequestRejected(ValueError):
    """The request cannot be served by any worker of this kind (context too long, bad tokens): 400."""


class EngineBusy(RuntimeError):
    """Not now: the engine has no room for the request (another worker may have): 503, retryable."""


class ServingEngine(ABC):
    """An inference engine behind tiercake's worker contract."""

    name: ClassVar[str]  # "reference", "vllm", ...

    @property
    @abstractmethod
    def perf(self) -> WorkerPerf:
        """Timings fitted on this machine (prefill time model, decode step, memcpy rate)."""

    @property
    @abstractmethod
    def store(self) -> TieredStore | None:
        """The store whose blocks are reported to the index, or None."""

    @property
    def held(self) -> HeldBlocks | None:
        """What the engine caches, as reported to the index (default: ``store``'s blocks)."""
        return self.store

    @property
    def kv_space(self) -> KVSpace | None:
        """The engine's block keys, when not the serving config's (None: the config's)."""
        return None

    @property
    def gpu_capacity_bytes(self) -> int:
        """The KV capacity the member advertises (its ``gpu`` tier)."""
        return 0

    @abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        """Token events for one request (see the module docstring for the contract)."""

    @abstractmethod
    def load(self) -> WorkerLoadReply:
        """Waiting, prefilling and running requests, free and total KV blocks, completed requests."""

    def change_session(self, command: SessionCommand) -> None:
        """The control API closes a session, or changes its retention or priority, through the worker
        that ran its last turn: its tiers and its node's are told. ``LookupError``: not one it knows;
        ``NotImplementedError``: this engine cannot (the worker answers 501)."""
        raise NotImplementedError(f"the {self.name} engine does not take session changes")

    @abstractmethod
    async def close(self) -> None:
        """Stop; write-throughs in flight are finished or abandoned, never half-visible."""
