"""Tuning tasks read from the model graph: presets through torch.export (fake weights, joint graph),
a custom module with mask features and hints, lengths files, and the ``autotune tasks`` / ``autotune run
--from-model`` commands."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path

import pytest

from autotune.runtime.lengths import LengthsError, read_lengths_file
from autotune.tuning import graph_tasks as gt
from autotune.tuning.cli import main
from autotune.tuning.tasks import Task


def _run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out + out.err


def _summary(tasks: list[gt.GraphTask]) -> list[tuple]:
    return [
        (
            g.task.kernel,
            g.task.dtype,
            g.task.dqk,
            g.task.dv,
            g.task.num_heads,
            g.task.bucket,
            g.task.distribution,
            g.task.mask,
            g.task.batch,
            g.count,
        )
        for g in tasks
    ]


def test_tiny_preset_tasks_from_the_joint_graph():
    graph = gt.ops_from_model("tiny")
    tasks = gt.build_tasks(graph, "h100")
    key = ("bfloat16", 32, 32, 2, 256, "jagged", "causal", 4, 2)
    assert _summary(tasks) == [(k, *key) for k in (gt.FWD, gt.BWD, gt.GEMM)]
    bwd = next(g for g in tasks if g.task.kernel == gt.BWD)
    assert bwd.nodes == ["attention_bwd", "attention_bwd_1"]  # read from the graph, not implied
    assert graph.rows == (1, 4 * 32)
    assert any("joint forward/backward graph" in n for n in graph.notes)
    assert any("silu_2 (64->64)" in n for n in graph.notes)  # the task heads' MLPs have no gemm_silu key


def test_seed_preset_tasks():
    tasks = gt.build_tasks(gt.ops_from_model("seed"), "h100")
    key = ("bfloat16", 256, 256, 4, 4096, "uniform", "causal", 32, 8)
    assert _summary(tasks) == [(k, *key) for k in (gt.FWD, gt.BWD, gt.GEMM)]


def test_float32_inference_has_no_backward():
    tasks = gt.build_tasks(gt.ops_from_model("tiny", dtype="float32", training=False), "h100")
    assert [(g.task.kernel, g.task.dtype) for g in tasks] == [(gt.FWD, "float32"), (gt.GEMM, "float32")]


FACTORY = textwrap.dedent(
    '''
    import torch
    from torch import nn
    from autotune.runtime.ops import HSTUAttention, hstu_attention

    class TwoCalls(nn.Module):
        """A context-masked call with a 'jagged' hint, and a windowed call with targets and no hint."""

        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 2 * (64 + 64 + 32))
            self.attn = HSTUAttention(source="reference", distribution="jagged", contextual_seq_len=4)

        def forward(self, x, offsets, targets):
            L = x.shape[0]
            q, k, v = torch.split(self.proj(x), [128, 128, 64], dim=1)
            q, k, v = q.reshape(L, 2, 64), k.reshape(L, 2, 64), v.reshape(L, 2, 32)
            a = self.attn(q, k, v, offsets, 700)
            b = hstu_attention(q, k, v, offsets, 3000, num_targets=targets, max_attn_len=8, source="reference")
            return a.sum() + b.sum()

    def factory():
        rows = torch.export.Dim("rows", min=2, max=4096)
        args = (torch.randn(40, 16), torch.tensor([0, 10, 25, 40]), torch.tensor([1, 2, 3]))
        return TwoCalls(), args, ({0: rows}, None, None)
    '''
)


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    (tmp_path / "graph_factory_mod.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "graph_factory_mod:factory"


def test_module_factory_masks_dims_and_hints(factory_module, tmp_path):
    graph = gt.ops_from_model(factory_module)
    fwd = [op for op in graph.ops if op.kernel == gt.FWD]
    assert [(op.dqk, op.dv, op.num_heads, op.max_seq_len, op.mask, op.distribution, op.batch) for op in fwd] == [
        (64, 32, 2, 700, "context", "jagged", 3),
        (64, 32, 2, 3000, "window", None, 3),
    ]
    tasks = gt.build_tasks(graph, "h100")
    # the hinted call gives one distribution, the unhinted one every law; bwd read from the joint graph
    assert sorted((g.task.kernel, g.task.bucket, g.task.distribution) for g in tasks) == sorted(
        [(k, 1024, "jagged") for k in (gt.FWD, gt.BWD)]
        + [(k, 4096, d) for k in (gt.FWD, gt.BWD) for d in ("jagged", "sparse", "uniform")]
    )
    uniform = tmp_path / "lengths.txt"
    uniform.write_text("# one batch per line\n512 512 512 512\n300, 300\n")
    by_lengths = gt.build_tasks(graph, "h100", read_lengths_file(uniform))
    assert {(g.task.bucket, g.task.distribution, g.task.batch) for g in by_lengths} == {
        (1024, "jagged", 3),
        (4096, "uniform", 3),
    }
    too_long = tmp_path / "long.json"
    too_long.write_text(json.dumps([[10, 800]]))
    with pytest.raises(gt.GraphTaskError, match="sequence of 800 tokens, above max_seq_len 700"):
        gt.build_tasks(graph, "h100", read_lengths_file(too_long))


def test_a_lengths_file_gives_the_jagged_tasks_their_lengths(factory_module, tmp_path):
    """Any lengths format works with a graph: a flat .npy sample makes the unhinted call jagged and its
    batches are drawn from the file; listed batches also give the batch size where the graph has none."""
    import numpy as np

    graph = gt.ops_from_model(factory_module)
    graph.ops = [dataclasses.replace(op, batch=None) for op in graph.ops if op.kernel == gt.FWD]
    flat = tmp_path / "lengths.npy"
    np.save(flat, np.array([5, 40, 40, 600, 650], dtype=np.int64))
    tasks = gt.build_tasks(graph, "h100", read_lengths_file(flat), default_batch=6)
    assert sorted((g.task.bucket, g.task.distribution, g.task.batch) for g in tasks) == [
        (1024, "jagged", 6),
        (4096, "jagged", 6),
    ]
    for g in tasks:
        assert g.task.sample == (5, 40, 40, 600, 650)
        assert set(g.task.lengths()) <= {5, 40, 600, 650, g.task.max_len}
    listed = tmp_path / "batches.json"
    listed.write_text(json.dumps([[3, 9], [7, 7, 1]]))
    tasks = gt.build_tasks(graph, "h100", read_lengths_file(listed))
    assert {(g.task.distribution, g.task.batch, g.task.sample) for g in tasks} == {("jagged", 3, (1, 3, 7, 7, 9))}


def test_preset_tasks_draw_from_the_model_length_law():
    """Without a lengths file, a jagged preset's tasks carry its data config's lengths; a full-length preset
    has none and its tasks stay uniform."""
    from models.config import get_config
    from models.data import length_sample

    graph = gt.ops_from_model("tiny")
    cfg = get_config("tiny")
    assert graph.lengths is not None and min(graph.lengths) >= cfg.min_seq_len and max(graph.lengths) <= 32
    assert sorted(graph.lengths) == sorted(length_sample(cfg))
    assert any("model's length sample" in n for n in graph.notes)
    tasks = gt.build_tasks(graph, "h100")
    assert {g.task.sample for g in tasks if g.task.kernel != gt.GEMM} == {graph.lengths}
    assert all(g.task.sample is None for g in tasks if g.task.kernel == gt.GEMM)
    assert gt.ops_from_model("seed").lengths is None


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "no non-zero length"),
        ("1 2 x\n", "not JSON"),
        ("[[1, -2]]", "negative length -2"),
        ("[[1], []]", "batch 1"),
    ],
)
def test_bad_lengths_files(tmp_path, text, message):
    path = tmp_path / "lengths"
    path.write_text(text)
    with pytest.raises(LengthsError, match=message):
        read_lengths_file(path)
    with pytest.raises(LengthsError, match="no such file"):
        read_lengths_file(tmp_path / "missing")
    (tmp_path / "binary").write_bytes(b"\x81\xfe\x00\xff")  # no UTF-8, no byte-order mark (those read as UTF-16)
    with pytest.raises(LengthsError, match="cannot read it as text"):
        read_lengths_file(tmp_path / "binary")


def test_tasks_command_prints_and_writes_json(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("COLUMNS", "220")
    out = tmp_path / "tasks.json"
    rc, text = _run(capsys, "tasks", "--from-model", "tiny", "--gpu", "h100", "--json", str(out))
    assert rc == 0, text
    assert "3 tasks for h100" in text and "dynamic rows: 1..128" in text
    data = json.loads(out.read_text())
    assert [(t["kernel"], t["count"]) for t in data["tasks"]] == [(gt.FWD, 2), (gt.BWD, 2), (gt.GEMM, 2)]
    assert Task.from_dict({k: v for k, v in data["tasks"][0].items() if k not in ("count", "nodes")}).bucket == 256


def test_tasks_with_a_lengths_file_say_the_file_replaced_the_model_sample(capsys, monkeypatch, tmp_path):
    """``--lengths FILE`` printed (and wrote to --json) "draw their batches from the model's length sample ...;
    --lengths FILE replaces it", as if the file had not been read."""
    monkeypatch.setenv("COLUMNS", "220")
    lengths, out = tmp_path / "l.json", tmp_path / "tasks.json"
    lengths.write_text("[5, 17, 30, 12]\n")
    rc, text = _run(
        capsys, "tasks", "--from-model", "tiny", "--gpu", "h100", "--lengths", str(lengths), "--json", str(out)
    )
    assert rc == 0, text
    assert "model's length sample" not in text
    assert f"--lengths {lengths} (4 lengths, mean 16, max 30)" in " ".join(text.split())
    notes = json.loads(out.read_text())["notes"]
    assert not any("model's length sample" in n for n in notes) and any(str(lengths) in n for n in notes)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["tasks", "--from-model", "huge"], "neither a preset"),
        (["tasks", "--from-model", "no_such_module:f"], "cannot import it"),
        (["tasks", "--from-onnx", "/nonexistent/model.onnx"], "no such file"),
        (
            ["run", "--gpu", "h100", "--dry-run", "--from-model", "tiny", "--buckets", "1K"],
            "--buckets cannot be combined",
        ),
        # The default's own value is ignored all the same: the graph decides (it was silently accepted).
        (["run", "--gpu", "h100", "--dry-run", "--from-model", "tiny", "--heads", "4"], "--heads cannot be combined"),
        (["run", "--gpu", "h100", "--dry-run", "--from-model", "tiny", "--kernel", "fwd,bwd"], "--kernel cannot be"),
        (["run", "--gpu", "h100", "--interpret", "--from-model", "tiny", "--dims", "32"], "--dims cannot be"),
        (["run", "--gpu", "h100", "--dry-run", "--from-model", "tiny", "--masks", "causal"], "--masks cannot be"),
    ],
)
def test_tasks_errors_are_clear(capsys, argv, message):
    rc, text = _run(capsys, *argv)
    assert rc == 2 and message in text


