"""Artifacts packaged with the module: a built wheel carries artifacts/<gpu>/*.json (not the studies), an
install in a fresh virtual environment finds them, and ``autotune export`` writes a bundle with a manifest
that ``autotune.load(DIR)`` accepts."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import autotune
from autotune.runtime import artifacts as art
from autotune.runtime import bundle, dispatch
from autotune.tuning.cli import main
from kernel_templates.hstu_attention.config import default_bwd_config, default_fwd_config

REPO = Path(__file__).resolve().parents[1]
FWD, BWD = "hstu_attention_fwd", "hstu_attention_bwd"
H100_ENV = {**dict.fromkeys(art.ENV_KEYS), "gpu_name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}


@pytest.fixture(autouse=True)
def _fresh_dispatch():
    dispatch.reset()
    yield
    dispatch.reset()


def _source_tree(dst: Path) -> Path:
    """A copy of the project as a fresh clone would hold it (tracked and unignored files; no tests)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    for rel in filter(None, listed.stdout.decode().split("\0")):
        src = REPO / rel
        if rel.startswith(("tests/", "docs/", "benchmarks/")) or not src.is_file():
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst / rel)
    studies = dst / "artifacts" / "h100" / "studies"  # what a tuning run leaves beside the JSONs
    studies.mkdir(parents=True, exist_ok=True)
    (studies / "tuning.journal").write_text("{}")
    (studies / "trial.json").write_text("{}")
    return dst


_PROBE = """
import json, sys, autotune
from autotune.runtime.bundle import packaged_artifacts_root
root = packaged_artifacts_root()
out = {"autotune": autotune.__file__, "root": str(root), "summary": autotune.load(root, gpu="h100")}
print(json.dumps(out))
"""


