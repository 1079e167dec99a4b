"""Model and data configuration of the HSTU ranking model, with named presets.

One frozen dataclass holds model, data and training knobs so a run is reproducible from (preset,
overrides, seed). ``validate`` raises ``ValueError`` naming the bad field before anything is built.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass
from typing import Any

from autotune.runtime.buckets import DISTRIBUTIONS
from kernel_templates.hstu_attention.config import SUPPORTED_HEAD_DIMS


def file_lengths(path: str) -> tuple[int, ...]:
    """The lengths of a lengths file (``ValueError`` naming the file when unusable), read once per version of the
    file: every sample draws from it, and a file rewritten (or another file under the same relative path) is
    read again, not answered from what this process read before."""
    try:
        st = os.stat(path)
        version = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    except (OSError, ValueError):  # missing or unusable: the reader names it
        version = None
    return _read_file_lengths(path, version)


@functools.lru_cache(maxsize=8)
def _read_file_lengths(path: str, version: tuple[int, ...] | None) -> tuple[int, ...]:
    from autotune.runtime.lengths import LengthsError, read_length_sample

    try:
        return tuple(read_length_sample(path))
    except LengthsError as e:
        raise ValueError(str(e).replace("--lengths", "lengths_file", 1)) from None


KERNEL_SOURCES = ("reference", "default", "tuned")
LAYER_IMPLS = ("unfused", "fused")
PRECISIONS = ("autocast", "bf16")
RECOMPUTE = ("none", "uvqk", "pre", "ln", "uvqk+ln", "pre+ln")
LENGTH_DISTRIBUTIONS = ("full", "uniform", "heavy_tailed", "file")
ATTENTION_HINTS = ("auto", *DISTRIBUTIONS)


@dataclass(frozen=True)
class ModelConfig:
    """Everything one training run needs besides the device and step count."""

    # model
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 32
    hidden_dim: int = 64
    num_items: int = 512
    num_actions: int = 5
    embedding_dim: int = 64
    num_tasks: int = 2
    head_hidden: int = 64
    dropout: float = 0.1
    eps: float = 1e-5
    # data
    batch_size: int = 4
    max_seq_len: int = 32
    min_seq_len: int = 4
    length_dist: str = "uniform"
    # length_dist="file": real sequence lengths (any format of autotune.runtime.lengths) that the synthetic
    # batches draw from, raised to min_seq_len; `autotune run --from-model` tunes on the same lengths.
    lengths_file: str = ""
    # The attention calls' length-distribution hint: "auto" = "uniform" for full lengths, else none (dispatch
    # matches each batch by its fill); "uniform", "jagged" or "sparse" pins the entries tuned on that law.
    attention_hint: str = "auto"
    zipf_alpha: float = 1.1
    num_categories: int = 16
    taste_size: int = 4
    taste_prob: float = 0.7
    label_noise: float = 0.05
    # training
    lr: float = 1e-3
    kernels: str = "default"
    # How a layer runs its kernels: "unfused" chains nn modules and the attention custom op;
    # "fused" runs the whole layer as one autograd function over dispatched kernels
    # (autotune.runtime.layer: every op tuned, q/k/v/u as views, one d(uvqk) buffer, fused residual grad).
    layer: str = "unfused"
    # "autocast": fp32 residual stream and LayerNorms (torch autocast's policy); "bf16": activations,
    # the residual stream included, in bf16 with fp32 statistics inside the fused kernels and fp32
    # master weights (fused layer only); the embeddings' sum, the final LayerNorm and the task heads too.
    precision: str = "autocast"
    # Fused layer only, what the backward recomputes instead of keeping: "uvqk" = SiLU(LN(x) W + b)
    # from the kept pre-activation (an elementwise pass); "pre" = the pre-activation, by a GEMM (the
    # forward's GEMM + SiLU kernel then stores SiLU's output only); "ln" = LN(x). "none" keeps all (most memory).
    recompute: str = "none"
    zero_copy: bool = True  # fused layer only; False copies q/k/v/u and concatenates their gradients
    # Fused layer, zero_copy, pre-activation kept: u's SiLU' inside the LN * u + dropout backward (False: in
    # the projection's SiLU' pass, as v, q and k).
    du_silu: bool = True
    # Replay the whole training step (forward, backward, Adam) from CUDA graphs (models.graphs): batches
    # are padded to a multiple of graph_tokens rows (0: max_seq_len), one graph per padded size.
    cuda_graph: bool = False
    graph_tokens: int = 0
    seed: int = 0

    def replace(self, **overrides: Any) -> ModelConfig:
        """A copy with ``overrides`` applied, validated; unknown names raise ValueError."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(f"unknown config field(s) {unknown}; known: {sorted(names)}")
        cfg = dataclasses.replace(self, **overrides)
        cfg.validate()
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def distribution(self) -> str | None:
        """The attention calls' length-distribution hint: ``attention_hint`` where pinned; else "uniform" for full
        lengths and otherwise None, so dispatch picks each batch's entry by its fill L / (B x max_seq_len). The
        "jagged" entries were tuned on one synthetic law; pinned to them, heavy-tailed batches of other shapes ran
        up to 20% slower (fused layer, H100, 4K-8K) than with the entry nearest their fill."""
        if self.attention_hint != "auto":
            return self.attention_hint
        return "uniform" if self.length_dist == "full" else None

    def _validate_lengths_file(self) -> None:
        """length_dist="file" needs a readable lengths file whose longest sequence fits max_seq_len."""
        if not isinstance(self.lengths_file, str):
            raise ValueError(f"lengths_file must be a path string ('' for none), got {self.lengths_file!r}")
        if (self.length_dist == "file") != bool(self.lengths_file):
            raise ValueError(
                f"lengths_file and length_dist='file' go together, got length_dist={self.length_dist!r}, "
                f"lengths_file={self.lengths_file!r}"
            )
        if not self.lengths_file:
            return
        longest = max(file_lengths(self.lengths_file))
        if longest > self.max_seq_len:
            raise ValueError(
                f"lengths_file {self.lengths_file} has a sequence of {longest} tokens, above max_seq_len "
                f"{self.max_seq_len}"
            )

    def _validate_head_dim(self) -> None:
        """The kernels' head dims: the unfused layer's attention call pads others up to the largest (256);
        the fused layer's views of the uvqk output need a kernel head dim itself."""
        if self.kernels == "reference":
            return
        if self.layer == "fused" and self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(
                f"head_dim {self.head_dim} has no kernel of its own (kernel head dims: {SUPPORTED_HEAD_DIMS}); "
                "layer='fused' needs one of them (layer='unfused' pads other head dims up to 256)"
            )
        if self.head_dim > SUPPORTED_HEAD_DIMS[-1]:
            raise ValueError(
                f"head_dim {self.head_dim} is above the kernels' largest head dim {SUPPORTED_HEAD_DIMS[-1]}; "
                "use kernels='reference' or a smaller head dim"
            )

    def validate(self) -> None:
        """Raise ValueError with the field name when the config cannot build a working model."""
        positive = (
            "num_layers",
            "num_heads",
            "head_dim",
            "hidden_dim",
            "num_items",
            "embedding_dim",
            "num_tasks",
            "head_hidden",
            "batch_size",
            "max_seq_len",
            "min_seq_len",
            "num_categories",
            "taste_size",
        )
        for name in positive:
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if self.hidden_dim != self.num_heads * self.head_dim:
            raise ValueError(
                f"hidden_dim ({self.hidden_dim}) must equal num_heads * head_dim "
                f"({self.num_heads} * {self.head_dim} = {self.num_heads * self.head_dim})"
            )
        if self.kernels not in KERNEL_SOURCES:
            raise ValueError(f"kernels must be one of {KERNEL_SOURCES}, got {self.kernels!r}")
        for name, allowed in (("layer", LAYER_IMPLS), ("precision", PRECISIONS), ("recompute", RECOMPUTE)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        self._validate_head_dim()
        self._validate_lengths_file()
        if self.layer == "fused" and self.kernels == "reference":
            raise ValueError("layer='fused' runs dispatched kernels; kernels must be 'default' or 'tuned'")
        if self.layer == "unfused" and (self.precision != "autocast" or self.recompute != "none"):
            raise ValueError("precision='bf16' and recompute need layer='fused'")
        for name in ("zero_copy", "du_silu", "cuda_graph"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.cuda_graph and self.kernels == "reference":  # it reads the offsets on the host, which capture forbids
            raise ValueError("cuda_graph captures the step in a CUDA graph: kernels must be 'default' or 'tuned' "
                             "(the reference attention reads the offsets on the host)")  # fmt: skip
        if self.layer == "unfused" and not self.zero_copy:
            raise ValueError("zero_copy=False copies the fused layer's q/k/v/u: it needs layer='fused'")
        if self.layer == "unfused" and not self.du_silu:  # else accepted and ignored: nothing to move
            raise ValueError("du_silu=False moves u's SiLU' back to the fused layer's projection pass: it needs "
                             "layer='fused'")  # fmt: skip
        if not isinstance(self.graph_tokens, int) or isinstance(self.graph_tokens, bool) or self.graph_tokens < 0:
            raise ValueError(f"graph_tokens must be an int >= 0 (0: max_seq_len), got {self.graph_tokens!r}")
        if self.attention_hint not in ATTENTION_HINTS:
            raise ValueError(f"attention_hint must be one of {ATTENTION_HINTS}, got {self.attention_hint!r}")
        if self.length_dist not in LENGTH_DISTRIBUTIONS:
            raise ValueError(f"length_dist must be one of {LENGTH_DISTRIBUTIONS}, got {self.length_dist!r}")
        if self.min_seq_len > self.max_seq_len:
            raise ValueError(f"min_seq_len ({self.min_seq_len}) must be <= max_seq_len ({self.max_seq_len})")
        if not isinstance(self.num_actions, int) or isinstance(self.num_actions, bool) or self.num_actions < 5:
            raise ValueError(f"num_actions must be an int >= 5 (none + click x like), got {self.num_actions!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**64:
            # torch.manual_seed takes 64 bits: a larger seed was its overflow traceback after the checks
            raise ValueError(f"seed must be an int in [0, 2**64), got {self.seed!r}")
        self._validate_floats()
        if self.num_items < self.num_categories:
            raise ValueError(f"num_items ({self.num_items}) must be >= num_categories ({self.num_categories})")
        if self.taste_size > self.num_categories:
            raise ValueError(f"taste_size ({self.taste_size}) must be <= num_categories ({self.num_categories})")

    def _validate_floats(self) -> None:
        """Real numbers (ints allowed), finite, in range; NaN fails every comparison, so it is named here."""
        for name, low, high in (("dropout", 0.0, 1.0), ("taste_prob", 0.0, 1.0), ("label_noise", 0.0, 1.0)):
            val = getattr(self, name)
            if not _is_real(val) or not low <= val < high:
                raise ValueError(f"{name} must be a number in [{low:g}, {high:g}), got {val!r}")
        for name in ("zipf_alpha", "lr", "eps"):
            val = getattr(self, name)
            if not _is_real(val) or not 0.0 < val < math.inf:
                raise ValueError(f"{name} must be a positive finite number, got {val!r}")


def _is_real(val: Any) -> bool:
    return isinstance(val, (int, float)) and not isinstance(val, bool)


_SEED = dict(
    num_layers=8,
    num_heads=4,
    head_dim=256,
    hidden_dim=1024,
    num_items=100_000,
    embedding_dim=1024,
    num_tasks=3,
    head_hidden=256,
    num_categories=64,
    taste_size=8,
    batch_size=32,
    min_seq_len=256,
)

PRESETS: dict[str, dict[str, Any]] = {
    # CI: seconds on CPU, also under the Triton interpreter.
    "tiny": dict(),
    # GPU smoke test.
    "small": dict(
        num_layers=4,
        num_heads=2,
        head_dim=64,
        hidden_dim=128,
        num_items=10_000,
        embedding_dim=128,
        num_categories=32,
        batch_size=16,
        max_seq_len=512,
        min_seq_len=64,
        head_hidden=64,
    ),
    # Seed benchmark: 8 layers, 4 heads x 256, hidden 1024, batch 32, every sequence 4K long.
    "seed": dict(_SEED, max_seq_len=4096, length_dist="full"),
    # Seed benchmark, jagged: heavy-tailed lengths up to 8K (mean ~2K).
    "seed-jagged": dict(_SEED, max_seq_len=8192, length_dist="heavy_tailed"),
    # Seed benchmark at 8K full lengths; batch 16 keeps activations within 80 GB.
    "seed-8k": dict(_SEED, max_seq_len=8192, length_dist="full", batch_size=16),
}


_BOOLS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``key=value`` strings (``--set``) as config overrides, each value read as its field's type (a string
    field keeps "123" as text); ``ValueError`` naming the item for an unknown field or an unreadable value."""
    types = {f.name: str(f.type) for f in dataclasses.fields(ModelConfig)}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep:
            raise ValueError(f"override {item!r} must look like key=value")
        if key not in types:
            raise ValueError(f"override {item!r}: unknown config field {key!r}; known: {sorted(types)}")
        kind = types[key]
        try:
            if kind == "bool":
                if raw.lower() not in _BOOLS:
                    raise ValueError("expected true or false")
                out[key] = _BOOLS[raw.lower()]
            else:
                out[key] = int(raw) if kind == "int" else float(raw) if kind == "float" else raw
        except ValueError as e:
            want = {"int": "an int", "float": "a number", "bool": "true or false"}.get(kind, kind)
            raise ValueError(f"override {item!r}: {key} takes {want}, got {raw!r} ({e})") from None
    return out


def get_config(preset: str, **overrides: Any) -> ModelConfig:
    """The named preset with overrides applied; ValueError for an unknown preset or a bad field."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known presets: {', '.join(PRESETS)}")
    return ModelConfig().replace(**{**PRESETS[preset], **overrides})
