"""Artifacts: round trip, contract schema, rejection of corrupt and stale files, atomic writes."""

from __future__ import annotations

import contextlib
import json
import signal
import warnings

import pytest

from autotune.runtime import artifacts as art


def _entry(**kw):
    e = {
        "dtype": "bfloat16",
        "dqk": 256,
        "dv": 256,
        "num_heads": 4,
        "bucket": 4096,
        "distribution": "uniform",
        "mask": "causal",
        "backend": "triton",
        "config": {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2, "l2_group": 8},
        "median_ms": 1.23,
        "spread_ms": 0.01,
        "tflops": 456.7,
        "default_ms": 1.5,
        "default_tflops": 380.0,
        "speedup": 1.22,
        "trials": 40,
        "tuning_s": 95.0,
    }
    e.update(kw)
    return e


def _artifact(entries=None):
    env = {k: None for k in art.ENV_KEYS}
    env["gpu_name"] = "NVIDIA H100 80GB HBM3"
    hashes = {"triton": art.current_template_hash("hstu_attention_fwd", "triton")}
    return art.Artifact("hstu_attention_fwd", "h100", env, hashes, "abc", entries or [_entry()])


def test_round_trip_and_lookup(tmp_path):
    a = _artifact([_entry(), _entry(distribution="jagged", config={**_entry()["config"], "block_m": 64})])
    path = art.save_artifact(a, art.artifact_path("h100", "hstu_attention_fwd", tmp_path))
    assert path == tmp_path / "h100" / "hstu_attention_fwd.json"
    b = art.load_artifact(path)
    assert b.to_dict() == a.to_dict()
    data = json.loads(path.read_text())
    assert set(data) == set(art.TOP_KEYS) and data["schema_version"] == art.SCHEMA_VERSION
    assert b.lookup("bfloat16", 256, 256, 4096, "jagged")["config"]["block_m"] == 64
    assert b.lookup("bfloat16", 256, 256, 4096)["distribution"] == "uniform"  # preferred without a distribution
    assert b.lookup("bfloat16", 128, 128, 4096) is None
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp files left