def test_run_from_model_tunes_exactly_the_graph_tasks(capsys, monkeypatch):
    """``autotune run --from-model tiny --interpret`` hands the tuner the graph's task list, nothing else."""
    import autotune.tuning.tuner

    seen = []
    monkeypatch.setattr(autotune.tuning.tuner, "run_tasks", lambda tasks, *a, **k: seen.extend(tasks) or [])
    rc, text = _run(capsys, "run", "--gpu", "h100", "--interpret", "--from-model", "tiny")
    assert rc == 0, text
    expected = gt.build_tasks(gt.ops_from_model("tiny", dtype="float32"), "h100", seq_cap=64, default_batch=2)
    assert seen == [g.task for g in expected] and len(seen) == 3
    assert {t.dtype for t in seen} == {"float32"} and all(t.seq_cap == 64 for t in seen)
    assert [g.count for g in expected] == [2, 2, 2]


def test_tasks_from_a_model_need_no_runnable_backend(monkeypatch):
    """Tracing records dispatch's choices but runs no kernel: a CPU host without the interpreter lists the
    tasks too, and the trace-only choice is not cached for real calls."""
    import torch

    from autotune.runtime import dispatch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU runs the default backends")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    dispatch.reset()
    graph = gt.ops_from_model("tiny")
    assert gt.build_tasks(graph, "h100")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        dispatch.select("hstu_attention_fwd", "float32", 32, 32, 2, 32, source="default")
    dispatch.reset()


