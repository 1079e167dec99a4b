"""Custom ops ``hstu::attention_fwd`` / ``hstu::attention_bwd`` and the drop-in function and module.

The ops are registered with ``torch.library.custom_op`` (fake impls for tracing, autograd through
``register_autograd``), so ``torch.compile`` traces them without graph breaks and ``torch.export``
sees them as single nodes. Configs cross the op boundary as (backend name, JSON string) because
custom ops cannot take dataclasses; ``autotune.dispatch`` picks them, so model code never names a
backend or tile size.
"""

import math

import torch
from torch import nn

from autotune import dispatch
from kernel_templates.hstu_attention.op import validate_hstu_inputs

FWD = "hstu_attention_fwd"
BWD = "hstu_attention_bwd"


def _reference_fwd(q, k, v, seq_offsets, num_targets, max_seq_len, alpha, ctx_len, attn_len, scaling):
    from kernel_templates.hstu_attention.reference import hstu_attention_reference

    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
        return hstu_attention_reference(
            q, k, v, seq_offsets, max_seq_len, alpha, num_targets, ctx_len, attn_len, scaling
        ).contiguous()


def _reference_bwd(do, q, k, v, seq_offsets, num_targets, max_seq_len, alpha, ctx_len, attn_len, scaling):
    """HSTU.md's backward in fp32 PyTorch, one sequence at a time (O(n^2) memory for one sequence).

    Written out rather than autograd: autograd is off inside a custom op's implementation. Autocast
    is off too, so the reference stays fp32 inside a bf16-autocast model.
    """
    from kernel_templates.hstu_attention.reference import hstu_mask

    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    inv_scale = 1.0 / float(scaling if scaling is not None else max_seq_len)
    offsets = seq_offsets.tolist()
    with torch.autocast(q.device.type, enabled=False):
        for b in range(len(offsets) - 1):
            start, end = int(offsets[b]), int(offsets[b + 1])
            if end == start:
                continue
            qb, kb, vb, dob = (t[start:end].float().transpose(0, 1) for t in (q, k, v, do))  # (H, n, D)
            nt = None if num_targets is None else int(num_targets[b])
            mask = hstu_mask(end - start, ctx_len, nt, attn_len, device=q.device).float() * inv_scale
            s = alpha * torch.matmul(qb, kb.transpose(1, 2))
            sig = torch.sigmoid(s)
            p = s * sig * mask
            ds = torch.matmul(dob, vb.transpose(1, 2)) * mask * alpha * sig * (1 + s * (1 - sig))
            dq[start:end] = torch.matmul(ds, kb).transpose(0, 1).to(q.dtype)
            dk[start:end] = torch.matmul(ds.transpose(1, 2), qb).transpose(0, 1).to(k.dtype)
            dv[start:end] = torch.matmul(p.transpose(1, 2), dob).transpose(0, 1).to(v.dtype)
    return dq, dk, dv


_FWD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor seq_offsets, Tensor? num_targets, int max_seq_len, float alpha, "
    "int contextual_seq_len, int max_attn_len, int? scaling_seqlen, str backend, str config, str bwd_backend, "
    "str bwd_config) -> Tensor"
)
_BWD_SCHEMA = (
    "(Tensor do, Tensor q, Tensor k, Tensor v, Tensor seq_offsets, Tensor? num_targets, int max_seq_len, "
    "float alpha, int contextual_seq_len, int max_attn_len, int? scaling_seqlen, str backend, str config) "
    "-> (Tensor, Tensor, Tensor)"
)


# Explicit schemas: no reliance on annotation inference across torch versions.
@torch.library.custom_op("hstu::attention_fwd", mutates_args=(), schema=_FWD_SCHEMA)
def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    num_targets: torch.Tensor | None,
    max_seq_len: int,
    alpha: float,
    contextual_seq_len: int,
    max_attn_len: int,
    scaling_seqlen: int | None,
    backend: str,
    config: str,
    bwd_backend: str,
    bwd_config: str,
) -> torch.Tensor:
    """Forward with an explicit backend/config. ``bwd_*`` ride along for the autograd backward."""
    if backend == "reference":
        return _reference_fwd(
            q, k, v, seq_offsets, num_targets, max_seq_len, alpha, contextual_seq_len, max_attn_len, scaling_seqlen
        )
    launcher = dispatch.resolve(dispatch.BACKENDS[backend].fwd)
    cfg = dispatch.decode_config(backend, FWD, config)
    return launcher(
        q, k, v, seq_offsets, max_seq_len, alpha, num_targets, contextual_seq_len, max_attn_len, scaling_seqlen, cfg
    )


@attention_fwd.register_fake
def _(q, k, v, seq_offsets, num_targets, max_seq_len, alpha, ctx, win, scaling, backend, config, bb, bc):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))


