"""Option checks the benchmark command lines share, one home per rule.

The benchmarks are GPU programs, but a count of 0, a head dim no kernel has or a misspelt name is the user's
mistake on any machine: each check here raises a ``CLIError`` naming the option, and ``usage_errors`` turns it
into ``p.error`` (exit status 2) before the GPU check, the artifact load or the first input is built, instead
of a ZeroDivisionError, an empty table or "needs a CUDA GPU" that hides it.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from autotune.tuning.cli import CLIError
from autotune.tuning.cli_checks import int_in


@contextmanager
def usage_errors(p: argparse.ArgumentParser) -> Iterator[None]:
    """A ``CLIError`` or ``ValueError`` (a config's own field check) raised inside as ``p.error``."""
    try:
        yield
    except (CLIError, ValueError) as e:
        p.error(str(e))


def _values(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def at_least(args: argparse.Namespace, low: int, *options: str) -> None:
    """Each ``options`` value (an int or a list of ints; None = not given) is ``>= low``."""
    for option in options:
        value = getattr(args, option[2:].replace("-", "_"))
        for v in _values(value) if value is not None else []:
            int_in(option, v, low)


def attention_head_dims(option: str, dims: int | Iterable[int], kernel: bool) -> None:
    """Head dims the attention kernels take: launched directly (``kernel``), one of their own head dims;
    through the public call, any up to the largest (a smaller one is zero-padded to the next kernel's)."""
    from kernel_templates.hstu_attention.config import SUPPORTED_HEAD_DIMS

    for d in _values(dims):
        if kernel and d not in SUPPORTED_HEAD_DIMS:
            raise CLIError(f"{option} must be one of {SUPPORTED_HEAD_DIMS} (the kernels' head dims), got {d}")
        int_in(option, d, 1, SUPPORTED_HEAD_DIMS[-1])


def one_of(option: str, values: Any, known: Iterable[Any]) -> None:
    """Every value of ``values`` (one or a list) is in ``known``: a misspelt name ran nothing, or failed late."""
    known = tuple(known)
    unknown = [v for v in _values(values) if v not in known]
    if unknown:
        raise CLIError(f"{option}: unknown {', '.join(map(str, unknown))}; known: {', '.join(map(str, known))}")


def length_distributions(option: str, values: Any) -> None:
    """Names of the tuner's length distributions (``autotune.runtime.buckets.sequence_lengths``)."""
    from autotune.runtime.buckets import DISTRIBUTIONS

    one_of(option, values, DISTRIBUTIONS)


def l2_groups(option: str, values: list[int] | None) -> None:
    """Launch-order groups a kernel config takes (None: not given)."""
    from kernel_templates.config_base import L2_GROUPS

    if values is not None:
        one_of(option, values, L2_GROUPS)


def probability(option: str, value: float) -> None:
    """A probability in [0, 1), as a dropout rate must be."""
    if not 0.0 <= value < 1.0:
        raise CLIError(f"{option} must be in [0, 1), got {value}")


def positive(option: str, value: float) -> None:
    """A finite number above 0 (a time budget)."""
    if not math.isfinite(value) or value <= 0:
        raise CLIError(f"{option} must be a positive number, got {value}")


def existing_folder(option: str, path: str | None) -> None:
    """A folder read from must exist (None: not given): ``autotune.load`` of a missing one warns and runs the
    defaults, so a misspelt artifacts folder benchmarked the wrong kernels."""
    if path is not None and not Path(path).is_dir():
        raise CLIError(f"{option} {path}: no such folder")


def existing_file(option: str, path: str | None) -> None:
    """A file read from must exist (None: not given)."""
    if path is not None and not Path(path).is_file():
        raise CLIError(f"{option} {path}: no such file")


def needs_gpu(script: str) -> None:
    """Exit with one line, not torch's CUDA traceback from the first tensor, on a machine without a GPU."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA GPU")
