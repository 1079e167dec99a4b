"""Artifacts that know their origin: GPU, architecture and version checks at load, entries keyed by
heads and mask, lengths above the largest bucket, no file content that makes ``load`` raise, and
``autotune show`` printing the same verdict that ``load`` acts on.

The running GPU is simulated by patching ``autotune.runtime.gpus.environment``; the GPU key is always passed.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

import autotune
from autotune.runtime import artifacts as art
from autotune.runtime import dispatch, gpus
from autotune.tuning.cli import main
from autotune.tuning.tasks import MASKS
from kernel_templates.hstu_attention.config import default_bwd_config, default_fwd_config

FWD, BWD = "hstu_attention_fwd", "hstu_attention_bwd"
REPO = Path(__file__).resolve().parents[1]
VERSIONS = {"driver": "580.159.04", "cuda": "13.0", "torch": "2.11.0+cu130", "triton": "3.6.0", "cutlass_dsl": "4.8.1"}
H100 = {"gpu_name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "sm_count": 132, **VERSIONS}
H200 = {"gpu_name": "NVIDIA H200", "compute_capability": "9.0", "sm_count": 132, **VERSIONS}
A100 = {"gpu_name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0", "sm_count": 108, **VERSIONS}
CPU = {**dict.fromkeys(art.ENV_KEYS), "gpu_name": "triton-interpreter (cpu)", **VERSIONS, "driver": None}


def _entry(kind: str, bucket: int, block_m: int, num_heads: int = 4, mask: str = "causal") -> dict:
    base = default_fwd_config(64, 64) if kind == FWD else default_bwd_config(64, 64)
    return {
        "dtype": "bfloat16", "dqk": 64, "dv": 64, "num_heads": num_heads, "bucket": bucket,
        "distribution": "uniform", "mask": mask, "backend": "triton",
        "config": dict(base.to_dict(), block_m=block_m, block_n=32, num_warps=4),
        "median_ms": 1.0, "spread_ms": 0.01, "tflops": 100.0, "default_ms": 1.2, "default_tflops": 80.0,
        "speedup": 1.2, "trials": 10, "tuning_s": 1.0,
    }  # fmt: skip


def write(root: Path, folder: str, gpu: str, env: dict, entries: list[dict] | None = None) -> Path:
    """Fwd and bwd artifacts saying ``gpu``/``env``, saved under ``root/folder``; ``entries``: the
    keyword arguments of ``_entry`` (default: one 4096 entry with block_m 128)."""
    for kind in (FWD, BWD):
        rows = [_entry(kind, **kw) for kw in entries or [{"bucket": 4096, "block_m": 128}]]
        hashes = {"triton": art.current_template_hash(kind, "triton")}
        art.save_artifact(art.Artifact(kind, gpu, dict(env), hashes, "s" * 64, rows), root / folder / f"{kind}.json")
    return root


@pytest.fixture(autouse=True)
def _fresh_dispatch(monkeypatch):
    """Fresh dispatch state; the running process is a CPU machine with VERSIONS unless a test says."""
    _running(monkeypatch, CPU)
    dispatch.reset()
    yield
    dispatch.reset()


def _running(monkeypatch, env: dict) -> None:
    monkeypatch.setattr(gpus, "environment", lambda: dict(env))


def _block_m(choice: dispatch.Choice) -> int:
    return json.loads(choice.config)["block_m"]


def _dispatch_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, dispatch.DispatchWarning)]


# ------------------------------------------------------------------------------------------ origin
def test_h100_file_under_h200_is_rejected_naming_both(tmp_path, monkeypatch):
    _running(monkeypatch, H200)
    loaded = autotune.load(str(write(tmp_path, "h200", "h100", H100)), gpu="h200")
    assert loaded["kernels"] == [] and set(loaded["problems"]) == {FWD, BWD}
    with pytest.warns(dispatch.DispatchWarning, match=r"tuned on 'h100'.*h200.*allow_same_arch=True"):
        c = dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, "uniform")
    assert c.source == "default" and _block_m(c) != 128


def test_same_arch_opt_in_uses_it_and_says_so_once(tmp_path, monkeypatch):
    _running(monkeypatch, H200)
    root = write(tmp_path, "h200", "h100", H100)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loaded = autotune.load(str(root), gpu="h200", allow_same_arch=True)
        autotune.load(str(root), gpu="h200", allow_same_arch=True)  # a second load: not said again
        c = dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, "uniform")
    said = _dispatch_warnings(record)
    assert loaded["kernels"] == [BWD, FWD] and not loaded["problems"]
    assert len(said) == 1 and "tuned on 'h100'" in said[0] and "'h200'" in said[0], said
    assert (c.source, _block_m(c)) == ("tuned", 128)


def test_same_arch_opt_in_finds_the_sibling_folder(tmp_path, monkeypatch):
    _running(monkeypatch, H200)
    root = write(tmp_path, "h100", "h100", H100)  # nothing under h200/
    assert set(dispatch.load(root, gpu="h200")["missing"]) >= {FWD, BWD}
    with pytest.warns(dispatch.DispatchWarning, match="allowed by allow_same_arch"):
        loaded = dispatch.load(root, gpu="h200", allow_same_arch=True)
    assert loaded["kernels"] == [BWD, FWD] and loaded["files"][FWD].endswith("h100/hstu_attention_fwd.json")


def test_another_architecture_is_rejected_even_with_the_opt_in(tmp_path, monkeypatch):
    _running(monkeypatch, H100)
    loaded = dispatch.load(write(tmp_path, "a100", "a100", A100), gpu="a100", allow_same_arch=True)
    assert set(loaded["problems"]) == {FWD, BWD}
    assert "another architecture" in loaded["problems"][FWD] and "sm 8.0" in loaded["problems"][FWD]


def test_running_gpu_differs_from_the_files_and_folder(tmp_path, monkeypatch):
    """An h100 artifact in its own folder, loaded by name on an H200: rejected (the running GPU)."""
    _running(monkeypatch, H200)
    loaded = dispatch.load(write(tmp_path, "h100", "h100", H100), gpu="h100")
    assert "this process runs on NVIDIA H200 ('h200')" in loaded["problems"][FWD]


def test_without_a_gpu_only_the_folder_is_checked(tmp_path):
    write(tmp_path, "h100", "h100", H100)
    write(tmp_path, "h200", "h100", H100)
    assert dispatch.load(tmp_path, gpu="h100")["kernels"] == [BWD, FWD]
    assert "lives under 'h200/'" in dispatch.load(tmp_path, gpu="h200")["problems"][FWD]


def test_a_file_contradicting_itself_is_rejected(tmp_path):
    loaded = dispatch.load(write(tmp_path, "h100", "h100", H200), gpu="h100", allow_same_arch=True)
    assert "contradicts itself" in loaded["problems"][FWD]


def test_version_drift_is_warned_once_and_the_file_used(tmp_path, monkeypatch):
    _running(monkeypatch, dict(H100, torch="2.12.0+cu130", driver="590.1", cutlass_dsl=None))
    root = write(tmp_path, "h100", "h100", H100)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loaded = dispatch.load(root, gpu="h100")
        dispatch.load(root, gpu="h100")
    said = _dispatch_warnings(record)
    assert loaded["kernels"] == [BWD, FWD] and not loaded["problems"]
    assert len(said) == 1, said
    assert "torch 2.11.0+cu130 (tuned) vs 2.12.0+cu130 (here)" in said[0] and "driver 580.159.04" in said[0]
    assert "cutlass_dsl" not in said[0]  # unknown on one side: not compared
    assert dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, "uniform").source == "tuned"


# ------------------------------------------------------------------------------ no content raises
GARBAGE = {
    "non-utf8": b'\xff\xfe{"schema_version": 1}',
    "truncated": b'{"schema_version": 1, "kernel": "hstu_attention_fwd", "entr',
    "empty": b"",
    "top-level list": b"[1, 2, 3]",
    "nan": b"NaN",
    "huge int": b'{"schema_version": ' + b"9" * 5000 + b"}",
    "deep nesting": b"[" * 200000 + b"]" * 200000,
}


MUTATIONS = {
    "missing keys": lambda d: d.pop("entries"),
    "wrong type": lambda d: d.update(entries="many"),
    "entry not an object": lambda d: d.update(entries=[3]),
    "inf median": lambda d: d["entries"][0].update(median_ms=float("inf")),
    "nan tflops": lambda d: d["entries"][0].update(tflops=float("nan")),
    "huge block": lambda d: d["entries"][0]["config"].update(block_m=10**400),
    "bool bucket": lambda d: d["entries"][0].update(bucket=True),
    "unknown mask": lambda d: d["entries"][0].update(mask="sliding"),
    "zero heads": lambda d: d["entries"][0].update(num_heads=0),
    "environment list": lambda d: d["environment"].update(gpu_name=["H100"]),
    "environment not a dict": lambda d: d.update(environment=[]),
    "template hash number": lambda d: d["template_hash"].update(triton=1),
}


def _bad_file(tmp_path: Path, case: str) -> Path:
    root = write(tmp_path, "h100", "h100", CPU)
    path = root / "h100" / f"{FWD}.json"
    if case in GARBAGE:
        path.write_bytes(GARBAGE[case])
    else:
        data = json.loads(path.read_text())
        MUTATIONS[case](data)
        path.write_text(json.dumps(data))  # json.dumps writes inf/nan as Infinity/NaN, as a bad writer would
    return root


@pytest.mark.parametrize("case", [*GARBAGE, *MUTATIONS])
def test_no_file_content_makes_load_raise(tmp_path, case):
    root = _bad_file(tmp_path, case)
    loaded = autotune.load(str(root), gpu="h100")  # must not raise
    assert loaded["kernels"] == [BWD] and FWD in loaded["problems"], loaded
    verdict = art.assess_artifact(root / "h100" / f"{FWD}.json", "h100")
    assert not verdict.usable and verdict.reason in loaded["problems"][FWD]
    with pytest.warns(dispatch.DispatchWarning, match="heuristic default"):
        assert dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, "uniform").source == "default"
    with pytest.raises(art.ArtifactError):  # the strict reader raises only its own error
        art.load_artifact(root / "h100" / f"{FWD}.json")


def test_non_utf8_and_truncated_reasons_say_what_is_wrong(tmp_path):
    assert "not UTF-8" in dispatch.load(_bad_file(tmp_path / "a", "non-utf8"), gpu="h100")["problems"][FWD]
    assert "not valid JSON" in dispatch.load(_bad_file(tmp_path / "b", "truncated"), gpu="h100")["problems"][FWD]


# ------------------------------------------------------------------------------ heads, mask, length
def test_mask_of_names_every_mask_of_the_tasks():
    cases = {
        (0, False, 0): "causal",
        (0, True, 0): "targets",
        (8, False, 0): "context",
        (8, True, 0): "context+targets",
        (0, False, 128): "window",
        (8, True, 128): "window",
    }
    assert {args: dispatch.mask_of(*args) for args in cases} == cases
    assert set(cases.values()) == set(MASKS) == set(dispatch.MASKS) == set(art.MASKS)


def test_heads_mismatch_uses_the_same_bucket_and_warns(tmp_path):
    entries = [dict(bucket=4096, block_m=128, num_heads=4), dict(bucket=1024, block_m=32, num_heads=8)]
    dispatch.load(write(tmp_path, "h100", "h100", CPU, entries), gpu="h100")
    with pytest.warns(dispatch.DispatchWarning, match="num_heads=4 instead of 8") as record:
        c = dispatch.select(FWD, "bfloat16", 64, 64, 8, 4096, "uniform")
    assert (c.source, c.bucket, _block_m(c)) == ("nearest", 4096, 128)  # same bucket beats same heads
    assert "nearest tuned bucket" not in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exact = dispatch.select(FWD, "bfloat16", 64, 64, 8, 1024, "uniform")
    assert (exact.source, _block_m(exact)) == ("tuned", 32)


def test_mask_mismatch_prefers_the_causal_entry_and_warns(tmp_path):
    entries = [dict(bucket=4096, block_m=b, mask=m) for b, m in ((128, "causal"), (64, "targets"), (16, "context"))]
    dispatch.load(write(tmp_path, "h100", "h100", CPU, entries), gpu="h100")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        targets = dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, "uniform", mask=dispatch.mask_of(0, True, 0))
        causal = dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, "uniform")
    assert (_block_m(targets), _block_m(causal), targets.source) == (64, 128, "tuned")
    with pytest.warns(dispatch.DispatchWarning, match="mask=causal instead of window"):
        window = dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, "uniform", mask=dispatch.mask_of(0, False, 256))
    assert (_block_m(window), window.source) == (128, "nearest")
    with pytest.raises(ValueError, match="unknown mask"):
        dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, "uniform", mask="sliding")


def test_length_above_the_largest_bucket_warns_once(tmp_path):
    dispatch.load(write(tmp_path, "h100", "h100", CPU, [dict(bucket=32768, block_m=64)]), gpu="h100")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        inside = dispatch.select(FWD, "bfloat16", 64, 64, 4, 32768, "uniform")
    with pytest.warns(dispatch.DispatchWarning, match="max_seq_len 40000 is above the largest tuned bucket 32768"):
        c = dispatch.select(FWD, "bfloat16", 64, 64, 4, 40000, "uniform")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # another long length: not said again
        again = dispatch.select(FWD, "bfloat16", 64, 64, 4, 70000, "uniform")
    assert inside == c == again and (c.bucket, c.source) == (32768, "tuned")


def test_length_between_16k_and_32k_runs_the_nearest_tuned_bucket(tmp_path):
    """A 20K call maps to the 32K bucket; with only a 16K entry it runs that one and says so."""
    dispatch.load(write(tmp_path, "h100", "h100", CPU, [dict(bucket=16384, block_m=64)]), gpu="h100")
    with pytest.warns(dispatch.DispatchWarning, match="bucket"):
        c = dispatch.select(FWD, "bfloat16", 64, 64, 4, 20000, "uniform")
    assert (c.bucket, c.source) == (16384, "nearest")


# ------------------------------------------------------------------------------ show agrees with load
def _show(capsys, root: Path, gpu: str) -> str:
    rc = main(["show", "--gpu", gpu, "--artifacts", str(root)])
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err
    return out.out


def _verdict_lines(text: str) -> dict[str, str]:
    """kernel -> 'usable' / 'NOT USED' from the table titles of ``autotune show``."""
    out = {}
    for line in text.splitlines():
        for kernel in (FWD, BWD, "gemm_silu"):
            if f"{kernel} on " in line:
                out[kernel] = "usable" if line.rstrip().endswith("usable") else "NOT USED"
    return out


def test_show_and_load_agree_on_the_shipped_artifacts(capsys, monkeypatch):
    shipped = json.loads((REPO / "artifacts" / "h100" / f"{FWD}.json").read_text())["environment"]
    _running(monkeypatch, shipped)  # an H100 with the versions the artifacts were tuned with
    monkeypatch.setenv("COLUMNS", "250")
    loaded = dispatch.load(REPO / "artifacts", gpu="h100")
    text = _show(capsys, REPO / "artifacts", "h100")
    shown = _verdict_lines(text)
    assert set(shown) == {FWD, BWD, "gemm_silu"}
    for kind in (FWD, BWD):
        assert (shown[kind] == "usable") == (kind in loaded["kernels"]), (shown, loaded["problems"])
    # Same GPU, same versions: the only reason not to use a shipped file is a template its entries use
    # having changed since (then re-tune); an unused backend's old hash (triton here) is no reason.
    for kind, verdict in shown.items():
        reason = loaded["problems"].get(kind, "") if kind != "gemm_silu" else ""
        assert verdict == "usable" or "stale artifact" in (reason or text), (kind, reason)
    assert not [w for w in dispatch.WARNINGS if "versions" in w or "tuned on" in w]


def test_show_and_load_agree_on_stale_and_foreign_files(tmp_path, capsys, monkeypatch):
    _running(monkeypatch, H100)
    monkeypatch.setenv("COLUMNS", "250")
    write(tmp_path, "h100", "h100", H100)
    fwd = tmp_path / "h100" / f"{FWD}.json"
    data = json.loads(fwd.read_text())
    data["template_hash"]["triton"] = "0" * 64  # stale: the triton entries' template changed
    fwd.write_text(json.dumps(data))
    bwd = tmp_path / "h100" / f"{BWD}.json"
    data = json.loads(bwd.read_text())
    data["template_hash"]["cute"] = "0" * 64  # a backend no entry uses: a record, not a reason
    bwd.write_text(json.dumps(data))
    loaded = dispatch.load(tmp_path, gpu="h100")
    text = _show(capsys, tmp_path, "h100")
    assert _verdict_lines(text) == {FWD: "NOT USED", BWD: "usable"}
    assert loaded["kernels"] == [BWD] and "stale" in loaded["problems"][FWD]
    assert "stale artifact" in text and "no entry uses cute" in text
    shutil.rmtree(tmp_path / "h100")
    write(tmp_path, "h200", "h100", H100)  # an H100 file under h200/, shown on an H100 machine
    loaded = dispatch.load(tmp_path, gpu="h200")
    text = _show(capsys, tmp_path, "h200")
    assert _verdict_lines(text) == {FWD: "NOT USED", BWD: "NOT USED"} and not loaded["kernels"]
    assert "usable with allow_same_arch=True" in text


def test_every_shipped_artifact_matches_the_current_templates():
    """A change to any source a shipped artifact's entries were tuned with (a kernel, its config, the
    CuTe compile/launch glue) makes the artifact stale, and dispatch would then silently run defaults:
    such a change must come with a re-tune of the artifacts it touches."""
    shipped = sorted((REPO / "artifacts").glob("*/*.json"))
    assert shipped, "no shipped artifacts found"
    stale = {}
    for path in shipped:
        reason = art.stale_reason(art.load_artifact(path, check_stale=False), str(path))
        if reason:
            stale[str(path.relative_to(REPO))] = reason
    assert not stale, stale


def test_an_interpreter_file_is_rejected_on_a_gpu(tmp_path, monkeypatch):
    """A file whose environment.gpu_name is no registry GPU (an interpreter run) is not used on a GPU."""
    root = write(tmp_path, "h100", "h100", CPU)
    _running(monkeypatch, H100)
    v = art.assess_artifact(root / "h100" / f"{FWD}.json", "h100", gpus.environment())
    assert not v.usable and "no registry GPU" in v.reason


@pytest.mark.parametrize("what", ["fifo", "folder", "dangling link", "link loop"])
def test_a_path_that_is_no_regular_file_is_rejected_not_missing(tmp_path, what):
    """A FIFO, folder or broken link at <gpu>/<kernel>.json was reported as "does not exist" (and, with
    allow_same_arch, silently replaced by a sibling GPU's file): it is a rejected file, with the reason."""
    import os

    root = write(tmp_path, "h100", "h100", CPU)
    write(tmp_path, "h200", "h200", CPU)
    path = root / "h100" / f"{FWD}.json"
    path.unlink()
    {
        "fifo": lambda: os.mkfifo(path),
        "folder": path.mkdir,
        "dangling link": lambda: path.symlink_to(tmp_path / "nowhere.json"),
        "link loop": lambda: path.symlink_to(path),
    }[what]()
    for same_arch in (False, True):
        loaded = autotune.load(str(root), gpu="h100", allow_same_arch=same_arch)
        assert FWD not in loaded["missing"] and FWD not in loaded["kernels"], loaded
        assert str(path) in loaded["problems"][FWD] and "does not exist" not in loaded["problems"][FWD]
