"""The exported ONNX file on batches its example never held, and ``autotune tasks --from-onnx`` on files
models.export did not write: several attention nodes of other shapes, foreign protobufs, another hstu
opset version, mismatched q/k/v shapes."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from autotune.runtime.onnx_hstu import DOMAIN, NAME
from autotune.tuning import graph_tasks as gt
from autotune.tuning.cli import main
from models import export
from models.hstu import HSTURankingModel

ATTRS = {"max_seq_len": 256, "contextual_seq_len": 0, "max_attn_len": 0}


def _typed(name: str, elem: int, dims: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, dims)


def _model(nodes, inputs, outputs, opsets=(("", 18), (DOMAIN, 1))) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])


def _two_nodes(k_dims=("L", 4, 64), opsets=(("", 18), (DOMAIN, 1))) -> onnx.ModelProto:
    """Two attention nodes of different heads, dims, lengths and masks; the second's outputs are untyped."""
    ins = [_typed("q", 1, ["L", 4, 64]), _typed("k", 1, list(k_dims)), _typed("v", 1, ["L", 4, 64])]
    ins += [_typed("off", 7, [9]), _typed("q2", 10, ["L", 2, 128]), _typed("v2", 10, ["L", 2, 32])]
    nodes = [
        helper.make_node(NAME, ["q", "k", "v", "off"], ["o"], domain=DOMAIN, **ATTRS),
        helper.make_node(NAME, ["q2", "q2", "v2", "off"], ["o2"], domain=DOMAIN,
                         **{**ATTRS, "max_seq_len": 1024, "max_attn_len": 8, "distribution": "uniform"}),
    ]  # fmt: skip
    return _model(nodes, ins, [_typed("o", 1, ["L", 4, 64]), helper.make_tensor_value_info("o2", 10, None)], opsets)


def test_several_attention_nodes_of_different_shapes_give_their_own_tasks(tmp_path):
    path = tmp_path / "two.onnx"
    onnx.save(_two_nodes(), str(path))
    graph = gt.ops_from_onnx(path)
    tasks = {(t.task.kernel, t.task.dtype, t.task.dqk, t.task.dv, t.task.num_heads, t.task.bucket,
              t.task.distribution, t.task.mask, t.task.batch) for t in gt.build_tasks(graph, "h100")}  # fmt: skip
    kernels = ("hstu_attention_fwd", "hstu_attention_bwd")
    want = {(k, "float16", 128, 32, 2, 1024, "uniform", "window", 8) for k in kernels}
    assert want <= tasks and len(tasks) == 2 + 2 * len(gt.DISTRIBUTIONS)
    assert {t[:7] for t in tasks - want} == {
        (k, "float32", 64, 64, 4, 256, d) for k in kernels for d in gt.DISTRIBUTIONS
    }


def test_a_tensor_protobuf_is_not_taken_for_a_model_without_attention(tmp_path, capsys):
    """A TensorProto file (e.g. a test_data_set input_0.pb) parses as a ModelProto whose dims read as an IR
    version: it gave '0 tasks' and exit 0 as if it were a model without attention."""
    path = tmp_path / "input_0.onnx"
    onnx.save_tensor(numpy_helper.from_array(np.zeros((3, 4), np.float32)), str(path))
    assert main(["tasks", "--gpu", "h100", "--from-onnx", str(path)]) == 2
    assert f"--from-onnx {path}: not an ONNX model" in capsys.readouterr().err
    half = tmp_path / "half.onnx"
    half.write_bytes(_two_nodes().SerializeToString()[:100])
    assert main(["tasks", "--gpu", "h100", "--from-onnx", str(half)]) == 2
    assert f"--from-onnx {half}: not a readable ONNX model" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("opsets", "message"),
    [((("", 18), (DOMAIN, 2)), "hstu nodes are of opset version 2"),
     ((("", 18),), "hstu nodes are of opset version none")],
    ids=["hstu-v2", "no-hstu-import"],
)  # fmt: skip
def test_an_hstu_opset_other_than_the_one_written_is_refused(tmp_path, capsys, opsets, message):
    """A JaggedAttention of another hstu opset version (its attributes may mean something else), or of none,
    was read as version 1."""
    path = tmp_path / "m.onnx"
    onnx.save(_two_nodes(opsets=opsets), str(path))
    assert main(["tasks", "--gpu", "h100", "--from-onnx", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--from-onnx {path}: its {message}" in err, err


@pytest.mark.parametrize(
    ("k_dims", "message"),
    [(("L", 4, 32), "o: k's head dim 32 differs from q's 64"), (("L", 2, 64), "o: k's heads 2 differ from q's 4")],
    ids=["head-dim", "heads"],
)
def test_a_node_whose_k_does_not_match_q_is_named_with_its_file(tmp_path, capsys, k_dims, message):
    """q (L, 4, 64) with k (L, 4, 32) was a 64/64 task; and a node's error named the node, not the file."""
    path = tmp_path / "m.onnx"
    onnx.save(_two_nodes(k_dims=k_dims), str(path))
    assert main(["tasks", "--gpu", "h100", "--from-onnx", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--from-onnx {path}: {message}" in err, err


def test_the_exported_file_runs_batches_its_example_never_held(tmp_path):
    """Three heads of 16, batch 3 of max length 8: all empty, one row, one row each, every sequence full, only
    the last sequence: ONNX Runtime equals the PyTorch oracle, and int32 offsets are refused by input name."""
    over = {"kernels": "reference", "num_heads": 3, "head_dim": 16, "hidden_dim": 48, "num_layers": 1,
            "batch_size": 3, "max_seq_len": 8, "min_seq_len": 1}  # fmt: skip
    path = tmp_path / "m.onnx"
    _, module, cfg = export.export_onnx("tiny", path, overrides=over)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    oracle = export.JaggedModule(HSTURankingModel(cfg)).eval()
    oracle.model.load_state_dict(module.model.state_dict())
    gen = torch.Generator().manual_seed(0)
    for lengths in ([0, 0, 0], [1, 0, 0], [1, 1, 1], [8, 8, 8], [0, 0, 5]):
        off = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int64)
        items = torch.randint(0, cfg.num_items, (sum(lengths),), generator=gen)
        acts = torch.randint(0, cfg.num_actions, (sum(lengths),), generator=gen)
        got = session.run(None, {"items": items.numpy(), "prev_actions": acts.numpy(), "seq_offsets": off.numpy()})
        with torch.no_grad():
            want = oracle(items, acts, off).numpy()
        assert got[0].shape == want.shape == (sum(lengths), cfg.num_tasks), lengths
        np.testing.assert_allclose(got[0], want, **export.TOLERANCE)
    with pytest.raises(Exception, match="int32"):
        session.run(None, {"items": items.numpy(), "prev_actions": acts.numpy(), "seq_offsets": off.int().numpy()})
    assert [t.name for t in session.get_inputs()] == list(export.INPUT_NAMES)
    assert onnx.load(str(path)).graph.input[2].type.tensor_type.elem_type == TensorProto.INT64