def test_wheel_carries_the_artifacts_and_an_install_finds_them(tmp_path):
    src = _source_tree(tmp_path / "src")
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(src),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob(f"hstu_autotune-{autotune.__version__}-*.whl")  # pyproject reads the version
    repo_files = {p.relative_to(REPO).as_posix(): p.read_bytes() for p in (REPO / "artifacts").glob("*/*.json")}
    assert repo_files, "the repository has no committed artifacts"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        packaged = {n: z.read(n) for n in names if n.startswith("artifacts/")}
    assert packaged == repo_files  # every committed JSON, byte for byte, and nothing else (no studies)
    assert not any("studies" in n for n in names) and "autotune/runtime/bundle.py" in names

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    vpy = venv / "bin" / "python"
    site = subprocess.run(
        [vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # torch & co. come from this environment's site-packages (a plain path entry: its .pth files, the
    # editable install of this checkout included, are not processed, so `autotune` is the wheel's)
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(vpy), "install", "--no-deps", "-q", str(wheel)]
    assert subprocess.run(pip, capture_output=True, text=True, timeout=300).returncode == 0
    probe = subprocess.run([vpy, "-I", "-c", _PROBE], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert probe.returncode == 0, probe.stderr
    got = json.loads(probe.stdout.splitlines()[-1])
    assert got["autotune"].startswith(site) and got["root"] == str(Path(site) / "artifacts")
    installed = got["summary"]
    here = autotune.load(REPO / "artifacts", gpu="h100")
    # the install decides exactly as the checkout does (usable, or stale for the same reason) ...
    assert installed["kernels"] == here["kernels"]
    assert {k: v.split(": ", 2)[-1] for k, v in installed["problems"].items()} == {
        k: v.split(": ", 2)[-1] for k, v in here["problems"].items()
    }
    # ... about files it found inside the installed package
    for kind in (FWD, BWD):
        where = installed["files"].get(kind) or installed["problems"][kind]
        assert str(Path(site) / "artifacts" / "h100" / f"{kind}.json") in where and "does not exist" not in where


def test_load_without_a_path_reads_the_packaged_artifacts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./artifacts here: only the packaged copy can be found
    summary = autotune.load(gpu="h100")
    assert Path(summary["path"]) == bundle.packaged_artifacts_root()
    assert all("does not exist" not in p for p in summary["problems"].values())


def _fresh_artifacts(root: Path, stale: bool = False) -> Path:
    """h100 fwd/bwd artifacts with one tuned Triton entry each (current template hashes unless ``stale``)."""
    for kind, cfg in ((FWD, default_fwd_config(64, 64)), (BWD, default_bwd_config(64, 64))):
        entry = {
            "dtype": "bfloat16",
            "dqk": 64,
            "dv": 64,
            "num_heads": 4,
            "bucket": 2048,
            "distribution": "uniform",
            "mask": "causal",
            "backend": "triton",
            "config": dict(cfg.to_dict(), block_m=128),
            "median_ms": 1.0,
            "spread_ms": 0.0,
            "tflops": 1.0,
            "default_ms": 1.2,
            "default_tflops": 0.8,
            "speedup": 1.2,
            "trials": 5,
            "tuning_s": 1.0,
        }
        hashes = {"triton": "0" * 64 if stale else art.current_template_hash(kind, "triton")}
        art.save_artifact(
            art.Artifact(kind, "h100", dict(H100_ENV), hashes, "s" * 64, [entry]), root / "h100" / f"{kind}.json"
        )
    return root


def test_export_bundle_round_trip(tmp_path, capsys):
    root = _fresh_artifacts(tmp_path / "arts")
    out = tmp_path / "bundle"
    assert main(["export", "--gpu", "h100", "--out", str(out), "--artifacts", str(root)]) == 0
    assert "manifest.json" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["gpu"] == "h100" and manifest["gpu_name"] == "NVIDIA H100 80GB HBM3"
    assert sorted(f["path"] for f in manifest["files"]) == [f"h100/{BWD}.json", f"h100/{FWD}.json"]
    assert manifest["exported_with"]["hstu-autotune"] == autotune.__version__ and "torch" in manifest["exported_with"]
    for f in manifest["files"]:
        assert (out / f["path"]).read_bytes() == (root / f["path"]).read_bytes()
        assert f["template_hash"]["triton"] == art.current_template_hash(f["kernel"])
    assert bundle.verify_bundle(out) == []
    summary = autotune.load(out, gpu="h100")
    assert summary["kernels"] == [BWD, FWD] and not summary["problems"]
    choice = dispatch.select(FWD, "bfloat16", 64, 64, 4, 2048, "uniform")
    assert choice.source == "tuned" and json.loads(choice.config)["block_m"] == 128
    # an edited or unlisted file is caught
    path = out / "h100" / f"{FWD}.json"
    path.write_text(path.read_text().replace('"trials": 5', '"trials": 6'))
    (out / "h100" / "gemm_silu.json").write_text("{}")
    problems = bundle.verify_bundle(out)
    assert any("sha256 differs" in p for p in problems) and any("not listed" in p for p in problems)


def test_the_manifest_records_the_version_from_a_checkout_that_is_not_installed(tmp_path, monkeypatch):
    """Run from the source tree on PYTHONPATH, no distribution metadata exists: the version still comes along."""

    def not_installed(dist: str) -> str:
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    manifest = bundle.export_bundle("h100", tmp_path / "b", _fresh_artifacts(tmp_path / "arts"))
    assert manifest["exported_with"]["hstu-autotune"] == autotune.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", autotune.__version__) and manifest["exported_with"]["torch"] is None


@pytest.mark.parametrize("made", [False, True])
def test_an_export_failing_part_way_leaves_out_as_it_was(tmp_path, monkeypatch, capsys, made):
    """A copy error after the first file left a half-filled --out (no manifest) that every re-run refused as
    not empty; now nothing is left at --out (or the empty folder given stays empty) and a re-run succeeds."""
    root = _fresh_artifacts(tmp_path / "arts")
    out = tmp_path / "bundle"
    if made:
        out.mkdir()
    copy, calls = shutil.copyfile, []

    def failing_copy(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return copy(src, dst)

    monkeypatch.setattr(shutil, "copyfile", failing_copy)
    assert main(["export", "--gpu", "h100", "--out", str(out), "--artifacts", str(root)]) == 1
    err = capsys.readouterr().err
    assert "--out" in err and "No space left" in err and "Traceback" not in err
    assert (out.is_dir() and not any(out.iterdir())) if made else not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["arts", *(["bundle"] if made else [])])
    monkeypatch.setattr(shutil, "copyfile", copy)
    bundle.export_bundle("h100", out, root)
    assert bundle.verify_bundle(out) == []
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_export_refuses_unusable_artifacts_and_a_used_destination(tmp_path, capsys):
    root = _fresh_artifacts(tmp_path / "arts", stale=True)
    assert main(["export", "--gpu", "h100", "--out", str(tmp_path / "b"), "--artifacts", str(root)]) == 1
    err = capsys.readouterr().err
    assert "refusing to export" in err and "stale artifact" in err and not (tmp_path / "b" / "manifest.json").exists()
    fresh = _fresh_artifacts(tmp_path / "fresh")
    used = tmp_path / "used"
    used.mkdir()
    (used / "x").write_text("")
    assert main(["export", "--gpu", "h100", "--out", str(used), "--artifacts", str(fresh)]) == 1
    assert "not an empty directory" in capsys.readouterr().err
    assert main(["export", "--gpu", "h100", "--out", str(tmp_path / "c"), "--artifacts", str(tmp_path / "none")]) == 1
    assert "no artifacts to export" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda m: m.update(files="x"), "'files' is a str, not a list"),
        (lambda m: m.update(files=[1]), "files[0] is a int, not an object"),
        (lambda m: m["files"][0].pop("path"), "files[0] has no 'path'"),
        (lambda m: m["files"][0].pop("sha256"), "has no 'sha256'"),
        (lambda m: m["files"][0].update(path="../../outside.json"), "points outside the bundle"),
        (lambda m: m["files"][0].update(path="/etc/passwd"), "points outside the bundle"),
        (lambda m: m["files"][0].update(path="h100"), "not a file"),
    ],
    ids=["files-str", "item-int", "no-path", "no-sha256", "dotdot", "absolute", "folder"],
)
def test_verify_bundle_reports_a_malformed_manifest(tmp_path, mutate, expected):
    """A malformed file list is a problem named in the answer, never an exception, and a listed path that
    leaves the bundle folder is refused without being read."""
    root = _fresh_artifacts(tmp_path / "arts")
    out = tmp_path / "bundle"
    bundle.export_bundle("h100", out, root)
    (tmp_path / "outside.json").write_text("{}")
    manifest = json.loads((out / "manifest.json").read_text())
    mutate(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))
    problems = bundle.verify_bundle(out)
    assert any(expected in p for p in problems), problems


