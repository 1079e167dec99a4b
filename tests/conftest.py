"""Test set-up: without CUDA, Triton kernels run under the interpreter (set before any kernel import)."""

from __future__ import annotations

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
# The CuTe DSL drops kept PTX into the working directory unless told where.
os.environ.setdefault("CUTE_DSL_DUMP_DIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), "hstu-cute-dump"))

import pytest  # noqa: E402

IS_SM90 = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_sm90 = pytest.mark.skip(reason="needs an sm90 GPU")
    skip_interp = pytest.mark.skip(reason="Triton interpreter on CPU tensors: CPU hosts (CI) run it")
    for item in items:
        if "interpreter" in item.keywords and HAS_CUDA:
            item.add_marker(skip_interp)
        elif "sm90" in item.keywords and not IS_SM90:
            item.add_marker(skip_sm90)
        elif "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def _no_out_folder(monkeypatch):
    """The benchmarks write their rows under ``$OUT`` when it is set (a device run's output folder): a test that runs
    one must not leave files in the caller's folder. Tests that want it set their own."""
    monkeypatch.delenv("OUT", raising=False)
