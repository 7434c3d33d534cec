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
from dataclasses import dataclass, field, replace
from itertools import groupby
from math import prod

from distplan.catalog.loader import load_catalog
from distplan.planner.workload import kernel_workspace
from distplan.planner.workload.trace import profile
from distplan.planner.workload.traced_model import FactoryWorkload, HFWorkload, from_spec, hf_path, parse_shape, preload

from .alloc_trace import (LOGGED_FAMILIES, LOGGED_FSDP1, LOGGED_FSDP2, LOGGED_OPTIMIZERS, logged_fsdp1_events,
                          logged_fsdp2_events, logged_step_events)
from .comm import Collective, DDP_BUCKET_CAP_MB, bucket_sizes, grad_ready_order, timed_collectives
from .compute import _gpu, _optimizer_bytes, _owned_elems, contention, step_time
from .config import (CHECKPOINTING, Cluster, GRAD_SYNC, TrainConfig, checkpoint_every,
                     fsdp2_first_microstep_grads_in_reduce_dtype, fsdp2_reduce_keeps_last_grad, torch_followed)
from .footprint import device_footprint
from .hardware import catalog_name
from .hf_config import read_hf_config
from .kernels import matmul_rates, optimizer_host_ops, step_bound
from .memory import (COMPONENTS, MemoryEstimate, RESERVED_MARGIN, Snapshot, estimate_memory, library_workspace_bytes,
                     zero1_partition)
from .plan_result import Plan
from .precision import OPTIMIZERS, OPTIMIZER_IMPLS, PRECISIONS, get_precision, optimizer_state_elems
from .ranking import TIE_FRACTION, _headroom_ok, _rank
from .recommend import Recommendation, _reasons
from .resolve import resolve_cluster, resolve_model
from .strategies import DDP, FSDP1, FSDP2, NAMES, ZERO1, Strategy, get_strategy
from .strategy_result import StrategyResult, drop_conflicts
from .units import fmt_count, fmt_gib



# -- the measured description ------------------------------------------------------------------

_FLOAT_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
"""Element bytes of the floating-point dtypes `Module.to(dtype)` casts (torch names, as the trace records them)."""


