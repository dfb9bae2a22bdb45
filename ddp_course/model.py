"""MiniGPT: a small decoder-only transformer. Single-device code only.

This file knows nothing of ranks or process groups: ``ddp_course/parallel/*`` wraps the model from
outside. Shapes are written as B (batch), T (time / block), C (channels = n_embd), nh (heads),
hs (head size = C / nh), V (vocabulary).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

if TYPE_CHECKING:
    from ddp_course.config import TrainConfig


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    activation_checkpointing: bool = False

    def num_params(self) -> int:
        """The parameters MiniGPT(self) will have, without building it: the token and position tables,
        per block 12 C^2 + 13 C (qkv, proj, fc, proj with their biases, two LayerNorms), the final
        LayerNorm; the head is tied to the token table. Equal to ``MiniGPT(self).num_params()``."""
        V, T, L, C = self.vocab_size, self.block_size, self.n_layer, self.n_embd
        return V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C

    def shape(self) -> dict[str, int]:
        """The fields that fix the parameters' shapes: saved with each checkpoint, so that a resume into
        another shape is refused (``checkpoint.load``)."""
        return {"block_size": self.block_size, "n_layer": self.n_layer, "n_head": self.n_head, "n_embd": self.n_embd,
                "vocab_size": self.vocab_size}

    @classmethod
    def from_train(cls, cfg: TrainConfig, vocab_size: int) -> GPTConfig:
        return cls(vocab_size=vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                   n_embd=cfg.n_embd, dropout=cfg.dropout, activation_checkpointing=cfg.activation_checkpointing)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        # (B, T, C) -> (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads: (B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))  # (B, T, C) -> (B, T, 4C) -> (B, T, C)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class MiniGPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying: one (V, C) matrix embeds and un-embeds
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by 1/sqrt(2L)
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """idx (B, T) token ids -> logits (B, T, V); with targets (B, T), also the mean cross-entropy."""
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size={self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks:
            if self.cfg.activation_checkpointing and self.training and torch.is_grad_enabled():
                # keep only the block's input; recompute its activations during backward
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(B * T, -1).float(), targets.reshape(B * T))
        return logits, loss

    def num_params(self, include_embeddings: bool = True) -> int:
        """Parameters counted once (the tied head is not counted twice)."""
        n = sum(p.numel() for p in self.parameters())
        if not include_embeddings:
            n -= self.pos_emb.weight.numel()
        return n

    def flops_per_token(self) -> float:
        """Training FLOPs per token of a full ``block_size`` sequence: ``6 * N + 12 * L * T * C``.

        ``6 * N``: every weight does one multiply-add (2 FLOPs) per token forward and two backward (the
        input's and the weight's gradient). N is ``num_params(include_embeddings=False)``: every weight
        but the position table, which is a lookup, no arithmetic. The token table stays in N: it is
        tied to the output head, whose (C -> V) product is real work, and tying makes it one matrix,
        counted once. LayerNorm gains and biases are in N too (a negligible overcount).
        ``12 * L * T * C``: attention's scores (q k^T) and weighted sum (att v), 2 * T * C FLOPs each per
        token per layer forward, times 3 for forward and backward; counted over the full T x T square,
        as the PaLM paper (appendix B) and nanoGPT count it, although a causal kernel skips about half."""
        c = self.cfg
        return 6 * self.num_params(include_embeddings=False) + 12 * c.n_layer * c.block_size * c.n_embd

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to idx (B, T), feeding back the last block_size."""
        was_training = self.training
        self.eval()
        for _ in range(max_new_tokens):
            ctx = idx[:, -self.cfg.block_size:]
            logits = self(ctx)[:, -1, :] / max(temperature, 1e-6)  # (B, V)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits.float(), dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
            idx = torch.cat([idx, nxt], dim=1)
        self.train(was_training)
        return idx
