"""Tuning tasks read from the model graph (``torch.export`` or an ONNX file), not a hand-written grid.

A compiler-driven tuner tunes what the model runs: every op that has a template, with the dtype,
heads, head dims, mask features, length bucket and length distribution of its call, identical calls
merged with a count. Two routes give the same list:

- ``torch.export`` of a preset (or of a ``module:factory`` of your own) on example inputs with a
  dynamic row dimension. In training mode the joint forward/backward graph is built, so the
  ``hstu::attention_bwd`` nodes are read from the graph itself (a layer whose inputs need no grad
  has none); if the joint graph cannot be built, each forward node implies its backward (the op's
  registered autograd formula calls ``hstu::attention_bwd`` with the same arguments).
- An ONNX file written by ``models.export``: ``hstu.JaggedAttention`` nodes carry the call's
  arguments and kernel key as attributes; an inference graph has no backward, so each node implies
  its backward unless ``training=False``.

The projection ``silu(x W^T + b)`` maps to the ``gemm_silu`` template, whose tasks are keyed by the
attention layer that owns it (``kernel_templates.gemm_silu.tuning``: N = 4 H Dqk, K = H Dv); a ``silu(linear)`` of
other shapes (the task heads' MLPs) has no such key and is reported as a note.

Buckets: ``max_seq_len`` is an ``int`` argument of the op, so an exported graph holds it as a constant
N and dispatch looks up ``bucket_for(N)`` for every batch: one bucket per node. The dynamic row range
is reported (and checked against N); a lengths file supplies the length distribution (and batch size)
where the graph does not fix it, and is checked against N.

Lengths of the jagged tasks: a lengths file's, else the model's data config's (a preset's length law, or a
factory's ``lengths``), else the tuner's synthetic jagged law. Representative batches are drawn from them.
"""

from __future__ import annotations

import importlib
import inspect
import json
import operator
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.runtime.buckets import DISTRIBUTIONS, bucket_for
from autotune.runtime.graph import (  # noqa: F401 - re-exported: the tuner's graph API  # noqa: E402
    BWD,
    FWD,
    GraphOp,
    GraphTaskError,
    attention_op,
    dtype_name,
    innermost_module_with,
    mask_name,
    module_hint,
    schema_args,
    value_of,
    walk_nodes,
)
from autotune.runtime.lengths import MAX_LENGTH, LengthsError, LengthsFile, check_length, compact
from autotune.tuning.tasks import Task

GEMM = "gemm_silu"
DEFAULT_BATCH = 32  # the CLI's representative batch when neither the graph nor a lengths file gives one


@dataclass
class GraphTask:
    """A tuning task and the graph nodes that map to it."""

    task: Task
    count: int = 0
    nodes: list[str] = field(default_factory=list)


@dataclass
class GraphOps:
    """What a graph holds: the templated calls, a description of the source, notes for the reader."""

    source: str
    ops: list[GraphOp]
    notes: list[str] = field(default_factory=list)
    rows: tuple[int, int] | None = None  # range of the dynamic row dimension, when known
    lengths: tuple[int, ...] | None = None  # the model data config's length sample, when the source has one


# Ops that only cut, reshape or cast a tensor: a projection's output reaches its attention call through these.
_FX_PASS = {"split", "split_with_sizes", "chunk", "slice", "narrow", "view", "reshape", "_unsafe_view", "unflatten",
            "_to_copy", "to", "contiguous", "clone", "alias", "getitem", "select", "permute", "transpose", "expand",
            "unsqueeze", "squeeze", "detach", "type_as", "unbind"}  # fmt: skip
_ONNX_PASS = {"Split", "Slice", "Reshape", "Cast", "Identity", "Transpose", "Unsqueeze", "Squeeze", "Flatten"}


def _fx_op_name(node: Any) -> str:
    """``split`` of ``aten.split.Tensor``, ``getitem`` of ``operator.getitem``."""
    return (getattr(node.target, "__name__", None) or str(node.target)).split(".")[0]


def _feeds_attention_qkv(start: Any, users: Any, passes: Any, is_qkv_use: Any) -> bool:
    """Whether ``start``'s value reaches an attention call's q, k or v through cut/reshape/cast ops only (a
    silu(linear) of the same shape elsewhere, say a task head's MLP, is no uvqk projection)."""
    todo, seen = [start], set()
    while todo:
        node = todo.pop()
        for user in users(node):
            if is_qkv_use(user, node):
                return True
            key = id(user)
            if key not in seen and passes(user):
                seen.add(key)
                todo.append(user)
    return False


