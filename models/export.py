"""ONNX export of the HSTU ranking model, checked against PyTorch, with the tuned kernel per node.

    python -m models.export --preset tiny --out model.onnx
    python -m models.export --preset seed --out seed.onnx --gpu h100      # record the H100 tuned configs

The graph takes the jagged batch as values plus offsets: ``items`` and ``prev_actions`` (L,) int64,
``seq_offsets`` (B+1,) int64 (positions are computed from the offsets), with the row count L dynamic
(``rows``) and B fixed by the preset (empty sequences are allowed, so fewer sequences fit too); it
returns ``logits`` (L, num_tasks). Opset 18, exported by ``torch.onnx`` (dynamo) in eval mode; the file's
IR version is the lowest its content needs (``onnx_hstu.pin_ir_version``), so older runtimes load it.

Each HSTU attention call is one ``hstu.JaggedAttention`` node (``autotune.runtime.onnx_hstu``): a model-local
function of standard operators defines it, so ONNX Runtime runs the file as is, and its attributes
record the call's kernel key (kernel dtype, bucket, distribution, mask) and the configs a runtime with
the kernels should launch: the exact tuned entry of ``--gpu``'s artifacts (for a call without a distribution
hint, which dispatch matches by each batch's fill, the entry it runs for the model's mean batch), else the heuristic
defaults for ``--kernel-dtype`` on a GPU (``config_source`` says which). The model metadata holds the preset config
and where the configs came from.

Checked export: ``onnx.checker`` (full check) on the written file, then ONNX Runtime on CPU against
the PyTorch model with the same weights (the PyTorch oracle kernels) on small jagged batches;
tolerance ``TOLERANCE`` (fp32 export: |ort - torch| <= 1e-4 + 1e-4 |torch|). The function body
is O(H L^2) in memory, which is why the check uses batches of a few hundred rows.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .config import PRESETS, ModelConfig, get_config, parse_overrides
from .data import JaggedBatch
from .hstu import HSTURankingModel

DEFAULT_OPSET = 18
INPUT_NAMES = ("items", "prev_actions", "seq_offsets")
OUTPUT_NAMES = ("logits",)
ROWS = "rows"
TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}  # fp32 ONNX Runtime vs PyTorch (observed: ~1e-6 on tiny)
_EXTERNAL_DATA_BYTES = 1_800_000_000  # protobuf's 2 GB limit, with room for the graph


class ExportError(ValueError):
    """A bad exporter input (preset, path, weights, artifacts); the message says what to fix."""


def positions_from_offsets(seq_offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """Position of each row inside its sequence, from the offsets alone (O(L * B), no host sync)."""
    r = torch.arange(rows, device=seq_offsets.device)
    seq = (seq_offsets[1:].unsqueeze(0) <= r.unsqueeze(1)).sum(1)
    return r - seq_offsets[seq]


class JaggedModule(nn.Module):
    """The ranking model on (items, prev_actions, seq_offsets): the exported signature.

    ``autocast`` runs the model under CPU autocast, as training runs it under CUDA autocast, so a
    traced graph carries the kernels' real dtype.
    """

    def __init__(self, model: HSTURankingModel, autocast: torch.dtype | None = None) -> None:
        super().__init__()
        self.model = model
        self.autocast = autocast

    def forward(self, items: torch.Tensor, prev_actions: torch.Tensor, seq_offsets: torch.Tensor) -> torch.Tensor:
        positions = positions_from_offsets(seq_offsets, items.shape[0])
        batch = JaggedBatch(items, prev_actions, positions, None, seq_offsets, [])  # type: ignore[arg-type]
        if self.autocast is None:
            return self.model(batch)
        with torch.autocast("cpu", dtype=self.autocast):
            return self.model(batch)


@dataclass
class ExportSpec:
    """What ``torch.export`` needs: the module, example arguments and their dynamic shapes."""

    module: nn.Module
    args: tuple[torch.Tensor, ...]
    dynamic_shapes: tuple[Any, ...]


def dynamic_shapes(cfg: ModelConfig) -> tuple[Any, ...]:
    """Rows dynamic in [1, batch * max_seq_len]; the offsets' length (B+1) static. ``ExportError`` naming the
    options when that range is one row (torch.export refuses a Dim with min == max by an AssertionError)."""
    if cfg.batch_size * cfg.max_seq_len < 2:
        raise ExportError(
            f"batch_size {cfg.batch_size} x max_seq_len {cfg.max_seq_len} is one row: the exported rows dimension "
            "needs at least 2 (set batch_size or max_seq_len >= 2)"
        )
    rows = torch.export.Dim(ROWS, min=1, max=cfg.batch_size * cfg.max_seq_len)
    return ({0: rows}, {0: rows}, None)


def resolve_config(preset: str, overrides: dict[str, Any] | None = None) -> ModelConfig:
    """The preset's config, or ``ExportError`` naming the known presets / the bad field."""
    if preset not in PRESETS:
        raise ExportError(f"unsupported preset {preset!r}; known presets: {', '.join(PRESETS)}")
    try:
        return get_config(preset, **(overrides or {}))
    except ValueError as e:
        raise ExportError(str(e)) from None


