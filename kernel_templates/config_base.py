"""What every template config shares: plain-JSON round trips and the launch-order choices.

Template configs are frozen dataclasses (hashable: they key compile caches) written to artifacts as
plain JSON. ``from_dict`` is strict both ways, so an artifact written for another version of a config
fails loudly instead of filling a missing field with a default it was never tuned with.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

# Launch order of the attention kernels: 0 = one block index across all sequence-heads at a time;
# g = all blocks of g sequence-heads at a time, so CTAs in flight share K/V (fwd) or Q/dO (bwd) in L2.
L2_GROUPS = (0, 1, 2, 4, 8, 16)


@dataclass(frozen=True)
class JsonConfig:
    """Base of the template configs: ``to_dict`` / strict ``from_dict``."""

    kind: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)}; expected {sorted(names)}")
        missing = names - set(d)
        if missing:
            raise ValueError(f"{cls.__name__}: missing fields {sorted(missing)}")
        return cls(**d)
