"""Shared pieces of the farm tests: an in-process farm on one small fake task, and a plain Optuna storage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna

from autotune.tuning.study_storage import rdb_url

# Fast farm timings for tests (beats every second, a dead worker noticed after 3 s) over the fake op's two configs.
FARM_ENV = {
    "AUTOTUNE_FAKE_MODES": "ok,ok2",
    "AUTOTUNE_FARM_HEARTBEAT": "1",
    "AUTOTUNE_FARM_GRACE": "3",
    "AUTOTUNE_FARM_POLL": "0.3",
    "TRITON_INTERPRET": "1",
}


def rdb_storage(url: str) -> optuna.storages.RDBStorage:
    """A plain Optuna storage on ``url`` (no farm wrapper): what another host would open."""
    return optuna.storages.RDBStorage(rdb_url(url))


def one_task_farm(pg_url: str, tmp_path: Path, grace_s: float = 1, **opts_kw):
    """(farm options, the one fake task, tuning options, storage) of an in-process farm on one small task."""
    from autotune.tuning import farm, tuner
    from autotune.tuning.tasks import Task

    fopts = farm.FarmOptions(heartbeat_s=1, grace_s=grace_s, retries=3, poll_s=0.2)
    task = Task("fake_faults", "h100", "float32", 32, 32, 1, 256, "uniform", batch=2, seq_cap=64)
    opts = tuner.TuneOptions(n_trials=2, sampler="bruteforce", interpret=True, plugins=["autotune.tuning.fake"],
                             artifacts_root=tmp_path, **opts_kw)  # fmt: skip
    return fopts, task, opts, farm.farm_storage(pg_url, fopts)


def run_one(study: optuna.Study, trial: optuna.Trial, opts: Any, fopts: Any, worker_id: str) -> bool:
    """``farm._run_one`` of the claimed ``trial`` by a worker named ``worker_id`` of this process (a fresh tuner
    worker, closed after)."""
    from autotune.runtime import gpus
    from autotune.tuning import farm
    from autotune.tuning.registry import plugin_modules
    from autotune.tuning.worker import Worker

    worker = Worker(plugin_modules(opts.plugins))
    ctx = {"opts": opts, "fopts": fopts, "id": worker_id, "deadline": None, "env": gpus.environment(), "worker": worker}
    try:
        return farm._run_one(study, trial, ctx)
    finally:
        worker.close()