@pytest.mark.parametrize(
    ("body", "match"),
    [("raise RuntimeError('boom')", "the factory raised RuntimeError: boom"), ("return None", "must return"),
     ("return (1, 2)", "its module must be a torch.nn.Module, got int")],
)  # fmt: skip
def test_a_factory_that_fails_or_returns_the_wrong_thing_is_named(tmp_path, monkeypatch, body, match):
    name = f"bad_factory_{abs(hash(body))}"  # one module per case: imports are cached by name
    (tmp_path / f"{name}.py").write_text(f"def factory():\n    {body}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(gt.GraphTaskError, match=match):
        gt.ops_from_model(f"{name}:factory")


def test_a_task_head_mlp_of_the_projection_shape_is_no_projection(monkeypatch):
    """A ``silu(linear)`` is a uvqk projection only when its output feeds an attention call's q, k or v: a task
    head's MLP of the same width (head_hidden = 4 H D) was counted as one more projection."""
    from models import config

    monkeypatch.setitem(config.PRESETS, "tiny", dict(config.PRESETS["tiny"], head_hidden=256))
    for training in (False, True):
        graph = gt.ops_from_model("tiny", training=training)
        gemm = [t for t in gt.build_tasks(graph, "h100") if t.task.kernel == "gemm_silu"]
        assert [t.count for t in gemm] == [2]  # one per layer


def test_a_model_on_the_fused_layer_is_named_with_what_traces(tmp_path, monkeypatch):
    """torch.export cannot trace the fused layer's kernel-launching autograd functions: a clear error that names
    the source and says to build the model with layer='unfused' (it was a raw TypeError from the tracer)."""
    (tmp_path / "fused_model.py").write_text(
        "from models.config import get_config\n"
        "from models.export import JaggedModule, dynamic_shapes, small_jagged_batch\n"
        "from models.hstu import HSTURankingModel\n"
        "def factory():\n"
        "    cfg = get_config('tiny', layer='fused')\n"
        "    return JaggedModule(HSTURankingModel(cfg)), small_jagged_batch(cfg, 0), dynamic_shapes(cfg)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(gt.GraphTaskError, match=r"fused_model:factory: torch.export could not trace .*layer='unfused'"):
        gt.ops_from_model("fused_model:factory", training=False)


def _onnx_file(path, attrs, inputs=("q", "k", "v", "off"), lengths=None, qkv=("L", 4, 64), offsets=33):
    """A one-node ONNX file of an hstu.JaggedAttention call (typed inputs, no function body)."""
    import onnx
    from onnx import TensorProto, helper

    from autotune.runtime.onnx_hstu import DOMAIN, NAME

    def typed(name, elem, dims):
        return helper.make_tensor_value_info(name, elem, dims)

    ins = [typed(n, TensorProto.FLOAT, list(qkv)) for n in "qkv"] + [typed("off", TensorProto.INT64, [offsets])]
    node = helper.make_node(NAME, list(inputs), ["o"], domain=DOMAIN, **attrs)
    graph = helper.make_graph([node], "g", ins, [typed("o", TensorProto.FLOAT, ["L", 4, 64])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])
    if lengths is not None:
        helper.set_model_props(model, {"hstu.lengths": lengths})
    onnx.save(model, str(path))
    return str(path)


GOOD_ATTRS = {"max_seq_len": 256, "contextual_seq_len": 0, "max_attn_len": 0}


@pytest.mark.parametrize(
    "attrs, inputs, lengths, message",
    [
        ({}, ("q", "k", "v", "off"), None, "o: the hstu.JaggedAttention node has no attribute max_seq_len"),
        ({**GOOD_ATTRS, "max_seq_len": -5}, ("q", "k", "v", "off"), None, "max_seq_len must be an integer >= 1"),
        (GOOD_ATTRS, (), None, "takes q, k, v, seq_offsets"),
        (GOOD_ATTRS, ("q", "k"), None, "takes q, k, v, seq_offsets"),
        (GOOD_ATTRS, ("q", "k", "v", "off"), "[true, 5]", "hstu.lengths metadata is not a list of lengths"),
        (GOOD_ATTRS, ("q", "k", "v", "off"), "[99999999]", "hstu.lengths metadata is not a list of lengths"),
        (GOOD_ATTRS, ("q", "k", "v", "off"), "[0, 0]", "hstu.lengths metadata holds no non-zero length"),
        (GOOD_ATTRS, ("q", "k", "v", "off"), "[]", "hstu.lengths metadata holds no non-zero length"),
    ],
    ids=[
        "no-attributes",
        "negative-max-seq-len",
        "no-inputs",
        "two-inputs",
        "bool-length",
        "huge-length",
        "zeros",
        "empty",
    ],  # fmt: skip
)
def test_a_malformed_onnx_attention_node_is_named(capsys, tmp_path, attrs, inputs, lengths, message):
    """A node without its attributes or inputs was a KeyError / IndexError traceback; metadata lengths a
    lengths file refuses (a bool, past the largest bucket) were taken as the model's length sample, and an empty
    or all-zero sample was dropped without a word (tasks on every synthetic law instead)."""
    assert main(["tasks", "--gpu", "h100", "--from-onnx", _onnx_file(tmp_path / "m.onnx", GOOD_ATTRS)]) == 0
    capsys.readouterr()
    rc = main(["tasks", "--gpu", "h100", "--from-onnx", _onnx_file(tmp_path / "m.onnx", attrs, inputs, lengths)])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err


@pytest.mark.parametrize(
    ("lengths", "match"),
    [("5", "must be a list of sequence lengths, got int"), ("[float('inf')]", "hold inf"),
     ("[3, -5]", "hold -5"), ("[40000]", "hold 40000"), ("[3.7]", "hold 3.7"), ("[True]", "hold True"),
     ("[0, 0]", "no non-zero length"), ("[]", "no non-zero length")],
)  # fmt: skip
def test_a_factorys_lengths_are_checked_as_a_lengths_file_is(tmp_path, monkeypatch, lengths, match):
    """``int()`` of each was a TypeError / OverflowError traceback for a scalar or inf, truncated 3.7 to 3, and
    kept negative and huge lengths as the model's length sample; an empty or all-zero one was dropped unsaid."""
    name = f"lengths_factory_{abs(hash(lengths))}"
    body = "import types, numpy, torch\n\n\ndef factory(lengths={}):\n"
    body += "    return types.SimpleNamespace(module=torch.nn.Linear(1, 1), args=(), lengths=lengths)\n"
    (tmp_path / f"{name}.py").write_text(body.format(lengths) + "\n\ndef ok():\n    return factory(numpy.arange(4))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(gt.GraphTaskError, match=match):
        gt.resolve_model(f"{name}:factory", "float32", False)
    assert gt.resolve_model(f"{name}:ok", "float32", False)[4] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ("def f(:\n", "cannot import it \\(SyntaxError"),
        ("raise RuntimeError('at import')\n", "cannot import it \\(RuntimeError: at import"),
        ("import torch\n\n\ndef factory():\n    return torch.nn.Linear(1, 1), 5\n", "its args must be a tuple"),
        ("import types, torch\n\n\ndef factory():\n    return types.SimpleNamespace(module=torch.nn.Linear(1, 1))\n",
         "its args must be a tuple"),
        ("import types\n\n\ndef factory():\n    return types.SimpleNamespace(module=5, args=())\n",
         "its module must be a torch.nn.Module, got int"),
        ("import torch\n\n\ndef factory():\n    return torch.nn.Linear(1, 1), (), 5\n", "its dynamic_shapes must be"),
        ("import torch\n\n\ndef factory():\n    return torch.nn.Linear(1, 1), (), None, 4\n",
         "the factory must return .*a tuple of 4"),
        ("import sys\n\nsys.exit(3)\n", "cannot import it \\(SystemExit: 3"),
        ("import sys\n\n\ndef factory():\n    sys.exit(3)\n", "the factory raised SystemExit: 3"),
    ],
    ids=["syntax-error", "raises-at-import", "args-int", "no-args", "module-int", "dynamic-shapes-int", "four-items",
         "exits-at-import", "factory-exits"],
)  # fmt: skip
def test_a_factory_module_or_result_of_the_wrong_kind_is_named(tmp_path, monkeypatch, body, match):
    """A module failing at import (SyntaxError, its own error) and a factory result whose args or dynamic shapes
    are no sequence, or whose object lacks ``.args``, were tracebacks; each is a GraphTaskError naming the spec."""
    name = f"bad_factory_{abs(hash(body))}"
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(gt.GraphTaskError, match=f"--from-model '{name}:factory': {match}"):
        gt.resolve_model(f"{name}:factory", "float32", False)


@pytest.mark.parametrize(
    ("qkv", "offsets", "message"),
    [(("L", "H", 64), 33, "o: q's heads must be a fixed positive size, got 'H'"),
     (("L", 0, 64), 33, "o: q's heads must be a fixed positive size, got 0"),
     (("L", 4, -3), 33, "o: q's head dim must be a fixed positive size, got -3"),
     (("L", 4, 64), 1, "o: seq_offsets holds 1 entries")],
    ids=["symbolic-heads", "zero-heads", "negative-dim", "one-offset"],
)  # fmt: skip
def test_an_onnx_node_of_unusable_shapes_is_named(capsys, tmp_path, qkv, offsets, message):
    """Symbolic heads were an int() traceback ('invalid literal'), zero heads or offsets an error naming no node
    or file, and a head dim of -3 or 0 was listed as a task."""
    rc = main(["tasks", "--gpu", "h100", "--from-onnx", _onnx_file(tmp_path / "m.onnx", GOOD_ATTRS, qkv=qkv,
                                                                   offsets=offsets)])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err


def test_an_empty_or_folder_onnx_path_is_named(capsys, tmp_path):
    """An empty file parsed as an empty ONNX model: 0 tasks and exit 0; a folder was 'no such file'."""
    (tmp_path / "empty.onnx").write_bytes(b"")
    assert main(["tasks", "--gpu", "h100", "--from-onnx", str(tmp_path / "empty.onnx")]) == 2
    assert "not an ONNX model (no IR version" in capsys.readouterr().err
    assert main(["tasks", "--gpu", "h100", "--from-onnx", str(tmp_path)]) == 2
    assert f"--from-onnx {tmp_path}: is a directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("attrs", "offsets", "message"),
    [({**GOOD_ATTRS, "distribution": "bogus"}, 33, "o (ONNX file m.onnx): distribution 'bogus' is not one of"),
     ({**GOOD_ATTRS, "kernel_dtype": "int8"}, 33, "o (ONNX file m.onnx): dtype 'int8' is not one of"),
     (GOOD_ATTRS, 10**6, "o (ONNX file m.onnx): batch must be in [1, ")],
    ids=["distribution", "kernel-dtype", "batch"],
)  # fmt: skip
def test_an_onnx_node_no_task_takes_is_named(capsys, tmp_path, attrs, offsets, message):
    """A node's distribution hint, kernel dtype or batch that no task takes was refused without naming the node
    or the file (in a graph of many attention nodes, which one?)."""
    rc = main(["tasks", "--gpu", "h100", "--from-onnx", _onnx_file(tmp_path / "m.onnx", attrs, offsets=offsets)])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err


