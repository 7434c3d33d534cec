"""distplan.catalog: hardware and model data (YAML) plus its strict loader.

Nothing is read at import time. `load_catalog()` (from `distplan.catalog.loader`, re-exported here
lazily) reads the YAML files on first use and caches them.
"""

from __future__ import annotations

__all__ = ["CatalogError", "GPU", "Interconnect", "Node", "ModelEntry", "Catalog", "load_catalog"]


def __getattr__(name: str):
    if name in __all__ or name == "clear_cache":
        from . import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
