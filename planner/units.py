"""Parse and format sizes: parameter counts (`7B`, `1.3e9`, `125M`), memory (`80`, `80GB`, `81920MiB`).

Conventions: bytes inside; GiB = 2**30 prints as GiB. GPU memory follows ONE rule:
- a size as printed on a card, a bare number or GB/G (`80`, `80GB`, `80G`, as in "H100 80GB"), is a card
  size: HBM and GDDR capacities are binary (an "80GB" H100 carries 80 GiB of HBM, of which the device
  reports 81,559 MiB: catalog/gpus/h100-sxm.yaml), so it is read as that many GiB, and the planner
  (`resolve.resolve_cluster`) plans the memory the catalog GPU of that class really has (79.65 GiB for
  80); a card size that names no catalog GPU is planned as that many GiB;
- every other unit spells an exact budget: a prefix without `i` is decimal, with `i` binary, the trailing
  `B` optional: `kB`/`MB`/`TB` = 10^3/10^6/10^12 bytes, `KiB`/`MiB`/`GiB`/`TiB` = 2^10/2^20/2^30/2^40
  bytes, `B` = bytes (`74.5GiB`, `81559MiB`). Units are case-insensitive.

Bounds: every planner input is bounded to what exists (`LIMITS`, `GPU_MEMORY_RANGE`,
`INTER_GBPS_RANGE`), so that hostile values give a one-line error naming the flag, the value and the
accepted range instead of hours of work, and every number is finite.
"""

from __future__ import annotations

import math
import operator
import re

from distplan.catalog.limits import LIMITS

GiB = 2**30
MiB = 2**20

_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_COUNT_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9_]*)?(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*$", re.I)

_CARD_UNITS = ("", "g", "gb")
"""The spellings of a card size (module docstring): read as GiB, then the catalog GPU's real memory."""
_MEM_UNITS = {
    "": GiB, "g": GiB, "gb": GiB, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "t": 10**12, "tb": 10**12,
    "ki": 2**10, "kib": 2**10, "mi": MiB, "mib": MiB, "gi": GiB, "gib": GiB, "ti": 2**40, "tib": 2**40,
}
_MEM_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.I)
_MEM_EXAMPLES = "80 or 80GB (a card's size), 74.5GiB or 81559MiB (an exact budget)"

GPU_MEMORY_RANGE = (GiB, 4 * 2**40)
"""Accepted GPU memory, bytes: 1 GiB (below any training GPU's) to 4 TiB (over ten times the largest
GPU memory built, 288 GB: B300, MI355X). Outside it a plan is meaningless: everything (or nothing) fits."""

INTER_GBPS_RANGE = (0.1, 100_000.0)
"""Accepted --inter-gbps, Gbit/s per node: 100 Mbit Ethernet to 100 Tbit/s (over ten times a node of
8 x 800 Gbit/s NICs, the fastest built)."""

def short_repr(value, limit: int = 60) -> str:
    """repr(value) cut to `limit` characters (an error message never prints a whole hostile value)."""
    if isinstance(value, str) and len(value) > 4 * limit:
        value = value[: 4 * limit]  # repr of a huge string costs its size: cut it first
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4 * limit:
        return f"<an integer of about {int(value.bit_length() * 0.30103):,} digits>"
    try:
        r = repr(value)
    except Exception:  # a hostile __repr__
        r = f"<{type(value).__name__}>"
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _flag(name: str) -> str:
    return name if name.startswith("-") else "--" + name.replace("_", "-")


def check_count(name: str, value, limit: str | None = None) -> int:
    """`value` as an int within LIMITS[limit or name] (a bool, float or text is refused); else a
    one-line ValueError: `--flag=VALUE: accepted: an integer from LO to HI (why)`. `name` is the
    argument or flag name (`gpus` -> --gpus)."""
    key = limit or name.lstrip("-").replace("-", "_")
    lo, hi, why = LIMITS[key]
    try:
        n = None if isinstance(value, bool) else operator.index(value)  # int, numpy integers; not 8.0
    except TypeError:
        n = None
    if n is None or not lo <= n <= hi:
        raise ValueError(f"{_flag(name)}={short_repr(value)}: accepted: an integer from {lo:,} to {hi:,} ({why})")
    return int(n)


def check_float(name: str, value, lo: float, hi: float, unit: str, why: str) -> float:
    """A finite number in [lo, hi]; else a one-line ValueError naming the flag and the range."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and (abs(value) < 1e300 if isinstance(value, int) else math.isfinite(value)) and lo <= value <= hi)
    if not ok:
        raise ValueError(f"{_flag(name)}={short_repr(value)}: accepted: a number of {unit} from {lo:g} to "
                         f"{hi:,g} ({why})")
    return float(value)


def _count_range(lo: int, hi: int, unit: str, why: str | None) -> str:
    top = f"10^{len(str(hi)) - 1}" if hi >= 10**6 and str(hi).strip("0") == "1" else f"{hi:,}"
    return f"{lo:,} to {top}{unit}" + (f" ({why})" if why else "")


def parse_count(text: str | int | float, flag: str = "--params", limit: str | None = None) -> int:
    """`7B`, `7b`, `1.3e9`, `125M`, `1.5T`, `350_000_000`, `7000000000` -> an integer count, within
    LIMITS[limit] (else 1 to 10^16); else a one-line ValueError naming `flag` and the accepted range."""
    lo, hi, why = LIMITS[limit] if limit else (1, 10**16, None)
    accepted = f"accepted: {_count_range(lo, hi, ' parameters' if limit == 'params' else '', why)}"
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise ValueError(f"{flag}={short_repr(text)}: {accepted}, written as 7B, 125M, 1.3e9 or 350_000_000")
    if isinstance(text, (int, float)):
        value = float(text) if abs(text) < 1e300 else math.inf  # a huge int would overflow float()
    else:
        m = _COUNT_RE.match(text) if len(text) <= 100 else None
        if not m:
            raise ValueError(f"{flag}={short_repr(text)}: {accepted}, written as 7B, 125M, 1.5T, 1.3e9 or "
                             f"350_000_000")
        value = float(m.group(1).replace("_", "")) * _COUNT_SUFFIX[m.group(2).lower()]
    if not value >= lo or value != value or value > hi:
        raise ValueError(f"{flag}={short_repr(text)}: {accepted}")
    return int(round(value))


BARE_COUNT_MIN = 10**6
"""A parameter count without a unit below this is refused (`parse_param_count`): `--params 7` means 7B far
more often than a 7-parameter model, and the smallest model worth planning (GPT-2 small, 124M) is far
above it. A small model's count is written with its unit (`500K`) or in full (`1000000`)."""


