"""The planner's public API: resolve inputs, evaluate every strategy, recommend one.

    from distplan.planner import plan
    p = plan(params="7B", gpus=8, gpu_mem=80)
    p.best.name, p["fsdp"].memory.peak_allocated, p.to_dict()

Everything here is pure Python (no torch); the catalog is read lazily on first use. Invalid arguments
raise `ValueError` naming the argument, the value and what is accepted.

The top of the plan layer: the inputs (resolve.py), one strategy's prediction (strategy_result.py), the
Plan and its recommendation (plan_result.py, recommend.py), the layout search (layout.py) and the trace
front end (module_plan.py) are below it; the command line (cli.py, from_flags.py) above.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from .allocator import parse_alloc_conf
from .caches import clear_caches
from .checkpoint import DEFAULT_STORAGE_GBPS, MODES
from .comm_schedule import collective_schedule
from .compute import _gpu, step_time
from .config import PP_SCHEDULES, Cluster, TrainConfig, check_tp, torch_release
from .cp import check_cp
from .front_end import FRONT_ENDS, unread_model_type, analytic_only, check_flags, check_traceable, use_trace
from .hardware import catalog_name
from .hf_config import SUPPORTED_MODEL_TYPES
from .kernels import step_bound
from .layout import search_with_changes
from .ranking import HEADROOM_FRACTION
from .memory import COMPONENTS, estimate_memory
from .model import ModelSpec
from .plan_result import Plan
from .pp import PP_STRATEGIES, check_pp, predict_pp_probe
from .resolve import (DEFAULT_GPU, NEAREST_MODEL_MATCH, _OVERRIDE_FIELDS, catalog_dirs_tuple,
                      check_spec_bounds, nearest_model, resolve_cluster, resolve_model, scaled_llama)
from .strategies import NAMES, get_strategy
from .strategy_result import StrategyResult, drop_conflicts, evaluate
from .trace_check import TraceCheck, dp_only, search_note
from .units import check_count, check_float, parse_count, parse_headroom, short_repr
from .workload.limits import user_code_limits

__all__ = ["DEFAULT_GPU", "NEAREST_MODEL_MATCH", "Plan", "StrategyResult", "catalog_dirs_tuple", "check_spec_bounds",
           "clear_caches", "drop_conflicts", "evaluate", "nearest_model", "plan", "predict_probe", "recommend",
           "resolve_cluster", "resolve_model", "scaled_llama", "search_plan", "traced_plan"]


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


def _plan_by_trace(strategies, kw: dict):
    """`plan(front_end="trace"|"auto")`: the trace front end's plan of `kw` (plan's arguments by the CLI's
    names) where it plans it (front_end.use_trace), else None (the analytic front end plans it)."""
    front_end, hf_config = kw["front_end"], kw["hf_config"]
    if front_end not in FRONT_ENDS:
        raise ValueError(f"--front-end={short_repr(front_end)}: accepted: {', '.join(FRONT_ENDS)}")
    if hf_config is None:
        raise ValueError(f"--front-end={front_end}: the trace front end reads a Hugging Face model; give "
                         f"hf_config (a config.json, its folder or a Hub id)")
    if not use_trace(kw):
        return None
    if isinstance(strategies, str):
        strategies = [strategies]
    return traced_plan(kw, check_flags(kw, list(strategies or ())))


def _checked_strategies_and_tokens(strategies, tokens) -> tuple:
    """`plan`'s `strategies` as a list of names (one name alone too) and `tokens` as a count: one-line
    ValueErrors for anything else."""
    if isinstance(strategies, str):
        strategies = [strategies]
    if strategies is not None and not isinstance(strategies, (list, tuple, set, frozenset)):
        raise ValueError(f"strategies={short_repr(strategies)}: accepted: a list of names from "
                         f"{', '.join(NAMES)}")
    if strategies is not None:  # one row per strategy, in the order given
        strategies = list(dict.fromkeys(strategies)) if all(isinstance(s, str) for s in strategies) else strategies
    if tokens is not None:
        if isinstance(tokens, str):
            tokens = parse_count(tokens, "--tokens")
        check_float("tokens", tokens, 1, 1e16, "tokens", "a positive count")
    return strategies, tokens


def _checked_tp(tp, sequence_parallel, spec: ModelSpec, cluster: Cluster, framework: str) -> int:
    """The tensor-parallel degree, checked with sequence parallelism against the model and the nodes."""
    tp = check_count("tp", tp)
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"--sequence-parallel={short_repr(sequence_parallel)}: accepted: True or False")
    if sequence_parallel and tp == 1:
        raise ValueError("--sequence-parallel: needs --tp > 1 (it shards along the tensor-parallel group)")
    if tp > 1:
        check_tp(tp, spec, "--tp", cluster.gpus, cluster.local_size)
        if framework != "pytorch":
            raise ValueError(f"--tp={tp} with --framework={short_repr(framework)}: tensor parallelism is "
                             f"modelled for PyTorch's parallelize_module; accepted: --framework pytorch")
    return tp


def _checked_pipeline(asked: _PPCheck, cluster: Cluster, tp: int, notes: list) -> tuple[int, int]:
    """(pipeline stages, micro-batches per step) of `asked`, checked (pp.check_pp); the micro-batches
    assumed when not given are added to `notes`."""
    spec, pp, pp_schedule, pp_microbatches = asked.model, asked.pp, asked.pp_schedule, asked.pp_microbatches
    pp = check_count("pp", pp)
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
        check_pp(replace(asked, pp=pp, pp_microbatches=pp_microbatches), "--pp")
    return pp, pp_microbatches


def _checked_cp(cp, asked: _CPCheck, cluster: Cluster, strategies, notes: list) -> int:
    """The context-parallel degree, checked (cp.check_cp) against the strategies asked for; its note added
    to `notes`."""
    cp = check_count("cp", cp)
    if cp > 1:
        check_cp(cp, asked, cluster.gpus)
        if strategies and [n for n in NAMES if not get_strategy(n).distributed and n in strategies]:
            raise ValueError(f"--strategy=single with --cp={cp}: the cp ranks' gradients must be averaged; "
                             f"accepted: a data-parallel strategy ({', '.join(n for n in NAMES if get_strategy(n).distributed)})")
        notes.append(f"context parallel: each sequence split over {cp} ranks ({asked.seq_len // cp} tokens each), "
                     f"ring attention; the strategies run over the dp x cp ranks")
    return cp


def _strategy_names(strategies, dp: int, pp: int, optimizer: str, framework: str) -> tuple[list, list]:
    """(the strategies to plan, notes): those asked for, or every one that runs over `dp` data-parallel
    ranks (x cp) and `pp` stages, less those the optimizer rules out (drop_conflicts)."""
    if pp > 1:
        bad = [n for n in (strategies or ()) if n not in PP_STRATEGIES]
        if bad:
            raise ValueError(f"--strategy={short_repr(bad[0])} with --pp={pp}: PipelineStage drives DDP and FSDP2 "
                             f"(fully_shard) only; accepted: {', '.join(PP_STRATEGIES)}")
    names = list(strategies) if strategies else [n for n in NAMES if (get_strategy(n).distributed or dp == 1)
                                                 and (pp == 1 or n in PP_STRATEGIES)]
    if dp == 1 and not strategies:
        names = ["single"]
    return drop_conflicts(names, optimizer, bool(strategies), framework)


def _storage_bytes_per_s(checkpoint: str | None, storage_gbps: float | None) -> float | None:
    """The checkpoint save's write bandwidth per writing rank, bytes/s (None without a save)."""
    storage = None
    if checkpoint is not None:
        if checkpoint not in MODES:
            raise ValueError(f"--checkpoint={short_repr(checkpoint)}: accepted: {', '.join(MODES)}")
        storage = check_float("storage_gbps", DEFAULT_STORAGE_GBPS if storage_gbps is None else storage_gbps,
                              1e-3, 1e5, "GB/s", "1 MB/s to 100 TB/s per writing rank") * 1e9
    elif storage_gbps is not None:
        raise ValueError("--storage-gbps: needs --checkpoint full|full-offload|sharded")
    return storage