@torch.library.custom_op("hstu::attention_bwd", mutates_args=(), schema=_BWD_SCHEMA)
def attention_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    num_targets: torch.Tensor | None,
    max_seq_len: int,
    alpha: float,
    contextual_seq_len: int,
    max_attn_len: int,
    scaling_seqlen: int | None,
    backend: str,
    config: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) with an explicit backend/config; recomputes S from q, k."""
    if backend == "reference":
        return _reference_bwd(
            do, q, k, v, seq_offsets, num_targets, max_seq_len, alpha, contextual_seq_len, max_attn_len, scaling_seqlen
        )
    launcher = dispatch.resolve(dispatch.BACKENDS[backend].bwd)
    cfg = dispatch.decode_config(backend, BWD, config)
    dq, dk, dv = launcher(
        do, q, k, v, seq_offsets, max_seq_len, alpha, num_targets, contextual_seq_len, max_attn_len, scaling_seqlen, cfg
    )
    return dq.to(q.dtype), dk, dv


@attention_bwd.register_fake
def _(do, q, k, v, seq_offsets, num_targets, max_seq_len, alpha, ctx, win, scaling, backend, config):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, seq_offsets, num_targets, max_seq_len, alpha, ctx_len, win, scaling, _, _, bb, bc = inputs
    ctx.save_for_backward(q, k, v, seq_offsets, num_targets)
    ctx.args = (max_seq_len, alpha, ctx_len, win, scaling, bb, bc)


def _backward(ctx, do):
    q, k, v, seq_offsets, num_targets = ctx.saved_tensors
    max_seq_len, alpha, ctx_len, win, scaling, bb, bc = ctx.args
    dq, dk, dv = attention_bwd(
        do.contiguous(), q, k, v, seq_offsets, num_targets, max_seq_len, alpha, ctx_len, win, scaling, bb, bc
    )
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


@torch.compiler.assume_constant_result
def _choose(
    dtype: torch.dtype, dqk: int, dv: int, heads: int, max_seq_len: int, distribution: str | None, source: str
) -> tuple[str, str, str, str]:
    """(fwd backend, fwd config, bwd backend, bwd config). Under torch.compile the result is a
    trace-time constant (dispatch is deterministic), so the graph holds the op with plain strings."""
    fwd = dispatch.select(FWD, dtype, dqk, dv, heads, max_seq_len, distribution, source)
    bwd = dispatch.select(BWD, dtype, dqk, dv, heads, max_seq_len, distribution, source)
    return fwd.backend, fwd.config, bwd.backend, bwd.config


def distribution_of(length_distribution: str | None) -> str | None:
    """Artifact distribution key of a length distribution: "full" lengths tune as "uniform"."""
    if length_distribution is None:
        return None
    return "uniform" if length_distribution in ("full", "uniform_full") else "jagged"


def hstu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seq_len: int,
    alpha: float | None = None,
    num_targets: torch.Tensor | None = None,
    contextual_seq_len: int = 0,
    max_attn_len: int = 0,
    scaling_seqlen: int | None = None,
    *,
    source: str = "tuned",
    distribution: str | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Jagged HSTU attention (HSTU.md contract) with the config dispatch picks for this shape.

    q, k, v must share one dtype (cast before calling under autocast). ``source`` is "tuned"
    (artifacts from ``autotune.load``, with fallbacks), "default" (heuristic) or "reference".
    ``validate`` checks shapes, dtypes and head dims on the host (no sync; offsets are trusted).
    """
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share a dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if validate and source != "reference":
        validate_hstu_inputs(
            q, k, v, seq_offsets, max_seq_len, num_targets, contextual_seq_len, max_attn_len, scaling_seqlen,
            check_offsets=False,
        )  # fmt: skip
    dqk, dv, heads = q.shape[2], v.shape[2], q.shape[1]
    fwd_backend, fwd_config, bwd_backend, bwd_config = _choose(
        q.dtype, dqk, dv, heads, int(max_seq_len), distribution, source
    )
    if alpha is None:
        alpha = 1.0 / math.sqrt(dqk)
    return attention_fwd(
        q,
        k,
        v,
        seq_offsets,
        num_targets,
        int(max_seq_len),
        float(alpha),
        int(contextual_seq_len),
        int(max_attn_len),
        scaling_seqlen,
        fwd_backend,
        fwd_config,
        bwd_backend,
        bwd_config,
    )


class HSTUAttention(nn.Module):
    """Drop-in jagged HSTU attention module: ``(q, k, v, seq_offsets, max_seq_len) -> out``.

    Holds no parameters; it fixes the kernel source and the length distribution hint.
    """

    def __init__(
        self,
        source: str = "tuned",
        distribution: str | None = None,
        contextual_seq_len: int = 0,
        max_attn_len: int = 0,
    ) -> None:
        super().__init__()
        if source not in dispatch.SOURCES:
            raise ValueError(f"unknown kernel source {source!r}; expected one of {dispatch.SOURCES}")
        self.source = source
        self.distribution = distribution
        self.contextual_seq_len = contextual_seq_len
        self.max_attn_len = max_attn_len

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq_offsets: torch.Tensor,
        max_seq_len: int,
        alpha: float | None = None,
        num_targets: torch.Tensor | None = None,
        scaling_seqlen: int | None = None,
    ) -> torch.Tensor:
        return hstu_attention(
            q,
            k,
            v,
            seq_offsets,
            max_seq_len,
            alpha,
            num_targets,
            self.contextual_seq_len,
            self.max_attn_len,
            scaling_seqlen,
            source=self.source,
            distribution=self.distribution,
        )

    def extra_repr(self) -> str:
        return f"source={self.source!r}, distribution={self.distribution!r}"