def _gemm_silu_calls(nodes: list[Any]) -> list[tuple[str, int, int, int, bool]]:
    """(node, N, K, index, feeds) of every ``silu(linear(x, W, b))`` with a 2-D x and weight; ``feeds``: its
    output reaches an attention call's q, k or v."""
    import torch

    attn = torch.ops.hstu.attention_fwd.default

    def is_qkv_use(user: Any, node: Any) -> bool:
        return user.op == "call_function" and user.target == attn and node in user.args[:3]

    def passes(user: Any) -> bool:
        return user.op == "call_function" and _fx_op_name(user) in _FX_PASS

    out = []
    for i, node in enumerate(nodes):
        if node.op != "call_function" or node.target not in (torch.ops.aten.silu.default, torch.ops.aten.silu_.default):
            continue
        src = node.args[0]
        if getattr(src, "target", None) is not torch.ops.aten.linear.default or len(src.args) < 3:
            continue
        x, w = value_of(src.args[0]), value_of(src.args[1])
        if x is None or w is None or x.dim() != 2 or w.dim() != 2 or src.args[2] is None:
            continue
        feeds = _feeds_attention_qkv(node, lambda n: list(n.users), passes, is_qkv_use)
        out.append((node.name, int(w.shape[0]), int(w.shape[1]), i, feeds))
    return out


def match_gemm_silu(
    calls: Iterable[tuple[str, int, int, int, bool]], attention: list[tuple[int, GraphOp]]
) -> tuple[list[GraphOp], list[str]]:
    """gemm_silu ops of the projections that feed an attention layer (N = 4 H Dqk, K = H Dv).

    Each takes the key of the first matching attention call after it in graph order (its own layer);
    the rest are reported: ``gemm_silu`` tasks have no key for other shapes.
    """
    ops, unmatched = [], []
    for name, n, k, index, feeds in calls:  # a call that feeds no attention's q, k or v: another layer's shape
        owners = [(i, a) for i, a in attention if feeds and 4 * a.num_heads * a.dqk == n and a.num_heads * a.dv == k]
        after = [a for i, a in owners if i > index]
        owner = after[0] if after else owners[0][1] if owners else None
        if owner is None:
            unmatched.append(f"{name} ({k}->{n})")
            continue
        ops.append(
            GraphOp(
                GEMM,
                name,
                owner.dtype,
                owner.dqk,
                owner.dv,
                owner.num_heads,
                owner.max_seq_len,
                "causal",
                owner.distribution,
                owner.batch,
            )
        )
    notes = []
    if unmatched:
        why = "not a uvqk projection of an attention layer"
        notes.append(f"silu(linear) without a gemm_silu key ({why}): {', '.join(unmatched)}")
    return ops, notes


def _rows_range(ep: Any) -> tuple[int, int] | None:
    """(min, max) of the first dynamic dimension's range, when the program has one."""
    for vr in ep.range_constraints.values():
        lo, hi = vr.lower, vr.upper
        try:
            return int(lo), int(hi)
        except (TypeError, ValueError):  # unbounded (int_oo)
            return int(lo), -1
    return None


def loss_module(module: Any) -> Any:
    """``module`` with its outputs reduced to one scalar: the loss the joint graph differentiates."""
    import torch

    class LossOf(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor]:
            out = self.inner(*args)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            return (sum(o.float().sum() for o in outs if o.is_floating_point()),)

    return LossOf(module)


