"""The CuTe launchers' per-call host path (``kernel_templates/cute/launch.py``): the launch cache and the
TMA layout test. CPU only: nothing here compiles or launches a kernel."""

from __future__ import annotations

import dataclasses

import torch

from kernel_templates.cute.config import HSTUCuteFwdConfig
from kernel_templates.cute.launch import LaunchCache, call_signature, jagged_args, tma_rows_ok
from kernel_templates.cute_runtime import CompiledKernel


def _builder(calls: list):
    def build():
        calls.append(1)
        return CompiledKernel(len(calls), object(), True, None)

    return build


def test_launch_cache_hits_the_same_config_object_and_signature_only():
    cache, calls = LaunchCache(), []
    cfg = HSTUCuteFwdConfig(128, 64, 2, True)
    sig = (torch.bfloat16, 256, 256, False, False, False)
    first = cache.get(cfg, sig, _builder(calls))
    assert cache.get(cfg, sig, _builder(calls)) is first and len(calls) == 1
    # An equal but distinct config object, or another signature, is looked up again (built once more).
    assert cache.get(dataclasses.replace(cfg), sig, _builder(calls)) is not first and len(calls) == 2
    cache.get(cfg, (torch.float16, *sig[1:]), _builder(calls))
    assert len(calls) == 3 and len(cache) == 3


def test_launch_cache_is_bounded_and_a_reused_id_never_aliases():
    cache, calls = LaunchCache(capacity=4), []
    sig = (torch.bfloat16, 128, 128, False, False, False)
    keep = [HSTUCuteFwdConfig(128, 64, s, True) for s in (1, 2, 3, 4, 5, 6)]
    for cfg in keep:
        cache.get(cfg, sig, _builder(calls))
    assert len(cache) <= 4 and len(calls) == 6
    # An entry whose stored config is not the caller's object (as after a reused id) is rebuilt.
    cfg = keep[-1]
    cache._entries[(id(cfg), sig)] = (object(), cache._entries[(id(cfg), sig)][1])
    before = len(calls)
    cache.get(cfg, sig, _builder(calls))
    assert len(calls) == before + 1


def test_tma_rows_ok_accepts_column_slices_and_rejects_other_layouts():
    wide = torch.empty(64, 4 * 2 * 128, dtype=torch.bfloat16)  # a uvqk-like projection, 4 slices of H x D
    q = wide[:, 2 * 128 : 4 * 128].view(64, 2, 128)  # rows strided by the projection's width
    assert tma_rows_ok(torch.empty(64, 2, 128, dtype=torch.bfloat16)) and tma_rows_ok(q)
    assert not tma_rows_ok(torch.empty(64, 128, 2, dtype=torch.bfloat16).transpose(1, 2))  # heads not contiguous
    assert not tma_rows_ok(torch.empty(2, 64, 128, dtype=torch.bfloat16).transpose(0, 1))  # (H, L, D) memory
    flat = torch.empty(64 * 2 * 128 + 1, dtype=torch.bfloat16)
    assert not tma_rows_ok(flat[1:].view(64, 2, 128))  # rows 2 bytes off 16-byte alignment
    odd = torch.empty(64, 2 * 128 + 4, dtype=torch.bfloat16)[:, : 2 * 128].view(64, 2, 128)
    assert not tma_rows_ok(odd)  # row stride 260 elements: not a multiple of 8


def test_jagged_args_cast_once_and_derive_the_scale_and_block_count():
    offsets64 = torch.tensor([0, 3, 3, 130], dtype=torch.int64)
    offsets, targets, inv_scale, blocks = jagged_args(offsets64, None, 129, None, 64)
    assert offsets.dtype == torch.int32 and offsets.tolist() == [0, 3, 3, 130]
    assert targets is offsets  # no targets: the offsets stand in, nothing else is cast
    assert inv_scale == 1.0 / 129 and blocks == 3  # ceil(129 / 64)
    same = offsets64.to(torch.int32)
    nt = torch.tensor([1, 0, 2], dtype=torch.int64)
    o2, t2, inv2, b2 = jagged_args(same, nt, 128, 512, 128)
    assert o2 is same and t2.dtype == torch.int32 and t2.tolist() == [1, 0, 2]
    assert inv2 == 1.0 / 512 and b2 == 1


def test_call_signature_names_dtype_dims_and_mask_flags():
    q = torch.empty(5, 2, 64, dtype=torch.float16)
    v = torch.empty(5, 2, 32, dtype=torch.float16)
    assert call_signature(q, v, None, 0, 0) == (torch.float16, 64, 32, False, False, False)
    assert call_signature(q, v, torch.zeros(1), 2, 7) == (torch.float16, 64, 32, True, True, True)
