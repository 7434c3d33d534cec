"""distplan.catalog: hardware and model data (YAML) plus its strict loader.

Nothing is read at import time. `load_catalog()` reads the YAML files on first use and caches them
(`clear_cache()` forgets them).
"""

from __future__ import annotations

from .loader import GPU, Catalog, CatalogError, Interconnect, ModelEntry, Node, clear_cache, load_catalog

__all__ = ["CatalogError", "GPU", "Interconnect", "Node", "ModelEntry", "Catalog", "load_catalog", "clear_cache"]
