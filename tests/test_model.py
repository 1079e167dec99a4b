"""HSTU ranking model: Triton kernels match the reference, the loss falls, configs fail clearly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from autotune.runtime import dispatch
from models.config import PRESETS, ModelConfig, get_config
from models.data import JaggedBatch, SyntheticJaggedDataset
from models.hstu import HSTURankingModel
from models.metrics import step_flops
from models.train import build, main, run


@pytest.fixture(autouse=True)
def _fresh_dispatch():
    dispatch.reset()
    yield
    dispatch.reset()


@pytest.mark.parametrize("head_dim", [32, 24])
def test_triton_model_matches_reference_loss_and_grads(device, head_dim):
    """Three Adam steps, fp32, dropout 0: same losses and gradients with either kernel source; head dim 24
    (no kernel of its own) runs zero-padded to 32."""
    base = get_config("tiny", dropout=0.0, head_dim=head_dim, hidden_dim=2 * head_dim)
    models = {src: build(base.replace(kernels=src), torch.device(device)) for src in ("reference", "default")}
    data = SyntheticJaggedDataset(base)
    for step in range(3):
        batch = data.batch(step).to(device)
        losses, grads = {}, {}
        for src, (model, opt) in models.items():
            loss = model.loss(batch)
            loss.backward()
            losses[src] = loss.detach()
            grads[src] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.testing.assert_close(losses["default"], losses["reference"], atol=1e-5, rtol=1e-5)
        assert grads["default"].keys() == grads["reference"].keys()
        for name, g in grads["reference"].items():
            torch.testing.assert_close(
                grads["default"][name], g, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
            )
    assert any(c.backend == "triton" for c in dispatch._CACHE.values())


def test_loss_decreases_on_synthetic_task():
    cfg = get_config("tiny", kernels="reference", lr=3e-3)
    result = run(cfg, steps=80, device="cpu", warmup=0, log_every=1, progress=False)
    losses = [loss for _, loss in result["losses"]]
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < first - 0.08, (first, last)


def test_priming_runs_each_timed_batch_once_untimed_and_changes_no_result(monkeypatch):
    """A jagged batch may select a kernel config no warm-up step compiled; priming runs the timed batches'
    forward and backward before the clock starts, with no optimizer step and the RNG restored, so losses
    (dropout included) are those of the unprimed run."""
    from models.hstu import HSTURankingModel

    calls = []
    loss = HSTURankingModel.loss
    monkeypatch.setattr(
        HSTURankingModel, "loss", lambda self, batch: calls.append(batch.num_tokens) or loss(self, batch)
    )
    cfg = get_config("tiny", kernels="reference", dropout=0.3)
    plain = run(cfg, steps=3, device="cpu", warmup=1, log_every=1, progress=False, prime=False)
    n_plain, calls[:] = list(calls), []
    primed = run(cfg, steps=3, device="cpu", warmup=1, log_every=1, progress=False, prime=True)
    assert (plain["primed"], primed["primed"]) == (False, True)
    assert calls == n_plain[:1] + n_plain[1:] + n_plain[1:]  # warm-up, the 3 timed batches primed, then timed
    assert primed["losses"] == plain["losses"] and primed["tokens"] == plain["tokens"]
    with pytest.raises(ValueError, match="prime must be a bool"):
        run(cfg, steps=1, device="cpu", progress=False, prime=1)


def test_train_cli_writes_metrics(tmp_path, device):
    out = tmp_path / "m.json"
    main(["--preset", "tiny", "--kernels", "default", "--steps", "2", "--warmup", "1", "--device", device,
          "--no-progress", "--json", str(out), "--set", "dropout=0.2"])  # fmt: skip
    result = json.loads(out.read_text())
    assert result["kernels"] == "default" and result["preset"] == "tiny"
    assert result["tokens_per_s"] > 0 and result["tflops"] > 0 and result["tokens"] > 0
    assert len(result["losses"]) == 3 and result["config"]["dropout"] == 0.2


def test_tuned_without_artifacts_warns_and_runs(tmp_path, device):
    with pytest.warns(dispatch.DispatchWarning, match="no artifact for GPU 'h100'"):
        result = run(get_config("tiny", kernels="tuned"), steps=1, warmup=0, artifacts=str(tmp_path), gpu="h100",
                     progress=False, device=device)  # fmt: skip
    assert result["dispatch"]["warnings"] and result["dispatch"]["choices"][0]["chosen_from"] == "default"


def test_dispatch_report_tells_choices_of_one_bucket_apart_by_fill_and_mask():
    """Calls without a hint are chosen by fill too: the run's report listed a kernel's choices of one bucket twice
    with nothing to tell them apart (no fill, no mask). Each row says its fill (None for a pinned hint) and mask."""
    from models.train import _dispatch_report

    dispatch.reset()
    try:
        for fill, mask, dist in ((1.0, "causal", None), (0.1, "causal", None), (None, "window", "jagged")):
            dispatch.select("hstu_attention_fwd", "float32", 32, 32, 2, 1000, dist, "default", mask, fill)
        rows = _dispatch_report(None)["choices"]
    finally:
        dispatch.reset()
    got = sorted((r["fill"] is None, r["fill"], r["mask"], r["distribution"], r["length_bucket"]) for r in rows)
    want = [(False, round(2 ** (-13 / 4), 4), "causal", None, 1024), (False, 1.0, "causal", None, 1024)]
    assert got == [*want, (True, None, "window", "jagged", 1024)]


def test_tuned_default_artifacts_are_the_packaged_ones(tmp_path, monkeypatch, device):
    """--kernels tuned without --artifacts loads the shipped artifacts (autotune.load()), whatever the cwd."""
    from autotune.runtime.artifacts import DEFAULT_ROOT

    monkeypatch.chdir(tmp_path)  # no ./artifacts here
    seen = {}
    real_load = dispatch.load

    def spy(path=None, gpu=None, allow_same_arch=False):
        seen["path"] = path
        return real_load(path, gpu, allow_same_arch)

    monkeypatch.setattr(dispatch, "load", spy)
    run(get_config("tiny", kernels="tuned"), steps=1, warmup=0, gpu="h100", progress=False, device=device)
    assert seen["path"] is None
    assert Path(dispatch.summary()["path"]).resolve() == DEFAULT_ROOT.resolve()


@pytest.mark.parametrize(
    ("preset", "overrides", "match"),
    [
        ("huge", {}, "unknown preset 'huge'"),
        ("tiny", {"hidden_dim": 96}, r"hidden_dim \(96\) must equal num_heads \* head_dim"),
        ("tiny", {"kernels": "fast"}, "kernels must be one of"),
        ("tiny", {"head_dim": 48, "hidden_dim": 96, "layer": "fused"}, "no kernel of its own"),
        ("tiny", {"head_dim": 320, "hidden_dim": 640}, "above the kernels' largest head dim 256"),
        ("tiny", {"min_seq_len": 64}, "min_seq_len"),
        ("tiny", {"length_dist": "zipf"}, "length_dist"),
        ("tiny", {"attention_hint": "zipf"}, "attention_hint must be one of"),
        ("tiny", {"num_layer": 3}, "unknown config field"),
        ("tiny", {"dropout": 1.5}, "dropout"),
        ("tiny", {"dropout": "0.1"}, "dropout must be a number"),
        ("tiny", {"eps": float("nan")}, "eps must be a positive finite number, got nan"),
        ("tiny", {"lr": float("inf")}, "lr must be a positive finite number"),
        ("tiny", {"zipf_alpha": 0}, "zipf_alpha must be a positive"),
        ("tiny", {"label_noise": None}, "label_noise must be a number"),
        ("tiny", {"seed": -1}, r"seed must be an int in \[0, 2\*\*64\)"),
        ("tiny", {"seed": 1.5}, "seed must be an int in"),
        ("tiny", {"seed": 2**64}, r"seed must be an int in \[0, 2\*\*64\), got 18446744073709551616"),
        ("tiny", {"num_actions": 5.5}, "num_actions must be an int >= 5"),
        ("tiny", {"length_dist": "file", "lengths_file": 123}, "lengths_file must be a path string"),
        ("tiny", {"zero_copy": False}, "zero_copy=False .* needs layer='fused'"),
        # du_silu=False on the unfused layer was accepted and ignored (the unfused layer has no SiLU' pass to move)
        ("tiny", {"du_silu": False}, "du_silu=False .* needs layer='fused'"),
        ("tiny", {"cuda_graph": True, "kernels": "reference"}, "cuda_graph .* kernels must be 'default' or 'tuned'"),
    ],
)
def test_bad_configs_raise_clear_errors(preset, overrides, match):
    with pytest.raises(ValueError, match=match):
        get_config(preset, **overrides)


@pytest.mark.parametrize("over", [{"precision": "bf16"}, {"recompute": "pre"}, {"du_silu": False}, {"dropout": 1.5}])
def test_a_layer_of_an_unvalidated_config_names_the_field(over):
    """``HSTULayer`` is public (``models.HSTULayer``): built from a ``ModelConfig(...)`` that never went through
    ``validate``, fused-layer options on the unfused layer ran as if unset, and a bad dropout failed only in the
    first forward. It validates its config as ``HSTURankingModel`` does."""
    from models.hstu import HSTULayer

    with pytest.raises(ValueError, match=next(iter(over))):
        HSTULayer(ModelConfig(**over))


def test_presets_and_flop_accounting():
    for name in PRESETS:
        get_config(name).validate()
    seed = get_config("seed")
    assert (seed.num_layers, seed.num_heads, seed.head_dim, seed.hidden_dim, seed.batch_size) == (8, 4, 256, 1024, 32)
    assert seed.max_seq_len in (4096, 8192) and seed.distribution == "uniform"
    # Head dims the kernels lack: padded by the unfused layer's attention call; any with the reference.
    assert get_config("tiny", head_dim=48, hidden_dim=96).head_dim == 48
    assert get_config("tiny", kernels="reference", head_dim=320, hidden_dim=640).head_dim == 320
    model = HSTURankingModel(get_config("tiny"))
    h, d, layers = 2, 32, 2
    per_layer = 64 * 4 * h * d + h * d * 64
    heads = 2 * (64 * 64 + 64)
    assert model.dense_params() == layers * per_layer + heads
    flops = step_flops(get_config("tiny"), [32, 10], dense_params=1000)
    pairs = 32 * 32 // 2 + 10 * 10 // 2
    assert flops["attention"] == layers * (2 * h * 2 * d + 2 * h * 5 * d) * pairs
    assert flops["gemm"] == 6 * 1000 * 42


def test_whole_model_compiles_without_graph_breaks(device):
    cfg = get_config("tiny", dropout=0.0)
    model, _ = build(cfg, torch.device(device))
    batch = SyntheticJaggedDataset(cfg).batch(0).to(device)
    eager = model.loss(batch)
    explained = torch._dynamo.explain(model.loss)(batch)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(model.loss, backend="aot_eager")(batch)
    torch.testing.assert_close(compiled, eager)


def test_set_kernels_is_not_overridden_and_log_every_is_checked(tmp_path):
    out = tmp_path / "m.json"
    main(["--preset", "tiny", "--set", "kernels=reference", "--steps", "1", "--warmup", "0", "--device", "cpu",
          "--no-progress", "--json", str(out)])  # fmt: skip
    assert json.loads(out.read_text())["kernels"] == "reference"
    with pytest.raises(ValueError, match="log_every must be an int >= 1"):
        run(get_config("tiny", kernels="reference"), steps=1, warmup=0, log_every=0, progress=False)


@pytest.mark.parametrize(
    "argv",
    [["--steps", "0"], ["--warmup", "-1"], ["--log-every", "0"], ["--dtype", "fp16"], ["--set", "foo=1"],
     ["--set", "num_layers"], ["--set", "num_layers=2.5"], ["--preset", "nope"], ["--device", "nope"],
     ["--device", "cpu", "--cuda-graph"], ["--device", "cpu", "--layer", "fused", "--precision", "bf16"],
     ["--dtype", "fp32", "--layer", "fused", "--precision", "bf16"], ["--graph-tokens", "64"],
     ["--seed", str(2**64)], ["--artifacts", "/nonexistent/artifacts"], ["--gpu", "x100"]],
)  # fmt: skip
def test_train_cli_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--preset", "tiny", "--kernels", "reference", "--no-progress", *argv])
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "named"), [(["--artifacts", "no/such/dir"], "--artifacts"), (["--gpu", "x100"], "--gpu")]
)
def test_a_missing_artifacts_folder_or_unknown_gpu_is_named_before_training(argv, named, capsys, monkeypatch):
    """Under --kernels tuned either made every kernel fall back to its default with a warning after the set-up
    (on a CPU naming the missing GPU, not the missing folder): a usage error naming the option, before anything is
    built, whatever the kernels."""
    monkeypatch.setattr("models.train.build", lambda *a: pytest.fail("the model was built before the checks"))
    with pytest.raises(SystemExit) as e:
        main(["--preset", "tiny", "--kernels", "reference", "--device", "cpu", "--steps", "1", "--no-progress", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"error: {named}" in err, err


@pytest.mark.parametrize("argv", [["--artifacts", "."], ["--allow-same-arch"]])
@pytest.mark.parametrize("kernels", ["reference", "default"])
def test_tuned_artifact_options_need_kernels_tuned(argv, kernels, capsys, monkeypatch, tmp_path):
    """Only --kernels tuned loads artifacts: with other kernels an existing --artifacts folder and --allow-same-arch
    were accepted and ignored (the run used no artifact, without a word). A usage error naming the option."""
    monkeypatch.setattr("models.train.build", lambda *a: pytest.fail("the model was built before the checks"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    argv = [str(tmp_path) if a == "." else a for a in argv]
    with pytest.raises(SystemExit) as e:
        main(["--preset", "tiny", "--kernels", kernels, "--device", "cpu", "--steps", "1", "--no-progress", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"error: {argv[0]}" in err and "--kernels tuned" in err, err


def test_gpu_key_in_capitals_reports_mfu():
    """``--gpu H100`` passed the CLI's check and loaded h100's artifacts, but the report looked the peak up as "H100":
    no peak and no MFU (``n/a``), as on an unknown GPU. The key is the registry's, in any case."""
    result = run(get_config("tiny", kernels="reference"), steps=1, warmup=0, gpu="H100", progress=False)
    assert result["gpu"] == "h100" and result["peak_tflops"] == 989.0 and result["mfu"] is not None