def _backward_ops(ep: Any, fwd: list[GraphOp]) -> tuple[list[GraphOp], str | None]:
    """hstu::attention_bwd calls of the joint forward/backward graph, or None and why not.

    Backward nodes carry no module stack, so each takes its distribution hint from the forward call
    with the same inputs and arguments (joint forward calls are in the order of the forward program's).
    """
    import torch

    try:
        from torch.export.experimental import _export_forward_backward

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree deprecations
            joint = _export_forward_backward(ep)
    except Exception as e:  # noqa: BLE001 - a private API; any failure means "imply it"
        return [], f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    nodes = [n for n in joint.graph.nodes if n.op == "call_function"]
    jf = [n for n in nodes if n.target == torch.ops.hstu.attention_fwd.default]
    if len(jf) != len(fwd):
        return [], f"the joint graph has {len(jf)} forward attention calls, the forward graph {len(fwd)}"
    hint: dict[tuple, str | None] = {}
    for jf_node, f in zip(jf, fwd, strict=True):
        hint.setdefault(_call_key(schema_args(jf_node)), f.distribution)
    ops = []
    for n in nodes:
        if n.target == torch.ops.hstu.attention_bwd.default:
            args = schema_args(n)
            ops.append(attention_op(BWD, n.name, args, hint.get(_call_key(args))))
    return ops, None


def _call_key(args: dict[str, Any]) -> tuple:
    """What a forward call and its backward share: the input nodes and the mask/scale arguments."""
    names = (
        "q",
        "k",
        "v",
        "seq_offsets",
        "num_targets",
        "max_seq_len",
        "alpha",
        "contextual_seq_len",
        "max_attn_len",
        "scaling_seqlen",
    )
    return tuple(args[n] for n in names)


def ops_from_program(module: Any, args: tuple, dynamic_shapes: Any, training: bool, source: str) -> GraphOps:
    """Templated calls of ``torch.export`` of ``module`` on ``args`` (and of its joint graph when training)."""
    import torch

    import autotune.runtime.ops  # noqa: F401 - the hstu ops must be registered before tracing

    root = loss_module(module)
    root.train(training)
    if isinstance(dynamic_shapes, dict):  # by parameter name -> positional, as the wrapper's *args take them
        names = list(inspect.signature(module.forward).parameters)
        dynamic_shapes = tuple(dynamic_shapes.get(n) for n in names[: len(args)])
    wrapped = None if dynamic_shapes is None else (tuple(dynamic_shapes),)
    try:
        ep = torch.export.export(root, tuple(args), dynamic_shapes=wrapped)
    except Exception as e:  # noqa: BLE001 - any tracing failure is the given model's: say which and why
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        fused = any(getattr(getattr(m, "cfg", None), "layer", None) == "fused" for m in root.modules())
        hint = (
            "; its layers run the fused layer (layer='fused'), whose autograd functions launch kernels that "
            "torch.export cannot trace: build it with layer='unfused' (the same parameters and function); "
            "`autotune run --kernel layer` tunes the fused layer's other kernels"
            if fused
            else ""
        )
        raise GraphTaskError(f"{source}: torch.export could not trace the model ({why}){hint}") from None
    graph = walk_nodes(ep.graph_module)
    fwd, attention = [], []
    for i, n in enumerate(graph):
        if n.op == "call_function" and n.target == torch.ops.hstu.attention_fwd.default:
            op = attention_op(FWD, n.name, schema_args(n), module_hint(n, root))
            fwd.append(op)
            attention.append((i, op))
    gemm, notes = match_gemm_silu(_gemm_silu_calls(graph), attention)
    bwd: list[GraphOp] = []
    if training and fwd:
        bwd, why = _backward_ops(ep, fwd)
        if why is not None:
            bwd = implied_backward(fwd)
            notes.append(f"backward calls implied by the forward ones (joint graph not built: {why})")
        else:
            notes.append("backward calls read from the joint forward/backward graph")
    if not fwd:
        notes.append("no hstu::attention_fwd call in the graph (model built with kernels='reference'?)")
    return GraphOps(source, fwd + bwd + gemm, notes, _rows_range(ep))


def implied_backward(fwd: Iterable[GraphOp]) -> list[GraphOp]:
    """The backward call each forward call's autograd formula makes (same shapes and arguments)."""
    return [
        GraphOp(
            BWD,
            f"{f.node} (autograd)",
            f.dtype,
            f.dqk,
            f.dv,
            f.num_heads,
            f.max_seq_len,
            f.mask,
            f.distribution,
            f.batch,
        )
        for f in fwd
        if f.kernel == FWD
    ]


