"""A conductor on the embedded backend behind its real HTTP app on a loopback port, for tests."""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from tiercake.conductor.api import build_app
from tiercake.conductor.embedded import EmbeddedBackend
from tiercake.conductor.service import Conductor


@contextlib.asynccontextmanager
async def running_conductor(tokens: list[str] | None = None, frontend=None, metrics_open: bool = True,
                            **conductor_kwargs):
    """Yields (url, conductor) once it leads; ``frontend``: a callable taking the conductor and
    returning the ``Frontend`` to serve beside the control API."""
    meta = await EmbeddedBackend().start()
    conductor = await Conductor(meta, conductor_kwargs.pop("conductor_id", "c1"), **{"ttl": 1, **conductor_kwargs}).start()
    runner = web.AppRunner(build_app(conductor, tokens, frontend(conductor) if frontend else None,
                                     metrics_open=metrics_open))
    try:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        await asyncio.wait_for(conductor.election.leading.wait(), 10)
        yield f"http://{host}:{port}", conductor
    finally:
        await runner.cleanup()
        await conductor.close()
        await meta.close()
