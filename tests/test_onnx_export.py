"""ONNX export of the HSTU model: the hstu.JaggedAttention node and its function body, the full checker in a
fresh process, ONNX Runtime against PyTorch, tuned configs recorded per node, tasks read back from the
file, and clear errors for bad exporter input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from autotune.runtime import artifacts as art
from autotune.runtime import onnx_hstu
from autotune.tuning import graph_tasks as gt
from kernel_templates.hstu_attention.config import default_bwd_config, default_fwd_config
from kernel_templates.hstu_attention.reference import hstu_attention_reference
from models import export

FWD, BWD = "hstu_attention_fwd", "hstu_attention_bwd"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny preset exported once: (path, result, module, config)."""
    path = tmp_path_factory.mktemp("onnx") / "tiny.onnx"
    result, module, cfg = export.export_onnx("tiny", path)
    return path, result, module, cfg


def test_exported_file_structure_and_checker_in_a_fresh_process(tiny):
    path, result, _, _ = tiny
    model = onnx.load(str(path))
    assert {o.domain: o.version for o in model.opset_import} == {"": 18, "hstu": 1}
    hstu = [n for n in model.graph.node if n.domain == "hstu"]
    assert [n.op_type for n in hstu] == ["JaggedAttention"] * 2 and result.nodes == len(model.graph.node)
    (func,) = model.functions
    assert (func.domain, func.name) == ("hstu", "JaggedAttention") and {n.domain for n in func.node} == {""}
    assert [i.name for i in model.graph.input] == ["items", "prev_actions", "seq_offsets"]
    assert [d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim] == ["rows"]
    assert [d.dim_value for d in model.graph.input[2].type.tensor_type.shape.dim] == [5]  # tiny: batch 4
    attrs = onnx_hstu.node_attributes(hstu[0])
    # tiny's jagged batches declare no distribution (dispatch matches each by its fill): recorded empty
    assert (attrs["kernel_dtype"], attrs["bucket"], attrs["distribution"], attrs["mask"]) == (
        "bfloat16",
        256,
        "",
        "causal",
    )
    assert attrs["max_seq_len"] == 32 and attrs["has_targets"] == 0 and attrs["config_source"] == "default"
    assert json.loads(attrs["config"]) and json.loads(attrs["bwd_config"])
    meta = {p.key: p.value for p in model.metadata_props}
    assert json.loads(meta["hstu.config"])["num_layers"] == 2 and len(json.loads(meta["hstu.kernels"])["nodes"]) == 2
    # No hstu schema is registered in a fresh process: the checker and ORT see the model-local function only.
    code = """
import sys, numpy as np, onnx, onnxruntime as ort
p = sys.argv[1]
onnx.checker.check_model(p, full_check=True)
s = ort.InferenceSession(p, providers=["CPUExecutionProvider"])
feeds = {"items": np.arange(9), "prev_actions": np.zeros(9, np.int64), "seq_offsets": np.array([0, 4, 4, 9, 9])}
print(s.run(None, feeds)[0].shape)
"""
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "(9, 2)"


def test_onnx_runtime_matches_pytorch(tiny):
    path, _, module, cfg = tiny
    rows = export.compare_with_torch(path, module, cfg, batches=3)
    assert len({r["rows"] for r in rows}) > 1  # dynamic rows: several batch sizes through one file
    for r in rows:
        assert r["ok"] and r["max_abs_err"] < 1e-5, r
        assert r["err_exported"] is not None and r["err_exported"] < 1e-5, r  # Triton (interpreter) model too


@pytest.mark.interpreter
def test_a_model_trained_with_the_fused_layer_exports_as_the_same_function(tmp_path):
    """layer="fused" (with bf16 precision and recompute) is a way to train the same layer: it exports through the
    unfused layer with a note, and ONNX Runtime matches the fused-layer PyTorch model with the same weights."""
    from models.hstu import HSTURankingModel

    over = {"layer": "fused", "precision": "bf16", "recompute": "uvqk"}
    result, module, cfg = export.export_onnx("tiny", tmp_path / "f.onnx", overrides=over)
    assert (cfg.layer, cfg.precision, cfg.recompute) == ("unfused", "autocast", "none")
    assert any("layer=fused" in n and "unfused layer" in n for n in result.notes), result.notes
    fused = HSTURankingModel(export.resolve_config("tiny", over)).eval()
    fused.load_state_dict(module.model.state_dict())
    session = ort.InferenceSession(str(tmp_path / "f.onnx"), providers=["CPUExecutionProvider"])
    args = export.small_jagged_batch(cfg, seed=3)
    got = session.run(None, dict(zip(export.INPUT_NAMES, (a.numpy() for a in args), strict=True)))[0]
    with torch.no_grad():
        want = export.JaggedModule(fused).eval()(*args).float().numpy()
    assert got.shape == want.shape and np.abs(got - want).max() <= 1e-4 + 1e-4 * np.abs(want).max()