def resolve_model(spec: str, dtype: str, training: bool) -> tuple[Any, tuple, Any, str, list[int] | None]:
    """(module, example args, dynamic shapes, description, length sample) of a preset name or
    ``module:factory``.

    A factory takes no arguments and returns ``(module, args)`` or ``(module, args, dynamic_shapes)``
    (an object with those attributes, and optionally ``lengths``, a sample of its sequence lengths, works
    too); the module is exported as it is given. A preset's sample is drawn from its data config's length
    law (``models.data.length_sample``); full-length presets have none.
    """
    from models.config import PRESETS

    if spec in PRESETS:
        from models.config import get_config
        from models.export import task_spec

        s = task_spec(spec, dtype=dtype, training=training)
        sample = config_length_sample(get_config(spec).to_dict())
        return s.module, s.args, s.dynamic_shapes, f"torch.export of preset {spec!r} ({dtype}, fake weights)", sample
    if ":" not in spec:
        raise GraphTaskError(f"--from-model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor module:factory")
    mod_name, _, attr = spec.partition(":")
    try:
        factory: Callable[[], Any] = getattr(importlib.import_module(mod_name), attr)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - a missing module or name, an empty name, a failing import
        why = str(e) if isinstance(e, (ImportError, AttributeError)) else f"{type(e).__name__}: {e}"
        raise GraphTaskError(f"--from-model {spec!r}: cannot import it ({why})") from None
    try:
        made = factory()
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's factory (a sys.exit too): the input's fault
        raise GraphTaskError(f"--from-model {spec!r}: the factory raised {type(e).__name__}: {e}") from None
    module, args, dyn, sample = _factory_result(spec, made)
    return module, args, dyn, f"torch.export of {spec}", sample


def _factory_result(spec: str, made: Any) -> tuple[Any, tuple, Any, list[int] | None]:
    """(module, args, dynamic shapes, length sample) of what a factory returned, each checked: an object
    without ``.args``, args or dynamic shapes that are no sequence were an AttributeError / TypeError traceback."""
    from torch import nn

    if hasattr(made, "module"):
        sample = getattr(made, "lengths", None)
        parts = (made.module, getattr(made, "args", None), getattr(made, "dynamic_shapes", None))
        sample = _factory_lengths(spec, sample) if sample is not None else None
    elif isinstance(made, (tuple, list)) and len(made) in (2, 3):
        parts, sample = (made[0], made[1], made[2] if len(made) == 3 else None), None
    else:
        got = f"a {type(made).__name__} of {len(made)}" if isinstance(made, (tuple, list)) else type(made).__name__
        raise GraphTaskError(
            f"--from-model {spec!r}: the factory must return (module, args[, dynamic_shapes]) or an object with "
            f".module and .args, got {got}"
        )
    module, args, dyn = parts
    if not isinstance(module, nn.Module):
        raise GraphTaskError(
            f"--from-model {spec!r}: its module must be a torch.nn.Module, got {type(module).__name__}"
        )
    if not isinstance(args, (tuple, list)):
        raise GraphTaskError(f"--from-model {spec!r}: its args must be a tuple of inputs, got {type(args).__name__}")
    if dyn is not None and not isinstance(dyn, (dict, tuple, list)):
        raise GraphTaskError(
            f"--from-model {spec!r}: its dynamic_shapes must be a dict, tuple or None, got {type(dyn).__name__}"
        )
    return module, tuple(args), dyn, sample


def _factory_lengths(spec: str, raw: Any) -> list[int]:
    """A factory's ``lengths`` as ints, by a lengths file's rules (integers 0..MAX_LENGTH; NumPy's and
    one-element integer tensors' taken): ``int()`` of each raised a traceback on a scalar or inf and truncated
    floats, and negative or huge lengths were kept."""
    try:
        values = list(raw)
    except TypeError:
        raise GraphTaskError(
            f"--from-model {spec!r}: its lengths must be a list of sequence lengths, got {type(raw).__name__}"
        ) from None
    out = []
    for n in values:
        try:
            length = None if isinstance(n, bool) else operator.index(n)  # NumPy ints and integer tensors as int
        except TypeError:
            length = None
        if not _is_length(length):
            raise GraphTaskError(
                f"--from-model {spec!r}: its lengths hold {n!r:.40}, not an integer length in 0..{MAX_LENGTH}"
            )
        out.append(length)
    if not any(out):  # dropped unsaid, it left the tasks on every synthetic law
        raise GraphTaskError(f"--from-model {spec!r}: its lengths hold no non-zero length")
    return out


