"""Runtime dispatch: bucket choice, fallbacks and their one-time warnings, same choice in every process."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from proc_env import child_env

from autotune.runtime import dispatch
from autotune.runtime.artifacts import Artifact, current_template_hash, save_artifact
from kernel_templates.hstu_attention.config import default_bwd_config, default_fwd_config

FWD, BWD = "hstu_attention_fwd", "hstu_attention_bwd"
REPO = Path(__file__).resolve().parents[1]
ENV = {k: None for k in ("gpu_name", "compute_capability", "sm_count", "driver", "cuda", "torch", "triton")}


def _host_environment() -> dict:
    """The environment block of a file tuned on this host (a GPU host rejects a file with no registry GPU), so
    the dispatch rules below read the same on CPU and GPU hosts."""
    from autotune.runtime import gpus

    return gpus.running_environment() or dict(ENV, cutlass_dsl=None)


def _entry(bucket: int, block_m: int, kind: str = FWD, dqk: int = 64, distribution: str = "uniform", **kw) -> dict:
    base = default_fwd_config(dqk, dqk) if kind == FWD else default_bwd_config(dqk, dqk)
    config = dict(base.to_dict(), block_m=block_m, block_n=32, num_warps=4)
    e = {
        "dtype": "bfloat16", "dqk": dqk, "dv": dqk, "num_heads": 4, "bucket": bucket, "distribution": distribution,
        "mask": "causal", "backend": "triton", "config": config, "median_ms": 1.0, "spread_ms": 0.01,
        "tflops": 100.0, "default_ms": 1.2, "default_tflops": 80.0, "speedup": 1.2, "trials": 10, "tuning_s": 1.0,
    }  # fmt: skip
    e.update(kw)
    return e


def write_artifacts(root: Path, gpu: str = "h100", stale: bool = False, extra: list[dict] | None = None) -> Path:
    """Fwd and bwd artifacts with entries at buckets 1024 (block_m 32) and 4096 (block_m 128)."""
    for kind in (FWD, BWD):
        entries = [_entry(1024, 32, kind), _entry(4096, 128, kind), _entry(4096, 64, kind, distribution="jagged")]
        entries += [e for e in (extra or []) if (kind == BWD) == ("dq_mode" in e["config"])]
        hashes = {"triton": "0" * 64 if stale else current_template_hash(kind, "triton")}
        for e in entries:
            hashes.setdefault(e["backend"], current_template_hash(kind, e["backend"]))
        art = Artifact(kind, gpu, _host_environment(), hashes, "s" * 64, entries)
        save_artifact(art, root / gpu / f"{kind}.json")
    return root


@pytest.fixture(autouse=True)
def _fresh_dispatch():
    dispatch.reset()
    yield
    dispatch.reset()


def _block_m(choice: dispatch.Choice) -> int:
    return json.loads(choice.config)["block_m"]


def test_exact_bucket_choice_without_warnings(tmp_path):
    import autotune

    loaded = autotune.load(str(write_artifacts(tmp_path)), gpu="h100")  # the one line training code needs
    assert loaded["kernels"] == [BWD, FWD] and not loaded["problems"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        small = dispatch.select(FWD, "bfloat16", 64, 64, 4, 1000, "uniform")
        mid = dispatch.select(FWD, "bfloat16", 64, 64, 4, 3000, "uniform")
        jag = dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, "jagged")
        bwd = dispatch.select(BWD, "bfloat16", 64, 64, 4, 1024, None)
    assert (_block_m(small), small.source, small.bucket) == (32, "tuned", 1024)
    assert (_block_m(mid), mid.bucket) == (128, 4096)
    assert _block_m(jag) == 64
    assert json.loads(bwd.config)["dq_mode"] == "atomic" and _block_m(bwd) == 32
    assert mid.backend == "triton"


def test_a_fallback_warning_names_the_callers_line_not_dispatch_internals(tmp_path):
    """The warning points at the line that asked for the kernel (here this test; in training the model's
    layer): a fixed stack level named a line inside dispatch (``value = build(state)``)."""
    dispatch.load(write_artifacts(tmp_path), gpu="h100")
    with pytest.warns(dispatch.DispatchWarning, match="nearest tuned bucket") as got:
        dispatch.select(FWD, "bfloat16", 64, 64, 4, 16000, "uniform")
    assert [w.filename for w in got] == [__file__]


def test_nearest_bucket_fallback_warns_once(tmp_path):
    dispatch.load(write_artifacts(tmp_path), gpu="h100")
    with pytest.warns(dispatch.DispatchWarning, match="nearest tuned bucket 4096"):
        c = dispatch.select(FWD, "bfloat16", 64, 64, 4, 16000, "uniform")
    assert (_block_m(c), c.source) == (128, "nearest")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same reason again (another length in the bucket): no new warning
        again = dispatch.select(FWD, "bfloat16", 64, 64, 4, 12000, "uniform")
    assert again == c
    # 2048 sits between 1024 and 4096 (equal log distance): the larger bucket wins, deterministically.
    with pytest.warns(dispatch.DispatchWarning, match="bucket 2048"):
        assert _block_m(dispatch.select(FWD, "bfloat16", 64, 64, 4, 2048, "uniform")) == 128


def test_no_artifact_for_gpu_falls_back_to_default(tmp_path):
    dispatch.load(write_artifacts(tmp_path, gpu="h100"), gpu="a100")
    with pytest.warns(dispatch.DispatchWarning, match="no artifact for GPU 'a100'"):
        c = dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, "uniform")
    assert c.source == "default"
    assert json.loads(c.config) == default_fwd_config(64, 64, os.environ.get("TRITON_INTERPRET") == "1").to_dict()
    assert "a100" in dispatch.summary()["missing"][FWD]


def test_stale_template_hash_falls_back(tmp_path):
    dispatch.load(write_artifacts(tmp_path, stale=True), gpu="h100")
    with pytest.warns(dispatch.DispatchWarning, match="stale"):
        c = dispatch.select(BWD, "bfloat16", 64, 64, 4, 4096, "uniform")
    assert c.source == "default"
    assert json.loads(c.config) == default_bwd_config(64, 64, os.environ.get("TRITON_INTERPRET") == "1").to_dict()


def test_unseen_head_dim_falls_back(tmp_path):
    dispatch.load(write_artifacts(tmp_path), gpu="h100")
    with pytest.warns(dispatch.DispatchWarning, match="unseen head dim"):
        c = dispatch.select(FWD, "bfloat16", 128, 128, 4, 4096, "uniform")
    assert c.source == "default"
    assert any("dqk=128" in w for w in dispatch.WARNINGS)


def test_other_16bit_dtype_serves_only_when_rechecked_in_the_call_dtype(tmp_path):
    """An fp16 call with no fp16 entry takes the bf16 entry whose full re-check ran fp16, never an unchecked one."""
    checked = ["many-short/causal/bfloat16", "many-short/causal/float16"]
    dispatch.load(write_artifacts(tmp_path, extra=[_entry(8192, 16, verified=checked)]), gpu="h100")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp16 = dispatch.select(FWD, "float16", 64, 64, 4, 8192, "uniform")
        bf16 = dispatch.select(FWD, "bfloat16", 64, 64, 4, 8192, "uniform")
    assert (_block_m(fp16), fp16.source, fp16.bucket) == (16, "tuned", 8192) and fp16 == bf16
    # The 1024 / 4096 entries list no fp16 case: an fp16 call there falls to the checked entry's bucket.
    with pytest.warns(dispatch.DispatchWarning, match="dtype=bfloat16 instead of float16"):
        near = dispatch.select(FWD, "float16", 64, 64, 4, 1024, "uniform")
    assert (_block_m(near), near.source) == (16, "nearest")
    assert dispatch.select(FWD, "bfloat16", 64, 64, 4, 1024, "uniform").source == "tuned"
    # fp32 has no 16-bit sibling; the backward artifact has no fp16-checked entry: both keep the default.
    with pytest.warns(dispatch.DispatchWarning, match="unseen head dim"):
        assert dispatch.select(FWD, "float32", 64, 64, 4, 8192, "uniform").source == "default"
    with pytest.warns(dispatch.DispatchWarning, match="dtype=float16"):
        assert dispatch.select(BWD, "float16", 64, 64, 4, 4096, "uniform").source == "default"


def test_own_dtype_entries_win_over_the_other_16bit_dtype(tmp_path):
    checked = ["many-short/causal/bfloat16", "many-short/causal/float16"]
    fp16_entry = _entry(8192, 64, dtype="float16")
    dispatch.load(write_artifacts(tmp_path, extra=[_entry(8192, 16, verified=checked), fp16_entry]), gpu="h100")
    assert _block_m(dispatch.select(FWD, "float16", 64, 64, 4, 8192, "uniform")) == 64
    with pytest.warns(dispatch.DispatchWarning, match="nearest tuned bucket 8192"):  # fp16 bucket 4096: own dtype
        assert _block_m(dispatch.select(FWD, "float16", 64, 64, 4, 4096, "uniform")) == 64


def test_an_fp16_call_prefers_the_verified_bf16_entry_of_its_bucket(tmp_path):
    """Two bf16 entries of one bucket compete for an fp16 call without a distribution hint: the uniform one (the
    lookup's first choice) was never re-checked in fp16, the jagged one was. The lookup picked the uniform one,
    refused it, and served the verified one as "nearest" with an empty warning; it is the bucket's tuned entry.
    bf16 calls keep the uniform one."""
    fp16 = ["many-short/causal/bfloat16", "many-short/causal/float16"]
    extra = [_entry(8192, 16), _entry(8192, 32, distribution="jagged", verified=fp16)]
    dispatch.load(write_artifacts(tmp_path, extra=extra), gpu="h100")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        half = dispatch.select(FWD, "float16", 64, 64, 4, 8192)
        bf16 = dispatch.select(FWD, "bfloat16", 64, 64, 4, 8192)
    assert (_block_m(half), half.source, half.bucket) == (32, "tuned", 8192)
    assert (_block_m(bf16), bf16.source) == (16, "tuned")


def test_a_bf16_entry_verified_in_fp16_under_one_mask_serves_no_other(tmp_path):
    """``verified`` cases are "case/mask/dtype": an entry re-checked in fp16 only under the causal mask served fp16
    window calls (its fp16 window kernel never checked). An fp16 window call takes an entry re-checked in fp16
    under the window mask (here the next bucket's, as nearest), else the default."""
    causal_only = ["many-short/causal/bfloat16", "many-short/causal/float16"]
    window = [*causal_only, "many-short/window/float16"]
    extra = [_entry(8192, 16, verified=causal_only), _entry(8192, 32, mask="window")]
    dispatch.load(write_artifacts(tmp_path, extra=extra), gpu="h100")
    with pytest.warns(dispatch.DispatchWarning, match="unseen head dim"):
        assert dispatch.select(FWD, "float16", 64, 64, 4, 8192, "uniform", mask="window").source == "default"
    assert _block_m(dispatch.select(FWD, "float16", 64, 64, 4, 8192, "uniform")) == 16  # causal: verified
    dispatch.load(write_artifacts(tmp_path, extra=[*extra, _entry(16384, 64, verified=window)]), gpu="h100")
    with pytest.warns(dispatch.DispatchWarning, match="nearest tuned bucket 16384"):
        near = dispatch.select(FWD, "float16", 64, 64, 4, 8192, "uniform", mask="window")
    assert (_block_m(near), near.source) == (64, "nearest")
    assert _block_m(dispatch.select(FWD, "bfloat16", 64, 64, 4, 8192, "uniform", mask="window")) == 32
    assert dispatch.verified_for({"verified": window}, "float16", "window")
    assert not dispatch.verified_for({"verified": causal_only}, "float16", "window")
    assert dispatch.verified_for({"verified": causal_only}, "float16")  # no mask: any mask


# Every choice of the committed attention artifacts over this grid of calls, as a digest: dispatch changes must
# leave bf16 choices as they are. Re-pin (the assertion prints the new digest) only with new artifact files.
PINNED_BF16_CHOICES = {
    "h100": "39b788a960e587133f8942a8aceb09756f780a98eac1efa18090d2f6b5dddb8f",
    "h200": "6ca0a1bd40f6380961ba85c98a2c95969db5c304d2360aa41300cf4fbfbd95ac",
}
_GRID_LENGTHS = (100, 1024, 3000, 4096, 8192, 16384, 32768, 50000)
_GRID_FILLS = (None, 1.0, 0.3, 0.05)


def _committed_choices(monkeypatch, gpu: str, dtype: str) -> list[tuple]:
    """(call, choice) over the grid, with the committed files loaded as on their GPU (every backend runnable)."""
    from autotune.runtime import gpus

    env = json.loads((REPO / "artifacts" / gpu / f"{FWD}.json").read_text())["environment"]
    monkeypatch.setattr(gpus, "environment", lambda: dict(env))
    available = lambda name, kind: True  # noqa: E731 - CuTe entries are chosen as on the GPU
    available.cache_clear = lambda: None
    monkeypatch.setattr(dispatch, "backend_available", available)
    dispatch.reset()
    assert not dispatch.load(REPO / "artifacts", gpu=gpu)["problems"]
    hints = [*((d, None) for d in ("uniform", "jagged", "sparse")), *((None, f) for f in _GRID_FILLS)]
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dispatch.DispatchWarning)
        for kind, d, heads, n, mask in itertools.product(
            (FWD, BWD), (64, 128, 256), (1, 2, 4, 8), _GRID_LENGTHS, ("causal", "targets", "window")
        ):
            for dist, fill in hints:
                c = dispatch.select(kind, dtype, d, d, heads, n, dist, "tuned", mask, fill)
                out.append(((kind, d, heads, n, mask, dist, fill), (c.backend, c.config, c.source, c.bucket)))
    return out


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_bf16_choices_of_the_committed_artifacts_are_pinned(monkeypatch, gpu):
    """A digest of every bf16 choice over a grid of calls (heads, lengths, masks, distributions, fills). The
    committed entries are all re-checked in fp16 under every mask, so fp16 calls get the same choices."""
    bf16 = _committed_choices(monkeypatch, gpu, "bfloat16")
    digest = hashlib.sha256(json.dumps(bf16).encode()).hexdigest()
    assert digest == PINNED_BF16_CHOICES[gpu], f"bf16 dispatch of artifacts/{gpu} changed: digest {digest}"
    assert _committed_choices(monkeypatch, gpu, "float16") == bf16


def _add_raw_entry(root: Path, entry: dict, kind: str = FWD) -> None:
    """Append ``entry`` to a saved artifact as a hand edit would (no validation on the way)."""
    path = root / "h100" / f"{kind}.json"
    data = json.loads(path.read_text())
    data["entries"].append(entry)
    data["template_hash"].setdefault(entry["backend"], "0" * 64)
    path.write_text(json.dumps(data))


def test_unavailable_backend_falls_back(tmp_path):
    """An entry of a backend the kernel's spec does not declare makes the file invalid: the default runs."""
    root = write_artifacts(tmp_path)
    _add_raw_entry(root, _entry(8192, 16, backend="nosuchbackend"))
    dispatch.load(root, gpu="h100")
    with pytest.warns(dispatch.DispatchWarning, match="nosuchbackend"):
        c = dispatch.select(FWD, "bfloat16", 64, 64, 4, 8192, "uniform")
    assert c.backend == "triton" and c.source == "default"


def test_a_reference_entry_is_never_served_as_tuned(tmp_path):
    """The fp32 oracle (O(n^2) memory) is a source a caller asks for, never a backend read from a file."""
    root = write_artifacts(tmp_path)
    _add_raw_entry(root, _entry(8192, 16, backend="reference", config={}))
    dispatch.load(root, gpu="h100")
    with pytest.warns(dispatch.DispatchWarning, match="reference"):
        c = dispatch.select(FWD, "bfloat16", 64, 64, 4, 8192, "uniform")
    assert c.backend == "triton" and c.source == "default"
    with pytest.warns(dispatch.DispatchWarning, match="reference"):
        assert dispatch._entry_choice(FWD, _entry(8192, 16, backend="reference"), "tuned", {}) is None


def test_entry_fill_skips_recorded_values_outside_zero_one():
    """A bad recorded fill (validation rejects it at load) never reaches log2: the law's fill is used."""
    for bad in (0, -0.5, 1.5, "x", True, None):
        assert dispatch.entry_fill({"distribution": "uniform", "bucket": 1024, "fill": bad}) == 1.0
        jagged = {"distribution": "jagged", "bucket": 1024, "fill": bad, "lengths": {"batch_fill": bad}}
        assert 0 < dispatch.entry_fill(jagged) < 1


def test_sources_and_unloaded_state_do_not_warn(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.select(FWD, "float32", 32, 32, 2, 64).source == "default"  # nothing loaded: heuristic
        dispatch.load(write_artifacts(tmp_path), gpu="h100")
        assert dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, source="default").source == "default"
        ref = dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, source="reference")
    assert ref.backend == "reference"
    with pytest.raises(ValueError, match="source='fastest': unknown kernel source"):  # names the argument
        dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, source="fastest")


