"""The commands a user runs by hand on one machine: `ask` a running cluster, the store `demo`,
`model make` (a model for vLLM where nothing can be downloaded) and `config show`."""

from __future__ import annotations

import argparse
import asyncio

import yaml
from pydantic import ByteSize

from .common import console, errors, load, refused, with_config


def cmd_ask(args: argparse.Namespace) -> int:
    import time

    from tiercake.conductor.client import Client, ConductorError

    async def ask() -> None:
        async with Client([args.url], token=args.api_key, timeout=120, retries=3) as client:
            model = args.model or (await client.models())[0]["id"]  # the model the cluster serves
            started = time.perf_counter()
            first = None
            text, usage = [], {}
            async for chunk in client.stream_completion(
                args.prompt, model=model, max_tokens=args.max_tokens, temperature=args.temperature, tenant=args.tenant
            ):
                if chunk.get("choices"):
                    if first is None:
                        first = time.perf_counter() - started
                    text.append(chunk["choices"][0]["text"])
                    console.print(chunk["choices"][0]["text"], end="", markup=False, highlight=False)
                if chunk.get("usage"):
                    usage = chunk["usage"]
            total = time.perf_counter() - started
            console.print()
            generated = usage.get("completion_tokens", len(text))
            rate = (generated - 1) / (total - first) if first is not None and total > first and generated > 1 else 0
            cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            extra = usage.get("tiercake", {})
            console.print(
                f"[dim]TTFT {first or 0:.3f} s · {rate:.1f} tokens/s · {generated} tokens · "
                f"cached prompt tokens {cached}/{usage.get('prompt_tokens', '?')} · "
                f"sources {extra.get('sources', {})}[/dim]"
            )

    try:
        asyncio.run(ask())
    except ConductorError as exc:
        errors.print(f"error: {args.url} answered {exc}", markup=False, highlight=False)
        return 1
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tiercake.demo import run_demo
    from tiercake.up_state import DataDirLock

    config = load(args.config, args.data_dir)
    lock = DataDirLock(Path(args.data_dir), command="demo").acquire()  # one command per data directory
    try:
        asyncio.run(run_demo(config, console))
    finally:
        lock.release()
    return 0


def cmd_model_make(args: argparse.Namespace) -> int:
    from tiercake.workers.vllm.tiny_model import make_tiny_llama

    print(make_tiny_llama(args.dir, seed=args.seed))
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    config = load(args.config, args.data_dir)
    if refused(config):
        return 2
    print(yaml.safe_dump(_readable(config), sort_keys=False), end="")
    return 0


def _readable(value):
    """A config for people: sizes with their unit (16MiB, as a config may give them), everything else
    as its JSON form."""
    from pydantic import BaseModel
    from pydantic_core import to_jsonable_python

    if isinstance(value, BaseModel):
        return {name: _readable(getattr(value, name)) for name in type(value).model_fields}
    if isinstance(value, ByteSize):
        return value.human_readable(separator="").replace(".0", "") if value >= 1024 else int(value)
    if isinstance(value, dict):
        return {k: _readable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_readable(v) for v in value]
    return to_jsonable_python(value)


def cmd_secret_tenant(args: argparse.Namespace) -> int:
    from tiercake.credentials import tenant_key

    config = load(args.config, args.data_dir)
    print(tenant_key(config.transfer.secret(), args.tenant).decode())
    return 0


def register(sub) -> None:
    """``ask``, ``demo``, ``model``, ``config`` and ``secret``."""
    for parser_of in (_ask, _demo, _model, _config, _secret):
        parser_of(sub)


def _ask(sub) -> None:
    """``tiercake ask``."""
    ask = sub.add_parser(
        "ask",
        help="send a prompt to a running cluster and print the answer with its timing",
        description="Streams the completion and prints TTFT, tokens per second and how many prompt tokens "
        "came from the cache: send the same prompt twice to see the cache work.",
    )
    ask.add_argument("prompt", help="the prompt's text")
    ask.add_argument(
        "--url",
        default="http://127.0.0.1:8080",
        help="the cluster's OpenAI-compatible API (default: tiercake up's, http://127.0.0.1:8080)",
    )
    ask.add_argument("--model", help="the model to ask (default: the one the cluster serves, from /v1/models)")
    ask.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    ask.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    ask.add_argument("--api-key", help="an API key (serving.api_keys)")
    ask.add_argument("--tenant", help="the tenant header, when the cluster has no API keys")
    ask.set_defaults(func=cmd_ask)


def _demo(sub) -> None:
    """``tiercake demo``."""
    demo = sub.add_parser(
        "demo",
        help="run the store on the embedded default and show what it did",
        description="Compute KV with the reference model for prompts that share a prefix, store it in "
        "the tiers, reuse it, and restart onto the SSD tier. Runs twice in a row to see the restart.",
    )
    with_config(demo)
    demo.set_defaults(func=cmd_demo)


def _model(sub) -> None:
    """``tiercake model make``."""
    model = sub.add_parser("model", help="models for vLLM, made here (nothing is downloaded)")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    make = model_sub.add_parser(
        "make",
        help="write a small Llama (Hugging Face layout: config, tokenizer, weights from a seed) to DIR",
        description="Write a 4-layer, 256-wide Llama with a byte-level BPE tokenizer and seeded random weights to "
        "DIR, for `tiercake up --engine vllm --model DIR` where nothing can be downloaded. Its answers are noise; "
        "every instance that loads it computes the same KV for the same tokens. Kept if DIR already holds it.",
    )
    make.add_argument("dir", metavar="DIR", help="where to write it (created)")
    make.add_argument("--seed", type=int, default=0, help="the weights' seed (default 0)")
    make.set_defaults(func=cmd_model_make)


def _config(sub) -> None:
    """``tiercake config show``."""
    config = sub.add_parser("config", help="configuration")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_sub.add_parser("show", help="validate a config and print it with every default filled in")
    with_config(show)
    show.set_defaults(func=cmd_config_show)


def _secret(sub) -> None:
    """``tiercake secret tenant``."""
    secret = sub.add_parser("secret", help="credentials derived from the cluster secret")
    secret_sub = secret.add_subparsers(dest="secret_command", required=True, metavar="ACTION")
    tenant = secret_sub.add_parser(
        "tenant",
        help="print a tenant's key: it reaches that tenant's key-value objects and nothing else",
        description="The key of one tenant's key-value store clients ($TIERCAKE_TENANT_KEY, or setup(url, "
        "tenant_key=..., tenant=NAME)), derived from the cluster secret ($TIERCAKE_SECRET or the config's "
        "transfer.secret_file): give it to that tenant's clients in place of the cluster secret.",
    )
    tenant.add_argument("tenant", metavar="NAME", help="the tenant")
    with_config(tenant)
    tenant.set_defaults(func=cmd_secret_tenant)