def test_tasks_json_never_overwrites_its_input(capsys, tmp_path):
    """``--json`` naming the --from-onnx (or --lengths) file replaced the model with the task list."""
    model = _onnx_file(tmp_path / "m.onnx", GOOD_ATTRS)
    before = (tmp_path / "m.onnx").read_bytes()
    lengths = tmp_path / "l.txt"
    lengths.write_text("100 200\n")
    for option, path in (("--from-onnx", model), ("--lengths", str(lengths))):
        rc = main(["tasks", "--gpu", "h100", "--from-onnx", model, "--lengths", str(lengths), "--json", path])
        err = capsys.readouterr().err
        assert rc == 2 and f"is the {option} file" in err, err
    assert (tmp_path / "m.onnx").read_bytes() == before and lengths.read_text() == "100 200\n"


def _lengths_file_tasks(tmp_path: Path, text: str, hint: str | None) -> tuple[gt.GraphOps, list[gt.GraphTask], Path]:
    """(graph, tasks, file path) of one attention call with distribution ``hint`` and a lengths file holding
    ``text``, after ``note_lengths_file`` has left its note on the graph."""
    path = tmp_path / "l.json"
    path.write_text(text)
    lengths = read_lengths_file(str(path))
    graph = gt.GraphOps("test", [gt.GraphOp(gt.FWD, "attn", "bfloat16", 64, 64, 2, 64, distribution=hint)])
    tasks = gt.build_tasks(graph, "h100", lengths)
    gt.note_lengths_file(graph, lengths, str(path), tasks)
    return graph, tasks, path


