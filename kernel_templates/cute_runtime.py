"""Compile cache and launch helpers shared by the CuTe DSL launchers (HSTU attention fwd/bwd, GEMM+SiLU).

Each launcher keeps what is specific to its kernel: the cache key, input validation and the fake-tensor
signature it compiles against. What they have in common lives here once, so the compile flags, the cache
rule and the DLPack fallback cannot drift apart between kernels. Importing this module does not import
``cutlass``: the DSL is loaded only when a kernel is compiled or launched.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

# The element types the CuTe kernels take, by torch dtype; the names key the compile caches.
TORCH_DTYPE_NAMES: dict[torch.dtype, str] = {torch.bfloat16: "bfloat16", torch.float16: "float16"}

K = TypeVar("K", bound=Hashable)


def has_tvm_ffi() -> bool:
    """Whether ``tvm_ffi`` is importable: kernels then take torch tensors directly (lower launch overhead)."""
    try:
        import tvm_ffi  # noqa: F401
    except ImportError:
        return False
    return True


def cutlass_dtype(name: str) -> Any:
    """The cutlass element type of a ``TORCH_DTYPE_NAMES`` value (imports cutlass, hence a function)."""
    import cutlass

    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[name]


@dataclass
class CompiledKernel(Generic[K]):
    """A compiled kernel: ``tvm_ffi`` says how to call ``fn``; ``ptx`` is kept only when asked for."""

    key: K
    fn: Any
    tvm_ffi: bool
    ptx: str | None


class KernelCache(Generic[K]):
    """Compiled kernels by key, one cache per launcher; safe to share between threads.

    Compiling happens outside the lock (it takes seconds): two threads missing on the same key both
    compile and the last one stored wins, which is harmless since both results are equivalent.
    """

    def __init__(self) -> None:
        self._entries: dict[K, CompiledKernel[K]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def get(self, key: K, build: Callable[[bool], tuple], keep_ptx: bool = False) -> CompiledKernel[K]:
        """The kernel for ``key``, compiled on a miss (or when ``keep_ptx`` and the cached one has no PTX).

        ``build(tvm_ffi)`` returns the positional arguments of ``cute.compile`` (the kernel object, fake
        tensors and scalars, and ``make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi)``). The target
        defaults to ``sm_90a`` so compiling works on machines without a GPU.
        """
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None and (hit.ptx is not None or not keep_ptx):
                return hit
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
        import cutlass.cute as cute

        tvm = has_tvm_ffi()
        args = build(tvm)
        flags = ["--enable-tvm-ffi"] if tvm else []
        if keep_ptx:
            dump = os.environ.get("CUTE_DSL_DUMP_DIR")
            if dump:
                os.makedirs(dump, exist_ok=True)
            flags.append("--keep-ptx")
        fn = cute.compile(*args, options=" ".join(flags)) if flags else cute.compile(*args)
        compiled = CompiledKernel(key, fn, tvm, fn.__ptx__ if keep_ptx else None)
        with self._lock:
            self._entries[key] = compiled
        return compiled


def dlpack_args(tensors_with_align: Iterable[tuple[torch.Tensor, int]]) -> list[Any]:
    """DLPack views for the fallback launch without TVM FFI, one per (tensor, alignment in bytes).

    Shapes and strides are marked dynamic with the last dim as the unit-stride one, matching the symbolic
    shapes the kernels were compiled with (jagged rows, heads, row strides of column slices), so one
    compiled kernel serves every batch.
    """
    from cutlass.cute.runtime import from_dlpack

    return [
        from_dlpack(t, assumed_align=align).mark_layout_dynamic(leading_dim=t.dim() - 1)
        for t, align in tensors_with_align
    ]


def current_stream() -> Any:
    """Torch's current CUDA stream as a driver handle: DLPack launches run in stream order with torch."""
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)