def test_cached_dispatch_is_microseconds(tmp_path):
    dispatch.load(write_artifacts(tmp_path), gpu="h100")
    dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, "uniform")
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, "uniform")
    per_call_us = (time.perf_counter() - t0) / n * 1e6
    assert per_call_us < 50, per_call_us


_CHILD = """
import json, sys, warnings
warnings.simplefilter("ignore")
from autotune.runtime import dispatch
dispatch.load(sys.argv[1], gpu="h100")
out = []
for kind in ("hstu_attention_fwd", "hstu_attention_bwd"):
    for n in (200, 1000, 2048, 3000, 4096, 9000, 20000):
        for dist in ("uniform", "jagged", None):
            c = dispatch.select(kind, "bfloat16", 64, 64, 4, n, dist)
            out.append([kind, n, dist, c.backend, c.config, c.source])
print(json.dumps(out))
"""


def test_same_choice_in_every_process(tmp_path):
    root = write_artifacts(tmp_path)
    env = child_env()
    procs = [
        subprocess.Popen([sys.executable, "-c", _CHILD, str(root)], stdout=subprocess.PIPE, env=env, cwd=REPO)
        for _ in range(2)
    ]
    outs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1]
    assert len({row[4] for row in outs[0]}) >= 3  # really different configs were chosen


