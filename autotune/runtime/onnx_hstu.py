"""The ``hstu`` ONNX domain: jagged HSTU attention as one node whose function body is standard ONNX.

``torch.onnx.export`` turns ``hstu::attention_fwd`` into an ``hstu.JaggedAttention`` node (see
``translation_table``); ``attach_functions`` then adds the model-local function that defines the node
from opset-18 operators, so ONNX Runtime (or any runtime without an HSTU kernel) runs the file as is,
and a runtime with an HSTU kernel can match the node by domain and name and read its attributes.

Why a registered schema instead of a translation that calls the function directly: the exporter
converts the opset of every model it builds, and that pass inlines model-local functions, which
would dissolve the node into ~60 plain ones. A node of a registered (schema-only) op passes through,
and its function is attached after the conversion.

The function body is a reference, not a kernel: it builds the (H, L, L) score tensor of the whole
jagged batch and masks pairs of different sequences, so memory is O(H * L^2) for L rows. It follows
the HSTU.md mask exactly (causal, context rows, targets, window) and matches the PyTorch oracle to
float rounding.
"""

from __future__ import annotations

from typing import Any

import onnx
from onnx.defs import OpSchema
from onnxscript import opset18 as op
from onnxscript import script
from onnxscript.values import Opset

DOMAIN = "hstu"
OPSET_VERSION = 18  # of the default domain, in the function body and the exported model
NAME = "JaggedAttention"
_INT64_MAX = 9223372036854775807

# Node attributes: (name, ONNX type, meaning). The first five define the maths (used by the body);
# the rest record the kernel a tuned runtime should launch for the node (unused by the body).
ATTRIBUTES: tuple[tuple[str, str, str], ...] = (
    ("max_seq_len", "INT", "N: longest sequence the caller promises; the default divisor"),
    ("alpha", "FLOAT", "score scale, usually 1/sqrt(Dqk)"),
    ("contextual_seq_len", "INT", "c: leading context tokens per sequence (0 = none)"),
    ("max_attn_len", "INT", "w: attention window (0 = none)"),
    ("scaling_seqlen", "INT", "divisor S; -1 = max_seq_len"),
    ("has_targets", "INT", "1 when the caller passed num_targets (else the input is zeros)"),
    ("kernel_dtype", "STRING", "dtype the recorded kernel config is for (artifact key)"),
    ("bucket", "INT", "artifact length bucket of max_seq_len"),
    ("distribution", "STRING", "artifact length-distribution key (uniform/jagged; empty = unknown)"),
    ("mask", "STRING", "artifact mask key (causal, targets, context, context+targets, window)"),
    ("backend", "STRING", "forward backend (triton, cute, reference)"),
    ("config", "STRING", "forward config as JSON"),
    ("bwd_backend", "STRING", "backward backend"),
    ("bwd_config", "STRING", "backward config as JSON"),
    ("config_source", "STRING", "where the configs come from: 'tuned:<gpu>' or the trace-time dispatch"),
)


@script(Opset(DOMAIN, 1), default_opset=op)
def JaggedAttention(  # noqa: N802 - the ONNX op name
    q,
    k,
    v,
    seq_offsets,
    num_targets,
    max_seq_len: int,
    alpha: float,
    contextual_seq_len: int,
    max_attn_len: int,
    scaling_seqlen: int,
    has_targets: int,
    kernel_dtype: str,
    bucket: int,
    distribution: str,
    mask: str,
    backend: str,
    config: str,
    bwd_backend: str,
    bwd_config: str,
    config_source: str,
):
    """O_i = (1/S) sum_j M_ij silu(alpha q_i.k_j) v_j over (L, H, D) rows with (B+1,) offsets."""
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    rows = op.Range(zero, op.Gather(op.Shape(q), zero), one)
    ends = op.Slice(seq_offsets, op.Constant(value_ints=[1]), op.Constant(value_ints=[_INT64_MAX]))
    starts = op.Slice(seq_offsets, op.Constant(value_ints=[0]), op.Constant(value_ints=[-1]))
    # Sequence of each row: how many sequences end at or before it (empty sequences are skipped).
    seg = op.ReduceSum(op.Cast(op.LessOrEqual(op.Unsqueeze(ends, [0]), op.Unsqueeze(rows, [1])), to=7), [1], keepdims=0)
    pos = rows - op.Gather(starts, seg)
    n = op.Gather(ends - starts, seg)
    c = op.Constant(value_int=contextual_seq_len)
    # HSTU.md position ids: context tokens share id 0, targets share id m (a no-op without targets).
    m = n - c + one - op.Gather(num_targets, seg)
    ids = op.Min(op.Max(pos - c + one, zero), m)
    id_i = op.Unsqueeze(ids, [1])
    id_j = op.Unsqueeze(ids, [0])
    valid = op.Or(op.Equal(op.Unsqueeze(rows, [1]), op.Unsqueeze(rows, [0])), op.Greater(id_i, id_j))
    w = op.Constant(value_int=max_attn_len)
    valid = op.And(valid, op.Or(op.LessOrEqual(w, zero), op.LessOrEqual(id_i - id_j, w)))
    context_rows = op.And(op.Equal(id_i, zero), op.Less(id_j, op.Unsqueeze(m, [1])))
    valid = op.Or(valid, op.And(op.Greater(c, zero), context_rows))
    pair = op.And(valid, op.Equal(op.Unsqueeze(seg, [1]), op.Unsqueeze(seg, [0])))
    s = op.MatMul(op.Transpose(q, perm=[1, 0, 2]), op.Transpose(k, perm=[1, 2, 0]))
    s = s * op.CastLike(op.Constant(value_float=alpha), q)
    divisor = op.Constant(value_int=scaling_seqlen)
    divisor = op.Where(op.Greater(divisor, zero), divisor, op.Constant(value_int=max_seq_len))
    p = s * op.Sigmoid(s) * op.CastLike(pair, q) / op.CastLike(divisor, q)
    return op.Transpose(op.MatMul(p, op.Transpose(v, perm=[1, 0, 2])), perm=[1, 0, 2])


