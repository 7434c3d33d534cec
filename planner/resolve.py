"""The inputs of a plan: one ModelSpec from a catalog name, a parameter count or a Hugging Face config,
and one Cluster from a node type, a GPU name or raw numbers, with the catalog's links filled in.

Pure Python (no torch); the catalog is read lazily on first use. Invalid arguments raise `ValueError`
naming the argument, the value and what is accepted.
"""

from __future__ import annotations

import math
import os
from typing import Sequence

from distplan.catalog.loader import CatalogError, load_catalog

from .config import Cluster
from .hf_config import read_hf_config, resolve_hf_config
from .hardware import default_nics, detect_local_gpus, gpu_for_memory
from .model import ModelSpec
from .units import (INTER_GBPS_RANGE, LIMITS, check_count, check_float, fmt_count, parse_count, parse_memory,
                    short_repr)

DEFAULT_GPU = "h100-sxm"

_OVERRIDE_FIELDS = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "tie_embeddings")


def catalog_dirs_tuple(catalog_dirs) -> tuple[str, ...]:
    """`catalog_dirs` as a tuple of str: one directory (a str or path) or a list/tuple of them; a
    one-line ValueError for anything else (a str is one directory, not its letters)."""
    if catalog_dirs is None:
        return ()
    if isinstance(catalog_dirs, (str, os.PathLike)):
        catalog_dirs = (catalog_dirs,)
    if not isinstance(catalog_dirs, (list, tuple)) or not all(
            isinstance(d, (str, os.PathLike)) for d in catalog_dirs):
        raise ValueError(f"catalog_dirs={short_repr(catalog_dirs)}: accepted: a directory (str or path) "
                         f"or a list of them")
    return tuple(str(d) for d in catalog_dirs)


def _catalog(catalog_dirs: Sequence[str] = ()):
    return load_catalog(catalog_dirs_tuple(catalog_dirs))


_SPEC_FIELDS = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "max_positions")


def check_spec_bounds(spec: ModelSpec, where: str) -> None:
    """Every architecture size of `spec` within `units.LIMITS` (a catalog entry, a ModelSpec given to
    the API, a scaled --params model); a one-line ValueError naming `where`, the field and the bound."""
    for name in _SPEC_FIELDS:
        value = getattr(spec, name)
        lo, hi, why = LIMITS[name]
        if not lo <= value <= hi:
            raise ValueError(f"{where}: {name}={short_repr(value)}: accepted: {lo:,} to {hi:,} ({why})")


# -- model --------------------------------------------------------------------------------------

NEAREST_MODEL_MATCH = 0.10
"""`--params N` plans a catalog model itself when one is within 10% of N (7B -> mistral-7b, 70B ->
llama-3-70b): a model that exists rather than a scaled one that does not."""


def nearest_model(target: int, catalog_dirs: Sequence[str] = ()) -> tuple[ModelSpec, str] | None:
    """The Llama-style (SwiGLU, RoPE) catalog model closest to `target` parameters, if within
    NEAREST_MODEL_MATCH of it, with a one-line note naming it."""
    best, best_d = None, math.inf
    for e in _catalog(catalog_dirs).entries("models"):
        if e.arch.get("mlp") != "swiglu" or e.arch.get("position") != "rope":
            continue
        spec = ModelSpec(**e.spec_kwargs())
        d = abs(spec.param_count() - target) / target
        if d < best_d:
            best, best_d = spec, d
    if best is None or best_d > NEAREST_MODEL_MATCH:
        return None
    return best, (f"--params {fmt_count(target)}: planned the nearest real model, {best.name} "
                  f"({fmt_count(best.param_count())} params, {best.layers} layers, hidden {best.hidden}); "
                  f"--model NAME or --hf-config PATH for another")