def test_upsert_replaces_the_same_key():
    a = _artifact()
    a.upsert(_entry(median_ms=0.9))
    a.upsert(_entry(bucket=8192))
    assert len(a.entries) == 2
    assert a.lookup("bfloat16", 256, 256, 4096)["median_ms"] == 0.9


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(schema_version=99), "schema_version"),
        (lambda d: d.pop("environment"), "missing keys"),
        (lambda d: d.update(extra=1), "unknown keys"),
        (lambda d: d["entries"][0].pop("median_ms"), "missing keys"),
        (lambda d: d["entries"][0].update(median_ms="fast"), "median_ms"),
        (lambda d: d["entries"][0].update(bucket=3000), "bucket"),
        (lambda d: d["entries"][0].update(distribution="zipf"), "distribution"),
        (lambda d: d["entries"][0]["config"].update(block_m=100), "HSTUFwdConfig"),
        (lambda d: d["entries"][0]["config"].update(bogus=1), "HSTUFwdConfig"),
        (lambda d: d["entries"].append(dict(d["entries"][0])), "duplicate"),
        (lambda d: d["entries"][0].update(fill=0), r"fill must be in \(0, 1\]"),
        (lambda d: d["entries"][0].update(fill=-0.5), r"fill must be in \(0, 1\]"),
        (lambda d: d["entries"][0].update(fill=1.5), r"fill must be in \(0, 1\]"),
        (lambda d: d["entries"][0].update(fill="x"), "fill must be"),
        (lambda d: d["entries"][0].update(batch=0), r"batch must be in \[1, 65535\]"),
        (lambda d: d["entries"][0].update(batch=65536), r"entries\[0\]\.batch must be in \[1, 65535\]"),
        (lambda d: d["entries"][0].update(num_heads=10**6), r"entries\[0\]\.num_heads must be <= 32768"),
        (lambda d: d["entries"][0].update(batch=True), "batch must be int"),
        (lambda d: d["entries"][0].update(batch=2.0), "batch must be int"),
        (lambda d: d["entries"][0].update(lengths={"batch_fill": 0.0}), r"lengths.batch_fill must be in \(0, 1\]"),
        (lambda d: d["entries"][0].update(lengths={"batch_fill": "a"}), "lengths.batch_fill must be"),
        (lambda d: d["entries"][0]["config"].update(l2_group=8.0), "config.l2_group must be int"),
        (lambda d: d["entries"][0]["config"].update(num_warps=True), "config.num_warps must be int"),
        (lambda d: d["entries"][0].update(backend="reference"), "'reference' is the fp32 oracle"),
        (lambda d: d["entries"][0].update(backend="nope"), "'nope' is not a backend of hstu_attention_fwd"),
        (lambda d: d["entries"][0].update(verified=[1, "x"]), r"verified\[0\] must be a string"),
        (lambda d: d["entries"][0].update(verified=[["a"]]), r"verified\[0\] must be a string"),
        (lambda d: d["entries"][0].update(tflops=-1.0), "tflops must be >= 0"),
        (lambda d: d["entries"][0].update(default_ms=-1.0), "default_ms must be >= 0"),
        (lambda d: d["entries"][0].update(speedup=-2), "speedup must be >= 0"),
        (lambda d: d["entries"][0].update(tuning_s=-3.0), "tuning_s must be >= 0"),
        (lambda d: d["entries"][0].update(median_ms=10**400), "median_ms must be finite"),  # valid JSON
        (lambda d: d["entries"][0].update(trials=10**400), "trials must be finite"),
        (lambda d: d.update(gpu="../elsewhere"), "gpu must be a lower-case GPU key"),  # the folder merge writes
        (lambda d: d.update(gpu="H100"), "gpu must be a lower-case GPU key"),  # a folder load never reads
        (lambda d: d["entries"][0].update(backend="cute"), "not a valid HSTUCuteFwdConfig"),
        (
            lambda d: d["entries"][0].update(
                backend="cute", config=dict(block_m=128, block_n=64, num_stages=2, intra_wg_overlap=True)
            ),
            # never filled with a default
            r"HSTUCuteFwdConfig: missing fields \['compact', 'l2_group', 'split_heavy', 'tanh_silu'\]",
        ),
        (
            lambda d: d["entries"][0].update(
                backend="cute",
                config=dict(
                    block_m=128,
                    block_n=64,
                    num_stages=2,
                    intra_wg_overlap=True,
                    l2_group=8,
                    compact=False,
                    tanh_silu=False,
                    split_heavy=1,
                ),
            ),
            "no template_hash",
        ),
    ],
)
def test_invalid_artifacts_are_rejected_with_a_clear_message(tmp_path, mutate, message):
    data = _artifact().to_dict()
    mutate(data)
    path = tmp_path / "a.json"
    path.write_text(json.dumps(data))
    with pytest.raises(art.ArtifactError, match=message):
        art.load_artifact(path)


