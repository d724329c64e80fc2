"""The worker contract, front <-> worker: a generate request in, token events out."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Name, Reply, Request


class KVHandoff(Request):
    """Where a prompt's first ``blocks`` full blocks are held: the node a prefill worker wrote them to
    (the decode worker pulls them from there), or the node the router told a worker to pull from."""

    node: Name
    blocks: int = Field(ge=0)
    tier: str = Field(default="handoff", description="the tier the node holds them in (for the statistics)")
    runs: list[tuple[str, int]] = Field(
        default_factory=list,
        description="the tier of each block, run-length encoded (PrefixHolding.runs), when the index said",
    )


MAX_SESSION_S = 7 * 24 * 3600.0  # the longest pause or retention a session may announce


class SessionDirective(Request):
    """The conversation a request belongs to, and what its client asks of its KV. ``id`` and ``parent``
    are the front's hashes of the client's session ids, scoped by tenant: two tenants' equal ids never
    meet, and the client's own string goes no further than the front."""

    id: str = Field(pattern=r"^[0-9a-f]{32}$")
    parent: str | None = Field(default=None, pattern=r"^[0-9a-f]{32}$", description="a subagent's parent session")
    retain_s: float | None = Field(default=None, gt=0, le=MAX_SESSION_S, description="keep its KV this long paused")
    priority: int = Field(default=0, ge=-100, le=100, description="kept before lower priorities in every tier")
    pause_s: float | None = Field(default=None, ge=0, le=MAX_SESSION_S, description="the pause expected after it")
    close: bool = Field(default=False, description="the conversation ends with this request")


class SessionCommand(Request):
    """The front asks the worker that ran a session's last turn to tell its tiers again: closed
    (``session.close``), or paused with a new retention and priority."""

    session: SessionDirective
    tenant: Name


class SessionInfo(Reply):
    """A session as the front has seen it (the control API's ``/v1/sessions``)."""

    id: str
    tenant: str
    parent: str | None = None
    state: Literal["active", "paused", "closed"]
    turns: int
    idle_s: float = Field(description="since its last turn began or ended")
    retain_s: float | None = None
    priority: int = 0
    pause_s: float | None = None
    worker: str | None = Field(default=None, description="the worker that ran its last turn")


class SessionsReply(Reply):
    sessions: list[SessionInfo]
    next_offset: int | None = Field(default=None, description="where the next page starts (None: this was the last)")


class SessionChange(Request):
    """``POST /v1/sessions/{id}``: close it now, or keep it longer or at another priority."""

    tenant: Name = "default"
    close: bool = False
    retain_s: float | None = Field(default=None, gt=0, le=MAX_SESSION_S)
    priority: int | None = Field(default=None, ge=-100, le=100)


class GenerateRequest(Request):
    """What the front sends a worker (token ids: the front tokenizes)."""

    tokens: list[int] = Field(min_length=1)
    max_tokens: int = Field(gt=0)
    temperature: float = Field(default=0.0, ge=0)
    top_p: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="nucleus sampling: the smallest set of tokens whose probabilities add up to it",
    )
    tenant: Name = "default"
    salt: str | None = Field(default=None, description="the hashing salt; default: the tenant")
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64, description="torch's generator takes 64 bits")
    pull: bool = Field(default=True, description="load what nodes hold beyond the worker's own prefix")
    source: KVHandoff | None = Field(default=None, description="pull the prefix from here without asking the index")
    handoff: bool = Field(
        default=False,
        description="a prefill for a decode worker: its last event carries the "
        "KVHandoff, sent only once the blocks are on the node",
    )
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=20,
        description="each token's log-probability and this many most likely alternatives (none: no log-probabilities)",
    )
    session: SessionDirective | None = Field(default=None, description="the conversation it belongs to, if any")


class PrefillStats(Reply):
    """How a worker's prefill went: reuse, and where the time went."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # tokens whose KV was reused, from any source
    sources: dict[str, int] = Field(default_factory=dict, description='"gpu" / "<node>:<tier>" -> blocks')
    block_size: int = Field(
        default=0,
        ge=0,
        description="tokens per block of sources (0: the serving config's; "
        "an engine with its own block size, as vLLM, says)",
    )
    lookup_s: float = 0.0
    load_s: float = 0.0
    load_bytes: int = 0
    load_tier: str | None = None  # the tier of the node that held most of the pulled blocks
    compute_s: float = 0.0
    written_blocks: int = 0  # new full blocks of the prompt written through to the worker's node
    refused_blocks: int = 0  # pulled blocks whose seal did not verify (forged or corrupt): recomputed instead
    prefetched_blocks: int = 0  # of the reused blocks, those pulled into the worker while the request waited
    copy_bytes_per_s: float | None = None  # the worker's memcpy rate, the floor of a load
    final: bool = Field(
        default=True,
        description="false: the engine learns what it reused only at the end "
        "(vLLM streaming); its last event carries the final figures",
    )


class TokenLogprob(Reply):
    token: int
    logprob: float


class TokenEvent(Reply):
    """One generated token; the first carries the prefill stats, the last its finish reason and, from
    a prefill made for a decode worker, the handoff. With ``logprobs`` asked for: the token's
    log-probability under the model (before temperature and top_p, as vLLM reports by default) and the
    most likely alternatives, most likely first."""

    token: int
    index: int
    logprob: float | None = None
    top_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stats: PrefillStats | None = None
    handoff: KVHandoff | None = None


class WorkerHealth(Reply):
    status: str
    worker: str
    role: str
    engine: str = "reference"
    pid: int
    frozen_objects: int = 0  # objects its start left that the collector no longer walks (tiercake.heap)


class WorkerLoadReply(Reply):
    waiting: int = 0
    prefilling: int = 0
    running: int = 0
    free_blocks: int = 0
    blocks: int = 0
    completed: int = 0