def register_schema() -> None:
    """Register ``hstu.JaggedAttention`` with onnx (once per process) so the exporter can emit it."""
    if onnx.defs.has(NAME, DOMAIN):
        return
    attr_type = OpSchema.AttrType
    param = OpSchema.FormalParameter
    attrs = [OpSchema.Attribute(name, getattr(attr_type, t), doc, required=True) for name, t, doc in ATTRIBUTES]
    floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"]
    schema = OpSchema(
        NAME,
        DOMAIN,
        1,
        "Jagged HSTU attention (see the model-local function for its definition).",
        inputs=[param(x, "T") for x in ("q", "k", "v")] + [param(x, "I") for x in ("seq_offsets", "num_targets")],
        outputs=[param("out", "T")],
        type_constraints=[("T", floats, "float types"), ("I", ["tensor(int64)"], "offsets and target counts")],
        attributes=attrs,
    )
    onnx.defs.register_schema(schema)


def _attention_fwd(
    q: Any,
    k: Any,
    v: Any,
    seq_offsets: Any,
    num_targets: Any,
    max_seq_len: int,
    alpha: float,
    contextual_seq_len: int,
    max_attn_len: int,
    scaling_seqlen: int | None,
    backend: str,
    config: str,
    bwd_backend: str,
    bwd_config: str,
    validate: str = "async",
) -> Any:
    """Translation of ``hstu::attention_fwd``: one ``hstu.JaggedAttention`` node.

    The kernel-key attributes are placeholders here; ``models.export`` fills them from the
    exported program (the length-distribution hint lives on the module, not in the op's arguments).
    """
    has_targets = num_targets is not None
    if not has_targets:  # the mask of "no targets" equals zero targets per sequence (HSTU.md)
        batch = op.Sub(op.Shape(seq_offsets), op.Constant(value_ints=[1]))
        num_targets = op.ConstantOfShape(batch, value=onnx.helper.make_tensor("zero", onnx.TensorProto.INT64, [1], [0]))
    return Opset(DOMAIN, 1)[NAME](
        q,
        k,
        v,
        seq_offsets,
        num_targets,
        max_seq_len=int(max_seq_len),
        alpha=float(alpha),
        contextual_seq_len=int(contextual_seq_len),
        max_attn_len=int(max_attn_len),
        scaling_seqlen=-1 if scaling_seqlen is None else int(scaling_seqlen),
        has_targets=int(has_targets),
        kernel_dtype="",
        bucket=0,
        distribution="",
        mask="",
        backend=backend,
        config=config,
        bwd_backend=bwd_backend,
        bwd_config=bwd_config,
        config_source="trace",
    )


def _ln_mul_dropout_fwd(x: Any, u: Any, weight: Any, bias: Any, eps: float, p: float, seed: Any) -> Any:
    """Translation of the fused ``hstu::ln_mul_dropout_fwd`` in inference (dropout is off when exported)."""
    y, mean, rstd = op.LayerNormalization(x, weight, bias, axis=-1, epsilon=float(eps), stash_type=1)
    return op.Mul(y, u), op.Squeeze(mean, [-1]), op.Squeeze(rstd, [-1])


def translation_table() -> dict[Any, Any]:
    """``custom_translation_table`` for ``torch.onnx.export`` of models that use the hstu custom ops."""
    import torch

    import autotune.runtime.ops  # noqa: F401 - registers hstu::attention_fwd
    import kernel_templates.fused_ln_mul_dropout  # noqa: F401 - registers hstu::ln_mul_dropout_fwd

    register_schema()
    return {
        torch.ops.hstu.attention_fwd.default: _attention_fwd,
        torch.ops.hstu.ln_mul_dropout_fwd.default: _ln_mul_dropout_fwd,
    }


def function_proto() -> onnx.FunctionProto:
    """The model-local function that defines ``hstu.JaggedAttention`` from opset-18 operators."""
    return JaggedAttention.to_function_proto()


def attach_functions(model: onnx.ModelProto) -> None:
    """Add the function of every hstu node (and the domain's opset import) to ``model``, in place."""
    if not any(n.domain == DOMAIN for n in model.graph.node):
        return
    if not any(f.domain == DOMAIN and f.name == NAME for f in model.functions):
        model.functions.append(function_proto())
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))


def set_attributes(node: onnx.NodeProto, values: dict[str, Any]) -> None:
    """Overwrite attributes of an hstu node (typed by ``ATTRIBUTES``)."""
    types = {name: t for name, t, _ in ATTRIBUTES}
    for name, value in values.items():
        if name not in types:
            raise KeyError(f"{NAME} has no attribute {name!r}")
        for i, a in enumerate(node.attribute):
            if a.name == name:
                del node.attribute[i]
                break
        node.attribute.append(onnx.helper.make_attribute(name, value))


def node_attributes(node: onnx.NodeProto) -> dict[str, Any]:
    """The attributes of a node as Python values (strings decoded)."""
    out = {}
    for a in node.attribute:
        value = onnx.helper.get_attribute_value(a)
        out[a.name] = value.decode() if isinstance(value, bytes) else value
    return out
