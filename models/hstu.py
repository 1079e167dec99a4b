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

from autotune.runtime.layer import LayerPlan, hstu_layer, layer_norm, plan_layer
from autotune.runtime.ops import HSTUAttention
from kernel_templates.fused_ln_mul_dropout import fused_ln_mul_dropout

from .config import ModelConfig
from .data import JaggedBatch

# config.recompute's projection part -> what the fused layer keeps for the backward
RECOMPUTE_KEEP = {"none": "pre+uvqk", "ln": "pre+uvqk", "uvqk": "pre", "pre": "uvqk"}


class _EmbeddingSum(torch.autograd.Function):
    """``sum_i weights[i][indices[i]]`` in ``dtype``: fp32 adds, the last one writing ``dtype`` (no separate cast
    pass over the activation); the backward casts the gradient to the tables' dtype once for all tables."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, n: int, *args: torch.Tensor) -> torch.Tensor:
        indices, weights = args[:n], args[n:]
        acc = F.embedding(indices[0], weights[0])
        for idx, w in zip(indices[1:-1], weights[1:-1], strict=True):
            acc += F.embedding(idx, w)
        if n == 1:
            out = acc.to(dtype)
        else:
            out = torch.empty(acc.shape, dtype=dtype, device=acc.device)
            torch.add(acc, F.embedding(indices[-1], weights[-1]), out=out)
        ctx.save_for_backward(*indices)
        ctx.tables = [(w.shape[0], w.dtype) for w in weights]
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        indices = ctx.saved_tensors
        cast: dict[torch.dtype, torch.Tensor] = {}
        grads = []
        for i, (idx, (rows, dtype)) in enumerate(zip(indices, ctx.tables, strict=True)):
            if not ctx.needs_input_grad[2 + len(indices) + i]:
                grads.append(None)
                continue
            if dtype not in cast:
                cast[dtype] = grad.to(dtype)
            g = cast[dtype]
            grads.append(torch.ops.aten.embedding_backward(g, idx, rows, -1, False, False))
        return None, None, *(None for _ in indices), *grads


def embedding_sum(
    dtype: torch.dtype, indices: tuple[torch.Tensor, ...], weights: tuple[torch.Tensor, ...]
) -> torch.Tensor:
    """The sum of the tables' lookups (same width), rounded once into ``dtype``."""
    return _EmbeddingSum.apply(dtype, len(indices), *indices, *weights)


