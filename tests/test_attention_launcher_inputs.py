"""The exported Triton attention launchers (``hstu_attention_fwd`` / ``hstu_attention_bwd``, which the tuner calls
directly) refuse bad arguments by name instead of letting the kernels read or write past a tensor: every case runs
under the interpreter's memory checker, so an out-of-bounds access fails the test as an error, not a ValueError."""

from __future__ import annotations

import pytest
import torch
from test_input_safety import memcheck  # noqa: F401  (the interpreter's memory checker fixture)

from kernel_templates.hstu_attention import HSTUBwdConfig, HSTUFwdConfig, hstu_attention_reference, triton_fwd
from kernel_templates.hstu_attention.testing import offsets_from_lengths
from kernel_templates.hstu_attention.triton_bwd import hstu_attention_bwd
from kernel_templates.hstu_attention.triton_fwd import hstu_attention_fwd

pytestmark = pytest.mark.interpreter

LENGTHS = [9, 0, 30, 1, 17]
FWD, BWD = HSTUFwdConfig(16, 16, 4, 1), HSTUBwdConfig(16, 16, 4, 1)


def _qkv() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(sum(LENGTHS), 2, 32, generator=gen) for _ in "qkv"]


def _call(direction: str, max_seq_len=30, alpha=0.2, num_targets=None, ctx=0, window=0, out=None, do=None):
    q, k, v = _qkv()
    args = (offsets_from_lengths(LENGTHS, "cpu"), max_seq_len, alpha, num_targets, ctx, window, None)
    if direction == "fwd":
        return hstu_attention_fwd(q, k, v, *args, FWD, out=out)
    return hstu_attention_bwd(v.clone() if do is None else do, q, k, v, *args, BWD, out=out)


BAD = {
    # a num_targets shorter than the batch was read past its end (both directions)
    "short targets": (dict(num_targets=torch.tensor([1, 0])), "num_targets"),
    "long targets": (dict(num_targets=torch.zeros(7, dtype=torch.int64)), "num_targets"),
    "float targets": (dict(num_targets=torch.zeros(5)), "num_targets"),
    # a negative context with a window moved the forward's key range below the sequence's first row
    "negative context": (dict(ctx=-(2**31) + 5, window=3, num_targets=torch.ones(5, dtype=torch.int64)), "contextual"),
    "negative window": (dict(window=-1), "max_attn_len"),
    "negative max_seq_len": (dict(max_seq_len=-4), "max_seq_len"),
    "zero max_seq_len over rows": (dict(max_seq_len=0), "max_seq_len"),
    "NaN alpha": (dict(alpha=float("nan")), "alpha"),
    "infinite alpha": (dict(alpha=float("inf")), "alpha"),
}


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("case", list(BAD))
def test_the_triton_launchers_name_a_bad_argument(memcheck, direction, case):  # noqa: F811
    kwargs, name = BAD[case]
    with pytest.raises(ValueError, match=name):
        _call(direction, **kwargs)


def test_the_forward_launcher_checks_its_out_buffer(memcheck):  # noqa: F811
    """A short ``out`` was written past its end; one that is q itself was read while it was written."""
    rows = sum(LENGTHS)
    with pytest.raises(ValueError, match="out must be a tensor of shape"):
        _call("fwd", out=torch.empty(rows - 8, 2, 32))
    with pytest.raises(ValueError, match="out must be contiguous in its last dim"):
        _call("fwd", out=torch.empty(rows, 2, 64)[..., ::2])
    with pytest.raises(ValueError, match="out must be float16"):
        _call("fwd", out=torch.empty(rows, 2, 32, dtype=torch.int32))
    q, k, v = _qkv()
    off = offsets_from_lengths(LENGTHS, "cpu")
    with pytest.raises(ValueError, match="out shares memory with the input q"):
        hstu_attention_fwd(q, k, v, off, 30, 0.2, None, 0, 0, None, FWD, out=q)


