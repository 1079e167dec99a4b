"""Heuristic defaults fitted to the target GPU's feasibility rules.

The templates' defaults (``default_*_config``, and the search spaces' ``default`` that call them) were picked
from H100 sweeps. On a GPU with less shared memory (an A100 at head dim 256) or at a width they were not
picked for (a LayerNorm 8192 wide) one breaks its own space's rules: a tuning run would start from a
baseline that cannot compile, and a call without artifacts would run it. Those functions are hashed into
the tuned artifacts, so the fit happens here, where the tuner's baseline and dispatch's default both pass:
a default its rules accept (every one the H100 and H200 artifacts were tuned against) is kept as it is.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from autotune import spec
from autotune.runtime import gpus
from autotune.runtime.buckets import BUCKETS
from search_spaces.base import DTYPE_BYTES, SearchSpace, SpaceContext


def _distance(space: SearchSpace, config: Any, other: Any) -> tuple[int, int]:
    """(params that differ, steps along their choice lists): how far ``other`` moves from ``config``."""
    changed = steps = 0
    for name, choices in space.params.items():
        a, b = getattr(config, name), getattr(other, name)
        if a != b:
            changed += 1
            steps += abs(choices.index(a) - choices.index(b)) if a in choices else len(choices)
    return changed, steps


def fit_default(space: SearchSpace, config: Any, ctx: SpaceContext) -> Any:
    """``config`` when ``space``'s rules accept it on ``ctx``, else the feasible config of the space nearest to
    it (fewest params changed, then fewest choice steps, then the space's order; its other fields kept).

    The rules are read at the longest bucket: a default serves every length, and a tile longer than a short
    sequence only computes padding. Where no config is feasible (a backend that cannot run on that GPU or
    dtype) ``config`` comes back unchanged."""
    ctx = dataclasses.replace(ctx, max_len=max(ctx.max_len, BUCKETS[-1]))
    if space.why_infeasible(config, ctx) is None:
        return config
    for other in sorted(space.full(), key=lambda c: _distance(space, config, c)):  # stable: the space's order
        try:
            candidate = dataclasses.replace(config, **space.values(other))
        except ValueError:
            continue
        if space.why_infeasible(candidate, ctx) is None:
            return candidate
    return config


def space_default(space: SearchSpace, ctx: SpaceContext) -> Any:
    """The space's heuristic default for ``ctx``, fitted to its rules: the tuner's baseline, what dispatch runs
    (``fit_spec_default``). Under the interpreter as given, as dispatch runs it there: any tile runs (the
    interpreter's own rules only keep tuning short)."""
    config = space.default(ctx)
    return config if ctx.interpret else fit_default(space, config, ctx)


def spec_defaults(kind: str, dqk: int, dv: int, num_heads: int, dtype: object, interpret: bool) -> dict[str, Any]:
    """{backend: config} of ``kind``'s spec defaults for these dims and dtype, in preference order (empty when the
    spec names none): what dispatch runs without artifacts and the tuner's baseline."""
    k = spec.kernel(kind)
    return spec.resolve(k.default)(dqk, dv, num_heads, dtype, interpret) if k.default else {}


def baseline_backend(kind: str, dqk: int, dv: int, num_heads: int, dtype: object, interpret: bool, among: Any) -> str:
    """The backend of ``among`` (names) that runs ``kind`` without artifacts: the first of the spec's defaults for
    these dims and dtype (``dispatch.default_choice`` runs the first available one), else Triton, else the first.
    The tuner's baseline: gemm_silu in float32 runs torch, not the CuTe kernel that sorts first."""
    names = list(among)
    order = spec_defaults(kind, dqk, dv, num_heads, dtype, interpret)
    return next((b for b in order if b in names), "triton" if "triton" in names else names[0])


def fit_spec_default(
    kind: str, backend: str, config: Any, dqk: int, dv: int, num_heads: int, dtype: object, interpret: bool
) -> Any:
    """A kernel spec's default ``config`` of ``backend``, fitted to the running GPU's rules; as given under the
    interpreter (any tile runs there), without a known GPU or dtype (a CPU, a trace), or for a backend built
    for another GPU."""
    gpu = None if interpret else gpus.running_gpu()
    name = str(dtype).removeprefix("torch.")
    if gpu is None or name not in DTYPE_BYTES:
        return config
    b = spec.kernel(kind).backend(backend)
    if b.space is None or b.compute_capability not in (None, gpu.compute_capability):
        return config
    return _fit(b.space, config, SpaceContext(gpu, name, dqk, dv, BUCKETS[-1], False, num_heads))


@functools.lru_cache(maxsize=256)
def _fit(space: str, config: Any, ctx: SpaceContext) -> Any:
    """``fit_default`` once per (space, config, context): a search costs up to a few tenths of a second."""
    return fit_default(spec.resolve(space), config, ctx)


spec.on_change(_fit.cache_clear)