def config_length_sample(config: dict[str, Any]) -> list[int] | None:
    """The length sample of a model data config (``models.data.length_sample``); None for full lengths
    or a dict that is not a ``models.config.ModelConfig``."""
    from models.config import ModelConfig
    from models.data import length_sample

    try:
        cfg = ModelConfig().replace(**config)
    except (TypeError, ValueError):
        return None
    return None if cfg.length_dist == "full" else length_sample(cfg)


MODEL_SAMPLE_NOTE = "jagged tasks draw their batches from the model's length sample"


def _sample_stats(sample: list[int]) -> str:
    return f"{len(sample)} lengths, mean {sum(sample) / len(sample):.0f}, max {max(sample)}"


def _with_lengths(graph: GraphOps, sample: list[int] | None) -> GraphOps:
    """``graph`` with the model's length sample attached (and said in its notes)."""
    if sample is not None and any(sample):
        graph.lengths = compact(sample)
        graph.notes.append(f"{MODEL_SAMPLE_NOTE} ({_sample_stats(sample)}); --lengths FILE replaces it")
    return graph


def note_lengths_file(graph: GraphOps, lengths: LengthsFile, path: str, tasks: list[GraphTask]) -> None:
    """Say in ``graph``'s notes that ``--lengths`` replaces the model's sample (the model's note stayed and told
    the reader the file was not used), or, when no task draws from it, why: every attention call declares its
    distribution (dispatch keys on that hint, so tasks of the file's law would never serve these calls)."""
    graph.notes[:] = [n for n in graph.notes if not n.startswith(MODEL_SAMPLE_NOTE)]
    if not any(gt.task.sample for gt in tasks):
        hints = sorted({op.distribution for op in graph.ops if op.kernel in (FWD, BWD) and op.distribution})
        if not hints:  # no hint to drop: the file's batches are uniform, and so are its tasks
            graph.notes.append(
                f"--lengths {path} is not used: every batch of it is of one length, so its tasks are 'uniform' ones, "
                "which draw no lengths"
            )
            return
        graph.notes.append(
            f"--lengths {path} is not used: the attention calls declare distribution {', '.join(map(repr, hints))}; "
            "dispatch keys on a call's hint, so tasks of the file's lengths would not serve these calls (build the "
            "model without it to use the file: attention_hint='auto' and lengths other than full in models.config, "
            "distribution=None in HSTUAttention)"
        )
        return
    graph.notes.append(f"jagged tasks draw their batches from --lengths {path} ({_sample_stats(lengths.sample)})")


def ops_from_model(spec: str, dtype: str = "bfloat16", training: bool = True) -> GraphOps:
    """Templated calls of a preset or ``module:factory`` (see ``resolve_model``), with its length sample."""
    module, args, dyn, source, sample = resolve_model(spec, dtype, training)
    return _with_lengths(ops_from_program(module, args, dyn, training, source), sample)


# --------------------------------------------------------------------------------------------------
# ONNX route
# --------------------------------------------------------------------------------------------------
def _onnx_shapes(model: Any) -> dict[str, tuple[int, list[int | str | None]]]:
    """value name -> (elem type, dims) for every typed value of the main graph."""
    g = model.graph
    out = {}
    for v in [*g.input, *g.output, *g.value_info]:
        t = v.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in t.shape.dim]
        out[v.name] = (t.elem_type, dims)
    for init in g.initializer:
        out[init.name] = (init.data_type, list(init.dims))
    return out


