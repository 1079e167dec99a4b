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


@dataclass
class JaggedFakes:
    """Fake tensors of one jagged-attention compile: every (L, H, d) tensor shares the dynamic L and H
    but has its own dynamic row stride (q/k/v may be column slices of the wider uvqk projection)."""

    dtype: Any
    rows: Any
    heads: Any
    offsets: Any
    targets: Any

    def jagged(self, d: int, elem: Any = None, divisibility: int = 8) -> Any:
        from cutlass.cute import sym_int
        from cutlass.cute.runtime import make_fake_tensor

        stride = sym_int(64, divisibility=divisibility)
        shape = (self.rows, self.heads, d)
        return make_fake_tensor(elem or self.dtype, shape, stride=(stride, d, 1), assumed_align=16)


def jagged_fakes(dtype_name: str) -> JaggedFakes:
    """Dynamic L, H and B: one compiled kernel serves every jagged batch of the same head dims."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    rows, heads, batch1, batch = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    offsets = make_fake_tensor(cutlass.Int32, (batch1,), stride=(1,), assumed_align=4)
    targets = make_fake_tensor(cutlass.Int32, (batch,), stride=(1,), assumed_align=4)
    return JaggedFakes(cutlass_dtype(dtype_name), rows, heads, offsets, targets)


def hstu_scalar_fakes(tvm_ffi: bool) -> tuple:
    """Placeholders of the trailing HSTU launch arguments: alpha, 1/scale, context length, attention
    window, block count, stream (values do not matter for compiling, only their types)."""
    import cutlass
    from cutlass.cute.runtime import make_fake_stream

    f32, i32 = cutlass.Float32, cutlass.Int32
    return (f32(1.0), f32(1.0), i32(0), i32(0), i32(1), make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi))
