"""What one tuning task produces: its result and the artifact entry it writes.

Apart from ``tuner.py`` (the search) so the farm, its result reader and the CLI share one result type and one
entry layout without the study machinery. ``tuner`` still exports ``InfraError``, ``TaskResult`` and ``failed_result``
(where the farm, the CLI and the tests import them from).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autotune.runtime.buckets import batch_fill
from autotune.tuning.tasks import Task
from autotune.tuning.worker import WorkerError


class InfraError(RuntimeError):
    """The worker could not be set up (GPU held by a dying process, host OOM, ...): no config's fault."""


@dataclass
class TaskResult:
    """What tuning one task gave: the chosen config and its timings, or why there is none."""

    task: Task
    backend: str | None = None
    config: dict[str, Any] | None = None
    median_ms: float | None = None
    spread_ms: float | None = None
    tflops: float | None = None
    default_config: dict[str, Any] | None = None
    default_ms: float | None = None
    default_tflops: float | None = None
    speedup: float | None = None
    trials: int = 0
    tuning_s: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)
    kept_default: bool = False
    error: str | None = None
    timing: str = "do_bench"  # how median_ms was measured: "do_bench" or "do_bench+cuda_graph"
    verified: list[str] = field(default_factory=list)  # cases the written config passed at the end
    rejected: dict[str, str] = field(default_factory=dict)  # config key -> why the final checks refused it
    comparison: dict[str, Any] | None = None  # interleaved winner/default timing verdict
    samples: int | None = None  # timed samples behind the chosen config's trial time
    cut: bool = False  # stopped by its deadline (the time budget) before its trials were measured
    left: str | None = None  # a farm host's budget ran out before it ran the task: why, and who runs it instead

    def entry(self) -> dict[str, Any]:
        t = self.task
        return {
            "dtype": t.dtype,
            "dqk": t.dqk,
            "dv": t.dv,
            "num_heads": t.num_heads,
            "bucket": t.bucket,
            "distribution": t.distribution,
            "mask": t.mask,
            "backend": self.backend,
            "config": self.config,
            "median_ms": self.median_ms,
            "spread_ms": self.spread_ms,
            "tflops": self.tflops,
            "default_ms": self.default_ms,
            "default_tflops": self.default_tflops,
            "speedup": self.speedup,
            "trials": self.trials,
            "tuning_s": round(self.tuning_s, 2),
            "timing": self.timing,
            "verified": list(self.verified),
            "fill": recorded_fill(t.lengths()),
            "batch": t.batch,
            **({"samples": self.samples} if self.samples else {}),
            **({"compare": _rounded(self.comparison)} if self.comparison else {}),
            **({"lengths": _sample_descriptor(t)} if t.sample is not None else {}),
        }


def failed_result(task: Task, e: BaseException) -> TaskResult:
    """The result of a task whose tuning raised ``e``. A task its deadline had cut before the raise stays cut
    (``tune_task`` marks the exception with ``cut_after``, its measured trials): it is reported, and a farm
    queues it again, as a task the time budget stopped, which the same command resumes."""
    if isinstance(e, InfraError):
        error = f"infrastructure: {e}"
    else:  # an unexpected type keeps its name: a bare KeyError('x') said only 'x'
        error = str(e) if isinstance(e, (RuntimeError, WorkerError)) else f"{type(e).__name__}: {e}"
    measured = getattr(e, "cut_after", None)
    return TaskResult(task, error=error, cut=measured is not None, trials=measured or 0)


def _sample_descriptor(task: Task) -> dict[str, Any]:
    """What an entry tuned on a lengths sample records of it (and of its representative batch)."""
    from autotune.runtime.lengths import describe

    lengths = task.lengths()
    return {**describe(task.sample), "batch_fill": recorded_fill(lengths)}


def recorded_fill(lengths: list[int]) -> float:
    """The timed batch's fill as dispatch computes a call's (``dispatch.call_fill``): its rows over B x the
    launch's max_seq_len, which the task's inputs set to the longest length. Over the bucket instead, a batch drawn
    from a lengths sample (longest 3000 in the 4K bucket) recorded a fill up to 2x below that of the very call it
    was timed on. 4 significant digits: four decimals rounded a wide batch of short lengths (a sample of 1s at batch
    60000, bucket 32K: 5e-5) to 0.0, which the artifact's own check refuses, so the entry could not be written."""
    return float(f"{batch_fill(lengths, max(lengths)):.4g}")


def _rounded(d: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in d.items()}
