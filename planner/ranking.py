"""How results rank: which fit with headroom, and the simplicity order that breaks near-ties (the
recommendation's rule, recommend.py; the layout search's, layout.py; the trace front end's, module_plan.py)."""

from __future__ import annotations

from .strategies import NAMES, get_strategy
from .units import fmt_gib, fmt_percent

HEADROOM_FRACTION = 0.05
TIE_FRACTION = 0.05
SIMPLICITY = ("single", "ddp", "fsdp-no-shard", "zero1", "zero2", "fsdp-grad-op", "hsdp", "zero3", "fsdp")


def _rank(name: str, nodes: int | None = None) -> int:
    """Simplicity order; on one node HSDP is FSDP plus a replica group of one, so it comes last."""
    if nodes == 1 and name in NAMES and get_strategy(name).hybrid:
        return len(SIMPLICITY)
    return SIMPLICITY.index(name) if name in SIMPLICITY else len(SIMPLICITY)


def _headroom_ok(r, fraction: float = HEADROOM_FRACTION) -> bool:
    """Fits without the allocator's retries and leaves `fraction` of the GPU's memory free."""
    return r.fits_cleanly and r.memory.headroom >= fraction * r.memory.gpu_memory_bytes


def headroom_warning(r, fraction: float, what: str = "strategy") -> str | None:
    """None when the pick `r` keeps the headroom asked; else the warning line the recommendation prints
    (it picked among what fits, since nothing left `fraction` free)."""
    if r is None or _headroom_ok(r, fraction):
        return None
    mem = r.memory
    return (f"no {what} that fits leaves the {fmt_percent(fraction)} headroom asked (--headroom); {r.name}, the "
            f"pick among those that fit, leaves {fmt_gib(mem.headroom)} GiB free of {fmt_gib(mem.gpu_memory_bytes)} "
            f"GiB ({fmt_percent(mem.headroom / mem.gpu_memory_bytes)})")