def _exported_layer(cfg: ModelConfig) -> tuple[ModelConfig, str | None]:
    """The config the graph is traced with: the unfused layer in the default precision, no CUDA graph.

    The fused layer, its bf16 precision, recompute and copies (``zero_copy=False``) are ways to train the same
    layer (same parameters, same function), built on autograd functions that launch kernels, which
    ``torch.export`` cannot trace; the exported graph holds the layer as standard ops around
    ``hstu.JaggedAttention``. ``cuda_graph`` replays training steps, not part of the function either. A note
    says so when it differs.
    """
    wanted = {"layer": "unfused", "precision": "autocast", "recompute": "none", "zero_copy": True, "du_silu": True,
              "cuda_graph": False}  # fmt: skip
    changed = {k: getattr(cfg, k) for k, v in wanted.items() if getattr(cfg, k) != v}
    if not changed:
        return cfg, None
    told = ", ".join(f"{k}={v}" for k, v in changed.items())
    return cfg.replace(**wanted), f"{told}: a training-time choice; exported through the unfused layer (same weights)"


def task_spec(preset: str, dtype: str = "bfloat16", training: bool = True) -> ExportSpec:
    """The preset model with fake weights (no memory, seconds even for seed) for task extraction.

    ``dtype`` is the autocast dtype training runs the kernels in (float32: no autocast).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = resolve_config(preset)
    cast = None if dtype == "float32" else getattr(torch, dtype)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = HSTURankingModel(cfg)
        rows = cfg.batch_size * cfg.max_seq_len
        args = (
            torch.zeros(rows, dtype=torch.int64),
            torch.zeros(rows, dtype=torch.int64),
            torch.zeros(cfg.batch_size + 1, dtype=torch.int64),
        )
    module = JaggedModule(model, cast)
    module.train(training)
    return ExportSpec(module, args, dynamic_shapes(cfg))


def small_jagged_batch(cfg: ModelConfig, seed: int, max_rows: int = 384, min_rows: int = 1) -> tuple[torch.Tensor, ...]:
    """(items, prev_actions, seq_offsets) of a jagged batch of ``min_rows`` to ``max_rows`` rows.

    B is the preset's; lengths are random in [0, cap] with one empty and one of length ``cap`` (the
    dense reference body is O(L^2), so seed-sized batches are cut to a few hundred rows). Empty sequences
    get one row each while the batch is below ``min_rows`` (the export's example needs 2: torch.export
    specialises a dimension of size 1 to a constant), as far as B x max_seq_len allows.
    """
    rng = np.random.default_rng(seed)
    b = cfg.batch_size
    cap = max(1, min(cfg.max_seq_len, 2 * max_rows // b))
    lengths = rng.integers(0, cap + 1, size=b)
    lengths[rng.integers(b)] = cap
    if b > 1:
        lengths[(int(np.argmax(lengths)) + 1) % b] = 0
    while lengths.sum() > max_rows:
        lengths[int(np.argmax(lengths))] //= 2
    for i in np.flatnonzero(lengths == 0):
        if lengths.sum() >= min_rows:
            break
        lengths[i] = 1
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    rows = int(offsets[-1])
    items = rng.integers(0, cfg.num_items, size=rows)
    actions = rng.integers(0, cfg.num_actions, size=rows)
    return tuple(torch.from_numpy(np.asarray(x, dtype=np.int64)) for x in (items, actions, offsets))


@dataclass
class ExportResult:
    """What was written: path, size, node counts, the kernel recorded for each hstu node, notes."""

    path: Path
    size_bytes: int
    nodes: int
    function_nodes: int
    opset: int
    kernels: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)


def _artifacts(gpu: str | None, root: Path | None, notes: list[str]) -> dict[str, Any]:
    """Usable fwd/bwd artifacts of ``gpu`` under ``root`` (keyed by kernel); reasons go to ``notes``."""
    if gpu is None:
        return {}
    from autotune.runtime.artifacts import DEFAULT_ROOT, assess_artifact
    from autotune.runtime.gpus import GPUS

    if gpu not in GPUS:
        raise ExportError(f"--gpu {gpu!r}: not a known GPU; one of {sorted(GPUS)}")

    root = Path(root) if root is not None else DEFAULT_ROOT
    if not root.is_dir():
        raise ExportError(f"--artifacts {root}: no such directory")
    found = {}
    for kind in ("hstu_attention_fwd", "hstu_attention_bwd"):
        path = root / gpu / f"{kind}.json"
        if not path.is_file():
            notes.append(f"{kind}: no artifact {path}; configs from the trace-time dispatch")
            continue
        verdict = assess_artifact(path, gpu, None)  # recorded for the target GPU, not the exporting machine
        if verdict.usable:
            found[kind] = (verdict.artifact, path)
        else:
            notes.append(f"{kind}: artifact not used ({verdict.reason}); configs from the trace-time dispatch")
    return found


def batch_fill(cfg: ModelConfig) -> float | None:
    """The fill L / (B x max_seq_len) dispatch computes for the model's mean batch (its data config's length law)."""
    from autotune.runtime import dispatch

    from .data import length_sample

    sample = length_sample(cfg)
    rows = round(cfg.batch_size * sum(sample) / len(sample))
    return dispatch.call_fill(rows, cfg.batch_size, min(cfg.max_seq_len, rows))


def kernel_records(
    ep: Any,
    root: nn.Module,
    kernel_dtype: str,
    gpu: str | None,
    artifacts_root: Path | None,
    notes: list[str],
    fill: float | None = None,
) -> list[dict[str, Any]]:
    """The kernel-key and config attributes of each hstu::attention_fwd call, in graph order: the tuned entries
    of ``gpu``'s artifacts, else the heuristic defaults for ``kernel_dtype`` on a GPU (never the configs this
    process traced with, which are for the trace's fp32 and, on a CPU, the Triton interpreter's small tiles).
    A call without a distribution hint records the entries dispatch runs for a batch of ``fill`` (the model's),
    not the bucket's uniform entry, which it runs only for full batches."""
    from autotune.runtime import dispatch
    from autotune.runtime.buckets import bucket_for
    from autotune.runtime.graph import FWD, attention_op, module_hint, schema_args, walk_nodes

    arts = _artifacts(gpu, artifacts_root, notes)
    records = []
    by_fill = False
    for n in walk_nodes(ep.graph_module):
        if n.op != "call_function" or n.target != torch.ops.hstu.attention_fwd.default:
            continue
        args = schema_args(n)
        op = attention_op(FWD, n.name, args, module_hint(n, root))
        key = (kernel_dtype, op.dqk, op.dv, bucket_for(op.max_seq_len), op.distribution, op.num_heads, op.mask)
        rec = {
            "fx_node": n.name,
            "kernel_dtype": kernel_dtype,
            "bucket": key[3],
            "distribution": op.distribution or "",
            "mask": op.mask,
            "max_seq_len": op.max_seq_len,
        }
        entries = {k: a.lookup(*key) for k, (a, _) in arts.items()}
        if op.distribution is None and fill is not None and all(entries.values()):
            entries = {k: dispatch.entry_for_fill(arts[k][0].entries, e, fill) for k, e in entries.items()}
            by_fill = True
        if len(arts) == 2 and all(entries.values()):
            fwd, bwd = entries["hstu_attention_fwd"], entries["hstu_attention_bwd"]
            rec.update(
                backend=fwd["backend"],
                config=json.dumps(fwd["config"], sort_keys=True),
                bwd_backend=bwd["backend"],
                bwd_config=json.dumps(bwd["config"], sort_keys=True),
                config_source=f"tuned:{gpu}",
            )
        else:
            rec.update(**_default_record(kernel_dtype, op), config_source="default")
            if arts:
                notes.append(f"{n.name}: no tuned entry for {key}; recorded the default configs")
        records.append(rec)
    if by_fill and len(arts) == 2:
        notes.append(
            f"nodes without a distribution hint: dispatch matches each batch by its fill; recorded the entries it "
            f"runs for the model's mean batch (fill {fill:.3g})"
        )
    return records


def _default_record(kernel_dtype: str, op: Any) -> dict[str, str]:
    """The forward and backward heuristic defaults a GPU runs for this call without artifacts."""
    from autotune.runtime import dispatch
    from autotune.runtime.graph import BWD, FWD

    rec = {}
    for kind, prefix in ((FWD, ""), (BWD, "bwd_")):
        choice = dispatch.preferred_default(kind, op.dqk, op.dv, kernel_dtype, op.num_heads)
        rec[f"{prefix}backend"], rec[f"{prefix}config"] = choice.backend, choice.config
    return rec


def _annotate(proto: Any, records: list[dict[str, Any]], cfg: ModelConfig, preset: str, gpu: str | None) -> None:
    """Fill the hstu nodes' kernel attributes, name the dynamic dim, attach functions and metadata."""
    from autotune.runtime.onnx_hstu import DOMAIN, attach_functions, set_attributes

    hstu = [n for n in proto.graph.node if n.domain == DOMAIN]
    if len(hstu) != len(records):
        raise RuntimeError(f"{len(hstu)} hstu nodes in the ONNX graph but {len(records)} attention calls traced")
    by_name = {r["fx_node"]: r for r in records}
    for i, node in enumerate(hstu):
        rec = by_name.get(node.output[0], records[i])  # the exporter names a single output after its fx node
        set_attributes(node, {k: v for k, v in rec.items() if k not in ("fx_node", "max_seq_len")})
    attach_functions(proto)
    symbols = {d.dim_param for v in proto.graph.input for d in v.type.tensor_type.shape.dim if d.dim_param}
    for v in [*proto.graph.input, *proto.graph.output, *proto.graph.value_info]:
        for d in v.type.tensor_type.shape.dim:
            if d.dim_param in symbols:
                d.dim_param = ROWS
    meta = {
        "hstu.preset": preset,
        "hstu.config": json.dumps(cfg.to_dict(), sort_keys=True),
        "hstu.kernels": json.dumps({"gpu": gpu, "nodes": records}, sort_keys=True),
        "hstu.inputs": "items, prev_actions: (rows,) int64; seq_offsets: (batch+1,) int64; rows dynamic",
    }
    if cfg.length_dist != "full":  # the sample itself: a lengths file need not travel with the ONNX file
        from autotune.runtime.lengths import compact

        from .data import length_sample

        meta["hstu.lengths"] = json.dumps(list(compact(length_sample(cfg))))
    for k, v in meta.items():
        proto.metadata_props.add(key=k, value=v)


def export_onnx(
    preset: str,
    out: str | Path,
    *,
    overrides: dict[str, Any] | None = None,
    weights: str | Path | None = None,
    kernel_dtype: str = "bfloat16",
    gpu: str | None = None,
    artifacts_root: str | Path | None = None,
    opset: int = DEFAULT_OPSET,
) -> tuple[ExportResult, nn.Module, ModelConfig]:
    """Export ``preset`` to ``out`` and run the full ``onnx.checker``; returns (result, module, config)."""
    from autotune.runtime.onnx_hstu import pin_ir_version, translation_table

    cfg, layer_note = _exported_layer(resolve_config(preset, overrides))
    gpu = gpu.lower() if gpu else gpu
    out = Path(out)
    if out.is_dir() or not out.parent.is_dir():
        raise ExportError(f"--out {out}: must be a file path in an existing directory")
    if opset != DEFAULT_OPSET:
        raise ExportError(f"--opset {opset}: the hstu function body is written for opset {DEFAULT_OPSET}, the only one")
    torch.manual_seed(cfg.seed)
    model = HSTURankingModel(cfg).eval()
    if weights is not None:
        if not Path(weights).is_file():
            raise ExportError(f"--weights {weights}: no such file")
        try:
            model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
        except Exception as e:  # noqa: BLE001 - unpickling and key/shape mismatches all mean "not these weights"
            # load_state_dict's first line is a header ("Error(s) in loading state_dict for ...:"): the first
            # reason under it names the tensor and its shapes (or the missing / unexpected keys)
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            why = (lines[1] if len(lines) > 1 and lines[0].endswith(":") else lines[0]) if lines else type(e).__name__
            why = why if len(why) <= 300 else why[:297] + "..."  # a whole model's unexpected keys in one line
            raise ExportError(f"--weights {weights}: not a state_dict of this model ({why})") from None
        bad = [n for n, t in model.state_dict().items() if t.is_floating_point() and not bool(t.isfinite().all())]
        if bad:  # the file would compute NaN for every input, and its check against PyTorch compares NaN with NaN
            raise ExportError(f"--weights {weights}: {', '.join(bad)} hold NaN or infinite values (a diverged run?)")
    module = JaggedModule(model).eval()
    notes: list[str] = [layer_note] if layer_note else []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.export's own pytree deprecations
        example = small_jagged_batch(cfg, seed=0, min_rows=2)
        ep = torch.export.export(module, example, dynamic_shapes=dynamic_shapes(cfg))
        arts_root = artifacts_root and Path(artifacts_root)
        records = kernel_records(ep, module, kernel_dtype, gpu, arts_root, notes, batch_fill(cfg) if gpu else None)
        program = torch.onnx.export(
            ep,
            (),
            None,
            opset_version=opset,
            dynamo=True,
            verbose=False,
            custom_translation_table=translation_table(),
            input_names=list(INPUT_NAMES),
            output_names=list(OUTPUT_NAMES),
        )
    proto = program.model_proto
    _annotate(proto, records, cfg, preset, gpu)
    pin_ir_version(proto)
    _save_checked(proto, out)
    func_nodes = sum(len(f.node) for f in proto.functions)
    result = ExportResult(out, out.stat().st_size, len(proto.graph.node), func_nodes, opset, records, notes)
    return result, module, cfg


def _save_checked(proto: Any, out: Path) -> None:
    """Write ``proto`` to ``out`` only once the full ``onnx.checker`` passed on the written bytes: a temporary
    file beside ``out`` is checked, then renamed over it, so an interrupted or failing export leaves no
    unchecked file at ``out`` and an earlier file there intact. A model past protobuf's limit keeps its
    weights in ``<out>.data``, which the file names (so the data file is written under its final name)."""
    import onnx

    from autotune.runtime.artifacts import write_atomically

    large = proto.ByteSize() > _EXTERNAL_DATA_BYTES

    def write(tmp: str) -> None:
        onnx.save_model(proto, tmp, save_as_external_data=large, location=out.name + ".data" if large else None)
        onnx.checker.check_model(tmp, full_check=True)

    write_atomically(out, write)


def compare_with_torch(path: str | Path, module: JaggedModule, cfg: ModelConfig, batches: int = 3) -> list[dict]:
    """ONNX Runtime (CPU) vs PyTorch on ``batches`` small jagged batches: one row per batch.

    PyTorch runs the same weights with the oracle attention (``kernels="reference"``), which runs
    anywhere; the exported module itself runs Triton kernels, so it is compared too where they can
    run (a copy on the GPU, or on the CPU under ``TRITON_INTERPRET=1``): column ``err_exported``
    (informational: on a GPU the fp32 kernels' dots may run in TF32).
    """
    import os

    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    oracle = JaggedModule(HSTURankingModel(cfg.replace(kernels="reference"))).eval()
    oracle.model.load_state_dict(module.model.state_dict())
    # Triton runs on CUDA tensors, or on CPU ones under the interpreter; elsewhere the column is empty.
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    device = "cpu" if interpret else "cuda" if torch.cuda.is_available() else None
    kernels = copy.deepcopy(module).to(device) if device and cfg.kernels != "reference" else None
    rows = []
    for i in range(batches):
        args = small_jagged_batch(cfg, seed=100 + i)
        got = session.run(None, dict(zip(INPUT_NAMES, (a.numpy() for a in args), strict=True)))[0]
        with torch.no_grad():
            want = oracle(*args).numpy()
            exported = None if kernels is None else kernels(*(a.to(device) for a in args)).cpu().numpy()
        err = np.abs(got - want)
        lengths = np.diff(args[2].numpy())
        rows.append(
            {
                "batch": i,
                "rows": int(args[0].shape[0]),
                "lengths": f"{int(lengths.min())}..{int(lengths.max())}",
                "max_abs_err": float(err.max(initial=0.0)),
                "max_abs_ref": float(np.abs(want).max(initial=0.0)),
                "ok": bool(np.all(err <= TOLERANCE["atol"] + TOLERANCE["rtol"] * np.abs(want))),
                "err_exported": None if exported is None else float(np.abs(got - exported).max(initial=0.0)),
            }
        )
    return rows


def _parse_overrides(items: list[str]) -> dict[str, Any]:
    try:
        return parse_overrides(items)
    except ValueError as e:
        raise ExportError(f"--set: {e}") from None


def main(argv: list[str] | None = None) -> int:
    """CLI: export, check with onnx.checker and ONNX Runtime, print the summary and error table."""
    p = argparse.ArgumentParser(prog="python -m models.export", description="Export the HSTU model to ONNX.")
    p.add_argument("--preset", required=True, help=f"one of {', '.join(PRESETS)}")
    p.add_argument("--out", required=True, help="output .onnx path")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override (one per --set; repeatable)"
    )
    p.add_argument("--weights", help="state_dict (torch.save) to load; default: the seeded initialisation")
    p.add_argument("--gpu", help="record the tuned configs of this GPU's artifacts (e.g. h100)")
    p.add_argument("--artifacts", help="artifacts root (default: the packaged artifacts)")
    p.add_argument(
        "--kernel-dtype",
        default="bfloat16",
        choices=("bfloat16", "float16", "float32"),
        help="dtype the recorded kernel configs are for (training runs bf16; default)",
    )
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET)
    p.add_argument("--check-batches", type=int, default=3, help="ONNX Runtime vs PyTorch batches (0: skip)")
    p.add_argument("--json", help="write the summary and error table here")
    args = p.parse_args(argv)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # "torchvision is not installed" etc.
    from .train import writable_file_path, write_json

    try:
        if args.json and not writable_file_path(Path(args.json)):  # checked before the export, not after it
            why = "a directory, not a file path" if Path(args.json).is_dir() else "not a writable file path"
            raise ExportError(f"--json {args.json}: {why}")
        out_files = {Path(args.out).resolve(), Path(args.out + ".data").resolve()}  # the model and its weights
        if args.json and Path(args.json).resolve() in out_files:  # else the summary replaced the checked model
            raise ExportError(f"--json {args.json}: the file --out {args.out} writes; name another file")
        written = out_files | ({Path(args.json).resolve()} if args.json else set())
        if args.weights and Path(args.weights).resolve() in written:  # else the weights it read were overwritten
            raise ExportError(f"--weights {args.weights}: a file this export writes (--out or --json) would replace it")
        overrides = _parse_overrides(args.set)
        lengths_file = overrides.get("lengths_file")
        if lengths_file and Path(lengths_file).resolve() in written:  # else the lengths it read were overwritten
            raise ExportError(f"--set lengths_file={lengths_file}: a file this export writes (--out or --json) "
                              "would replace it")  # fmt: skip
        if args.check_batches < 0:
            raise ExportError(f"--check-batches {args.check_batches}: must be >= 0 (0 skips the check)")
        if args.artifacts is not None and args.gpu is None:  # else ignored: every node would record the defaults
            raise ExportError(f"--artifacts {args.artifacts}: the tuned configs of which GPU? pass --gpu too")
        result, module, cfg = export_onnx(
            args.preset,
            args.out,
            overrides=overrides,
            weights=args.weights,
            kernel_dtype=args.kernel_dtype,
            gpu=args.gpu,
            artifacts_root=args.artifacts,
            opset=args.opset,
        )
    except ExportError as e:
        print(f"models.export: error: {e}", file=sys.stderr)
        return 2
    if args.check_batches > 0:
        result.errors = compare_with_torch(result.path, module, cfg, args.check_batches)
    _print(result)
    if args.json:
        write_json(Path(args.json), _summary(result))
    return 0 if all(r["ok"] for r in result.errors) else 1