def test_corrupt_and_missing_files(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('{"schema_version": 1, "kern')
    with pytest.raises(art.ArtifactError, match="not valid JSON"):
        art.load_artifact(path)
    with pytest.raises(art.ArtifactError, match="cannot read"):
        art.load_artifact(tmp_path / "missing.json")
    assert art.load_artifact_or_none(tmp_path / "missing.json") is None
    with pytest.warns(RuntimeWarning, match="heuristic defaults"):
        assert art.load_artifact_or_none(path) is None


def test_stale_template_hash_is_refused(tmp_path):
    a = _artifact()
    a.template_hash["triton"] = "0" * 64
    path = art.save_artifact(a, tmp_path / "a.json")
    with pytest.raises(art.ArtifactError, match="stale"):
        art.load_artifact(path)
    assert art.load_artifact(path, check_stale=False).entries  # `show` can still read it
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert art.load_artifact_or_none(path) is None
    assert any("stale" in str(x.message) for x in w)


def test_template_hash_depends_on_sources(tmp_path):
    f = tmp_path / "k.py"
    f.write_text("x = 1\n")
    from autotune import spec

    backend = spec.BackendSpec("triton", None, None, None, None, sources=(str(f),))
    kernel = spec.KernelSpec("test_kernel", "fwd", "m:a", "m:b", "m:c", backends=(backend,))
    spec.register(spec.OpSpec("test_op", kernels=(kernel,)))
    try:
        h1 = art.current_template_hash("test_kernel", "triton")
        f.write_text("x = 2\n")
        assert art.current_template_hash("test_kernel", "triton") != h1
    finally:
        spec.unregister("test_op")
    assert art.current_template_hash("hstu_attention_fwd") != art.current_template_hash("hstu_attention_bwd")


def test_save_refuses_invalid_and_keeps_the_old_file(tmp_path):
    path = art.save_artifact(_artifact(), tmp_path / "a.json")
    before = path.read_text()
    bad = _artifact([_entry(median_ms=-1.0)])
    with pytest.raises(art.ArtifactError):
        art.save_artifact(bad, path)
    assert path.read_text() == before


@pytest.mark.parametrize(
    "field, value, where",
    [
        ("compare", {"a_ms": float("inf"), "b_ms": 1.0}, "compare.a_ms"),
        ("compare", {"rounds": 3, "speedup": float("nan")}, "compare.speedup"),
        ("compare", {"samples": [1.0, float("-inf")]}, r"compare.samples\[1\]"),
        ("lengths", {"count": 10, "mean": float("inf")}, "lengths.mean"),
        ("lengths", {"count": 10**400}, "lengths.count"),  # valid JSON, no float holds it
    ],
)
def test_non_finite_numbers_inside_compare_or_lengths_are_refused(tmp_path, field, value, where):
    """Only top-level numbers were checked: ``compare.a_ms: Infinity`` loaded as usable and a later save wrote
    the non-standard ``Infinity`` back. Load names the field, and save refuses before writing anything."""
    data = _artifact().to_dict()
    data["entries"][0][field] = value
    path = tmp_path / "a.json"
    path.write_text(json.dumps(data))  # Python's json writes Infinity/NaN, as a hand edit might
    with pytest.raises(art.ArtifactError, match=rf"entries\[0\]\.{where} must be finite"):
        art.load_artifact(path)
    target = tmp_path / "b.json"
    with pytest.raises(art.ArtifactError, match=rf"entries\[0\]\.{where} must be finite"):
        art.save_artifact(_artifact([_entry(**{field: value})]), target)
    assert not target.exists()


def test_saved_files_are_strict_json(tmp_path):
    """Every written file parses with a reader that refuses Infinity/NaN (``allow_nan=False`` on the write)."""
    path = art.save_artifact(_artifact([_entry(compare={"a_ms": 1.0, "b_ms": 2.0})]), tmp_path / "a.json")

    def refuse(token: str) -> float:
        raise ValueError(f"non-standard JSON number {token}")

    assert json.loads(path.read_text(), parse_constant=refuse)["entries"][0]["compare"]["b_ms"] == 2.0


def test_optional_timing_key_is_typed_and_unknown_keys_still_fail(tmp_path):
    path = art.artifact_path("h100", "hstu_attention_fwd", tmp_path)
    art.save_artifact(_artifact([_entry(timing="do_bench+cuda_graph")]), path)
    assert art.load_artifact(path).entries[0]["timing"] == "do_bench+cuda_graph"
    for bad, match in ((_entry(timing=3), "timing"), (_entry(bogus=1), "unknown keys")):
        data = _artifact().to_dict()
        data["entries"] = [bad]
        with pytest.raises(art.ArtifactError, match=match):
            art.validate_artifact(data, check_stale=False)


def test_lookup_is_keyed_by_heads_and_mask():
    a = _artifact([_entry(), _entry(num_heads=8, median_ms=2.0), _entry(mask="targets", median_ms=3.0)])
    assert a.lookup("bfloat16", 256, 256, 4096, num_heads=8)["median_ms"] == 2.0
    assert a.lookup("bfloat16", 256, 256, 4096, num_heads=4, mask="targets")["median_ms"] == 3.0
    assert a.lookup("bfloat16", 256, 256, 4096, num_heads=4, mask="causal")["median_ms"] == 1.23
    assert a.lookup("bfloat16", 256, 256, 4096, num_heads=2) is None
    assert a.lookup("bfloat16", 256, 256, 4096, mask="window") is None
    assert a.lookup("bfloat16", 256, 256, 4096)["mask"] == "causal"  # unset: causal preferred


def test_mask_names_match_the_tasks():
    from autotune.tuning.tasks import MASKS

    assert tuple(MASKS) == art.MASKS


def test_unreadable_bytes_are_an_artifact_error(tmp_path):
    path = tmp_path / "a.json"
    path.write_bytes(b"\x80\x81 not utf-8")
    with pytest.raises(art.ArtifactError, match="not UTF-8"):
        art.load_artifact(path)
    path.write_bytes(b"[" * 100000)
    with pytest.raises(art.ArtifactError, match="corrupt"):
        art.load_artifact(path)
    verdict = art.assess_artifact(path)
    assert not verdict.usable and verdict.artifact is None and "corrupt" in verdict.reason


def test_only_templates_that_entries_use_make_an_artifact_stale(tmp_path):
    a = _artifact()
    a.template_hash["cute"] = "0" * 64  # recorded, but no entry runs cute
    path = art.save_artifact(a, tmp_path / "h100" / "hstu_attention_fwd.json")
    assert art.load_artifact(path).entries  # the strict reader agrees
    verdict = art.assess_artifact(path)
    assert verdict.usable and verdict.info == ("the cute template changed since tuning, but no entry uses cute",)
    a.template_hash["triton"] = "0" * 64
    art.save_artifact(a, path)
    verdict = art.assess_artifact(path)
    assert not verdict.usable and "stale artifact: the triton template" in verdict.reason


def test_optional_numbers_may_be_null_and_a_fill_of_one_is_valid(tmp_path):
    a = _artifact([_entry(default_ms=None, default_tflops=None, speedup=None, fill=1, verified=["a/causal/bf16"])])
    path = art.save_artifact(a, tmp_path / "h100" / "hstu_attention_fwd.json")
    assert art.load_artifact(path).entries[0]["fill"] == 1


def test_a_tuned_entry_records_its_batch_and_loads_with_it(tmp_path):
    """An entry records the batch size it was timed on (``--from-artifact`` times that batch again); entries from
    before lack the key and load as they did."""
    from autotune.tuning.tasks import Task
    from autotune.tuning.tuner import TaskResult

    task = Task("hstu_attention_fwd", "h100", "bfloat16", 256, 256, 4, 4096, "uniform", batch=7)
    entry = TaskResult(task, backend="triton", config=_entry()["config"], median_ms=1.0, spread_ms=0.0, tflops=1.0)
    assert entry.entry()["batch"] == 7
    a = _artifact([entry.entry(), _entry(bucket=8192)])
    path = art.save_artifact(a, tmp_path / "h100" / "hstu_attention_fwd.json")
    assert [e.get("batch") for e in art.load_artifact(path).entries] == [7, None]


def test_a_file_whose_kernel_is_not_its_name_is_not_used(tmp_path, capsys):
    """A backward artifact saved as hstu_attention_fwd.json: rejected by the verdict that load and show share."""
    from autotune.tuning.cli import main

    a = _artifact()
    path = art.save_artifact(a, tmp_path / "h100" / "hstu_attention_bwd.json")
    v = art.assess_artifact(path, "h100")
    assert not v.usable and "holds kernel 'hstu_attention_fwd', not 'hstu_attention_bwd'" in v.reason
    assert main(["show", "--gpu", "h100", "--artifacts", str(tmp_path)]) == 1
    assert "holds kernel" in capsys.readouterr().out


def test_saved_artifacts_are_readable_as_the_umask_allows(tmp_path):
    import os

    old = os.umask(0o022)
    try:
        path = art.save_artifact(_artifact(), tmp_path / "h100" / "hstu_attention_fwd.json")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644


def test_merge_touches_nothing_outside_the_root_for_a_bad_kernel_or_gpu(tmp_path):
    """A kernel or GPU name from a merged file ('../..') must not place the lock file or folders outside root."""
    from autotune.tuning.artifact_io import merge_entries

    root = tmp_path / "root"
    root.mkdir()
    env = _artifact().environment
    for kernel, gpu in (("../../evil", "h100"), ("hstu_attention_fwd", "../../evil"), ("hstu_attention_fwd", "")):
        with pytest.raises(ValueError):
            merge_entries(kernel, gpu, [], root, env)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["root"]


def test_merge_replaces_a_file_of_another_kernel_under_the_kernels_name(tmp_path):
    """Another kernel's artifact at <gpu>/<kernel>.json is unusable (dispatch rejects it): a merge replaces it
    with a warning, as it does an invalid file, instead of failing on its entries (or adopting them)."""
    from autotune.tuning.artifact_io import merge_entries

    src = art.load_artifact(art.REPO_ROOT / "artifacts" / "h100" / "gemm_silu.json", check_stale=False)
    path = art.artifact_path("h100", "hstu_attention_fwd", tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(src.to_dict()))
    with pytest.warns(RuntimeWarning, match="holds kernel 'gemm_silu'"):
        merge_entries("hstu_attention_fwd", "h100", [_entry()], tmp_path, src.environment)  # same timing env
    merged = art.load_artifact(path)
    assert merged.kernel == "hstu_attention_fwd" and [e["config"] for e in merged.entries] == [_entry()["config"]]


def test_a_template_hash_key_no_spec_declares_is_refused_without_reading_its_path(tmp_path):
    """A ``template_hash`` key names a backend, never a path: '../<dir>' hashed the ``.py`` files there (and '/'
    walked the whole filesystem). It hashes no file, and a key no spec declares for the kernel is an ArtifactError,
    so load warns and skips the file."""
    import os

    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "x.py").write_text("secret = 1\n")
    escape = os.path.relpath(evil, art.REPO_ROOT / "kernel_templates")
    nothing = art.current_template_hash("no_such_kernel", "triton")  # a pair no spec declares hashes no file
    assert art.current_template_hash("hstu_attention_fwd", escape) == nothing
    for key in (escape, "nope"):
        data = _artifact().to_dict()
        data["template_hash"][key] = "0" * 64
        path = tmp_path / "h100" / "hstu_attention_fwd.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(data))
        with pytest.raises(art.ArtifactError, match="template_hash key .* is not a backend of hstu_attention_fwd"):
            art.load_artifact(path, check_stale=False)
        verdict = art.assess_artifact(path, "h100")
        assert not verdict.usable and "template_hash key" in verdict.reason
        with pytest.warns(RuntimeWarning, match="template_hash key"):
            assert art.load_artifact_or_none(path) is None