def test_every_valid_training_config_exports_through_the_cli(tmp_path, capsys):
    """zero_copy=False and cuda_graph=True raised a ValueError traceback: the traced config kept zero_copy=False
    with the unfused layer, and the oracle (kernels='reference') kept cuda_graph=True, both invalid configs. Every
    valid combination of the training-time options now gives a traced config and an oracle config; the
    CLI exports the combination that failed."""
    import itertools

    from models.config import LAYER_IMPLS, PRECISIONS, RECOMPUTE

    flags = ((True, False),) * 3  # zero_copy, cuda_graph, du_silu (a fused-layer-only False, as zero_copy's)
    combos = itertools.product(LAYER_IMPLS, PRECISIONS, RECOMPUTE, *flags, ("default", "tuned"))
    valid = 0
    for layer, precision, recompute, zero_copy, cuda_graph, du_silu, kernels in combos:
        over = dict(layer=layer, precision=precision, recompute=recompute, zero_copy=zero_copy, cuda_graph=cuda_graph,
                    du_silu=du_silu)  # fmt: skip
        try:
            cfg = export.resolve_config("tiny", {**over, "kernels": kernels})
        except export.ExportError:
            continue
        valid += 1
        traced, _ = export._exported_layer(cfg)
        assert traced.replace(kernels="reference").layer == "unfused"  # the oracle compare_with_torch builds
    assert valid > 20
    sets = ["layer=fused", "zero_copy=false", "cuda_graph=true"]
    argv = ["--preset", "tiny", "--out", str(tmp_path / "m.onnx"), "--check-batches", "1"]
    assert export.main([*argv, *(a for s in sets for a in ("--set", s))]) == 0
    out = capsys.readouterr().out
    assert "zero_copy=False, cuda_graph=True" in out and (tmp_path / "m.onnx").is_file()


def test_an_unwritable_json_path_is_refused_before_the_export(tmp_path, capsys):
    """--json under a regular file was written only after the whole export, and failed there with a traceback."""
    (tmp_path / "file").write_text("")
    argv = ["--preset", "tiny", "--out", str(tmp_path / "m.onnx"), "--json", str(tmp_path / "file" / "r.json")]
    assert export.main(argv) == 2
    err = capsys.readouterr().err
    assert "models.export: error: --json" in err and "not a writable file path" in err
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.parametrize("json_name", ["m.onnx", "m.onnx.data", "./sub/../m.onnx"])
def test_a_json_path_onto_the_exported_files_is_refused(tmp_path, capsys, monkeypatch, json_name):
    """``--json`` naming the ``--out`` file (or its external-data file) wrote the summary over the checked model
    after "onnx.checker full check passed", exit 0: the ONNX file was gone without a word."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    argv = ["--preset", "tiny", "--out", "m.onnx", "--json", json_name, "--check-batches", "0"]
    assert export.main(argv) == 2
    err = capsys.readouterr().err
    assert "models.export: error: --json" in err and "--out" in err, err
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.parametrize("argv", [["--out", "w.pt"], ["--out", "m.onnx", "--json", "w.pt"]])
def test_an_output_onto_the_weights_file_is_refused(tmp_path, capsys, monkeypatch, argv):
    """``--out`` or ``--json`` naming the ``--weights`` file wrote the model or the summary over the trained weights
    it had just read: they were lost, exit 0."""
    from models.config import get_config
    from models.hstu import HSTURankingModel

    monkeypatch.chdir(tmp_path)
    torch.save(HSTURankingModel(get_config("tiny")).state_dict(), "w.pt")
    before = (tmp_path / "w.pt").read_bytes()
    assert export.main(["--preset", "tiny", "--weights", "w.pt", "--check-batches", "0", *argv]) == 2
    assert "models.export: error: --weights" in capsys.readouterr().err
    assert (tmp_path / "w.pt").read_bytes() == before


@pytest.mark.parametrize("argv", [["--out", "lengths.json"], ["--out", "m.onnx", "--json", "lengths.json"]])
def test_an_output_onto_the_lengths_file_is_refused(tmp_path, capsys, monkeypatch, argv):
    """``--out`` or ``--json`` naming the ``--set lengths_file`` the model's batches draw from wrote the ONNX model or
    the summary over the user's lengths it had just read (exit 0): refused, naming the override, nothing written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lengths.json").write_text("[10, 20, 30]\n")
    sets = ["--set", "length_dist=file", "--set", "lengths_file=lengths.json"]
    assert export.main(["--preset", "tiny", *sets, "--check-batches", "0", *argv]) == 2
    assert "models.export: error: --set lengths_file=lengths.json" in capsys.readouterr().err
    assert (tmp_path / "lengths.json").read_text() == "[10, 20, 30]\n" and not (tmp_path / "m.onnx").exists()


