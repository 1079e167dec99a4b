"""The JSON type rule of a config field, in one torch-free home: an artifact's entries, a config string given to
dispatch and a config object given to a launcher are all held to it."""

from __future__ import annotations

import dataclasses
from typing import Any


def field_types(default: Any) -> tuple[type, ...] | None:
    """The types a config field with this default may hold (None: not checked)."""
    if default is None:
        return (int, type(None))
    if isinstance(default, bool):
        return (bool,)
    if isinstance(default, int):
        return (int,)
    if isinstance(default, float):
        return (int, float)
    if isinstance(default, str):
        return (str,)
    return None


def config_type_error(cls: type, config: dict[str, Any]) -> str | None:
    """``"<field> must be <types> ..."`` for the first value without the type of its dataclass field's default (an
    int field takes no float or bool: the config classes' membership checks take 4.0 and True), else None."""
    if not dataclasses.is_dataclass(cls):
        return None
    for f in dataclasses.fields(cls):
        if f.name not in config or f.default is dataclasses.MISSING:
            continue
        types = field_types(f.default)
        v = config[f.name]
        if types is not None and (isinstance(v, bool) and bool not in types or not isinstance(v, types)):
            names = "/".join("null" if t is type(None) else t.__name__ for t in types)
            return f"{f.name} must be {names} (as {cls.__name__}), got {v!r:.60}"
    return None