def _onnx_gemm_silu_calls(model: Any, shapes: dict) -> list[tuple[str, int, int, int, bool]]:
    """(node, N, K, index, feeds) of ``Mul(a, Sigmoid(a))`` with ``a = Gemm(x, W, b)`` or ``Add(MatMul(x, W), b)``;
    ``feeds``: its output reaches a JaggedAttention node's q, k or v."""
    from autotune.runtime.onnx_hstu import DOMAIN, NAME

    nodes = list(model.graph.node)
    producer = {o: (i, n) for i, n in enumerate(nodes) for o in n.output}
    consumers: dict[str, list[Any]] = {}
    for n in nodes:
        for name in n.input:
            consumers.setdefault(name, []).append(n)

    def users(value: Any) -> list[Any]:  # a value is a tensor name or a node (its outputs)
        names = [value] if isinstance(value, str) else list(value.output)
        return [u for name in names for u in consumers.get(name, [])]

    def is_qkv_use(user: Any, value: Any) -> bool:
        names = {value} if isinstance(value, str) else set(value.output)
        return user.domain == DOMAIN and user.op_type == NAME and bool(names & set(user.input[:3]))

    def passes(user: Any) -> bool:
        return user.domain in ("", "ai.onnx") and user.op_type in _ONNX_PASS

    out = []
    for i, n in enumerate(nodes):
        if n.op_type != "Mul" or n.domain not in ("", "ai.onnx") or len(n.input) != 2:
            continue
        for a, s in (n.input, n.input[::-1]):
            sig = producer.get(s, (None, None))[1]
            if sig is None or sig.op_type != "Sigmoid" or sig.input[0] != a:
                continue
            src = producer.get(a, (None, None))[1]
            nk = _onnx_linear_dims(src, producer, shapes)
            if nk is not None:
                feeds = _feeds_attention_qkv(n.output[0], users, passes, is_qkv_use)
                out.append((n.output[0], nk[0], nk[1], i, feeds))
            break
    return out


def _onnx_linear_dims(src: Any, producer: dict, shapes: dict) -> tuple[int, int] | None:
    """(N, K) of a biased linear layer node (Gemm, or Add of a MatMul), else None."""
    import onnx

    if src is None:
        return None
    if src.op_type == "Gemm" and len(src.input) == 3:
        trans_b = next((onnx.helper.get_attribute_value(a) for a in src.attribute if a.name == "transB"), 0)
        w = shapes.get(src.input[1], (None, []))[1]
        if len(w) == 2 and all(isinstance(d, int) for d in w):
            return (w[0], w[1]) if trans_b else (w[1], w[0])
    if src.op_type == "Add":
        for mm_name in src.input:
            mm = producer.get(mm_name, (None, None))[1]
            if mm is not None and mm.op_type == "MatMul":
                w = shapes.get(mm.input[1], (None, []))[1]
                if len(w) == 2 and all(isinstance(d, int) for d in w):
                    return w[1], w[0]
    return None


def ops_from_onnx(path: str | Path, training: bool = True) -> GraphOps:
    """Templated calls of an ONNX file (``hstu.JaggedAttention`` nodes, silu(linear) projections)."""
    import onnx

    from autotune.runtime.onnx_hstu import DOMAIN, DOMAIN_VERSION, NAME, node_attributes

    path = Path(path)
    if not path.is_file():
        raise GraphTaskError(f"--from-onnx {path}: {'is a directory' if path.is_dir() else 'no such file'}")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # noqa: BLE001 - protobuf raises several types for a bad file
        raise GraphTaskError(f"--from-onnx {path}: not a readable ONNX model ({e})") from None
    if not model.ir_version or not model.HasField("graph") or not model.opset_import:
        # An empty file, or another protobuf (a TensorProto's dims parse as an IR version): 0 tasks, rc 0 before.
        raise GraphTaskError(
            f"--from-onnx {path}: not an ONNX model (no IR version, graph or opset import; empty or another format)"
        )
    version = {o.domain: o.version for o in model.opset_import}.get(DOMAIN)
    if version != DOMAIN_VERSION and any(n.domain == DOMAIN for n in model.graph.node):
        raise GraphTaskError(
            f"--from-onnx {path}: its {DOMAIN} nodes are of opset version {version or 'none'}; this reader knows "
            f"{DOMAIN} version {DOMAIN_VERSION} (models.export)"
        )
    shapes = _onnx_shapes(model)
    missing = [n.input[0] for n in model.graph.node if n.domain == DOMAIN and n.input and n.input[0] not in shapes]
    if missing:
        model = onnx.shape_inference.infer_shapes(model)
        shapes = _onnx_shapes(model)
    fwd, attention = [], []
    for i, n in enumerate(model.graph.node):
        if n.domain != DOMAIN or n.op_type != NAME:
            continue
        try:
            op = _onnx_attention_op(n, node_attributes(n), shapes)
        except GraphTaskError as e:  # which node, and of which file
            raise GraphTaskError(f"--from-onnx {path}: {e}") from None
        fwd.append(op)
        attention.append((i, op))
    gemm, notes = match_gemm_silu(_onnx_gemm_silu_calls(model, shapes), attention)
    bwd = implied_backward(fwd) if training else []
    if bwd:
        notes.append("backward calls implied by the forward nodes (an ONNX graph is inference only)")
    if not fwd:
        notes.append(f"no {DOMAIN}.{NAME} node in {path.name} (not written by models.export?)")
    graph = GraphOps(f"ONNX file {path.name}", fwd + bwd + gemm, notes, None)
    meta = {p.key: p.value for p in model.metadata_props}
    return _with_lengths(graph, _onnx_length_sample(meta, path))