def test_every_set_option_applies(tmp_path):
    """``--set`` given twice keeps both (argparse's plain ``nargs`` kept only the last one, silently)."""
    out = tmp_path / "m.json"
    main(["--preset", "tiny", "--kernels", "reference", "--set", "num_layers=1", "--set", "dropout=0.0",
          "--steps", "1", "--warmup", "0", "--device", "cpu", "--no-progress", "--json", str(out)])  # fmt: skip
    cfg = json.loads(out.read_text())["config"]
    assert (cfg["num_layers"], cfg["dropout"]) == (1, 0.0)


def test_a_diverged_loss_stops_the_run(tmp_path, capsys):
    """A non-finite loss is an error at the next read-back, not a run that reports throughput on NaNs."""
    cfg = get_config("tiny", kernels="reference", lr=1e6)
    with pytest.raises(FloatingPointError, match=r"the loss is nan at step \d+: training diverged"):
        run(cfg, steps=6, warmup=0, log_every=1, progress=False)
    out = tmp_path / "m.json"
    out.write_text('{"tokens_per_s": 1}')  # an earlier run's result: not to be read as this one's
    with pytest.raises(SystemExit) as e:
        main(["--preset", "tiny", "--kernels", "reference", "--set", "lr=1e6", "--steps", "6", "--warmup", "0",
              "--log-every", "1", "--device", "cpu", "--no-progress", "--json", str(out)])  # fmt: skip
    assert e.value.code == 1 and "training diverged" in capsys.readouterr().err and not out.exists()


