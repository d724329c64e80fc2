"""vLLM's OpenAI-compatible server as a tiercake worker asks it: one HTTP session, opened at the
worker's start and closed with it, and every answer's status turned into the worker contract's typed
errors (400: the request's fault; 503: busy; anything else, or no answer: ``VllmUnavailable``)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time

import aiohttp

from tiercake.started import started

from ..contract import EngineBusy, RequestRejected

log = logging.getLogger(__name__)


class VllmUnavailable(ConnectionError):
    """The vLLM server could not be reached or failed the request (500: another worker may serve it)."""


class VllmServer:
    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=10)
        self._http: aiohttp.ClientSession | None = None

    def open(self) -> None:
        """(On the loop that will use it.)"""
        self._http = aiohttp.ClientSession(timeout=self._timeout)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    @property
    def http(self) -> aiohttp.ClientSession:
        return started(self._http, f"the client of vLLM at {self.url}")

    async def served_model(self, wait_s: float) -> str:
        """The model vLLM serves, asked until it answers or ``wait_s`` has passed."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                async with self.http.get(self.url + "/v1/models") as resp:
                    resp.raise_for_status()
                    return (await resp.json())["data"][0]["id"]
            except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, IndexError) as exc:
                if time.monotonic() >= deadline:
                    waited = f" within {wait_s:g} s" if wait_s else ""
                    raise VllmUnavailable(
                        f"no vLLM OpenAI server at {self.url}{waited} ({exc or type(exc).__name__}): "
                        "start it first (process.serve_command)"
                    ) from None
            await asyncio.sleep(1.0)

    async def num_kv_blocks(self) -> int:
        """The instance's KV blocks (vLLM's ``cache_config_info`` metric)."""
        async with self.http.get(self.url + "/metrics") as resp:
            text = await resp.text()
        found = re.search(r'^vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', text, re.M)
        if not found:
            log.warning(
                "vllm worker: %s/metrics has no num_gpu_blocks; what vLLM caches is not reported, so "
                "routing cannot prefer it",
                self.url,
            )
            return 0
        return int(found.group(1))

    async def post(self, body: dict) -> aiohttp.ClientResponse:
        """vLLM's answer to a completion, its status checked."""
        try:
            resp = await self.http.post(self.url + "/v1/completions", json=body)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise VllmUnavailable(f"vLLM at {self.url}: {exc or type(exc).__name__}") from None
        if resp.status == 200:
            return resp
        text = await resp.text()
        resp.release()
        try:
            message = json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = text[:500]
        if resp.status == 400:
            raise RequestRejected(f"vLLM refused the request: {message}")
        if resp.status == 503:
            raise EngineBusy(f"vLLM at {self.url} is busy: {message}")
        raise VllmUnavailable(f"vLLM at {self.url} answered {resp.status}: {message}")

    async def complete(self, body: dict) -> dict:
        """A completion asked whole: vLLM's answer as JSON."""
        async with await self.post(body) as resp:
            return await resp.json()