@pytest.mark.parametrize("hint", ["uniform", None])
def test_a_lengths_file_no_task_draws_from_is_said_to_be_unused(tmp_path, hint):
    """A model whose attention calls declare distribution 'uniform' (the seed preset) got uniform tasks, and the
    note said "jagged tasks draw their batches from --lengths FILE": there were none. Now the note says the file
    is not used and why; without a hint the jagged tasks do draw from it."""
    graph, tasks, path = _lengths_file_tasks(tmp_path, "[5, 17, 30, 12]\n", hint)
    if hint:
        assert [t.task.distribution for t in tasks] == ["uniform"]
        assert graph.notes == [
            f"--lengths {path} is not used: the attention calls declare distribution 'uniform'; dispatch keys on a "
            "call's hint, so tasks of the file's lengths would not serve these calls (build the model without it to "
            "use the file: attention_hint='auto' and lengths other than full in models.config, distribution=None in "
            "HSTUAttention)"
        ]
    else:
        assert [t.task.distribution for t in tasks] == ["jagged"] and tasks[0].task.sample
        assert graph.notes == [f"jagged tasks draw their batches from --lengths {path} (4 lengths, mean 16, max 30)"]


def test_an_unused_uniform_lengths_file_is_not_blamed_on_a_hint_the_calls_lack(tmp_path):
    """Calls without a hint (the presets' jagged models) and a file of one-length batches get uniform tasks, which
    draw no lengths: the note told the user to pass distribution=None, which the model already did."""
    graph, tasks, path = _lengths_file_tasks(tmp_path, "[[16, 16], [30, 30, 30]]\n", None)
    assert [t.task.distribution for t in tasks] == ["uniform"]
    assert graph.notes == [
        f"--lengths {path} is not used: every batch of it is of one length, so its tasks are 'uniform' ones, which "
        "draw no lengths"
    ]