def _onnx_length_sample(meta: dict[str, str], path: Path) -> list[int] | None:
    """The model's length sample: the one the file carries (``hstu.lengths``), else drawn from its data
    config; a config whose lengths file cannot be read here is an error, not a silent synthetic law."""
    if "hstu.lengths" in meta:
        try:
            sample = json.loads(meta["hstu.lengths"])
        except json.JSONDecodeError:
            sample = None
        if not isinstance(sample, list) or not all(_is_length(n) for n in sample):  # a lengths file's rules
            raise GraphTaskError(
                f"--from-onnx {path}: its hstu.lengths metadata is not a list of lengths (integers 0..{MAX_LENGTH})"
            )
        if not any(sample):  # dropped unsaid, it left the tasks on every synthetic law
            raise GraphTaskError(f"--from-onnx {path}: its hstu.lengths metadata holds no non-zero length")
        return sample
    try:
        config = json.loads(meta["hstu.config"]) if "hstu.config" in meta else None
    except json.JSONDecodeError:
        config = None
    if not isinstance(config, dict):
        return None
    if config.get("length_dist") == "file":
        from models.config import ModelConfig

        try:
            ModelConfig().replace(**config)
        except (TypeError, ValueError) as e:
            raise GraphTaskError(
                f"--from-onnx {path}: the model draws its lengths from {config.get('lengths_file')!r}, which "
                f"cannot be read here ({e}); pass --lengths FILE or re-export (the file then carries them)"
            ) from None
    return config_length_sample(config)


def _is_length(n: Any) -> bool:
    """A sequence length as a lengths file holds one (``lengths.check_length``: an int, no bool, in 0..MAX_LENGTH)."""
    try:
        check_length(n, "")
    except LengthsError:
        return False
    return True


_ONNX_DTYPES = {1: "float32", 10: "float16", 16: "bfloat16"}
# Integer attributes every hstu.JaggedAttention node carries (``onnx_hstu``), with their smallest value.
_ONNX_INT_ATTRS = {"max_seq_len": 1, "contextual_seq_len": 0, "max_attn_len": 0}


def _onnx_attention_op(node: Any, attrs: dict[str, Any], shapes: dict) -> GraphOp:
    """A GraphOp of one ``hstu.JaggedAttention`` node; ``GraphTaskError`` naming the node for a malformed one
    (a KeyError / IndexError traceback before)."""
    name = node.output[0] if node.output else (node.name or f"{node.domain}.{node.op_type}")
    if len(node.input) < 4 or not node.output:
        what = f"{node.domain}.{node.op_type}"
        raise GraphTaskError(f"{name}: a {what} node takes q, k, v, seq_offsets and has an output")
    for attr, low in _ONNX_INT_ATTRS.items():
        value = attrs.get(attr)
        if attr not in attrs:
            raise GraphTaskError(f"{name}: the {node.domain}.{node.op_type} node has no attribute {attr}")
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise GraphTaskError(f"{name}: attribute {attr} must be an integer >= {low}, got {value!r:.60}")
    q, k, v, off = (shapes.get(node.input[i]) for i in range(4))
    if q is None or v is None or len(q[1]) != 3 or len(v[1]) != 3:
        raise GraphTaskError(f"{name}: the shapes of q/v are unknown; run onnx shape inference on the file first")
    for what, dim in (("q's heads", q[1][1]), ("q's head dim", q[1][2]), ("v's head dim", v[1][2])):
        if not isinstance(dim, int) or dim < 1:  # a symbolic 'H' was an int() traceback, 0 an unnamed task error
            raise GraphTaskError(f"{name}: {what} must be a fixed positive size, got {dim!r}")
    # A k of other dims (or a v of other heads) was a task of q's shape; the function body would not run.
    for what, dim, want in (("k's heads", k and k[1][1:2], q[1][1]), ("k's head dim", k and k[1][2:], q[1][2]),
                            ("v's heads", v[1][1:2], q[1][1])):  # fmt: skip
        if dim and isinstance(dim[0], int) and dim[0] != want:
            raise GraphTaskError(f"{name}: {what} {dim[0]} differ{'s' * what.endswith('dim')} from q's {want}")
    if off is not None and off[1] and isinstance(off[1][0], int) and off[1][0] < 2:
        raise GraphTaskError(f"{name}: seq_offsets holds {off[1][0]} entries; a batch of B takes B + 1 >= 2")
    dtype = attrs.get("kernel_dtype") or _ONNX_DTYPES.get(q[0])
    if dtype is None:
        raise GraphTaskError(f"{name}: unsupported element type {q[0]} and no kernel_dtype attribute")
    batch = off[1][0] - 1 if off is not None and off[1] and isinstance(off[1][0], int) else None
    mask = mask_name(int(attrs["contextual_seq_len"]), bool(attrs.get("has_targets", 0)), int(attrs["max_attn_len"]))
    dist = attrs.get("distribution") or None
    return GraphOp(FWD, name, dtype, q[1][2], v[1][2], int(q[1][1]), int(attrs["max_seq_len"]), mask, dist, batch)