def test_exported_model_carries_the_lowest_ir_version_its_content_needs(tiny):
    """The file's IR version is what its content needs, not the installed onnx package's newest.

    Opset 18 and model-local functions need IR 8; the exporter's metadata_props on nodes need IR 10
    (onnx.proto's Version notes). Nothing newer is used, so the file must say at most 10: a runtime of
    the IR-10 era (ONNX Runtime >= 1.17) loads it whatever onnx wrote it (a newer onnx stamped 14 and
    an ONNX Runtime of max IR 13 refused the file).
    """
    model = onnx.load(str(tiny[0]))
    metadata = any(n.metadata_props for n in model.graph.node) or any(v.metadata_props for v in model.graph.value_info)
    want = max(onnx.helper.find_min_ir_version_for(model.opset_import, ignore_unknown=True), 8, 10 if metadata else 8)
    assert model.functions and model.ir_version == want <= 10
    onnx.checker.check_model(model, full_check=True)


def _ir_case(feature: str) -> onnx.ModelProto:
    """An opset-13 Identity model (IR 7 by its opset) with one feature of a newer IR version added."""
    t = onnx.helper.make_tensor_value_info
    opset = 18 if feature == "opset18" else 13
    node = onnx.helper.make_node("Identity", ["x"], ["y"])
    graph = onnx.helper.make_graph([node], "g", [t("x", onnx.TensorProto.FLOAT, [2])], [t("y", 1, [2])])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
    func = onnx.helper.make_function("d", "F", ["a"], ["b"], [onnx.helper.make_node("Identity", ["a"], ["b"])], [])
    func.opset_import.append(onnx.helper.make_opsetid("", opset))
    if feature == "function_default":
        func.attribute_proto.append(onnx.helper.make_attribute("k", 1))
    if feature in ("function", "function_default"):
        model.functions.append(func)
    if feature == "node_metadata":
        model.graph.node[0].metadata_props.add(key="k", value="v")
    if feature == "int4_initializer":
        model.graph.initializer.append(onnx.helper.make_tensor("w", onnx.TensorProto.INT4, [2], [1, 2]))
    if feature == "float4_in_a_subgraph":
        inner = onnx.helper.make_graph([], "b", [], [t("z", onnx.TensorProto.FLOAT4E2M1, [2])])
        branch = onnx.helper.make_node("If", ["c"], ["z"], then_branch=inner, else_branch=inner)
        model.graph.node.append(branch)
    return model


@pytest.mark.parametrize(
    "feature, want",
    [
        ("none", 7),
        ("opset18", 8),
        ("function", 8),
        ("function_default", 9),
        ("node_metadata", 10),
        ("int4_initializer", 10),
        ("float4_in_a_subgraph", 11),
    ],
)
def test_pin_ir_version_takes_the_newest_feature_the_model_uses(feature, want):
    if feature == "float4_in_a_subgraph" and not hasattr(onnx.TensorProto, "FLOAT4E2M1"):
        pytest.skip("this onnx predates FLOAT4E2M1")
    model = _ir_case(feature)
    assert model.ir_version == onnx.IR_VERSION  # make_model stamps the newest
    assert onnx_hstu.pin_ir_version(model) == want and model.ir_version == want


def _single_node_model(dtype: int, attrs: dict) -> onnx.ModelProto:
    """A model of one hstu.JaggedAttention node, its function attached, pinned like an exported one."""
    t = lambda name, elem, shape: onnx.helper.make_tensor_value_info(name, elem, shape)  # noqa: E731
    inputs = [
        t("q", dtype, ["L", 2, 16]),
        t("k", dtype, ["L", 2, 16]),
        t("v", dtype, ["L", 2, 8]),
        t("seq_offsets", onnx.TensorProto.INT64, ["B1"]),
        t("num_targets", onnx.TensorProto.INT64, ["B"]),
    ]
    node = onnx.helper.make_node("JaggedAttention", [i.name for i in inputs], ["out"], domain="hstu")
    onnx_hstu.set_attributes(node, attrs)
    graph = onnx.helper.make_graph([node], "one", inputs, [t("out", dtype, ["L", 2, 8])])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])
    onnx_hstu.attach_functions(model)
    onnx_hstu.pin_ir_version(model)
    return model


