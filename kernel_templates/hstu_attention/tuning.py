"""Tuner adapter of the jagged HSTU attention kernels: representative inputs, oracles, FLOPs, launches.

Named by ``spec.py``; the tuner's worker calls these (see ``autotune.spec`` for the contracts). A
task is read through ``task.mask_features`` (contextual length, target fraction, window fraction).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .op import kernel_targets
from .reference import hstu_attention_flops, hstu_attention_reference, row_chunks, score_scale, sequence_rows
from .testing import offsets_from_lengths


def _make_inputs(task: Any, lengths: list[int], seed: int, device: str, dtype: torch.dtype, backward: bool) -> dict:
    """Random (never zero) q, k, v (and dO) on the task's jagged offsets and mask features."""
    gen = torch.Generator(device=device).manual_seed(seed)
    total, heads = sum(lengths), task.num_heads
    offsets = offsets_from_lengths(lengths, device, torch.int32)

    def rnd(d: int) -> torch.Tensor:
        return torch.randn((total, heads, d), generator=gen, device=device, dtype=torch.float32).to(dtype)

    context, target_frac, window_frac = task.mask_features
    num_targets = None
    if target_frac > 0:
        nt = [min(n, max(1, int(n * target_frac))) if n else 0 for n in lengths]
        num_targets = torch.tensor(nt, dtype=torch.int32, device=device)
    num_targets = kernel_targets(num_targets, context, offsets)  # what the runtime call launches with a context
    inputs = {
        "q": rnd(task.dqk),
        "k": rnd(task.dqk),
        "v": rnd(task.dv),
        "seq_offsets": offsets,
        "max_seq_len": max(lengths) if lengths else 0,
        "alpha": 1.0 / math.sqrt(task.dqk),
        "num_targets": num_targets,
        "contextual_seq_len": context,
        "max_attn_len": int(window_frac * task.max_len),
        "scaling_seqlen": None,
    }
    if backward:
        inputs["do"] = rnd(task.dv)
    return inputs


def _args(inputs: dict) -> tuple:
    i = inputs
    return (
        i["seq_offsets"],
        i["max_seq_len"],
        i["alpha"],
        i["num_targets"],
        i["contextual_seq_len"],
        i["max_attn_len"],
        i["scaling_seqlen"],
    )


def reference_fwd(inputs: dict, compute_dtype: torch.dtype) -> tuple:
    """fp32 oracle (compute_dtype=float32, fp32 inputs) or PyTorch in the kernel's dtype."""
    cast = (lambda t: t.float()) if compute_dtype == torch.float32 else (lambda t: t)
    q, k, v = (cast(inputs[n]) for n in ("q", "k", "v"))
    with torch.no_grad():
        return (hstu_attention_reference(q, k, v, *_args(inputs), compute_dtype=compute_dtype),)


def reference_bwd(inputs: dict, compute_dtype: torch.dtype) -> tuple:
    """Autograd through the reference, one block of query rows of one sequence at a time
    (``row_chunks``): memory stays bounded for any length, so the tuner can check its whole timing
    batch (32 x 8K, or a 32K sequence) on one GPU. dK and dV add up over the row blocks in fp32."""
    cast = (lambda t: t.float()) if compute_dtype == torch.float32 else (lambda t: t)
    dq = torch.zeros_like(cast(inputs["q"]))
    dk, dv = (torch.zeros_like(inputs[n], dtype=torch.float32) for n in ("k", "v"))
    offsets = inputs["seq_offsets"].tolist()
    targets = inputs["num_targets"]
    max_seq_len, alpha, _, ctx, window, scaling = _args(inputs)[1:]
    scale = score_scale(max_seq_len, scaling)
    for b in range(len(offsets) - 1):
        start, end = int(offsets[b]), int(offsets[b + 1])
        t = None if targets is None else int(targets[b])
        k, v = (cast(inputs[n][start:end]).detach().requires_grad_(True) for n in ("k", "v"))
        for r0, r1 in row_chunks(end - start, k.shape[1]):
            q = cast(inputs["q"][start + r0 : start + r1]).detach().requires_grad_(True)
            with torch.enable_grad():
                out = sequence_rows(q, k, v, (r0, r1), alpha, scale, t, ctx, window, compute_dtype).to(q.dtype)
            gq, gk, gv = torch.autograd.grad(out, (q, k, v), inputs["do"][start + r0 : start + r1].to(out.dtype))
            dq[start + r0 : start + r1] = gq
            dk[start:end] += gk.float()
            dv[start:end] += gv.float()
    return dq, dk.to(dq.dtype), dv.to(dq.dtype)