class HSTULayer(nn.Module):
    """One HSTU layer over a jagged (L, hidden) activation."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # As HSTURankingModel does: a config built directly (no replace/get_config) with, say, precision='bf16' or
        # recompute on the unfused layer ran that layer as if they were not set.
        cfg.validate()
        self.cfg = cfg
        h, d = cfg.num_heads, cfg.head_dim
        self.input_norm = nn.LayerNorm(cfg.hidden_dim, eps=cfg.eps)
        self.uvqk = nn.Linear(cfg.hidden_dim, 4 * h * d)
        self.attn_norm = nn.LayerNorm(h * d, eps=cfg.eps)
        self.out_proj = nn.Linear(h * d, cfg.hidden_dim)
        self.attention = HSTUAttention(source=cfg.kernels, distribution=cfg.distribution)
        self.fused = cfg.kernels != "reference"
        self.alpha = 1.0 / math.sqrt(d)

    def plan(self, dt: torch.dtype) -> LayerPlan:
        """The fused layer's kernels for compute dtype ``dt`` (cached per shape key by ``plan_layer``)."""
        cfg = self.cfg
        p = cfg.dropout if self.training else 0.0
        return plan_layer(
            dt, cfg.num_heads, cfg.head_dim, cfg.max_seq_len, self.alpha, cfg.eps, p, cfg.kernels, cfg.distribution,
            keep=RECOMPUTE_KEEP[cfg.recompute.split("+")[0]], recompute_ln="ln" in cfg.recompute.split("+"),
            zero_copy=cfg.zero_copy, du_silu=cfg.du_silu,
        )  # fmt: skip

    def _fused(self, x: torch.Tensor, seq_offsets: torch.Tensor) -> torch.Tensor:
        """The whole layer through ``autotune.runtime.layer`` (kernels chosen per shape by dispatch)."""
        cfg, dev = self.cfg, x.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        if cfg.precision == "bf16":
            x = x.to(dt)
        plan = self.plan(dt)
        p = plan.dropout
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
        if batch.lengths and not torch.compiler.is_compiling():
            self._check_lengths(batch.lengths)
        if self.cfg.precision == "bf16":
            return self._forward_compute_dtype(batch)
        x = self.input_proj(self.item_emb(batch.items) + self.action_emb(batch.prev_actions))
        x = x + self.pos_emb(batch.positions)
        for layer in self.layers:
            x = layer(x, batch.seq_offsets)
        x = self.final_norm(x)
        return torch.cat([head(x) for head in self.heads], dim=1)

    def _check_lengths(self, lengths: list[int]) -> None:
        """A sequence above max_seq_len indexes past the position table: an IndexError on the CPU, a device-side
        assert (a dead CUDA context) on a GPU, before the attention call could name it. The host lengths say it
        first (no device sync); a traced call skips this, so its guards never hold the lengths."""
        longest = max(lengths)
        if longest > self.cfg.max_seq_len:
            raise ValueError(
                f"batch has a sequence of {longest} tokens (sequence {lengths.index(longest)}), above the model's "
                f"max_seq_len {self.cfg.max_seq_len}"
            )

    def _forward_compute_dtype(self, batch: JaggedBatch) -> torch.Tensor:
        """precision="bf16": the stream stays in the compute dtype from the embeddings to the logits.

        The embeddings' fp32 sum is rounded once by its last add; the final LayerNorm runs the layers' kernel
        (fp32 statistics, output in the compute dtype) instead of autocast's fp32 LayerNorm, whose fp32 output
        each head cast again; the task heads run as one GEMM + SiLU + one block-diagonal GEMM, so the normed
        stream has one consumer (no per-head cast, no fp32 sum of the heads' gradients in the backward).
        """
        dev = batch.items.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else self.pos_emb.weight.dtype
        if isinstance(self.input_proj, nn.Identity):
            x = embedding_sum(
                dt, (batch.items, batch.prev_actions, batch.positions),
                (self.item_emb.weight, self.action_emb.weight, self.pos_emb.weight),
            )  # fmt: skip
        else:
            x = self.input_proj(self.item_emb(batch.items) + self.action_emb(batch.prev_actions))
            x = (x + self.pos_emb(batch.positions)).to(dt)
        for layer in self.layers:
            x = layer(x, batch.seq_offsets)
        with torch.autocast(dev, enabled=False):
            norm = self.final_norm
            x = layer_norm(x, norm.weight, norm.bias, norm.eps, self.layers[0].plan(dt))
            first = [head[0] for head in self.heads]
            last = [head[2] for head in self.heads]
            w1 = torch.cat([m.weight for m in first]).to(dt)
            b1 = torch.cat([m.bias for m in first]).to(dt)
            hidden = F.silu(F.linear(x, w1, b1))
            w2 = torch.block_diag(*(m.weight for m in last)).to(dt)
            b2 = torch.cat([m.bias for m in last]).to(dt)
            return F.linear(hidden, w2, b2)

    def loss(self, batch: JaggedBatch) -> torch.Tensor:
        """Mean binary cross-entropy over positions and tasks (fp32); weighted by row when the batch
        has ``weights`` (a padded batch: padding rows weigh 0)."""
        logits = self.forward(batch)
        if batch.weights is None:
            if logits.numel() == 0:  # every sequence empty: no loss (a mean over nothing would be NaN), zero grads
                return logits.float().sum()
            return F.binary_cross_entropy_with_logits(logits.float(), batch.labels)
        per_row = F.binary_cross_entropy_with_logits(logits.float(), batch.labels, reduction="none").mean(1)
        return (per_row * batch.weights).sum()

    def dense_params(self) -> int:
        """Parameters of the GEMMs (everything but embedding tables): the 6 x params x tokens count."""
        emb = {id(p) for m in (self.item_emb, self.action_emb, self.pos_emb) for p in m.parameters()}
        return sum(p.numel() for p in self.parameters() if id(p) not in emb and p.dim() >= 2)
