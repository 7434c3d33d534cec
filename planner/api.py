"""The planner's public API: resolve inputs, evaluate every strategy, recommend one.

    from distplan.planner import plan
    p = plan(params="7B", gpus=8, gpu_mem=80)
    p.best.name, p["fsdp"].memory.peak_allocated, p.to_dict()

Everything here is pure Python (no torch); the catalog is read lazily on first use. Invalid arguments
raise `ValueError` naming the argument, the value and what is accepted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Sequence

from .comm_schedule import collective_schedule
from .compute import _gpu, required_inter_bandwidth, step_time
from .config import CHECKPOINTING, Cluster, TrainConfig
from .memory import COMPONENTS, MemoryEstimate, estimate_memory
from .model import ModelSpec
from .strategies import NAMES, Strategy, get_strategy
from .units import (INTER_GBPS_RANGE, LIMITS, check_count, check_float, fmt_count, parse_count, parse_memory,
                    short_repr)

DEFAULT_GPU = "h100-sxm"

_OVERRIDE_FIELDS = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "tie_embeddings")


def clear_caches(catalog: bool = True) -> None:
    """Forget every cached lookup and figure (links, GPUs, layouts, schedules, activations, and with
    `catalog` the parsed catalog files): after editing catalog YAML in a running process, or to time
    the planner from cold."""
    from distplan.catalog.loader import clear_cache

    from . import activations, alloc_trace, comm, compute, footprint, kernels, memory, model, pp, tp
    if catalog:
        clear_cache()
    for mod in (activations, alloc_trace, comm, compute, footprint, kernels, memory, model, pp, tp):
        for obj in vars(mod).values():
            if callable(getattr(obj, "cache_clear", None)):
                obj.cache_clear()
    compute._WEIGHTED.clear()
    import sys
    traced = sys.modules.get(f"{__package__}.module_plan")  # traces, if any were made (needs torch)
    if traced is not None:
        traced._TRACES.clear()


def catalog_dirs_tuple(catalog_dirs) -> tuple[str, ...]:
    """`catalog_dirs` as a tuple of str: one directory (a str or path) or a list/tuple of them; a
    one-line ValueError for anything else (a str is one directory, not its letters)."""
    import os
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
    from distplan.catalog.loader import load_catalog
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
        from distplan.catalog.loader import CatalogError
        try:
            entry = _catalog(catalog_dirs).model(str(model))
        except CatalogError as exc:
            raise ValueError(f"--model={short_repr(model)}: {exc}") from None
        spec = ModelSpec(**entry.spec_kwargs())
        check_spec_bounds(spec, f"--model={short_repr(model)} ({entry.path})")
    elif hf_config is not None:
        from .hf_config import read_hf_config, resolve_hf_config
        hf_config = resolve_hf_config(hf_config)  # a Hub id: its config.json in the Hugging Face cache
        kwargs = read_hf_config(hf_config, implementation=implementation)
        try:
            spec = ModelSpec(**kwargs)
        except ValueError as exc:
            raise ValueError(f"--hf-config={short_repr(hf_config)}: {exc}") from None
    else:
        target = parse_count(params if params is not None else "7B", "--params")
        if target > LIMITS["params"][1]:
            raise ValueError(f"--params={short_repr(params)}: accepted: 1 to 10^14 parameters "
                             f"({LIMITS['params'][2]})")
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
    from distplan.catalog.loader import CatalogError
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
        from .hardware import detect_local_gpus
        local, notice = detect_local_gpus()
        notes.append(notice)

    try:
        node_e = cat.node(node) if node else None
        gpu_name = gpu or (node_e.gpu if node_e else None)
        if gpu_name is None and local is not None:
            gpu_name = local.catalog_gpu
        if gpu_name is None and mem_bytes is not None:  # --gpu-mem alone: the catalog GPU of that size
            from .hardware import gpu_for_memory
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
        from .hardware import default_nics
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


# -- results ------------------------------------------------------------------------------------

@dataclass
class StrategyResult:
    """One strategy's prediction: memory at the peak, collectives, step time."""

    strategy: Strategy
    memory: MemoryEstimate
    collectives: list = field(default_factory=list)
    time: Any = None
    checkpoint: Any = None
    """The checkpoint save (`checkpoint.CheckpointEstimate`) when the plan was asked for one."""
    _required: Any = field(default=None, repr=False)
    """A zero-argument function giving the required inter-node bandwidth (a bisection over the
    communication model, the costliest answer here), evaluated on first use and kept."""

    @property
    def required_inter_bytes_per_s(self) -> float | None:
        """Per-node inter-node bandwidth (bytes/s) at which this strategy's communication would hide: what it
        exposes, and the compute it slows while it overlaps, at most 5% of compute."""
        if callable(self._required):
            self._required = (self._required(),)
        return self._required[0] if isinstance(self._required, tuple) else self._required

    @property
    def name(self) -> str:
        return self.strategy.name

    @property
    def fits(self) -> bool:
        """The training step fits, and so does the checkpoint save when one was planned."""
        return self.memory.fits and (self.checkpoint is None or self.checkpoint.fits)

    @property
    def fits_cleanly(self) -> bool:
        """`fits`, without the caching allocator releasing its cache (memory.MemoryEstimate.alloc_retries):
        what the recommendation asks of a pick."""
        return self.fits and not self.memory.alloc_retries

    @property
    def comm_bytes_per_gpu(self) -> int:
        return sum(c.bytes_per_gpu for c in self.collectives)

    @property
    def comm_time_s(self) -> float:
        return sum(c.time_s for c in self.collectives)

    @property
    def step_time_s(self) -> float | None:
        return self.time.step_time_s if self.time is not None else None

    def to_dict(self) -> dict:
        t = self.time
        return {
            "name": self.name,
            "implementation": self.strategy.implementation,
            "fits": self.fits,
            "peak_phase": self.memory.peak_phase,
            "memory": self.memory.to_dict(),
            "headroom_bytes": int(self.memory.headroom),
            "comm": {
                "collectives": [c.to_dict() for c in self.collectives],
                "bytes_per_gpu": int(self.comm_bytes_per_gpu),
                "time_s": self.comm_time_s,
                "exposed_s": t.exposed_comm_s if t is not None else None,
            },
            "compute_s": t.compute_s if t is not None else None,
            # step_time_s = compute_s + comm.exposed_s + optimizer_s + overhead_s
            "optimizer_s": t.optimizer_s if t is not None else None,
            "overhead_s": t.overhead_s if t is not None else None,
            "step_time_s": t.step_time_s if t is not None else None,
            "tokens_per_s": t.tokens_per_s if t is not None else None,
            "mfu": t.mfu if t is not None else None,
            # inf (no inter-node bandwidth hides it: the intra-node part alone is exposed) -> null + flag
            "required_inter_bytes_per_s": (None if self.required_inter_bytes_per_s == float("inf")
                                           else self.required_inter_bytes_per_s),
            "comm_hideable": self.required_inter_bytes_per_s != float("inf"),
            "notes": list(self.memory.notes),
            **({"checkpoint": self.checkpoint.to_dict()} if self.checkpoint is not None else {}),
        }


