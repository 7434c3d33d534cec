"""Training and cluster inputs of one plan, validated once, with every default written down."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from functools import lru_cache

from .allocator import parse_alloc_conf
from .model import ModelSpec, cached_hash, state_without_hash, tp_rank_spec
from .pp_schedule import check_pp
from .precision import OPTIMIZER_IMPLS, OPTIMIZERS, PRECISIONS, Precision, get_precision
from .units import LIMITS, check_count, short_repr

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv")
"""`torch.distributed.pipelining` ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble (planner/pp.py)."""

CHECKPOINTING = ("none", "selective", "selective-op", "full", "every-2", "every-3", "every-4")
"""Activation checkpointing modes. none; full: every block (non-reentrant `torch.utils.checkpoint`),
keeping its input; every-K: every K-th block from the first (transformers' `every_n_layers`), the others
keep all they save; selective: an op-level policy that saves the outputs of every matmul and of SDPA and
recomputes the rest (the reference decoder's); selective-op: torchtitan's op policy, the same but every
second mm of a block is recomputed too (torchtitan `selective_ac_option = "op"`)."""


def checkpoint_every(mode: str) -> int:
    """Blocks per checkpointed block: 1 for full, K for every-K, 0 for none (and selective)."""
    if mode == "full":
        return 1
    if mode.startswith("every-"):
        return int(mode.split("-", 1)[1])
    return 0
ATTENTION = ("sdpa", "eager")
ATTENTION_KERNELS = ("flash", "flash-triton")
"""The fused attention kernel an `sdpa` attention runs, for its time only (both save the output and the
log-sum-exp): flash (FlashAttention-2, SDPA's flash backend) or flash-triton (FlashAttention written in
Triton, Dao's flash_attn_triton.py, which llm-foundry's attn_impl='triton' runs)."""
OFFLOAD = ("none", "optimizer", "params")
CHECKPOINT_MODES = ("full", "full-offload", "sharded")
"""Checkpoint saves the planner models (`checkpoint.py`): full state dict gathered on every rank, full
state dict gathered to rank 0's CPU, sharded (Distributed Checkpoint)."""
DEFAULT_STORAGE_GBPS = 2.0
"""Write bandwidth per writing rank, GB/s (10^9 bytes/s), for the checkpoint save time: an assumption,
about one NVMe SSD's or one parallel-file-system client's sustained write; `--storage-gbps` changes it."""
FRAMEWORKS = ("pytorch", "deepspeed")
GRAD_SYNC = ("last", "every")
"""When gradient accumulation (grad_accum > 1) communicates gradients. last: only on the last micro-step,
the others run under DDP's / FSDP1's `no_sync()` or FSDP2's `set_requires_gradient_sync(False)`, which
keep UNSHARDED gradients between micro-steps; every: every micro-step reduces (all-reduce or
reduce-scatter) and the sharded gradient is accumulated (torchtitan's loop, which never disables sync)."""


NEWEST_TORCH = (2, 15)
"""The newest PyTorch release the walks were checked against (benchmarks/results/cpu-torch2.15-*): what a
plan assumes where no torch is installed, as a user installing one today gets it."""

_RELEASE = re.compile(r"(\d+)\.(\d+)(?:\.\d+)?(?:[a-z+.][0-9A-Za-z+.]*)?")


def torch_version_file() -> str | None:
    """The installed torch's torch/version.py, found without importing torch (the planner never does);
    None when torch is not installed."""
    import importlib.util
    import os

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    return os.path.join(os.path.dirname(spec.origin), "version.py")


_VERSION_FIELD = re.compile(r"""^(__version__|cuda|hip)\s*(?::[^=]*)?=\s*(?:'([^']*)'|"([^"]*)"|None)""", re.M)


def torch_build(path: str | None = None) -> dict:
    """The fields `__version__`, `cuda` and `hip` that torch/version.py (`path`, default the installed
    torch's) assigns, read as text without importing torch; None where it assigns None ("cuda: None" is
    a CPU build). Only the fields found; {} without torch or a readable file."""
    path = path or torch_version_file()
    if path is None:
        return {}
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return {}
    return {m.group(1): m.group(2) if m.group(2) is not None else m.group(3) for m in _VERSION_FIELD.finditer(text)}


@lru_cache(maxsize=1)
def installed_torch() -> str:
    """The installed torch's `__version__` ("2.13.0+cpu"), read from torch/version.py without importing
    torch (the planner never does); "" when none is installed. Read once per process: every plan asks."""
    return torch_build().get("__version__") or ""


def torch_release(version: str = "", flag: str = "--torch-version") -> tuple[int, int]:
    """(major, minor) of `version` ("2.15", "2.13.0+cpu", "2.16.0.dev20261101"); of the installed torch when
    "", or NEWEST_TORCH when none is installed. A string that is no release number is a one-line
    ValueError naming `flag`."""
    v = version or installed_torch()
    if not v:
        return NEWEST_TORCH
    got = _parse_release(v) if isinstance(v, str) else None
    if got is None:
        raise ValueError(f"{flag}={short_repr(version)}: accepted: a PyTorch release such as 2.15 or 2.13.0")
    return got


@lru_cache(maxsize=64)
def _parse_release(v: str) -> tuple[int, int] | None:
    """(major, minor) of a release string, None if it is none (the walk asks on every estimate)."""
    m = _RELEASE.fullmatch(v)
    return None if m is None else (int(m.group(1)), int(m.group(2)))


def torch_followed(version: str = "") -> str:
    """The release a plan follows, as its JSON writes it: `version`, else the installed torch's, else
    NEWEST_TORCH."""
    return version or installed_torch() or "%d.%d" % NEWEST_TORCH


def fsdp2_reduce_keeps_last_grad(train: "TrainConfig") -> bool:
    """Whether FSDP2's `foreach_reduce` (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py) keeps a
    unit's last unsharded gradient alive after `unsharded_grads.clear()` until it returns. Through torch
    2.14 it does: the loop `for i, (fsdp_param, unsharded_grad) in enumerate(zip(fsdp_params,
    unsharded_grads))` that reorders Shard(dim > 0) gradients runs in `foreach_reduce` itself when the
    shard group has more than one rank, and its loop variable holds the last gradient (measured: the
    block's w_down gradient, an untied LM head's at the root). torch 2.15 moved that loop into
    `_default_reduce_scatter_input_fn`, so the gradient goes with the list (measured: the HF llama with
    full checkpointing, zero3 on gloo, peaks 3% lower under 2.15 than 2.13,
    benchmarks/results/cpu-torch2.15-2026-11-26-hf.jsonl)."""
    return torch_release(train.torch_version) < (2, 15)


def fsdp2_grads_in_reduce_dtype(train: "TrainConfig") -> bool:
    """Whether FSDP2 makes its unsharded gradients in `reduce_dtype` under mixed precision. From torch 2.15
    `FSDPParam.init_unsharded_param` sets `self._unsharded_param.grad_dtype = self.unsharded_grad_dtype`
    (the reduce dtype when set; torch/distributed/fsdp/_fully_shard/_fsdp_param.py), so AccumulateGrad
    casts each gradient to fp32 as it lands; through 2.14 they stay in param_dtype until the reduce
    (measured: the TP norms' Partial gradients of transformers Llama and Qwen3 under FSDP2 bf16 mixed
    precision are all-reduced in fp32 on 2.15, in bf16 on 2.13,
    benchmarks/results/cpu-torch2.15-2026-11-29-parallel-hf.jsonl)."""
    return torch_release(train.torch_version) >= (2, 15)


def fsdp2_first_microstep_grads_in_reduce_dtype(train: "TrainConfig") -> bool:
    """Whether, from the second optimizer step on, FSDP2's first micro-step of accumulation without sync
    makes its unsharded gradients in `reduce_dtype` under mixed precision. From torch 2.15 it does:
    `FSDPParamGroup._set_unsharded_grad_dtypes` leaves each unsharded parameter's `grad_dtype` at the
    reduce dtype after a step's reduce, and `pre_backward` clears it only where a .grad exists or the
    micro-step reduces (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py), so autograd casts each
    incoming gradient to fp32 before accumulating it. What that costs is a tied embedding's backward: the
    head's and the embedding's gradients are two fp32 V x h copies (`aten::_to_copy`) and their sum a third
    (`aten::add`), where torch 2.13 (and a later micro-step) makes the three in bf16. Reproduced by
    benchmarks/tied_accum_fsdp2.py; measured on GPT-2 medium (zero3, bf16-mixed, 2 micro-steps, rank 0 of 8
    on the fake process group: 15% above the walk of the later micro-step alone,
    benchmarks/results/cpu-torch2.15-2026-11-29-tied-accum-hf.jsonl). Untied, the fp32 gradients of the
    first micro-step are what a later one carries anyway."""
    return torch_release(train.torch_version) >= (2, 15)


def pp_recv_buffers_per_receive(train: "TrainConfig") -> bool:
    """Whether `PipelineStage` allocates each receive buffer right before its receive and lets it go with
    its micro-batch, and drops each forward output once its send completes. From torch 2.15
    (torch/distributed/pipelining/_recv_buffers.py: `_RecvInfo.allocate_buffer` in `_get_recv_ops`,
    `take_buffer` handing it to the computation; stage.py `release_fwd_send_outputs` for the outputs that
    `_output_slot_is_releasable`: not a DDP-wrapped stage's, not the last stage's). On torch 2.13
    `_prepare_forward_infra` / `_prepare_backward_infra` make one activation and one gradient buffer per
    micro-batch in the first step and keep them for the run, and `fwd_cache` keeps each output until its
    backward (2.14 not checked; measured on gloo, the transformers Llama in 2 and 4 stages, GPipe and
    1F1B: benchmarks/results/cpu-torch2.15-2026-11-29-pp-hf.jsonl)."""
    return torch_release(train.torch_version) >= (2, 15)


def _choice(name: str, value: str, accepted: tuple) -> None:
    if not isinstance(value, str) or value not in accepted:
        raise ValueError(f"{name}={short_repr(value)}: accepted values are {', '.join(accepted)}")


def _positive(name: str, value) -> None:
    """A positive int within `units.LIMITS[name]` (one-line ValueError naming the bound and why)."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}={short_repr(value)}: must be a positive integer")
    check_count(name, value)


_MAX_SEQ, _MAX_MB, _MAX_ACCUM = (LIMITS[k][1] for k in ("seq_len", "micro_batch", "grad_accum"))


@dataclass(frozen=True)
class TrainConfig:
    """What one training step does on each data-parallel rank."""

    model: ModelSpec
    seq_len: int = 2048
    """Tokens per sequence (s)."""
    micro_batch: int = 1
    """Sequences per rank per micro-step (b)."""
    grad_accum: int = 1
    """Micro-steps per optimizer step (A)."""
    grad_sync: str = "last"
    """With grad_accum > 1, which micro-steps reduce gradients (GRAD_SYNC): 'last' (no_sync before it)
    or 'every'. No effect at grad_accum = 1 or under framework='deepspeed' (its own schedule)."""
    precision: str = "bf16-mixed"
    """One of fp32, bf16-mixed, fp16-mixed, bf16 (see precision.py)."""
    optimizer: str = "adamw"
    optimizer_impl: str = "foreach"
    """foreach (PyTorch's default on CUDA), fused, for-loop."""
    checkpointing: str = "none"
    """Activation checkpointing (CHECKPOINTING): none, selective (save matmul/SDPA outputs), full (per
    block), every-K (blocks 0, K, 2K, ...; not with pipeline parallelism in the analytic front end)."""
    attention: str = "sdpa"
    attention_kernel: str = "flash"
    """ATTENTION_KERNELS: the fused kernel under `sdpa` (its time only; kernels.py)."""
    cpu_offload: str = "none"
    framework: str = "pytorch"
    """pytorch (native implementations, validated) or deepspeed (DeepSpeed ZeRO's buffers)."""
    compile: bool = False
    """The blocks run under torch.compile (Inductor fuses their pointwise ops): changes the step time's
    memory-bound work and kernel count only; memory is modelled for eager execution."""
    tp: int = 1
    """Tensor-parallel degree: `parallelize_module` with torchtitan's Llama plan over a TP mesh
    dimension of `tp` GPUs inside a node; the data-parallel strategies run over gpus / tp ranks
    (planner/tp.py)."""
    sequence_parallel: bool = False
    """With tp > 1: norms and dropouts sharded along the sequence (`SequenceParallel`), the block's
    all-reduces replaced by all-gather + reduce-scatter (torchtitan's layout)."""
    alloc_conf: str = ""
    """`PYTORCH_CUDA_ALLOC_CONF` of the run (expandable_segments, max_split_size_mb): what the caching
    allocator replay (alloc_trace.py) follows for the reserved peak."""
    pp: int = 1
    """Pipeline-parallel stages (`torch.distributed.pipelining`, one stage per rank of the pp mesh
    dimension); the data-parallel strategies run over gpus / (tp * pp) ranks (planner/pp.py)."""
    pp_schedule: str = "1f1b"
    """gpipe, 1f1b, interleaved-1f1b, interleaved-zb or zbv (`pp.PP_SCHEDULES`)."""
    pp_microbatches: int = 1
    """Micro-batches of `micro_batch` sequences per optimizer step with pp > 1 (grad_accum stays 1)."""
    cp: int = 1
    """Context-parallel degree: each sequence split over `cp` ranks, attention as a ring
    (`context_parallel`, torchtitan's layout); the strategies run over gpus / (tp * pp) ranks, dp x cp
    (planner/cp.py)."""

    torch_version: str = ""
    """The PyTorch release the run uses ("2.15", "2.13.0+cu126"), where the implementations the walks follow
    differ between releases (`fsdp2_reduce_keeps_last_grad`); "" is the installed torch's (`torch_release`)."""

    _cp_local = False  # True on `cp.CPView`: seq_len is one context-parallel rank's share already

    def __post_init__(self) -> None:
        if not (type(self.seq_len) is int and 0 < self.seq_len <= _MAX_SEQ and type(self.micro_batch) is int
                and 0 < self.micro_batch <= _MAX_MB and type(self.grad_accum) is int
                and 0 < self.grad_accum <= _MAX_ACCUM and self.grad_sync in GRAD_SYNC
                and self.precision in PRECISIONS and self.optimizer in OPTIMIZERS
                and self.optimizer_impl in OPTIMIZER_IMPLS and self.checkpointing in CHECKPOINTING
                and self.attention in ATTENTION and self.attention_kernel in ATTENTION_KERNELS
                and self.cpu_offload in OFFLOAD
                and self.framework in FRAMEWORKS and type(self.compile) is bool
                and type(self.tp) is int and self.tp >= 1 and type(self.sequence_parallel) is bool
                and type(self.pp) is int and self.pp >= 1 and self.pp_schedule in PP_SCHEDULES
                and type(self.pp_microbatches) is int and 0 < self.pp_microbatches <= _MAX_ACCUM
                and type(self.cp) is int and self.cp >= 1):  # one test for the common case; below names the culprit
            self._check_fields()
        if self.torch_version:
            torch_release(self.torch_version, "torch_version")  # a release number, or a one-line error
        if self.attention_kernel != "flash" and self.attention != "sdpa":
            raise ValueError(f"attention_kernel={self.attention_kernel!r} with attention={self.attention!r}: the "
                             f"kernel is the fused one sdpa runs; accepted: attention='sdpa', or "
                             f"attention_kernel='flash'")
        if self.model.attn_softcap and self.attention != "eager":
            # transformers' Gemma-2 has no SDPA path (`Gemma2PreTrainedModel._supports_sdpa = False`: SDPA
            # cannot soft-cap the scores): its attention is the eager one whatever was asked
            object.__setattr__(self, "attention", "eager")
        if self.model.sandwich_norms and (self.tp > 1 or self.pp > 1):
            flag, value = ("tp", self.tp) if self.tp > 1 else ("pp", self.pp)
            raise ValueError(f"{flag}={value} with a Gemma-2 model: its sandwich norms and soft-capped eager "
                             f"attention are modelled without tensor or pipeline parallelism; accepted: {flag}=1")
        if self.model.position == "learned" and self.seq_len > self.model.max_positions:
            raise ValueError(
                f"seq_len={self.seq_len} exceeds the model's {self.model.max_positions} learned positions")
        if self.tp > 1:
            check_tp(self.tp, self.model, "tp")
            if self.framework != "pytorch":
                raise ValueError(f"tp={self.tp} with framework={self.framework}: tensor parallelism is "
                                 f"modelled for PyTorch's parallelize_module; accepted: framework='pytorch'")
        elif self.sequence_parallel:
            raise ValueError("sequence_parallel=True: needs tp > 1 (sequence parallelism shards along the "
                             "tensor-parallel group)")
        if self.alloc_conf:
            if not isinstance(self.alloc_conf, str):
                raise ValueError(f"alloc_conf={short_repr(self.alloc_conf)}: accepted: a PYTORCH_CUDA_ALLOC_CONF string")
            parse_alloc_conf(self.alloc_conf, "alloc_conf")
        if self.pp > 1:
            check_pp(self, "pp")
        if self.cp > 1 and not self._cp_local:
            check_cp(self.cp, self, flag="cp")
        object.__setattr__(self, "_prec", get_precision(self.precision))

    def _check_fields(self) -> None:
        _positive("seq_len", self.seq_len)
        _positive("micro_batch", self.micro_batch)
        _positive("grad_accum", self.grad_accum)
        _choice("grad_sync", self.grad_sync, GRAD_SYNC)
        _choice("precision", self.precision, PRECISIONS)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("optimizer_impl", self.optimizer_impl, OPTIMIZER_IMPLS)
        _choice("checkpointing", self.checkpointing, CHECKPOINTING)
        _choice("attention", self.attention, ATTENTION)
        _choice("attention_kernel", self.attention_kernel, ATTENTION_KERNELS)
        _choice("cpu_offload", self.cpu_offload, OFFLOAD)
        _choice("framework", self.framework, FRAMEWORKS)
        if type(self.compile) is not bool:
            raise ValueError(f"compile={short_repr(self.compile)}: accepted: True or False")
        _positive("tp", self.tp)
        if type(self.sequence_parallel) is not bool:
            raise ValueError(f"sequence_parallel={short_repr(self.sequence_parallel)}: accepted: True or False")
        _positive("pp", self.pp)
        _choice("pp_schedule", self.pp_schedule, PP_SCHEDULES)
        if not (type(self.pp_microbatches) is int and 0 < self.pp_microbatches <= _MAX_ACCUM):
            raise ValueError(f"pp_microbatches={short_repr(self.pp_microbatches)}: must be an integer from 1 "
                             f"to {_MAX_ACCUM}")
        _positive("cp", self.cp)

    @property
    def prec(self) -> Precision:
        return self._prec

    @property
    def sync_every(self) -> bool:
        """Gradients are reduced on every micro-step of an accumulating step (grad_sync='every',
        grad_accum > 1); False also when there is nothing to accumulate."""
        return self.grad_accum > 1 and self.grad_sync == "every"

    @property
    def tokens_per_micro_step(self) -> int:
        return self.seq_len * self.micro_batch

    def to_dict(self) -> dict:
        d = asdict(self)
        d["model"] = self.model.to_dict()
        d["torch_version"] = torch_followed(self.torch_version)
        return d

    @property
    def rank_model(self) -> ModelSpec:
        """The model's parameters as one tensor-parallel rank holds them (`model.TPRankSpec`)."""
        return tp_rank_spec(self.model, self.tp)


def tp_divisors(model: ModelSpec, *counts: int) -> list[int]:
    """Tensor-parallel degrees that divide the model's heads, kv_heads and ffn_hidden (and `counts`)."""
    return [t for t in range(1, model.kv_heads + 1)
            if not (model.heads % t or model.kv_heads % t or model.ffn_hidden % t or any(c % t for c in counts))]


def check_tp(tp: int, model: ModelSpec, flag: str = "--tp", gpus: int | None = None,
             gpus_per_node: int | None = None) -> None:
    """A one-line ValueError unless `tp` splits the model's heads, kv_heads and ffn_hidden (whole heads
    and MLP columns per rank) and, when given, the GPUs and the GPUs of a node (TP inside a node)."""
    counts = [c for c in (gpus, gpus_per_node) if c is not None]
    bad = [f"{k}={v}" for k, v in (("heads", model.heads), ("kv_heads", model.kv_heads),
                                   ("ffn_hidden", model.ffn_hidden)) if v % tp]
    bad += [f"{k}={v}" for k, v in (("gpus", gpus), ("gpus_per_node", gpus_per_node)) if v is not None and v % tp]
    if bad:
        ok = tp_divisors(model, *counts)
        raise ValueError(f"{flag}={short_repr(tp)}: must divide {', '.join(bad)} (tensor parallelism splits "
                         f"whole heads and MLP columns, inside one node); accepted: {', '.join(map(str, ok))}")


@dataclass(frozen=True)
class Cluster:
    """GPUs, how they are grouped into nodes, and the links between them."""

    gpus: int = 8
    gpus_per_node: int = 0
    """0 means min(8, gpus)."""
    gpu_memory_bytes: int = 80 * 2**30
    gpu_name: str = "h100-sxm"
    intra_link: str = "nvlink4"
    inter_link: str = "ib-ndr"
    nics_per_node: int = 8
    inter_bytes_per_s: float | None = None
    """Override of the per-node inter-node bandwidth (from --inter-gbps)."""
    host_memory_bytes: int = 0
    """CPU memory per node (the catalog node's; 0: not known, so CPU offload's host bytes are not checked)."""
    notes: tuple = field(default=())
    catalog_dirs: tuple = field(default=())
    """User catalog directories layered over ours (links and GPUs are looked up there too)."""

    __hash__ = cached_hash  # keys the communication model's caches
    __getstate__ = state_without_hash

    def __post_init__(self) -> None:
        _positive("gpus", self.gpus)
        if self.gpus_per_node == 0:
            object.__setattr__(self, "gpus_per_node", min(8, self.gpus))
        _positive("gpus_per_node", self.gpus_per_node)
        if self.gpus % self.gpus_per_node and self.gpus > self.gpus_per_node:
            raise ValueError(
                f"gpus={self.gpus} is not a multiple of gpus_per_node={self.gpus_per_node}")
        m = self.gpu_memory_bytes
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m < 1e300 or m != m:
            raise ValueError(f"gpu_memory_bytes={short_repr(m)}: must be a positive, finite number of bytes")
        _positive("nics_per_node", self.nics_per_node)
        b = self.inter_bytes_per_s
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b < 1e300 or b != b):
            raise ValueError(f"inter_bytes_per_s={short_repr(b)}: must be a positive, finite bandwidth")

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    @property
    def local_size(self) -> int:
        return min(self.gpus, self.gpus_per_node)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["notes"] = list(self.notes)
        return d


def check_cp(cp: int, train_like, gpus: int | None = None, flag: str = "--cp") -> None:
    """A one-line ValueError unless context parallelism with `cp` ranks can run this configuration."""
    if type(cp) is not int or cp < 1:
        raise ValueError(f"{flag}={short_repr(cp)}: must be a positive integer")
    if cp == 1:
        return
    s = train_like.seq_len
    if s % (2 * cp):
        raise ValueError(f"{flag}={cp}: the sequence length {s} must be a multiple of 2 x cp = {2 * cp} "
                         f"(head-tail load balancing splits it into 2 x cp chunks)")
    if train_like.attention != "sdpa":
        raise ValueError(f"{flag}={cp} with attention={train_like.attention}: ring attention replaces SDPA's "
                         f"kernels; accepted: attention sdpa")
    if train_like.framework != "pytorch":
        raise ValueError(f"{flag}={cp} with framework={train_like.framework}: context parallelism is modelled "
                         f"for torch.distributed.tensor.experimental.context_parallel; accepted: pytorch")
    if gpus is not None and gpus % (cp * train_like.tp):
        raise ValueError(f"{flag}={cp}: cp x tp = {cp * train_like.tp} must divide the {gpus} GPUs")