def parse_param_count(text: str | int | float, flag: str = "--params", limit: str | None = None) -> int:
    """`parse_count` (within LIMITS[limit]), refusing a bare count under `BARE_COUNT_MIN` with a one-line
    error suggesting `7B`."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        bare = float(text) if abs(text) < 1e300 else math.inf
    else:
        m = _COUNT_RE.match(text) if isinstance(text, str) and len(text) <= 100 else None
        bare = float(m.group(1).replace("_", "")) if m and not m.group(2) else None
    if bare is not None and 0 < bare < BARE_COUNT_MIN:
        shown = text.strip() if isinstance(text, str) else f"{bare:g}"
        guess = f"did you mean {shown}B ({shown} billion)? " if bare < 1000 else ""
        raise ValueError(f"{flag}={short_repr(text)}: a bare count under a million; {guess}accepted: a count with "
                         f"its unit (7B, 125M, 500K) or 1000000 and up")
    return parse_count(text, flag, limit)


def parse_memory(text: str | int | float, flag: str = "--gpu-mem",
                 bounds: tuple[float, float] | None = GPU_MEMORY_RANGE) -> int:
    """`80` = `80GB` = `80G` (a card size: 80 GiB), `80GiB`, `80Gi`, `81920MiB`, `8e10B` -> bytes (module
    docstring's rule), within `bounds` (bytes; default GPU_MEMORY_RANGE, None for any positive size).
    `is_card_size` tells a card size from an exact budget."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = (float(text) if abs(text) < 1e300 else math.inf), ""
    else:
        m = _MEM_RE.match(text) if isinstance(text, str) and len(text) <= 100 else None
        if not m or m.group(2).lower() not in _MEM_UNITS:
            raise ValueError(f"{flag}={short_repr(text)}: expected a size such as {_MEM_EXAMPLES}; "
                             f"units: none or GB (a card's size), B, kB, MB, TB (powers of 10), KiB, MiB, GiB, TiB "
                             f"(powers of 2)")
        value, unit = float(m.group(1)), m.group(2).lower()
    nbytes = value * _MEM_UNITS[unit]
    if not math.isfinite(nbytes):
        raise ValueError(f"{flag}={short_repr(text)}: expected a finite size such as {_MEM_EXAMPLES}")
    if bounds is not None and not bounds[0] <= nbytes <= bounds[1]:
        raise ValueError(f"{flag}={short_repr(text)} is {fmt_bytes(nbytes)}: accepted: {fmt_bytes(bounds[0])} "
                         f"(less than any training GPU has) to {fmt_bytes(bounds[1])} (over ten times the "
                         f"largest GPU memory built, 288 GB)")
    if int(nbytes) < 1:
        raise ValueError(f"{flag}={short_repr(text)}: expected a size of at least 1 byte, such as {_MEM_EXAMPLES}")
    return int(nbytes)


HEADROOM_MAX = 0.5
"""The largest --headroom accepted: a margin of more than half the GPU's memory is not a margin."""
_FRACTION_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(%?)\s*$")


def parse_headroom(text: str | int | float, flag: str = "--headroom") -> float:
    """The GPU memory a recommendation must leave free, as a fraction: `0.05`, `5%` or 0.05 -> 0.05,
    from 0 to `HEADROOM_MAX`; else a one-line ValueError naming the flag, the value and what is accepted."""
    value = None
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text) if abs(text) < 1e300 else math.inf
    elif isinstance(text, str) and len(text) <= 100:
        m = _FRACTION_RE.match(text)
        if m:
            value = float(m.group(1)) / (100 if m.group(2) else 1)
    if value is None or not 0 <= value <= HEADROOM_MAX:
        raise ValueError(f"{flag}={short_repr(text)}: accepted: a fraction of the GPU's memory from 0 to "
                         f"{HEADROOM_MAX:g} (0.05) or a percent from 0% to {100 * HEADROOM_MAX:g}% (5%)")
    return value


def fmt_percent(fraction: float) -> str:
    """0.05 -> '5%', 0.125 -> '12.5%'."""
    return f"{100 * fraction:.3g}%"


def is_card_size(text: str | int | float) -> bool:
    """True for a size as printed on a card (a number, `80`, `80GB`, `80G`), False for an exact budget
    (`74.5GiB`, `81559MiB`, `8e10B`); `text` already accepted by `parse_memory`."""
    if isinstance(text, (int, float)):
        return True
    m = _MEM_RE.match(text)
    return bool(m) and m.group(2).lower() in _CARD_UNITS


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