def test_set_values_take_their_field_types():
    from models.config import parse_overrides

    got = parse_overrides(["lengths_file=123", "dropout=0.25", "zero_copy=false", "num_layers=3", "layer=fused"])
    assert got == {"lengths_file": "123", "dropout": 0.25, "zero_copy": False, "num_layers": 3, "layer": "fused"}


@pytest.mark.parametrize("over", [{}, {"layer": "fused"}, {"layer": "fused", "precision": "bf16"}])
def test_a_batch_of_empty_sequences_has_zero_loss_and_gradients(device, over):
    """Every sequence empty (L = 0): the loss is 0, not a mean over nothing (NaN), and every gradient is zero."""
    cfg = get_config("tiny", kernels="default", **over)
    model = HSTURankingModel(cfg).to(device)
    empty = torch.zeros(0, dtype=torch.long, device=device)
    labels = torch.zeros(0, cfg.num_tasks, device=device)
    batch = JaggedBatch(empty, empty, empty, labels, torch.zeros(4, dtype=torch.long, device=device), [0, 0, 0])
    loss = model.loss(batch)
    loss.backward()
    assert loss.item() == 0.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


@pytest.mark.parametrize("precision", ["autocast", "bf16"])
def test_a_sequence_above_max_seq_len_is_named_before_the_position_table(precision):
    """A batch whose sequence outgrows max_seq_len indexed past the position embedding: a bare IndexError on the
    CPU (a device-side assert on a GPU) before the attention call could name the length."""
    over = {"layer": "fused", "precision": "bf16", "kernels": "default"} if precision == "bf16" else {}
    cfg = get_config("tiny", **{"kernels": "reference", "max_seq_len": 8, "min_seq_len": 2, **over})
    model = HSTURankingModel(cfg)
    n = 11
    rows = torch.zeros(n, dtype=torch.long)
    batch = JaggedBatch(rows, rows, torch.arange(n), torch.zeros(n, cfg.num_tasks), torch.tensor([0, 1, n]), [1, n - 1])
    with pytest.raises(ValueError, match="sequence of 10 tokens \\(sequence 1\\), above the model's max_seq_len 8"):
        model.loss(batch)