@pytest.mark.parametrize(
    "ctx, targets, window, scaling",
    [(0, None, 0, None), (3, [2, 0, 1, 0], 0, None), (0, [1, 3, 0, 0], 0, 50), (2, None, 4, None), (0, None, 3, None)],
)
def test_function_body_matches_the_reference_for_every_mask(ctx, targets, window, scaling):
    """The standard-op body against the PyTorch oracle: context, targets, window, divisor, empty sequences."""
    gen = torch.Generator().manual_seed(ctx * 7 + window)
    offsets = torch.tensor([0, 9, 9, 30, 37])
    L = int(offsets[-1])
    q, k = (torch.randn(L, 2, 16, generator=gen) for _ in range(2))
    v = torch.randn(L, 2, 8, generator=gen)
    nt = None if targets is None else torch.tensor(targets)
    want = hstu_attention_reference(q, k, v, offsets, 40, 0.25, nt, ctx, window, scaling)
    attrs = {name: (0 if t == "INT" else 0.0 if t == "FLOAT" else "") for name, t, _ in onnx_hstu.ATTRIBUTES}
    attrs.update(
        max_seq_len=40,
        alpha=0.25,
        contextual_seq_len=ctx,
        max_attn_len=window,
        scaling_seqlen=-1 if scaling is None else scaling,
        has_targets=int(nt is not None),
    )
    model = _single_node_model(onnx.TensorProto.FLOAT, attrs)
    assert model.ir_version == 8  # opset 18 and a model-local function, nothing newer
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {
        "q": q.numpy(),
        "k": k.numpy(),
        "v": v.numpy(),
        "seq_offsets": offsets.numpy(),
        "num_targets": (nt if nt is not None else torch.zeros(4, dtype=torch.int64)).numpy(),
    }
    got = session.run(None, feeds)[0]
    np.testing.assert_allclose(got, want.numpy(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("max_seq_len, scaling", [(40, None), (65536, None), (40, 70000), (2**20, None)])
def test_a_float16_node_divides_by_a_divisor_past_float16s_range(max_seq_len, scaling):
    """The body cast the divisor S to q's type: in float16 one of 65520 and more was inf, and every output 0 with
    no error (the kernels divide in fp32). The fp16 node now matches the fp32 oracle within fp16 rounding."""
    gen = torch.Generator().manual_seed(5)
    offsets = torch.tensor([0, 9, 9, 30, 37])
    q, k = (torch.randn(37, 2, 16, generator=gen) for _ in range(2))
    v = torch.randn(37, 2, 8, generator=gen)
    want = hstu_attention_reference(q, k, v, offsets, max_seq_len, 0.25, None, 0, 0, scaling).numpy()
    attrs = {name: (0 if t == "INT" else 0.0 if t == "FLOAT" else "") for name, t, _ in onnx_hstu.ATTRIBUTES}
    attrs.update(max_seq_len=max_seq_len, alpha=0.25, scaling_seqlen=-1 if scaling is None else scaling)
    model = _single_node_model(onnx.TensorProto.FLOAT16, attrs)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"q": q.half().numpy(), "k": k.half().numpy(), "v": v.half().numpy(), "seq_offsets": offsets.numpy(),
             "num_targets": np.zeros(4, dtype=np.int64)}  # fmt: skip
    got = session.run(None, feeds)[0].astype(np.float32)
    assert np.abs(got - want).max() <= 5e-3 * np.abs(want).max(), (np.abs(got).max(), np.abs(want).max())


def test_tasks_from_the_onnx_file_equal_the_torch_export_tasks(tiny):
    path = tiny[0]
    from_onnx = gt.build_tasks(gt.ops_from_onnx(path), "h100")
    from_model = gt.build_tasks(gt.ops_from_model("tiny"), "h100")
    assert [(g.task, g.count) for g in from_onnx] == [(g.task, g.count) for g in from_model]
    assert len(from_onnx) == 3
    assert [g.task.kernel for g in gt.build_tasks(gt.ops_from_onnx(path, training=False), "h100")] == [FWD, "gemm_silu"]


def _write_artifacts(root: Path, entry_key: dict) -> dict[str, dict]:
    """Fresh (current template hash) fwd/bwd artifacts for h100 holding one Triton entry each."""
    configs = {FWD: default_fwd_config(32, 32).to_dict(), BWD: default_bwd_config(32, 32).to_dict()}
    configs[FWD]["block_m"] = 64
    env = {**dict.fromkeys(art.ENV_KEYS), "gpu_name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}
    for kind, config in configs.items():
        entry = {
            **entry_key,
            "backend": "triton",
            "config": config,
            "median_ms": 1.0,
            "spread_ms": 0.0,
            "tflops": 1.0,
            "default_ms": 1.1,
            "default_tflops": 0.9,
            "speedup": 1.1,
            "trials": 3,
            "tuning_s": 1.0,
        }
        hashes = {"triton": art.current_template_hash(kind, "triton")}
        art.save_artifact(art.Artifact(kind, "h100", env, hashes, "s" * 64, [entry]), root / "h100" / f"{kind}.json")
    return configs


def test_tuned_configs_are_recorded_per_node_through_the_cli(tmp_path, capsys):
    key = {
        "dtype": "bfloat16",
        "dqk": 32,
        "dv": 32,
        "num_heads": 2,
        "bucket": 256,
        "distribution": "jagged",
        "mask": "causal",
    }
    configs = _write_artifacts(tmp_path / "arts", key)
    out, report = tmp_path / "m.onnx", tmp_path / "report.json"
    argv = [
        "--preset",
        "tiny",
        "--out",
        str(out),
        "--gpu",
        "h100",
        "--artifacts",
        str(tmp_path / "arts"),
        "--check-batches",
        "1",
        "--json",
        str(report),
    ]
    assert export.main(argv) == 0
    text = capsys.readouterr().out
    assert "onnx.checker full check passed" in text and "ONNX Runtime (CPU) vs PyTorch" in text
    for node in (n for n in onnx.load(str(out)).graph.node if n.domain == "hstu"):
        attrs = onnx_hstu.node_attributes(node)
        assert attrs["config_source"] == "tuned:h100"
        assert json.loads(attrs["config"]) == configs[FWD] and json.loads(attrs["bwd_config"]) == configs[BWD]
    summary = json.loads(report.read_text())
    assert summary["errors"][0]["ok"] and summary["nodes"] > 0 and summary["size_bytes"] == out.stat().st_size


def test_a_node_without_a_hint_records_the_entries_dispatch_runs_for_the_models_fill(tmp_path):
    """tiny's jagged batches declare no distribution: dispatch runs each by its fill (about 0.56 for tiny). The
    record took the bucket's uniform entry (``lookup`` prefers it), which dispatch runs only for full batches."""
    key = {"dtype": "bfloat16", "dqk": 32, "dv": 32, "num_heads": 2, "bucket": 256, "mask": "causal"}
    uniform = _write_artifacts(tmp_path / "arts", {**key, "distribution": "uniform"})
    jagged = {}
    for kind in (FWD, BWD):
        path = tmp_path / "arts" / "h100" / f"{kind}.json"
        a = art.load_artifact(path)
        entry = dict(a.entries[0], distribution="jagged", fill=0.55, config=dict(a.entries[0]["config"], num_warps=2))
        a.upsert(entry)
        art.save_artifact(a, path)
        jagged[kind] = entry["config"]
    assert jagged[FWD] != uniform[FWD] and jagged[BWD] != uniform[BWD]
    out = tmp_path / "m.onnx"
    argv = ["--preset", "tiny", "--out", str(out), "--gpu", "h100", "--artifacts", str(tmp_path / "arts"),
            "--check-batches", "1"]  # fmt: skip
    assert export.main(argv) == 0
    nodes = [onnx_hstu.node_attributes(n) for n in onnx.load(str(out)).graph.node if n.domain == "hstu"]
    assert nodes
    for attrs in nodes:
        assert attrs["distribution"] == "" and attrs["config_source"] == "tuned:h100"
        assert json.loads(attrs["config"]) == jagged[FWD] and json.loads(attrs["bwd_config"]) == jagged[BWD]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--preset", "giant", "--out", "{tmp}/m.onnx"], "unsupported preset 'giant'"),
        (["--preset", "tiny", "--out", "{tmp}/missing/m.onnx"], "existing directory"),
        (["--preset", "tiny", "--out", "{tmp}"], "must be a file path"),
        (["--preset", "tiny", "--out", "{tmp}/m.onnx", "--weights", "{tmp}/none.pt"], "--weights"),
        (
            ["--preset", "tiny", "--out", "{tmp}/m.onnx", "--gpu", "h100", "--artifacts", "{tmp}/no"],
            "no such directory",
        ),
        (["--preset", "tiny", "--out", "{tmp}/m.onnx", "--set", "head_dim=48"], "hidden_dim"),
        (["--preset", "tiny", "--out", "{tmp}/m.onnx", "--opset", "20"], "written for opset 18"),
        (["--preset", "tiny", "--out", "{tmp}/m.onnx", "--gpu", "h999"], "--gpu 'h999': not a known GPU"),
        (["--preset", "tiny", "--out", "{tmp}/m.onnx", "--json", "{tmp}"], "--json"),
        (["--preset", "tiny", "--out", "{tmp}/m.onnx", "--check-batches", "-1"], "--check-batches -1: must be >= 0"),
        (["--preset", "tiny", "--out", "{tmp}/m.onnx", "--artifacts", "{tmp}"], "pass --gpu too"),
        (
            [
                "--preset",
                "tiny",
                "--out",
                "{tmp}/m.onnx",
                *("--set", "batch_size=1", "--set", "max_seq_len=1"),
                *("--set", "min_seq_len=1"),
            ],
            "batch_size 1 x max_seq_len 1 is one row",
        ),  # fmt: skip
    ],
)
def test_bad_exporter_input_is_a_clear_error(tmp_path, capsys, argv, message):
    rc = export.main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and "models.export: error:" in err and message in err
    assert not (tmp_path / "m.onnx").exists()


