"""Reading HSTU op calls out of an exported graph: what the ONNX export and the tuner's graph tasks share.

``walk_nodes`` lists a program's call nodes (nested graph modules included), ``schema_args`` binds a
custom-op node's arguments by name, ``attention_op`` turns an ``hstu::attention_*`` call into a
``GraphOp`` (the kernel key of that call), ``module_hint`` / ``innermost_module_with`` find the model
module a node came from (for the length-distribution hint and the export's source lookup).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FWD, BWD = "hstu_attention_fwd", "hstu_attention_bwd"


class GraphTaskError(ValueError):
    """The model, file or lengths cannot give tasks; the message says why and what to pass."""


@dataclass(frozen=True)
class GraphOp:
    """One templated op call found in a graph, with everything its tuning key needs."""

    kernel: str
    node: str
    dtype: str
    dqk: int
    dv: int
    num_heads: int
    max_seq_len: int
    mask: str = "causal"
    distribution: str | None = None
    batch: int | None = None


def mask_name(contextual_seq_len: int, has_targets: bool, max_attn_len: int) -> str:
    """The artifact mask key of a call (the same rule as ``autotune.runtime.dispatch.mask_of``)."""
    if max_attn_len > 0:
        return "window"
    if contextual_seq_len > 0:
        return "context+targets" if has_targets else "context"
    return "targets" if has_targets else "causal"


def dtype_name(dtype: Any) -> str:
    """'torch.bfloat16' / torch.bfloat16 -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------------------------------
# torch.export route
# --------------------------------------------------------------------------------------------------
def schema_args(node: Any) -> dict[str, Any]:
    """The call's arguments by schema name (positional and keyword, defaults filled)."""
    schema = node.target._schema
    out = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    out.update({a.name: v for a, v in zip(schema.arguments, node.args, strict=False)})
    out.update(node.kwargs)
    return out


def value_of(x: Any) -> Any:
    """The example value (FakeTensor / int) of an fx argument."""
    return x.meta.get("val") if hasattr(x, "meta") else x


def _static(dim: Any) -> int | None:
    return dim if isinstance(dim, int) else None


def attention_op(kernel: str, name: str, args: dict[str, Any], distribution: str | None) -> GraphOp:
    """A GraphOp of an ``hstu::attention_fwd/bwd`` call from its named arguments."""
    q, v, offsets = value_of(args["q"]), value_of(args["v"]), value_of(args["seq_offsets"])
    max_seq_len = value_of(args["max_seq_len"])
    if not isinstance(max_seq_len, int):
        raise GraphTaskError(f"{name}: max_seq_len is not a constant ({max_seq_len!r}); cannot pick a bucket")
    n_off = _static(offsets.shape[0])
    return GraphOp(
        kernel,
        name,
        dtype_name(q.dtype),
        int(q.shape[2]),
        int(v.shape[2]),
        int(q.shape[1]),
        max_seq_len,
        mask_name(int(args["contextual_seq_len"]), args["num_targets"] is not None, int(args["max_attn_len"])),
        distribution,
        None if n_off is None else n_off - 1,
    )


def module_hint(node: Any, root: Any) -> str | None:
    """The length-distribution hint of the module that made the call (``HSTUAttention.distribution``).

    The hint is the artifact key dispatch will look up, so the task must carry it; it lives on the
    module, not in the op's arguments, hence the nn_module_stack walk.
    """
    module = innermost_module_with(node, root, "distribution")
    return None if module is None else module.distribution


def innermost_module_with(node: Any, root: Any, attr: str) -> Any:
    """The innermost module on an exported node's ``nn_module_stack`` that has ``attr``, or None."""
    for path, _type in reversed(list(node.meta.get("nn_module_stack", {}).values())):
        try:
            module = root.get_submodule(path)
        except (AttributeError, TypeError):
            continue
        if hasattr(module, attr):
            return module
    return None


def walk_nodes(gm: Any) -> list[Any]:
    """The nodes of a graph module in execution order, with higher-order-op subgraphs (an autocast
    region is one ``wrap_with_autocast`` call of a submodule) expanded where they are used."""
    import torch

    out = []
    for node in gm.graph.nodes:
        sub = getattr(gm, node.target, None) if node.op == "get_attr" and isinstance(node.target, str) else None
        if isinstance(sub, torch.fx.GraphModule):
            out.extend(walk_nodes(sub))
        else:
            out.append(node)
    return out
