"""The conductor: one process's share of the control plane, over a metadata backend.

Every conductor loads and follows the placement index and the membership, and serves lookups from
memory; the one that wins the election also accepts placement writes. The HTTP face is ``api.py``.
"""

from __future__ import annotations

import uuid

from pydantic import BaseModel, ConfigDict, Field

from .election import LeaderElection
from .membership import Membership
from .metadata import MetadataBackend, MetadataUnavailableError
from .placement import PlacementIndex


class NotLeaderError(Exception):
    """A write reached a conductor that does not lead; ``leader`` says who does (if anyone)."""

    def __init__(self, leader: str | None) -> None:
        super().__init__(f"this conductor does not lead; the leader is {leader or 'not known yet'}")
        self.leader = leader


class ConductorInfo(BaseModel):
    """What a conductor publishes about itself, so clients can find the leader's address."""

    model_config = ConfigDict(extra="forbid")

    conductor_id: str
    url: str = Field(description="where its HTTP API listens")


class Conductor:
    def __init__(self, meta: MetadataBackend, conductor_id: str | None = None, url: str = "", ttl: int = 3) -> None:
        self.meta = meta
        self.conductor_id = conductor_id or f"conductor-{uuid.uuid4().hex[:8]}"
        self.url = url
        self.index = PlacementIndex(meta)
        self.members = Membership(meta)
        self.election = LeaderElection(meta, ConductorInfo(conductor_id=self.conductor_id, url=url).model_dump_json(),
                                       ttl=ttl)

    async def start(self) -> Conductor:
        await self.index.start()
        await self.members.start()
        await self.election.start()
        return self

    async def close(self) -> None:
        await self.election.resign()
        await self.members.close()
        await self.index.close()

    @property
    def is_leader(self) -> bool:
        return self.election.is_leader

    async def leader(self) -> ConductorInfo | None:
        raw = await self.election.leader()
        return ConductorInfo.model_validate_json(raw) if raw else None

    async def ready(self) -> tuple[bool, str]:
        """Ready to serve: the backend answers and a leader is known."""
        try:
            leader = await self.leader()
        except MetadataUnavailableError as exc:
            return False, f"metadata backend unreachable: {exc}"
        if leader is None:
            return False, "no leader elected yet"
        return True, f"leader {leader.conductor_id}"

    def require_leader(self, leader: ConductorInfo | None) -> None:
        if not self.is_leader:
            raise NotLeaderError(leader.url if leader else None)
