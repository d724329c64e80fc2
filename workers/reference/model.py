"""The reference model: a small Llama-style decoder in torch with seeded weights and a byte tokenizer.

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU MLP, so the KV it computes
has the structure of a real model's (this module computes KV for a prompt; the serving path adds
paged attention on top). Nothing is downloaded: the weights come from a seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiercake.config import ModelConfig

__all__ = ["ModelConfig", "PagedChunk", "ReferenceModel", "decode", "encode"]


def encode(text: str) -> list[int]:
    """Byte-level tokenizer: UTF-8 bytes are the token ids."""
    return list(text.encode("utf-8"))


def decode(tokens: list[int]) -> str:
    return bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", errors="replace")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs of the last dimension by position-dependent angles. x: [T, H, D]."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angles = positions.float()[:, None] * freqs[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class ReferenceModel:
    """Seeded weights; ``prefill_kv`` returns the KV of every position, per layer."""

    def __init__(self, config: ModelConfig = ModelConfig(), device: str = "cpu") -> None:
        if config.dim % config.heads or config.heads % config.kv_heads:
            raise ValueError("dim must divide by heads, and heads by kv_heads")
        self.config = config
        self.device = torch.device(device)
        g = torch.Generator().manual_seed(config.seed)
        c = config

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(self.device)

        self.embed = torch.randn(c.vocab, c.dim, generator=g).to(self.device)
        self.layers = [
            {
                "attn_norm": torch.ones(c.dim, device=self.device),
                "wq": w(c.heads * c.head_dim, c.dim),
                "wk": w(c.kv_heads * c.head_dim, c.dim),
                "wv": w(c.kv_heads * c.head_dim, c.dim),
                "wo": w(c.dim, c.heads * c.head_dim),
                "mlp_norm": torch.ones(c.dim, device=self.device),
                "w_gate": w(c.ffn_dim, c.dim),
                "w_up": w(c.ffn_dim, c.dim),
                "w_down": w(c.dim, c.ffn_dim),
            }
            for _ in range(c.layers)
        ]
        self.norm = torch.ones(c.dim, device=self.device)
        self.lm_head = w(c.vocab, c.dim)

    def check_tokens(self, tokens: list[int]) -> None:
        if not tokens:
            raise ValueError("empty prompt")
        if max(tokens) >= self.config.vocab or min(tokens) < 0:
            raise ValueError(f"token ids must lie in [0, {self.config.vocab})")

    def _qkv(self, layer: dict, x: torch.Tensor, positions: torch.Tensor):
        c = self.config
        h = _rms_norm(x, layer["attn_norm"])
        q = (h @ layer["wq"].T).view(-1, c.heads, c.head_dim)
        k = (h @ layer["wk"].T).view(-1, c.kv_heads, c.head_dim)
        v = (h @ layer["wv"].T).view(-1, c.kv_heads, c.head_dim)
        return _rope(q, positions, c.rope_theta), _rope(k, positions, c.rope_theta), v

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """Queries at positions ``start..`` over keys ``0..``: [T, heads, D] x [S, kv_heads, D]."""
        c = self.config
        group = c.heads // c.kv_heads
        t, s = q.shape[0], k.shape[0]
        kk = k.to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, S, D]
        vv = v.to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)
        mask = torch.arange(s, device=q.device)[None, :] <= (start + torch.arange(t, device=q.device))[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask)
        return out.transpose(0, 1).reshape(t, c.heads * c.head_dim)

    def _mlp(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        h = _rms_norm(x, layer["mlp_norm"])
        return x + (torch.nn.functional.silu(h @ layer["w_gate"].T) * (h @ layer["w_up"].T)) @ layer["w_down"].T

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.norm) @ self.lm_head.T

    @torch.no_grad()
    def prefill_kv(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits of the last position, KV as ``[layers, 2, T, kv_heads, head_dim]`` in the model dtype)."""
        self.check_tokens(tokens)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(ids.numel(), device=self.device)
        x = self.embed[ids]
        kv = []
        for layer in self.layers:
            q, k, v = self._qkv(layer, x, positions)
            kv.append(torch.stack([k, v]))
            x = x + self._attend(q, k, v, 0) @ layer["wo"].T
            x = self._mlp(layer, x)
        return self._logits(x[-1]), torch.stack(kv).to(getattr(torch, self.config.dtype))

    @torch.no_grad()
    def forward_paged(self, chunks: list[PagedChunk], kv: torch.Tensor) -> list[torch.Tensor]:
        """Run new tokens of several sequences at once over paged KV (continuous batching).

        ``kv`` is the block pool, ``[blocks, layers, 2, block_size, kv_heads, head_dim]``. Each chunk's
        K/V for positions before its ``start`` are read from its block table; the K/V of its new
        tokens are written into the table's blocks (which must cover ``start + len(tokens)``
        positions). The dense layers run over every chunk's tokens together; attention runs per
        sequence over its own blocks. Returns each chunk's logits, ``[len(tokens), vocab]``.
        """
        if not chunks:
            return []
        block_size = kv.shape[3]
        for chunk in chunks:
            self.check_tokens(chunk.tokens)
            if len(chunk.table) * block_size < chunk.start + len(chunk.tokens):
                raise ValueError(
                    f"block table of {len(chunk.table)} blocks cannot hold {chunk.start + len(chunk.tokens)} positions"
                )
        ids = torch.tensor([t for c in chunks for t in c.tokens], dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(c.start, c.start + len(c.tokens), device=self.device) for c in chunks])
        spans, at = [], 0
        for chunk in chunks:
            spans.append((at, at + len(chunk.tokens)))
            at += len(chunk.tokens)
        tables = [torch.tensor(c.table, dtype=torch.long, device=kv.device) for c in chunks]
        x = self.embed[ids]
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, positions)
            outs = []
            for chunk, (a, b), table in zip(chunks, spans, tables):
                pos = torch.arange(chunk.start, chunk.start + (b - a), device=kv.device)
                blocks, offsets = table[pos // block_size], pos % block_size
                kv[blocks, li, 0, offsets] = k[a:b].to(kv.dtype)
                kv[blocks, li, 1, offsets] = v[a:b].to(kv.dtype)
                length = chunk.start + (b - a)
                used = table[: -(-length // block_size)]
                keys = kv[used, li, 0].reshape(-1, *kv.shape[-2:])[:length]
                values = kv[used, li, 1].reshape(-1, *kv.shape[-2:])[:length]
                outs.append(self._attend(q[a:b], keys, values, chunk.start))
            x = x + torch.cat(outs) @ layer["wo"].T
            x = self._mlp(layer, x)
        logits = self._logits(x)
        return [logits[a:b] for a, b in spans]


@dataclass(slots=True)
class PagedChunk:
    """New tokens of one sequence, at positions ``start..``, over the blocks of ``table``."""

    tokens: list[int]
    start: int
    table: list[int]
