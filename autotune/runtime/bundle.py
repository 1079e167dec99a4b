"""Artifacts that travel with the module: the packaged copy and self-contained export bundles.

A wheel of the project installs the committed ``artifacts/<gpu>/<kernel>.json`` beside the packages
(``site-packages/artifacts``, the place ``autotune.runtime.artifacts.DEFAULT_ROOT`` already names in a source
checkout), so ``packaged_artifacts_root()`` finds them in both layouts without a path argument.

``export_bundle`` writes one folder a training job can ship: ``<out>/<gpu>/<kernel>.json`` (the layout
``autotune.load(out)`` reads) plus ``manifest.json`` with the GPU, the package and library versions,
and the sha256 of every file, and the kernels it has no file for (``missing``: dispatch runs their default
config); ``verify_bundle`` re-checks those hashes. Only usable artifacts are exported (valid, not stale, of the
named GPU and, for a GPU, made on one): a bundle never carries a file dispatch would reject.
Stdlib only, like ``autotune.runtime.artifacts``.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import secrets
import shutil
import tempfile
from collections.abc import Collection
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from autotune import __version__
from autotune.runtime import artifacts as art
from autotune.runtime.gpus import GPUS

MANIFEST = "manifest.json"
FORMAT = "hstu-autotune-artifact-bundle"
FORMAT_VERSION = 1
_VERSIONED = ("torch", "triton", "nvidia-cutlass-dsl", "optuna")  # installed distributions (None if absent)


class BundleError(ValueError):
    """Nothing to export, an unusable artifact, a bad destination or a bundle that fails its hashes."""


def packaged_artifacts_root() -> Path:
    """The artifacts shipped with the installed package (a checkout: the repository's ``artifacts``)."""
    return art.DEFAULT_ROOT


def _sha256(path: Path) -> str:
    return hashlib.sha256(art.read_regular_file(path)).hexdigest()


def _versions() -> dict[str, str | None]:
    """Python, this project (from the source, so a checkout that is not installed has it too) and the libraries."""
    out: dict[str, str | None] = {"python": platform.python_version(), "hstu-autotune": __version__}
    for dist in _VERSIONED:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _missing_reason(folder: Path, kernel: str) -> str:
    return f"no {kernel}.json in {folder}: autotune.load runs the default config for {kernel}, as dispatch does"


def _usable_files(
    root: Path, gpu: str, kernels: list[str] | None, missing_ok: Collection[str] = ()
) -> tuple[list[tuple[Path, Any]], dict[str, str], list[str]]:
    """(file, artifact) of each kernel to export, {kernel: why it has no file} for those in ``missing_ok``, and the
    other ``*.json`` files of the folder (no registered kernel's: ``autotune.load`` never reads them, so they are
    not exported); ``BundleError`` for a named kernel (not in ``missing_ok``) without a file and naming each
    rejected file."""
    from autotune.spec import kernels as registered

    folder = root / gpu
    files = sorted(folder.glob("*.json")) if folder.is_dir() else []
    known = set(registered())
    ignored = [f.name for f in files if f.stem not in known]
    files = [f for f in files if f.stem in known]
    present = {f.stem for f in files}
    wanted = list(dict.fromkeys([*(kernels or ()), *missing_ok]))
    unknown = [k for k in wanted if k not in present and k not in missing_ok]
    if unknown:
        raise BundleError(
            f"no artifact for {', '.join(unknown)} in {folder} (a kernel asked for by name must have one; "
            "a bundle without it would run the default config)"
        )
    missing = {k: _missing_reason(folder, k) for k in wanted if k not in present}
    if kernels:
        files = [f for f in files if f.stem in kernels]
    if not files:
        which = f" of {', '.join(kernels)}" if kernels else ""
        raise BundleError(f"no artifacts to export: {folder} holds no <kernel>.json{which}")
    out, problems = [], []
    for f in files:
        verdict = art.assess_artifact(f, gpu, None)  # for the target GPU, whatever this machine has
        if not verdict.usable:
            problems.append(f"{f.name}: {verdict.reason}")
        elif gpu in GPUS and art.interpreter_made(verdict.artifact.environment):
            # check_origin cannot tell without a running GPU; a GPU host rejects it (as `autotune merge` refuses it)
            name = verdict.artifact.environment.get("gpu_name")
            problems.append(
                f"{f}: made under the Triton interpreter / on a CPU (environment.gpu_name {name!r}); a {gpu} host "
                f"rejects it: re-tune on the GPU with `autotune run --gpu {gpu}`"
            )
        else:
            out.append((f, verdict.artifact))
    if problems:
        raise BundleError("refusing to export artifacts dispatch would reject:\n  " + "\n  ".join(problems))
    return out, missing, ignored if kernels is None else []


def export_bundle(
    gpu: str,
    out: str | Path,
    root: str | Path | None = None,
    kernels: list[str] | None = None,
    missing_ok: Collection[str] = (),
) -> dict:
    """Write ``out/<gpu>/*.json`` and ``out/manifest.json``; returns the manifest.

    ``kernels``: those to export (None: every file of the GPU's folder); each must have a file unless it is in
    ``missing_ok`` (a group's members, or every known kernel when exporting all): those without one are listed
    under the manifest's ``missing`` with why, and a bundle loads them as dispatch does, on the default config.
    ``out`` must be missing or empty. The files are copied byte for byte (their template hashes
    stay what tuning recorded), then the manifest, last, in a sibling folder renamed to ``out`` at the end:
    a failure part-way leaves ``out`` as it was.
    """
    root = Path(root) if root is not None else packaged_artifacts_root()
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BundleError(f"--out {out}: exists and is not an empty directory")
    if not out.parent.is_dir():
        raise BundleError(f"--out {out}: parent directory {out.parent} does not exist")
    files, missing, ignored = _usable_files(root, gpu, kernels, missing_ok)
    # Built in a sibling folder and renamed into place: a failure part-way (a copy error, a full disk) left a
    # half-filled --out that every re-run then refused as not empty.
    tmp_dir = out.parent / f".{out.name}.partial.{os.getpid()}.{secrets.token_hex(4)}"
    tmp_dir.mkdir()  # the umask's permissions, as the folder it becomes (mkdtemp's are owner-only)
    try:
        manifest = _write_bundle(files, gpu, tmp_dir, missing, ignored)
        os.replace(tmp_dir, out)  # onto a missing or empty folder
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return manifest


def _write_bundle(files: list, gpu: str, out: Path, missing: dict[str, str], ignored: list[str]) -> dict:
    """Copy the artifact files into ``out/<gpu>/`` and write the manifest last; returns the manifest."""
    (out / gpu).mkdir(parents=True, exist_ok=True)
    listed = []
    for src, artifact in files:
        dst = out / gpu / src.name
        shutil.copyfile(src, dst)
        listed.append(
            {
                "path": f"{gpu}/{src.name}",
                "kernel": artifact.kernel,
                "sha256": _sha256(dst),
                "entries": len(artifact.entries),
                "created": artifact.created,
                "template_hash": artifact.template_hash,
                "search_space_hash": artifact.search_space_hash,
                "environment": artifact.environment,
            }
        )
    env = files[0][1].environment
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "gpu": gpu,
        "gpu_name": env.get("gpu_name"),
        "compute_capability": env.get("compute_capability"),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "exported_with": _versions(),
        "files": listed,
        "missing": missing,  # kernels asked for (or known) without a file: the bundle runs their default config
        "ignored": ignored,  # the folder's other *.json files (no kernel's artifact), not exported
    }
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".manifest.")
    with os.fdopen(fd, "w") as fh:
        json.dump(manifest, fh, indent=2, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, out / MANIFEST)
    return manifest