# ----------------------------------------------------------------------------------- fill ratio
def test_fill_ratio_picks_the_entry_tuned_on_the_nearest_fill(tmp_path):
    """Without a hint, the batch's fill L / (B x max_seq_len) picks between the uniform entry (fill 1)
    and the jagged one (the synthetic law's fill, or the recorded one); more skewed than both: the
    jagged one; between them and far from both: uniform."""
    from autotune.runtime.buckets import law_fill

    dispatch.load(write_artifacts(tmp_path), gpu="h100")
    jagged_fill = law_fill(4096)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        full = dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, None, fill=1.0)
        near = dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, None, fill=jagged_fill * 1.2)
        far = dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, None, fill=jagged_fill / 4)
        unknown = dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, None, fill=None)
        hinted = dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, "uniform", fill=jagged_fill)
    assert (_block_m(full), _block_m(near), _block_m(far), _block_m(unknown), _block_m(hinted)) == (
        128,
        64,
        64,
        128,
        128,
    )
    # A recorded fill wins over the law's: the same jagged entry recorded at fill 0.05 takes the calls near
    # it and below; a call between 0.05 and 1, a factor above 2 from both, runs the uniform entry.
    dispatch.reset()
    root = tmp_path / "recorded"
    write_artifacts(root)
    path = root / "h100" / f"{FWD}.json"
    data = json.loads(path.read_text())
    for e in data["entries"]:
        if e["distribution"] == "jagged":
            e["fill"] = 0.05
    path.write_text(json.dumps(data))
    dispatch.load(root, gpu="h100")
    assert _block_m(dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, None, fill=0.06)) == 64
    assert _block_m(dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, None, fill=jagged_fill)) == 128