class _Blocked(BaseException):
    """Raised by the alarm: a BaseException, so no ``except OSError`` / ``except Exception`` on the way hides it."""


@contextlib.contextmanager
def _fails_instead_of_hanging(seconds: int = 20):
    """A read that blocks (a FIFO with no writer) raises ``_Blocked`` here instead of hanging the suite."""

    def expire(*_):
        raise _Blocked(f"blocked for {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_a_fifo_or_huge_artifact_is_refused_without_reading_it(tmp_path, capsys):
    """A FIFO named <kernel>.json hung ``load_artifact`` and ``autotune show`` (a read with no writer never
    returns); a file of GBs was read whole. Both are an ArtifactError naming the path, read nothing."""
    import os

    from autotune.runtime import bundle
    from autotune.tuning.cli import main

    folder = tmp_path / "h100"
    folder.mkdir()
    fifo = folder / "hstu_attention_fwd.json"
    os.mkfifo(fifo)
    big = folder / "hstu_attention_bwd.json"
    with open(big, "wb") as f:
        f.truncate(art.MAX_ARTIFACT_BYTES + 1)  # sparse: no disk used
    with _fails_instead_of_hanging():
        with pytest.raises(art.ArtifactError, match="not a regular file") as e:
            art.read_regular_file(fifo)
        assert str(fifo) in str(e.value)
        with pytest.raises(art.ArtifactError, match="larger than an artifact may be") as e:
            art.load_artifact(big)
        assert str(big) in str(e.value)
        assert not art.assess_artifact(fifo, "h100").usable
        assert main(["show", "--gpu", "h100", "--artifacts", str(tmp_path)]) == 1
        out = capsys.readouterr().out
        assert "not a regular file" in out and "larger than an artifact" in out
        os.mkfifo(tmp_path / bundle.MANIFEST)
        problems = bundle.verify_bundle(tmp_path)
    assert len(problems) == 1 and "not a regular file" in problems[0], problems
    small = tmp_path / "small.json"
    small.write_bytes(b"[1, 2, 3]")
    assert art.read_regular_file(small, 9) == b"[1, 2, 3]"
    with pytest.raises(art.ArtifactError, match="larger than"):
        art.read_regular_file(small, 8)


def test_a_write_over_an_unusable_file_keeps_its_old_content_aside(tmp_path):
    """A tuner writing into a folder whose file holds one bad entry replaced the file whole: the old bytes
    are renamed to <kernel>.json.unusable-<time> (which load, show and verify do not read), not lost."""
    from autotune.tuning.artifact_io import merge_entries

    a = _artifact()
    path = art.artifact_path("h100", "hstu_attention_fwd", tmp_path)
    path.parent.mkdir(parents=True)
    data = a.to_dict()
    data["entries"][0]["config"]["block_m"] = "128"
    path.write_text(json.dumps(data))
    before = path.read_bytes()
    with pytest.warns(RuntimeWarning, match="kept as"):
        merge_entries("hstu_attention_fwd", "h100", [_entry(bucket=1024)], tmp_path, a.environment)
    assert [e["bucket"] for e in art.load_artifact(path).entries] == [1024]
    (aside,) = [p for p in path.parent.glob(f"{path.name}.unusable-*")]
    assert aside.read_bytes() == before and not list(path.parent.glob("*.json.*.tmp"))


@pytest.mark.parametrize("value", [float("nan"), {"x": 1}, [1], 3])
def test_an_extra_environment_value_that_is_no_string_is_refused(tmp_path, value):
    """``environment`` values are strings or null (docs/CONTRACTS.md); only the known keys were checked, so an extra
    key holding NaN or an object loaded as usable and the next save of the file (merge, verify --write) raised
    ``ValueError: Out of range float values`` from json. An extra string or null still loads."""
    data = _artifact().to_dict()
    path = tmp_path / "a.json"
    for extra in ("host", None):
        data["environment"]["note"] = extra
        path.write_text(json.dumps(data))
        art.load_artifact(path)
    data["environment"]["note"] = value
    path.write_text(json.dumps(data))  # NaN as the non-standard literal, as a bad writer leaves it
    with pytest.raises(art.ArtifactError, match="environment.note must be"):
        art.load_artifact(path)