def scaled_llama(target: int, catalog_dirs: Sequence[str] = ()) -> tuple[ModelSpec, str]:
    """A Llama-style decoder of about `target` parameters, scaled from the nearest catalog model.

    The nearest SwiGLU/RMSNorm/RoPE catalog model (by log parameter count) keeps its head dimension,
    GQA ratio, FFN/hidden ratio and vocabulary; width and depth scale by (target/P)^(1/3), width rounded
    to whole heads (and a multiple of 128 when large), the FFN to a multiple of 256, and the depth then
    chosen to land closest to the target.
    """
    cat = _catalog(catalog_dirs)
    best, best_d = None, math.inf
    for e in cat.entries("models"):
        a = e.arch
        if a.get("mlp") != "swiglu" or a.get("position") != "rope":
            continue
        spec = ModelSpec(**e.spec_kwargs())
        d = abs(math.log(target / spec.param_count()))
        if d < best_d:
            best, best_d = spec, d
    assert best is not None, "the catalog has no Llama-style model"
    k = (target / best.param_count()) ** (1 / 3)
    hd = best.head_dim
    group = best.heads // best.kv_heads
    unit = hd * group
    hidden = max(unit, round(best.hidden * k / unit) * unit)
    if hidden >= 1024:
        step = unit * 128 // math.gcd(unit, 128)
        hidden = max(step, round(hidden / step) * step)
    heads = hidden // hd
    kv_heads = max(1, heads // group)
    ffn = max(256, round(best.ffn_hidden / best.hidden * hidden / 256) * 256)
    base = ModelSpec(name="", layers=1, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn_hidden=ffn,
                     vocab=best.vocab, max_positions=best.max_positions, tie_embeddings=best.tie_embeddings)
    per_layer = base.block_param_count()
    fixed = base.param_count() - per_layer
    layers = max(1, round((target - fixed) / per_layer))
    spec = ModelSpec(name=f"~{fmt_count(target)} (scaled from {best.name})", layers=layers, hidden=hidden,
                     heads=heads, kv_heads=kv_heads, ffn_hidden=ffn, vocab=best.vocab,
                     max_positions=best.max_positions, tie_embeddings=best.tie_embeddings,
                     source=f"scaled from catalog model {best.name}")
    note = (f"no catalog model within {100 * NEAREST_MODEL_MATCH:.0f}% of {fmt_count(target)} params: "
            f"assumed a Llama-style decoder scaled from {best.name}: {layers} layers, hidden {hidden}, "
            f"{heads} heads ({kv_heads} KV), FFN {ffn}, vocab {best.vocab} = {spec.param_count():,} params")
    return spec, note


def resolve_model(model: str | ModelSpec | None = None, params: str | int | float | None = None,
                  hf_config: str | None = None, overrides: dict | None = None,
                  catalog_dirs: Sequence[str] = (), implementation: bool = True) -> tuple[ModelSpec, list[str]]:
    """One ModelSpec from a catalog name, a parameter count or a Hugging Face config.json, plus notes.

    `implementation`: a config.json describes the transformers model (its activation variant, dropout,
    sliding window, fused projections: `hf_config.read_hf_config`); False keeps only its shape, for the
    reference decoder that `distplan validate --front-end analytic` runs."""
    notes: list[str] = []
    catalog_dirs = catalog_dirs_tuple(catalog_dirs)
    given = [flag for flag, x in (("--model", model), ("--params", params), ("--hf-config", hf_config))
             if x is not None]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)}: accepted: one of --model, --params and --hf-config")
    if model is not None and not isinstance(model, (str, ModelSpec)):
        raise ValueError(f"--model={short_repr(model)}: accepted: a catalog model name or a ModelSpec")
    if isinstance(model, ModelSpec):
        spec = model
        check_spec_bounds(spec, "model")
    elif model is not None:
        try:
            entry = _catalog(catalog_dirs).model(str(model))
        except CatalogError as exc:
            raise ValueError(f"--model={short_repr(model)}: {exc}") from None
        spec = ModelSpec(**entry.spec_kwargs())
        check_spec_bounds(spec, f"--model={short_repr(model)} ({entry.path})")
    elif hf_config is not None:
        hf_config = resolve_hf_config(hf_config)  # a Hub id: its config.json in the Hugging Face cache
        kwargs = read_hf_config(hf_config, implementation=implementation)
        try:
            spec = ModelSpec(**kwargs)
        except ValueError as exc:
            raise ValueError(f"--hf-config={short_repr(hf_config)}: {exc}") from None
    else:
        target = parse_count(params if params is not None else "7B", "--params", limit="params")
        if params is None:
            notes.append("no model given: assuming 7B parameters")
        spec, note = nearest_model(target, catalog_dirs) or scaled_llama(target, catalog_dirs)
        notes.append(note)
    changes = {k: v for k, v in (overrides or {}).items() if v is not None and k in _OVERRIDE_FIELDS}
    for k, v in changes.items():
        if k == "tie_embeddings":
            if not isinstance(v, bool):
                raise ValueError(f"tie_embeddings={short_repr(v)}: accepted: True or False")
        else:
            changes[k] = check_count(k, v)
    if changes.get("kv_heads") is None and changes.get("heads") is not None and spec.kv_heads == spec.heads:
        changes["kv_heads"] = changes["heads"]
    if changes:
        try:
            spec = spec.with_overrides(**changes)
        except ValueError as exc:
            raise ValueError(f"model overrides: {exc}") from None
        notes.append("overrides: " + ", ".join(f"{k}={v}" for k, v in changes.items()))
    check_spec_bounds(spec, "model")
    return spec, notes