@pytest.mark.parametrize(
    ("kw", "match"),
    [({"steps": 2.5}, "steps must be an int >= 1, got 2.5"), ({"warmup": True}, "warmup must be an int >= 0"),
     ({"workers": -1}, "workers must be an int >= 0"), ({"device": "meta"}, "device must be cpu or cuda"),
     ({"dtype": "fp16"}, "dtype must be 'bf16', 'fp32' or None, got 'fp16'"),
     ({"device": None}, "device must be a str or torch.device"),
     ({"cfg": "tiny"}, "cfg must be a ModelConfig"),
     ({"cfg": ModelConfig(num_layers=0)}, "num_layers must be a positive int, got 0"),
     # graph_tokens without cuda_graph: the CLI refused it, run() took eager steps without a word
     ({"cfg": get_config("tiny", kernels="reference", graph_tokens=16)}, "graph_tokens pads the batches")],
)  # fmt: skip
def test_run_checks_its_arguments_before_set_up(kw, match, monkeypatch):
    """A float step count failed in ``range`` after the model was built, a meta device inside autocast, a bad
    dtype after the model was built, a config built without validation with another check's message."""
    monkeypatch.setattr("models.train.build", lambda *a: pytest.fail("the model was built before the checks"))
    kw = {"cfg": get_config("tiny", kernels="reference"), "steps": 1, **kw}
    with pytest.raises(ValueError, match=match):
        run(**kw, progress=False)