def _summary(result: ExportResult) -> dict[str, Any]:
    return {
        "path": str(result.path),
        "size_bytes": result.size_bytes,
        "nodes": result.nodes,
        "function_nodes": result.function_nodes,
        "opset": result.opset,
        "kernels": result.kernels,
        "notes": result.notes,
        "tolerance": TOLERANCE,
        "errors": result.errors,
    }


def _print(result: ExportResult) -> None:
    print(
        f"wrote {result.path}: {result.size_bytes / 1e6:.2f} MB, {result.nodes} nodes (opset {result.opset}), "
        f"{len(result.kernels)} hstu.JaggedAttention nodes ({result.function_nodes} nodes in their function); "
        "onnx.checker full check passed"
    )
    for k in result.kernels:
        print(
            f"  {k['fx_node']}: {k['kernel_dtype']} bucket {k['bucket']} {k['distribution'] or 'by fill'} {k['mask']}: "
            f"{k['backend']} {k['config']} | bwd {k['bwd_backend']} {k['bwd_config']} ({k['config_source']})"
        )
    for note in result.notes:
        print(f"  note: {note}")
    if result.errors:
        tol = f"|ort - torch| <= {TOLERANCE['atol']:g} + {TOLERANCE['rtol']:g} |torch|"
        print(f"ONNX Runtime (CPU) vs PyTorch, tolerance {tol}:")
        print("  batch  rows  lengths   max|err|     max|torch|   ok   vs exported module")
        for r in result.errors:
            exp = "-" if r["err_exported"] is None else f"{r['err_exported']:.2e}"
            print(
                f"  {r['batch']:5d} {r['rows']:5d}  {r['lengths']:8s} {r['max_abs_err']:.2e}     "
                f"{r['max_abs_ref']:.2e}     {'yes' if r['ok'] else 'NO'}  {exp}"
            )


if __name__ == "__main__":
    sys.exit(main())