def test_the_file_carries_its_length_sample_wherever_it_is_read(tmp_path):
    """A model that draws lengths from a file: the ONNX file carries the sample, so tasks read elsewhere
    (the lengths file gone) still draw from it; a file without it whose lengths file is unreadable is an error."""
    lengths = tmp_path / "lens.txt"
    lengths.write_text("30 31 32 30\n2 3 4 32\n")
    path = tmp_path / "f.onnx"
    export.export_onnx("tiny", path, overrides={"length_dist": "file", "lengths_file": str(lengths)})
    lengths.unlink()
    graph = gt.ops_from_onnx(str(path))
    assert graph.lengths and max(graph.lengths) == 32 and min(graph.lengths) >= 4
    model = onnx.load(str(path))
    for p in [p for p in model.metadata_props if p.key == "hstu.lengths"]:
        model.metadata_props.remove(p)
    onnx.save(model, str(path))
    with pytest.raises(gt.GraphTaskError, match="cannot be read here"):
        gt.ops_from_onnx(str(path))


def test_recorded_configs_are_the_kernel_dtypes_gpu_defaults_without_the_interpreter(tmp_path, monkeypatch):
    """Without a GPU's artifacts each node records the heuristic defaults a GPU runs for ``--kernel-dtype`` (not
    the trace's fp32 configs or the interpreter's small tiles), and exporting needs no ``TRITON_INTERPRET``;
    ``--gpu`` is read in any case and ``--json`` goes into a new directory."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    report = tmp_path / "new" / "r.json"
    argv = ["--preset", "tiny", "--out", str(tmp_path / "m.onnx"), "--check-batches", "0", "--json", str(report)]
    assert export.main(argv) == 0
    for dtype in ("bfloat16", "float16"):
        result, _, cfg = export.export_onnx("tiny", tmp_path / f"{dtype}.onnx", kernel_dtype=dtype, gpu="H100",
                                            artifacts_root=tmp_path)  # fmt: skip
        want_f = default_fwd_config(cfg.head_dim, cfg.head_dim, False, dtype).to_dict()
        want_b = default_bwd_config(cfg.head_dim, cfg.head_dim, False, dtype).to_dict()
        for rec in result.kernels:
            assert (rec["kernel_dtype"], rec["config_source"]) == (dtype, "default")
            assert json.loads(rec["config"]) == want_f and json.loads(rec["bwd_config"]) == want_b
    assert json.loads(report.read_text())["kernels"][0]["config_source"] == "default"


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_int32_offsets_and_targets_export_and_run(index_dtype):
    """The call takes int32 offsets and targets; the node takes int64 ones, so the translation casts them (an
    int32 model exported before but ONNX Runtime could not load it)."""
    from autotune.runtime.ops import HSTUAttention

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = HSTUAttention(source="reference", contextual_seq_len=2, max_attn_len=3)

        def forward(self, q, k, v, off, nt):
            return self.a(q, k, v, off, 16, 0.25, nt)

    off = torch.tensor([0, 5, 12, 12], dtype=index_dtype)
    nt = torch.tensor([1, 2, 0], dtype=index_dtype)
    q, k, v = (torch.randn(12, 2, 32) for _ in range(3))
    m = M().eval()
    with torch.no_grad():
        want = m(q, k, v, off, nt)
    rows = torch.export.Dim("rows", min=1, max=64)
    ep = torch.export.export(m, (q, k, v, off, nt), dynamic_shapes=({0: rows}, {0: rows}, {0: rows}, None, None))
    prog = torch.onnx.export(ep, (), None, opset_version=18, dynamo=True,
                             custom_translation_table=onnx_hstu.translation_table())  # fmt: skip
    proto = prog.model_proto
    onnx_hstu.attach_functions(proto)
    onnx_hstu.pin_ir_version(proto)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {i.name: t.numpy() for i, t in zip(session.get_inputs(), (q, k, v, off, nt), strict=True)})
    np.testing.assert_allclose(got[0], want.numpy(), rtol=1e-4, atol=1e-5)


class _LnMulDropout(torch.nn.Module):
    """``fused_ln_mul_dropout`` with its own LayerNorm parameters (of ``param_dtype``) and dropout 0.5."""

    def __init__(self, param_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter((1 + 0.1 * torch.randn(16, generator=gen)).to(param_dtype))
        self.b = torch.nn.Parameter((0.1 * torch.randn(16, generator=gen)).to(param_dtype))

    def forward(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        from kernel_templates.fused_ln_mul_dropout import fused_ln_mul_dropout

        return fused_ln_mul_dropout(x, u, self.w, self.b, 1e-5, 0.5, self.training)


def _onnx_of(module: torch.nn.Module, args: tuple) -> onnx.ModelProto:
    ep = torch.export.export(module, args)
    prog = torch.onnx.export(ep, (), None, opset_version=18, dynamo=True,
                             custom_translation_table=onnx_hstu.translation_table())  # fmt: skip
    return prog.model_proto


def test_a_training_mode_dropout_is_refused_instead_of_exported_as_none():
    """A module exported in training mode carries dropout p > 0 into ``hstu::ln_mul_dropout_fwd``, whose translation
    has no dropout: the file computed the undropped, unscaled LN(x) * u (half the entries and twice the scale of what
    PyTorch computed) without a word. It is refused, naming p and eval mode; the eval-mode export still runs."""
    x, u = torch.randn(8, 16), torch.randn(8, 16)
    with pytest.raises(Exception, match=r"dropout p=0.5.*eval mode"):
        _onnx_of(_LnMulDropout().train(), (x, u))
    module = _LnMulDropout().eval()
    session = ort.InferenceSession(_onnx_of(module, (x, u)).SerializeToString(), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        want = module(x, u).numpy()
    np.testing.assert_allclose(session.run(None, {"x": x.numpy(), "u": u.numpy()})[0], want, rtol=1e-5, atol=1e-5)


def test_float16_activations_beside_fp32_layernorm_parameters_export_and_run():
    """``fused_ln_mul_dropout`` takes float16 x and u beside fp32 (master) LayerNorm parameters and computes in fp32;
    its translation fed them to one LayerNormalization, which takes a single type, so the file failed the checker
    ("Scale has inconsistent type"). It now runs, matching PyTorch in float16."""
    x, u = torch.randn(8, 16).half(), torch.randn(8, 16).half()
    module = _LnMulDropout(torch.float32).eval()
    proto = _onnx_of(module, (x, u))
    onnx.checker.check_model(proto, full_check=True)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": x.numpy(), "u": u.numpy()})[0]
    with torch.no_grad():
        want = module(x, u)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want.float().numpy(), rtol=2e-3, atol=2e-3)


def test_a_one_row_example_batch_still_exports_rows_as_dynamic(tmp_path):
    """batch_size 2 x max_seq_len 1: the example batch (one empty sequence, one of length 1) had one row, which
    torch.export specialised to a constant (a UserError traceback). The example now has 2 rows, and the file
    runs batches of 0, 1 and 2 rows as PyTorch does."""
    over = {"batch_size": 2, "max_seq_len": 1, "min_seq_len": 1, "num_layers": 1, "kernels": "reference"}
    path = tmp_path / "one.onnx"
    _, module, cfg = export.export_onnx("tiny", path, overrides=over)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for lengths in ([0, 0], [1, 0], [0, 1], [1, 1]):
        off = torch.tensor([0, lengths[0], sum(lengths)])
        items = torch.arange(sum(lengths))
        got = session.run(None, {"items": items.numpy(), "prev_actions": items.numpy(), "seq_offsets": off.numpy()})
        with torch.no_grad():
            want = module(items, items, off).numpy()
        assert got[0].shape == want.shape and np.allclose(got[0], want, atol=1e-5), lengths


def test_a_failing_export_leaves_the_earlier_file_and_no_unchecked_one(tmp_path, monkeypatch):
    """The file was written at --out before onnx.checker ran: a check that failed (or an interrupted export) left
    an unchecked file where a good one had been. It is now checked beside --out and renamed over it."""
    out = tmp_path / "m.onnx"
    out.write_bytes(b"earlier export")

    def failing_check(path, full_check=False):
        assert Path(path).parent == tmp_path and Path(path) != out
        raise onnx.checker.ValidationError("checker says no")

    monkeypatch.setattr(onnx.checker, "check_model", failing_check)
    with pytest.raises(onnx.checker.ValidationError, match="checker says no"):
        export.export_onnx("tiny", out, overrides={"num_layers": 1, "kernels": "reference"})
    assert out.read_bytes() == b"earlier export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    monkeypatch.undo()
    export.export_onnx("tiny", out, overrides={"num_layers": 1, "kernels": "reference"})
    assert onnx.load(str(out)).graph.node and sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    assert out.stat().st_mode & 0o777 == 0o666 & ~art._umask()


def _weights(tmp_path: Path, value: float) -> Path:
    """A one-layer tiny state_dict whose first task head's output weights are all ``value``."""
    from models.config import get_config
    from models.hstu import HSTURankingModel

    sd = HSTURankingModel(get_config("tiny", num_layers=1)).state_dict()
    sd["heads.0.2.weight"].fill_(value)
    torch.save(sd, tmp_path / "w.pt")
    return tmp_path / "w.pt"