def test_train_cli_refuses_unusable_device_and_json_path_up_front(tmp_path, capsys):
    """``--json`` below a file was only found when writing it after the whole run; ``--device cuda`` on a host
    without CUDA ended in torch's bare assertion: both are usage errors (exit 2) naming the option."""
    (tmp_path / "file").write_text("")
    bad = [["--json", str(tmp_path / "file" / "sub" / "m.json")], ["--device", "meta"]]
    if not torch.cuda.is_available():
        bad.append(["--device", "cuda"])
    for argv in bad:
        with pytest.raises(SystemExit) as e:
            main(["--preset", "tiny", "--kernels", "reference", "--steps", "1", "--warmup", "0", "--no-progress",
                  *argv])  # fmt: skip
        err = capsys.readouterr().err
        assert e.value.code == 2 and ("--json" in err or "device" in err), (argv, err)
    assert not (tmp_path / "file").is_dir()


def test_train_json_onto_the_lengths_file_is_refused(tmp_path, capsys, monkeypatch):
    """``--json`` naming the ``lengths_file`` the batches draw from: main removes the --json file before the run (a
    failed run leaves no older report), so the user's lengths were deleted and the first batch failed on the missing
    file, a traceback. A usage error naming --json, before anything is removed; the same name spelled another way
    (relative, ./) too."""
    monkeypatch.chdir(tmp_path)
    lengths = tmp_path / "lengths.json"
    lengths.write_text("[10, 20, 30]\n")
    for json_name in (str(lengths), "./lengths.json"):
        with pytest.raises(SystemExit) as e:
            main(["--preset", "tiny", "--kernels", "reference", "--steps", "1", "--warmup", "0", "--no-progress",
                  "--set", "length_dist=file", "lengths_file=lengths.json", "--json", json_name])  # fmt: skip
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--json" in err and "lengths_file" in err, err
        assert lengths.read_text() == "[10, 20, 30]\n"