def test_the_backward_launcher_checks_do_and_its_out_buffers(memcheck):  # noqa: F811
    """A short ``do`` was read past its end and a short dK buffer written past its end."""
    rows = sum(LENGTHS)
    with pytest.raises(ValueError, match="do must have shape"):
        _call("bwd", do=torch.randn(rows - 8, 2, 32))
    good = tuple(torch.empty(rows, 2, 32) for _ in range(3))
    with pytest.raises(ValueError, match=r"out\[1\] \(dk\) must be a tensor of shape"):
        _call("bwd", out=(good[0], torch.empty(rows - 8, 2, 32), good[2]))
    with pytest.raises(ValueError, match=r"out must be a tuple"):
        _call("bwd", out=good[:2])
    with pytest.raises(ValueError, match=r"out\[0\] \(dq\) and out\[2\] \(dv\) must be different tensors"):
        _call("bwd", out=(good[0], good[1], good[0]))
    dq, dk, dv = _call("bwd", out=good)  # valid buffers are used as they are
    assert dk is good[1] and dv is good[2] and torch.isfinite(dk).all()


def test_a_max_seq_len_past_the_rows_launches_for_the_rows(monkeypatch):
    """A loose max_seq_len (2**24 over 57 rows) sized the forward grid for 2**20 row blocks per sequence-head,
    past CUDA's 65535 (a launch error on a GPU, hours under the interpreter); it launches for the rows now,
    with max_seq_len still the divisor, so the result is the reference's."""
    kernel, grids = triton_fwd._hstu_fwd_kernel, []

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            assert grid[1] <= 65535, f"grid {grid} past CUDA's limit"
            return kernel[grid]

    monkeypatch.setattr(triton_fwd, "_hstu_fwd_kernel", Spy())
    q, k, v = _qkv()
    off = offsets_from_lengths(LENGTHS, "cpu")
    out = hstu_attention_fwd(q, k, v, off, 2**24, 0.2, None, 0, 0, None, FWD)
    assert grids == [(len(LENGTHS) * 2, -(-sum(LENGTHS) // 16))]
    torch.testing.assert_close(out, hstu_attention_reference(q, k, v, off, 2**24, 0.2), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_a_launcher_names_a_config_of_another_kind(direction):
    """A dict (a config not decoded) failed inside the launcher as an AttributeError naming ``block_m``."""
    q, k, v = _qkv()
    args = (offsets_from_lengths(LENGTHS, "cpu"), 30, 0.2, None, 0, 0, None, {"block_m": 16})
    with pytest.raises(ValueError, match="config must be a HSTU"):
        hstu_attention_fwd(q, k, v, *args) if direction == "fwd" else hstu_attention_bwd(v, q, k, v, *args)


# The checked launchers' argument names as the attention calls spell them.
_CALL_NAMES = {"ctx": "contextual_seq_len", "window": "max_attn_len"}


@pytest.mark.parametrize("entry", ["runtime ops", "kernel_templates op"])
@pytest.mark.parametrize("case", list(BAD))
def test_the_calls_that_launch_the_unchecked_entries_refuse_the_same_arguments(memcheck, entry, case):  # noqa: F811
    """The attention calls launch ``hstu_attention_*_validated``, which skip the launchers' checks: each bad
    argument above is refused by the call itself (validating modes), before any kernel runs."""
    from autotune.runtime import ops
    from kernel_templates.hstu_attention import op

    kwargs, name = BAD[case]
    args = {"max_seq_len": 30, "alpha": 0.2, **{_CALL_NAMES.get(n, n): a for n, a in kwargs.items()}}
    q, k, v = (t.requires_grad_(True) for t in _qkv())
    off = offsets_from_lengths(LENGTHS, "cpu")
    extra = {"source": "default"} if entry == "runtime ops" else {}
    call = ops.hstu_attention if entry == "runtime ops" else op.hstu_attention
    with pytest.raises(ValueError, match=name):
        call(q, k, v, off, **args, **extra)


def test_the_runtime_launchers_are_the_unchecked_entries_and_agree_with_the_checked_ones():
    """Dispatch launches the ``_validated`` entries (as it does CuTe's); called directly with good inputs they
    return what the checked launchers return, and a direct backward call still has ``do`` checked by name."""
    from autotune import spec
    from autotune.runtime import ops
    from kernel_templates.hstu_attention import triton_bwd

    launchers = {k: spec.resolve(spec.kernel(k).backend("triton").launcher) for k in (ops.FWD, ops.BWD)}
    assert launchers == {
        ops.FWD: triton_fwd.hstu_attention_fwd_validated,
        ops.BWD: triton_bwd.hstu_attention_bwd_validated,
    }
    q, k, v = _qkv()
    args = (offsets_from_lengths(LENGTHS, "cpu"), 30, 0.2, torch.tensor([1, 0, 3, 1, 2]), 2, 7, None)
    torch.testing.assert_close(launchers[ops.FWD](q, k, v, *args, FWD), hstu_attention_fwd(q, k, v, *args, FWD))
    do = torch.randn_like(v)
    want = hstu_attention_bwd(do, q, k, v, *args, BWD)
    torch.testing.assert_close(launchers[ops.BWD](do, q, k, v, *args, BWD), want)
    with pytest.raises(ValueError, match="do must have shape"):
        torch.ops.hstu.attention_bwd(do[:-8], q, k, v, args[0], None, 30, 0.2, 0, 0, None, "triton", "{}", "async")


# Built configs whose fields pass the config classes' membership checks (8.0 == 8) in another type.
_MISTYPED = [
    ("fwd_config", HSTUFwdConfig(16, 16, 4, 1, l2_group=8.0), "l2_group must be int"),
    ("bwd_config", HSTUBwdConfig(16, 16, 4, 1, "separate", 32.0), "dq_block_m must be int"),
    ("bwd_config", HSTUBwdConfig(16, 16, 4, 1, "separate", dq_block_n=32.0), "dq_block_n must be int"),
]


@pytest.mark.parametrize(("arg", "config", "message"), _MISTYPED)
def test_a_config_field_of_another_type_is_refused_by_name(arg, config, message):
    """A float launch-order group or dQ tile reached the kernel as a float constexpr and failed inside Triton
    (``InterpreterError: unexpected type fp32``), naming no argument: the template call and the checked launchers
    refuse it as a JSON config string is refused (``dispatch.decode_config``)."""
    from kernel_templates.hstu_attention import op

    q, k, v = (t.requires_grad_(True) for t in _qkv())
    off = offsets_from_lengths(LENGTHS, "cpu")
    with pytest.raises(ValueError, match=f"{arg}.{message}"):
        op.hstu_attention(q, k, v, off, 30, 0.2, **{arg: config})
    args = (off, 30, 0.2, None, 0, 0, None, config)
    with pytest.raises(ValueError, match=f"config.{message}"):
        if arg == "fwd_config":
            hstu_attention_fwd(*(t.detach() for t in (q, k, v)), *args)
        else:
            hstu_attention_bwd(v.detach(), *(t.detach() for t in (q, k, v)), *args)


def test_the_layer_launchers_refuse_a_config_field_of_another_type():
    """``config_of`` holds every launcher's config to its fields' types, the layer ops' too."""
    from kernel_templates.launch_checks import config_of
    from kernel_templates.layer_norm.config import LayerNormFwdConfig

    config_of(LayerNormFwdConfig(4, 4), LayerNormFwdConfig)
    config_of(None, LayerNormFwdConfig, optional=True)
    with pytest.raises(ValueError, match=r"config\.num_warps must be int \(as LayerNormFwdConfig\), got 4\.0"):
        config_of(LayerNormFwdConfig(4, 4.0), LayerNormFwdConfig)


def test_a_checked_config_does_not_pass_an_equal_one_of_another_type():
    """The launchers remember checked config objects by identity (their hot path): a float field equals and hashes
    as its int, so a config with ``l2_group=8.0`` checked after one with ``8`` must still be refused."""
    from kernel_templates.launch_checks import config_fields

    good, bad = HSTUFwdConfig(16, 16, 4, 1, l2_group=8), HSTUFwdConfig(16, 16, 4, 1, l2_group=8.0)
    assert good == bad and hash(good) == hash(bad)
    config_fields(good)
    config_fields(good)
    with pytest.raises(ValueError, match=r"config\.l2_group must be int"):
        config_fields(bad)
