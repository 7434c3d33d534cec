"""`clear_caches`: forget every cached lookup and figure of the planner (api.clear_caches)."""

from __future__ import annotations

import sys

# each module by its own name (not `from . import`, which reads as an import of the package itself)
import distplan.planner.activations as activations
import distplan.planner.alloc_trace as alloc_trace
import distplan.planner.comm as comm
import distplan.planner.compute as compute
import distplan.planner.footprint as footprint
import distplan.planner.kernels as kernels
import distplan.planner.memory as memory
import distplan.planner.model as model
import distplan.planner.pp as pp
import distplan.planner.tp as tp


def clear_caches(catalog: bool = True) -> None:
    """Forget every cached lookup and figure (links, GPUs, layouts, schedules, activations, and with
    `catalog` the parsed catalog files): after editing catalog YAML in a running process, or to time
    the planner from cold."""
    loader = sys.modules.get("distplan.catalog.loader")  # parsed files, if the catalog was read at all
    if catalog and loader is not None:
        loader.clear_cache()
    for mod in (activations, alloc_trace, comm, compute, footprint, kernels, memory, model, pp, tp):
        for obj in vars(mod).values():
            if callable(getattr(obj, "cache_clear", None)):
                obj.cache_clear()
    compute._WEIGHTED.clear()
    traced = sys.modules.get(f"{__package__}.module_plan")  # traces, if any were made (needs torch)
    if traced is not None:
        traced._TRACES.clear()
