"""The shell scripts users and CI run, on copies in a temporary folder (a path with a space) with stand-ins for
``python`` and ``nvidia-smi``: their exit status is the status of the work they ran, and their logs keep all of
its output."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FAKE_PYTHON = """#!/usr/bin/env bash
echo "python $*" >>"$OUT/calls.txt"
for i in $(seq 1 40); do echo "line $i"; done
sleep 0.3  # a reader that stops early has gone by now
for i in $(seq 41 200); do echo "line $i"; done
touch "$OUT/finished.$$"
exit "${FAKE_RC:-0}"
"""


def _copy(tmp_path: Path, script: str) -> tuple[Path, dict[str, str]]:
    """``scripts/<script>`` in a copy of the layout it expects, and an environment whose python is the stand-in."""
    root = tmp_path / "my repo"
    (root / "scripts").mkdir(parents=True)
    (root / "artifacts" / "h100").mkdir(parents=True)
    (root / "artifacts" / "h100" / "x.json").write_text("{}")
    shutil.copy2(REPO / "scripts" / script, root / "scripts" / script)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python", FAKE_PYTHON), ("nvidia-smi", "#!/usr/bin/env bash\necho 'NVIDIA H100, 1'\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OUT": str(out)}
    return root / "scripts" / script, env


@pytest.mark.parametrize(
    "script, step", [("gpu_evidence.sh", "tune"), ("gpu_evidence.sh", "verify"), ("layer_evidence.sh", "tune")]
)
@pytest.mark.parametrize("fake_rc", [0, 1])
def test_an_evidence_step_exits_with_its_runs_status(script, step, fake_rc, tmp_path):
    """A tuning run or a re-check that failed (exit 1) left the step with tar's status 0: the failure
    never showed. The artifacts are still packed for the run to resume from."""
    path, env = _copy(tmp_path, script)
    done = subprocess.run(["bash", str(path), step], env={**env, "FAKE_RC": str(fake_rc)}, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == fake_rc, done.stderr
    assert (tmp_path / "out" / "artifacts.tar").is_file()


def test_layer_evidence_graphs_fails_when_its_gpu_tests_fail(tmp_path):
    """The graphs step ran the GPU tests, then the benchmark: the benchmark's status hid failed tests."""
    path, env = _copy(tmp_path, "layer_evidence.sh")
    (tmp_path / "bin" / "python").write_text(
        FAKE_PYTHON.replace('exit "${FAKE_RC:-0}"', '[ "$1 $2" = "-m pytest" ] && exit 1; exit 0')
    )
    done = subprocess.run(["bash", str(path), "graphs", "tiny"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert len((tmp_path / "out" / "calls.txt").read_text().splitlines()) == 2  # the benchmark still ran


def test_layer_evidence_profile_keeps_whole_logs_and_lets_the_profiles_finish(tmp_path):
    """The step showed the first 30 lines through ``head``: once head left, tee died (the log lost the rest) and
    the profile was killed by a broken pipe before it wrote its JSON."""
    path, env = _copy(tmp_path, "layer_evidence.sh")
    done = subprocess.run(["bash", str(path), "profile", "tiny"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out"
    assert len(list(out.glob("finished.*"))) == 2  # both profiles ran to their end
    assert len((out / "profile_tiny.log").read_text().splitlines()) == 400
    assert len(done.stdout.splitlines()) == 60


SETUP_IMPORTS = ("kernel_templates", "optuna", "rich", "pytest", "cutlass", "onnxscript", "onnxruntime", "psycopg",
                 "matplotlib")  # fmt: skip


def _setup_env(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A copy of ``scripts/setup.sh`` (under a path with a space) whose installed packages are empty stubs (no pip
    runs), a fast venv maker as ``$PYTHON`` and, first on PATH, a ``python`` standing in for the system's that
    fails and logs every call: the environment must not reach it."""
    root = tmp_path / "my repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy2(REPO / "scripts" / "setup.sh", root / "scripts" / "setup.sh")
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for name in SETUP_IMPORTS:
        (stubs / f"{name}.py").write_text("")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    base = getattr(sys, "_base_executable", sys.executable)
    scripts = {
        "python3": f'#!/usr/bin/env bash\n[ "$1 $2" = "-m venv" ] && exec "{base}" "$@" --without-pip\n'
        f'exec "{base}" "$@"\n',
        "python": f'#!/usr/bin/env bash\necho "system python $*" >>"{tmp_path}/system.log"\nexit 1\n',
    }  # fmt: skip
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHON": str(bin_dir / "python3"),
           "PYTHONPATH": str(stubs)}  # fmt: skip
    env.pop("VIRTUAL_ENV", None)
    return root, env


def _source_setup(root: Path, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    cmd = f'. "{root}/scripts/setup.sh" && python -c "import sys; print(sys.prefix)"'
    return subprocess.run(["bash", "-c", cmd], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("breakage", ["dangling link", "interpreter fails"])
def test_setup_makes_a_broken_venv_again(breakage, tmp_path):
    """A .venv whose interpreter is a dangling link (its base Python removed or upgraded) was passed to ``venv``
    without --clear, which left the link as it was: PATH then skipped it, and the import check and ``pip install``
    ran on the system's Python. One whose interpreter exists but fails was kept, and pip failed inside it."""
    root, env = _setup_env(tmp_path)
    venv = root / ".venv"
    subprocess.run([env["PYTHON"], "-m", "venv", str(venv)], env=env, check=True, timeout=120)
    python = venv / "bin" / "python"
    python.unlink()
    if breakage == "dangling link":
        python.symlink_to("/nonexistent/python3.99")
    else:
        python.write_text("#!/bin/sh\nexit 1\n")
        python.chmod(0o755)
    done = _source_setup(root, env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == venv and not (tmp_path / "system.log").exists()


def test_setup_refuses_a_python_older_than_the_project_needs(tmp_path):
    root, env = _setup_env(tmp_path)
    old = tmp_path / "bin" / "python3.9"
    old.write_text('#!/usr/bin/env bash\n[ "$1" = "-c" ] && exit 1\nmkdir -p "${@: -1}"; exit 0\n')
    old.chmod(0o755)
    done = _source_setup(root, {**env, "PYTHON": str(old)}, cwd=tmp_path)
    assert done.returncode == 2 and "is not Python >= 3.10" in done.stderr and "PYTHON" in done.stderr, done.stderr
    assert not (tmp_path / "system.log").exists()


def _flags_after_sourcing(root: Path, env: dict[str, str], cwd: Path, before: str) -> subprocess.CompletedProcess:
    """Source setup.sh in a shell whose options are ``before``, then print its status, the shell's option
    letters and pipefail, run a failing command and say the shell is still there."""
    cmd = (
        f'{before}; . "{root}/scripts/setup.sh"; echo "rc=$? flags=$-"; shopt -qo pipefail && echo pipefail; '
        'false; echo alive; python -c "import sys; print(sys.prefix)"'
    )
    return subprocess.run(["bash", "-c", cmd], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("before", ["true", "set -u", "set -o pipefail"])
def test_sourcing_setup_leaves_the_callers_shell_options_as_they_were(before, tmp_path):
    """Sourced in an interactive shell, setup.sh left ``set -euo pipefail`` behind where it failed (the user's
    shell then exited on their next failing command) and turned a caller's own ``-u`` off where it succeeded."""
    root, env = _setup_env(tmp_path)
    done = _flags_after_sourcing(root, env, tmp_path, before)
    flags = done.stdout.split("flags=")[1].split()[0]
    assert "rc=0" in done.stdout and "e" not in flags and ("u" in flags) == (before == "set -u"), done.stdout
    assert ("pipefail" in done.stdout.split()) == ("pipefail" in before) and "alive" in done.stdout
    assert Path(done.stdout.strip().splitlines()[-1]) == root / ".venv"  # still in the environment afterwards
    old = tmp_path / "bin" / "python3.9"
    old.write_text('#!/usr/bin/env bash\n[ "$1" = "-c" ] && exit 1\nmkdir -p "${@: -1}"; exit 0\n')
    old.chmod(0o755)
    shutil.rmtree(root / ".venv")
    failed = _flags_after_sourcing(root, {**env, "PYTHON": str(old)}, tmp_path, before)
    assert "flags=" in failed.stdout, f"the caller's shell exited: {failed.stdout!r} {failed.stderr!r}"
    flags = failed.stdout.split("flags=")[1].split()[0]
    assert "rc=2" in failed.stdout and "e" not in flags and ("u" in flags) == (before == "set -u"), failed.stdout
    assert ("pipefail" in failed.stdout.split()) == ("pipefail" in before) and "alive" in failed.stdout