# -- cluster ------------------------------------------------------------------------------------

def resolve_cluster(gpus: int | None = None, gpus_per_node: int | None = None, gpu: str | None = None,
                    gpu_mem: str | float | None = None, node: str | None = None, intra: str | None = None,
                    inter: str | None = None, nics_per_node: int | None = None,
                    inter_gbps: float | None = None, detect_local: bool = False,
                    catalog_dirs: Sequence[str] = ()) -> tuple[Cluster, list[str]]:
    """A Cluster from a node type, a GPU name or raw numbers, with the catalog's links filled in.

    With `detect_local` and no GPU/memory/count given, the local GPUs are read through NVML
    (`hardware.detect_local_gpus`); no driver or no GPU leaves the catalog default with a notice.
    """
    catalog_dirs = catalog_dirs_tuple(catalog_dirs)
    cat = _catalog(catalog_dirs)
    notes: list[str] = []
    gpus = check_count("gpus", gpus) if gpus is not None else None
    gpus_per_node = check_count("gpus_per_node", gpus_per_node) if gpus_per_node is not None else None
    nics_per_node = check_count("nics_per_node", nics_per_node) if nics_per_node is not None else None
    if inter_gbps is not None:
        inter_gbps = check_float("inter_gbps", inter_gbps, *INTER_GBPS_RANGE, "Gbit/s per node",
                                 "100 Mbit Ethernet to over ten times a node of 8 x 800 Gbit/s NICs")
    for flag, name in (("--gpu", gpu), ("--node", node), ("--intra", intra), ("--inter", inter)):
        if name is not None and not isinstance(name, str):
            raise ValueError(f"{flag}={short_repr(name)}: accepted: a catalog name (distplan catalog list)")
    mem_bytes = parse_memory(gpu_mem, "--gpu-mem") if gpu_mem is not None else None

    local = None
    if detect_local and gpus is None and gpu is None and gpu_mem is None and node is None:
        local, notice = detect_local_gpus()
        notes.append(notice)

    try:
        node_e = cat.node(node) if node else None
        gpu_name = gpu or (node_e.gpu if node_e else None)
        if gpu_name is None and local is not None:
            gpu_name = local.catalog_gpu
        if gpu_name is None and mem_bytes is not None:  # --gpu-mem alone: the catalog GPU of that size
            gpu_name, matched = gpu_for_memory(cat, mem_bytes, DEFAULT_GPU)
            e = cat.gpu(gpu_name)
            notes.append(f"--gpu-mem {gpu_mem} = {mem_bytes / 2**30:.4g} GiB: " + (
                f"assumed {e.name} (the catalog GPU with that memory: its FLOP/s and {e.scale_up_link}); "
                f"--gpu NAME for another" if matched else
                f"no catalog GPU has that memory: planned {e.name}'s FLOP/s and {e.scale_up_link} with it; "
                f"--gpu NAME to choose"))
        elif mem_bytes is not None:
            notes.append(f"--gpu-mem {gpu_mem} = {mem_bytes / 2**30:.4g} GiB of {gpu_name}")
        gpu_e = cat.gpu(gpu_name or DEFAULT_GPU)
    except CatalogError as exc:
        flag = "--node" if node and "node" in str(exc) else "--gpu"
        raise ValueError(f"{flag}: {exc}") from None

    if mem_bytes is None:
        mem_bytes = local.memory_bytes if local is not None else gpu_e.memory_bytes
    if gpus is None:
        gpus = local.count if local is not None else (node_e.gpus_per_node if node_e else 8)
        if local is None and gpu is None and gpu_mem is None and node is None:
            notes.append(f"no --gpus given: assuming {gpus}")
    per_node_from = f"--gpus-per-node {gpus_per_node}"
    if gpus_per_node is None:
        gpus_per_node = node_e.gpus_per_node if node_e else min(8, gpus)
        per_node_from = f"--node {node_e.name}" if node_e else "assumed without --node or --gpus-per-node"
    if (isinstance(gpus, int) and isinstance(gpus_per_node, int) and 0 < gpus_per_node < gpus
            and gpus % gpus_per_node):
        raise ValueError(f"--gpus={gpus}: not a multiple of the {gpus_per_node} GPUs per node ({per_node_from}); "
                         f"accepted: up to {gpus_per_node}, or a multiple of {gpus_per_node} "
                         f"({gpus // gpus_per_node * gpus_per_node} or {(gpus // gpus_per_node + 1) * gpus_per_node}"
                         f" here); --gpus-per-node sets the node's size")
    intra_name = intra or (node_e.intra_link if node_e else None)
    if intra_name is None:
        if local is not None and local.intra_link:
            intra_name = local.intra_link
        else:
            intra_name = gpu_e.scale_up_link
    inter_name = inter or (node_e.inter_link if node_e else "ib-ndr")
    for flag, name, tier in (("--intra", intra_name, "intra_node"), ("--inter", inter_name, "inter_node")):
        try:
            link = cat.interconnect(name)
        except CatalogError as exc:
            raise ValueError(f"{flag}={short_repr(name)}: {exc}") from None
        if flag == "--intra" and link.tier != "intra_node":
            raise ValueError(f"--intra={short_repr(name)} is an inter-node link ({link.kind}); accepted: "
                             + ", ".join(n for n in cat.names("interconnects")
                                         if cat.interconnect(n).tier == "intra_node"))
        if flag == "--inter" and link.tier != "inter_node":
            raise ValueError(f"--inter={short_repr(name)} is an intra-node link ({link.kind}); accepted: "
                             + ", ".join(n for n in cat.names("interconnects")
                                         if cat.interconnect(n).tier == "inter_node"))
        if flag == "--intra":
            intra_name = link.name
        else:
            inter_name = link.name
    nics = nics_per_node or (node_e.nics_per_node if node_e else None)
    if nics is None:
        nics, why = default_nics(cat, inter_name, gpu_e.name, min(gpus_per_node, gpus))
        if gpus > gpus_per_node and not inter_gbps:
            notes.append(f"inter-node: {nics} x {inter_name} per node ({why}); --nics-per-node to change")
    try:
        cluster = Cluster(gpus=gpus, gpus_per_node=min(gpus_per_node, gpus), gpu_memory_bytes=mem_bytes,
                          gpu_name=gpu_e.name, intra_link=intra_name, inter_link=inter_name,
                          nics_per_node=nics,
                          inter_bytes_per_s=inter_gbps * 1e9 / 8 if inter_gbps else None,
                          host_memory_bytes=node_e.host_memory_bytes if node_e else 0,
                          notes=tuple(notes), catalog_dirs=catalog_dirs)
    except ValueError as exc:
        raise ValueError(f"cluster: {exc}") from None
    return cluster, notes