def drop_conflicts(names: list, optimizer: str, asked: bool, framework: str = "pytorch") -> tuple[list, list]:
    """(the strategies to plan, notes): those whose implementation cannot run `optimizer`
    (precision.optimizer_conflict) leave the default list with a note; asked for by name, they are planned
    and the note says they fail. DeepSpeed's ZeRO stages are its own implementation, not FSDP2: not judged."""
    from .precision import optimizer_conflict
    if framework != "pytorch":
        return names, []
    why = {n: optimizer_conflict(optimizer, get_strategy(n).family) for n in names}
    bad = [n for n in names if why[n]]
    if not bad:
        return names, []
    reason = why[bad[0]]
    if asked:
        return names, [f"{', '.join(bad)} with --optimizer {optimizer}: planned as asked, but {reason}"]
    kept = [n for n in names if not why[n]]
    return kept, [f"{', '.join(bad)} not planned with --optimizer {optimizer}: {reason}"]


def evaluate(train: TrainConfig, cluster: Cluster, strategy: str | Strategy, *, comm: bool = True,
             device: str = "cuda", catalog_dirs: Sequence[str] = (), checkpoint: str | None = None,
             storage_bytes_per_s: float | None = None, mem: MemoryEstimate | None = None) -> StrategyResult:
    """One strategy's prediction; `mem`: its memory estimate when the caller already has it (the
    layout search judges memory first)."""
    st = get_strategy(strategy)
    if mem is None:
        mem = estimate_memory(train, cluster, st, device=device)
    result = StrategyResult(st, mem)
    if checkpoint is not None:
        from .checkpoint import DEFAULT_STORAGE_GBPS, estimate_checkpoint
        result.checkpoint = estimate_checkpoint(train, cluster, st, checkpoint,
                                                storage_bytes_per_s or DEFAULT_STORAGE_GBPS * 1e9,
                                                device=device, mem=mem)
    if comm:
        result.collectives = collective_schedule(train, cluster, st)
        gpu = _gpu(cluster.gpu_name, tuple(catalog_dirs) if catalog_dirs else ())
        result.time = step_time(train, cluster, st, result.collectives, gpu)
        result._required = lambda: required_inter_bandwidth(train, cluster, st.name, gpu=gpu)
    return result


