"""The trace front end: plan a model from one step run on fake tensors (`--module pkg.mod:factory
--input-shape 128,1,28,28`, and `--hf-config PATH` with transformers installed).

The analytic planner (`memory.py`, `comm.py`) describes a decoder by formula. Here the description is
measured instead (`ModuleDesc`): the parameter shapes grouped into wrapping units (a module's direct
children that own parameters, as an FSDP auto-wrap policy on direct children gives them; a Hugging Face
causal LM's decoder layers; parameters of no unit form the `root` unit), and the forward as segments in
execution order, each with the bytes autograd saves and the bytes of its input, what its forward and
backward hold instant by instant, and the order gradients become ready. They come from
`distplan.planner.workload.trace.profile` (`planner/workload/traced_model.py` says how each kind of model is built,
fed and trained), which runs one training step on fake tensors (torch is imported lazily; nothing is
allocated); a deep transformers model is traced at a few layers and its middle layer repeated.

`estimate_module_memory` then walks the same phases as `memory.estimate_memory`, per family:

- single/ddp/zero1: full parameters and gradients; DDP buckets the size of all gradients (allocated at
  construction, `reducer.cpp`); zero1's optimizer state by ZeroRedundancyOptimizer's greedy partition
  (largest tensor first to the least loaded rank; the most loaded rank reported).
- fsdp2 (zero2, zero3): each parameter sharded on dim 0, padded to the shard group; fsdp1 (fsdp,
  fsdp-grad-op, hsdp, fsdp-no-shard): one flat parameter per unit, padded. The unit in use is unsharded
  (in the compute dtype under mixed precision), the next one prefetched when resharding; its unsharded
  gradient and the reduce-scatter input (fp32 under mixed precision) coexist; the root unit stays
  unsharded from forward to the end of backward.
- forward, segment by segment: the earlier segments' saved tensors plus what the profile measured the
  segment's forward to hold at its peak (its saved tensors so far, its input, intermediates such as a
  residual block's two branches before their sum). FSDP2 keeps the current unit's all-gather output
  beside its copied-out parameters (`FSDPParamGroup.wait_for_unshard`).
- backward, segment by segment from the last, at the instants the profile measured as the segment's
  peaks on fake tensors, before and after the gradient of its unit's output is ready (where FSDP's
  pre-backward hook runs): the earlier segments' saved tensors, its own not yet freed, the gradients of
  every unit already reached, its own parameters' gradients made so far, and the activation gradients
  alive (a conv -> ReLU -> pool segment holds the pool's and the ReLU's input gradients at once). FSDP2
  with resharding: before the hook the unit's parameters are still the all-gather output the unit after
  it prefetched; the hook copies them out and prefetches the unit before. A sharded unit's
  reduce-scatter comes after its segment's backward: its saved tensors and its output's gradient are
  gone by then. FSDP2 (`foreach_reduce`): the unsharded gradients and the reduce-scatter input, then,
  the gradients freed, the input, the output and (gloo) the collective's copy of the input.
- temporaries: the input batch throughout (what the probes' tracker calls it too); the output and its
  gradient around the loss; at the optimizer step the foreach intermediate (one tensor the size of the
  rank's parameters, `_multi_tensor_adam`'s exp_avg_sq_sqrt).
- CUDA: two cuBLAS workspaces, cuBLASLt's when a Linear has a bias, and each convolution's cuDNN
  workspace at the instant it runs (forward or backward, with what the profile saw alive then). The
  cuDNN sizes come from the kernel cuDNN picks, so they are measured on the local GPU
  (`planner/workload/kernel_workspace.py`); planned without a GPU, they are left out and a note says so.
- activation checkpointing `full` (per unit, non-reentrant; transformers' own for an HF model): each
  unit keeps its input, and the root's ops after it (a decoder's final norm, head and loss) keep what
  they save; a unit's own saved tensors come back in its backward, after its hook, as temporaries (made
  in the backward phase), as many as the traced run held at that instant. `selective` is not defined for
  an arbitrary module: treated as `none`, with a note.

The reserved peak (`max_memory_reserved`): single, DDP and ZeRO-1 runs of a `--module` replay the traced
step's own allocations through the caching allocator (`ModuleDesc.alloc_log`, in host order, with the cuDNN
workspaces measured on the GPU; `logged_module_events`, alloc_trace.logged_step_events); a Hugging Face
model takes the analytic front end's replay of the same run (`pair_reserved`); FSDP runs of a `--module`
keep memory.RESERVED_MARGIN.

Collectives follow `comm.py`'s schedules with the units' real sizes, plus DDP's broadcast of the
module's buffers (BatchNorm statistics) once per step. The step time of a Hugging Face model the analytic
front end reads is the analytic twin's (`compute.step_time`, the per-kernel model: one time model for both
front ends); otherwise that of the kernels the traced step launched (`ModuleDesc.census`, counted by the
trace: every ATen op of the forward and the backward that is not a view, by FLOPs for GEMMs, convolutions
and fused attention, by bytes moved for the rest, with the launch and host costs `kernels.py` uses; the
checkpointed units' forward again in backward), plus the optimizer step and the communication that backward
or forward compute cannot hide. On the models both front ends read the two compute times agree within 10%
(tests/test_census.py). For `--module` a "token" in `tokens_per_s` is one sample (one row of the batch
dimension).

Known limitations: activations and outputs scale linearly with the batch (used for the largest batch
that fits; cuDNN workspaces are only known at the measured batch); a traced model's step time is of its
eager kernels (torch.compile's fusion is not modelled for it), and where the CPU trace ran SDPA's math
composite (dropout_p > 0) CUDA runs one fused kernel; `--micro-batch` and `--seq-len` are ignored (the
batch is the input shape's first dimension); CPU offload and `--framework deepspeed` are not supported here.

FSDP under 16-bit mixed precision is traced as it runs (workload.trace's "fsdp-*" and "fsdp1-*" regimes): the
root casts the fp32 batch to 16 bits; FSDP1 wraps each BatchNorm module apart and runs it in fp32
(`MixedPrecision._module_classes_to_ignore`: its own units, `ModuleDesc.fp32_units`, fp32 all-gathers);
FSDP2 with BatchNorm raises in PyTorch (16-bit weights, fp32 running statistics), so `estimate` leaves
zero2 and zero3 out with the reason and `validate` predicts the error (`fsdp2_batchnorm_failure`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from math import prod

from distplan.catalog.loader import load_catalog
from distplan.planner.workload import kernel_workspace
from distplan.planner.workload.trace import profile
from distplan.planner.workload.traced_model import FactoryWorkload, HFWorkload, from_spec, hf_path, parse_shape, preload

from .front_end import BACKEND, planned_device, target_line
from .config import CHECKPOINTING, Cluster, GRAD_SYNC, checkpoint_every
from .hf_config import read_hf_config
from .memory import MemoryEstimate, RESERVED_MARGIN
from .module_desc import (ModuleDesc, ModuleModel, ModuleTrain, _desc_for, _regime,
                          _shard_group, fsdp2_batchnorm_failure)
from .module_memory import fsdp2_padding_note, logged_module_events, walk_module_memory
from .module_step import census_seconds, module_collectives, module_time, traced_compute
from .module_twin import TWIN_TOLERANCE, analytic_twins, pair_reserved, pair_tied, twin_time
from .plan_result import Plan
from .precision import OPTIMIZERS, OPTIMIZER_IMPLS, PRECISIONS, get_precision
from .accuracy import band_key, error_band
from .ranking import HEADROOM_FRACTION, TIE_FRACTION, _headroom_ok, _rank, headroom_warning
from .recommend import Recommendation, _reasons
from .resolve import resolve_cluster
from .strategies import NAMES, Strategy, get_strategy
from .strategy_result import StrategyResult, drop_conflicts
from .units import fmt_count, fmt_gib, parse_headroom


# what the trace front end offers, here and from the modules it is split into (module_desc, module_step,
# module_memory, module_twin)
__all__ = ["ModuleDesc", "ModuleModel", "ModulePlan", "ModuleTrain", "analytic_twins", "census_seconds",
           "check_hf_config", "estimate_module_memory", "fsdp2_batchnorm_failure", "kernel_workspaces",
           "logged_module_events", "module_collectives", "module_spec_plan", "module_time", "pair_tied",
           "probe_kernel_workspaces", "traced_compute", "twin_time"]


_TRACE_SNAPSHOTS: list | None = None
"""Set to a list to receive every Snapshot of the next `estimate_module_memory` walk (debugging)."""


def estimate_module_memory(desc: ModuleDesc, train: ModuleTrain, cluster: Cluster,
                           strategy: str | Strategy, device: str = "cuda", backend: str = "nccl",
                           workspaces: dict | None = None, rank: int | None = None,
                           init: str = "device") -> MemoryEstimate:
    """Most loaded rank's memory of one strategy for a measured module (module_memory.walk_module_memory,
    which says what each argument does); every Snapshot of the walk into `_TRACE_SNAPSHOTS` when it is a list."""
    return walk_module_memory(desc, train, cluster, strategy, device, backend, workspaces, rank, init,
                              snapshots=_TRACE_SNAPSHOTS)


# -- the plan ----------------------------------------------------------------------------------

@dataclass
class ModulePlan(Plan):
    """A Plan whose model is a measured nn.Module (`desc`); renders like a decoder plan."""

    desc: ModuleDesc | None = None
    descs: dict = field(default_factory=dict)
    """ModuleDesc per strategy family regime (mixed precision measures fp32+autocast and 16-bit)."""
    profile_s: float = 0.0
    workspaces: dict = field(default_factory=dict)
    """cuDNN workspace per convolution call, measured on the local GPU ({} without one)."""
    kw: dict | None = None
    """The options the plan was made from (`module_spec_plan`'s `kw`): the recommendation re-plans with a
    change (activation checkpointing) when nothing fits."""
    twin: object = None
    """A Hugging Face model the analytic front end also reads: `twin(strategy, batch)`, the analytic
    estimate of the same run at `batch` sequences (analytic_twins), whose replay gives the reserved
    peak; None otherwise."""

    def header_lines(self) -> list[str]:
        t, c, d = self.train, self.cluster, self.desc
        n = d.param_count()
        units = ", ".join(_unit_runs(d.units))
        return [
            f"model: {d.name}: {n:,} params ({fmt_count(n)}); wrapping units: {units}",
            f"training: input {'x'.join(map(str, t.input_shape))} per GPU"
            f"{' (sequences x tokens)' if t.tokens_per_sample > 1 else ''} x accum {t.grad_accum}"
            + (f" (gradients reduced {'every micro-step' if t.sync_every else 'on the last micro-step'})"
               if t.grad_accum > 1 else "") + ", "
            f"{t.precision}, {t.optimizer} ({t.optimizer_impl}), checkpointing {t.checkpointing}; "
            f"measured on fake tensors in {self.profile_s:.2f} s",
            f"cluster: {c.gpus} x {c.gpu_name} ({c.gpu_memory_bytes / 2**30:.2f} GiB) in {c.nodes} node(s) of "
            f"{c.gpus_per_node}; intra {c.intra_link}, inter {c.inter_link} x {c.nics_per_node}",
            target_line(self.device),
        ] + [f"note: {x}" for x in self.notes]

    @property
    def recommendation(self):
        return module_recommend(self)

    @property
    def error_front_end(self) -> str:
        hf = bool(self.kw and self.kw.get("hf_config") and not self.kw.get("module"))
        return band_key("trace-hf" if hf else "trace-module", self.device)

    def evaluate_on(self, cluster: Cluster, name: str) -> StrategyResult:
        """The traced workload under strategy `name` on another cluster (Plan.evaluate_on), as the plan's own
        results were made; where the trace's own run is not written, the reserved peak paired with the analytic
        twin's on that cluster."""
        gpu = load_catalog(tuple(cluster.catalog_dirs)).gpu(cluster.gpu_name)
        twin = analytic_twins(self.kw, cluster, self.device, BACKEND[self.device])[0] if self.twin is not None and self.kw else None
        hf = bool(self.kw and self.kw.get("hf_config") and not self.kw.get("module"))
        r = module_result(self.descs, self.train, cluster, name, gpu, self.workspaces, twin, self.desc.batch,
                          "meta" if hf else "device", self.device)
        if twin is not None:
            pair_reserved(r.memory, twin(name, self.desc.batch))
        return r

    def to_dict(self) -> dict:
        rec = self.recommendation
        d = self.desc
        inputs = {"module": self.train.model.factory, "model": self.train.model.to_dict(),
                  "model_params": d.param_count(), "train": self.train.to_dict(),
                  "cluster": self.cluster.to_dict(), "device": self.device, "notes": list(self.notes),
                  "profile": {regime: {"activation_bytes": x.activation_bytes, "output_bytes": x.output_bytes,
                                       "buffers_bytes": x.buffers_bytes, "forward_flops": x.forward_flops,
                                       "segments": [list(s) for s in x.segments]}
                              for regime, x in self.descs.items()}}
        return {"inputs": inputs, "strategies": [r.to_dict() for r in self.results],
                "recommendation": rec.to_dict(), "error_band": error_band(self.error_front_end)}


def _unit_runs(units) -> list[str]:
    """'root 1.05B', '32 x model.layers.N 218M': consecutive units that differ only in their index,
    with equal sizes, as one entry."""
    import re
    out: list = []
    for u, ps in units:
        n = sum(prod(s) for _, s in ps)
        stem = re.sub(r"\.\d+$", ".N", u)
        if out and out[-1][0] == stem and out[-1][1] == n and stem != u:
            out[-1][2] += 1
        else:
            out.append([stem if stem != u else u, n, 1])
    return [f"{c} x {stem} {fmt_count(n)}" if c > 1 else f"{stem if c > 1 else stem} {fmt_count(n)}"
            for stem, n, c in out]


def module_recommend(plan: ModulePlan):
    """recommend.recommend's rule, with the largest batch from the module's linear scaling."""
    results = plan.results
    ok = [r for r in results if _headroom_ok(r, plan.headroom)] or [r for r in results if r.fits_cleanly]

    def fits(name: str, batch: int) -> bool:
        st = get_strategy(name)
        desc = _desc_for(plan.descs, plan.train.precision, st.family).scaled(batch)
        mem = estimate_module_memory(desc, plan.train, plan.cluster, st, workspaces=plan.workspaces)
        if plan.twin is not None and mem.allocated_fits:
            pair_reserved(mem, plan.twin(name, batch))
        return mem.fits_cleanly

    if not ok:
        names = [r.name for r in results]
        change = None
        for b in range(plan.desc.batch - 1, 0, -1):
            hit = next((n for n in names if fits(n, b)), None)
            if hit:
                flag = (f"--micro-batch {b}" if plan.kw and plan.kw.get("hf_config") and not plan.kw.get("module")
                        else f"--input-shape {b},...")
                change = f"use a batch of {b} per GPU with {hit} ({flag}; raise --grad-accum to keep the batch)"
                break
        if change is None:
            change = _checkpointing_change(plan, names)
        first = f"no strategy fits in {fmt_gib(plan.cluster.gpu_memory_bytes)} GiB per GPU"
        return Recommendation(None, [first + (f" as given; smallest change: {change}" if change else "")],
                              None, change or "use more GPUs with a sharded strategy (zero3, fsdp) or larger GPUs")
    timed = all(r.step_time_s for r in ok)
    if timed:
        fastest = min(r.step_time_s for r in ok)
        best = min([r for r in ok if r.step_time_s <= fastest * (1 + TIE_FRACTION)], key=lambda r: _rank(r.name))
    else:
        best = min(ok, key=lambda r: _rank(r.name))
    reasons = _reasons(plan, best, ok, timed)
    if plan.train.tokens_per_sample == 1:
        reasons = [x.replace("tokens/s", "samples/s") for x in reasons]
    lo, hi = plan.desc.batch, plan.desc.batch * 2
    while hi <= 2**20 and fits(best.name, hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(best.name, mid) else (lo, mid)
    return Recommendation(best.name, reasons, lo, warning=headroom_warning(best, plan.headroom))


def _checkpointing_change(plan: ModulePlan, names: list[str]) -> str | None:
    """When nothing fits at any batch: the same workload traced again with full activation checkpointing
    (each wrapping unit recomputed in backward), and the first strategy that fits so, or None."""
    if plan.kw is None or plan.train.checkpointing == "full":
        return None
    try:
        again = module_spec_plan(dict(plan.kw, activation_checkpointing="full"), names)
    except ValueError:
        return None
    fit = [r for r in again.results if r.memory.fits_cleanly]
    if not fit:
        return None
    r = min(fit, key=lambda r: r.memory.device_total)
    return (f"--activation-checkpointing full (about 1/3 more compute; traced so: {r.name} needs "
            f"{fmt_gib(r.memory.device_total)} GiB)")


def _workload_of(kw: dict, strategies) -> tuple:
    """(whether a Hugging Face model, the workload to trace, its input shape, the precision) of
    module_spec_plan's `kw`, its flags checked; torch (and transformers) imported."""
    hf = bool(kw.get("hf_config")) and not kw.get("module")
    factory = kw.get("module")
    shape_text = kw.get("input_shape")
    if not hf and not shape_text:
        raise ValueError(f"--module={factory!r} needs --input-shape, the example input's shape with the batch "
                         f"first, e.g. --input-shape 128,1,28,28")
    for flag in (("model", "params") if hf else ("model", "params", "hf_config")):
        if kw.get(flag):
            raise ValueError(f"--{flag.replace('_', '-')} and --{'hf-config' if hf else 'module'}: give only one model")
    if kw.get("framework", "pytorch") != "pytorch":
        raise ValueError(f"--framework={kw['framework']!r}: the trace plans the PyTorch-native strategies only")
    # torch (and below, for --hf-config, transformers and the model's modules) imported with the garbage
    # collector paused, then frozen: workload.preload says why (a cold --hf-config trace 11 s -> 7.3 s).
    # The traces' profile_s ("measured on fake tensors in") no longer counts transformers' imports.
    try:
        preload()
    except ImportError:
        raise ValueError("--module needs torch: pip install 'distplan[validate]'") from None
    if hf:
        check_hf_config(kw["hf_config"], kw.get("seq_len") or 2048)
        work = HFWorkload(hf_path(kw["hf_config"]), kw.get("micro_batch") or 1, kw.get("seq_len") or 2048,
                          kw.get("layers"), kw.get("attention") or "sdpa")
        preload(work)
        shape = work.input_shape
    else:
        shape = parse_shape(shape_text, "--input-shape")
        work = FactoryWorkload(factory, shape)
    precision = kw.get("precision") or "bf16-mixed"
    for flag, value, accepted in (("--precision", precision, PRECISIONS),
                                  ("--optimizer", kw.get("optimizer") or "adamw", OPTIMIZERS),
                                  ("--optimizer-impl", kw.get("optimizer_impl") or "foreach", OPTIMIZER_IMPLS),
                                  ("--activation-checkpointing", kw.get("activation_checkpointing") or "none",
                                   CHECKPOINTING), ("--grad-sync", kw.get("grad_sync") or "last", GRAD_SYNC)):
        if value not in accepted:
            raise ValueError(f"{flag}={value!r}: accepted values are {', '.join(accepted)}")
    for s in strategies:
        if s not in NAMES:
            raise ValueError(f"--strategy={s!r}: accepted: {', '.join(NAMES)}")
    return hf, work, shape, precision


def _trace_regimes(work, names: list, precision: str, kw: dict) -> tuple:
    """The workload traced in every regime the strategies `names` run it in (`_regime`): ({regime:
    ModuleDesc}, {regime: the trace's one-line error}, seconds traced, {strategy: why PyTorch cannot train
    the module so})."""
    descs: dict[str, ModuleDesc] = {}
    failed: dict[str, str] = {}  # regime -> the trace's one-line error
    profile_s = 0.0
    unrunnable: dict[str, str] = {}  # strategy -> why PyTorch cannot train the module so
    device = planned_device(kw)

    def trace(regime: str) -> None:
        nonlocal profile_s
        if regime in descs or regime in failed:
            return
        try:
            prof = profile(work, regime, device)  # the target's kernels (front_end.planned_device)
        except ValueError as exc:
            # a model that traces in one regime and not another (an op whose meta function refuses a
            # dtype; torch 2.13's grouped_mm refused fp32 before workload.trace._grouped_mm_any_dtype):
            # the strategies of the regime that ran are planned, the others named
            failed[regime] = str(exc)
            return
        desc = ModuleDesc.from_profile(prof)
        every = checkpoint_every(kw.get("activation_checkpointing") or "none")
        if every:  # the checkpointed run's allocations (its recomputations), for its replay
            try:
                ck = profile(work, regime, device, every)
                desc = desc.with_checkpointed_log(ModuleDesc.from_profile(ck), every)
                profile_s += ck["profile_s"]
            except ValueError:  # (the walk still plans it; its reserved peak is the margin's)
                pass
        descs[regime] = desc.for_precision(precision)
        profile_s += prof["profile_s"]

    for n in names:
        st = get_strategy(n)
        family = st.family
        regime = _regime(precision, family)
        trace(regime)
        if regime in descs and descs[regime].batchnorm:
            trace(_regime(precision, family, True))  # FSDP1 under mixed precision: BatchNorm apart, in fp32
            why = fsdp2_batchnorm_failure(descs[regime], precision) if st.fsdp2 else None
            if why:
                unrunnable[n] = why
    return descs, failed, profile_s, unrunnable


def _trace_notes(kw: dict, hf: bool, names: list, dropped: list, failed: dict, unrunnable: dict,
                 batchnorm: bool, precision: str, desc: ModuleDesc) -> list[str]:
    """module_spec_plan's notes on what it planned: the strategies left out, the flags the trace does not
    follow, FSDP1's BatchNorm, the loss."""
    notes: list[str] = []
    for regime, why in failed.items():
        left = [n for n in dropped if _regime(precision, get_strategy(n).family) == regime]
        notes.append(f"{', '.join(left)} not planned: the trace in {regime} failed ({why.split(': ', 2)[-1]})")
    flag = "--hf-config (trace)" if hf else "--module"
    if not hf and (kw.get("micro_batch") not in (None, 1) or kw.get("seq_len") not in (None, 2048)):
        notes.append("--micro-batch and --seq-len are ignored with --module: the batch is --input-shape's first dim")
    if kw.get("cpu_offload") not in (None, "none"):
        notes.append(f"--cpu-offload={kw['cpu_offload']} is not modelled for {flag}; planned without offload")
    ignored = ("hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "tie_embeddings") + (() if hf else ("layers",))
    if any(kw.get(k) is not None for k in ignored):
        notes.append(f"architecture overrides ({', '.join('--' + k.replace('_', '-') for k in ignored)}) do not "
                     f"apply to {flag}; ignored" + (" (--layers does)" if hf else ""))
    if unrunnable:
        notes.append(f"{', '.join(unrunnable)} not planned: {next(iter(unrunnable.values()))}")
    if batchnorm and get_precision(precision).mixed and any(get_strategy(n).fsdp1 for n in names):
        notes.append(f"FSDP1 under {precision} wraps each BatchNorm module apart and runs it in fp32, its input cast "
                     f"to fp32 and its output back (MixedPrecision._module_classes_to_ignore): traced so")
    loss_text = {"cross_entropy": "cross-entropy (2-D output)", "sum": "sum of the outputs",
                 "hf-causal-lm": "transformers' causal-LM loss (labels = input ids)"}.get(desc.loss, desc.loss)
    notes.append(f"front end: trace (the model run on fake tensors, activations from saved_tensors_hooks); "
                 f"loss: {loss_text}")
    return notes


def _workspace_notes(descs: dict) -> tuple[dict, list[str]]:
    """(the cuDNN convolution workspaces measured here, {key: bytes}; the note saying so)."""
    notes: list[str] = []
    workspaces, local = kernel_workspaces(descs.values())
    if any(d.kernel_args for d in descs.values()):
        if workspaces:
            notes.append(f"cuDNN convolution workspaces measured on this machine's {local}: up to "
                         f"{max(workspaces.values()) / 2**20:.1f} MiB (they depend on the GPU and cuDNN version)")
        else:
            notes.append("cuDNN convolution workspaces not counted: they depend on the kernel cuDNN picks on the "
                         "GPU; plan on a machine with the GPU to measure them (tens of MiB for a small CNN)")
    return workspaces, notes


def _reserved_peak_note(results: list, hf: bool, twin, why: str | None, batch: int) -> str | None:
    """The note saying where each strategy's reserved peak comes from (its own replay, the analytic twin's,
    the margin); `why`: why there is no twin. Pairs the strategies without their own replay with the twin
    (pair_reserved) on the way."""
    replayed = [r.name for r in results if r.memory.reserved_replay is not None]
    rest = [r for r in results if r.memory.reserved_replay is None]
    parts = [f"the traced step's own allocations replayed through the caching allocator for "
             f"{', '.join(replayed)}"] if replayed else []
    if hf and rest:
        # where the step's allocations are not written (every-K checkpointing, FSDP2 on one rank, an optimizer
        # the writers lack) or the embeddings are tied (pair_tied, in module_result): the analytic front end's
        # cached-but-free bytes of the same run, where it reads the config
        if twin is not None:
            paired = [r.name for r in rest if pair_reserved(r.memory, twin(r.name, batch))]
            if paired:
                parts.append(f"the trace's allocated peak plus the cached-but-free bytes of the analytic front end's "
                             f"allocator replay of the same run for {', '.join(paired)}")
            margin = [r.name for r in rest if r.name not in paired]
            why = (f"{', '.join(margin)}: not written from the trace, and the analytic front end's allocated peak "
                   f"differs from the trace's by more than {TWIN_TOLERANCE:.0%}" if margin else None)
        else:
            why = f"{', '.join(r.name for r in rest)}: not written from the trace, nor paired: {why}"
        if why:
            parts.append(f"{RESERVED_MARGIN:.0%} margin for {why}")
    elif rest:
        parts.append(f"the allocated peak + {RESERVED_MARGIN:.0%} for {', '.join(r.name for r in rest)} (not written "
                     f"for them)")
    return "reserved peak: " + "; ".join(parts) if replayed or hf else None


def module_spec_plan(kw: dict, strategies=()) -> ModulePlan:
    """Plan a traced workload for every strategy (or `strategies`): `kw["module"]` (PKG.MOD:FACTORY) at
    `kw["input_shape"]`, or `kw["hf_config"]` (a Hugging Face causal LM) at `micro_batch` x `seq_len`.

    `kw` holds the `estimate` command's options (see from_flags.build_plan). Raises ValueError naming the flag.
    """
    hf, work, shape, precision = _workload_of(kw, strategies)
    device = planned_device(kw)

    cluster, notes = resolve_cluster(kw.get("gpus"), kw.get("gpus_per_node"), kw.get("gpu"), kw.get("gpu_mem"),
                                     kw.get("node"), kw.get("intra"), kw.get("inter"), kw.get("nics_per_node"),
                                     kw.get("inter_gbps"), kw.get("detect_local", True),
                                     tuple(kw.get("catalog_dirs") or ()))
    names = list(strategies) or [n for n in NAMES if get_strategy(n).distributed or cluster.gpus == 1]
    if cluster.gpus == 1 and not strategies:
        names = ["single"]
    names, conflicts = drop_conflicts(names, kw.get("optimizer") or "adamw", bool(strategies))
    notes.extend(conflicts)

    descs, failed, profile_s, unrunnable = _trace_regimes(work, names, precision, kw)
    if not descs:
        raise ValueError(next(iter(failed.values())))
    dropped = [n for n in names if _regime(precision, get_strategy(n).family) in failed
               or (n not in unrunnable and _regime(precision, get_strategy(n).family, True) in failed)]
    if unrunnable and all(n in unrunnable or n in dropped for n in names):
        raise ValueError(f"--strategy={','.join(names)}: {next(iter(unrunnable.values()))}")
    names = [n for n in names if n not in dropped and n not in unrunnable]
    batchnorm = any(d.batchnorm for d in descs.values())
    desc = next(iter(descs.values()))
    model = ModuleModel(desc.name, work.label, desc.param_count(), desc.units, layers=len(desc.units))
    train = ModuleTrain(model, precision=precision, optimizer=kw.get("optimizer") or "adamw",
                        optimizer_impl=kw.get("optimizer_impl") or "foreach",
                        checkpointing=kw.get("activation_checkpointing") or "none",
                        grad_accum=kw.get("grad_accum") or 1, grad_sync=kw.get("grad_sync") or "last",
                        input_shape=shape, torch_version=kw.get("torch_version") or "",
                        alloc_conf=kw.get("alloc_conf") or "",
                        seq_len=shape[1] if hf else "-", attention=work.attention if hf else "-")
    notes = list(notes)
    notes += _trace_notes(kw, hf, names, dropped, failed, unrunnable, batchnorm, precision, desc)
    fsdp_names = [n for n in names if get_strategy(n).fsdp]
    if hf and fsdp_names:
        notes.append(f"{', '.join(fsdp_names)}: the model built on the meta device and wrapped there, each rank then "
                     f"making only what FSDP keeps (torchtitan's way), as `distplan validate --hf-config` probes it")

    workspaces, ws_notes = _workspace_notes(descs)
    notes += ws_notes

    gpu = load_catalog(tuple(kw.get("catalog_dirs") or ())).gpu(cluster.gpu_name)
    twin, why = analytic_twins(kw, cluster, device, BACKEND[device]) if hf else (None, None)
    # a transformers model's plan builds it under FSDP on the meta device, as the analytic front end's does
    # (a 47B Mixtral built whole on each GPU first does not fit); the probes build it on the device
    results = [module_result(descs, train, cluster, n, gpu, workspaces, twin, desc.batch, "meta" if hf else "device",
                             device) for n in names]
    fsdp2 = [n for n in names if get_strategy(n).fsdp2]
    padding = fsdp2_padding_note(desc, fsdp2, _shard_group(get_strategy(fsdp2[0]), cluster)[1]) if fsdp2 else None
    if padding:
        notes.append(padding)
    if twin is not None:
        notes.append("step time: the analytic front end's per-kernel model of the same run (GEMMs by shape, "
                     "attention by kernel, memory-bound ops by bytes, communication overlap), as --front-end "
                     "analytic prints it")
    else:
        notes.append("step time: every kernel the traced step launched, timed by its FLOPs (GEMMs, attention) or "
                     "the bytes it moves (the rest), with launch and host costs, plus exposed communication"
                     + (" (eager kernels: torch.compile's fusion is not modelled for a traced model)"
                        if kw.get("compile") else ""))
    reserved = _reserved_peak_note(results, hf, twin, why, desc.batch)
    if reserved:
        notes.append(reserved)
    headroom = kw.get("headroom")
    return ModulePlan(train, cluster, results, notes, None, device=device, desc=desc, descs=descs, profile_s=profile_s,
                      workspaces=workspaces, twin=twin, kw=dict(kw),
                      headroom=HEADROOM_FRACTION if headroom is None else parse_headroom(headroom))


def module_result(descs: dict, train: ModuleTrain, cluster: Cluster, name: str, gpu, workspaces: dict, twin,
                  batch: int, init: str = "device", device: str = "cuda") -> StrategyResult:
    """One strategy's prediction for a traced workload: the memory walk and collectives of the trace in the
    strategy's precision regime, the step time of the analytic twin where there is one, else the trace's.
    `init`: estimate_module_memory's."""
    st = get_strategy(name)
    d = _desc_for(descs, train.precision, st.family)
    mem = estimate_module_memory(d, train, cluster, st, device, BACKEND[device], workspaces=workspaces, init=init)
    if twin is not None:
        pair_tied(mem, d, twin(name, batch))
    colls = module_collectives(d, train, cluster, name)
    timed = twin_time(twin, name, batch, cluster) if twin is not None else None
    return StrategyResult(st, mem, colls, timed or module_time(d, train, cluster, colls, gpu, st))


def check_hf_config(path, seq_len: int | None = None) -> None:
    """The analytic front end's one-line errors for a config.json it cannot read; a model_type it does
    not describe (mixtral, gemma3, ...) is left to the trace, which takes any causal LM transformers knows. A
    sequence longer than learned position embeddings (GPT-2's n_positions) fails in a real run; the
    fake tensors would not notice, so it is refused here."""
    try:
        spec = read_hf_config(path)
    except ValueError as exc:
        if "is not supported" not in str(exc):
            raise
        return
    if seq_len and spec.get("position") == "learned" and seq_len > spec["max_positions"]:
        raise ValueError(f"--seq-len={seq_len}: exceeds the model's {spec['max_positions']} learned positions")


def kernel_workspaces(descs) -> tuple[dict, str | None]:
    """cuDNN workspaces of every convolution in `descs` (ModuleDescs), measured on the local GPU
    (`validate.kernel_workspace`): ({key: bytes}, the GPU's name), or ({}, None) without one."""
    name = kernel_workspace.available()
    calls = {key: args for d in descs for key, args in d.kernel_args}
    if not calls or name is None:
        return {}, name
    return kernel_workspace.measure([{"key": k, "args": json.loads(a)} for k, a in calls.items()]), name


def probe_kernel_workspaces(module: dict, precision: str, strategies) -> dict:
    """For `distplan validate --module` on a GPU: the cuDNN workspaces of the module's convolutions in
    every regime the strategies run it in, measured here once ({key: bytes}); stored in the probes'
    inputs so the prediction can be repeated without the GPU."""

    if module.get("path") and module["path"] not in sys.path:
        sys.path.insert(0, module["path"])
    work = from_spec(module)
    regimes = {_regime(precision, get_strategy(s).family) for s in strategies}
    descs = [_traced(work, r, "cuda") for r in sorted(regimes)]
    if any(d.batchnorm for d in descs):  # FSDP1's own regime under mixed precision (`_regime`)
        regimes = {_regime(precision, get_strategy(s).family, True) for s in strategies} - regimes
        descs += [_traced(work, r, "cuda") for r in sorted(regimes)]
    return kernel_workspaces(descs)[0]


_TRACES: dict = {}


def _traced(work, regime: str, device: str = "cpu", every: int = 0) -> ModuleDesc:
    """The workload's ModuleDesc in a regime with `device`'s kernels (workload.trace.KERNEL_DEVICES), traced
    once per process (a validation run predicts many probes of one model). `every`: with the allocation log
    of a run checkpointing every `every`-th unit (`ModuleDesc.with_checkpointed_log`)."""

    key = (json.dumps(work.to_spec(), sort_keys=True), regime, device, every)
    if key not in _TRACES:
        if key[-1]:
            plain = _traced(work, regime, device)
            try:
                _TRACES[key] = plain.with_checkpointed_log(
                    ModuleDesc.from_profile(profile(work, regime, device, every)), every)
            except ValueError:  # the checkpointed trace fails: planned as traced, the reserved peak the margin's
                _TRACES[key] = plain
        else:
            _TRACES[key] = ModuleDesc.from_profile(profile(work, regime, device))
    return _TRACES[key]