def test_weights_holding_nan_are_refused_by_name(tmp_path, capsys):
    """A diverged checkpoint exported a file that computes NaN for every input (and whose check compared NaN
    with NaN): now a usage error naming --weights and the tensor, before anything is written."""
    argv = ["--preset", "tiny", "--set", "num_layers=1", "--out", str(tmp_path / "m.onnx")]
    assert export.main([*argv, "--weights", str(_weights(tmp_path, float("nan")))]) == 2
    err = capsys.readouterr().err
    assert "--weights" in err and "heads.0.2.weight" in err and "NaN or infinite" in err
    assert not (tmp_path / "m.onnx").exists()


def test_the_json_report_stays_json_when_the_outputs_overflow(tmp_path):
    """Finite weights whose logits overflow: the error table holds NaN, which --json wrote as a bare NaN (not
    JSON). Non-finite numbers are now null, the check still fails (exit 1)."""
    report = tmp_path / "r.json"
    argv = ["--preset", "tiny", "--set", "num_layers=1", "--set", "kernels=reference", "--check-batches", "1"]
    argv += ["--out", str(tmp_path / "m.onnx"), "--weights", str(_weights(tmp_path, 3e38)), "--json", str(report)]
    assert export.main(argv) == 1

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    summary = json.loads(report.read_text(), parse_constant=refuse)
    assert summary["errors"][0]["ok"] is False and summary["errors"][0]["max_abs_err"] is None


@pytest.mark.parametrize(
    "over, named",
    [({"max_seq_len": 64}, "size mismatch for pos_emb.weight"), ({"num_layers": 2}, "Unexpected key(s)")],
)
def test_weights_of_another_config_are_refused_naming_the_mismatch(tmp_path, capsys, over, named):
    """Weights of another config (a longer max_seq_len, another layer count) were refused with load_state_dict's
    header alone, "(Error(s) in loading state_dict for HSTURankingModel:)", naming no tensor, shape or key: the
    reason under it is part of the message now."""
    from models.config import get_config
    from models.hstu import HSTURankingModel

    torch.save(HSTURankingModel(get_config("tiny", **{"num_layers": 1, **over})).state_dict(), tmp_path / "w.pt")
    argv = ["--preset", "tiny", "--set", "num_layers=1", "--out", str(tmp_path / "m.onnx"), "--check-batches", "0"]
    assert export.main([*argv, "--weights", str(tmp_path / "w.pt")]) == 2
    err = capsys.readouterr().err
    assert "--weights" in err and "not a state_dict of this model" in err and named in err, err
    assert not (tmp_path / "m.onnx").exists()