@dataclass
class Plan:
    """Every evaluated strategy for one model, training setup and cluster, and the recommendation."""

    train: TrainConfig
    cluster: Cluster
    results: list[StrategyResult]
    notes: list[str] = field(default_factory=list)
    tokens: float | None = None
    checkpoint: str | None = None
    storage_bytes_per_s: float | None = None
    search: Any = None
    """The layout search (`layout.LayoutSearch`) when `recommend` searched the mesh: this plan's train
    config is then the picked layout's (or the one given, when nothing fits anywhere)."""
    _recommendation: Any = field(default=None, repr=False, compare=False)

    def __getitem__(self, name: str) -> StrategyResult:
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(f"{short_repr(name)} was not evaluated; evaluated: {', '.join(r.name for r in self.results)}")

    def evaluate_on(self, cluster: Cluster, name: str) -> StrategyResult:
        """This plan's training run under strategy `name` on another cluster (the remedies `recommend`
        weighs: more NICs, RDMA, fewer nodes), by the same front end as the plan's own results."""
        return evaluate(self.train, cluster, name, catalog_dirs=cluster.catalog_dirs)

    @property
    def recommendation(self):
        from .recommend import recommend
        if self.search is None:
            return recommend(self)
        if self._recommendation is None:  # a searched plan does not change: its answer is kept
            self._recommendation = recommend(self)
        return self._recommendation

    @property
    def best(self) -> StrategyResult | None:
        rec = self.recommendation
        return self[rec.strategy] if rec.strategy else None

    def to_dict(self) -> dict:
        rec = self.recommendation
        inputs = {"model": self.train.model.to_dict(), "model_params": self.train.model.param_count(),
                  "train": {k: v for k, v in self.train.to_dict().items() if k != "model"},
                  "cluster": self.cluster.to_dict(), "notes": list(self.notes)}
        t, p, c = self.train.tp, self.train.pp, self.train.cp
        inputs["mesh"] = {"pp": p, "dp": self.cluster.gpus // (t * p * c), "cp": c, "tp": t,
                          "sequence_parallel": self.train.sequence_parallel}
        if p > 1:
            from .pp import bubble_fraction
            inputs["mesh"].update(pp_schedule=self.train.pp_schedule,
                                  pp_microbatches=self.train.pp_microbatches,
                                  pp_bubble_fraction=bubble_fraction(self.train.pp_schedule, p,
                                                                     self.train.pp_microbatches))
        if self.tokens:
            inputs["tokens"] = self.tokens
        if self.checkpoint:
            inputs["checkpoint"] = {"mode": self.checkpoint, "storage_bytes_per_s": self.storage_bytes_per_s}
        out = {"inputs": inputs, "strategies": []}
        for r in self.results:
            d = r.to_dict()
            if self.tokens and r.time is not None and r.time.tokens_per_s:
                d["time_to_train_s"] = self.tokens / r.time.tokens_per_s
            out["strategies"].append(d)
        out["recommendation"] = rec.to_dict()
        return out

    def _repr_html_(self) -> str:
        from .report import plan_html
        return plan_html(self)

    def plot(self, path: str | None = None):
        from .report import plot_matplotlib
        return plot_matplotlib(self, path)

    def svg(self) -> str:
        from .report import plan_svg
        return plan_svg(self)


@dataclass(frozen=True)
class _CPCheck:
    """What `cp.check_cp` reads, before the TrainConfig exists."""
    seq_len: int
    attention: str
    framework: str
    pp: int
    tp: int


@dataclass(frozen=True)
class _PPCheck:
    """What `pp.check_pp` reads, with the CLI's flag names in its messages."""
    model: ModelSpec
    grad_accum: int
    framework: str
    pp: int
    pp_schedule: str
    pp_microbatches: int
    cpu_offload: str
    checkpointing: str


