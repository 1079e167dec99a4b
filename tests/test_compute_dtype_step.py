"""The precision="bf16" model step keeps the stream in the compute dtype end to end, and the fused layer
sums the uvqk bias gradient in fp32 straight into the master bias's dtype.

Checked on CPU (Triton interpreter): the embeddings' sum, the final LayerNorm through the layers' kernel and the
task heads as one GEMM + SiLU + block-diagonal GEMM give the loss and every gradient of the module-by-module
formulation (fp32: tight; fp16 autocast: within fp16 rounding), and a step launches no activation-sized cast or
fp32 add beyond the ones stated (a dispatch-mode counter over every aten op of forward and backward).
"""

from __future__ import annotations

import collections
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from autotune.runtime import dispatch
from models.config import get_config
from models.data import SyntheticJaggedDataset
from models.hstu import HSTULayer, HSTURankingModel

pytestmark = pytest.mark.interpreter

ROOT = Path(__file__).resolve().parents[1]
KERNELS = str(ROOT / "kernel_templates")


@pytest.fixture(autouse=True)
def _fresh_dispatch():
    dispatch.reset()
    yield
    dispatch.reset()


def _cfg(**kw):
    return get_config("tiny", layer="fused", precision="bf16", dropout=0.0, batch_size=3, **kw)


def _module_formulation(model: HSTURankingModel, batch) -> torch.Tensor:
    """Logits as the modules compose them: fp32 embedding sums, a cast, nn.LayerNorm, one call per head."""
    x = model.input_proj(model.item_emb(batch.items) + model.action_emb(batch.prev_actions))
    x = x + model.pos_emb(batch.positions)
    for layer in model.layers:
        x = layer(x, batch.seq_offsets)
    x = model.final_norm(x.float())
    return torch.cat([head(x) for head in model.heads], dim=1)


