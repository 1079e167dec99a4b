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
the HSTU mask (docs/CONTRACTS.md) exactly (causal, context rows, targets, window) and matches the PyTorch oracle to
float rounding.

Every model the project writes goes through ``pin_ir_version``: it carries the lowest IR version its
content needs, not the newest the installed ``onnx`` package knows (which an older runtime refuses).
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
DOMAIN_VERSION = 1  # of the hstu domain: what the node's attributes and inputs mean
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


@script(Opset(DOMAIN, DOMAIN_VERSION), default_opset=op)
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
    # Position ids (docs/CONTRACTS.md): context tokens share id 0, targets share id m (a no-op without targets).
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
    divisor = op.Constant(value_int=scaling_seqlen)
    divisor = op.Where(op.Greater(divisor, zero), divisor, op.Constant(value_int=max_seq_len))
    # No rows: v is the (0, H, Dv) output. ONNX Runtime up to 1.30 dies of SIGFPE (the process, not the call) in
    # the MatMul its optimizer fuses with these transposes when the batch has no rows at all.
    if op.Equal(op.Gather(op.Shape(q), zero), zero):
        out = op.Identity(v)
    else:
        s = op.MatMul(op.Transpose(q, perm=[1, 0, 2]), op.Transpose(k, perm=[1, 2, 0]))
        s = s * op.CastLike(op.Constant(value_float=alpha), q)
        # The divisor in double, the quotient rounded once to q's type: cast to q's type, a divisor from 65520 up
        # was inf in float16 and every output 0 (the kernels divide in fp32). Exact for every T and divisor.
        silu = op.Cast(s * op.Sigmoid(s) * op.CastLike(pair, q), to=11)
        p = op.CastLike(op.Div(silu, op.Cast(divisor, to=11)), q)
        out = op.Transpose(op.MatMul(p, op.Transpose(v, perm=[1, 0, 2])), perm=[1, 0, 2])
    return out


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
        DOMAIN_VERSION,
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
    # The node takes int64 offsets and targets; the call also takes int32 ones (a model's own index dtype).
    seq_offsets = op.Cast(seq_offsets, to=onnx.TensorProto.INT64)
    if not has_targets:  # the mask of "no targets" equals zero targets per sequence (docs/CONTRACTS.md)
        batch = op.Sub(op.Shape(seq_offsets), op.Constant(value_ints=[1]))
        num_targets = op.ConstantOfShape(batch, value=onnx.helper.make_tensor("zero", onnx.TensorProto.INT64, [1], [0]))
    else:
        num_targets = op.Cast(num_targets, to=onnx.TensorProto.INT64)
    return Opset(DOMAIN, DOMAIN_VERSION)[NAME](
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
    """Translation of the fused ``hstu::ln_mul_dropout_fwd`` in inference (dropout is off when exported).

    A dropout probability above 0 (a module exported in training mode) is a ``ValueError`` naming it: the node has no
    dropout, so the file computed the undropped, unscaled ``LN(x) * u`` without a word.
    """
    if float(p) > 0.0:
        raise ValueError(
            f"hstu::ln_mul_dropout_fwd has dropout p={float(p):g}: its ONNX translation is inference only "
            "(no dropout); export the module in eval mode (module.eval())"
        )
    # In fp32, as the kernels compute it (parameters of any float dtype, output in x's): LayerNormalization takes one
    # type for x, scale and bias, so float16 activations beside fp32 parameters failed the checker.
    f32 = onnx.TensorProto.FLOAT
    scale, shift = op.Cast(weight, to=f32), op.Cast(bias, to=f32)
    y, mean, rstd = op.LayerNormalization(op.Cast(x, to=f32), scale, shift, axis=-1, epsilon=float(eps), stash_type=1)
    return op.CastLike(op.Mul(y, op.Cast(u, to=f32)), x), op.Squeeze(mean, [-1]), op.Squeeze(rstd, [-1])


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
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, DOMAIN_VERSION))


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


# IR version that introduced each feature ``min_ir_version`` detects (the notes on onnx.proto's Version enum).
_IR_SPARSE = 6  # sparse initializers
_IR_TRAINING = 7  # TrainingInfoProto
_IR_FUNCTIONS = 8  # model-local functions, Optional and SparseTensor types
_IR_FUNCTION_DEFAULTS = 9  # FunctionProto.attribute_proto
_IR_METADATA = 10  # metadata_props below ModelProto, function/node overloads, FunctionProto.value_info
_IR_MULTI_DEVICE = 11  # ModelProto.configuration, NodeProto.device_configurations
_OLD_DTYPES = 16  # every TensorProto data type up to BFLOAT16 is valid since IR 4
_DTYPE_IR = {
    "FLOAT8E4M3FN": 9,
    "FLOAT8E4M3FNUZ": 9,
    "FLOAT8E5M2": 9,
    "FLOAT8E5M2FNUZ": 9,
    "UINT4": 10,
    "INT4": 10,
    "FLOAT4E2M1": 11,
    "FLOAT8E8M0": 12,
    "UINT2": 13,
    "INT2": 13,
    "FLOAT6E2M3": 14,
    "FLOAT6E3M2": 14,
}