def test_export_takes_the_kernel_names_run_show_and_verify_take(tmp_path, capsys):
    """``--kernel fwd`` was "no artifact for fwd" (exit 1): only spec names were looked up."""
    argv = ["export", "--gpu", "h100", "--artifacts", str(_fresh_artifacts(tmp_path / "arts")), "--kernel"]
    assert main([*argv, "fwd", "--out", str(tmp_path / "b")]) == 0
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert [f["path"] for f in manifest["files"]] == [f"h100/{FWD}.json"]
    capsys.readouterr()
    assert main([*argv, ",", "--out", str(tmp_path / "c")]) == 2
    assert "--kernel ',' names nothing" in capsys.readouterr().err
    assert main([*argv, "fwd,nosuch", "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "unknown kernel(s) nosuch" in err and "known:" in err and not (tmp_path / "d").exists()


def test_verify_bundle_reports_a_manifest_nested_past_the_parser(tmp_path):
    """JSON nested deeper than the parser's stack is a named problem, not a RecursionError."""
    (tmp_path / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    problems = bundle.verify_bundle(tmp_path)
    assert len(problems) == 1 and "cannot read the manifest" in problems[0], problems


def _layer_artifacts(root: Path, gpu: str, skip: str) -> Path:
    """Every layer kernel's artifact of ``gpu`` (the committed h100 files, relabelled) but ``skip``'s."""
    from autotune.runtime.layer import LAYER_KERNELS

    env = dict(H100_ENV, gpu_name="NVIDIA H200", compute_capability="9.0") if gpu == "h200" else dict(H100_ENV)
    for kind in LAYER_KERNELS:
        if kind.startswith("hstu_attention") or kind == skip:
            continue
        a = art.load_artifact(REPO / "artifacts" / "h100" / f"{kind}.json")
        a.gpu, a.environment = gpu, {**a.environment, **env}
        art.save_artifact(a, root / gpu / f"{kind}.json")
    return root


def test_a_group_export_writes_what_exists_and_names_each_missing_kernel(tmp_path, capsys):
    """``--kernel layer`` on a GPU without ``linear_residual_bwd.json`` failed as a whole; it now writes the
    others, names the missing one in its output and the manifest, and the bundle loads as dispatch does."""
    root = _layer_artifacts(tmp_path / "arts", "h200", skip="linear_residual_bwd")
    out = tmp_path / "bundle"
    argv = ["export", "--gpu", "h200", "--artifacts", str(root), "--kernel"]
    assert main([*argv, "layer", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "missing linear_residual_bwd" in text and "default config" in text, text
    manifest = json.loads((out / "manifest.json").read_text())
    assert list(manifest["missing"]) == ["linear_residual_bwd"]
    assert "default config" in manifest["missing"]["linear_residual_bwd"]
    assert "h200/linear_residual_fwd.json" in [f["path"] for f in manifest["files"]]
    assert bundle.verify_bundle(out) == []
    summary = autotune.load(out, gpu="h200", allow_same_arch=True)  # on an H100 too
    assert "linear_residual_bwd" in summary["missing"] and "linear_residual_fwd" in summary["kernels"]
    # a kernel named on its own still must have its file
    assert main([*argv, "linear_residual_bwd", "--out", str(tmp_path / "one")]) == 1
    err = capsys.readouterr().err
    assert "no artifact for linear_residual_bwd" in err and not (tmp_path / "one").exists()


def test_an_export_of_every_kernel_records_those_without_a_file(tmp_path, capsys):
    """No --kernel: the bundle holds the GPU's files and the manifest lists each registered kernel it lacks."""
    root = _fresh_artifacts(tmp_path / "arts")
    assert main(["export", "--gpu", "h100", "--out", str(tmp_path / "b"), "--artifacts", str(root)]) == 0
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert FWD not in manifest["missing"] and "gemm_silu" in manifest["missing"]
    assert "missing gemm_silu" in capsys.readouterr().out


def test_export_refuses_an_interpreter_made_artifact_for_a_gpu(tmp_path, capsys):
    """A Triton-interpreter / CPU artifact under h100/ was exported into an h100 bundle a GPU host then
    rejected; export refuses it as ``autotune merge`` does, naming the file."""
    root = _fresh_artifacts(tmp_path / "arts")
    path = root / "h100" / f"{FWD}.json"
    a = art.load_artifact(path)
    a.environment = {**a.environment, "gpu_name": "triton-interpreter (cpu)", "compute_capability": None}
    art.save_artifact(a, path)
    assert main(["export", "--gpu", "h100", "--out", str(tmp_path / "b"), "--artifacts", str(root)]) == 1
    err = capsys.readouterr().err
    assert f"{FWD}.json" in err and "Triton interpreter" in err and not (tmp_path / "b").exists(), err


def test_the_docs_name_only_files_a_fresh_clone_holds():
    """README.md named ``../shared/docs/HSTU.md`` for the attention contract, a file outside the repository;
    every Markdown file it names (links, backquoted paths) must exist inside it, and no source names shared/docs."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    tracked = [REPO / rel for rel in filter(None, listed.stdout.decode().split("\0"))]
    bad = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = doc.read_text()
        for name in re.findall(r"`([^`\s]+\.md)`", text) + re.findall(r"\]\(([^)#\s]+)", text):
            if "://" in name:
                continue
            target = next((p for p in (REPO / name, doc.parent / name) if p.exists()), None)
            if target is None or not target.resolve().is_relative_to(REPO):
                bad.append(f"{doc.name}: {name}")
    sources = [p for p in tracked if p.suffix in (".py", ".md") and p.is_file() and p.name != "test_packaging.py"]
    bad += [f"{p.relative_to(REPO)}: names shared/docs" for p in sources if "shared/docs" in p.read_text()]
    assert not bad, bad


def test_an_export_of_every_kernel_leaves_out_json_files_no_kernel_has(tmp_path, capsys):
    """A notes.json (or a copy named ``fwd-old.json``) beside the artifacts, which ``autotune.load`` never reads,
    made ``autotune export`` refuse the whole bundle as holding an artifact dispatch would reject."""
    root = _fresh_artifacts(tmp_path / "arts")
    (root / "h100" / "notes.json").write_text('{"note": "tuned on node 7"}\n')
    out = tmp_path / "b"
    assert main(["export", "--gpu", "h100", "--out", str(out), "--artifacts", str(root)]) == 0
    assert "not exported: notes.json" in capsys.readouterr().out
    assert not (out / "h100" / "notes.json").exists() and bundle.verify_bundle(out) == []
    assert json.loads((out / "manifest.json").read_text())["ignored"] == ["notes.json"]