# --------------------------------------------------------------------------------------------------
# ops -> tasks
# --------------------------------------------------------------------------------------------------
def build_tasks(
    graph: GraphOps,
    gpu: str,
    lengths: LengthsFile | None = None,
    seq_cap: int | None = None,
    default_batch: int = DEFAULT_BATCH,
    seed: int = 0,
) -> list[GraphTask]:
    """Tasks of the ops, identical ones merged (with counts and node names), in the CLI's order.

    Distribution: the call's hint, else the lengths file's ("uniform" when its batches are), else "jagged"
    drawn from the graph's length sample (a model that leaves its batches to dispatch's fill match), else every
    synthetic law (``DISTRIBUTIONS``). Batch: the graph's, else the lengths file's largest batch, else
    ``default_batch``. The jagged attention tasks draw their batches from the file's lengths, else from
    the graph's (``GraphOps.lengths``), else from the synthetic jagged law.
    """
    merged: dict[Task, GraphTask] = {}
    longest = max(lengths.sample) if lengths else 0
    sample = compact(lengths.sample) if lengths else graph.lengths
    for op in graph.ops:
        if lengths and longest > op.max_seq_len:
            raise GraphTaskError(
                f"the lengths file has a sequence of {longest} tokens, above max_seq_len {op.max_seq_len} of {op.node}"
            )
        if op.distribution:
            dists: tuple[str, ...] = (op.distribution,)
        elif lengths:
            dists = ("uniform" if lengths.uniform else "jagged",)
        elif sample:  # the model's own length law: its tasks are what dispatch matches its batches' fill to
            dists = ("jagged",)
        else:
            dists = DISTRIBUTIONS
        batch = op.batch or (lengths.batch if lengths and lengths.batch else default_batch)
        for dist in dists:
            drawn = sample if dist == "jagged" and op.kernel in (FWD, BWD) else None
            try:
                task = Task(
                    op.kernel,
                    gpu,
                    op.dtype,
                    op.dqk,
                    op.dv,
                    op.num_heads,
                    bucket_for(op.max_seq_len),
                    dist,
                    op.mask,
                    batch,
                    seq_cap,
                    seed,
                    drawn,
                )
            except ValueError as e:  # a node's distribution, dtype, heads or batch no task takes: say which node
                raise GraphTaskError(f"{op.node} ({graph.source}): {e}") from None
            entry = merged.setdefault(task, GraphTask(task))
            entry.count += 1
            entry.nodes.append(op.node)
    order = {FWD: 0, BWD: 1, GEMM: 2}
    return sorted(merged.values(), key=lambda g: (order.get(g.task.kernel, 3), g.task.family, g.task.bucket))


def tasks_to_json(graph: GraphOps, tasks: list[GraphTask]) -> dict[str, Any]:
    """A JSON-able record of the extraction (for ``autotune tasks --json``)."""
    return {
        "source": graph.source,
        "rows": list(graph.rows) if graph.rows else None,
        "notes": graph.notes,
        "tasks": [{**t.task.to_dict(), "count": t.count, "nodes": t.nodes} for t in tasks],
    }
