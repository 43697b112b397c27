"""Config fields that check themselves: one validation style for every frozen config section (the model, how it
runs, and each section of a run).

    @dataclasses.dataclass(frozen=True)
    class TrainConfig:
        steps: int = field(1000, positive, doc="optimizer steps of the whole run")
        schedule: str = field("cosine", one_of("cosine", "wsd"), doc="the learning-rate schedule")

        def __post_init__(self):
            check_fields(self, "train")      # ConfigError("train.steps: must be > 0, got 0")

A field's type comes from its annotation (a bool is not an int; an int is a valid float; floats must be finite);
its rules and its one-line `doc` (what --help prints) from `field`. Checks that tie several fields together stay
in the section's own __post_init__, raising ConfigError through `fail` the same way.
"""

import dataclasses
import difflib
import math
import typing

from plumbing.errors import ConfigError

_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}


def field(default, *rules, doc: str = ""):
    """A dataclass field with its checks (functions value -> complaint or None) and a one-line description."""
    return dataclasses.field(default=default, metadata={"rules": rules, "doc": doc})


def fail(section: str, name: str, message: str):
    raise ConfigError(f"{section}.{name}: {message}")


def doc(cls, name: str) -> str:
    """The one-line description of field `name` of config class `cls` ('' when it has none)."""
    return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}.get(name, "")


def check_fields(obj, section: str) -> None:
    """ConfigError naming `section.field` for the first field whose value has the wrong type or breaks a rule."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        kind = hints.get(f.name)
        if kind in _TYPE_NAMES and not _is(kind, value):
            fail(section, f.name, f"must be {_TYPE_NAMES[kind]}, got {value!r}")
        for rule in f.metadata.get("rules", ()):
            complaint = rule(value)
            if complaint:
                fail(section, f.name, f"{complaint}, got {value!r}")


def _is(kind, value) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, kind)


def from_dict(cls, values: dict, section: str):
    """cls(**values), refusing a key cls does not have (naming the closest one) before anything is built."""
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in values:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
            hint = f"; did you mean {section}.{close[0]}?" if close else ""
            raise ConfigError(f"unknown config key {section}.{key}{hint}")
    return cls(**values)


# Rules: value -> a complaint (what it must be), or None when the value is allowed.

def positive(v):
    return None if v > 0 else "must be > 0"


def non_negative(v):
    return None if v >= 0 else "must be >= 0"


def at_least(low):
    return lambda v: None if v >= low else f"must be >= {low}"


def between(low, high, *, low_open: bool = False, high_open: bool = False):
    """low <= v <= high, each end excluded when open."""
    lo, hi = ("(" if low_open else "["), (")" if high_open else "]")

    def rule(v):
        ok = (low < v if low_open else low <= v) and (v < high if high_open else v <= high)
        return None if ok else f"must be in {lo}{low}, {high}{hi}"

    return rule


def one_of(*choices):
    shown = ", ".join(repr(c) if c == "" else str(c) for c in choices)
    return lambda v: None if v in choices else f"must be one of {shown}"


def nonempty(v):
    return None if str(v).strip() else "must be a non-empty string"