def test_three_laws_each_take_the_calls_nearest_their_fill(tmp_path):
    """With a sparse entry beside the uniform and jagged ones (fills from their synthetic laws, not
    recorded), a call near the sparse law's fill and every call more skewed than it runs the sparse
    entry; a call near the jagged law's fill still runs the jagged one."""
    from autotune.runtime.buckets import law_fill

    sparse = _entry(4096, 16, FWD, distribution="sparse")
    dispatch.load(write_artifacts(tmp_path, extra=[sparse]), gpu="h100")
    jagged_fill, sparse_fill = law_fill(4096), law_fill(4096, "sparse")
    assert sparse_fill < jagged_fill / 3  # the laws are far enough apart for the fill to tell them apart
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        picks = [
            _block_m(dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, None, fill=f))
            for f in (1.0, jagged_fill, sparse_fill * 1.3, sparse_fill / 8)
        ]
        hinted = _block_m(dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, "sparse"))
    assert picks == [128, 64, 16, 16] and hinted == 16
    # The backward has no sparse entry here: the same skewed call falls back to its lowest-fill entry.
    assert _block_m(dispatch.select(BWD, "bfloat16", 64, 64, 4, 4096, None, fill=sparse_fill)) == 64


def test_sparse_law_has_one_full_sequence_among_short_ones():
    from autotune.runtime.buckets import SPARSE_DIVISOR, sequence_lengths

    for n, b, seed in ((1024, 32, 0), (8192, 16, 3), (256, 2, 1)):
        lengths = sequence_lengths(n, b, "sparse", seed)
        assert len(lengths) == b and lengths.count(n) >= 1 and min(lengths) >= 1
        assert sorted(lengths)[-2] <= -(-n // SPARSE_DIVISOR)  # the others are at most n / 8 long
    assert sequence_lengths(2048, 32, "sparse", 0) == sequence_lengths(2048, 32, "sparse", 0)


def test_fill_helpers():
    assert dispatch.call_fill(300, 4, 100) == 0.75
    assert dispatch.call_fill(500, 4, 100) == 1.0  # clamped: rows beyond B x N say the call is full
    assert dispatch.call_fill(0, 4, 100) is None and dispatch.call_fill(10, 0, 100) is None
    assert dispatch.fill_bin(1.0) == 0 and dispatch.fill_bin(0.5) == -dispatch.FILL_STEPS
    assert dispatch.fill_bin(None) is None and dispatch.fill_bin(0.0) is None
    assert dispatch.entry_fill({"distribution": "uniform", "bucket": 1024}) == 1.0
    assert dispatch.entry_fill({"distribution": "jagged", "bucket": 1024, "lengths": {"batch_fill": 0.4}}) == 0.4


def test_public_call_dispatches_by_fill_without_reading_offsets(tmp_path, monkeypatch):
    """hstu_attention reads only shapes to choose: offsets on the meta device (unreadable) still pick
    the jagged entry for a quarter-full batch and the uniform one for a full batch."""
    import torch

    from autotune.runtime import ops

    dispatch.load(write_artifacts(tmp_path), gpu="h100")
    seen = []
    monkeypatch.setattr(ops, "_AttentionFunction", type("F", (), {"apply": staticmethod(lambda *a: seen.append(a))}))
    offsets = torch.empty(5, dtype=torch.int32, device="meta")  # B = 4
    for rows, want in ((4 * 4096, 128), (4096, 64)):
        q = torch.empty(rows, 4, 64, dtype=torch.bfloat16, requires_grad=True)  # the autograd path
        ops.hstu_attention(q, q, q, offsets, 4096, validate="none")
        assert json.loads(seen[-1][11])["block_m"] == want


def test_a_loose_max_seq_len_chooses_by_the_rows(tmp_path, monkeypatch):
    """No sequence is longer than q has rows: max_seq_len 2**20 over 1000 rows takes the 1K entry (as a tight
    bound would), not the largest bucket's with a "never tuned at these lengths" warning."""
    import torch

    from autotune.runtime import ops

    dispatch.load(write_artifacts(tmp_path), gpu="h100")
    seen = []
    monkeypatch.setattr(ops, "_AttentionFunction", type("F", (), {"apply": staticmethod(lambda *a: seen.append(a))}))
    offsets = torch.empty(2, dtype=torch.int32, device="meta")  # B = 1
    q = torch.empty(1000, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.hstu_attention(q, q, q, offsets, 1 << 20, validate="none")
    assert json.loads(seen[-1][11])["block_m"] == 32 and seen[-1][5] == 1 << 20  # the call keeps max_seq_len


def test_choices_are_cached_per_bucket_not_per_row_count(tmp_path, monkeypatch):
    """A loose max_seq_len chooses by the rows: keyed by the length, dispatch's cache held (and resolved again) a
    choice per row count a jagged stream reached. Keyed by the length's bucket it holds one per bucket and fill,
    and ``length_key`` is ``bucket_for`` up to the largest bucket (one key above it)."""
    import torch

    from autotune.runtime import ops
    from autotune.runtime.buckets import bucket_for

    assert all(dispatch.length_key(n) == bucket_for(n) for n in range(dispatch.LARGEST_BUCKET + 1))
    assert {dispatch.length_key(n) for n in (dispatch.LARGEST_BUCKET + 1, 1 << 20, 2**31 - 1)} == {1 << 16}
    dispatch.load(write_artifacts(tmp_path), gpu="h100")
    resolved = []
    resolve = dispatch._resolve
    monkeypatch.setattr(dispatch, "_resolve", lambda *a, **kw: resolved.append(a[1]) or resolve(*a, **kw))
    monkeypatch.setattr(ops, "_AttentionFunction", type("F", (), {"apply": staticmethod(lambda *a: None)}))
    offsets = torch.empty(2, dtype=torch.int32, device="meta")  # B = 1: fill 1 whatever the rows
    for rows in range(600, 1000, 7):  # every one in the 1K bucket
        q = torch.empty(rows, 4, 64, dtype=torch.bfloat16, requires_grad=True)
        ops.hstu_attention(q, q, q, offsets, 1 << 20, validate="none")
    assert sorted(resolved) == [BWD, FWD]
    assert len(dispatch.cached_choices()) == 2


def test_a_batch_over_the_grid_limit_never_gets_a_per_sequence_grid(monkeypatch):
    """CUDA caps a grid's y dimension at 65535, where the CuTe grid order puts the sequences: a larger batch runs
    the Triton default (once warned) in the public call and the fused layer; compact/persistent CuTe configs
    (sequences in x) and batches within the limit keep their choice."""
    import torch

    from autotune.runtime import layer, ops
    from kernel_templates.cute.bwd_config import default_cute_bwd_config
    from kernel_templates.cute.op import default_cute_fwd_config
    from kernel_templates.hstu_attention.config import HSTUBwdConfig, HSTUFwdConfig

    grid = {**default_cute_fwd_config(64, 64).to_dict(), "compact": False}
    grid_bwd = {**default_cute_bwd_config(64, 64).to_dict(), "compact": False, "persistent": False}
    big = dispatch.GRID_YZ_MAX + 1
    for kind, cfg in ((FWD, grid), (BWD, grid_bwd)):
        assert dispatch.for_batch(kind, "cute", json.dumps(cfg), big - 1, 64, 64, "bfloat16", 4)[0] == "cute"
        compact = json.dumps(dict(cfg, compact=True))
        assert dispatch.for_batch(kind, "cute", compact, big, 64, 64, "bfloat16", 4) == ("cute", compact)
        with pytest.warns(dispatch.DispatchWarning, match="over the 65535"):
            backend, config = dispatch.for_batch(kind, "cute", json.dumps(cfg), big, 64, 64, "bfloat16", 4)
        assert backend == "triton" and dispatch.decode_config(backend, kind, config) is not None
    seen = []
    monkeypatch.setattr(ops, "_AttentionFunction", type("F", (), {"apply": staticmethod(lambda *a: seen.append(a))}))
    monkeypatch.setattr(ops, "_choose", lambda *a, **kw: ("cute", json.dumps(grid), "cute", json.dumps(grid_bwd)))
    q = torch.empty(big, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    for batch, want in ((big - 1, "cute"), (big, "triton")):
        ops.hstu_attention(q, q, q, torch.empty(batch + 1, dtype=torch.int32, device="meta"), 8, validate="none")
        assert (seen[-1][10], seen[-1][12]) == (want, want)
    fwd = layer.Step(FWD, "cute", type("C", (), {"to_dict": lambda self: grid})(), "tuned")
    fields = {"head_dim": 64, "heads": 4, "dtype": torch.bfloat16, "distribution": "uniform", "source": "tuned"}
    plan = type("P", (), {"step": lambda self, kind: fwd, **fields})()
    assert layer._attention_step(plan, FWD, torch.empty(big, device="meta"), big, 8) is fwd
    swapped = layer._attention_step(plan, FWD, torch.empty(big + 1, device="meta"), big, 8)
    assert swapped.backend == "triton" and isinstance(swapped.config, HSTUFwdConfig | HSTUBwdConfig)


@pytest.mark.parametrize("config", ["[1]", "{", '{"compact": 1}'])
def test_a_batch_over_the_grid_limit_decodes_the_config_as_every_call_does(config):
    """A direct ``torch.ops.hstu`` call over 65535 sequences reads its CuTe config in ``for_batch`` first: a string
    that is no config object failed there as an AttributeError ('list' object has no attribute 'get') or a bare
    JSONDecodeError, where any other call gets the ValueError naming config."""
    for kind in (FWD, BWD):
        with pytest.raises(ValueError, match="config"):
            dispatch.for_batch(kind, "cute", config, dispatch.GRID_YZ_MAX + 1, 64, 64, "bfloat16", 4)


def test_no_runnable_default_says_what_to_do(monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU runs the default backends")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1.*'reference' source"):
        dispatch.default_choice(FWD, 64, 64, "float32", 2)


def test_load_takes_gpu_keys_in_any_case_and_says_what_a_wrong_folder_is(tmp_path):
    root = write_artifacts(tmp_path)
    assert dispatch.load(root, gpu="H100")["kernels"] == [BWD, FWD]
    missing = dispatch.load(root / "h100", gpu="h100")["missing"]
    assert "pass the folder above it" in missing[FWD]
    assert "not a known GPU key" in dispatch.load(root, gpu="bogus")["missing"][FWD]
    with pytest.raises(ValueError, match="path must be a folder path"):
        dispatch.load(123, gpu="h100")
    with pytest.raises(ValueError, match="gpu must be a GPU key"):
        dispatch.load(root, gpu=100)


def test_an_entry_its_space_rules_out_is_never_served(tmp_path):
    """A config the search space rejects for the call (here ~1.2 MB of shared memory for a 227 KB GPU, as a
    hand-edited file or a tightened rule leaves it) is not served, tuned or nearest: the default runs, said."""
    cfg = {"block_m": 256, "block_n": 128, "num_warps": 1, "num_stages": 8}
    bad = _entry(4096, 256, FWD, dqk=256, config=dict(default_fwd_config(256, 256).to_dict(), **cfg))
    dispatch.load(write_artifacts(tmp_path, extra=[bad]), gpu="h100")
    for heads in (4, 2):  # the entry's own key, then a nearest lookup
        with pytest.warns(dispatch.DispatchWarning, match="cannot serve .* shared memory"):
            choice = dispatch.select(FWD, "bfloat16", 256, 256, heads, 4096, "uniform")
        assert choice.source == "default" and json.loads(choice.config) != bad["config"]
    assert dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, "uniform").source == "tuned"  # feasible ones serve


def test_a_nearest_entry_is_still_chosen_by_fill(tmp_path):
    """Untuned heads, bucket or mask fall back to the closest task, whose uniform and jagged entries the call's fill
    still tells apart: before, the fallback ignored the fill and ran the entry whose config text sorts first (the
    uniform one here) for a quarter-full or near-empty batch as for a full one."""
    from autotune.runtime.buckets import law_fill

    dispatch.load(write_artifacts(tmp_path), gpu="h100")
    jagged_fill = law_fill(4096)
    calls = [dict(num_heads=8, max_seq_len=4096), dict(num_heads=4, max_seq_len=8192), dict(mask="targets")]
    for call in calls:
        args = dict(dict(num_heads=4, max_seq_len=4096), **call)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", dispatch.DispatchWarning)  # the fallback is said once; tested above
            picks = [
                dispatch.select(FWD, "bfloat16", 64, 64, distribution=None, fill=f, **args)
                for f in (1.0, jagged_fill, jagged_fill / 8)
            ]
        assert [(_block_m(c), c.source) for c in picks] == [(128, "nearest"), (64, "nearest"), (64, "nearest")], call


def test_select_refuses_an_unknown_distribution_or_fill():
    """A distribution typo ran a nearest entry (a warning at most); a tensor fill was read on the host (a sync on
    every call), a NaN or negative one ran the uniform entry: each is a ValueError naming the argument."""
    import torch

    with pytest.raises(ValueError, match="unknown distribution 'jaged'"):
        dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, "jaged")
    for bad in (torch.tensor(0.5), "0.5", True, float("nan"), -0.25):
        with pytest.raises(ValueError, match="fill must be"):
            dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, None, fill=bad)
    assert dispatch.fill_bin(0.5) == dispatch.fill_bin(torch.tensor(0.5).item()) == -dispatch.FILL_STEPS
    dispatch.select(FWD, "bfloat16", 64, 64, 4, 4096, "jagged", fill=torch.tensor(0.5))  # a hint: fill unread


