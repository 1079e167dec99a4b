"""Model FLOPs by the field's convention (docs/CONTRACTS.md) and MFU against the GPU registry's peak."""

from __future__ import annotations

import torch

from kernel_templates.hstu_attention.reference import hstu_attention_flops
from kernel_templates.hstu_attention.testing import offsets_from_lengths

from .config import ModelConfig

DEFAULT_PEAK_TFLOPS = 989.0  # H100/H200 dense bf16


def step_flops(cfg: ModelConfig, lengths: list[int], dense_params: int) -> dict[str, float]:
    """FLOPs of one training step (fwd + bwd): attention by docs/CONTRACTS.md, GEMMs as 6 x params x tokens."""
    fwd, bwd = hstu_attention_flops(offsets_from_lengths(lengths), cfg.num_heads, cfg.head_dim, cfg.head_dim)
    attention = (fwd + bwd) * cfg.num_layers
    gemm = 6.0 * dense_params * sum(lengths)
    return {"attention": attention, "gemm": gemm, "total": attention + gemm}


def peak_tflops(gpu: str | None) -> float | None:
    """Dense bf16 peak of a registry GPU (989 for H100/H200); None when unknown (e.g. CPU)."""
    if gpu is None:
        return None
    try:
        from autotune.runtime.gpus import GPUS

        spec = GPUS.get(gpu)
        return float(spec.peak_bf16_tflops) if spec is not None else None
    except ImportError:
        return DEFAULT_PEAK_TFLOPS if gpu in ("h100", "h200") else None


def model_flops_utilization(tflops: float, peak: float | None, gpus: int) -> float | None:
    """MFU of ``tflops`` achieved by ``gpus`` GPUs together, each of ``peak`` dense TFLOP/s (None without a peak):
    a data-parallel run's FLOPs are the world's, so its peak is the world's too."""
    if peak is None or peak <= 0:
        return None
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be a positive int, got {gpus!r}")
    return tflops / (peak * gpus)


def detect_gpu_name(device: torch.device) -> str | None:
    """Registry key of the device's GPU, or None on CPU / an unknown GPU."""
    if device.type != "cuda":
        return None
    try:
        from autotune.runtime.gpus import detect_gpu

        return detect_gpu()
    except Exception:  # noqa: BLE001 - unknown GPU: no MFU, everything else still reported
        return None
