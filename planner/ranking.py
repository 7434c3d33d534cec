"""How results rank: which fit with headroom, and the simplicity order that breaks near-ties (the
recommendation's rule, recommend.py; the layout search's, layout.py; the trace front end's, module_plan.py)."""

from __future__ import annotations

from .strategies import NAMES, get_strategy

HEADROOM_FRACTION = 0.05
TIE_FRACTION = 0.05
SIMPLICITY = ("single", "ddp", "fsdp-no-shard", "zero1", "zero2", "fsdp-grad-op", "hsdp", "zero3", "fsdp")


def _rank(name: str, nodes: int | None = None) -> int:
    """Simplicity order; on one node HSDP is FSDP plus a replica group of one, so it comes last."""
    if nodes == 1 and name in NAMES and get_strategy(name).hybrid:
        return len(SIMPLICITY)
    return SIMPLICITY.index(name) if name in SIMPLICITY else len(SIMPLICITY)


def _headroom_ok(r) -> bool:
    return r.fits_cleanly and r.memory.headroom >= HEADROOM_FRACTION * r.memory.gpu_memory_bytes