def test_parse_bucket_names_every_bad_spelling():
    """'infK' raised OverflowError (not the CLI's ValueError) and '4.0001K' was truncated to 4096."""
    from autotune.runtime.buckets import parse_bucket

    assert parse_bucket("0.25K") == 256 and type(parse_bucket("4k")) is int
    for bad in ("infK", "1e400k", "4.0001K", "0.2501k", "nanK"):
        with pytest.raises(ValueError, match="bucket"):
            parse_bucket(bad)


def test_impossible_sizes_are_a_value_error_naming_the_argument():
    """Zero or negative heads or head dims, a negative max_seq_len, or a bool or float size reached the spec
    defaults (or hit the cached choice of the int it equals: True == 1); each is a ValueError naming the argument,
    on a cache hit as on a miss, from every entry that takes these sizes."""
    import numpy as np

    dispatch.select(FWD, "float32", 32, 32, 1, 64, source="default")  # cached: True and 1.0 equal its key
    entries = {  # name of the heads argument, call with sizes (dqk, dv, heads, max_seq_len)
        "select": ("num_heads", lambda d, v, h, n: dispatch.select(FWD, "float32", d, v, h, n, source="default")),
        "default_choice": ("num_heads", lambda d, v, h, n: dispatch.default_choice(FWD, d, v, "float32", h)),
        "preferred_default": ("num_heads", lambda d, v, h, n: dispatch.preferred_default(FWD, d, v, "float32", h)),
        "for_batch": ("heads", lambda d, v, h, n: dispatch.for_batch(FWD, "triton", "{}", 4, d, v, "float32", h)),
    }
    bad = {0: (0, -32, 32.0, True, "32", None), 1: (0, -1, 32.5, False), 2: (0, -2, 2.0, True, 1.0), 3: (-1, 64.0)}
    for entry, (heads, call) in entries.items():
        for position, values in bad.items():
            if position == 3 and entry != "select":
                continue  # only select takes max_seq_len
            name = ("dqk", "dv", heads, "max_seq_len")[position]
            for value in values:
                sizes = [32, 32, 1, 64]
                sizes[position] = value
                with pytest.raises(ValueError, match=f"^{name} must be an int >= [01], got"):
                    call(*sizes)
    # An empty batch's max_seq_len of 0 and integer types other than int (numpy's) stay valid.
    assert dispatch.select(FWD, "float32", 32, 32, 2, 0, source="default").source == "default"
    assert dispatch.select(FWD, "float32", np.int64(32), 32, np.int32(2), np.int64(64), source="default")
    assert dispatch.for_batch(FWD, "triton", "{}", 4, 32, np.int64(32), "float32", 2) == ("triton", "{}")


