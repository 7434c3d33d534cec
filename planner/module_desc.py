"""The trace front end's measured description of a module (`ModuleDesc`: its wrapping units, activations,
allocation log) and of the run it is planned for (`ModuleTrain`, `ModuleModel`, `ModuleTime`); module_plan.py."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from itertools import groupby
from math import prod

from .config import Cluster, torch_followed
from .memory import zero1_partition
from .precision import get_precision
from .strategies import FSDP1, FSDP2, Strategy


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


# -- the description under a strategy: its regime, shard group and unit sizes --------------

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


def _zero1_owned(shapes: list, shard: int, rank: int | None = None) -> list:
    """ZeroRedundancyOptimizer._partition_parameters (`memory.zero1_partition`): the shapes of the most
    loaded rank, or of `rank`."""
    ordered = sorted(shapes, key=prod, reverse=True)  # stable: equal sizes keep registration order
    runs = [(n, tuple(group)) for n, group in groupby(ordered, key=prod)]
    totals, owned = zero1_partition(runs, shard)
    return owned[totals.index(max(totals)) if rank is None else rank]