@dataclass(frozen=True)
class ModuleDesc:
    """What the planner needs of a module: units of parameter shapes and forward segments."""

    name: str
    """Display name: `Class (pkg.mod:factory)`."""
    units: tuple
    """((unit, ((param name, shape), ...)), ...) in registration order; 'root' = the root's own."""
    segments: tuple
    """((unit, saved activation bytes, input bytes, backward, forward, outside, end, grads made, shared
    inputs), ...) in forward order, 'loss' last. grads made: the bytes of parameter gradients its backward
    made (-1: not measured). shared inputs: ((id, bytes), ...) of the unit's other tensor inputs (a
    decoder layer's masks, RoPE tables, position ids), the same id where units share a tensor; then the
    bytes of the unit's input storage that the unit itself saves (0: none; a recomputed checkpointed unit
    saves the kept input again, not a copy). outside: the saved bytes of the root's ops that ran after the unit's own call;
    end: the transient bytes alive at the segment's last backward op (the input's gradient, and what
    waits in autograd's buffers: a tied head's gradient).
    forward: the highest bytes alive during the segment's forward of what the forward created, less the
    earlier segments' saved tensors (its own saved tensors so far, its input and intermediates).
    backward: (before, after), each (transient, grads, saved) bytes at the segment's highest backward
    instant before and after the gradient of its unit's output is ready (where FSDP's pre-backward hook
    runs), measured on fake tensors (`workload.trace._SegmentTracker`): activation gradients alive, its
    parameters' gradients made so far, its saved tensors not yet freed."""
    output_bytes: int
    buffers_bytes: int
    forward_flops: int
    batch: int
    """The input shape's first dimension: samples per GPU per micro-step."""
    loss: str = "sum"
    """'cross_entropy' (2-D output) or 'sum' (workload.trace's rule)."""
    kernels: tuple = ()
    """((segment index in `segments`, phase, key, at), ...): the convolutions, whose cuDNN workspaces
    are measured on a GPU (`planner/workload/kernel_workspace.py`); `at`: what is alive when the call runs,
    (transient, grads, saved) in backward (as `segments`' backward), (forward bytes,) in forward (as
    `segments`' forward)."""
    linear_bias: bool = False
    """An addmm (a Linear with a bias) runs in forward: cuBLASLt's workspace on CUDA."""
    buffers: tuple = ()
    """((dtype, (bytes of each buffer, ...)), ...) in registration order: what DDP broadcasts."""
    batch_bytes: int = 0
    """The input batch: alive through the whole step, a temporary (not saved by autograd)."""
    kernel_args: tuple = ()
    """((key, JSON of the call's arguments), ...): what `validate.kernel_workspace.measure` runs."""
    grad_ready: tuple = ()
    """Parameter numels in the order their gradients became ready in the traced backward (hooks on
    AccumulateGrad): the order DDP rebuilds its buckets in. Empty: derived from the names."""
    backward_accumulating: tuple = ()
    """Per segment of `segments`, its backward in a micro-step after the first of gradient accumulation
    (every .grad already there, each new gradient added in place and freed): (before, after), each
    (transient, fresh, saved) at the highest instant, `fresh` the parameters' gradients made and not yet
    accumulated (`workload.trace._SegmentTracker.segment_peaks_accumulating`). Empty: not measured (a profile
    written before it was; the walk then counts no fresh gradient)."""
    tied: tuple = ()
    """Numels of the parameters reached under more than one name (a tied embedding and LM head), once each.
    Empty: none, or a profile written before they were recorded."""
    census: tuple = ()
    """Per segment of `segments`, the kernels its forward and backward launched and its unit's own forward
    (what a checkpointed unit runs again): ((forward, backward, unit forward), ...), each a tuple of
    `workload.trace.CENSUS_FIELDS` (gemm FLOPs, gemms, attention FLOPs, bytes of the memory-bound kernels,
    kernels, ATen ops, the fp32 GEMMs' FLOPs; a profile written before the last was counted has 0 there)."""
    construct: tuple = ()
    """The parameters' and buffers' bytes in the order `model.to(device)` allocates them."""
    alloc_log: tuple = ()
    """The traced step's allocations in host order (`workload.trace._SegmentTracker.log`): (1, id, bytes),
    (0, id) and (2, convolution key); replayed through the caching allocator for the reserved peak
    (alloc_trace.logged_step_events). Empty: not recorded (a Hugging Face model, a profile at another
    batch, an older profile)."""
    alloc_kept: tuple = ()
    """The ids of `alloc_log` alive when the step is over: the parameters' gradients."""
    alloc_grads: tuple = ()
    """((id, parameter name), ...): which of `alloc_kept` is whose gradient (FSDP reduces each unit's at
    its post-backward). Empty: an older profile."""
    construct_names: tuple = ()
    """Per `construct` entry, its parameter's name ("" for a buffer). Empty: an older profile."""
    construct_built: tuple = ()
    """Per `construct` entry, its bytes as the factory built it, before a 16-bit regime's cast (pure bf16
    training casts the module after `model.to(device)`). Empty: an older profile."""
    alloc_log_every: int = 0
    """The activation checkpointing `alloc_log` was traced under (config.checkpoint_every: every k-th unit;
    0 none): a checkpointed run's log has the recomputations (`with_checkpointed_log`)."""
    batchnorm: bool = False
    """The module has BatchNorm layers (FSDP1's mixed precision runs them apart in fp32; FSDP2's fails)."""
    unit_forward: tuple = ()
    """Per segment of `segments`, (the unit's own forward peak, its output) in bytes: what a checkpointed unit's
    recomputation holds at its peak (the forward peak less the earlier segments' saved tensors, as `forward`;
    without the root's ops after the unit). Empty: not recorded (an older profile)."""
    saved_inputs: tuple = ()
    """Indices of `segments` whose input an earlier op already saved (a ReLU's output, the next unit's input):
    under checkpointing an activation there, not the checkpointed forward's transient output."""
    batch_inputs: tuple = ()
    """Indices of `segments` whose unit's input is the input batch itself (a checkpointed unit keeps no new
    tensor for it: the batch is a temporary through the step)."""
    fp32_units: tuple = ()
    """Units whose parameters stay fp32 under mixed precision: FSDP1's own units of the BatchNorm modules
    (the "fsdp1-*" trace regimes, workload.trace._fsdp1_full_precision_modules). Empty elsewhere."""

    @property
    def activation_bytes(self) -> int:
        return sum(s[1] for s in self.segments)

    def param_count(self) -> int:
        return sum(prod(s) for _, ps in self.units for _, s in ps)

    def unit_shapes(self, unit: str) -> tuple:
        for u, ps in self.units:
            if u == unit:
                return tuple(s for _, s in ps)
        return ()

    def all_shapes(self) -> list:
        return [s for _, ps in self.units for _, s in ps]

    @classmethod
    def from_profile(cls, prof: dict) -> "ModuleDesc":
        units = tuple((u["name"], tuple((n, tuple(s)) for n, s in u["params"])) for u in prof["units"])
        def backward(s):
            if "backward_split" in s:
                return tuple(tuple(int(v) for v in part) for part in s["backward_split"])
            # no hook instants recorded: the segment's peak, as if after the hook
            return (0, 0, 0), tuple(int(s[k]) for k in ("backward_bytes", "backward_grad_bytes",
                                                          "backward_saved_bytes"))

        segs = tuple((s["unit"], int(s["activation_bytes"]), int(s["input_bytes"]), backward(s),
                      int(s["forward_bytes"]), int(s["activation_bytes"]) - int(s.get("unit_bytes", 0)),
                      int(s.get("backward_end", s["input_bytes"])), int(s.get("grads_made", -1)),
                      tuple((int(i), int(b)) for i, b in s.get("shared_inputs", ())),
                      int(s.get("input_saved_bytes", 0)))
                     for s in prof["segments"])
        def entry(c):  # CENSUS_FIELDS, the fields a profile of an older version lacks as 0
            return tuple(c) + (0,) * (7 - len(c))

        census = tuple((entry(s["census"][0]), entry(s["census"][1]), entry(s.get("unit_census") or ()))
                       for s in prof["segments"])
        kernels = tuple((i, k["phase"], k["key"], tuple(int(v) for v in k["at"]))
                        for i, s in enumerate(prof["segments"]) for k in s.get("kernels", ()))
        accumulating = tuple(tuple(tuple(int(v) for v in part) for part in s["backward_split_accumulating"])
                             for s in prof["segments"]) if all("backward_split_accumulating" in s
                                                               for s in prof["segments"]) else ()
        return cls(f"{prof['module_class']} ({prof['factory']})", units, segs, int(prof["output_bytes"]),
                   int(prof["buffers_bytes"]), int(prof["forward_flops"]), int(prof["input_shape"][0]),
                   prof.get("loss", "sum"), kernels=kernels, linear_bias=bool(prof.get("linear_bias", False)),
                   batch_bytes=int(prof.get("batch_bytes", 0)),
                   grad_ready=tuple(int(n) for _, n in prof.get("grad_ready", ())), census=census,
                   backward_accumulating=accumulating, tied=tuple(int(n) for n in prof.get("tied", ())),
                   buffers=tuple((d, tuple(int(n) for n in sizes)) for d, sizes in prof.get("buffers", ())),
                   kernel_args=tuple(sorted({(k["key"], json.dumps(k["args"], sort_keys=True))
                                             for s in prof["segments"] for k in s.get("kernels", ())})),
                   construct=tuple(int(n) for n in prof.get("construct_bytes", ())),
                   alloc_log=tuple(tuple(e) for e in (prof.get("alloc_log") or {}).get("events", ())),
                   alloc_kept=tuple((prof.get("alloc_log") or {}).get("kept", ())),
                   alloc_grads=tuple((int(i), n) for i, n in (prof.get("alloc_log") or {}).get("grads", ())),
                   construct_names=tuple(prof.get("construct_names", ())),
                   construct_built=tuple(int(n) for n in prof.get("construct_built", ())),
                   batchnorm=bool(prof.get("batchnorm", False)), fp32_units=tuple(prof.get("fp32_units", ())),
                   batch_inputs=tuple(i for i, s in enumerate(prof["segments"]) if s.get("input_is_batch")),
                   saved_inputs=tuple(i for i, s in enumerate(prof["segments"]) if s.get("input_already_saved")),
                   unit_forward=tuple((int(s.get("unit_forward_bytes", 0)), int(s.get("unit_output_bytes", 0)))
                                      for s in prof["segments"]) if all("unit_forward_bytes" in s or s["unit"] in
                                                                        ("root", "loss") for s in prof["segments"])
                   else ())

    def with_checkpointed_log(self, other: "ModuleDesc", every: int) -> "ModuleDesc":
        """This description with the allocation log of `other`, the same module traced with every `every`-th
        unit checkpointed (workload.trace.profile's `checkpoint_every`)."""
        return replace(self, alloc_log=other.alloc_log, alloc_kept=other.alloc_kept,
                       alloc_grads=other.alloc_grads, alloc_log_every=every)

    def for_precision(self, precision: str) -> "ModuleDesc":
        """The traced description as a run of `precision` holds it: pure bf16 casts the whole module
        (`model.to(torch.bfloat16)`), its buffers too (`with_buffers_in`); otherwise as traced."""
        # (pure bf16 casts the module after it is built: that cast is written from `construct_built`, which
        # an older profile lacks)
        if precision != "bf16":
            return self
        cast = self.with_buffers_in("bfloat16")
        return cast if self.construct_built else replace(cast, alloc_log=())

    def with_buffers_in(self, dtype: str) -> "ModuleDesc":
        """The module after `module.to(dtype)`: its floating-point buffers cast too (pure 16-bit training
        casts the whole module: validate/wrap.py). The trace casts the parameters only (a transformers model's
        buffers stay as built: FSDP's mixed precision, which shares the 16-bit trace, leaves them), so a
        pure-bf16 plan casts them here: what DDP broadcasts (one message per dtype) and what they hold.
        Measured: Qwen2.5-0.5B ddp bf16, its rotary `inv_freq` and `original_inv_freq` broadcast as one
        128-byte bfloat16 message, not a 256-byte float32 one."""
        size = _FLOAT_BYTES[dtype]
        merged: dict = {}
        for d, sizes in self.buffers:
            if d in _FLOAT_BYTES and d != dtype:  # floating: the elements in the new dtype
                merged.setdefault(dtype, []).extend(n // _FLOAT_BYTES[d] * size for n in sizes)
            else:
                merged.setdefault(d, []).extend(sizes)
        buffers = tuple((d, tuple(sizes)) for d, sizes in merged.items())
        total = self.buffers_bytes - sum(sum(x) for _, x in self.buffers) + sum(sum(x) for _, x in buffers)
        return replace(self, buffers=buffers, buffers_bytes=total)

    def scaled(self, batch: int) -> "ModuleDesc":
        """The same module at another batch: activations, inputs, output, FLOPs scale linearly."""
        k = batch / self.batch
        def bwd(b):
            return int(b[0] * k), b[1], int(b[2] * k)

        segs = tuple((u, int(a * k), int(i * k), tuple(bwd(x) for x in b), int(f * k), int(o * k), int(e * k), g,
                      tuple((j, int(n * k)) for j, n in sh), int(ins * k))
                     for u, a, i, b, f, o, e, g, sh, ins in self.segments)
        # the kernels' FLOPs and bytes scale with the batch, their counts do not (weights' casts and
        # gradients' do not scale either: a small error, as the activations')
        census = tuple(tuple((c[0] * k, c[1], c[2] * k, c[3] * k, c[4], c[5], c[6] * k) for c in seg)
                       for seg in self.census)
        # cuDNN's workspaces at another batch are another kernel's: not known without measuring.
        accumulating = tuple(tuple(bwd(x) for x in b) for b in self.backward_accumulating)
        unit_forward = tuple((int(f * k), int(o * k)) for f, o in self.unit_forward)
        return replace(self, segments=segs, output_bytes=int(self.output_bytes * k), census=census,
                       unit_forward=unit_forward,
                       backward_accumulating=accumulating,
                       forward_flops=int(self.forward_flops * k), batch=batch,
                       batch_bytes=int(self.batch_bytes * k),
                       kernels=() if batch != self.batch else self.kernels,
                       alloc_log=() if batch != self.batch else self.alloc_log)


@dataclass(frozen=True)
class ModuleTrain:
    """The training step of a module plan; mirrors TrainConfig's fields that reports read."""

    model: "ModuleModel"
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    optimizer_impl: str = "foreach"
    checkpointing: str = "none"
    grad_accum: int = 1
    grad_sync: str = "last"
    """With grad_accum > 1: 'last' (no_sync before the last micro-step) or 'every' (config.GRAD_SYNC)."""
    input_shape: tuple = ()
    torch_version: str = ""
    """As TrainConfig.torch_version: the PyTorch release whose FSDP2 the walk follows ("" = the installed)."""
    alloc_conf: str = ""
    """As TrainConfig.alloc_conf: the run's PYTORCH_CUDA_ALLOC_CONF, which the replay of the traced step's own
    allocations follows (allocator.parse_alloc_conf, alloc_rounding)."""
    # TrainConfig fields that have no meaning for an arbitrary module (kept for report.header):
    seq_len: str = "-"
    attention: str = "-"
    cpu_offload: str = "none"
    framework: str = "pytorch"

    @property
    def micro_batch(self) -> int:
        return self.input_shape[0]

    @property
    def sync_every(self) -> bool:
        """As TrainConfig.sync_every: every micro-step of an accumulating step reduces gradients."""
        return self.grad_accum > 1 and self.grad_sync == "every"

    @property
    def tokens_per_sample(self) -> int:
        """A traced language model's sequence length (tokens/s counts tokens); 1 for a --module."""
        return self.seq_len if isinstance(self.seq_len, int) else 1

    @property
    def prec(self):
        return get_precision(self.precision)

    def to_dict(self) -> dict:
        return {"input_shape": list(self.input_shape), "micro_batch": self.micro_batch,
                "grad_accum": self.grad_accum, "grad_sync": self.grad_sync, "precision": self.precision, "optimizer": self.optimizer,
                "optimizer_impl": self.optimizer_impl, "checkpointing": self.checkpointing,
                "torch_version": torch_followed(self.torch_version)}


@dataclass(frozen=True)
class ModuleModel:
    """The module as `report.header` reads a model; the decoder-only fields print as '-'."""

    name: str
    factory: str
    params: int
    units: tuple
    layers: int = 0
    hidden: str = "-"
    heads: str = "-"
    kv_heads: str = "-"
    ffn_hidden: str = "-"
    mlp: str = "-"
    vocab: str = "-"

    def param_count(self) -> int:
        return self.params

    def to_dict(self) -> dict:
        return {"name": self.name, "factory": self.factory, "params": self.params,
                "units": [{"name": u, "params": [[n, list(s)] for n, s in ps]} for u, ps in self.units]}


@dataclass
class ModuleTime:
    """Compute + exposed communication for one optimizer step (see the module docstring)."""

    compute_s: float
    comm_s: float
    exposed_comm_s: float
    step_time_s: float
    tokens_per_s: float
    """Samples per second, all GPUs (a sample counts as a token for --module)."""
    mfu: float
    optimizer_s: float = 0.0
    """The optimizer step's passes over this rank's parameters (memory bound)."""
    overhead_s: float = 0.0
    """Copies and launches around the collectives (compute.StepTime.overhead_s; the analytic twin's time)."""


# -- memory ------------------------------------------------------------------------------------

def _shard_group(st: Strategy, cluster: Cluster) -> tuple[int, int]:
    world = cluster.gpus if st.distributed else 1
    shard = {"world": world, "node": min(world, cluster.local_size), "none": 1}[st.shard_group]
    if st.fsdp_no_shard:
        shard = 1
    return world, shard


def _autocast_cast_bytes(desc: ModuleDesc) -> dict:
    """Per unit, the bytes of autocast's 16-bit casts of its matmul and convolution weights (the
    parameters of two or more dimensions) and of their modules' biases: what `torch.autocast` caches
    for the region (`at::autocast::cached_cast`: leaf tensors that require grad)."""
    out = {}
    for u, params in desc.units:
        mats = {n.rsplit(".", 1)[0] for n, s in params if len(s) >= 2}
        out[u] = 2 * sum(prod(s) for n, s in params if len(s) >= 2 or (n.endswith(".bias") and n.rsplit(".", 1)[0] in mats))
    return out


def _unit_sizes(desc: ModuleDesc, family: str, shard: int, sharding: bool) -> dict:
    """{unit: (shard elems, unsharded elems)} per FSDP family (memory.layout's rules, per unit)."""
    out = {}
    for u, ps in desc.units:
        shapes = [s for _, s in ps]
        if family == FSDP2 and sharding:  # FSDPParam: dim-0 shards, padded
            sh = sum(-(-s[0] // shard) * prod(s[1:]) if s else -(-1 // shard) for s in shapes)
            out[u] = (sh, sh * shard)
        elif sharding:  # FSDP1 FlatParameter padded to a multiple of the group
            n = sum(prod(s) for s in shapes)
            sh = -(-n // shard)
            out[u] = (sh, sh * shard)
        else:
            n = sum(prod(s) for s in shapes)
            out[u] = (n, n)
    return out


PADDING_NOTE_FRACTION = 0.10
"""FSDP2's dim-0 padding is named in a note once it adds this fraction to a rank's parameter shard."""


def fsdp2_padding_note(desc: ModuleDesc, names, shard: int) -> str | None:
    """A note where FSDP2's dim-0 sharding pads the shards well beyond 1/shard of the parameters: a
    parameter with fewer rows than the shard group (a mixture-of-experts layer's stacked experts, whose
    dim 0 is the number of experts) gives every rank ceil(rows / shard) rows, the all-gathers move
    shard x that, and ranks past the last row hold padding (`FSDPParam._init_sharded_param`: `torch.chunk`
    on dim 0, padded to `padded_sharded_param_size`). None when the padding is under
    PADDING_NOTE_FRACTION or no FSDP2 strategy is planned."""
    names = [n for n in names if get_strategy(n).fsdp2]
    if not names or shard <= 1:
        return None
    padded = exact = 0
    worst = (0, "", ())
    for _, ps in desc.units:
        for pname, s in ps:
            rows = -(-s[0] // shard) * prod(s[1:]) if s else 1
            padded += rows
            exact += prod(s) / shard
            extra = rows - prod(s) / shard
            if extra > worst[0]:
                worst = (extra, pname, s)
    if not exact or padded <= (1 + PADDING_NOTE_FRACTION) * exact:
        return None
    _, pname, s = worst
    return (f"{', '.join(names)}: FSDP2 shards each parameter on dim 0, and {pname} ({'x'.join(map(str, s))}) has "
            f"{s[0]} rows for {shard} ranks, so each rank holds {-(-s[0] // shard)} row(s) and the all-gathers "
            f"move {shard} x that: the parameter shards come to {padded / exact:.1f}x 1/{shard} of the model. "
            f"fully_shard(shard_placement_fn=...) can shard such parameters on another dim (not planned), or "
            f"FSDP1's flat parameters (fsdp) avoid it")


def _zero1_owned(shapes: list, shard: int, rank: int | None = None) -> list:
    """ZeroRedundancyOptimizer._partition_parameters (`memory.zero1_partition`): the shapes of the most
    loaded rank, or of `rank`."""
    ordered = sorted(shapes, key=prod, reverse=True)  # stable: equal sizes keep registration order
    runs = [(n, tuple(group)) for n, group in groupby(ordered, key=prod)]
    totals, owned = zero1_partition(runs, shard)
    return owned[totals.index(max(totals)) if rank is None else rank]


def estimate_module_memory(desc: ModuleDesc, train: ModuleTrain, cluster: Cluster,
                           strategy: str | Strategy, device: str = "cuda", backend: str = "nccl",
                           workspaces: dict | None = None, rank: int | None = None,
                           init: str = "device") -> MemoryEstimate:
    """Most loaded rank's memory of one strategy for a measured module (module docstring); `rank`: that
    rank's instead, where ranks differ (ZeRO-1's partition of the optimizer state: a probe on the fake process
    group measures rank 0). `init`: how the written run builds the model under FSDP (logged_module_events).

    On 'cuda' `peak_allocated` adds two cuBLAS workspaces (forward and backward threads) and cuBLASLt's
    when a Linear has a bias (`memory.library_workspace_bytes`'s rule), and each convolution's cuDNN
    workspace from `workspaces` ({kernel key: bytes}, measured by `validate.kernel_workspace`) at the
    instant its call runs: the components are those of the tensors' peak, `peak_allocated` is the
    highest of tensors plus the workspace of the moment, and `workspace` what it adds to the components.
    `backend` 'gloo' adds the copy its reduce_scatter_tensor makes of its input (as memory.py)."""
    st = get_strategy(strategy)
    family = st.family
    world, shard = _shard_group(st, cluster)
    prec = train.prec
    pb, gb, cb = prec.param_bytes, prec.grad_bytes, prec.compute_bytes
    notes: list[str] = []
    shapes = desc.all_shapes()
    total = desc.param_count()
    largest = max((prod(s) for s in shapes), default=0)
    fsdp = st.fsdp
    sharding = fsdp and shard > 1 and st.shards_params
    sizes = _unit_sizes(desc, family, shard, sharding) if fsdp else {}

    # Optimizer state (precision.optimizer_state_elems) on this rank's elements.
    if st.zero_optimizer and shard > 1:
        owned = _zero1_owned(shapes, shard, rank)
        elems, extra = optimizer_state_elems(train.optimizer, owned)
        step_elems = sum(prod(s) for s in owned)
    elif sharding:
        # The most loaded rank's shards: FSDP2 keeps each parameter's dim-0 chunk (rank 0 has
        # ceil(d0/shard) rows), FSDP1 one flat 1-D shard per unit; states are zeros_like(shard).
        if st.fsdp2:
            local = [(-(-s[0] // shard),) + tuple(s[1:]) if s else (1,) for s in shapes]
        else:
            local = [(v[0],) for v in sizes.values()]
        elems, extra = optimizer_state_elems(train.optimizer, local)
        step_elems = sum(v[0] for v in sizes.values())
    else:
        elems, extra = optimizer_state_elems(train.optimizer, shapes)
        step_elems = total
    opt = elems * pb + int(extra)
    if train.optimizer in ("adam", "adamw"):
        opt_tmp = {"foreach": step_elems * pb, "for-loop": 2 * min(largest, step_elems) * pb}.get(
            train.optimizer_impl, 0)
    elif train.optimizer == "adafactor":
        opt_tmp = 2 * largest * pb
    else:
        opt_tmp = 0

    # Forward segments, with checkpointing.
    segs = [s for s in desc.segments if s[0] != "loss"]
    loss_act = sum(s[1] for s in desc.segments if s[0] == "loss")
    acts = [s[1] for s in segs]
    every = checkpoint_every(train.checkpointing)
    kept_in = [0 if j in desc.batch_inputs else s[2] for j, s in enumerate(segs)]  # a checkpointed unit's input
    # the units the probes checkpoint (`workload.enable_checkpointing`: the parameter-owning children), not the
    # segments of parameter-free children (a pooling module: measured, the MNIST CNN under full checkpointing,
    # +21% on the peak while its pools counted as checkpointed units keeping their inputs)
    owners = {u for u, ps in desc.units if ps and u != "root"}
    unit_index = {u: i for i, u in enumerate(dict.fromkeys(s[0] for s in segs if s[0] in owners))}
    ckpt = [bool(every) and s[0] in unit_index and unit_index[s[0]] % every == 0 for s in segs]
    if every:
        # Each checkpointed unit (every one for full, every K-th from the first for every-K: transformers'
        # `every_n_layers`) keeps its input; what the root's own ops after it saved (a decoder's final
        # norm, LM head and loss) stays; the unit's own saved tensors are recomputed in its backward.
        # A segment without a unit (the root's first ops: embedding) is not checkpointed. Its other tensor
        # inputs (a decoder layer's masks, RoPE tables, position ids: shared by the units) stay alive with
        # it, each counted once, at the first checkpointed unit given it.
        # A unit whose input is the batch itself keeps nothing new for it (the batch is a temporary).
        kept: set = set()
        acts = []
        for j, (s, c) in enumerate(zip(segs, ckpt)):
            if not c:
                acts.append(s[1])
                continue
            acts.append(kept_in[j] + s[5] + sum(b for i, b in s[8] if i not in kept))
            kept.update(i for i, _ in s[8])
    elif train.checkpointing in ("selective", "selective-op"):
        notes.append(f"{train.checkpointing} checkpointing is not defined for an arbitrary module: planned as none")
    inputs = [s[2] for s in segs] + [desc.output_bytes]
    ends = [s[6] for s in segs]  # transient bytes at each segment's backward end (measured)
    out_tmp = desc.output_bytes
    buffers = desc.buffers_bytes

    snaps: list[Snapshot] = []
    extra: list[int] = []  # cuDNN workspace taken at each snapshot's instant
    ws = workspaces if device == "cuda" and workspaces else {}
    fwd_kernels: dict = {}  # segment -> [(workspace, (forward bytes,))]
    bwd_kernels: dict = {}  # segment -> [(workspace, (transient, grads, saved))]
    for i, phase, key, at in desc.kernels:
        if i < len(segs) and key in ws:
            (fwd_kernels if phase == "forward" else bwd_kernels).setdefault(i, []).append((ws[key], at))

    def snap(phase, workspace=0, **parts):
        full = {k: 0 for k in COMPONENTS}
        for k, v in parts.items():
            full[k] += int(v)
        # the step's input batches, one per micro-step, alive through the step (a loader hands the step
        # its micro-batches together; the probe makes them before the first forward)
        full["temporaries"] += desc.batch_bytes * train.grad_accum
        snaps.append(Snapshot(phase, full))
        extra.append(int(workspace))

    def instants(k: int, split: tuple = (), kernel_grads: bool = True):
        """Segment k's backward: its measured peaks before and after its unit's output gradient is
        ready (no workspace), then each convolution's instant with its workspace (after), as
        ((transient, own grads, saved), workspace, before). With full checkpointing the unit's saved
        tensors are the recomputed ones, made after the hook (temporaries). `split`: other per-segment
        (before, after) peaks than the profile's `backward` (ModuleDesc.backward_accumulating);
        `kernel_grads` False: no gradients at the convolutions' instants."""
        if ckpt[k]:
            # The recomputation's own forward peak, right after the hook (non-reentrant checkpoint runs the
            # unit's forward again to its end: what its forward held at its peak, the block's locals
            # through its last op), next to its kept input and its output's gradient (measured: the CIFAR
            # ResNet's basic blocks under full checkpointing, -9.4% on the peak without this instant)
            if desc.unit_forward:
                fwd_peak, out = desc.unit_forward[k]
                yield (out + fwd_peak, 0, kept_in[k]), 0, False
        for before, (tmp, g, saved) in zip((True, False), split[k] if split else segs[k][3]):
            if ckpt[k]:
                # Its input, and before the hook what the root's ops after the unit still hold; the
                # unit's own saved tensors exist only once the recomputation (after the hook) made
                # them again, in the backward phase: temporaries to the probes, as many still alive
                # as the traced run had at that instant.
                unit_saved = segs[k][1] - segs[k][5]
                if before:
                    saved = kept_in[k] + max(0, saved - unit_saved)
                else:
                    # (where the unit saves its input itself, the recompute saves the kept input again:
                    # counted once, in `saved`; its first op's backward, the last, frees it)
                    tmp, saved = tmp + max(0, min(saved, unit_saved) - segs[k][9]), kept_in[k]
            yield (tmp, g, saved), 0, before
        for w, at in bwd_kernels.get(k, ()):
            g = at[1] if kernel_grads else 0
            if ckpt[k]:
                yield (at[0] + at[2], g, acts[k]), w, False
            else:
                yield (at[0], g, at[2]), w, False

    accumulating = desc.backward_accumulating

    def instants_accumulating(k: int):
        """`instants` of a micro-step after the first of gradient accumulation, every .grad already there:
        ((transient, fresh, saved), workspace, before), `fresh` the new gradients made and not yet added in
        place into their .grad (ModuleDesc.backward_accumulating); a profile without them counts none,
        and a convolution's instant counts none."""
        if accumulating:
            yield from instants(k, accumulating, kernel_grads=False)
            return
        for (tmp, _g, saved), w, before in instants(k):
            yield (tmp, 0, saved), w, before

    # Gradients of the root's parameters made in another unit's segment: the root's own ops that run
    # after that unit (a decoder's final norm and LM head, after its last block) join its segment,
    # ahead of the unit's output gradient (the "before" instant). They stay alive until the root
    # reduces at the very end of backward (FSDP: the root's post-backward; DDP: .grad).
    # The gradients the segment's backward made (measured: the storages alive when the whole backward
    # ends) less its unit's own (in the traced dtype). A profile without that figure: the segment's
    # gradients at its before-hook instant, which misses a root gradient still autograd's transient at
    # that instant (a 16-bit LM head's at long sequences: Llama-3-8B's 1 GiB at 1024 tokens).
    traced_gb = 2 if prec.mixed and fsdp or train.precision == "bf16" else 4  # the trace's parameters' dtype
    numel = {u: sum(prod(s) for _, s in ps) for u, ps in desc.units}  # each unit's parameters, real shapes
    own_g = {u: n * traced_gb for u, n in numel.items()}
    root_g = [0 if s[0] == "root" else max(0, s[7] - own_g.get(s[0], 0)) if s[7] >= 0 else s[3][0][1]
              for s in segs]

    def root_grads(k: int, before: bool, g: int) -> int:
        """Bytes of root gradients alive at segment k's instant: those of the segments after it, plus
        this segment's so far (at its before-hook instant, `g` itself)."""
        return sum(root_g[k + 1:]) + (g if before else root_g[k])

    all_acts = sum(acts) + loss_act
    # Segment k's forward at its measured peak: the earlier segments' saved tensors plus what its own
    # forward holds (saved so far, its input, intermediates: a block's two branches before their sum);
    # the probes' tracker counts all of it as activations. Checkpointed: its input and its output.
    # Checkpointed, the transient its forward holds beyond what it saves and its input (the root's ops
    # after a decoder's last block: logits and their fp32 copy at the loss) is there too; and under
    # autocast the 16-bit casts of every checkpointed unit's weights so far stay in autocast's cache until
    # the forward ends (`autocast_mode.cpp` cached_casts), though the unit saves none of them.
    casts = _autocast_cast_bytes(desc) if every and _regime(train.precision, family).startswith("autocast") else {}
    cached = [sum(casts.get(x[0], 0) for x, c in zip(segs[:k + 1], ckpt) if c) for k in range(len(segs))]
    fwd_act = [sum(acts[:k + 1]) + max(0, s[4] - s[1] - s[2]) + cached[k] if c else sum(acts[:k]) + s[4] + cached[k]
               for k, (s, c) in enumerate(zip(segs, ckpt))]
    # (a checkpointed segment's output is a transient, unless the root's ops after the unit saved it: the MNIST
    # CNN's ReLUs, whose outputs are in `outside`; measured, zero3 fp32 over 2 micro-steps, +1.1% counting it twice)
    fwd_tmp = [inputs[k + 1] if c and k + 1 not in desc.saved_inputs else 0 for k, c in enumerate(ckpt)]
    loss_fwd = [] if every else [sum(acts) + s[4] for s in desc.segments if s[0] == "loss"]

    def fwd_instants(k: int):
        """Segment k's forward: its peak (no workspace), then each convolution's instant with its
        workspace, as (activations, temporaries, workspace); unmeasured, the peak bounds them."""
        yield fwd_act[k], fwd_tmp[k], 0
        for w, at in fwd_kernels.get(k, ()):
            yield (fwd_act[k], fwd_tmp[k], w) if ckpt[k] else (sum(acts[:k]) + at[0], 0, w)
    later, every_sync = train.grad_accum > 1, train.sync_every  # as memory.estimate_memory
    if not st.fsdp:
        unit_grad = {u: n * gb for u, n in numel.items()}
        base = dict(params=total * pb + buffers, optimizer=opt,
                    comm_buffers=total * gb if st.distributed else 0)
        if later:
            # Accumulation: every .grad is alive from the first micro-step on, later gradients added in
            # place (AccumulateGrad), synced or not (memory.estimate_memory's DDP walk).
            notes.append("gradient accumulation keeps every parameter's gradient between micro-steps")
            plain = snap

            def snap(phase, workspace=0, grads=0, **parts):  # noqa: F811
                plain(phase, workspace, grads=max(grads, total * gb) if phase != "optimizer" else grads, **parts)
        for k in range(len(segs)):
            for a, t, w in fwd_instants(k):
                snap("forward", w, **base, activations=a, temporaries=t)
        for a in loss_fwd:
            snap("forward", **base, activations=a)
        snap("forward", **base, activations=all_acts, temporaries=out_tmp)
        snap("backward", **base, activations=all_acts, temporaries=2 * out_tmp)
        reached: set = set()
        for k in range(len(segs) - 1, -1, -1):
            u = segs[k][0]
            own = unit_grad.get(u, 0) if u not in reached else 0
            reached.add(u)
            done = sum(unit_grad.get(x, 0) for x in reached if x != u)
            for (tmp, g, saved), w, before in (instants_accumulating(k) if later else instants(k)):
                if later:  # every .grad is kept (`snap` above); the new gradients not yet added in: temporaries
                    snap("backward", w, **base, activations=sum(acts[:k]) + saved, temporaries=tmp + g)
                    continue
                rg = root_grads(k, before, g)
                if u == "root":
                    mine = min(max(0, own - rg), g)
                else:  # after the hook, g also counts the root's gradients made before it
                    mine = 0 if before else min(own, max(0, g - root_g[k]))
                snap("backward", w, **base, activations=sum(acts[:k]) + saved,
                     grads=done + mine + (rg if u != "root" else min(rg, own)), temporaries=tmp)
        snap("optimizer", **base, grads=total * gb, temporaries=opt_tmp)
    else:
        udt = cb if prec.mixed else pb  # param_dtype of the unsharded unit
        red = 4 if prec.mixed else gb  # reduce_dtype
        sg = 4 if prec.mixed else gb  # sharded gradient (fp32 under mixed precision)
        reshard = st.reshard_after_forward and sharding
        shard_params = sum(v[0] for v in sizes.values())
        base = dict(params=shard_params * pb + buffers, optimizer=opt)
        # FSDP1's BatchNorm units keep fp32 (no mixed precision: `ModuleDesc.fp32_units`); so small they are
        # counted with the shards, not walked (their unsharded parameters and gradients live within their
        # parent unit's segment)
        unit_dt = {u: pb if u in desc.fp32_units else udt for u in sizes}
        unsh = {u: v[1] * unit_dt[u] for u, v in sizes.items()}
        if not sharding:  # NO_SHARD: only a 16-bit copy of the unit in use under mixed precision
            unsh = {u: (v[1] * cb if prec.mixed and u not in desc.fp32_units else 0) for u, v in sizes.items()}
        root = unsh.get("root", 0)
        order = [s[0] for s in segs if s[0] in sizes and s[0] != "root"]
        # Gradient accumulation (memory.estimate_memory's `carry`): what earlier micro-steps left in each
        # unit until the unit reduces on this (the last) micro-step: without sync its unsharded gradient
        # (FSDP1: param_dtype; FSDP2: reduce_dtype), synced every micro-step its shard (sg), NO_SHARD
        # its full flat gradient. FSDP2 in fp32 without sync adds the new gradients in place.
        if not later:
            unit_carry = {}
        elif not sharding:
            unit_carry = {u: v[1] * (red if every_sync else unit_dt[u]) for u, v in sizes.items()}
        elif every_sync:
            unit_carry = {u: v[0] * sg for u, v in sizes.items()}
        elif st.fsdp1:  # the padded flat gradient
            unit_carry = {u: v[1] * unit_dt[u] for u, v in sizes.items()}
        else:
            # FSDP2's are the unsharded parameters' own .grad, of their real shapes
            # (`FSDPParam.to_accumulated_grad_if_needed`), not the dim-0-padded all-gather size (measured:
            # Mixtral's experts at 16 fake ranks, 4 rows padded to 16, accumulating over 2 micro-steps: +62%
            # before)
            unit_carry = {u: numel[u] * red for u in sizes}
        in_place = later and not every_sync and sharding and st.fsdp2 and not prec.mixed
        if later:
            notes.append("gradient accumulation keeps " + ("sharded" if every_sync and sharding else "unsharded")
                         + " gradients of every unit between micro-steps")

        def carried(reduced) -> int:
            return sum(v for x, v in unit_carry.items() if x not in reduced)
        carry_now = [carried(())]  # the units that have not reduced yet, at the instant walked
        plain = snap

        def snap(phase, workspace=0, grads=0, **parts):  # noqa: F811
            plain(phase, workspace, grads=grads + (carry_now[0] if phase != "optimizer" else 0), **parts)
        held: list = []  # units unsharded and kept to backward (no reshard)
        # NO_SHARD under mixed precision frees each unit's 16-bit copy when it "reshards" after its forward
        # (`FlatParamHandle.post_reshard` -> `_free_low_precision_sharded_param`) and casts it again for
        # its backward: one unit's copy at a time, as memory.estimate_memory's `held`
        one_copy = not sharding and prec.mixed
        copied: set = set()  # FSDP2 units past their pre-forward copy-out
        for k, (u, *_) in enumerate(segs):
            cur = unsh.get(u, 0) if u != "root" else 0
            if u in sizes and u != "root" and not reshard and u not in held:
                if one_copy:
                    held[:] = [u]
                else:
                    held.append(u)
            nxt = next((x for x in order[order.index(u) + 1:]), None) if u in order else None
            pre = unsh.get(nxt, 0) if reshard and nxt else 0
            kept = sum(unsh[x] for x in held)
            # FSDP2 copies the unit's all-gather output out into its parameters and keeps that output
            # until the next unit's all-gather (`FSDPParamGroup._all_gather_result`; measured on the
            # CIFAR ResNet: only the current unit's is alive), the last one until the root's
            # post-forward (as the decoder walk's `ag_tail`).
            ag = cur if st.fsdp2 and sharding else 0
            if ag and u not in copied:
                # The unit's pre-forward copy-out (`FSDPParamGroup.wait_for_unshard`): the previous
                # group's all-gather output (the root's, for the first unit), dropped from
                # `comm_ctx.all_gather_state` but held by the local `prev_all_gather_state` until the
                # method returns, next to this unit's output and its copied-out parameters.
                prev = order[order.index(u) - 1] if order.index(u) > 0 else "root"
                snap("forward", **base, comm_buffers=root + (cur if reshard else kept) + ag + unsh.get(prev, 0),
                     activations=sum(acts[:k]) + inputs[k])
                copied.add(u)
            for a, t, w in fwd_instants(k):
                snap("forward", w, **base, comm_buffers=root + (cur + pre if reshard else kept) + ag,
                     activations=a, temporaries=t)
        kept_fwd = root + sum(unsh[x] for x in held)
        ag_tail = unsh.get(order[-1], 0) if st.fsdp2 and sharding and not reshard and order else 0
        for a in loss_fwd:
            snap("forward", **base, comm_buffers=kept_fwd + ag_tail, activations=a)
        snap("forward", **base, comm_buffers=kept_fwd + ag_tail, activations=all_acts, temporaries=out_tmp)
        # The root's pre-backward hook (on its outputs: it fires as backward starts) prefetches the last unit
        # when the root has parameters of its own: FSDP2 `FSDPParamGroup.pre_backward` -> `_backward_prefetch`,
        # FSDP1 `_pre_backward_hook` -> `_prefetch_handle` (BACKWARD_PRE). A root without parameters has no
        # group or handle: the last unit is all-gathered in its own hook.
        root_prefetch = unsh.get(order[-1], 0) if reshard and root and order else 0
        root_prefetch_copy = one_copy and "root" in sizes and sum(sizes["root"]) > 0
        snap("backward", **base, comm_buffers=kept_fwd + root_prefetch, activations=all_acts,
             temporaries=2 * out_tmp)
        def unit_grads_now(k: int, u: str, before: bool, g: int, g_unit: int) -> tuple[int, int]:
            """(gradient bytes of unit `u` and the root alive at a segment-k instant, those of them the probes'
            tracker counts as grads): FSDP2's unsharded parameters' .grad (read through
            FSDPParam._unsharded_param); FSDP1's view gradients wait in autograd's buffer (temporaries)."""
            rg = root_grads(k, before, g)
            if u == "root":  # its own gradients so far include those made in other segments
                mine = min(g_unit, max(g, rg))
            else:  # after the hook, g also counts the root's gradients made before it
                mine = (0 if before else min(g_unit, max(0, g - root_g[k]))) + rg
            return mine, mine if st.fsdp2 else 0

        reached = set()
        resharded: set = set()  # FSDP2 reshards each unit in its post-backward, before reducing
        # FSDP2 keeps a unit's reduce-scatter input until the next unit's post-backward replaces it
        # (`comm_ctx.reduce_scatter_state`), as the decoder walk's `rs_held`.
        rs_held = 0
        for k in range(len(segs) - 1, -1, -1):
            u = segs[k][0]
            first = u not in reached
            reached.add(u)
            if one_copy and u in sizes and u != "root":
                held[:] = [u]  # its 16-bit copy made again for its backward, the previous one freed
            in_use = unsh.get(u, 0) if u != "root" else 0
            prev = next((x for x in reversed(order[:order.index(u)])), None) if u in order else None
            # (NO_SHARD under mixed precision prefetches the unit before too: its 16-bit copy, made by
            # `_unshard` -> `pre_unshard` -> `_use_low_precision_shard`)
            pre = unsh.get(prev, 0) if (reshard or one_copy) and prev else 0
            fsdp1 = st.fsdp1
            g_unit = sizes[u][1] * udt if u in sizes and first else 0
            # The unit's reduction input: FSDP1 NO_SHARD all-reduces its flat gradient where the sharded
            # strategies reduce-scatter it (`_reduce_grad_no_shard`), at the same instant.
            rs = sizes[u][1] * red if u in sizes and first and (sharding or fsdp1) else 0
            done = [x for x in reached if x in sizes and x != u]
            carry_now[0] = carried(done)
            grads = (sum(sizes[x][0] for x in done) * sg if sharding
                     else sum(sizes[x][1] for x in done) * gb)
            kept_now = sum(unsh[x] for x in held if x not in resharded)
            unsharded = root + (in_use + pre if reshard else kept_now)
            unsharded_before = unsharded
            if reshard:
                # FSDP1's pre-backward hook (`_runtime_utils._pre_backward_hook`) unshards the unit and
                # prefetches the one before (BACKWARD_PRE); until it runs only what the unit after it
                # prefetched is there.
                # FSDP2's pre-backward hook (on the unit's outputs) copies the unit's all-gather output
                # out into its parameters, frees it and prefetches the unit before; until it runs (the
                # segment's ops after the unit's forward, ReLU, pooling, and segments without
                # parameters) the next unit's prefetched all-gather output is what is alive. The first
                # unit of the backward is all-gathered in its own hook, not prefetched.
                nxt = u if u in order else next((s[0] for s in reversed(segs[:k]) if s[0] in order), None)
                unsharded_before = root + (unsh[nxt] if nxt and (nxt != order[-1] or root_prefetch) else 0)
                if u not in order:
                    unsharded = unsharded_before
            elif one_copy and u in order:
                # the unit's copy is the one the unit after it prefetched (the last unit's: the root's, when
                # the root has parameters), then its hook prefetches the unit before (measured: the MNIST
                # CNN bf16-mixed on 8 fake ranks over 2 micro-steps, fc1's copy and conv3's at fc1's backward)
                unsharded_before = root + (in_use if u != order[-1] or root_prefetch_copy else 0)
                unsharded = root + in_use + pre
            # During the segment's backward, at its measured peaks: its saved tensors not yet freed,
            # the activation gradients alive, its parameters' gradients made so far (temporaries, as
            # the probes' tracker sees them: FSDP1's are views of the flat parameter waiting in
            # autograd's buffer, FSDP2's the unsharded parameters' .grad, read by no collective).
            for (tmp, g, saved), w, before in (instants_accumulating(k) if in_place else instants(k)):
                comm = unsharded_before if before else unsharded
                if in_place:
                    # every unit's .grad is kept (`carry_now`): the new gradients made and not yet added
                    # into it are temporaries (measured: Llama-3.2-1B's width at 2 layers, zero3 fp32 over 2
                    # micro-steps, the tied embedding's gradient, the head's and their sum alive at once
                    # next to the kept one: -17% when they were not counted)
                    mine, own_grads = g, 0
                else:
                    mine, own_grads = unit_grads_now(k, u, before, g, g_unit)
                snap("backward", w, **base, comm_buffers=comm + rs_held,
                     activations=sum(acts[:k]) + saved, grads=grads + own_grads,
                     temporaries=tmp + mine - own_grads)
            if later and not every_sync and u in sizes:
                # The first micro-step without sync, at the same instants: the units already reached keep
                # their unsharded gradients (`unit_carry`), none reduced, none resharded in backward
                # (FSDP1's SHARD_GRAD_OP keeps them unsharded: `_should_free_in_backward`), nothing carried from
                # before. Measured: the CIFAR ResNet, every FSDP strategy in fp32 over 2 micro-steps with full
                # checkpointing, its peak at layer1's recomputation of the first micro-step, next to the
                # unsharded gradients of layer2, layer3 and fc (the later units are the larger in a CNN).
                kept_first = sum(unit_carry.get(x, 0) for x in done)
                # (FSDP2 reshards a unit after its backward without sync too: reshard_after_backward)
                held_first = root + (in_use + pre if reshard else
                                     sum(unsh[x] for x in held if st.fsdp1 or x not in done))
                for (tmp, g, saved), w, before in instants(k):
                    mine, own_grads = unit_grads_now(k, u, before, g, g_unit)
                    plain("backward", w, **base, comm_buffers=unsharded_before if before and reshard else held_first,
                          activations=sum(acts[:k]) + saved, grads=kept_first + own_grads,
                          temporaries=tmp + mine - own_grads)
            if rs:
                if not every_sync and st.fsdp2:  # `post_backward` collects the accumulated gradient
                    carry_now[0] = carried(done + [u])
                # The unit's post-backward: its backward is over (its saved tensors and its output's
                # gradient are freed). FSDP2 reshards the unit, then reduces (`FSDPParamGroup.
                # post_backward`). FSDP1 is measured (MNIST CNN, gloo and fake process group alike) with
                # its flat parameter still unsharded and no extra copy at this point, and is walked so.
                if st.fsdp2 and u != "root":
                    resharded.add(u)
                    unsharded = root + (pre if reshard else sum(unsh[x] for x in held if x not in resharded))
                elif st.fsdp2:  # the root too: its post-backward reshards before it reduces
                    unsharded = 0
                # The root's gradients made so far wait for the root's own reduction at the end.
                rg = root_grads(k, False, 0) if u != "root" else 0
                if fsdp1 and u == "root":
                    # The root's post-backward runs after every other unit's (the end of backward):
                    # `_post_backward_hook` reshards first (`_post_backward_reshard`; the root too
                    # frees its unsharded flat parameter, `_should_free_in_backward`), casts
                    # flat_param.grad to reduce_dtype under mixed precision (the 16-bit gradient
                    # stays alive as `autograd_computed_grad` to the hook's end) and `_reduce_grad`
                    # reduce-scatters into a new shard. Before it, at the root's last AccumulateGrad,
                    # the view gradients and their concatenation (flat_param.grad) are both alive next
                    # to the unsharded flat parameter. Measured (fake process group of 8, untied 65K
                    # vocabulary: the root dominates): fp32 peaks at the concatenation, bf16-mixed at
                    # the reduce (16-bit gradient + fp32 input + fp32 shard). NO_SHARD keeps its flat
                    # parameter but frees the 16-bit copy mixed precision made (`post_reshard` ->
                    # `_free_low_precision_sharded_param`) and all-reduces the cast gradient in place.
                    # (`ends` of the root, the last segment, is what its first op held: a tied head's
                    # gradient and the embedding's, summed into the view gradient, g_unit, by now; as at
                    # FSDP2's root below. Measured: a tied Llama of 64K vocabulary, fsdp and fsdp-grad-op
                    # fp32 on 8 fake ranks, where counting them put this instant 11-14% above the peak)
                    snap("backward", **base, comm_buffers=unsharded + g_unit, activations=sum(acts[:k]),
                         grads=grads, temporaries=g_unit)
                    out = sizes[u][0] * red if sharding else 0
                    if not every_sync:  # the accumulated flat gradient is the reduction's input
                        carry_now[0] = carried(done + [u])
                    # on gloo the output shard is a buffer the collective writes and the input is split once
                    # more (memory.estimate_memory's root reduce-scatter; measured on gloo, 2 ranks)
                    gloo = backend == "gloo" and sharding
                    # (the tied head's gradient, in `ends` at the embedding's last op, is summed into the
                    # flat gradient by now)
                    snap("backward", **base, comm_buffers=unsharded - root + rs + (out if gloo else 0),
                         activations=sum(acts[:k]), grads=grads + (0 if gloo else out),
                         temporaries=(g_unit if prec.mixed else 0) + (rs if gloo else 0))
                elif fsdp1:
                    # The view gradients are concatenated into flat_param.grad (both alive), which is
                    # the reduce-scatter (NO_SHARD: all-reduce) input unless mixed precision casts it
                    # to reduce_dtype first. Accumulating without sync, the flat gradient kept from the
                    # earlier micro-steps (`carry_now`) takes the concatenation in place: a temporary
                    # (measured: the MNIST CNN, fsdp fp32 over 2 micro-steps on 8 fake ranks); so does
                    # NO_SHARD's reduced gradient, kept as the flat gradient when each micro-step syncs.
                    into = later and (not every_sync or not sharding) and u in unit_carry
                    snap("backward", **base, comm_buffers=unsharded + (0 if into else g_unit),
                         activations=sum(acts[:k]), grads=grads, temporaries=ends[k] + g_unit * (1 + into) + rg)
                    if sharding and u != "root" or one_copy:
                        # freed by `_post_backward_reshard` (`_should_free_in_backward`: FULL_SHARD and
                        # SHARD_GRAD_OP alike when gradients sync): later units no longer hold it. NO_SHARD
                        # under mixed precision frees its 16-bit copy there (`post_reshard` ->
                        # `_free_low_precision_sharded_param`; measured: the MNIST CNN's fc1 bf16-mixed on 8
                        # fake ranks, +1.9% on the peak while the segments after it still held the copy)
                        resharded.add(u)
                        if one_copy and prev:
                            held[:] = [prev]  # the copy its hook prefetched, alive to the unit before's backward
                    if prec.mixed:
                        # `_runtime_utils._post_backward_hook` reshards first (the unit's 16-bit unsharded
                        # flat parameter goes, sharded strategies), then casts flat_param.grad to
                        # reduce_dtype (the 16-bit gradient stays alive as `autograd_computed_grad` to the
                        # hook's end) and `_reduce_grad` reduce-scatters it into a new shard (NO_SHARD:
                        # all-reduces it in place). Measured: a transformers Llama (width 1024, 4 and 8 blocks,
                        # vocabulary 2048, 256 tokens) bf16-mixed on 8 fake ranks, this instant exact;
                        # counting the cast next to the unsharded parameter was 19% above
                        # (benchmarks/results/cpu-torch2.13-2026-11-24-blockpeak-hf.jsonl).
                        after = root + (pre if reshard or one_copy else
                                        sum(unsh[x] for x in held if x not in resharded))
                        # the new shard: the unit's gradient shard, unless an earlier micro-step's is kept
                        # (`_accumulate_sharded_grad` adds it into `_saved_grad_shard`, and it goes)
                        out = sizes[u][0] * red if sharding else 0
                        added = later and every_sync
                        snap("backward", **base, comm_buffers=after + rs + (out if added else 0),
                             activations=sum(acts[:k]), grads=grads + (0 if added else out),
                             temporaries=ends[k] + g_unit + rg)
                else:
                    # FSDP2 `foreach_reduce` (_fsdp_collectives.py): the unsharded gradients are copied
                    # into the reduce-scatter input and freed only then (`unsharded_grads.clear()`);
                    # next the output (one shard of the input) is allocated and the collective runs,
                    # gloo's reduce-scatter copying its input once more.
                    end = 0 if u == "root" else ends[k]  # a tied head's gradient is summed in by then
                    snap("backward", **base, comm_buffers=unsharded + rs, activations=sum(acts[:k]),
                         grads=grads + rg, temporaries=end + g_unit)
                    split = rs if backend == "gloo" else 0
                    # through torch 2.14 the last parameter's unsharded gradient stays, held by
                    # `foreach_reduce`'s loop variable until it returns (an untied LM head's, V x h, at
                    # the root; config.fsdp2_reduce_keeps_last_grad)
                    last_g = (prod(desc.unit_shapes(u)[-1]) * udt
                              if u in sizes and fsdp2_reduce_keeps_last_grad(train) else 0)
                    snap("backward", **base, comm_buffers=unsharded + rs + sizes[u][0] * red,
                         activations=sum(acts[:k]), grads=grads + rg, temporaries=end + split + last_g)
                    rs_held = rs
        k = next((i for i, s_ in enumerate(segs) if s_[0] == "root"), None)  # the root's last backward segment
        if later and not every_sync and sharding and st.fsdp1 and "root" in sizes and k is not None:
            # The first micro-step, without sync, at the root's last gradients (memory.estimate_memory walks
            # the same instant): every other unit's unsharded flat gradient is kept, none reduced, nothing
            # accumulated yet, and SHARD_GRAD_OP has freed no unit (`_should_free_in_backward` is False
            # without sync). Measured: Qwen2.5-0.5B at 8 layers, fsdp-grad-op fp32 over 2 micro-steps, its
            # tied 152K-vocabulary gradients next to every unit's: -4.69% without it.
            carry_now[0] = 0
            comm = root + (0 if reshard else sum(unsh[x] for x in held))
            kept_grads = sum(v[1] for x, v in sizes.items() if x != "root") * udt
            g_root = sizes["root"][1] * udt
            for (tmp, g, saved), w, before in instants(k):
                snap("backward", w, **base, comm_buffers=comm, activations=sum(acts[:k]) + saved,
                     grads=kept_grads, temporaries=tmp + min(g_root, max(g, root_grads(k, before, g))))
            snap("backward", **base, comm_buffers=comm + g_root, activations=sum(acts[:k]), grads=kept_grads,
                 temporaries=g_root)
        if (later and not every_sync and sharding and st.fsdp2 and prec.mixed and desc.tied
                and "root" in sizes and fsdp2_first_microstep_grads_in_reduce_dtype(train)):
            # torch 2.15, the first micro-step without sync (from the second step on; memory.estimate_memory
            # walks the same instant): its gradients land in reduce_dtype, so at the tied embedding's
            # backward its gradient and the head's are fp32 copies and their sum a third, next to every
            # other unit's unsharded gradient of this micro-step and the root's others; nothing accumulated
            # yet, every unit but the root resharded. Measured: GPT-2 medium, zero3 bf16-mixed over 2
            # micro-steps on 8 fake ranks, 15% above the peak walked without it.
            carry_now[0] = 0
            tied = sum(desc.tied)
            others = sum(n for u, n in numel.items() if u != "root") + max(0, numel["root"] - tied)
            snap("backward", **base, comm_buffers=root, grads=others * red, temporaries=3 * tied * red)
        grads_end = shard_params * sg if sharding else total * gb
        snap("optimizer", **base, grads=grads_end, temporaries=opt_tmp)

    if _TRACE_SNAPSHOTS is not None:  # debugging: every instant the walk looked at
        _TRACE_SNAPSHOTS[:] = snaps
    peak = max(snaps, key=lambda s: s.total)
    library = library_workspace_bytes(train, cluster.gpu_name, desc.linear_bias) if device == "cuda" else 0
    peak_allocated = max(s.total + e for s, e in zip(snaps, extra)) + library
    workspace = peak_allocated - peak.total
    # The reserved peak: the traced step's own allocations replayed through the caching allocator where
    # they are written (logged_module_events); a Hugging Face model whose own run is not written, or whose
    # embeddings are tied, pairs with the analytic front end's replay (module_result, pair_tied,
    # pair_reserved); else the allocated peak plus the margin
    # (memory.RESERVED_MARGIN). `reserved_source` says which.
    events = (logged_module_events(desc, train, family, world, shard, library, ws, rank, st.name, init)
              if device == "cuda" else None)
    # The CUDA context and each NCCL communicator's buffers (footprint.py); none on gloo or fake.
    fp = device_footprint(cluster, world if backend == "nccl" else 1, st.shard_group)
    return MemoryEstimate(st.name, dict(peak.parts), peak_allocated, peak.phase, fp.total,
                          cluster.gpu_memory_bytes, notes, workspace, footprint=fp,
                          reserved_replay=("events", events, train.alloc_conf) if events else None)


def logged_module_events(desc: ModuleDesc, train: "ModuleTrain", family: str, world: int, shard: int,
                         workspace: int = 0, conv_workspaces: dict | None = None,
                         rank: int | None = None, strategy: str = "", init: str = "device") -> tuple | None:
    """The events of the module's run (alloc_trace.logged_step_events; zero2 / zero3 sharded over more than
    one rank: alloc_trace.logged_fsdp2_events; FSDP1: alloc_trace.logged_fsdp1_events, the units'
    collectives where the trace marked FSDP's hooks) from its traced step's allocations, as a tuple (replay
    results are remembered by it; under activation checkpointing the log of the checkpointed trace,
    `ModuleDesc.alloc_log_every`; pure bf16: the cast after construction from `ModuleDesc.construct_built`);
    None where they are not written: FSDP2 on one rank, FSDP2 accumulating under mixed precision where the
    installed torch makes the first micro-step's gradients in fp32 (2.15), a log traced without the run's
    checkpointing,
    optimizers outside alloc_trace.LOGGED_OPTIMIZERS, and a profile
    without a log (another batch than the traced). `init` "device": the model built on the device, then
    wrapped (what the probes do); "meta": under FSDP built on the meta device and only this rank's shards
    materialized (alloc_trace.logged_fsdp2_events / logged_fsdp1_events `meta`: what a plan of a large model
    assumes, as the analytic front end's)."""
    pure, mixed = train.precision == "bf16", train.precision in ("bf16-mixed", "fp16-mixed")
    if (not desc.alloc_log or not desc.construct or train.optimizer not in LOGGED_OPTIMIZERS
            or train.precision not in ("fp32", "bf16-mixed", "fp16-mixed", "bf16")
            or (pure and not desc.construct_built) or checkpoint_every(train.checkpointing) != desc.alloc_log_every):
        return None
    built = desc.construct_built if pure else ()
    if (strategy in LOGGED_FSDP2 and mixed and train.grad_accum > 1 and not train.sync_every
            and fsdp2_first_microstep_grads_in_reduce_dtype(train)):
        return None  # torch 2.15's fp32 gradients of the first micro-step (the walk has them; the writer does not)
    if strategy in LOGGED_FSDP2 and shard > 1 and desc.alloc_grads and desc.construct_names:
        return tuple(logged_fsdp2_events(desc.construct, desc.construct_names, desc.alloc_log, desc.alloc_grads,
                                         desc.units, (desc.batch_bytes,) * train.grad_accum, shard,
                                         get_strategy(strategy).reshard_after_forward, mixed, train.optimizer,
                                         train.optimizer_impl, train.grad_accum, train.sync_every,
                                         fsdp2_reduce_keeps_last_grad(train), workspace, conv_workspaces,
                                         built, 2 if pure else 4, init == "meta"))
    if strategy in LOGGED_FSDP1 and desc.alloc_grads and desc.construct_names:
        return tuple(logged_fsdp1_events(desc.construct, desc.construct_names, desc.alloc_log, desc.alloc_grads,
                                         desc.units, (desc.batch_bytes,) * train.grad_accum, shard, strategy,
                                         mixed, desc.fp32_units, train.optimizer,
                                         train.optimizer_impl, train.grad_accum, train.sync_every, workspace,
                                         conv_workspaces, built, 2 if pure else 4, init == "meta"))
    if family not in LOGGED_FAMILIES:
        return None
    prec = train.prec
    shapes = desc.all_shapes()
    owned = _zero1_owned(shapes, shard, rank) if family == ZERO1 and shard > 1 else shapes
    autocast = mixed
    total = sum(prod(s) for s in shapes)
    buckets = (total * prec.grad_bytes,) if family in (DDP, ZERO1) else ()
    rebuilt = tuple(ddp_buckets(desc, prec.grad_bytes, DDP_BUCKET_CAP_MB, autocast)) if buckets else ()
    return tuple(logged_step_events(desc.construct, desc.alloc_log, desc.alloc_kept,
                                    (desc.batch_bytes,) * train.grad_accum, family, world,
                                    tuple(prod(s) * prec.param_bytes for s in owned), train.optimizer,
                                    train.optimizer_impl, train.grad_accum, buckets, rebuilt,
                                    tuple(sum(sizes) for _, sizes in desc.buffers), workspace,
                                    conv_workspaces, built))


_TRACE_SNAPSHOTS: list | None = None
"""Set to a list to receive every Snapshot of the next `estimate_module_memory` walk (debugging)."""

DDP_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024
"""`DistributedDataParallel.broadcast_bucket_size` (torch/nn/parallel/distributed.py)."""


# -- communication -----------------------------------------------------------------------------

def ready_order_sizes(desc: ModuleDesc, autocast: bool = False) -> list[int]:
    """The traced gradient-ready order, else comm.grad_ready_order over the module's parameters."""
    if desc.grad_ready:
        return list(desc.grad_ready)
    return grad_ready_order(((name, shape) for _, ps in desc.units for name, shape in ps), autocast)


def ddp_buckets(desc: ModuleDesc, elem_bytes: int, bucket_cap_mb: int | None = DDP_BUCKET_CAP_MB,
                autocast: bool = False) -> list[int]:
    """comm.bucket_sizes on the module's ready order."""
    return list(bucket_sizes(ready_order_sizes(desc, autocast), elem_bytes, bucket_cap_mb))


def module_collectives(desc: ModuleDesc, train: ModuleTrain, cluster: Cluster, strategy: str) -> list[Collective]:
    """One optimizer step's collectives for the module (comm._raw_schedule's rules, real unit sizes)."""
    st = get_strategy(strategy)
    if not st.distributed:
        return []
    world, g = cluster.gpus, cluster.local_size
    A = train.grad_accum
    R = A if train.sync_every else 1  # micro-steps that reduce (comm._raw_schedule)
    pdt = {"fp32": "float32", "bf16-mixed": "bfloat16", "fp16-mixed": "float16", "bf16": "bfloat16"}[train.precision]
    gdt = "bfloat16" if train.precision == "bf16" else "float32"
    nbytes = _FLOAT_BYTES
    pb, gb = nbytes[pdt], nbytes[gdt]
    raw: dict[tuple, int] = {}

    def add(op, group, n, dtype, msg, calls, phase, unit):
        if calls > 0 and msg > 0:
            key = (op, group, n, dtype, int(msg), phase, unit)
            raw[key] = raw.get(key, 0) + int(calls)

    units = [(u, tuple(s for _, s in ps)) for u, ps in desc.units]
    if st.ddp_reducer:
        buckets = ddp_buckets(desc, gb, autocast=train.precision in ("bf16-mixed", "fp16-mixed"))
        for b in buckets[:-1]:
            add("all_reduce", "world", world, gdt, b, R, "backward", "bucket")
        add("all_reduce", "world", world, gdt, buckets[-1], R, "backward", "last_bucket")
        # DDP broadcasts the module's buffers (BatchNorm statistics) from rank 0 before a forward that
        # follows a synchronised forward (`_check_sync_bufs_pre_fwd`; `_post_forward` sets
        # `require_forward_param_sync` only outside no_sync): once per optimizer step however many
        # no_sync micro-steps it has, or once per micro-step when each one syncs. `_broadcast_coalesced` sends
        # one message per dtype (measured, CPU and H100); past `broadcast_bucket_size` (250 MiB) of
        # buffers the split is assumed to close a bucket once it reaches that size (not measured).
        for dtype, sizes in desc.buffers:
            bucket = 0
            for n in sizes:
                bucket += n
                if bucket >= DDP_BROADCAST_BUCKET_BYTES:
                    add("broadcast", "world", world, dtype, bucket, R, "forward", "buffers")
                    bucket = 0
            add("broadcast", "world", world, dtype, bucket, R, "forward", "buffers")
        if st.zero_optimizer:
            sdt = "bfloat16" if train.precision == "bf16" else "float32"
            for n in ready_order_sizes(desc):
                add("broadcast", "world", world, sdt, n * nbytes[sdt], 1, "optimizer", "param")
    elif st.fsdp2:
        for u, shapes in units:
            n = sum(-(-s[0] // world) * world * prod(s[1:]) if s else world for s in shapes)
            kind = "root" if u == "root" else "unit"
            add("all_gather", "world", world, pdt, n * pb, A, "forward", kind)
            # The root is not resharded after forward (`FSDPState._lazy_init`: fully_shard's default
            # reshard_after_forward=None leaves the root's post_forward_mesh_info None).
            if st.reshard_after_forward and u != "root":
                add("all_gather", "world", world, pdt, n * pb, A, "backward", kind)
            add("reduce_scatter", "world", world, gdt, n * gb, R, "backward", kind)
    else:  # fsdp1
        shard_n, group = (min(world, g), "intra_node") if st.hybrid else (world, "world")
        # A BatchNorm unit inside a checkpointed unit is all-gathered once more in backward when its parent
        # recomputes: its forward runs again after it was resharded (measured: the CIFAR ResNet, fsdp and hsdp
        # bf16-mixed under full checkpointing, 3 all-gathers of each BatchNorm unit per step)
        every = checkpoint_every(train.checkpointing)
        regs = [u for u, ps in desc.units if ps and u != "root" and u not in desc.fp32_units]
        recomputed = set(regs[::every]) if every else set()

        def in_recomputed(u: str) -> bool:
            return any(u.startswith(p + ".") for p in recomputed)
        for u, shapes in units:
            n = sum(prod(s) for s in shapes)
            kind = "root" if u == "root" else "unit"
            if st.fsdp_no_shard:
                add("all_reduce", "world", world, gdt, n * gb, R, "backward", kind)
                continue
            flat = -(-n // shard_n) * shard_n
            # a BatchNorm unit under mixed precision gathers its fp32 parameters (`ModuleDesc.fp32_units`)
            udt = "float32" if u in desc.fp32_units else pdt
            add("all_gather", group, shard_n, udt, flat * nbytes[udt],
                1 if not st.reshard_after_forward and not train.sync_every else A, "forward", kind)
            if st.reshard_after_forward and u != "root":
                add("all_gather", group, shard_n, udt, flat * nbytes[udt], A * (2 if in_recomputed(u) else 1),
                    "backward", kind)
            add("reduce_scatter", group, shard_n, gdt, flat * gb, R, "backward", kind)
            if st.hybrid:
                add("all_reduce", "inter_node", max(1, world // shard_n), gdt, flat // shard_n * gb, R,
                    "backward", kind)
    return timed_collectives([(op, group, n, dtype, msg, calls, phase, unit)
                              for (op, group, n, dtype, msg, phase, unit), calls in raw.items()], cluster)


def census_seconds(c: tuple, gpu, precision: str, backward: bool, sm_bound: bool = False) -> float:
    """GPU seconds of the kernels one census entry counts (`ModuleDesc.census`), by what bounds each, as
    `kernels.kernel_times` times a decoder's: GEMMs and convolutions by FLOPs at the matmul rate of the
    precision plus the fixed time each GEMM loses to tiles and waves, fused attention at the GPU's forward or
    backward attention efficiency, every other kernel by the bytes it moves at the achievable HBM bandwidth,
    and each kernel's launch overhead. `sm_bound`: the GEMMs' and attention's seconds only (the kernels
    that need whole SMs, `compute.sm_bound_share`). Under a 16-bit precision the GEMMs that ran on fp32
    inputs (`fp32_gemm_flops`: autocast leaves ops off its lists in fp32) take the fp32 matmul rate."""
    gemm_flops, gemms, attention, nbytes, kernels = c[:5]
    peak, rate, fixed = matmul_rates(gpu.flops, gpu.matmul_efficiency, gpu.matmul_half_efficiency_flop, precision)
    att = peak * (gpu.attention_backward_efficiency if backward else gpu.attention_efficiency)
    wide = c[6] if precision != "fp32" else 0.0
    busy = (gemm_flops - wide) / rate + gemms * fixed + attention / att
    if wide:
        busy += wide / matmul_rates(gpu.flops, gpu.matmul_efficiency, gpu.matmul_half_efficiency_flop, "fp32")[1]
    if sm_bound:
        return busy
    return busy + nbytes / (gpu.hbm_bytes_per_s * gpu.hbm_efficiency) + kernels * gpu.kernel_overhead_s


def traced_compute(desc: ModuleDesc, train: ModuleTrain, gpu, sm_bound: bool = False) -> tuple[float, float, float]:
    """(forward, backward with its recompute, host) seconds of one micro-step from the traced kernels: the
    forward and backward of every segment, the forward of each checkpointed unit again in backward, and the
    host's time to issue every ATen op (`gpu.host_op_s` each: a step is never faster than its host).
    `sm_bound`: forward and backward count GEMMs and attention only (`census_seconds`)."""
    every = checkpoint_every(train.checkpointing)
    unit_names = [s[0] for s in desc.segments if s[0] not in ("root", "loss")]
    again = set(unit_names[::every]) if every else set()
    fwd = bwd = ops = 0.0
    for seg, (f, b, own) in zip(desc.segments, desc.census):
        fwd += census_seconds(f, gpu, train.precision, False, sm_bound)
        bwd += census_seconds(b, gpu, train.precision, True, sm_bound)
        ops += f[5] + b[5]
        if seg[0] in again:
            bwd += census_seconds(own, gpu, train.precision, False, sm_bound)
            ops += own[5]
    return fwd, bwd, ops * gpu.host_op_s


def module_time(desc: ModuleDesc, train: ModuleTrain, cluster: Cluster, collectives: list,
                gpu, st: Strategy) -> ModuleTime:
    """One optimizer step: compute, the communication it cannot hide, and the optimizer step.

    Compute: `traced_compute` per micro-step (the longer of the GPU's time and the host's), plus the
    optimizer step's passes over this rank's parameters by bytes (compute._optimizer_bytes).
    Communication in forward/backward hides behind that phase's compute, except the last bucket or unit of
    backward and the optimizer-phase broadcasts, which nothing follows; while it overlaps, the SMs NCCL
    holds slow the GEMMs and attention (`compute.contention`, as `compute.exposed_comm` charges it)."""
    fwd_s, bwd_s, host_s = traced_compute(desc, train, gpu)
    compute = train.grad_accum * max(fwd_s + bwd_s, host_s)
    fwd_share = fwd_s / (fwd_s + bwd_s) if fwd_s + bwd_s > 0 else 1 / 3
    optimizer = _optimizer_bytes(train, _owned_elems(train, cluster, st)) / (gpu.hbm_bytes_per_s * gpu.hbm_efficiency)
    # the host issues the optimizer's ops too (kernels.optimizer_host_ops): FSDP1 steps a flat parameter per unit
    tensors = (len(desc.units) if st.fsdp1 else sum(len(params) for _, params in desc.units))
    optimizer = max(optimizer, optimizer_host_ops(train, tensors) * gpu.host_op_s)
    fwd = sum(c.time_s for c in collectives if c.phase == "forward")
    # the last bucket's or the root's reduction, exposed on each micro-step that reduces
    reducing = train.grad_accum if train.sync_every else 1
    bwd_tail = sum(c.time_s / max(1, c.calls) * reducing for c in collectives
                   if c.phase == "backward" and c.unit in ("last_bucket", "root"))
    bwd = sum(c.time_s for c in collectives if c.phase == "backward") - bwd_tail
    opt = sum(c.time_s for c in collectives if c.phase == "optimizer")
    lost_f = lost_b = 0.0
    if fwd + bwd > 0 and fwd_s + bwd_s > 0:
        busy = sum(traced_compute(desc, train, gpu, sm_bound=True)[:2]) / (fwd_s + bwd_s)
        cont = contention(cluster, st, gpu, busy)
        if cont is not None:
            lost_f = sum(cont.lost(c.group) * c.time_s for c in collectives if c.phase == "forward")
            # the tail (last bucket, root) runs after the backward's compute: it slows nothing
            lost_b = sum(cont.lost(c.group) * c.time_s * (1 - min(c.calls, reducing) / max(1, c.calls)
                                                          if c.unit in ("last_bucket", "root") else 1)
                         for c in collectives if c.phase == "backward")
    exposed = (max(0.0, fwd - compute * fwd_share, lost_f) + max(0.0, bwd - compute * (1 - fwd_share), lost_b)
               + bwd_tail + opt)
    step = compute + exposed + optimizer
    samples = desc.batch * train.grad_accum * cluster.gpus * train.tokens_per_sample
    peak = matmul_rates(gpu.flops, gpu.matmul_efficiency, gpu.matmul_half_efficiency_flop, train.precision)[0]
    model_flops = 3 * desc.forward_flops * train.grad_accum  # no recompute: MFU, as compute.model_flops
    return ModuleTime(compute, sum(c.time_s for c in collectives), exposed, step,
                      samples / step if step > 0 else 0.0,
                      model_flops / (step * peak) if step > 0 else 0.0, optimizer)


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
        ] + [f"note: {x}" for x in self.notes]

    @property
    def recommendation(self):
        return module_recommend(self)

    def evaluate_on(self, cluster: Cluster, name: str) -> StrategyResult:
        """The traced workload under strategy `name` on another cluster (Plan.evaluate_on), as the plan's own
        results were made; where the trace's own run is not written, the reserved peak paired with the analytic
        twin's on that cluster."""
        gpu = load_catalog(tuple(cluster.catalog_dirs)).gpu(cluster.gpu_name)
        twin = analytic_twins(self.kw, cluster)[0] if self.twin is not None and self.kw else None
        hf = bool(self.kw and self.kw.get("hf_config") and not self.kw.get("module"))
        r = module_result(self.descs, self.train, cluster, name, gpu, self.workspaces, twin, self.desc.batch,
                          "meta" if hf else "device")
        if twin is not None:
            pair_reserved(r.memory, twin(name, self.desc.batch))
        return r

    def to_dict(self) -> dict:
        rec = self.recommendation
        d = self.desc
        inputs = {"module": self.train.model.factory, "model": self.train.model.to_dict(),
                  "model_params": d.param_count(), "train": self.train.to_dict(),
                  "cluster": self.cluster.to_dict(), "notes": list(self.notes),
                  "profile": {regime: {"activation_bytes": x.activation_bytes, "output_bytes": x.output_bytes,
                                       "buffers_bytes": x.buffers_bytes, "forward_flops": x.forward_flops,
                                       "segments": [list(s) for s in x.segments]}
                              for regime, x in self.descs.items()}}
        return {"inputs": inputs, "strategies": [r.to_dict() for r in self.results],
                "recommendation": rec.to_dict()}


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


def _regime(precision: str, family: str, batchnorm: bool = False) -> str:
    """workload.trace dtype for a precision recipe and family (activations.regime_for's rule); `batchnorm`: the
    module has BatchNorm layers, which FSDP1's mixed precision runs apart in fp32 (the "fsdp1-*" regimes)."""
    if precision == "fp32":
        return "float32"
    low = "float16" if precision == "fp16-mixed" else "bfloat16"
    if precision == "bf16":
        return "bfloat16"
    if family == FSDP1 and batchnorm:
        return f"fsdp1-{low}"
    return f"fsdp-{low}" if family in (FSDP1, FSDP2) else f"autocast-{low}"


def _desc_for(descs: dict, precision: str, family: str) -> ModuleDesc:
    """The traced description a strategy of `family` plans from: FSDP1's own regime for a module with
    BatchNorm under mixed precision where it was traced, else the family's regime."""
    plain = descs[_regime(precision, family)]
    return descs.get(_regime(precision, family, plain.batchnorm), plain)


FSDP2_BATCHNORM_ERRORS = ("Expected running_mean to have type", "expected scalar type BFloat16 but found Float",
                          "expected scalar type Half but found Float")
"""What batch_norm raises for 16-bit weights with fp32 running statistics (CUDA; the CPU, bf16 and fp16)."""


def fsdp2_batchnorm_failure(desc: ModuleDesc, precision: str) -> str | None:
    """Why FSDP2 cannot train the module as the probes wrap it, or None: BatchNorm under 16-bit mixed
    precision. `MixedPrecisionPolicy(param_dtype)` casts BatchNorm's weight and bias to 16 bits while its
    running statistics (buffers, which fully_shard does not cast) stay fp32, and batch_norm refuses the mix
    (CUDA: "Expected running_mean to have type BFloat16"; CPU: "expected scalar type BFloat16 but found
    Float"; measured by the H100 and CPU probes of the CIFAR ResNet)."""
    if not desc.batchnorm or precision not in ("bf16-mixed", "fp16-mixed"):
        return None
    return ("FSDP2 casts BatchNorm's weights to 16 bits but not its fp32 running statistics, which batch_norm "
            "refuses (expected running_mean to have type BFloat16); give each BatchNorm module its own "
            "fully_shard with MixedPrecisionPolicy(param_dtype=torch.float32), or use fsdp (FSDP1 runs "
            "BatchNorm apart in fp32)")


def module_recommend(plan: ModulePlan):
    """recommend.recommend's rule, with the largest batch from the module's linear scaling."""
    results = plan.results
    ok = [r for r in results if _headroom_ok(r)] or [r for r in results if r.fits_cleanly]

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
    return Recommendation(best.name, reasons, lo)


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


def module_spec_plan(kw: dict, strategies=()) -> ModulePlan:
    """Plan a traced workload for every strategy (or `strategies`): `kw["module"]` (PKG.MOD:FACTORY) at
    `kw["input_shape"]`, or `kw["hf_config"]` (a Hugging Face causal LM) at `micro_batch` x `seq_len`.

    `kw` holds the `estimate` command's options (see from_flags.build_plan). Raises ValueError naming the flag.
    """
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

    cluster, notes = resolve_cluster(kw.get("gpus"), kw.get("gpus_per_node"), kw.get("gpu"), kw.get("gpu_mem"),
                                     kw.get("node"), kw.get("intra"), kw.get("inter"), kw.get("nics_per_node"),
                                     kw.get("inter_gbps"), kw.get("detect_local", True),
                                     tuple(kw.get("catalog_dirs") or ()))
    names = list(strategies) or [n for n in NAMES if get_strategy(n).distributed or cluster.gpus == 1]
    if cluster.gpus == 1 and not strategies:
        names = ["single"]
    names, conflicts = drop_conflicts(names, kw.get("optimizer") or "adamw", bool(strategies))
    notes.extend(conflicts)

    descs: dict[str, ModuleDesc] = {}
    failed: dict[str, str] = {}  # regime -> the trace's one-line error
    profile_s = 0.0
    unrunnable: dict[str, str] = {}  # strategy -> why PyTorch cannot train the module so

    def trace(regime: str) -> None:
        nonlocal profile_s
        if regime in descs or regime in failed:
            return
        try:
            prof = profile(work, regime, "cuda")  # a plan is for GPUs: the bytes CUDA's kernels keep
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
                ck = profile(work, regime, "cuda", every)
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
    fsdp_names = [n for n in names if get_strategy(n).fsdp]
    if hf and fsdp_names:
        notes.append(f"{', '.join(fsdp_names)}: the model built on the meta device and wrapped there, each rank then "
                     f"making only what FSDP keeps (torchtitan's way), as `distplan validate --hf-config` probes it")

    workspaces, local = kernel_workspaces(descs.values())
    if any(d.kernel_args for d in descs.values()):
        if workspaces:
            notes.append(f"cuDNN convolution workspaces measured on this machine's {local}: up to "
                         f"{max(workspaces.values()) / 2**20:.1f} MiB (they depend on the GPU and cuDNN version)")
        else:
            notes.append("cuDNN convolution workspaces not counted: they depend on the kernel cuDNN picks on the "
                         "GPU; plan on a machine with the GPU to measure them (tens of MiB for a small CNN)")

    gpu = load_catalog(tuple(kw.get("catalog_dirs") or ())).gpu(cluster.gpu_name)
    twin, why = analytic_twins(kw, cluster) if hf else (None, None)
    # a transformers model's plan builds it under FSDP on the meta device, as the analytic front end's does
    # (a 47B Mixtral built whole on each GPU first does not fit); the probes build it on the device
    results = [module_result(descs, train, cluster, n, gpu, workspaces, twin, desc.batch, "meta" if hf else "device")
               for n in names]
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
    replayed = [r.name for r in results if r.memory.reserved_replay is not None]
    rest = [r for r in results if r.memory.reserved_replay is None]
    parts = [f"the traced step's own allocations replayed through the caching allocator for "
             f"{', '.join(replayed)}"] if replayed else []
    if hf and rest:
        # where the step's allocations are not written (every-K checkpointing, FSDP2 on one rank, an optimizer
        # the writers lack) or the embeddings are tied (pair_tied, in module_result): the analytic front end's
        # cached-but-free bytes of the same run, where it reads the config
        if twin is not None:
            paired = [r.name for r in rest if pair_reserved(r.memory, twin(r.name, desc.batch))]
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
    if replayed or hf:
        notes.append("reserved peak: " + "; ".join(parts))
    return ModulePlan(train, cluster, results, notes, None, desc=desc, descs=descs, profile_s=profile_s,
                      workspaces=workspaces, twin=twin, kw=dict(kw))


def module_result(descs: dict, train: ModuleTrain, cluster: Cluster, name: str, gpu, workspaces: dict, twin,
                  batch: int, init: str = "device") -> StrategyResult:
    """One strategy's prediction for a traced workload: the memory walk and collectives of the trace in the
    strategy's precision regime, the step time of the analytic twin where there is one, else the trace's.
    `init`: estimate_module_memory's."""
    st = get_strategy(name)
    d = _desc_for(descs, train.precision, st.family)
    mem = estimate_module_memory(d, train, cluster, st, workspaces=workspaces, init=init)
    if twin is not None:
        pair_tied(mem, d, twin(name, batch))
    colls = module_collectives(d, train, cluster, name)
    timed = twin_time(twin, name, batch, cluster) if twin is not None else None
    return StrategyResult(st, mem, colls, timed or module_time(d, train, cluster, colls, gpu, st))


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


def predict_module_probe(spec: dict) -> dict:
    """The planner's prediction for a `distplan validate --module` probe (api.predict_probe's shape).

    The module is profiled on fake tensors in the regime the strategy runs it in, exactly as
    `distplan estimate --module` does, then walked by `estimate_module_memory` on the probe's world.
    """

    mod = spec["module"]
    if mod.get("path") and mod["path"] not in sys.path:
        sys.path.insert(0, mod["path"])  # where `distplan validate --module` was run
    work = from_spec(mod)
    shape = work.input_shape
    t = spec["train"]
    st = get_strategy(spec["strategy"])
    precision = t.get("precision", "fp32")
    device = spec.get("device_type") or ("cuda" if spec.get("mode") == "gpu" else "cpu")
    kernels = "cuda" if device == "cuda" else "cpu"
    ckpt = t.get("checkpointing", "none")
    every = checkpoint_every("none" if ckpt in ("selective", "selective-op") else ckpt)
    d = _traced(work, _regime(precision, st.family), kernels, every)
    if _regime(precision, st.family, d.batchnorm) != _regime(precision, st.family):  # FSDP1's BatchNorm units
        d = _traced(work, _regime(precision, st.family, True), kernels, every)
    d = d.for_precision(precision)
    workspaces = mod.get("kernel_workspaces") or {}  # measured on the probing GPU (validate_cmd)
    model = ModuleModel(d.name, work.label, d.param_count(), d.units, layers=len(d.units))
    train = ModuleTrain(model, precision=precision, optimizer=t.get("optimizer", "adamw"),
                        optimizer_impl=t.get("optimizer_impl", "foreach"),
                        checkpointing="none" if ckpt in ("selective", "selective-op") else ckpt,
                        grad_accum=int(t.get("grad_accum", 1)), grad_sync=t.get("grad_sync", "last"),
                        input_shape=shape, torch_version=spec.get("torch_version") or "",
                        alloc_conf=t.get("alloc_conf") or "", seq_len=shape[1] if work.kind == "hf" else "-")
    world = int(spec["world_size"])
    gpn = int(spec.get("gpus_per_node") or world)
    cluster = Cluster(gpus=world, gpus_per_node=gpn, gpu_memory_bytes=10**15,
                      gpu_name=spec.get("gpu_name") or "h100-sxm", nics_per_node=gpn)
    backend = {"gpu": "nccl", "cpu": "gloo", "fake": "fake"}.get(spec.get("mode"), "nccl")
    # (the fake process group runs rank 0 alone: its ZeRO-1 partition, which need not be the most loaded; measured:
    # a ViT's, 11% below the most loaded rank's optimizer state)
    # the probe built the model on the device, or on the meta device for FSDP (spec "init", validate/probe.py)
    init = "meta" if spec.get("init") == "meta" and st.fsdp else "device"
    mem = estimate_module_memory(d, train, cluster, st, device=device, backend=backend, workspaces=workspaces,
                                 rank=0 if spec.get("mode") == "fake" else None, init=init)
    out = {k: int(mem.components[k]) for k in COMPONENTS}
    out.update(workspace=int(mem.workspace), peak_allocated=int(mem.peak_allocated), peak_phase=mem.peak_phase)
    twin = None
    if device == "cuda" and work.kind == "hf":
        # judged on a GPU where the analytic front end's replay pairs with the trace (built as the probe built
        # it); a margin is not a prediction to judge
        kw = {"hf_config": mod["hf_config"], "layers": mod.get("layers"), "seq_len": shape[1],
              "micro_batch": shape[0], "precision": precision, "optimizer": train.optimizer,
              "optimizer_impl": train.optimizer_impl, "activation_checkpointing": ckpt,
              "grad_accum": train.grad_accum, "grad_sync": train.grad_sync, "alloc_conf": t.get("alloc_conf", ""),
              "torch_version": spec.get("torch_version") or "", "attention": work.attention}
        twin, _ = analytic_twins(kw, cluster, device, backend, init=init)
        if twin is not None:
            pair_tied(mem, d, twin(st.name, shape[0]))
            pair_reserved(mem, twin(st.name, shape[0]))  # (where its own run is not written)
    if device == "cuda" and (mem.reserved_replay is not None or mem.reserved_from is not None):
        out["peak_reserved"] = int(mem.peak_reserved)  # a margin is not a prediction to judge
    colls = [{"op": c.op, "group_size": c.group_size, "dtype": c.dtype, "message_bytes": int(c.message_bytes),
              "calls": int(c.calls)} for c in module_collectives(d, train, cluster, st.name)]
    step, bound = _probe_step_time(spec, d, train, cluster, st, twin, shape[0]) if device == "cuda" else (None, None)
    pred = {"memory": out, "collectives": colls, "step_time_s": step, "step_time_bound": bound}
    why = fsdp2_batchnorm_failure(d, precision) if st.fsdp2 else None
    if why:  # what PyTorch raises (CUDA's batch_norm; the CPU's)
        pred["fails"] = {"reason": why, "error_contains": list(FSDP2_BATCHNORM_ERRORS)}
    return pred


def _probe_step_time(spec: dict, d: ModuleDesc, train: ModuleTrain, cluster: Cluster, st: Strategy, twin,
                     batch: int) -> tuple[float | None, str | None]:
    """(step seconds, 'gpu' or 'host') a GPU probe of a traced model should measure, as `module_spec_plan`
    times the same run: the analytic twin's per-kernel model where the analytic front end reads the config,
    else the traced step's kernel census (`module_time`). On the fake process group the collectives return
    at once, so the exposed communication is left out (as api.predict_probe does for the reference decoder).
    'host' where the host issuing eager ops outlasts the GPU's kernels: reported by `validate`, not judged.
    (None, None) for a GPU the catalog does not name."""
    if spec.get("mode") not in ("gpu", "fake") or not spec.get("gpu_name"):
        return None, None
    cat = catalog_name(spec["gpu_name"])
    if not cat:
        return None, None
    cl = replace(cluster, gpu_name=cat)
    gpu = _gpu(cat)
    timed = twin_time(twin, st.name, batch, cl) if twin is not None else None
    if timed is not None:
        host_bound = step_bound(replace(twin.train, micro_batch=batch), gpu, st.family) == "host"
    else:
        timed = module_time(d, train, cl, module_collectives(d, train, cl, st.name), gpu, st)
        fwd_s, bwd_s, host_s = traced_compute(d, train, gpu)
        host_bound = host_s >= fwd_s + bwd_s
    step = timed.step_time_s - (timed.exposed_comm_s if spec.get("mode") == "fake" else 0.0)
    return step, "host" if host_bound else "gpu"