def test_run_from_onnx_under_interpret_takes_the_dtype_from_model_takes(capsys, monkeypatch, tmp_path):
    """``--from-model`` under ``--interpret`` tuned float32 (the interpreter's --dtype) but ``--from-onnx`` the
    file's bfloat16: both now take --dtype under --interpret (float32 unless given); on a GPU the file's."""
    import autotune.tuning.tuner

    seen = []
    monkeypatch.setattr(autotune.tuning.tuner, "run_tasks", lambda tasks, *a, **k: seen.extend(tasks) or [])
    model = _onnx_file(tmp_path / "m.onnx", {**GOOD_ATTRS, "kernel_dtype": "bfloat16"})
    argv = ["run", "--gpu", "h100", "--from-onnx", model, "--artifacts", str(tmp_path / "arts")]
    rc, text = _run(capsys, *argv, "--interpret")
    assert rc == 0 and seen and {t.dtype for t in seen} == {"float32"}, text
    assert "--interpret" in text and "float32" in text  # the note says why the file's dtype was not taken
    rc, text = _run(capsys, *argv, "--dry-run")
    assert rc == 0 and "bfloat16" in text and "float32" not in text, text


def test_run_from_onnx_on_a_gpu_refuses_a_dtype_it_would_ignore(capsys, tmp_path):
    """Without --interpret the file's ops are tuned in the dtype the file holds: a ``--dtype float16`` was dropped
    without a word and the run tuned bfloat16. It is refused, naming the option; under --interpret it is taken."""
    model = _onnx_file(tmp_path / "m.onnx", {**GOOD_ATTRS, "kernel_dtype": "bfloat16"})
    argv = ["run", "--gpu", "h100", "--from-onnx", model, "--artifacts", str(tmp_path / "arts"), "--dry-run"]
    rc, text = _run(capsys, *argv, "--dtype", "float16")
    assert rc == 2 and "--dtype cannot be combined with --from-onnx" in text, text
    rc, text = _run(capsys, *argv, "--dtype", "float16", "--interpret")
    assert rc == 0 and "float16" in text, text