def plan(model: str | ModelSpec | None = None, *, params: str | int | float | None = None,
         hf_config: str | None = None, gpus: int | None = None, gpus_per_node: int | None = None,
         gpu: str | None = None, gpu_mem: str | float | None = None, node: str | None = None,
         intra: str | None = None, inter: str | None = None, nics_per_node: int | None = None,
         inter_gbps: float | None = None, seq_len: int = 2048, micro_batch: int = 1, grad_accum: int = 1,
         grad_sync: str = "last", precision: str = "bf16-mixed", optimizer: str = "adamw", optimizer_impl: str = "foreach",
         activation_checkpointing: str = "none", attention: str = "sdpa", attention_kernel: str = "flash",
         cpu_offload: str = "none", framework: str = "pytorch", compile: bool = False, tp: int = 1, sequence_parallel: bool = False,
         alloc_conf: str = "", pp: int = 1, pp_schedule: str = "1f1b", pp_microbatches: int | None = None,
         cp: int = 1, torch_version: str = "", strategies: Iterable[str] | None = None,
         tokens: float | None = None, checkpoint: str | None = None, storage_gbps: float | None = None,
         comm: bool = True, detect_local: bool = False, catalog_dirs: Sequence[str] = (),
         front_end: str = "analytic", **overrides) -> Plan:
    """Plan a training run: every strategy's per-GPU memory, communication and step time.

    Args:
        model: a catalog model name ("llama-3-8b") or a ModelSpec; or give `params` ("7B") or
            `hf_config` (path to a Hugging Face config.json, or a Hub id "org/name[@revision]": its
            config.json from the Hugging Face cache, downloaded there if missing).
        gpus, gpus_per_node, gpu, gpu_mem, node, intra, inter, nics_per_node, inter_gbps: the cluster
            (catalog names; `gpu_mem` as 80, "80GB" or "80GiB").
        seq_len, micro_batch, grad_accum, precision, optimizer, optimizer_impl,
            activation_checkpointing, attention, cpu_offload, framework: one training step.
        grad_sync: with grad_accum > 1, "last" (gradients reduced on the last micro-step only: DDP/FSDP1
            `no_sync()`, FSDP2 `set_requires_gradient_sync(False)` before it) or "every" (every
            micro-step reduces; the sharded gradient accumulates).
        compile: the blocks run under torch.compile (step time only: fused pointwise kernels).
        attention_kernel: the fused kernel `attention="sdpa"` runs, for its time only: "flash"
            (FlashAttention-2, SDPA's flash backend) or "flash-triton" (FlashAttention in Triton, as
            llm-foundry's attn_impl='triton'; config.ATTENTION_KERNELS). The analytic front end only.
        tp, sequence_parallel: tensor-parallel degree inside a node (torchtitan's Llama plan; the
            strategies then run over gpus / tp data-parallel ranks) and sequence parallelism (tp.py).
        alloc_conf: the run's PYTORCH_CUDA_ALLOC_CONF (expandable_segments, max_split_size_mb), which the
            reserved peak's allocator replay follows.
        pp, pp_schedule, pp_microbatches: pipeline stages (torch.distributed.pipelining; the strategies
            run over gpus / (tp * pp) ranks), the schedule (gpipe, 1f1b, interleaved-1f1b, interleaved-zb, zbv) and the
            micro-batches per step (default 2 * pp) (pp.py).
        cp: context-parallel degree (torchtitan's `context_parallel`: each sequence split over cp ranks,
            ring attention; the strategies run over the dp x cp ranks) (cp.py).
        torch_version: the PyTorch release the run will use ("2.15"), where the walks follow
            implementations that changed between releases (config.TrainConfig.torch_version); default
            the installed torch's.
        strategies: names from the registry (default: all).
        tokens: total training tokens, for the time-to-train figure.
        checkpoint: also plan saving a checkpoint: "full", "full-offload" or "sharded" (checkpoint.py);
            its device peak counts in `fits`.
        storage_gbps: write bandwidth per writing rank for the save time, GB/s (default
            checkpoint.DEFAULT_STORAGE_GBPS).
        front_end: with `hf_config`, "analytic" (the formulas, no torch), "trace" (the transformers model run
            on fake tensors: any causal LM transformers builds, mixture-of-experts included; needs torch and
            transformers; returns a module_plan.ModulePlan, without tp/pp/cp or checkpoint saves) or "auto"
            (the trace when torch and transformers are installed), as the CLI's --front-end (whose default
            is auto).
        overrides: layers, hidden, heads, kv_heads, ffn_hidden, vocab, tie_embeddings.
    """
    catalog_dirs = catalog_dirs_tuple(catalog_dirs)
    if front_end != "analytic":
        from .cli import FRONT_ENDS, build_plan, use_trace
        if front_end not in FRONT_ENDS:
            raise ValueError(f"--front-end={short_repr(front_end)}: accepted: {', '.join(FRONT_ENDS)}")
        if hf_config is None:
            raise ValueError(f"--front-end={front_end}: the trace front end reads a Hugging Face model; give "
                             f"hf_config (a config.json, its folder or a Hub id)")
        if use_trace({"hf_config": hf_config, "front_end": front_end, "tp": tp, "pp": pp, "cp": cp,
                      "sequence_parallel": sequence_parallel, "checkpoint": checkpoint,
                      "storage_gbps": storage_gbps, "attention_kernel": attention_kernel}):
            kw = dict(overrides, model=model, params=params, hf_config=hf_config, front_end=front_end, gpus=gpus,
                      gpus_per_node=gpus_per_node, gpu=gpu, gpu_mem=gpu_mem, node=node, intra=intra, inter=inter,
                      nics_per_node=nics_per_node, inter_gbps=inter_gbps, seq_len=seq_len, micro_batch=micro_batch,
                      grad_accum=grad_accum, grad_sync=grad_sync, precision=precision, optimizer=optimizer,
                      optimizer_impl=optimizer_impl, activation_checkpointing=activation_checkpointing,
                      attention=attention, attention_kernel=attention_kernel, cpu_offload=cpu_offload,
                      framework=framework, compile_=compile,
                      alloc_conf=alloc_conf, torch_version=torch_version, tp=tp, pp=pp, cp=cp,
                      sequence_parallel=sequence_parallel, checkpoint=checkpoint, storage_gbps=storage_gbps,
                      tokens=tokens, catalog_dirs=catalog_dirs, detect_local=detect_local)
            if isinstance(strategies, str):
                strategies = [strategies]
            return build_plan(kw, list(strategies or ()), detect_local=detect_local, comm=comm)
    seq_len, micro_batch, grad_accum = (check_count(k, v) for k, v in (
        ("seq_len", seq_len), ("micro_batch", micro_batch), ("grad_accum", grad_accum)))
    if isinstance(strategies, str):
        strategies = [strategies]
    if strategies is not None and not isinstance(strategies, (list, tuple, set, frozenset)):
        raise ValueError(f"strategies={short_repr(strategies)}: accepted: a list of names from "
                         f"{', '.join(NAMES)}")
    if tokens is not None:
        if isinstance(tokens, str):
            tokens = parse_count(tokens, "--tokens")
        check_float("tokens", tokens, 1, 1e16, "tokens", "a positive count")
    unknown = set(overrides) - set(_OVERRIDE_FIELDS)
    if unknown:
        raise ValueError(f"unknown argument(s) {', '.join(sorted(unknown))}; model overrides accepted: "
                         + ", ".join(_OVERRIDE_FIELDS))
    spec, notes = resolve_model(model if not isinstance(model, ModelSpec) else model, params, hf_config,
                                overrides, catalog_dirs)
    cluster, cnotes = resolve_cluster(gpus, gpus_per_node, gpu, gpu_mem, node, intra, inter, nics_per_node,
                                      inter_gbps, detect_local, catalog_dirs)
    tp = check_count("tp", tp)
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"--sequence-parallel={short_repr(sequence_parallel)}: accepted: True or False")
    if sequence_parallel and tp == 1:
        raise ValueError("--sequence-parallel: needs --tp > 1 (it shards along the tensor-parallel group)")
    if tp > 1:
        from .config import check_tp
        check_tp(tp, spec, "--tp", cluster.gpus, cluster.local_size)
        if framework != "pytorch":
            raise ValueError(f"--tp={tp} with --framework={short_repr(framework)}: tensor parallelism is "
                             f"modelled for PyTorch's parallelize_module; accepted: --framework pytorch")
    if torch_version:
        from .config import torch_release
        torch_release(torch_version, "--torch-version")  # one line naming the flag, before anything runs
    if alloc_conf:
        if not isinstance(alloc_conf, str):
            raise ValueError(f"--alloc-conf={short_repr(alloc_conf)}: accepted: a PYTORCH_CUDA_ALLOC_CONF string")
        from .allocator import parse_alloc_conf
        notes = notes + parse_alloc_conf(alloc_conf, "--alloc-conf")[2]
    pp = check_count("pp", pp)
    from .config import PP_SCHEDULES
    if not isinstance(pp_schedule, str) or pp_schedule not in PP_SCHEDULES:
        raise ValueError(f"--pp-schedule={short_repr(pp_schedule)}: accepted: {', '.join(PP_SCHEDULES)}")
    if pp_microbatches is None:
        pp_microbatches = 2 * pp if pp > 1 else 1
        if pp > 1:
            notes.append(f"pipeline: {pp_microbatches} micro-batches per step assumed (2 x --pp; "
                         f"--pp-microbatches sets it)")
    pp_microbatches = check_count("pp_microbatches", pp_microbatches)
    if pp == 1 and pp_microbatches != 1:
        raise ValueError(f"--pp-microbatches={pp_microbatches}: needs --pp > 1 (without pipeline stages use "
                         f"--grad-accum)")
    if pp > 1:
        if cluster.gpus % (tp * pp):
            raise ValueError(f"--pp={pp}: tp x pp = {tp * pp} must divide --gpus={cluster.gpus}; accepted: "
                             + ", ".join(str(d) for d in range(1, cluster.gpus // tp + 1)
                                         if (cluster.gpus // tp) % d == 0 and d <= spec.layers))
        from .pp import check_pp
        check_pp(_PPCheck(spec, grad_accum, framework, pp, pp_schedule, pp_microbatches, cpu_offload,
                          activation_checkpointing), "--pp")
    cp = check_count("cp", cp)
    if cp > 1:
        from .cp import check_cp
        check_cp(cp, _CPCheck(seq_len, attention, framework, pp, tp), cluster.gpus)
        if strategies and "single" in strategies:
            raise ValueError(f"--strategy=single with --cp={cp}: the cp ranks' gradients must be averaged; "
                             f"accepted: a data-parallel strategy ({', '.join(n for n in NAMES if n != 'single')})")
        notes.append(f"context parallel: each sequence split over {cp} ranks ({seq_len // cp} tokens each), "
                     f"ring attention; the strategies run over the dp x cp ranks")
    train = TrainConfig(spec, seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum,
                        grad_sync=grad_sync, precision=precision, optimizer=optimizer, optimizer_impl=optimizer_impl,
                        checkpointing=activation_checkpointing, attention=attention,
                        attention_kernel=attention_kernel,
                        cpu_offload=cpu_offload, framework=framework, compile=compile, tp=tp,
                        sequence_parallel=sequence_parallel, alloc_conf=alloc_conf, pp=pp,
                        pp_schedule=pp_schedule, pp_microbatches=pp_microbatches, cp=cp,
                        torch_version=torch_version)
    dp = cluster.gpus // (tp * pp)  # the ranks a strategy runs over (dp x cp)
    if pp > 1:
        from .pp import PP_STRATEGIES
        bad = [n for n in (strategies or ()) if n not in PP_STRATEGIES]
        if bad:
            raise ValueError(f"--strategy={short_repr(bad[0])} with --pp={pp}: PipelineStage drives DDP and FSDP2 "
                             f"(fully_shard) only; accepted: {', '.join(PP_STRATEGIES)}")
    names = list(strategies) if strategies else [n for n in NAMES if (n != "single" or dp == 1)
                                                 and (pp == 1 or n in PP_STRATEGIES)]
    if dp == 1 and not strategies:
        names = ["single"]
    names, conflicts = drop_conflicts(names, optimizer, bool(strategies), framework)
    notes = notes + conflicts
    storage = None
    if checkpoint is not None:
        from .checkpoint import DEFAULT_STORAGE_GBPS, MODES
        if checkpoint not in MODES:
            raise ValueError(f"--checkpoint={short_repr(checkpoint)}: accepted: {', '.join(MODES)}")
        storage = check_float("storage_gbps", DEFAULT_STORAGE_GBPS if storage_gbps is None else storage_gbps,
                              1e-3, 1e5, "GB/s", "1 MB/s to 100 TB/s per writing rank") * 1e9
    elif storage_gbps is not None:
        raise ValueError("--storage-gbps: needs --checkpoint full|full-offload|sharded")
    results = [evaluate(train, cluster, get_strategy(n), comm=comm, catalog_dirs=catalog_dirs,
                        checkpoint=checkpoint, storage_bytes_per_s=storage) for n in names]
    if tokens is not None and not tokens > 0:
        raise ValueError(f"tokens={short_repr(tokens)}: must be positive")
    from .cli import analytic_only
    layout_flag = analytic_only({"tp": tp, "pp": pp, "cp": cp, "sequence_parallel": sequence_parallel,
                                 "checkpoint": checkpoint, "storage_gbps": storage_gbps})
    front = ("front end: analytic (decoder formulas" + (
        ")" if not hf_config else
        f", as transformers implements this model: the trace does not follow {layout_flag.split('=')[0]})"
        if layout_flag else "; --front-end trace runs the transformers model itself on fake tensors)"))
    if spec.attn_softcap:
        notes.append("attention: eager, as transformers runs Gemma-2 by default (no SDPA path: SDPA cannot "
                     "soft-cap the scores), keeping B x heads x S^2 scores per layer; flash_attention_2 (the "
                     "flash-attn package) soft-caps without them and is not modelled")
    return Plan(train, cluster, results, notes + cnotes + [front], tokens, checkpoint, storage)


def recommend(model: str | ModelSpec | None = None, *, tp: int | None = None, pp: int | None = None,
              sequence_parallel: bool | None = None, **kwargs) -> Plan:
    """`plan` and its recommendation, searching the parallel layout over what is not given.

    With `tp` and `pp` both given this is `plan(...)` (the strategy choice at that mesh). Otherwise the
    unfixed dimensions are searched (layout.py): tp inside a node, pp, and sequence parallelism unless
    `sequence_parallel` is given; every layout at the global batch the arguments give. The Plan returned
    is the picked layout's (every strategy evaluated there), with `.search` and
    `.recommendation.layout`; when no layout fits it is the plan as given, and the recommendation says
    what the closest layout needs. Other arguments: as `plan`.

        p = recommend("llama-3-405b", gpus=256, node="dgx-h100", seq_len=8192)
        p.recommendation.layout, p.recommendation.strategy, p.best.memory.device_total
    """
    if tp is not None and pp is not None:
        return plan(model, tp=tp, pp=pp, sequence_parallel=bool(sequence_parallel), **kwargs)
    if sequence_parallel is not None and not isinstance(sequence_parallel, bool):
        raise ValueError(f"--sequence-parallel={short_repr(sequence_parallel)}: accepted: True or False")
    kwargs.pop("comm", None)  # the search compares step times: always timed
    sp_given = bool(sequence_parallel) and tp is not None
    given = plan(model, tp=tp or 1, pp=pp or 1, sequence_parallel=sp_given, **kwargs)
    return search_plan(given, fixed_tp=tp, fixed_pp=pp, fixed_sp=sequence_parallel,
                       strategies=kwargs.get("strategies"))


def search_plan(given: Plan, *, fixed_tp: int | None = None, fixed_pp: int | None = None,
                fixed_sp: bool | None = None, strategies=None) -> Plan:
    """The layout search over `given`'s model, cluster and global batch (layout.py): the picked layout's
    Plan with `.search` set, or `given` with `.search` set when nothing fits in any layout."""
    from .layout import search_with_changes
    if isinstance(strategies, str):
        strategies = [strategies]
    c = given.cluster
    s = search_with_changes(given.train, c, list(strategies) if strategies else None, fixed_tp=fixed_tp,
                            fixed_pp=fixed_pp, fixed_sp=fixed_sp, checkpoint=given.checkpoint,
                            storage_bytes_per_s=given.storage_bytes_per_s, catalog_dirs=c.catalog_dirs)
    if s.pick is None:
        return replace(given, search=s)
    cand, best = s.pick
    # every strategy of the picked layout with its communication and time (the tables show them all);
    # those the search timed are kept as they are
    results = [r if r.time is not None else evaluate(cand.train, c, r.strategy, catalog_dirs=c.catalog_dirs,
                                                     mem=r.memory, checkpoint=given.checkpoint,
                                                     storage_bytes_per_s=given.storage_bytes_per_s)
               for r in cand.results]
    notes = [n for n in given.notes if not n.startswith("pipeline:")]
    return Plan(cand.train, c, results, notes, given.tokens, given.checkpoint, given.storage_bytes_per_s, search=s)


# -- validation ---------------------------------------------------------------------------------

def predict_probe(spec: dict) -> dict:
    """The planner's prediction for one validation probe (see distplan.validate), in base units.

    Probes run on CPU (gloo, fake process group) or GPU; `device` picks the activation terms that
    differ between the two (LayerNorm statistics dtype, autocast's softmax, SDPA's backend) and adds
    the cuBLAS workspaces of the spec's `gpu_name` (the probing machine's GPU) on CUDA.
    """
    if spec.get("module") and all(int(spec.get(k, 1)) == 1 for k in ("tp", "pp", "cp")):
        # a traced model; split by tensor parallelism (validate/tp_probe.parallelize_hf), into pipeline stages
        # (validate/pp_probe.build_hf_stage) or over context-parallel ranks (validate/cp.hf_context_parallel), a
        # transformers model is predicted by the analytic front end from spec["model"], the config as
        # transformers implements it
        from .module_plan import predict_module_probe
        return predict_module_probe(spec)
    if int(spec.get("pp", 1)) > 1:  # a pipeline probe (validate/pp_probe.py): its most loaded rank
        from .pp import predict_pp_probe
        return predict_pp_probe(spec)
    model = ModelSpec(**spec["model"])
    t = spec["train"]
    train = TrainConfig(model, seq_len=t["seq_len"], micro_batch=t["micro_batch"],
                        grad_accum=t.get("grad_accum", 1), grad_sync=t.get("grad_sync", "last"),
                        precision=t["precision"],
                        optimizer=t.get("optimizer", "adamw"), optimizer_impl=t.get("optimizer_impl", "foreach"),
                        checkpointing=t.get("checkpointing", "none"), attention=t.get("attention", "sdpa"),
                        alloc_conf=t.get("alloc_conf", ""), cpu_offload=t.get("cpu_offload", "none"),
                        tp=int(spec.get("tp", 1)),
                        sequence_parallel=bool(spec.get("sequence_parallel", False)), cp=int(spec.get("cp", 1)),
                        torch_version=spec.get("torch_version") or "")
    world = int(spec["world_size"])
    gpn = int(spec.get("gpus_per_node") or world)
    cluster = Cluster(gpus=world, gpus_per_node=gpn, gpu_memory_bytes=10**15, gpu_name=DEFAULT_GPU,
                      intra_link="nvlink4", inter_link="ib-ndr", nics_per_node=gpn)
    mode = spec.get("mode")
    device = spec.get("device_type") or ("cuda" if mode == "gpu" else "cpu")
    backend = {"gpu": "nccl", "cpu": "gloo", "fake": "fake"}.get(mode, "nccl")
    # the probes build the model on the device, then wrap it (validate/probe.py)
    mem = estimate_memory(train, cluster, spec["strategy"], device=device, backend=backend,
                          gpu_name=spec.get("gpu_name"), init="device")
    out = {k: int(mem.components[k]) for k in COMPONENTS}
    out.update(workspace=int(mem.workspace), peak_allocated=int(mem.peak_allocated), peak_phase=mem.peak_phase)
    if device == "cuda":
        out["peak_reserved"] = int(mem.peak_reserved)
    collectives = [{"op": c.op, "group_size": c.group_size, "dtype": c.dtype,
                    "message_bytes": int(c.message_bytes), "calls": int(c.calls)}
                   for c in collective_schedule(train, cluster, spec["strategy"])]
    step = bound = None
    if device == "cuda" and mode in ("gpu", "fake") and spec.get("gpu_name"):
        # Timed on GPUs only: predicted for the catalog GPU the device name maps to. On the fake process
        # group the collectives return at once: the step without its exposed communication.
        from .hardware import catalog_name
        cat = catalog_name(spec["gpu_name"])
        if cat:
            from .kernels import step_bound
            cl = replace(cluster, gpu_name=cat)
            gpu = _gpu(cat)
            st = step_time(train, cl, spec["strategy"], collective_schedule(train, cl, spec["strategy"]), gpu)
            step = st.step_time_s - (st.exposed_comm_s if mode == "fake" else 0.0)
            bound = step_bound(train, gpu, get_strategy(spec["strategy"]).family)
    return {"memory": out, "collectives": collectives, "step_time_s": step, "step_time_bound": bound}
