"""Human-readable byte sizes: parse "8GiB" / "1.5 GB" / "30%" and format bytes back.

Used by the config for every `*_BYTES` knob and the budget, and by logs and the benchmark.
Suffixes: B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB and the bare K/M/G/T (powers of
1024, as fio and dd read them). Case does not matter. A trailing "%" makes a fraction of some
total that is only known later (available RAM, free disk, the no-offload peak).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["SizeSpec", "parse_size", "format_bytes"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_MAX_BYTES = (1 << 63) - 1  # what a byte count in the C++ core (int64) can hold
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z%]*)\s*$")


@dataclass(frozen=True)
class SizeSpec:
    """A size given either in bytes or as a fraction of a total known later.

    Exactly one of `nbytes` / `fraction` is set. `fraction` is 0.3 for "30%".
    """

    nbytes: int | None = None
    fraction: float | None = None

    def resolve(self, total_bytes: int) -> int:
        """Bytes this spec stands for, given the total a percentage refers to."""
        if self.nbytes is not None:
            return self.nbytes
        return int(self.fraction * total_bytes)

    def __str__(self) -> str:
        if self.nbytes is not None:
            return format_bytes(self.nbytes)
        return f"{self.fraction * 100:g}%"


def parse_size(value: str | int, *, allow_percent: bool = False) -> SizeSpec:
    """Parse a size such as "8GiB", "512 MiB", "1.5GB", "4096", "30%" or an int.

    Raises ValueError with a short reason (the caller adds the setting's name).
    """
    if isinstance(value, bool):
        raise ValueError("expected a size, got a boolean")
    if isinstance(value, (int, float)):   # a keyword argument's number: bytes
        if value < 0:
            raise ValueError("size must not be negative")
        if value > _MAX_BYTES:   # (inf too) as a string gets it: not later, in the core
            raise ValueError("more bytes than a 64-bit count holds (the most is 8 EiB)")
        if not math.isfinite(value) or value != int(value):
            raise ValueError("size in bytes must be a non-negative whole number" + (
                f' (a share is a percentage: "{value * 100:g}%")'
                if allow_percent and 0 < value < 1 else ""))
        return SizeSpec(nbytes=int(value))
    text = str(value).strip()
    if text.startswith("-"):
        raise ValueError("size must not be negative")
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError('not a size (examples: "8GiB", "512MiB", "4096"'
                         + (', "30%"' if allow_percent else "") + ")")
    number, unit = float(m.group(1)), m.group(2).lower()
    if not math.isfinite(number):
        raise ValueError(f"{m.group(1)!r} is too large a number")
    if unit == "%":
        if not allow_percent:
            raise ValueError("a percentage is not accepted here; give bytes such as \"1MiB\"")
        return SizeSpec(fraction=number / 100.0)
    if unit not in _UNITS:
        raise ValueError(f"unknown unit {m.group(2)!r} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, "
                         "TB, or K, M, G, T for KiB ... TiB" + (", or %" if allow_percent else "")
                         + ")")
    nbytes = number * _UNITS[unit]
    if nbytes > _MAX_BYTES:
        raise ValueError("more bytes than a 64-bit count holds (the most is 8 EiB)")
    if unit in ("", "b") and number != int(number):
        raise ValueError("a size in bytes must be a whole number" + (
            f' (a share is a percentage: "{number * 100:g}%")'
            if allow_percent and number < 1 else ""))
    return SizeSpec(nbytes=int(nbytes))


def format_bytes(nbytes: int | float) -> str:
    """Format a byte count with a binary unit: 1536 -> "1.5 KiB", 3 << 30 -> "3 GiB"."""
    sign = "-" if nbytes < 0 else ""
    value = float(abs(nbytes))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            text = f"{value:.0f}" if unit == "B" or value >= 100 else f"{value:.3g}"
            return f"{sign}{text} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
