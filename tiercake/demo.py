"""`make run` / `tiercake demo`: the store on the embedded default, showing what it did.

Until the serving path lands this is tiercake's main job: the reference model computes KV for
prompts that share a system prompt, the blocks go into the tiers under their chained keys, the
shared prefix is found and reused (bitwise equal to a recompute), the gpu tier spills into the pool
and the pool into SSD, and on the next run the SSD tier's blocks are found again after the restart.
"""

from __future__ import annotations

import torch
import xxhash
from rich.console import Console
from rich.table import Table

from tiercake.blocks import BlockLayout, block_keys
from tiercake.config import TiercakeConfig
from tiercake.tiers.build import build_store
from tiercake.workers.reference.model import ModelConfig, ReferenceModel, encode

SYSTEM = (
    "You are a careful assistant for the infrastructure team. Answer briefly, cite the runbook, and "
    "never guess a number you have not measured. "
)
WORDS = (
    "node pool tier block lease evict spill promote prefix cache decode prefill latency budget replica "
    "etcd leader watch shard region page token tenant quota trace metric alert rollout drain"
).split()


def document(n: int, words: int = 150) -> str:
    """A deterministic stand-in for a user's attached document (different for every n)."""
    g = torch.Generator().manual_seed(1000 + n)
    picks = torch.randint(0, len(WORDS), (words,), generator=g).tolist()
    return f"Document {n}: " + " ".join(WORDS[i] for i in picks) + ". "


def _layout(config: TiercakeConfig) -> BlockLayout:
    if config.store.layout is None:
        raise ValueError("the demo computes KV blocks: its config needs store.layout")
    return config.store.layout


def _model_for(config: TiercakeConfig) -> ReferenceModel:
    layout = _layout(config)
    heads = layout.kv_heads * 2
    return ReferenceModel(
        ModelConfig(
            layers=layout.layers, kv_heads=layout.kv_heads, heads=heads, dim=heads * layout.head_dim, dtype=layout.dtype
        )
    )


def _check_reuse(
    served: torch.Tensor, put_digests: dict[bytes, int], key: bytes, recomputed: torch.Tensor, tier: str
) -> None:
    """Served bytes are exactly the bytes stored, and within float tolerance of a recompute (the
    recompute runs over a different prompt length, so its kernels may round differently)."""
    if key in put_digests and xxhash.xxh3_64_intdigest(served.numpy().tobytes()) != put_digests[key]:
        raise RuntimeError(f"the {tier} tier served bytes other than those stored")
    error = (served.view(recomputed.dtype).view(recomputed.shape).float() - recomputed.float()).abs().max().item()
    if error > 1e-2:
        raise RuntimeError(f"block from the {tier} tier is {error} away from a recompute")


def _blocks(kv: torch.Tensor, block_size: int) -> list[torch.Tensor]:
    """Split ``[layers, 2, T, kv_heads, head_dim]`` into full blocks of the store's layout."""
    full = kv.shape[2] // block_size
    return [kv[:, :, i * block_size : (i + 1) * block_size].contiguous() for i in range(full)]


async def run_demo(config: TiercakeConfig, console: Console) -> None:
    layout = _layout(config)
    namespace = config.namespace()
    model = _model_for(config)
    store = build_store(config.store)
    await store.open()
    try:
        recovered = len(store.keys())
        console.print(
            f"[bold]tiercake demo[/bold] on node [cyan]{config.node_id}[/cyan]: tiers "
            + ", ".join(f"{t.name} ({t.backend.capacity_bytes >> 20} MiB)" for t in store.tiers)
            + f"; KV block {layout.nbytes >> 10} KiB ({layout.tag})"
        )
        if recovered:
            console.print(f"restart: the ssd tier still holds [green]{recovered}[/green] blocks from the last run")
        put_digests: dict[bytes, int] = {}
        phases = [
            ("new conversations", [(n, "Summarise it.") for n in range(24)]),
            ("follow-ups on the first six", [(n, "And the risks?") for n in range(6)]),
        ]
        for phase, requests in phases:
            reused = computed = 0
            served: dict[str, int] = {}
            for n, question in requests:
                tokens = encode(SYSTEM + document(n) + question)
                keys = block_keys(namespace, tokens)
                cached = store.prefix_length(keys)
                _, kv = model.prefill_kv(tokens)
                blocks = _blocks(kv, layout.block_size)
                for i in range(cached):
                    out = torch.empty(layout.nbytes, dtype=torch.uint8)
                    tier = await store.get_into(keys[i], out)
                    served[tier] = served.get(tier, 0) + 1
                    _check_reuse(out, put_digests, keys[i], blocks[i], tier)
                for i in range(cached, len(keys)):
                    if store.contains(keys[i]):  # a later block can outlive an evicted earlier one
                        continue
                    await store.put(keys[i], blocks[i], parent=keys[i - 1] if i else None)
                    put_digests[keys[i]] = xxhash.xxh3_64_intdigest(blocks[i].numpy().tobytes())
                reused += cached
                computed += len(keys) - cached
            await store.drain()
            where = ", ".join(f"{v} from {k}" for k, v in served.items()) or "none"
            console.print(
                f"{phase}: {len(requests)} requests, [green]{reused} blocks reused[/green] ({where}; "
                f"each verified), {computed} computed and stored"
            )
        table = Table(title="tiers after the run")
        for col in ("tier", "blocks", "used", "hits", "puts", "spilled in", "promoted in", "evicted", "dropped"):
            table.add_column(col, justify="left" if col == "tier" else "right")
        stats = store.stats()["tiers"]
        for name, s in stats.items():
            table.add_row(
                name,
                str(s["blocks"]),
                f"{s['used_bytes'] >> 10} KiB",
                str(s["hits"]),
                str(s["puts"]),
                str(s["spills_in"]),
                str(s["promotions_in"]),
                str(s["evictions"]),
                str(s["drops"]),
            )
        console.print(table)
        console.print(
            f"the ssd tier keeps {len(store.keys('ssd'))} blocks across restarts: run again to see them found"
        )
    finally:
        await store.close()