def test_tasks_from_onnx_refuses_a_dtype_it_would_ignore(capsys, tmp_path):
    """``autotune tasks --from-onnx FILE --dtype float16`` listed the file's bfloat16 tasks: the --dtype was dropped
    without a word (``run`` refuses it likewise). The file's dtype stays the default."""
    model = _onnx_file(tmp_path / "m.onnx", {**GOOD_ATTRS, "kernel_dtype": "bfloat16"})
    rc, text = _run(capsys, "tasks", "--gpu", "h100", "--from-onnx", model, "--dtype", "float16")
    assert rc == 2 and "--dtype cannot be combined with --from-onnx" in text, text
    rc, text = _run(capsys, "tasks", "--gpu", "h100", "--from-onnx", model)
    assert rc == 0 and "bfloat16" in text, text


def test_lengths_out_writes_the_sample_the_tasks_carry(capsys, monkeypatch, tmp_path):
    """Entries tuned through ``--from-model`` record the model's own length sample, which ``run --from-artifact``
    needs back as ``--lengths FILE``; no command wrote that sample, so those entries could never be re-measured.
    ``tasks --lengths-out`` writes it, and read back it has the digest the tasks' entries record."""
    from autotune.runtime.lengths import compact, describe, read_length_sample

    monkeypatch.setenv("COLUMNS", "220")
    out, sample_file = tmp_path / "tasks.json", tmp_path / "sample.json"
    argv = ("tasks", "--from-model", "tiny", "--gpu", "h100", "--json", str(out), "--lengths-out", str(sample_file))
    rc, text = _run(capsys, *argv)
    assert rc == 0, text
    samples = {tuple(t["sample"]) for t in json.loads(out.read_text())["tasks"] if t.get("sample")}
    assert len(samples) == 1, samples  # the preset's jagged tasks carry one sample
    back = compact(read_length_sample(str(sample_file)))
    assert describe(back)["sha256_16"] == describe(next(iter(samples)))["sha256_16"]
    rc, text = _run(capsys, "tasks", "--from-model", "tiny", "--gpu", "h100", "--lengths-out", str(out), "--json",
                    str(out))  # fmt: skip
    assert rc == 2 and "--lengths-out" in text and "--json" in text, text


