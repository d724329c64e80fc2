"""The requests every vLLM bench times, whatever the instance's connector: a completion timed to its
end, vLLM's prefix cache reset (checked), prompts that never share a block, and the held-and-cold
protocol (``held_and_cold``) that ``bench vllm`` runs on tiercake's instance and on its peers."""

from __future__ import annotations

import asyncio
import random
import secrets
import statistics
import time
from dataclasses import dataclass

import aiohttp

MODEL = "tiercake-bench-llama"
BLOCK = 32
FRACTIONS = (0.5, 0.9)


async def complete(
    http: aiohttp.ClientSession, url: str, tokens: list[int], salt: str | None = None, model: str = MODEL
) -> tuple[float, dict]:
    """Seconds to the end of a two-token completion (the first token and one decode step: the
    connector's load report reaches vLLM's scheduler one step after the load) and the response."""
    body = {"model": model, "prompt": tokens, "max_tokens": 2, "temperature": 0}
    if salt:
        body["cache_salt"] = salt
    started = time.perf_counter()
    async with http.post(url + "/v1/completions", json=body) as resp:
        data = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"vLLM answered {resp.status}: {data}")
    return time.perf_counter() - started, data


async def reset(http: aiohttp.ClientSession, url: str, tries: int = 200) -> None:
    """vLLM's prefix cache emptied: it answers 200 with ``success: false`` while blocks are still held
    (a request finishing), so it is asked again until it says it did."""
    for _ in range(tries):
        async with http.post(url + "/reset_prefix_cache") as resp:
            if resp.status != 200:
                raise RuntimeError(
                    f"cannot reset vLLM's prefix cache: {resp.status} (VLLM_SERVER_DEV_MODE=1 is needed)"
                )
            body = await resp.json(content_type=None)
        if not isinstance(body, dict) or body.get("success", True):
            return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"vLLM did not reset its prefix cache in {tries} tries (blocks still held)")


def prompt(seed: int, length: int, vocab: int = 500) -> list[int]:
    """Tokens of a prompt no other seed shares a block of (seeded: the same in every run)."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


async def _warm_up(http: aiohttp.ClientSession, url: str, prompt_tokens: int, model: str) -> None:
    """The first request pays one-time costs, and each shape timed is compiled first."""
    await complete(http, url, [5] * 64, model=model)
    for fraction in FRACTIONS:
        tokens = prompt(7000 + int(fraction * 100), prompt_tokens)
        await complete(http, url, tokens[: int(prompt_tokens * fraction) // BLOCK * BLOCK] + [1], model=model)
        await asyncio.sleep(0.3)
        await reset(http, url)
        await complete(http, url, tokens, model=model)
        await complete(http, url, tokens, salt=secrets.token_hex(8), model=model)
    await reset(http, url)


QUIET_S = 1.2  # a vLLM CPU worker keeps polling for a second after its last step: instances kept apart


async def _loaded(
    http: aiohttp.ClientSession, url: str, tokens: list[int], held: int, model: str
) -> tuple[float, dict]:
    """``tokens`` timed on ``url``, whose connector must load the first ``held`` of them (vLLM's
    ``cached_tokens`` say so; a block's worth may be short, vLLM computes the last prompt token)."""
    seconds, data = await complete(http, url, tokens, model=model)
    details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
    if (details.get("cached_tokens") or 0) < held - BLOCK:
        raise RuntimeError(f"only {details} of {held} held tokens were loaded by the connector at {url}")
    return seconds, data


async def held_and_cold(
    url: str,
    prompt_tokens: int,
    rounds: int,
    held: bool = True,
    first_round: int = 0,
    warm: bool = True,
    model: str = MODEL,
    pause: float = 0.3,
    other: str | None = None,
) -> dict[str, list[tuple[float, dict]]]:
    """Samples of one vLLM instance, whatever its connector. For each held fraction and round: the
    prefix is computed (and saved by the connector), vLLM's prefix cache reset, and the full prompt
    timed ("held50", "held90": its prefix loaded by the connector, as vLLM's ``cached_tokens`` must
    show); then, after the same pause and a reset, the same prompt under a new cache salt ("cold50",
    "cold90": nothing held anywhere, all computed). Each sample: (seconds, vLLM's answer). Without
    ``held`` (a connector that holds nothing), only the cold requests, timed the same. Rounds are
    numbered from ``first_round`` (their prompts differ); ``warm``: first the warm-up requests;
    ``pause``: before each timed request (the saves land meanwhile).

    With ``other`` (a second instance with the same connector), also the same prefix with another
    ending timed there ("across50", "across90": the prefix the first instance saved, loaded by the
    second), the instances kept ``QUIET_S`` apart."""
    samples: dict[str, list[tuple[float, dict]]] = {}
    async with aiohttp.ClientSession() as http:
        if warm:
            for warmed in (url, other) if other is not None and held else (url,):
                await _warm_up(http, warmed, prompt_tokens, model)
        for fraction in FRACTIONS:
            pct = int(fraction * 100)
            for r in range(first_round, first_round + rounds):
                tokens = prompt(int(fraction * 1000) + r, prompt_tokens)
                prefix = tokens[: int(prompt_tokens * fraction) // BLOCK * BLOCK]
                if held:
                    await complete(http, url, prefix + [1], model=model)  # computed, saved by the connector
                    await asyncio.sleep(pause)  # saves are asynchronous: let them land and be indexed
                    await reset(http, url)
                    samples.setdefault(f"held{pct}", []).append(await _loaded(http, url, tokens, len(prefix), model))
                    await reset(http, url)
                if held and other is not None:
                    await asyncio.sleep(QUIET_S)
                    ending = prompt(50_000 + int(fraction * 1000) + r, prompt_tokens)[len(prefix) :]
                    sample = await _loaded(http, other, prefix + ending, len(prefix), model)
                    samples.setdefault(f"across{pct}", []).append(sample)
                    await reset(http, other)
                    await asyncio.sleep(QUIET_S - pause)
                await asyncio.sleep(pause)  # as before the held request: an idle pause changes the next step's time
                seconds, data = await complete(http, url, tokens, salt=secrets.token_hex(8), model=model)
                samples.setdefault(f"cold{pct}", []).append((seconds, data))
    return samples


@dataclass(frozen=True)
class Instance:
    """A vLLM instance a bench times: ``held``, its connector holds prefixes (held and cold requests;
    else cold ones only); ``other``, a second instance with the same connector to load across."""

    url: str
    held: bool = True
    other: str | None = None


async def interleaved(instances: dict[str, Instance], prompt_tokens: int, rounds: int) -> dict[str, dict[str, list]]:
    """Each instance's samples (``held_and_cold``), a round of each in turn, ``QUIET_S`` apart: a quiet
    or a busy moment of the machine touches them all. Every instance gets the same prompts."""
    samples: dict[str, dict[str, list]] = {name: {} for name in instances}
    for r in range(rounds):
        for name, instance in instances.items():
            got = await held_and_cold(
                instance.url, prompt_tokens, 1, held=instance.held, first_round=r, warm=r == 0, other=instance.other
            )
            for key, items in got.items():
                samples[name].setdefault(key, []).extend(items)
            if len(instances) > 1:
                await asyncio.sleep(QUIET_S)
    return samples


def median_s(samples: dict, name: str) -> float:
    return statistics.median(seconds for seconds, _ in samples[name])
