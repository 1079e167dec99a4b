"""The compile cache and launch helpers shared by the CuTe launchers (CPU only; ``cute.compile`` is faked).

The cache rule (a hit unless PTX is wanted and the cached kernel has none), the compile flags and the
DLPack views are what the three launchers rely on; the real compiles are covered by the launchers' tests.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

cutlass = pytest.importorskip("cutlass")

import cutlass.cute as cute  # noqa: E402

from kernel_templates import cute_runtime  # noqa: E402
from kernel_templates.cute_runtime import (  # noqa: E402
    TORCH_DTYPE_NAMES,
    KernelCache,
    cutlass_dtype,
    dlpack_args,
    has_tvm_ffi,
)


@pytest.fixture
def fake_compile(monkeypatch):
    """Record every ``cute.compile`` call; the returned object has PTX only under --keep-ptx."""
    calls = []

    def compile_(*args, options=""):
        calls.append((args, options))
        return SimpleNamespace(__ptx__="ptx" if "--keep-ptx" in options else None)

    monkeypatch.setattr(cute, "compile", compile_)
    return calls


@pytest.mark.parametrize("tvm", [False, True])
def test_flags_and_build_argument(monkeypatch, tmp_path, fake_compile, tvm):
    monkeypatch.setattr(cute_runtime, "has_tvm_ffi", lambda: tvm)
    dump = tmp_path / "ptx"
    monkeypatch.setenv("CUTE_DSL_DUMP_DIR", str(dump))
    seen = []
    cache: KernelCache[str] = KernelCache()
    compiled = cache.get("k", lambda t: seen.append(t) or ("kernel", 1), keep_ptx=True)
    assert seen == [tvm]
    assert fake_compile == [(("kernel", 1), "--enable-tvm-ffi --keep-ptx" if tvm else "--keep-ptx")]
    assert dump.is_dir()
    assert (compiled.key, compiled.tvm_ffi, compiled.ptx) == ("k", tvm, "ptx")


def test_cache_rule(monkeypatch, fake_compile):
    monkeypatch.setattr(cute_runtime, "has_tvm_ffi", lambda: False)
    cache: KernelCache[str] = KernelCache()
    plain = cache.get("k", lambda t: ())
    assert plain.ptx is None and fake_compile == [((), "")]
    assert cache.get("k", lambda t: ()) is plain
    # PTX wanted but the cached kernel has none: compile again and keep the kernel with PTX.
    with_ptx = cache.get("k", lambda t: (), keep_ptx=True)
    assert with_ptx is not plain and with_ptx.ptx == "ptx"
    assert cache.get("k", lambda t: ()) is with_ptx
    assert cache.get("k", lambda t: (), keep_ptx=True) is with_ptx
    assert len(fake_compile) == 2 and len(cache) == 1 and "k" in cache and "other" not in cache


def test_build_errors_store_nothing(fake_compile):
    cache: KernelCache[str] = KernelCache()

    def build(tvm: bool) -> tuple:
        raise ValueError("bad signature")

    with pytest.raises(ValueError, match="bad signature"):
        cache.get("k", build)
    assert len(cache) == 0 and fake_compile == []


def test_dtypes_and_tvm_ffi_probe():
    assert {torch.bfloat16: "bfloat16", torch.float16: "float16"} == TORCH_DTYPE_NAMES
    assert cutlass_dtype("bfloat16") is cutlass.BFloat16
    assert cutlass_dtype("float16") is cutlass.Float16
    assert isinstance(has_tvm_ffi(), bool)


def test_dlpack_args_are_dynamic_with_unit_last_stride():
    x = torch.zeros(10, 2, 64, dtype=torch.bfloat16)
    offsets = torch.zeros(5, dtype=torch.int32)
    wrapped = dlpack_args([(x, 16), (offsets, 4)])
    assert len(wrapped) == 2
    assert re.search(r"\(\?,\?,\?\):\(\?[^,]*,\?[^,]*,1\)", str(wrapped[0])), str(wrapped[0])
    assert re.search(r"\(\?\):\(1\)", str(wrapped[1])), str(wrapped[1])