def _dtype_ir(dtype: int) -> int:
    """IR version of a tensor data type; one newer than this table: the installed onnx's (safe, not minimal)."""
    if dtype <= _OLD_DTYPES:
        return 4
    known = {getattr(onnx.TensorProto, name, None): ir for name, ir in _DTYPE_IR.items()}
    return known.get(dtype, onnx.IR_VERSION)


def _type_ir(t: onnx.TypeProto) -> int:
    kind = t.WhichOneof("value")
    if kind == "tensor_type":
        return _dtype_ir(t.tensor_type.elem_type)
    if kind == "sparse_tensor_type":
        return max(_IR_FUNCTIONS, _dtype_ir(t.sparse_tensor_type.elem_type))
    if kind == "optional_type":
        return max(_IR_FUNCTIONS, _type_ir(t.optional_type.elem_type))
    if kind == "sequence_type":
        return _type_ir(t.sequence_type.elem_type)
    if kind == "map_type":
        return max(_dtype_ir(t.map_type.key_type), _type_ir(t.map_type.value_type))
    return 3


def _value_info_ir(v: onnx.ValueInfoProto) -> int:
    return max(_IR_METADATA if v.metadata_props else 3, _type_ir(v.type))


def _tensor_ir(t: onnx.TensorProto) -> int:
    return max(_IR_METADATA if t.metadata_props else 3, _dtype_ir(t.data_type))


def _sparse_ir(s: onnx.SparseTensorProto) -> int:
    return max(_IR_SPARSE, _tensor_ir(s.values))


def _set(a: onnx.AttributeProto, field: str) -> list[Any]:
    """The single-valued ``field`` of an attribute as a list (empty when unset)."""
    return [getattr(a, field)] if a.HasField(field) else []


def _node_ir(n: onnx.NodeProto) -> int:
    need = _IR_METADATA if n.metadata_props or n.overload else 3
    if len(getattr(n, "device_configurations", ())):
        need = max(need, _IR_MULTI_DEVICE)
    for a in n.attribute:
        need = max(
            [
                need,
                *(_tensor_ir(t) for t in [*_set(a, "t"), *a.tensors]),
                *(_sparse_ir(s) for s in [*_set(a, "sparse_tensor"), *a.sparse_tensors]),
                *(_graph_ir(g) for g in [*_set(a, "g"), *a.graphs]),
                *(_type_ir(t) for t in [*_set(a, "tp"), *a.type_protos]),
            ]
        )
    return need


def _graph_ir(g: onnx.GraphProto) -> int:
    return max(
        [
            _IR_METADATA if g.metadata_props else 3,
            *(_value_info_ir(v) for v in [*g.input, *g.output, *g.value_info]),
            *(_tensor_ir(t) for t in g.initializer),
            *(_sparse_ir(s) for s in g.sparse_initializer),
            *(_node_ir(n) for n in g.node),
        ]
    )


def _function_ir(f: onnx.FunctionProto) -> int:
    need = max(_IR_FUNCTIONS, onnx.helper.find_min_ir_version_for(f.opset_import, ignore_unknown=True))
    if f.attribute_proto:
        need = max(need, _IR_FUNCTION_DEFAULTS)
    if f.overload or f.value_info or f.metadata_props:
        need = max(need, _IR_METADATA)
    return max([need, *(_value_info_ir(v) for v in f.value_info), *(_node_ir(n) for n in f.node)])


def min_ir_version(model: onnx.ModelProto) -> int:
    """The lowest IR version that ``model``'s opsets and content need (custom domains need nothing).

    Walks the graph, its subgraphs and the model-local functions for the features newer IR versions
    introduced (onnx.proto's Version notes): functions, function attribute defaults, metadata_props
    below the model, overloads, newer tensor data types, training info, multi-device configuration.
    """
    return max(
        onnx.helper.find_min_ir_version_for(model.opset_import, ignore_unknown=True),
        _IR_TRAINING if model.training_info else 3,
        _IR_MULTI_DEVICE if len(getattr(model, "configuration", ())) else 3,
        _graph_ir(model.graph),
        *(_function_ir(f) for f in model.functions),
    )


def pin_ir_version(model: onnx.ModelProto) -> int:
    """Set ``model.ir_version`` to ``min_ir_version`` (in place) and return it; call it last, before saving.

    ``onnx.helper.make_model`` and the exporters stamp the newest IR version they know, so a model
    written with a new onnx package would be refused by an older runtime although nothing in it needs
    that version.
    """
    model.ir_version = min_ir_version(model)
    return model.ir_version
