"""Parse and format sizes: parameter counts (`7B`, `1.3e9`, `125M`), memory (`80`, `80GB`, `81920MiB`).

Conventions: bytes inside; GiB = 2**30 prints as GiB; GB = 10**9. A bare memory
number is GiB (how GPU memory is usually quoted on the command line: `--gpu-mem 80`).
"""

from __future__ import annotations

import re

GiB = 2**30
MiB = 2**20

_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_COUNT_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9_]*)?(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*$", re.I)

_MEM_UNITS = {
    "": GiB, "gib": GiB, "gb": 10**9, "mib": MiB, "mb": 10**6, "tib": 2**40, "tb": 10**12,
    "kib": 2**10, "kb": 10**3, "b": 1, "g": GiB, "m": MiB, "t": 2**40,
}
_MEM_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.I)


def parse_count(text: str | int | float, flag: str = "--params") -> int:
    """`7B`, `7b`, `1.3e9`, `125M`, `1.5T`, `350_000_000`, `7000000000` -> an integer count."""
    if isinstance(text, bool):
        raise ValueError(f"{flag}={text!r}: expected a count such as 7B, 125M, 1.3e9 or 350_000_000")
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _COUNT_RE.match(str(text))
        if not m:
            raise ValueError(
                f"{flag}={text!r}: expected a count such as 7B, 125M, 1.5T, 1.3e9 or 350_000_000")
        value = float(m.group(1).replace("_", "")) * _COUNT_SUFFIX[m.group(2).lower()]
    if not value >= 1 or value != value or value > 1e16:
        raise ValueError(f"{flag}={text!r}: must be a positive count of at least 1")
    return int(round(value))


def parse_memory(text: str | int | float, flag: str = "--gpu-mem") -> int:
    """`80` (GiB), `80GiB`, `80GB` (10^9), `81920MiB` -> bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = _MEM_RE.match(str(text))
        if not m or m.group(2).lower() not in _MEM_UNITS:
            raise ValueError(
                f"{flag}={text!r}: expected a positive size such as 80 (GiB), 80GiB, 80GB or 81920MiB")
        value, unit = float(m.group(1)), m.group(2).lower()
    nbytes = value * _MEM_UNITS[unit]
    if not nbytes > 0:
        raise ValueError(
            f"{flag}={text!r}: expected a positive size such as 80 (GiB), 80GiB, 80GB or 81920MiB")
    return int(nbytes)


def gib(nbytes: float) -> float:
    return nbytes / GiB


def fmt_gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f}"


def fmt_count(n: float) -> str:
    for div, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if abs(n) >= div:
            return f"{n / div:.3g}{suffix}"
    return f"{n:g}"


def fmt_bytes(nbytes: float) -> str:
    for div, suffix in ((2**40, "TiB"), (GiB, "GiB"), (MiB, "MiB"), (2**10, "KiB")):
        if abs(nbytes) >= div:
            return f"{nbytes / div:.2f} {suffix}"
    return f"{int(nbytes)} B"


def fmt_seconds(s: float) -> str:
    if s >= 3600 * 24:
        return f"{s / 86400:.1f} d"
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"
