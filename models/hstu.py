"""HSTU ranking model of generative recommenders (the seed benchmark's structure).

Embeddings (item + previous action + position) -> a stack of HSTU layers -> LayerNorm -> one MLP
head per task. An HSTU layer: ``x -> LN -> uvqk = silu(LN(x) W + b) -> split u, v, q, k per head ->
jagged attention -> dropout(LN(attn) * u) -> W_o -> + x``.

The kernel source is the model's kernel knob: "reference" runs the PyTorch oracle attention and
an unfused LN * u + dropout; "default" and "tuned" run the ``hstu::attention_*`` custom ops (heuristic
configs, or the ones ``autotune.load`` found) and the fused Triton LN * u + dropout. ``layer="fused"``
runs each layer as one autograd function over dispatched kernels (``autotune.runtime.layer``), with the
precision policy and recompute switches of the config. Model code never names a backend or a tile size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from autotune.runtime.layer import hstu_layer, plan_layer
from autotune.runtime.ops import HSTUAttention
from kernel_templates.fused_ln_mul_dropout import fused_ln_mul_dropout

from .config import ModelConfig
from .data import JaggedBatch

# config.recompute's projection part -> what the fused layer keeps for the backward
RECOMPUTE_KEEP = {"none": "pre+uvqk", "ln": "pre+uvqk", "uvqk": "pre", "pre": "uvqk"}


class HSTULayer(nn.Module):
    """One HSTU layer over a jagged (L, hidden) activation."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, d = cfg.num_heads, cfg.head_dim
        self.input_norm = nn.LayerNorm(cfg.hidden_dim, eps=cfg.eps)
        self.uvqk = nn.Linear(cfg.hidden_dim, 4 * h * d)
        self.attn_norm = nn.LayerNorm(h * d, eps=cfg.eps)
        self.out_proj = nn.Linear(h * d, cfg.hidden_dim)
        self.attention = HSTUAttention(source=cfg.kernels, distribution=cfg.distribution)
        self.fused = cfg.kernels != "reference"
        self.alpha = 1.0 / math.sqrt(d)

    def _fused(self, x: torch.Tensor, seq_offsets: torch.Tensor) -> torch.Tensor:
        """The whole layer through ``autotune.runtime.layer`` (kernels chosen per shape by dispatch)."""
        cfg, dev = self.cfg, x.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        if cfg.precision == "bf16":
            x = x.to(dt)
        p = cfg.dropout if self.training else 0.0
        plan = plan_layer(
            dt, cfg.num_heads, cfg.head_dim, cfg.max_seq_len, self.alpha, cfg.eps, p, cfg.kernels, cfg.distribution,
            keep=RECOMPUTE_KEEP[cfg.recompute.split("+")[0]], recompute_ln="ln" in cfg.recompute.split("+"),
            zero_copy=cfg.zero_copy,
        )  # fmt: skip
        seed = torch.randint(0, 2**31 - 1, (1,), device=x.device) if p > 0 else self._zero_seed(x.device)
        params = {
            "ln1_w": self.input_norm.weight, "ln1_b": self.input_norm.bias,
            "w_uvqk": self.uvqk.weight, "b_uvqk": self.uvqk.bias,
            "ln2_w": self.attn_norm.weight, "ln2_b": self.attn_norm.bias,
            "w_o": self.out_proj.weight, "b_o": self.out_proj.bias,
        }  # fmt: skip
        with torch.autocast(dev, enabled=False):
            return hstu_layer(x, params, seq_offsets, plan, seed)

    def _zero_seed(self, device: torch.device) -> torch.Tensor:
        if getattr(self, "_seed0", None) is None or self._seed0.device != device:
            self._seed0 = torch.zeros(1, dtype=torch.int64, device=device)
        return self._seed0

    def forward(self, x: torch.Tensor, seq_offsets: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        if cfg.layer == "fused":
            return self._fused(x, seq_offsets)
        L, h, d = x.shape[0], cfg.num_heads, cfg.head_dim
        uvqk = F.silu(self.uvqk(self.input_norm(x)))
        # Under autocast the linear's output is bf16 already; cast explicitly so every kernel sees one dtype.
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else uvqk.dtype
        uvqk = uvqk.to(dtype)
        u, v, q, k = torch.split(uvqk, h * d, dim=1)
        attn = self.attention(
            q.view(L, h, d), k.view(L, h, d), v.view(L, h, d), seq_offsets, cfg.max_seq_len, self.alpha
        ).reshape(L, h * d)
        if self.fused:
            w, b = self.attn_norm.weight, self.attn_norm.bias
            y = fused_ln_mul_dropout(attn, u, w, b, cfg.eps, cfg.dropout, self.training)
        else:
            y = F.dropout(self.attn_norm(attn) * u, cfg.dropout, self.training)
        return x + self.out_proj(y)


class HSTURankingModel(nn.Module):
    """Multi-task ranking over jagged histories: one logit per (position, task)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.item_emb = nn.Embedding(cfg.num_items, cfg.embedding_dim)
        self.action_emb = nn.Embedding(cfg.num_actions, cfg.embedding_dim)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.hidden_dim)
        self.input_proj = (
            nn.Linear(cfg.embedding_dim, cfg.hidden_dim) if cfg.embedding_dim != cfg.hidden_dim else nn.Identity()
        )
        self.layers = nn.ModuleList(HSTULayer(cfg) for _ in range(cfg.num_layers))
        self.final_norm = nn.LayerNorm(cfg.hidden_dim, eps=cfg.eps)
        self.heads = nn.ModuleList(
            nn.Sequential(nn.Linear(cfg.hidden_dim, cfg.head_hidden), nn.SiLU(), nn.Linear(cfg.head_hidden, 1))
            for _ in range(cfg.num_tasks)
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Small embeddings (std 0.02) so the residual stream starts near LayerNorm's scale."""
        for emb in (self.item_emb, self.action_emb, self.pos_emb):
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, batch: JaggedBatch) -> torch.Tensor:
        """Logits of shape (L, num_tasks)."""
        x = self.input_proj(self.item_emb(batch.items) + self.action_emb(batch.prev_actions))
        x = x + self.pos_emb(batch.positions)
        for layer in self.layers:
            x = layer(x, batch.seq_offsets)
        x = self.final_norm(x)
        return torch.cat([head(x) for head in self.heads], dim=1)

    def loss(self, batch: JaggedBatch) -> torch.Tensor:
        """Mean binary cross-entropy over positions and tasks (fp32); weighted by row when the batch
        has ``weights`` (a padded batch: padding rows weigh 0)."""
        logits = self.forward(batch)
        if batch.weights is None:
            return F.binary_cross_entropy_with_logits(logits.float(), batch.labels)
        per_row = F.binary_cross_entropy_with_logits(logits.float(), batch.labels, reduction="none").mean(1)
        return (per_row * batch.weights).sum()

    def dense_params(self) -> int:
        """Parameters of the GEMMs (everything but embedding tables): the 6 x params x tokens count."""
        emb = {id(p) for m in (self.item_emb, self.action_emb, self.pos_emb) for p in m.parameters()}
        return sum(p.numel() for p in self.parameters() if id(p) not in emb and p.dim() >= 2)