def test_load_refuses_a_gpu_that_is_no_folder_name(tmp_path):
    """An empty, blank or path-like gpu read ``path/<kernel>.json`` (or outside the folder) as if ``path`` were a GPU
    folder, and left dispatch with gpu '' (no space feasibility checks); the previous state is kept."""
    root = write_artifacts(tmp_path)
    dispatch.load(root, gpu="h100")
    for bad in ("", "  ", "../h100", "h100/", "x" * 300, "h1\x0000"):
        with pytest.raises(ValueError, match="gpu must be a GPU key"):
            dispatch.load(root / "h100", gpu=bad)
    assert dispatch.summary()["gpu"] == "h100" and dispatch.summary()["kernels"] == [BWD, FWD]


def test_load_refuses_an_empty_path_or_a_non_bool_allow_same_arch(tmp_path):
    """``path=""`` (an unset environment variable) read the working directory's ``<gpu>/<kernel>.json`` files, and
    ``allow_same_arch="false"`` (a string from a config file) was truthy: it accepted another GPU's files. Both are
    a ValueError naming the argument, and the loaded state is kept."""
    root = write_artifacts(tmp_path)
    dispatch.load(root, gpu="h100")
    for kwargs, match in (({"path": ""}, "path must name a folder"), ({"path": " "}, "path must name a folder")):
        with pytest.raises(ValueError, match=match):
            dispatch.load(gpu="h100", **kwargs)
    for flag in ("false", 0, 1, None):
        with pytest.raises(ValueError, match="allow_same_arch must be a bool"):
            dispatch.load(root, gpu="h100", allow_same_arch=flag)
    assert dispatch.summary()["path"] == str(root) and dispatch.summary()["kernels"] == [BWD, FWD]