def _flops(inputs: dict, index: int) -> float:
    q, v = inputs["q"], inputs["v"]
    return hstu_attention_flops(
        inputs["seq_offsets"].cpu(),
        q.shape[1],
        q.shape[2],
        v.shape[2],
        inputs["contextual_seq_len"],
        None if inputs["num_targets"] is None else inputs["num_targets"].cpu(),
        inputs["max_attn_len"],
    )[index]


def alloc_out_fwd(inputs: dict) -> tuple:
    q, v = inputs["q"], inputs["v"]
    return (torch.full((q.shape[0], q.shape[1], v.shape[2]), float("nan"), dtype=q.dtype, device=q.device),)


def alloc_out_bwd(inputs: dict) -> tuple:
    """NaN-filled dq, dk, dv: the correctness check then proves every element was written."""
    return tuple(torch.full_like(inputs[n], float("nan")) for n in ("q", "k", "v"))


def launch_cute_fwd(inputs: dict, config: Any, out: tuple | None) -> tuple:
    from kernel_templates.cute import hstu_attention_cute_fwd

    i = inputs
    return (hstu_attention_cute_fwd(i["q"], i["k"], i["v"], *_args(i), config, out=out[0] if out else None),)


def launch_cute_bwd(inputs: dict, config: Any, out: tuple | None) -> tuple:
    from kernel_templates.cute import hstu_attention_cute_bwd

    i = inputs
    args = (i["do"], i["q"], i["k"], i["v"], *_args(i))
    return tuple(hstu_attention_cute_bwd(*args, config=config, out=out, validate=False))


def launch_triton_fwd(inputs: dict, config: Any, out: tuple | None) -> tuple:
    from kernel_templates.hstu_attention.triton_fwd import hstu_attention_fwd

    i = inputs
    o = hstu_attention_fwd(i["q"], i["k"], i["v"], *_args(i), config, out=out[0] if out else None)
    return (o,)


def launch_triton_bwd(inputs: dict, config: Any, out: tuple | None) -> tuple:
    from kernel_templates.hstu_attention.triton_bwd import hstu_attention_bwd

    i = inputs
    return tuple(hstu_attention_bwd(i["do"], i["q"], i["k"], i["v"], *_args(i), config, out=out))


def _jit_fwd() -> list:
    from kernel_templates.hstu_attention import triton_fwd

    return [triton_fwd._hstu_fwd_kernel]


def _jit_bwd() -> list:
    from kernel_templates.hstu_attention import triton_bwd

    return [triton_bwd._hstu_bwd_kv_kernel, triton_bwd._hstu_bwd_q_kernel]


def make_inputs_fwd(task: Any, lengths: list[int], seed: int, device: str, dtype: torch.dtype) -> dict:
    return _make_inputs(task, lengths, seed, device, dtype, False)


def make_inputs_bwd(task: Any, lengths: list[int], seed: int, device: str, dtype: torch.dtype) -> dict:
    return _make_inputs(task, lengths, seed, device, dtype, True)


def flops_fwd(inputs: dict) -> float:
    return _flops(inputs, 0)


def flops_bwd(inputs: dict) -> float:
    return _flops(inputs, 1)