@pytest.mark.parametrize("tuned", [True, False])
def test_train_json_onto_an_artifact_file_is_refused(tmp_path, capsys, monkeypatch, tuned):
    """``--json`` naming a tuned artifact (of ``--artifacts``, or of the packaged root): main removed it before the
    run, which fell back to the default configs with a warning, and wrote the metrics in its place, a file
    autotune.load rejects. A usage error naming --json, the artifact left as it was."""
    import autotune.runtime.artifacts as art

    root = tmp_path / "arts"
    (root / "h100").mkdir(parents=True)
    artifact = root / "h100" / "hstu_attention_fwd.json"
    artifact.write_bytes((art.DEFAULT_ROOT / "h100" / "hstu_attention_fwd.json").read_bytes())
    before = artifact.read_bytes()
    if tuned:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        argv = ["--kernels", "tuned", "--artifacts", str(root), "--gpu", "h100", "--set", "num_layers=1"]
    else:  # the packaged artifacts (no --artifacts), which only --kernels tuned reads, are no place for it either
        monkeypatch.setattr(art, "DEFAULT_ROOT", root)
        argv = ["--kernels", "reference"]
    with pytest.raises(SystemExit) as e:
        main([*argv, "--preset", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", "--no-progress",
              "--json", str(artifact)])  # fmt: skip
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--json" in err and "artifact file" in err, err
    assert artifact.read_bytes() == before


@pytest.mark.parametrize("argv", [[], ["--kernels", "tuned"], ["--layer", "fused"]])
def test_gpu_kernels_on_a_cpu_without_the_interpreter_are_a_usage_error(argv, capsys, monkeypatch):
    """The preset's 'default' kernels on a CPU without TRITON_INTERPRET=1 failed in dispatch after the set-up,
    a deep traceback: a usage error naming --kernels and the value that runs on a CPU, before anything is built."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as e:
        main(["--preset", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", "--no-progress", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error: --kernels" in err and "--kernels reference" in err, err
    with pytest.raises(ValueError, match="--kernels default runs Triton/CuTe GPU kernels"):
        run(get_config("tiny"), steps=1, warmup=0, device="cpu", progress=False)


def test_graph_step_pads_an_empty_batch(tmp_path):
    """A CUDA-graph step pads an empty batch to one granule (``granularity`` rows), one row more than any other
    batch pads: ``padding_slots`` holds it also when granularity - 1 is a multiple of max_seq_len (33 rows need 2
    slots of 32); the padded empty batch has loss 0 and zero gradients."""
    from models.graphs import graph_capacity, pad_batch, padded_offsets, padding_slots

    msl = 32
    for gran in (1, 7, 31, 32, 33, 64, 65, 100):
        for n in (0, 1, gran - 1, gran, gran + 1, 3 * msl):
            lengths = [msl] * (n // msl) + ([n % msl] if n % msl else [])
            offsets = padded_offsets(lengths, graph_capacity(n, gran), padding_slots(gran, msl), msl)
            assert int(offsets[-1]) == graph_capacity(n, gran) and int(offsets.diff().max()) <= msl
    cfg = get_config("tiny", kernels="reference", dropout=0.0)
    model = HSTURankingModel(cfg)
    empty = torch.zeros(0, dtype=torch.long)
    batch = JaggedBatch(empty, empty, empty, torch.zeros(0, cfg.num_tasks), torch.zeros(3, dtype=torch.long), [0, 0])
    padded = pad_batch(batch, graph_capacity(0, 33), padding_slots(33, msl), msl)
    loss = model.loss(padded)
    loss.backward()
    assert padded.num_tokens == 33 and loss.item() == 0.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_mfu_counts_every_gpu_of_a_data_parallel_run():
    """A data-parallel run's TFLOP/s are the world's, so its MFU divides by the world's peak (4 H100s at 2,475
    TFLOP/s together were reported as 250% MFU)."""
    from models.metrics import model_flops_utilization

    assert model_flops_utilization(989.0, 989.0, 1) == pytest.approx(1.0)
    assert model_flops_utilization(1236.7, 989.0, 4) == pytest.approx(1236.7 / 3956.0)
    assert model_flops_utilization(100.0, None, 2) is None
    with pytest.raises(ValueError, match="gpus must be a positive int"):
        model_flops_utilization(100.0, 989.0, 0)


def test_train_help_lists_every_accepted_recompute_layer_and_precision():
    """``--recompute``'s help listed none | uvqk | ln | uvqk+ln: ``pre`` and ``pre+ln`` (the fused GEMM + SiLU
    forward keeping SiLU's output only), which the config accepts and bench_layer's last column runs, were
    not named, so a user reading ``--help`` could not find them."""
    from models.config import KERNEL_SOURCES, LAYER_IMPLS, PRECISIONS, RECOMPUTE
    from models.train import make_parser

    helps = {a.dest: a.help for a in make_parser()._actions}
    for dest, allowed in (("recompute", RECOMPUTE), ("layer", LAYER_IMPLS), ("precision", PRECISIONS),
                          ("kernels", KERNEL_SOURCES)):  # fmt: skip
        assert all(value in helps[dest] for value in allowed), (dest, helps[dest])