def test_a_load_during_a_choice_never_leaves_the_old_files_choice_cached(tmp_path, monkeypatch):
    """``autotune.load`` of another folder in another thread while a call resolves its choice (simulated by a
    load inside the bucket lookup): the call may return the choice of the files it began with, but that
    choice was cached after the load dropped the cache, so every later call kept running the old files'
    config. It is now never cached, and the next call resolves against the new files."""
    old = write_artifacts(tmp_path / "old")
    new = write_artifacts(tmp_path / "new", stale=True)  # rejected: the default serves
    dispatch.load(old, gpu="h100")
    bucket_for = dispatch.bucket_for

    def load_meanwhile(max_seq_len: int) -> int:
        monkeypatch.setattr(dispatch, "bucket_for", bucket_for)
        dispatch.load(new, gpu="h100")
        return bucket_for(max_seq_len)

    monkeypatch.setattr(dispatch, "bucket_for", load_meanwhile)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dispatch.DispatchWarning)
        during = dispatch.select(FWD, "bfloat16", 64, 64, 4, 1000, "uniform")
        after = dispatch.select(FWD, "bfloat16", 64, 64, 4, 1000, "uniform")
    assert during.source == "tuned" and dispatch.summary()["path"] == str(new)
    assert after.source == "default"


@pytest.mark.parametrize(
    "change, field",
    [
        ({"num_warps": 4.0}, "num_warps"),  # 4.0 in (1, 2, 4, 8, 16): the class's own check took it
        ({"l2_group": True}, "l2_group"),  # True == 1: a bool ran as an int
        ({"num_stages": "2"}, "num_stages"),
    ],
)
def test_a_config_json_of_wrong_field_types_is_refused_by_name(change, field):
    """A config string (a direct ``torch.ops.hstu`` call, a hand-made Choice) is held to the field types an
    artifact's config is: a float or bool for an int field never reaches the launcher."""
    good = default_fwd_config(64, 64).to_dict()
    assert dispatch.decode_config("triton", FWD, json.dumps(good)) is not None
    with pytest.raises(ValueError, match=rf"config\.{field} must be int"):
        dispatch.decode_config("triton", FWD, json.dumps({**good, **change}))


@pytest.mark.parametrize("text", ["not json", "null", "[64]", '"block_m"'])
def test_a_config_string_that_is_no_json_object_names_config(text):
    with pytest.raises(ValueError, match="config"):
        dispatch.decode_config("triton", FWD, text)


def test_the_custom_op_refuses_a_bad_config_before_launching():
    """The explicit-config op names its config argument instead of failing inside the decode or the kernel."""
    import torch

    from autotune.runtime import ops

    q = torch.zeros(4, 1, 32)
    offsets = torch.tensor([0, 4], dtype=torch.int64)
    bad = json.dumps({**default_fwd_config(32, 32).to_dict(), "num_warps": 4.0})
    with pytest.raises(ValueError, match=r"config\.num_warps"):
        ops.attention_fwd(q, q, q, offsets, None, 4, 1.0, 0, 0, None, "triton", bad, "triton", "{}")
