"""GPU registry: the hardware facts that feasibility rules and TFLOP/s reports need.

Owned by the tuner (docs/CONTRACTS.md, "GPU registry"). Numbers are per device, dense (no sparsity).
Adding a GPU: add one ``GPUSpec`` to ``GPUS`` and, if its marketing name differs, a pattern to
``_NAME_PATTERNS``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class GPUSpec:
    """Facts a feasibility rule may use; ``smem_per_block`` is the opt-in maximum per block (bytes)."""

    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    smem_per_block: int
    regs_per_sm: int
    peak_bf16_tflops: float
    max_regs_per_thread: int = 255

    @property
    def cc(self) -> str:
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"


GPUS: dict[str, GPUSpec] = {
    "a100": GPUSpec("a100", (8, 0), 108, 166912, 65536, 312.0),
    "h100": GPUSpec("h100", (9, 0), 132, 232448, 65536, 989.0),
    "h200": GPUSpec("h200", (9, 0), 132, 232448, 65536, 989.0),
    "b200": GPUSpec("b200", (10, 0), 148, 232448, 65536, 2250.0),
}

_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"\bH200\b", "h200"),
    (r"\bH100\b|\bGH200\b", "h100"),
    (r"\bA100\b", "a100"),
    (r"\bB200\b|\bGB200\b", "b200"),
)


def gpu_from_name(device_name: str) -> str | None:
    """Registry key for a CUDA device name such as 'NVIDIA H100 80GB HBM3', or None."""
    for pattern, key in _NAME_PATTERNS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return key
    return None


def get_gpu(name: str) -> GPUSpec:
    """The spec of a registry key; ValueError listing the known ones otherwise."""
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(sorted(GPUS))} (or 'auto')") from None


def detect_gpu() -> str:
    """Registry key of the current CUDA device; RuntimeError without CUDA or for an unknown GPU."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU is present (torch.cuda.is_available() is False)")
    name = torch.cuda.get_device_name()
    key = gpu_from_name(name)
    if key is None:
        known = ", ".join(sorted(GPUS))
        raise RuntimeError(f"GPU {name!r} is not in the registry ({known}); add it to autotune/runtime/gpus.py")
    return key


def running_gpu() -> GPUSpec | None:
    """The registry spec of the current CUDA device; None without CUDA or for a GPU the registry lacks (what
    the heuristic defaults are fitted to: ``autotune.runtime.defaults``)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return _spec_named(torch.cuda.get_device_name())


@functools.cache
def _spec_named(device_name: str) -> GPUSpec | None:
    key = gpu_from_name(device_name)
    return GPUS[key] if key else None


def interpreting() -> bool:
    """Whether Triton kernels run under its CPU interpreter in this process (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@contextlib.contextmanager
def interpreter(on: bool) -> Iterator[None]:
    """``TRITON_INTERPRET=1`` while ``on``: workers spawned meanwhile inherit it and run the kernels on the CPU
    (a tuning run told to interpret, called as a library on a GPU host, timed them on the GPU), and Triton reads
    it when first imported. The variable is restored after, so a library caller's process is left as it was."""
    before = os.environ.get("TRITON_INTERPRET")
    if on:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


def environment() -> dict[str, object]:
    """The artifact's ``environment`` block (docs/CONTRACTS.md) for the current process. Under the Triton
    interpreter (``TRITON_INTERPRET=1``) the kernels run on the CPU whatever GPU the host has, so the block is the
    interpreter's: an ``--interpret`` run on a GPU host wrote its CPU timings as that GPU's."""
    import importlib.metadata
    import subprocess

    import torch
    import triton

    env: dict[str, object] = {
        "gpu_name": "triton-interpreter (cpu)",
        "compute_capability": None,
        "sm_count": None,
        "driver": None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cutlass_dsl": None,
    }
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        env["cutlass_dsl"] = importlib.metadata.version("nvidia-cutlass-dsl")
    if torch.cuda.is_available() and not interpreting():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env["gpu_name"] = props.name
        env["compute_capability"] = f"{props.major}.{props.minor}"
        env["sm_count"] = props.multi_processor_count
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            env["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    return env


def running_environment() -> dict[str, object] | None:
    """``environment()``, or None when it cannot be read (e.g. torch or triton missing): artifact
    loading then checks an artifact's origin against the requested GPU only instead of failing."""
    try:
        return environment()
    except Exception:  # noqa: BLE001 - loading artifacts must never fail on an environment probe
        return None


def same_arch_gpus(key: str) -> list[str]:
    """Other registry GPUs of ``key``'s compute capability, sorted (e.g. 'h100' for 'h200'): the GPUs
    whose tuned configs may serve ``key`` when a user allows a same-architecture fallback."""
    spec = GPUS.get(key.lower())
    if spec is None:
        return []
    return sorted(k for k, s in GPUS.items() if k != spec.name and s.compute_capability == spec.compute_capability)
