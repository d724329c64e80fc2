"""The reference model: a small Llama-style decoder in torch with seeded weights and a byte tokenizer.

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU MLP, so the KV it computes
has the structure of a real model's (this module computes KV for a prompt; the serving path adds
paged attention on top). Nothing is downloaded: the weights come from a seed.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from tiercake.blocks import BlockLayout


class ModelConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab: int = Field(default=256, gt=0, description="byte-level: 256")
    dim: int = Field(default=128, gt=0)
    layers: int = Field(default=4, gt=0)
    heads: int = Field(default=4, gt=0)
    kv_heads: int = Field(default=2, gt=0)
    ffn_dim: int = Field(default=256, gt=0)
    rope_theta: float = 10000.0
    seed: int = 0
    dtype: str = "float16"

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def layout(self, block_size: int = 16) -> BlockLayout:
        return BlockLayout(
            layers=self.layers, kv_heads=self.kv_heads, head_dim=self.head_dim, block_size=block_size, dtype=self.dtype
        )


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

    @torch.no_grad()
    def prefill_kv(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits of the last position, KV as ``[layers, 2, T, kv_heads, head_dim]`` in the model dtype)."""
        c = self.config
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        if ids.numel() == 0:
            raise ValueError("empty prompt")
        if int(ids.max()) >= c.vocab or int(ids.min()) < 0:
            raise ValueError(f"token ids must lie in [0, {c.vocab})")
        positions = torch.arange(ids.numel(), device=self.device)
        x = self.embed[ids]
        kv = []
        group = c.heads // c.kv_heads
        for layer in self.layers:
            h = _rms_norm(x, layer["attn_norm"])
            q = (h @ layer["wq"].T).view(-1, c.heads, c.head_dim)
            k = (h @ layer["wk"].T).view(-1, c.kv_heads, c.head_dim)
            v = (h @ layer["wv"].T).view(-1, c.kv_heads, c.head_dim)
            q, k = _rope(q, positions, c.rope_theta), _rope(k, positions, c.rope_theta)
            kv.append(torch.stack([k, v]))
            kk = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, T, head_dim]
            vv = v.repeat_interleave(group, dim=1).transpose(0, 1)
            attn = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, is_causal=True)
            attn = attn.transpose(0, 1).reshape(-1, c.heads * c.head_dim)
            x = x + attn @ layer["wo"].T
            h = _rms_norm(x, layer["mlp_norm"])
            x = x + (torch.nn.functional.silu(h @ layer["w_gate"].T) * (h @ layer["w_up"].T)) @ layer["w_down"].T
        logits = _rms_norm(x[-1], self.norm) @ self.lm_head.T
        return logits, torch.stack(kv).to(getattr(torch, c.dtype))
