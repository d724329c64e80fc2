"""A conductor on the embedded backend behind its real HTTP app on a loopback port, for tests."""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from tiercake.conductor.api import build_app
from tiercake.conductor.embedded import EmbeddedBackend
from tiercake.conductor.service import Conductor
from tiercake.errors import app_runner


@contextlib.asynccontextmanager
async def running_conductor(
    tokens: list[str] | None = None, frontend=None, metrics_open: bool = True, **conductor_kwargs
):
    """Yields (url, conductor) once it leads; ``frontend``: a callable taking the conductor and
    returning the ``Frontend`` to serve beside the control API."""
    meta = await EmbeddedBackend().start()
    conductor = await Conductor(
        meta, conductor_kwargs.pop("conductor_id", "c1"), **{"ttl": 1, **conductor_kwargs}
    ).start()
    runner = app_runner(
        build_app(conductor, tokens, frontend(conductor) if frontend else None, metrics_open=metrics_open)
    )
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


@contextlib.asynccontextmanager
async def leader_and_follower(token: str = "peer-token", runners_too: bool = False):
    """Two conductors on one embedded backend, each behind its HTTP app on a loopback port: yields
    (leader, follower) once the first leads (``runners_too``: and their apps' runners, to stop one's
    HTTP); they call each other with ``token``."""
    import socket

    meta = await EmbeddedBackend().start()
    started, runners = [], []
    try:
        for name in ("leader", "follower"):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{sock.getsockname()[1]}"
            conductor = await Conductor(meta, name, url=url, ttl=1, peer_token=token).start()
            runner = app_runner(build_app(conductor, [token]))
            await runner.setup()
            await web.SockSite(runner, sock).start()
            started.append(conductor)
            runners.append(runner)
            if name == "leader":
                await asyncio.wait_for(conductor.election.leading.wait(), 10)
        yield (started[0], started[1], runners) if runners_too else (started[0], started[1])
    finally:
        for runner in runners:
            await runner.cleanup()
        for conductor in reversed(started):
            await conductor.close()
        await meta.close()