def verify_bundle(path: str | Path) -> list[str]:
    """Problems of a bundle (missing/bad manifest, a malformed or escaping file entry, a missing, changed or
    unlisted file); [] when sound. Listed paths must stay inside the bundle folder."""
    path = Path(path)
    try:
        manifest = json.loads(art.read_regular_file(path / MANIFEST))
    except (ValueError, RecursionError) as e:  # ArtifactError is a ValueError; RecursionError: JSON nested too deep
        return [f"{path / MANIFEST}: cannot read the manifest ({e})"]
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return [f"{path / MANIFEST}: not an {FORMAT} manifest"]
    files = manifest.get("files", [])
    if not isinstance(files, list):
        return [f"{path / MANIFEST}: 'files' is a {type(files).__name__}, not a list"]
    problems = []
    listed = set()
    base = path.resolve()
    for i, item in enumerate(files):
        where = f"{path / MANIFEST}: files[{i}]"
        if not isinstance(item, dict):
            problems.append(f"{where} is a {type(item).__name__}, not an object")
            continue
        rel, digest = item.get("path"), item.get("sha256")
        if not isinstance(rel, str) or not rel:
            problems.append(f"{where} has no 'path' (a relative file name)")
            continue
        try:
            f = (path / rel).resolve()
        except (OSError, ValueError) as e:
            problems.append(f"{where}: path {rel!r} cannot be resolved ({e})")
            continue
        if Path(rel).is_absolute() or not f.is_relative_to(base):
            problems.append(f"{where}: path {rel!r} points outside the bundle")
            continue
        listed.add(f)
        if not isinstance(digest, str) or not digest:
            problems.append(f"{where} ({rel}) has no 'sha256'")
            continue
        if not f.exists():
            problems.append(f"{rel}: listed in the manifest but missing")
        elif not f.is_file():
            problems.append(f"{rel}: listed in the manifest but not a file")
        else:
            try:
                same = _sha256(f) == digest
            except art.ArtifactError as e:
                problems.append(f"{rel}: cannot read ({e})")
                continue
            if not same:
                problems.append(f"{rel}: sha256 differs from the manifest (edited after export)")
    for f in sorted(path.glob("*/*.json")):
        if f.resolve() not in listed:
            problems.append(f"{f.relative_to(path)}: not listed in the manifest")
    return problems