def test_lengths_out_writes_the_lengths_file_sample_the_tasks_draw_from(capsys, monkeypatch, tmp_path):
    """With ``--lengths FILE`` the jagged tasks draw from the file's lengths (their entries record its digest), but
    ``--lengths-out`` wrote the model's own sample: ``run --from-artifact --lengths OUT`` then refused every entry
    as tuned on another sample. It writes the sample the tasks carry, the file's."""
    from autotune.runtime.lengths import compact, describe, read_length_sample

    monkeypatch.setenv("COLUMNS", "220")
    lengths, out, sample_file = tmp_path / "l.json", tmp_path / "tasks.json", tmp_path / "sample.json"
    lengths.write_text("[[10, 20], [30]]\n")
    rc, text = _run(capsys, "tasks", "--from-model", "tiny", "--gpu", "h100", "--lengths", str(lengths), "--json",
                    str(out), "--lengths-out", str(sample_file))  # fmt: skip
    assert rc == 0, text
    samples = {tuple(t["sample"]) for t in json.loads(out.read_text())["tasks"] if t.get("sample")}
    assert samples == {compact(read_length_sample(str(lengths)))}, samples
    written = compact(read_length_sample(str(sample_file)))
    assert describe(written)["sha256_16"] == describe(next(iter(samples)))["sha256_16"]
