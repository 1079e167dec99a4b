"""The drop-in call is safe by construction: bad inputs are reported, and none reads or writes out of bounds.

CPU: every bad input of issue 12 raises the documented ValueError naming the argument through
``autotune.runtime.ops.hstu_attention`` (sources "default" and "reference", modes "async" and "full") and the
``HSTUAttention`` module; good inputs with empty and length-1 sequences match the reference; the
device check kernel (run by the interpreter) computes the host check's error mask; and the Triton
kernels, run by the interpreter under a memory checker that sees every load, store and atomic,
stay inside their tensors for offsets pointing anywhere. GPU tests (in ``test_input_safety_gpu.py``)
cover the device assertion, the absence of syncs in "async" mode and ``compute-sanitizer``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from proc_env import REPO
from triton.runtime.errors import InterpreterError

from autotune.runtime import dispatch, ops
from kernel_templates.hstu_attention import HSTUBwdConfig, HSTUFwdConfig, hstu_attention_reference
from kernel_templates.hstu_attention import input_check as ic
from kernel_templates.hstu_attention.triton_bwd import hstu_attention_bwd
from kernel_templates.hstu_attention.triton_fwd import hstu_attention_fwd

L, H, D = 29, 2, 32
GOOD_OFFSETS = [0, 7, 20, 20, 29]  # lengths 7, 13, 0, 9
MAX_LEN = 32


@pytest.fixture(autouse=True)
def _fresh_dispatch():
    dispatch.reset()
    yield
    dispatch.reset()


def _qkv(rows: int = L, heads: int = H, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(rows, heads, D, generator=g) for _ in range(3))


def _case(name: str) -> dict:
    """Keyword arguments of ``hstu_attention`` for one bad input of the issue's list."""
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v, seq_offsets=torch.tensor(GOOD_OFFSETS), max_seq_len=MAX_LEN, num_targets=None)
    if name == "start_not_zero":
        args["seq_offsets"] = torch.tensor([2, 7, 20, 20, 29])
    elif name == "decreasing":
        args["seq_offsets"] = torch.tensor([0, 7, 5, 20, 29])
    elif name == "ends_before_L":
        args["seq_offsets"] = torch.tensor([0, 7, 20, 20, 25])
    elif name == "ends_after_L":
        args["seq_offsets"] = torch.tensor([0, 7, 20, 20, 31])
    elif name == "max_seq_len_below_longest":
        args["max_seq_len"] = 12  # the longest sequence has 13 rows
    elif name == "hld_layout":
        args.update({n: t.transpose(0, 1).contiguous() for n, t in (("q", q), ("k", k), ("v", v))})
    elif name == "targets_negative":
        args["num_targets"] = torch.tensor([1, -1, 0, 2])
    elif name == "targets_above_length":
        args["num_targets"] = torch.tensor([8, 0, 0, 2])  # sequence 0 has 7 rows
    else:
        raise KeyError(name)
    return args


# (case, a regex the ValueError must match: the argument's name and what is wrong with it)
BAD_INPUTS = [
    ("start_not_zero", r"seq_offsets must start at 0, got seq_offsets\[0\] = 2"),
    ("decreasing", r"seq_offsets must be non-decreasing, got seq_offsets\[1\] = 7 > seq_offsets\[2\] = 5"),
    ("ends_before_L", r"seq_offsets must end at L = 29 \(q.shape\[0\]\), got seq_offsets\[-1\] = 25"),
    ("ends_after_L", r"seq_offsets must end at L = 29 \(q.shape\[0\]\), got seq_offsets\[-1\] = 31"),
    ("max_seq_len_below_longest", r"max_seq_len=12 is below the longest sequence \(13, sequence 1\)"),
    ("hld_layout", r"seq_offsets must end at L = 2 \(q.shape\[0\]\).*not \(H, L, D\)"),
    ("targets_negative", r"num_targets must be within \[0, sequence length\].*num_targets\[1\] = -1"),
    ("targets_above_length", r"num_targets must be within \[0, sequence length\].*num_targets\[0\] = 8 for length 7"),
]


@pytest.mark.parametrize("mode", ["async", "full"])
@pytest.mark.parametrize("source", ["default", "reference"])
@pytest.mark.parametrize("case,match", BAD_INPUTS, ids=[c for c, _ in BAD_INPUTS])
def test_bad_input_raises_naming_the_argument(case, match, source, mode):
    args = _case(case)
    with pytest.raises(ValueError, match=match):
        ops.hstu_attention(**args, source=source, validate=mode)