def _analytic_front_end_note(hf_config, layout_kw: dict) -> str:
    """The note naming the analytic front end, and with --hf-config why the trace did not plan it."""
    layout_flag = analytic_only(layout_kw)
    return ("front end: analytic (decoder formulas" + (
        ")" if not hf_config else
        f", as transformers implements this model: the trace does not follow {layout_flag.split('=')[0]})"
        if layout_flag else "; --front-end trace runs the transformers model itself on fake tensors)"))


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
         front_end: str = "analytic", headroom: str | float | None = None, **overrides) -> Plan:
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
        headroom: the GPU memory the recommendation must leave free, a fraction (0.05) or a percent
            ("5%"), default ranking.HEADROOM_FRACTION; where nothing fitting leaves it, the pick is the one
            that fits and `recommendation.warning` says so.
        overrides: layers, hidden, heads, kv_heads, ffn_hidden, vocab, tie_embeddings.
    """
    for name, flag in (("comm", comm), ("detect_local", detect_local)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name}={short_repr(flag)}: accepted: True or False")
    headroom = HEADROOM_FRACTION if headroom is None else parse_headroom(headroom)
    catalog_dirs = catalog_dirs_tuple(catalog_dirs)
    if front_end != "analytic":
        traced = _plan_by_trace(strategies, dict(
            overrides, model=model, params=params, hf_config=hf_config, front_end=front_end, gpus=gpus,
            gpus_per_node=gpus_per_node, gpu=gpu, gpu_mem=gpu_mem, node=node, intra=intra, inter=inter,
            nics_per_node=nics_per_node, inter_gbps=inter_gbps, seq_len=seq_len, micro_batch=micro_batch,
            grad_accum=grad_accum, grad_sync=grad_sync, precision=precision, optimizer=optimizer,
            optimizer_impl=optimizer_impl, activation_checkpointing=activation_checkpointing,
            attention=attention, attention_kernel=attention_kernel, cpu_offload=cpu_offload,
            framework=framework, compile_=compile,
            alloc_conf=alloc_conf, torch_version=torch_version, tp=tp, pp=pp, cp=cp,
            sequence_parallel=sequence_parallel, checkpoint=checkpoint, storage_gbps=storage_gbps,
            tokens=tokens, catalog_dirs=catalog_dirs, detect_local=detect_local, headroom=headroom))
        if traced is not None:
            return traced
    seq_len, micro_batch, grad_accum = (check_count(k, v) for k, v in (
        ("seq_len", seq_len), ("micro_batch", micro_batch), ("grad_accum", grad_accum)))
    strategies, tokens = _checked_strategies_and_tokens(strategies, tokens)
    unknown = set(overrides) - set(_OVERRIDE_FIELDS)
    if unknown:
        raise ValueError(f"unknown argument(s) {', '.join(sorted(unknown))}; model overrides accepted: "
                         + ", ".join(_OVERRIDE_FIELDS))
    spec, notes = resolve_model(model if not isinstance(model, ModelSpec) else model, params, hf_config,
                                overrides, catalog_dirs)
    cluster, cnotes = resolve_cluster(gpus, gpus_per_node, gpu, gpu_mem, node, intra, inter, nics_per_node,
                                      inter_gbps, detect_local, catalog_dirs)
    tp = _checked_tp(tp, sequence_parallel, spec, cluster, framework)
    if torch_version:
        torch_release(torch_version, "--torch-version")  # one line naming the flag, before anything runs
    if alloc_conf:
        if not isinstance(alloc_conf, str):
            raise ValueError(f"--alloc-conf={short_repr(alloc_conf)}: accepted: a PYTORCH_CUDA_ALLOC_CONF string")
        notes = notes + parse_alloc_conf(alloc_conf, "--alloc-conf")[2]
    pp, pp_microbatches = _checked_pipeline(_PPCheck(spec, grad_accum, framework, pp, pp_schedule, pp_microbatches,
                                                     cpu_offload, activation_checkpointing), cluster, tp, notes)
    cp = _checked_cp(cp, _CPCheck(seq_len, attention, framework, pp, tp), cluster, strategies, notes)
    train = TrainConfig(spec, seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum,
                        grad_sync=grad_sync, precision=precision, optimizer=optimizer, optimizer_impl=optimizer_impl,
                        checkpointing=activation_checkpointing, attention=attention,
                        attention_kernel=attention_kernel,
                        cpu_offload=cpu_offload, framework=framework, compile=compile, tp=tp,
                        sequence_parallel=sequence_parallel, alloc_conf=alloc_conf, pp=pp,
                        pp_schedule=pp_schedule, pp_microbatches=pp_microbatches, cp=cp,
                        torch_version=torch_version)
    names, conflicts = _strategy_names(strategies, cluster.gpus // (tp * pp), pp, optimizer, framework)
    notes = notes + conflicts
    storage = _storage_bytes_per_s(checkpoint, storage_gbps)
    results = [evaluate(train, cluster, get_strategy(n), comm=comm, catalog_dirs=catalog_dirs,
                        checkpoint=checkpoint, storage_bytes_per_s=storage) for n in names]
    if tokens is not None and not tokens > 0:
        raise ValueError(f"tokens={short_repr(tokens)}: must be positive")
    front = _analytic_front_end_note(hf_config, {"tp": tp, "pp": pp, "cp": cp, "sequence_parallel": sequence_parallel,
                                                 "checkpoint": checkpoint, "storage_gbps": storage_gbps})
    if spec.attn_softcap:
        notes.append("attention: eager, as transformers runs Gemma-2 by default (no SDPA path: SDPA cannot "
                     "soft-cap the scores), keeping B x heads x S^2 scores per layer; flash_attention_2 (the "
                     "flash-attn package) soft-caps without them and is not modelled")
    return Plan(train, cluster, results, notes + cnotes + [front], tokens, checkpoint, storage, headroom=headroom)


def traced_plan(kw: dict, strategies: list[str]):
    """The trace front end's plan (module_plan.ModulePlan) of the flags in `kw` and the strategy names
    `strategies`, both already checked (front_end.check_flags): `plan(front_end="trace")`, `--module`."""
    check_traceable(kw)
    from .module_plan import module_spec_plan  # lazy: the trace front end imports json and torch's tracer
    with user_code_limits(kw.get("timeout_s")):  # --module's code: in a child, bounded (workload/isolated.py)
        return module_spec_plan(kw, strategies)


def recommend(model: str | ModelSpec | None = None, *, tp: int | None = None, pp: int | None = None,
              sequence_parallel: bool | None = None, front_end: str = "analytic", **kwargs) -> Plan:
    """`plan` and its recommendation, searching the parallel layout over what is not given.

    With `tp` and `pp` both given this is `plan(...)` (the strategy choice at that mesh). Otherwise the
    unfixed dimensions are searched (layout.py): tp inside a node, pp, and sequence parallelism unless
    `sequence_parallel` is given; every layout at the global batch the arguments give. The Plan returned
    is the picked layout's (every strategy evaluated there), with `.search` and
    `.recommendation.layout`; when no layout fits it is the plan as given, and the recommendation says
    what the closest layout needs. Every layout is judged by the analytic front end whatever `front_end`
    says, so that the answer does not depend on what is installed; with `hf_config` and the trace front end
    ("trace", or "auto" with torch and transformers) the data-parallel layout is also planned by the trace,
    as a check (`.search.trace`, trace_check.py). A model the analytic front end does not read is planned by
    the trace at data parallelism only, unsearched. Other arguments: as `plan`.

        p = recommend("llama-3-405b", gpus=256, node="dgx-h100", seq_len=8192)
        p.recommendation.layout, p.recommendation.strategy, p.best.memory.device_total
    """
    if tp is not None and pp is not None:
        return plan(model, tp=tp, pp=pp, sequence_parallel=bool(sequence_parallel), front_end=front_end, **kwargs)
    if sequence_parallel is not None and not isinstance(sequence_parallel, bool):
        raise ValueError(f"--sequence-parallel={short_repr(sequence_parallel)}: accepted: True or False")
    kwargs.pop("comm", None)  # the search compares step times: always timed
    sp_given = bool(sequence_parallel) and tp is not None
    hf_config = kwargs.get("hf_config")
    fixed = dict(hf_config=hf_config, front_end=front_end, tp=tp, pp=pp, cp=kwargs.get("cp"),
                 sequence_parallel=sp_given, checkpoint=kwargs.get("checkpoint"), storage_gbps=kwargs.get("storage_gbps"),
                 attention_kernel=kwargs.get("attention_kernel"))
    traced = _trace_checks_search(fixed)
    unread = unread_model_type(hf_config) if traced else None
    if unread is not None:  # the trace alone: data parallelism, no search
        p = plan(model, tp=1, pp=1, front_end=front_end, **kwargs)
        p.notes.append(f"layout: not searched: the search judges tp, pp and cp by the analytic front end, which does "
                       f"not read model_type {unread!r} (it reads {', '.join(SUPPORTED_MODEL_TYPES)}); the trace "
                       f"planned data parallelism over all {p.cluster.gpus} GPUs")
        return p
    given = plan(model, tp=tp or 1, pp=pp or 1, sequence_parallel=sp_given, **kwargs)
    out = search_plan(given, fixed_tp=tp, fixed_pp=pp, fixed_sp=sequence_parallel,
                      strategies=kwargs.get("strategies"))
    flag = analytic_only(fixed)
    why_not = f"{flag} given: the trace, which does not follow it, checks no layout" if flag else None
    if traced:
        out.search.trace = _trace_check(out.search, model, kwargs)
        if out.search.trace is None:
            why_not = "no layout searched is data-parallel only (the one the trace models): the trace did not run"
    out.notes[:] = [n for n in out.notes if not n.startswith("front end: ")] + [
        search_note(hf_config, out.search.trace, why_not)]
    return out


def _trace_checks_search(fixed: dict) -> bool:
    """Whether the trace front end checks a layout search of `fixed` (the front end, --hf-config and the
    mesh flags given): `use_trace`'s rule; --front-end trace with a flag only the analytic front end
    models is the one-line error `plan` gives."""
    front_end = fixed["front_end"]
    if front_end not in FRONT_ENDS:
        raise ValueError(f"--front-end={short_repr(front_end)}: accepted: {', '.join(FRONT_ENDS)}")
    if front_end == "analytic":
        return False
    if fixed["hf_config"] is None:
        raise ValueError(f"--front-end={front_end}: the trace front end reads a Hugging Face model; give "
                         f"hf_config (a config.json, its folder or a Hub id)")
    if front_end == "trace":
        check_traceable(fixed)
    return use_trace(fixed)


def _trace_check(search, model, kwargs: dict):
    """trace_check.TraceCheck of `search`: its data-parallel layout (micro-batch, micro-steps, checkpointing
    as the search ran it) planned by the trace front end; None when it searched no such layout."""
    cand = dp_only(search)
    if cand is None:
        return None
    t = cand.train
    kw = dict(kwargs, cp=1, micro_batch=t.micro_batch, grad_accum=t.grad_accum,
              activation_checkpointing=t.checkpointing, strategies=[r.name for r in cand.results])
    traced = plan(model, tp=1, pp=1, sequence_parallel=False, front_end="trace", **kw)
    return TraceCheck.of(search, traced.results, traced.profile_s)


def search_plan(given: Plan, *, fixed_tp: int | None = None, fixed_pp: int | None = None,
                fixed_sp: bool | None = None, strategies=None) -> Plan:
    """The layout search over `given`'s model, cluster and global batch (layout.py): the picked layout's
    Plan with `.search` set, or `given` with `.search` set when nothing fits in any layout."""
    if isinstance(strategies, str):
        strategies = [strategies]
    c = given.cluster
    s = search_with_changes(given.train, c, list(strategies) if strategies else None, fixed_tp=fixed_tp,
                            fixed_pp=fixed_pp, fixed_sp=fixed_sp, checkpoint=given.checkpoint,
                            storage_bytes_per_s=given.storage_bytes_per_s, catalog_dirs=c.catalog_dirs,
                            headroom=given.headroom)
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
    return Plan(cand.train, c, results, notes, given.tokens, given.checkpoint, given.storage_bytes_per_s, search=s,
                headroom=given.headroom)


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
        from .module_prediction import predict_module_probe  # lazy: the trace front end imports json and torch's tracer
        return predict_module_probe(spec)
    if int(spec.get("pp", 1)) > 1:  # a pipeline probe (validate/pp_probe.py): its most loaded rank
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
        cat = catalog_name(spec["gpu_name"])
        if cat:
            cl = replace(cluster, gpu_name=cat)
            gpu = _gpu(cat)
            st = step_time(train, cl, spec["strategy"], collective_schedule(train, cl, spec["strategy"]), gpu)
            step = st.step_time_s - (st.exposed_comm_s if mode == "fake" else 0.0)
            bound = step_bound(train, gpu, get_strategy(spec["strategy"]).family)
    return {"memory": out, "collectives": collectives, "step_time_s": step, "step_time_bound": bound}
