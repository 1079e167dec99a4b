"""The declaration format of a search space: tunables, feasibility rules, heuristic default.

A space is the product of its ``params`` choices; ``rules`` reject configs that cannot work on the
target (shared memory, registers, tile vs. length, ...) before anything is compiled, so an infeasible
config costs no GPU time. Like quack's GemmConfig: a frozen config dataclass, a heuristic default,
the full space and a prune step.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from autotune.runtime.gpus import GPUSpec

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class SpaceContext:
    """What a feasibility rule may look at: the target GPU, dtype, head dims, the longest sequence."""

    gpu: GPUSpec
    dtype: str
    dqk: int
    dv: int
    max_len: int
    interpret: bool = False
    num_heads: int = 1  # layer ops read their width as num_heads x dv

    @property
    def width(self) -> int:
        """Hidden width of the layer owning the op (heads x dv)."""
        return self.num_heads * self.dv

    @property
    def elem_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


Rule = Callable[[Any, SpaceContext], "str | None"]


@dataclass(frozen=True)
class SearchSpace:
    """Tunables of one backend of one kernel.

    ``params``: name -> choices, in the config dataclass's field names. ``rules``: functions
    ``(config, ctx) -> reason or None``. ``default``: ``ctx -> config``, the heuristic baseline
    every study starts from and the tuned config must beat.
    """

    name: str
    config_cls: type
    params: dict[str, tuple[Any, ...]]
    rules: tuple[Rule, ...]
    default: Callable[[SpaceContext], Any]
    notes: str = ""
    _hash: list[str] = field(default_factory=list, compare=False, repr=False)

    def make(self, values: dict[str, Any]):
        """A config from a dict of param values (missing fields take the dataclass defaults)."""
        return self.config_cls(**values)

    def full(self) -> list[Any]:
        """Every config of the product of choices (constructible ones only)."""
        names = list(self.params)
        out = []
        for combo in itertools.product(*(self.params[n] for n in names)):
            try:
                out.append(self.make(dict(zip(names, combo, strict=True))))
            except ValueError:
                continue
        return out

    def why_infeasible(self, config: Any, ctx: SpaceContext) -> str | None:
        """The first rule's reason to reject ``config`` on ``ctx``, or None when feasible."""
        for rule in self.rules:
            reason = rule(config, ctx)
            if reason:
                return f"{rule.__name__}: {reason}"
        return None

    def prune(self, ctx: SpaceContext, configs: Sequence[Any] | None = None) -> list[Any]:
        """The feasible configs of ``configs`` (default: the full space)."""
        return [c for c in (self.full() if configs is None else configs) if self.why_infeasible(c, ctx) is None]

    def values(self, config: Any) -> dict[str, Any]:
        """The tunable values of a config (the params Optuna samples)."""
        return {n: getattr(config, n) for n in self.params}

    def hash(self) -> str:
        """sha256 of the declaration (choices and the rules' source), to spot artifacts tuned on another space."""
        if not self._hash:
            blob = {
                "name": self.name,
                "config": self.config_cls.__name__,
                "params": {k: list(v) for k, v in self.params.items()},
                "rules": [inspect.getsource(r) for r in self.rules],
                "default": inspect.getsource(self.default),
            }
            self._hash.append(hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest())
        return self._hash[0]