@pytest.mark.parametrize("mode", ["async", "full", True])
@pytest.mark.parametrize("case,match", BAD_INPUTS, ids=[c for c, _ in BAD_INPUTS])
def test_module_rejects_bad_input(case, match, mode):
    a = _case(case)
    module = ops.HSTUAttention(source="default", validate=mode)
    with pytest.raises(ValueError, match=match):
        module(a["q"], a["k"], a["v"], a["seq_offsets"], a["max_seq_len"], num_targets=a["num_targets"])


@pytest.mark.parametrize("case", [c for c, _ in BAD_INPUTS])
def test_validate_none_does_not_check(case, device):
    """Mode "none" is documented as "no check": a bad batch runs (and stays in bounds, tested below)."""
    args = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in _case(case).items()}
    out = ops.hstu_attention(**args, source="default", validate="none")
    assert out.shape == (args["q"].shape[0], args["q"].shape[1], D)


def test_bad_validate_argument_is_rejected():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="validate must be one of"):
        ops.hstu_attention(q, k, v, torch.tensor(GOOD_OFFSETS), MAX_LEN, validate="fast")
    with pytest.raises(ValueError, match="validate must be one of"):
        ops.HSTUAttention(validate="sometimes")
    assert ic.validate_mode(True) == "async" and ic.validate_mode(False) == "none"


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"distribution": "jaged"}, "distribution"),
        ({"contextual_seq_len": -1}, "contextual_seq_len"),
        ({"max_attn_len": 2.5}, "max_attn_len"),
        ({"max_attn_len": 2**31}, "max_attn_len"),
    ],
)
def test_module_arguments_are_checked_when_it_is_built(kwargs, name):
    """A module built with a typo or a negative context was accepted and failed only at its first call."""
    with pytest.raises(ValueError, match=name):
        ops.HSTUAttention(**kwargs)


@pytest.mark.parametrize("name", ["contextual_seq_len", "max_attn_len"])
@pytest.mark.parametrize("bad", [-1, 2**31, 2.5, True, "3", None])
def test_module_and_call_reject_a_bad_context_or_window_alike(name, bad):
    """The module's constructor and the call's validation hold one rule (``op.check_mask_lengths``): the same
    values are refused with the same message."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=name) as built:
        ops.HSTUAttention(**{name: bad})
    with pytest.raises(ValueError, match=name) as called:
        ops.hstu_attention(q, k, v, torch.tensor(GOOD_OFFSETS), MAX_LEN, source="reference", **{name: bad})
    assert str(built.value) == str(called.value)
    assert not hasattr(ops, "_is_int")  # the rule is op.py's public check, not its private helper


def test_custom_op_called_directly_checks_offsets():
    """The op under the call checks too (its default is "async"), so torch.ops callers are covered."""
    q, k, v = _qkv()
    fwd_cfg = dispatch.select(ops.FWD, q.dtype, D, D, H, MAX_LEN, None, "default").config
    bad = torch.tensor([0, 7, 20, 20, 31])
    with pytest.raises(ValueError, match="seq_offsets must end at L = 29"):
        torch.ops.hstu.attention_fwd(q, k, v, bad, None, MAX_LEN, 0.25, 0, 0, None, "triton", fwd_cfg, "", "")
    with pytest.raises(ValueError, match="seq_offsets must end at L = 29"):
        torch.ops.hstu.attention_bwd(v, q, k, v, bad, None, MAX_LEN, 0.25, 0, 0, None, "triton", "{}")


def test_custom_op_backward_called_directly_checks_do():
    """A direct backward call checks the gradient it is given (no launcher does): shape, dtype, named."""
    q, k, v = _qkv()
    good = torch.tensor(GOOD_OFFSETS)
    bwd_cfg = dispatch.select(ops.BWD, q.dtype, D, D, H, MAX_LEN, None, "default").config
    with pytest.raises(ValueError, match="do must have shape"):
        torch.ops.hstu.attention_bwd(v[:-1], q, k, v, good, None, MAX_LEN, 0.25, 0, 0, None, "triton", bwd_cfg)
    with pytest.raises(ValueError, match="do must have q's dtype"):
        torch.ops.hstu.attention_bwd(v.double(), q, k, v, good, None, MAX_LEN, 0.25, 0, 0, None, "triton", bwd_cfg)


# ------------------------------------------------------------------------------------------------
# Good inputs still pass and match the reference.
# ------------------------------------------------------------------------------------------------
EDGE_OFFSETS = [0, 0, 1, 1, 5, 5, 6, 14]  # lengths 0, 1, 0, 4, 0, 1, 8


@pytest.mark.interpreter
@pytest.mark.parametrize("mode", ["async", "full"])
@pytest.mark.parametrize("targets", [False, True])
def test_empty_and_length_one_sequences_match_reference(mode, targets):
    q, k, v = _qkv(rows=14)
    off = torch.tensor(EDGE_OFFSETS)
    # Boundary targets: 0 and exactly the length are both valid.
    nt = torch.tensor([0, 1, 0, 4, 0, 0, 3]) if targets else None
    q_in, k_in, v_in = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = ops.hstu_attention(q_in, k_in, v_in, off, 8, num_targets=nt, source="default", validate=mode)
    ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = hstu_attention_reference(*ref_in, off, 8, 1 / D**0.5, nt)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q_in, k_in, v_in), do)
    for g, r in zip(grads, torch.autograd.grad(ref, ref_in, do), strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)
    via_ref = ops.hstu_attention(q, k, v, off, 8, num_targets=nt, source="reference", validate=mode)
    torch.testing.assert_close(via_ref, ref.detach(), atol=1e-5, rtol=1e-4)


def test_reference_source_takes_any_head_dim():
    """The reference validates fully but is not limited to the kernels' head dims."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(6, 1, 24, generator=g) for _ in range(3))
    out = ops.hstu_attention(q, k, v, torch.tensor([0, 2, 6]), 4, source="reference")
    assert out.shape == (6, 1, 24)
    with pytest.raises(ValueError, match="seq_offsets must start at 0"):
        ops.hstu_attention(q, k, v, torch.tensor([1, 2, 6]), 4, source="reference", validate="async")


