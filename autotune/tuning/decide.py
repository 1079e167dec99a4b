"""The end of a study: which config is written (``decide``). The fastest correct configs are re-checked on the
bucket's other shapes, masks and dtypes, then timed interleaved with the default; a candidate is kept only if it
passes its re-check and beats the default by more than the spread, else the default is, if it passes its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import TrialState

from autotune.tuning.measure import compare_extended

if TYPE_CHECKING:
    from autotune.tuning.tuner import TaskResult, _Study

# Trials that failed for reasons outside the config: never counted as seen, so they run again.
RETRY_STATUSES = ("interrupted", "infra")
# A default trial that ended so in an earlier run is measured again when its study is reopened, and none of these
# is a measured default: "timing" is a clock that gave no positive finite time, the environment's, as a hang may be.
DEFAULT_REMEASURE = ("timeout", "crash", "timing")


def _verify(s: _Study, trial: optuna.trial.FrozenTrial) -> dict[str, Any]:
    """The worker's re-check of ``trial``'s config. A re-check whose every case the space's rules ruled out
    (a default measured despite its rules) vouches for nothing: it is "unchecked", not a pass."""
    msg = {"cmd": "verify", "backend": trial.user_attrs["backend"], "config": s.values_of(trial)}
    v = s.request({**msg, "level": s.opts.verify}, timeout=max(s.opts.eval_timeout_s, s.opts.verify_timeout_s))
    if v["status"] == "ok" and not v.get("checked"):
        skipped = "; ".join(v.get("skipped", []))
        return {**v, "status": "unchecked", "error": f"the space's rules ruled out every case ({skipped})"}
    return v


def decide(s: _Study, result: TaskResult) -> optuna.trial.FrozenTrial | None:
    """The config to write: the fastest one that passes the re-check on the bucket's other shapes and
    beats the default by more than the measured spread in interleaved timings; else the default.

    A default whose measurement did not finish (timed out, crashed, never measured) may have failed for
    the environment's sake: nothing is written then (a re-run measures it again). A default that ran and
    was wrong (incorrect, failed to compile, over the spill limit) has nothing to be compared with: the
    fastest re-checked config is written. A default that failed the final re-check is never written; a
    re-checked candidate then wins even when the comparison does not favour it, in this run as in a re-run
    (which finds the default among the rejected)."""
    default = s.seen.get(s.default_key)
    status = default.user_attrs.get("status") if default is not None else "not measured"
    if default is None or status in (*DEFAULT_REMEASURE, *RETRY_STATUSES):
        result.error = (
            f"the default config could not be measured (status {status}"
            + (f": {str(default.user_attrs.get('error'))[-200:]}" if default is not None else "")
            + "); no winner is written without a measured default to compare with (re-run to measure it again)"
        )
        return None
    measured = status == "ok" and default.state == TrialState.COMPLETE
    memo: dict[tuple[str, int], Any] = {}  # each candidate is re-checked and compared once
    while True:
        default_ok = measured and s.default_key not in s.rejected
        cand = _candidate(s, result, default, measured, default_ok, memo)
        if cand is not None or not default_ok:
            return cand
        v = _verify(s, default)
        if v["status"] == "ok":
            result.verified = v.get("checked", [])
            result.kept_default = True
            return default
        s.reject(default, f"{v['status']} on re-check: {v.get('error')}")  # the candidates' turn again


def _candidate(
    s: _Study,
    result: TaskResult,
    default: optuna.trial.FrozenTrial,
    measured: bool,
    default_ok: bool,
    memo: dict[tuple[str, int], Any],
) -> optuna.trial.FrozenTrial | None:
    """The fastest candidate (at most ``max_verify`` re-checked) that passes its re-check and is to be written:
    it beats the default, or the default is not to be written; None leaves the decision to the default."""
    result.comparison = None
    for cand in s.ranked():
        if cand.number == default.number:
            break
        if ("verify", cand.number) not in memo:
            if sum(k[0] == "verify" for k in memo) >= s.opts.max_verify:
                break
            memo["verify", cand.number] = _verify(s, cand)
        v = memo["verify", cand.number]
        if v["status"] != "ok":
            s.reject(cand, f"{v['status']} on re-check: {v.get('error')}")
            continue
        if not measured:  # the default ran wrong: nothing to compare with
            result.verified = v.get("checked", [])
            return cand
        if ("compare", cand.number) not in memo:
            memo["compare", cand.number] = _compare(s, cand)
        cmp, verdict = memo["compare", cand.number]
        if verdict is None:
            if cmp.get("side") == "b":
                break  # the default went wrong on the timed batch: keep the measured default decision
            s.reject(cand, f"{cmp['status']} in the final comparison: {cmp.get('error')}")
            continue
        result.comparison = verdict
        if verdict["beats"] or not default_ok:
            result.verified = v.get("checked", [])
            return cand
        break
    return None


def _compare(s: _Study, cand: optuna.trial.FrozenTrial) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``compare_extended`` of ``cand`` (a) against the default (b) in the worker: (first reply, verdict)."""
    a = {"backend": cand.user_attrs["backend"], "config": s.values_of(cand)}
    b = {"backend": s.default_backend.name, "config": s.default_values}
    timeout = max(s.opts.eval_timeout_s, s.opts.verify_timeout_s)
    return compare_extended(
        lambda n: s.request({"cmd": "compare", "rounds": n, "a": a, "b": b}, timeout=timeout),
        s.opts.compare_rounds,
        s.opts.compare_max_rounds,
    )
