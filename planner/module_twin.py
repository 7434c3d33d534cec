"""The analytic twin of a traced Hugging Face model: the analytic front end's estimate of the same run, whose
allocator replay gives the trace its reserved peak and whose time model its step time; module_plan.py."""

from __future__ import annotations

from dataclasses import replace

from .compute import step_time
from .config import Cluster, TrainConfig, checkpoint_every
from .memory import MemoryEstimate, estimate_memory
from .module_desc import ModuleDesc, ModuleTime, _shard_group
from .resolve import resolve_model
from .strategies import get_strategy


TWIN_TOLERANCE = 0.02
"""The trace's allocated peak and the analytic front end's must agree within this fraction for the trace to
take the analytic replay's cached-but-free bytes (they agree within 1% for the model types the analytic
front end reads, tests/test_analytic_vs_trace.py, README "Measured accuracy")."""


def analytic_twins(kw: dict, cluster: Cluster, device: str = "cuda", backend: str = "nccl", init: str = "meta"):
    """(twin, None), twin(strategy, batch) -> the analytic front end's MemoryEstimate of the run `kw` plans
    with the trace (the same config.json, layers, precision, optimizer, checkpointing, accumulation, alloc
    conf) at `batch` sequences; or (None, why) where the analytic front end does not read the config or
    does not model the checkpointing. `device`, `backend`, `init` as memory.estimate_memory's; on the CPU
    (the probes' check, tests/test_alloc_trace.py) the replay is of the CPU run, which a plan never makes."""
    ckpt = kw.get("activation_checkpointing") or "none"
    try:
        spec, _ = resolve_model(hf_config=kw["hf_config"], overrides={"layers": kw.get("layers")},
                                catalog_dirs=tuple(kw.get("catalog_dirs") or ()))
    except ValueError as exc:  # a model_type it does not describe: the message names the ones it does
        return None, "this model_type (the analytic front end reads " + str(exc).split("accepted: ")[-1] + ")"
    base = TrainConfig(spec, seq_len=kw.get("seq_len") or 2048, micro_batch=kw.get("micro_batch") or 1,
                       grad_accum=kw.get("grad_accum") or 1, grad_sync=kw.get("grad_sync") or "last",
                       precision=kw.get("precision") or "bf16-mixed", optimizer=kw.get("optimizer") or "adamw",
                       optimizer_impl=kw.get("optimizer_impl") or "foreach",
                       # the trace plans selective (and selective-op) as none
                       checkpointing=ckpt if checkpoint_every(ckpt) else "none",
                       alloc_conf=kw.get("alloc_conf") or "", torch_version=kw.get("torch_version") or "",
                       compile=bool(kw.get("compile") or kw.get("compile_")), attention=kw.get("attention") or "sdpa")
    cache: dict = {}

    def twin(strategy: str, batch: int):
        key = (strategy, batch)
        if key not in cache:
            t = replace(base, micro_batch=batch)
            mem = cache[key] = estimate_memory(t, cluster, strategy, device=device, backend=backend, init=init)
            if device != "cuda":
                st = get_strategy(strategy)
                mem.reserved_replay = (t, st.name, *_shard_group(st, cluster), device, backend, 0, False, init, None)
        return cache[key]
    twin.train = base
    return twin, None


def twin_time(twin, strategy: str, batch: int, cluster: Cluster) -> ModuleTime | None:
    """The step time of the analytic twin's run (`compute.step_time`: the per-kernel model, one time model
    for both front ends) as a ModuleTime; None where that model does not take the run."""
    try:
        t = step_time(replace(twin.train, micro_batch=batch), cluster, strategy)
    except (ValueError, KeyError):
        return None
    return ModuleTime(t.compute_s, t.comm_s, t.exposed_comm_s, t.step_time_s, t.tokens_per_s, t.mfu, t.optimizer_s,
                      t.overhead_s)


def pair_tied(mem: MemoryEstimate, desc: ModuleDesc, analytic: MemoryEstimate) -> None:
    """A model with tied embeddings takes the analytic replay's pairing (`pair_reserved`) before its own run's:
    the module writers do not write what the analytic writer does for a tied weight (the LM head transformers
    makes and drops, the tied weight's gradients at the embedding's backward), and against the recorded CPU
    probes of tied models (tests/data/alloc_events_cpu_tied_bf16.json.gz; Qwen2.5-0.5B at its real vocabulary)
    the own run read -11.1% to +8.2% where the pairing read within 0.7% (tests/test_hf_reserved.py)."""
    if desc.tied and mem.reserved_replay is not None:
        events, mem.reserved_replay = mem.reserved_replay, None
        if not pair_reserved(mem, analytic):
            mem.reserved_replay = events


def pair_reserved(mem: MemoryEstimate, analytic: MemoryEstimate) -> bool:
    """Give the trace's estimate `mem` the reserved peak of the analytic one's replay (memory.MemoryEstimate
    `reserved_from`) where that replay exists and the two allocated peaks agree within TWIN_TOLERANCE, and
    the trace's own run is not written (`mem.reserved_replay`: that replay is the one printed)."""
    if analytic.reserved_replay is None or mem.reserved_replay is not None:
        return False
    if abs(analytic.peak_allocated - mem.peak_allocated) > TWIN_TOLERANCE * mem.peak_allocated:
        return False
    mem.reserved_from = analytic
    return True