@pytest.mark.parametrize(("dqk", "dv"), [(48, 48), (96, 40), (16, 200), (64, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_head_dims_the_kernels_lack_run_zero_padded(dqk, dv, dtype, device):
    """Head dims between the kernels' (48, 96, 200, ...) run padded to the next one: output and every
    gradient within the tolerance rule of the fp32 reference, including empty and length-1 sequences,
    with alpha defaulting from the true Dqk; above the largest kernel head dim the error names it.
    fp32 and fp16 on CPU (interpreter), bf16 and fp16 on a GPU."""
    from kernel_templates.hstu_attention.testing import check_tolerance

    if device == "cuda" and dtype == torch.float32:
        dtype = torch.bfloat16
    g = torch.Generator().manual_seed(dqk + dv)
    off = torch.tensor([0, 0, 1, 6, 23]).to(device)
    q, k = (torch.randn(23, 2, dqk, generator=g).to(device) for _ in range(2))
    v = torch.randn(23, 2, dv, generator=g).to(device)
    do = torch.randn(23, 2, dv, generator=g).to(device)
    nt = torch.tensor([0, 1, 2, 3]).to(device)
    ins = [t.to(dtype).requires_grad_(True) for t in (q, k, v)]
    out = ops.hstu_attention(*ins, off, 20, num_targets=nt, source="default")
    grads = torch.autograd.grad(out, ins, do.to(dtype))
    results = {}
    for name, prec in (("ref32", torch.float32), ("lowp", dtype)):
        r_in = [t.to(prec).requires_grad_(True) for t in (q, k, v)]
        r = hstu_attention_reference(*r_in, off, 20, 1 / dqk**0.5, nt)
        results[name] = (r, *torch.autograd.grad(r, r_in, do.to(prec)))
    for i, (name, got) in enumerate(zip(("out", "dq", "dk", "dv"), (out, *grads), strict=True)):
        assert got.shape == results["ref32"][i].shape and got.dtype == dtype
        check_tolerance(f"d{dqk}/{dv} {name}", got, results["ref32"][i], results["lowp"][i])
    # Above the largest kernel head dim: said as such (it read "must be one of (32, 64, 128, 256)", as if the
    # padded 48 or 96 were refused too).
    for dqk, dv, name in ((320, 8, r"q/k head dim \(Dqk\)"), (8, 300, r"v head dim \(Dv\)")):
        with pytest.raises(ValueError, match=name + r" must be at most 256 \(a smaller one is zero-padded.*got 3"):
            ops.hstu_attention(
                torch.randn(6, 1, dqk), torch.randn(6, 1, dqk), torch.randn(6, 1, dv), torch.tensor([0, 6]), 8
            )
    for shapes, name in ((((6, 1, 0), (6, 1, 8)), "Dqk"), (((6, 1, 8), (6, 1, 0)), "Dv")):
        for source in ("tuned", "reference"):
            with pytest.raises(ValueError, match=rf"\({name}\) must be at least 1, got 0"):
                qk, vs = shapes
                ops.hstu_attention(
                    torch.randn(qk), torch.randn(qk), torch.randn(vs), torch.tensor([0, 6]), 8, source=source
                )


# (q, k, v shapes of a degenerate call, a regex its ValueError must match: the argument named)
DEGENERATE_SHAPES = {
    "zero heads": (((29, 0, 32),) * 3, r"q, k and v must have at least one head .*got q \(29, 0, 32\)"),
    "zero heads, padded dim": (((29, 0, 48),) * 3, r"q, k and v must have at least one head"),
    "k heads differ": (((29, 2, 32), (29, 3, 32), (29, 2, 32)), r"k must have q's shape"),
    "v heads differ": (((29, 2, 32), (29, 2, 32), (29, 3, 32)), r"v must have shape \(L, H, Dv\)"),
    "zero Dqk": (((29, 2, 0), (29, 2, 0), (29, 2, 32)), r"q/k head dim \(Dqk\) must be"),
    "zero Dv": (((29, 2, 32), (29, 2, 32), (29, 2, 0)), r"v head dim \(Dv\) must be"),
    "q strided last dim": (((29, 2, 64), (29, 2, 32), (29, 2, 32)), r"q must be contiguous in its last dim"),
    "v strided last dim": (((29, 2, 32), (29, 2, 32), (29, 2, 64)), r"v must be contiguous in its last dim"),
}


@pytest.mark.parametrize("call", ["default", "reference", "fwd op", "bwd op", "reference op", "template"])
@pytest.mark.parametrize("case", list(DEGENERATE_SHAPES))
def test_degenerate_shapes_name_the_argument_at_every_entry(case, call):
    """Zero heads passed every check: the public call failed in dispatch ("num_heads must be an int >= 1", no
    argument named), the reference op and the template launched on an empty grid. Each degenerate shape is a
    ValueError naming q, k or v at every entry point."""
    from kernel_templates.hstu_attention.op import hstu_attention as template

    (qs, ks, vs), match = DEGENERATE_SHAPES[case]
    q, k, v = (torch.randn(s) for s in (qs, ks, vs))
    q, v = (t[..., ::2] if t.shape[-1] == 64 else t for t in (q, v))  # a strided last dim of 32
    off = torch.tensor(GOOD_OFFSETS)
    cfg = {n: dispatch.select(n, q.dtype, D, D, H, MAX_LEN, None, "default").config for n in (ops.FWD, ops.BWD)}
    backend = "reference" if call == "reference op" else "triton"
    do = torch.randn(q.shape[0], q.shape[1], v.shape[2])
    with pytest.raises(ValueError, match=match):
        if call in ("default", "reference"):
            ops.hstu_attention(q, k, v, off, MAX_LEN, source=call)
        elif call in ("fwd op", "reference op"):
            fwd = (backend, cfg[ops.FWD], backend, cfg[ops.BWD])
            torch.ops.hstu.attention_fwd(q, k, v, off, None, MAX_LEN, 0.25, 0, 0, None, *fwd)
        elif call == "bwd op":
            torch.ops.hstu.attention_bwd(do, q, k, v, off, None, MAX_LEN, 0.25, 0, 0, None, backend, cfg[ops.BWD])
        else:
            template(q, k, v, off, MAX_LEN)


@pytest.mark.gpu
@pytest.mark.parametrize(("dqk", "dv"), [(96, 96), (48, 200)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_padded_head_dims_on_the_gpu(dqk, dv, dtype):
    """The padded call through the tuned path (CuTe where it has the padded dim) in half precision."""
    from kernel_templates.hstu_attention.testing import check_tolerance, make_jagged_inputs

    inp = make_jagged_inputs([0, 1, 77, 300, 129], 2, dqk, dv, torch.float32, "cuda", seed=3)
    do = torch.randn(inp.q.shape[0], 2, dv, device="cuda")
    ins = [t.to(dtype).requires_grad_(True) for t in (inp.q, inp.k, inp.v)]
    out = ops.hstu_attention(*ins, inp.seq_offsets, inp.max_seq_len)
    got = (out, *torch.autograd.grad(out, ins, do.to(dtype)))
    refs = {}
    for name, prec in (("ref32", torch.float32), ("lowp", dtype)):
        r_in = [t.to(prec).requires_grad_(True) for t in (inp.q, inp.k, inp.v)]
        r = hstu_attention_reference(*r_in, inp.seq_offsets, inp.max_seq_len, 1 / dqk**0.5)
        refs[name] = (r, *torch.autograd.grad(r, r_in, do.to(prec)))
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        check_tolerance(f"d{dqk}/{dv} {name}", got[i], refs["ref32"][i].float(), refs["lowp"][i])


# ------------------------------------------------------------------------------------------------
# The device check kernel computes the host check's mask (run here by the interpreter).
# ------------------------------------------------------------------------------------------------
def _random_batch(rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
    batch = int(rng.integers(0, 9))
    lengths = rng.integers(0, 12, size=batch)
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    rows = int(off[-1])
    kind = rng.integers(0, 6)
    if kind == 1:
        off[0] = rng.integers(-3, 4)
    elif kind == 2 and batch > 1:
        off[rng.integers(1, batch)] = rng.integers(-5, rows + 5)
    elif kind == 3:
        rows += int(rng.integers(-2, 3))
    max_len = int(lengths.max()) if batch else 0
    max_len += int(rng.integers(-2, 3)) if kind == 4 else 0
    nt = None
    if rng.integers(0, 2) and batch:
        nt = torch.tensor(rng.integers(-2, 14, size=batch) if kind == 5 else rng.integers(0, lengths + 1))
    dtype = torch.int32 if rng.integers(0, 2) else torch.int64
    return torch.tensor(off, dtype=dtype), (None if nt is None else nt.to(dtype)), rows, max(max_len, 0)


@pytest.mark.interpreter
def test_device_check_kernel_matches_host_check():
    rng = np.random.default_rng(0)
    seen = 0
    for _ in range(60):
        off, nt, rows, max_len = _random_batch(rng)
        err = torch.full((1,), -1, dtype=torch.int32)
        ic.launch_offsets_check(off, nt, rows, max_len, err=err, assert_on_device=False)
        bits, found = ic.offsets_problems(off, nt, rows, max_len)
        assert int(err) == bits, (off.tolist(), None if nt is None else nt.tolist(), rows, max_len)
        assert len(found) == bin(bits).count("1")
        seen |= bits
    assert seen == 31, f"the random batches should hit every error bit, got {seen:05b}"


@pytest.mark.interpreter
def test_device_check_kernel_loops_over_long_batches():
    """More sequences than one block of the check kernel: a bad one in the second block is found."""
    lengths = torch.ones(1500, dtype=torch.int64)
    off = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    off[1200] = off[1199] - 1  # sequence 1199 decreases
    err = torch.zeros(1, dtype=torch.int32)
    ic.launch_offsets_check(off, None, int(off[-1]), 4, err=err, assert_on_device=False)
    assert int(err) == ic.DECREASING


# ------------------------------------------------------------------------------------------------
# A memory checker for the interpreter: every load, store and atomic must fall inside a tensor argument.
# ------------------------------------------------------------------------------------------------
class OutOfBounds(AssertionError):
    """An access outside every tensor argument of the running kernel."""


class MemoryChecker:
    """Wraps the interpreter's launch and memory ops; ``accesses`` counts the checked elements."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, int]] = []
        self.accesses = 0

    def register(self, args: list) -> None:
        self.spans = []
        for a in args:
            if isinstance(a, torch.Tensor) and a.numel() > 0:
                last = sum((s - 1) * st for s, st in zip(a.shape, a.stride(), strict=True))
                self.spans.append((a.data_ptr(), a.data_ptr() + (last + 1) * a.element_size()))

    def check(self, ptrs, mask, what: str) -> None:
        addr = np.asarray(ptrs.data, dtype=np.uint64)
        active = addr[np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)] if mask is not None else addr
        size = ptrs.get_element_ty().primitive_bitwidth // 8
        ok = np.zeros(active.shape, dtype=bool)
        for lo, hi in self.spans:
            ok |= (active >= lo) & (active + size <= hi)
        self.accesses += int(active.size)
        if not ok.all():
            bad = int(active[~ok][0])
            raise OutOfBounds(f"{what} at {bad:#x} is outside every tensor argument {[hex(s) for s, _ in self.spans]}")


@pytest.fixture
def memcheck(monkeypatch) -> MemoryChecker:
    from triton.runtime import interpreter as interp

    checker = MemoryChecker()
    builder = interp.InterpreterBuilder
    init, load, store, rmw = (
        interp.GridExecutor._init_args_hst,
        builder.create_masked_load,
        builder.create_masked_store,
        builder.create_atomic_rmw,
    )

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = init(self, args_dev, kwargs)
        checker.register(list(args_hst) + list(kwargs_hst.values()))
        return args_hst, kwargs_hst

    def masked_load(self, ptrs, mask, *a):
        checker.check(ptrs, mask, "load")
        return load(self, ptrs, mask, *a)

    def masked_store(self, ptrs, value, mask, *a):
        checker.check(ptrs, mask, "store")
        return store(self, ptrs, value, mask, *a)

    def atomic_rmw(self, op, ptr, val, mask, *a):
        checker.check(ptr, mask, "atomic")
        return rmw(self, op, ptr, val, mask, *a)

    monkeypatch.setattr(interp.GridExecutor, "_init_args_hst", init_args)
    monkeypatch.setattr(builder, "create_masked_load", masked_load)
    monkeypatch.setattr(builder, "create_masked_store", masked_store)
    monkeypatch.setattr(builder, "create_atomic_rmw", atomic_rmw)
    return checker


@triton.jit
def _read_past_end(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs + n, mask=offs < BLOCK))


@pytest.mark.interpreter
def test_memory_checker_catches_an_out_of_bounds_read(memcheck):
    """The checker can fail: a read past the end of a view (inside its storage) is caught."""
    buf = torch.zeros(64)
    y = torch.zeros(8)
    _read_past_end[(1,)](buf[:8], y, 0, BLOCK=8)  # in bounds
    assert memcheck.accesses == 16
    with pytest.raises(InterpreterError, match="OutOfBounds.*load"):
        _read_past_end[(1,)](buf[:8], y, 4, BLOCK=8)


# Offsets that point anywhere: negative, past L, decreasing, huge (int64), and targets outside [0, n].
OOB_OFFSETS = [
    ([-8, 5, 29], None),
    ([0, 10, 45], None),
    ([0, 20, 3, 29], None),
    ([0, 20, 35, 29], None),
    ([40, 50, 60], None),
    ([0, 2**40, 29], None),
    ([0, 9, 29], [-3, 100]),
    ([0, 9, 29], [9, 21]),
]
GUARD = 16
SENTINEL = 1232.0  # exact in fp32, fp16 and bf16


def _guarded(rows: int, dim: int, fill: float | None = None, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): the view is rows [GUARD, GUARD + rows) of a buffer with GUARD rows either side,
    so an out-of-bounds row access stays in memory (the checker reports it) and can be seen."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(rows + 2 * GUARD, H, dim, generator=g)
    if fill is not None:
        buf.fill_(fill)
    return buf, buf[GUARD : GUARD + rows]


def _assert_guards_untouched(buf: torch.Tensor, rows: int) -> None:
    assert bool((buf[:GUARD] == SENTINEL).all()) and bool((buf[GUARD + rows :] == SENTINEL).all())


@pytest.mark.interpreter
@pytest.mark.parametrize("offsets,targets", OOB_OFFSETS)
def test_triton_forward_stays_in_bounds(memcheck, offsets, targets):
    _, q = _guarded(L, D, seed=1)
    _, k = _guarded(L, D, seed=2)
    _, v = _guarded(L, D, seed=3)
    out_buf, out = _guarded(L, D, fill=SENTINEL)
    off = torch.tensor(offsets, dtype=torch.int64)
    nt = None if targets is None else torch.tensor(targets)
    for ctx, window in ((0, 0), (2, 3)):
        hstu_attention_fwd(q, k, v, off, 8, 0.25, nt, ctx, window, None, HSTUFwdConfig(16, 16, 4, 1), out=out)
        _assert_guards_untouched(out_buf, L)
        assert torch.isfinite(out[out != SENTINEL]).all()
    assert memcheck.accesses > 0


@pytest.mark.interpreter
@pytest.mark.parametrize("dq_mode", ["atomic", "separate"])
@pytest.mark.parametrize("offsets,targets", OOB_OFFSETS)
def test_triton_backward_stays_in_bounds(memcheck, offsets, targets, dq_mode):
    tensors = [_guarded(L, D, seed=s)[1] for s in (1, 2, 3, 4)]
    outs = [_guarded(L, D, fill=SENTINEL) for _ in range(3)]
    off = torch.tensor(offsets, dtype=torch.int64)
    nt = None if targets is None else torch.tensor(targets)
    cfg = HSTUBwdConfig(16, 16, 4, 1, dq_mode=dq_mode, dkv_split=dq_mode == "separate")
    hstu_attention_bwd(*tensors, off, 8, 0.25, nt, 2, 0, None, cfg, out=tuple(o for _, o in outs))
    for buf, _ in outs:
        _assert_guards_untouched(buf, L)
    assert memcheck.accesses > 0


@pytest.mark.interpreter
@pytest.mark.parametrize("offsets,targets", OOB_OFFSETS[:5])
def test_drop_in_call_with_validate_none_stays_in_bounds(memcheck, offsets, targets):
    """Through the public call and autograd, offsets unchecked: no access leaves the tensors."""
    q, k, v = (_guarded(L, D, seed=s)[1].requires_grad_(True) for s in (1, 2, 3))
    out = ops.hstu_attention(q, k, v, torch.tensor(offsets), 8, source="default", validate="none")
    out.sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None
    assert memcheck.accesses > 0


@pytest.mark.interpreter
def test_hld_layout_with_validate_none_stays_in_bounds(memcheck):
    """(H, L, D) tensors: the offsets (made for L = 29) are clamped to the 2 rows the kernel sees."""
    q, k, v = (t.transpose(0, 1).contiguous().requires_grad_(True) for t in _qkv())
    out = ops.hstu_attention(q, k, v, torch.tensor(GOOD_OFFSETS), MAX_LEN, source="default", validate="none")
    out.sum().backward()
    assert out.shape == (H, L, D)
    assert memcheck.accesses > 0


# ------------------------------------------------------------------------------------------------
# GPU: the device assertion, no sync in "async" mode, guard rows, compute-sanitizer.
# ------------------------------------------------------------------------------------------------
DEVICE_MESSAGES = {
    "start_not_zero": "seq_offsets must start at 0",
    "decreasing": "seq_offsets must be non-decreasing",
    "ends_before_L": "seq_offsets must end at L",
    "ends_after_L": "seq_offsets must end at L",
    "max_seq_len_below_longest": "max_seq_len is below the longest sequence",
    "hld_layout": "seq_offsets must end at L",
    "targets_negative": "num_targets must be within",
    "targets_above_length": "num_targets must be within",
}

# Runs one bad case of this file on the GPU in "async" mode; the device assertion ends the process.
ASSERT_SCRIPT = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import test_input_safety as t
from autotune.runtime import ops
a = t._case(sys.argv[2])
a = {n: x.cuda() if isinstance(x, torch.Tensor) else x for n, x in a.items()}
for n in ("q", "k", "v"):
    a[n] = a[n].to(torch.bfloat16)
# A valid call first, so the kernels are loaded: a first launch loads its module, which synchronises.
rows = a["q"].shape[0]
good = dict(a, seq_offsets=torch.tensor([0, rows], device="cuda", dtype=a["seq_offsets"].dtype), max_seq_len=rows)
if a.get("num_targets") is not None:
    good["num_targets"] = torch.zeros(1, device="cuda", dtype=a["num_targets"].dtype)
ops.hstu_attention(**good, source="default")
torch.cuda.synchronize()
out = ops.hstu_attention(**a, source="default")
print("launched without a sync", flush=True)
torch.cuda.synchronize()
print("NO DEVICE ERROR", flush=True)
"""

# Offsets pointing anywhere, unchecked, through Triton (and CuTe on sm90) forward and backward.
SANITIZER_SCRIPT = """
import json, sys, torch
from autotune.runtime import ops
backends = sys.argv[1].split(",")
cases = json.loads(sys.argv[2])
L, H, D = 29, 2, 64
for backend in backends:
    for offsets, targets in cases:
        off = torch.tensor(offsets, device="cuda")  # int64; the CuTe launcher narrows it to int32
        nt = None if targets is None else torch.tensor(targets, device="cuda")
        q, k, v = (torch.randn(L, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        if backend == "triton":
            out = ops.hstu_attention(q, k, v, off, 8, num_targets=nt, source="default", validate="none")
        else:  # "cute" launches the plain grid, "cute_compact" only the real tiles (tile_table.py)
            import dataclasses
            from kernel_templates.cute import default_cute_bwd_config, default_cute_fwd_config, hstu_attention_cute
            c = backend == "cute_compact"
            fc = dataclasses.replace(default_cute_fwd_config(D, D), compact=c, l2_group=0)
            bc = dataclasses.replace(default_cute_bwd_config(D, D), compact=c, l2_group=2)
            out = hstu_attention_cute(q, k, v, off, 8, num_targets=nt, fwd_config=fc, bwd_config=bc, validate=False)
        out.float().sum().backward()
torch.cuda.synchronize()
print("SCRIPT DONE", flush=True)
"""


def _gpu_env() -> dict:
    from proc_env import child_env

    return child_env("TRITON_INTERPRET", "CUTE_DSL_ARCH")


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(DEVICE_MESSAGES))
def test_async_mode_fails_a_device_assertion_naming_the_argument(tmp_path, case):
    import subprocess
    import sys

    script = tmp_path / "assert_case.py"
    script.write_text(ASSERT_SCRIPT)
    res = subprocess.run(
        [sys.executable, str(script), str(REPO / "tests"), case],
        capture_output=True, text=True, timeout=300, env=_gpu_env(),
    )  # fmt: skip
    text = res.stdout + res.stderr
    assert "launched without a sync" in text, text[-3000:]
    assert "NO DEVICE ERROR" not in text and res.returncode != 0, text[-3000:]
    assert "device-side assert" in text, text[-3000:]
    assert DEVICE_MESSAGES[case] in text, text[-3000:]


@pytest.mark.gpu
def test_device_check_kernel_matches_host_check_on_gpu():
    rng = np.random.default_rng(1)
    for _ in range(40):
        off, nt, rows, max_len = _random_batch(rng)
        err = torch.full((1,), -1, dtype=torch.int32, device="cuda")
        nt_dev = None if nt is None else nt.cuda()
        ic.launch_offsets_check(off.cuda(), nt_dev, rows, max_len, err=err, assert_on_device=False)
        assert int(err) == ic.offsets_problems(off, nt, rows, max_len)[0]


@pytest.mark.gpu
def test_async_mode_does_not_sync_and_full_mode_does():
    q, k, v = (t.cuda().to(torch.bfloat16) for t in _qkv())
    off = torch.tensor(GOOD_OFFSETS, device="cuda")
    ops.hstu_attention(q, k, v, off, MAX_LEN, source="default")  # compile outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.hstu_attention(q, k, v, off, MAX_LEN, source="default", validate="async")
        ops.hstu_attention(q, k, v, off, MAX_LEN, source="default", validate="none")
        with pytest.raises(RuntimeError, match="synchroniz"):
            ops.hstu_attention(q, k, v, off, MAX_LEN, source="default", validate="full")
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _guarded_cuda(rows: int, dim: int, dtype: torch.dtype, fill: float | None = None):
    buf = torch.randn(rows + 2 * GUARD, H, dim, device="cuda", dtype=dtype)
    if fill is not None:
        buf.fill_(fill)
    return buf, buf[GUARD : GUARD + rows]


def _gpu_guard_case(backend: str, offsets: list[int], targets: list[int] | None, compact: bool = False) -> None:
    """Forward and backward with unchecked offsets; the rows around every output stay untouched."""
    d, dtype = 64, torch.bfloat16
    q, k, v, do = (_guarded_cuda(L, d, dtype)[1] for _ in range(4))
    outs = [_guarded_cuda(L, d, dtype, fill=SENTINEL) for _ in range(4)]
    off = torch.tensor(offsets, device="cuda")  # int64; the CuTe launcher narrows it to int32
    nt = None if targets is None else torch.tensor(targets, device="cuda", dtype=torch.int32)
    args = (off, 8, 0.125, nt, 0, 0, None)
    if backend == "triton":
        from kernel_templates.hstu_attention import default_bwd_config, default_fwd_config

        hstu_attention_fwd(q, k, v, *args, default_fwd_config(d, d), out=outs[0][1])
        hstu_attention_bwd(do, q, k, v, *args, default_bwd_config(d, d), out=tuple(o for _, o in outs[1:]))
    else:
        import dataclasses

        from kernel_templates.cute import (
            default_cute_bwd_config,
            default_cute_fwd_config,
            hstu_attention_cute_bwd,
            hstu_attention_cute_fwd,
        )

        fwd_cfg = dataclasses.replace(default_cute_fwd_config(d, d), compact=compact)
        bwd_cfg = dataclasses.replace(default_cute_bwd_config(d, d), compact=compact)
        hstu_attention_cute_fwd(q, k, v, *args, fwd_cfg, out=outs[0][1])
        bwd_out = tuple(o for _, o in outs[1:])
        hstu_attention_cute_bwd(do, q, k, v, *args, config=bwd_cfg, out=bwd_out, validate=False)
    torch.cuda.synchronize()
    for buf, _ in outs:
        assert bool((buf[:GUARD].float() == SENTINEL).all()) and bool((buf[GUARD + L :].float() == SENTINEL).all())


@pytest.mark.gpu
@pytest.mark.parametrize("offsets,targets", OOB_OFFSETS)
def test_triton_kernels_keep_guard_rows_on_gpu(offsets, targets):
    _gpu_guard_case("triton", offsets, targets)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("compact", [False, True], ids=["grid", "compact"])
@pytest.mark.parametrize("offsets,targets", OOB_OFFSETS)
def test_cute_kernels_keep_guard_rows_on_gpu(offsets, targets, compact):
    pytest.importorskip("cutlass")
    _gpu_guard_case("cute", offsets, targets, compact)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "backend",
    ["triton", pytest.param("cute", marks=pytest.mark.sm90), pytest.param("cute_compact", marks=pytest.mark.sm90)],
)
def test_out_of_bounds_offsets_under_compute_sanitizer(tmp_path, backend):
    """memcheck sees every device access; without the caching allocator each tensor is its own allocation."""
    import json
    import shutil
    import subprocess
    import sys

    if shutil.which("compute-sanitizer") is None:
        pytest.skip("compute-sanitizer is not on PATH")
    if backend.startswith("cute"):
        pytest.importorskip("cutlass")
    script = tmp_path / "oob.py"
    script.write_text(SANITIZER_SCRIPT)
    env = _gpu_env()
    env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    cmd = ["compute-sanitizer", "--tool", "memcheck", sys.executable, str(script), backend, json.dumps(OOB_OFFSETS)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=580, env=env)
    text = res.stdout + res.stderr
    assert "SCRIPT DONE" in text, text[-4000:]
    assert "ERROR SUMMARY: 0 errors" in text, text[-4000:]