def _loss_and_grads(model: HSTURankingModel, batch, logits_fn=None, amp: torch.dtype | None = None):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
        logits = model(batch) if logits_fn is None else logits_fn(model, batch)
        loss = F.binary_cross_entropy_with_logits(logits.float(), batch.labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("embedding_dim", [64, 32])
def test_compute_dtype_path_matches_the_module_formulation_fp32(embedding_dim):
    """fp32 (no autocast): same loss and gradients as the module-by-module model, to fp32 rounding; with an
    input projection (embedding_dim != hidden) the embeddings take the module path."""
    cfg = _cfg(embedding_dim=embedding_dim)
    torch.manual_seed(0)
    model = HSTURankingModel(cfg)
    batch = SyntheticJaggedDataset(cfg).batch(0)
    loss, grads = _loss_and_grads(model, batch)
    ref_loss, ref_grads = _loss_and_grads(model, batch, _module_formulation)
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * max(1.0, abs(ref_loss.item()))
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert grads[name].dtype == g.dtype == torch.float32, name
        assert _rel(grads[name], g) <= 1e-5, f"d{name}: {_rel(grads[name], g):.2e}"


def test_compute_dtype_path_fp16_within_rounding_of_fp32():
    """fp16 compute dtype (CPU autocast): the loss and the gradients of the fp32 master weights stay within
    fp16 rounding of the fp32 module formulation."""
    cfg = _cfg()
    torch.manual_seed(0)
    model = HSTURankingModel(cfg)
    batch = SyntheticJaggedDataset(cfg).batch(1)
    loss, grads = _loss_and_grads(model, batch, amp=torch.float16)
    ref_loss, ref_grads = _loss_and_grads(model, batch, _module_formulation)
    assert abs(loss.item() - ref_loss.item()) <= 2e-3 * max(1.0, abs(ref_loss.item()))
    for name, g in ref_grads.items():
        assert grads[name].dtype == torch.float32, name
        assert _rel(grads[name], g) <= 3e-2, f"d{name}: {_rel(grads[name], g):.2e}"


class _ActivationOps(TorchDispatchMode):
    """Counts activation-sized (``rows`` rows, >= ``width`` columns) dtype casts and fp32 adds issued outside the
    kernel launchers (the interpreter's own fp32 staging of a kernel's inputs is not the model's work)."""

    def __init__(self, rows: int, width: int) -> None:
        super().__init__()
        self.rows, self.size = rows, rows * width
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in ("_to_copy", "copy_", "add", "add_") and not self._in_kernel_launcher():
            ins = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            res = out if isinstance(out, torch.Tensor) else None
            big = res is not None and res.dim() == 2 and res.shape[0] == self.rows and res.numel() >= self.size
            if big and name in ("_to_copy", "copy_") and any(t.dtype != res.dtype for t in ins):
                self.ops[f"cast {ins[-1].dtype}->{res.dtype}".replace("torch.", "")] += 1
            elif big and name in ("add", "add_") and any(t.dtype == torch.float32 for t in ins):
                self.ops[f"fp32 {name}"] += 1
        return out

    @staticmethod
    def _in_kernel_launcher() -> bool:
        frames = [f.filename for f in traceback.extract_stack() if f.filename.startswith(str(ROOT))]
        inner = [f for f in frames if not f.endswith("test_compute_dtype_step.py")]
        return bool(inner) and inner[-1].startswith(KERNELS)


def test_step_has_no_avoidable_activation_casts_or_fp32_adds():
    """One forward + backward in fp16 (CPU autocast) with 2 tasks: the only activation-sized cast is the
    gradient into the fp32 embedding tables (once for the three tables); the only fp32 adds are the
    embeddings' sum (the last writes fp16). The module formulation costs 2 casts more on CPU (the stream's
    cast into the compute dtype and its backward) and, under CUDA autocast, an fp32 LayerNorm whose output
    each head casts again plus an fp32 sum of the heads' gradients."""
    cfg = _cfg()
    torch.manual_seed(0)
    model = HSTURankingModel(cfg)
    batch = SyntheticJaggedDataset(cfg).batch(2)
    rows = batch.items.shape[0]
    assert rows not in (cfg.hidden_dim, 4 * cfg.hidden_dim, cfg.num_tasks * cfg.head_hidden)  # no weight of `rows` rows
    counter = _ActivationOps(rows, cfg.hidden_dim)
    with counter:
        _loss_and_grads(model, batch, amp=torch.float16)
    assert dict(counter.ops) == {"cast float16->float32": 1, "fp32 add_": 1, "fp32 add": 1}
    base = _ActivationOps(rows, cfg.hidden_dim)
    with base:
        _loss_and_grads(model, batch, _module_formulation, amp=torch.float16)
    assert sum(base.ops.values()) > sum(counter.ops.values()), base.ops


@pytest.mark.parametrize(("recompute", "rounded"), [("none", False), ("uvqk", False), ("pre", True)])
def test_uvqk_bias_gradient_is_not_rounded_to_the_compute_dtype(recompute, rounded):
    """With the pre-activation kept, the backward's fp32 column sum lands in the fp32 master bias's gradient
    as it is (it used to be rounded to the compute dtype and cast back: values fp16 can hold exactly); when
    the backward recomputes the pre-activation it runs the compute-dtype bias, and the sum is rounded."""
    cfg = get_config("tiny", layer="fused", precision="bf16", dropout=0.0, recompute=recompute)
    lengths = [5, 17, 32, 9]
    off = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(4)
    x, dout = (torch.randn(sum(lengths), cfg.hidden_dim, generator=gen) for _ in range(2))
    torch.manual_seed(0)
    layer = HSTULayer(cfg)
    with torch.autocast("cpu", dtype=torch.float16):
        out = layer(x, off)
    assert out.dtype == torch.float16
    out.float().backward(dout)
    g = layer.uvqk.bias.grad
    assert g.dtype == torch.float32 and torch.isfinite(g).all()
    assert torch.equal(g, g.half().float()) == rounded
    torch.testing.assert_close(layer.out_proj.bias.grad, dout.sum(0), rtol=1e-2, atol=1e-2)  # fp16 dout, fp32 sum
