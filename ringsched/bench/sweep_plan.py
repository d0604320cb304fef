"""What `bench sweep` runs: the server configurations (`--config pp=2,threads=1`, `--config tp=2,threads=1`) and
the ladder of rates.

Contract: `ServerConfig.parse(text)` turns one `--config` string into a validated config whose `flags` are the
launcher flags it stands for; `parse_rates(text)` reads `--rates`; `RateLadder.next_rate(throughputs)` is
the pure rule that picks the next finite rung from the output throughputs measured so far. Every bad input
raises `SweepConfigError`, whose message names the flag.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ringsched.layout.flex import FLEX_POLICIES

# --config key -> launcher flag.
CONFIG_FLAGS = {
    "pp": "--pp-size",
    "tp": "--tp-size",
    "threads": "--threads-per-stage",
    "depth": "--pp-async-batch-depth",
    "partition": "--pp-layer-partition",
    "flex": "--pp-flex-layers",
    "policy": "--pp-flex-policy",
    "dtype": "--dtype",
    "mbs": "--pp-max-micro-batch-size",
    "running": "--max-running-requests",
}
DTYPES = ("float32", "bfloat16", "float16")
EXAMPLE = "e.g. --config pp=2,threads=1,partition=16:14 (or partition=auto)"


class SweepConfigError(ValueError):
    """A `bench sweep` flag that cannot be used; the message names the flag and the fix."""


@dataclass(frozen=True)
class ServerConfig:
    """One server configuration of the sweep. Unset fields keep the launcher's defaults (`partition=None`: the
    even split); `partition="auto"` is the launcher's measured split. `label` is the `--config` string."""

    label: str
    pp: int | None = None
    tp: int | None = None
    threads: int | None = None
    depth: int | None = None
    partition: tuple[int, ...] | str | None = None
    flex: int | None = None
    policy: str | None = None
    dtype: str | None = None
    mbs: int | None = None
    running: int | None = None

    def __post_init__(self) -> None:
        where = f"--config {self.label!r}"
        for key, low in (("pp", 1), ("tp", 1), ("threads", 1), ("depth", 0), ("flex", 0), ("mbs", 1), ("running", 1)):
            value = getattr(self, key)
            if value is not None and value < low:
                raise SweepConfigError(f"{where}: {key} must be >= {low}, got {value}")
        if self.policy is not None and self.policy not in FLEX_POLICIES:
            raise SweepConfigError(f"{where}: policy must be one of {', '.join(FLEX_POLICIES)}, got {self.policy!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise SweepConfigError(f"{where}: dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.partition is not None and self.partition != "auto":
            if any(c < 1 for c in self.partition):
                raise SweepConfigError(f"{where}: every stage of partition needs at least one layer")
            if len(self.partition) != (self.pp or 1):
                raise SweepConfigError(
                    f"{where}: partition has {len(self.partition)} stages but pp is {self.pp or 1}; "
                    "give one layer count per stage, separated by ':'"
                )

    @classmethod
    def parse(cls, text: str) -> ServerConfig:
        """`"pp=2,threads=1,partition=16:14"` -> `ServerConfig`; unknown or repeated keys are errors."""
        label = text.strip()
        where = f"--config {label!r}"
        values: dict[str, object] = {}
        for item in filter(None, (part.strip() for part in label.split(","))):
            key, sep, value = (s.strip() for s in item.partition("="))
            if not sep or not value:
                raise SweepConfigError(f"{where}: {item!r} is not key=value; {EXAMPLE}")
            if key not in CONFIG_FLAGS:
                raise SweepConfigError(f"{where}: unknown key {key!r}; known keys: {', '.join(CONFIG_FLAGS)}")
            if key in values:
                raise SweepConfigError(f"{where}: {key} is given twice")
            values[key] = _parse_value(where, key, value)
        if not values:
            raise SweepConfigError(f"--config {text!r} is empty; {EXAMPLE}")
        return cls(label=label, **values)

    @property
    def flags(self) -> list[str]:
        """The launcher flags of the fields that are set, in `CONFIG_FLAGS` order."""
        flags: list[str] = []
        for key, flag in CONFIG_FLAGS.items():
            value = getattr(self, key)
            if value is not None:
                joined = key == "partition" and not isinstance(value, str)
                flags += [flag, ",".join(map(str, value)) if joined else str(value)]
        return flags


def _parse_value(where: str, key: str, value: str) -> object:
    if key in ("dtype", "policy"):
        return value
    if key == "partition":
        if value == "auto":
            return value
        # ':' separates stages because ',' already separates the keys of a --config string.
        return tuple(_int(where, key, v) for v in value.split(":"))
    return _int(where, key, value)


def _int(where: str, key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise SweepConfigError(f"{where}: {key} must be an integer, got {value!r}") from None


def parse_rates(text: str) -> tuple[float, ...]:
    """`"0.25,0.5,1,2"` -> ascending finite rates in requests/s (the `inf` rung is always run last)."""
    try:
        rates = tuple(float(r) for r in text.split(",") if r.strip())
    except ValueError:
        raise SweepConfigError(f"--rates {text!r}: give requests/s separated by commas, e.g. 0.25,0.5,1,2") from None
    if not rates:
        raise SweepConfigError("--rates is empty; give requests/s separated by commas, e.g. 0.25,0.5,1,2")
    if not all(math.isfinite(r) and r > 0 for r in rates):
        raise SweepConfigError(f"--rates {text!r}: every rate must be finite and > 0 (the inf rung is automatic)")
    if any(b <= a for a, b in zip(rates, rates[1:], strict=False)):
        raise SweepConfigError(f"--rates {text!r}: list the rates in increasing order")
    return rates


@dataclass(frozen=True)
class RateLadder:
    """The finite rungs of one configuration: `rates` when given, else `min_rate * factor**i`. Either way the
    ladder stops after `max_rungs`, or as soon as output throughput grew by less than `threshold` (a
    fraction) over the rung before: past saturation a higher rate only lengthens the queue."""

    rates: tuple[float, ...] = ()
    min_rate: float = 1.0
    factor: float = 2.0
    threshold: float = 0.05
    max_rungs: int = 8

    def __post_init__(self) -> None:
        if not (math.isfinite(self.min_rate) and self.min_rate > 0):
            raise SweepConfigError(f"--min-rate must be finite and > 0 requests/s, got {self.min_rate}")
        if not self.factor > 1:
            raise SweepConfigError(f"--rate-factor must be > 1, got {self.factor}")
        if self.threshold < 0:
            raise SweepConfigError(f"--saturation-threshold must be >= 0 (0.05 is 5%), got {self.threshold}")
        if self.max_rungs < 1:
            raise SweepConfigError(f"--max-rungs must be >= 1, got {self.max_rungs}")

    def next_rate(self, throughputs: Sequence[float]) -> float | None:
        """The rate of the next finite rung, given the output throughputs of the rungs run so far (in order),
        or None when the finite ladder is over and the `inf` rung comes next."""
        n = len(throughputs)
        if n >= self.max_rungs or (n >= 2 and saturated(throughputs[-2], throughputs[-1], self.threshold)):
            return None
        if self.rates:
            return self.rates[n] if n < len(self.rates) else None
        return self.min_rate * self.factor**n


def saturated(previous: float, current: float, threshold: float) -> bool:
    """Whether throughput grew by less than `threshold` (a fraction of `previous`) from one rung to the next."""
    return current < previous * (1.0 + threshold)
