"""No layer imports upward: kernels < search spaces < runtime < tuner; training code never loads the tuner."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    """Every module a file imports (absolute names; relative imports resolved against its package)."""
    tree = ast.parse(path.read_text())
    pkg = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


RULES = [
    ("kernel_templates", ("autotune.runtime", "autotune.tuning", "models")),
    ("search_spaces", ("autotune.tuning", "models")),
    ("autotune/runtime", ("autotune.tuning", "models")),
    ("models", ("autotune.tuning",)),
]


@pytest.mark.parametrize(("folder", "forbidden"), RULES)
def test_no_upward_imports(folder, forbidden):
    bad = []
    for f in sorted((REPO / folder).rglob("*.py")):
        for mod in _imports(f):
            if any(mod == p or mod.startswith(p + ".") for p in forbidden):
                bad.append(f"{f.relative_to(REPO)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_training_imports_never_load_the_tuner():
    code = (
        "import sys, autotune, autotune.runtime.ops, autotune.runtime.layer, models.hstu, models.train; "
        "print(sorted(m for m in sys.modules if m.startswith('autotune.tuning') or m == 'optuna'))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", res.stdout


def test_the_task_limits_are_the_grid_limits_and_load_no_torch():
    """The tuner reads its batch and head limits before any kernel module loads: they come from the one
    torch-free home of CUDA's grid limits, the same the kernels' input checks use."""
    code = (
        "import sys, autotune.runtime.buckets as b, kernel_templates.grid_limits as g; "
        "print(b.MAX_BATCH == g.GRID_YZ_MAX, b.MAX_HEADS * b.MAX_BATCH <= g.GRID_X_MAX, 'torch' in sys.modules)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["True", "True", "False"], res.stdout
    from kernel_templates import grid_limits
    from kernel_templates.hstu_attention import input_check

    assert input_check.GRID_YZ_MAX == grid_limits.GRID_YZ_MAX
