"""Collective schedule of one optimizer step, as the installed PyTorch issues it, and its time.

Owns the strategy's schedule (op, group, dtype, message bytes, calls per optimizer step, phase, bytes
sent per GPU, time: `_raw_schedule`, timed and cached by `_timed_schedule`) and `comm_summary`;
`collective_schedule` (comm_schedule.py) composes it with tensor, context and pipeline parallelism, and
the alpha-beta time of one collective (`collective_time`) is nccl_model.py's.

Each schedule was read from the torch 2.13 source and checked call by call with the fake process
group on the reference decoder (tests/test_comm.py, `test_schedule_matches_torch`):

- DDP (`torch/nn/parallel/distributed.py`): the first iteration runs ONE bucket (bucket limits
  `[sys.maxsize]` when `find_unused_parameters=False`); from the second iteration the C++ Reducer has
  rebuilt its buckets in gradient-ready order (modules in reverse order, each module's params in
  registration order: weight then bias), first bucket capped at `first_bucket_bytes_cap`, the others
  at `bucket_cap_mb` MiB, a bucket closed when its size reaches the cap (so it may exceed it). An
  explicit `bucket_cap_mb=25` (what `validate/wrap.py` passes) makes the first cap 25 MiB too; only
  `bucket_cap_mb=None` gives the 1 MiB `dist._DEFAULT_FIRST_BUCKET_BYTES` first bucket. We model the
  steady state (iteration >= 2). One all-reduce per bucket per optimizer step (`no_sync` before), or
  per micro-step with grad_sync='every'.
- ZeroRedundancyOptimizer (`torch/distributed/optim/zero_redundancy_optimizer.py`), defaults
  (`parameters_as_bucket_view=False`): after the local step `_sync_params` broadcasts EVERY parameter
  tensor from its owner rank, one `broadcast` per parameter (not one all-gather), in the param dtype.
- FSDP2 (`torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`): one all-gather per group of the
  concatenated shards, each param padded on dim 0 to a multiple of the world size
  (`_get_dim0_padded_size`); reduce-scatter of the same padded size in reduce_dtype. The root group
  (embed + final norm + head) is NOT resharded after forward only when `fully_shard(root)` is called
  without `reshard_after_forward` (`_fsdp_state.py` `_lazy_init`); `validate/wrap.py` passes it
  explicitly, so under zero3 the root is all-gathered in backward too (`fsdp2_root_reshard`).
  With `set_requires_gradient_sync(False)`: no reduce-scatter, unsharded grads accumulate
  (`accumulate_unsharded_grad_if_needed`); params are still resharded after backward, so every
  micro-step all-gathers again.
- FSDP1 (`torch/distributed/fsdp/_flat_param.py`, `_runtime_utils.py`): one FlatParameter per unit;
  `use_orig_params=False` adds no alignment padding, only padding of the flat numel to a multiple of the
  shard-group size. FULL_SHARD / HYBRID_SHARD: the root is never resharded after forward, blocks are
  all-gathered in forward and backward. SHARD_GRAD_OP under `no_sync` keeps params unsharded across
  micro-steps (`_should_free_in_backward`), so it all-gathers ONCE per optimizer step, not per
  micro-step. NO_SHARD: one all-reduce of the unpadded flat grad per unit. HYBRID_SHARD: plus an
  all-reduce of the reduced shard over the replica group, issued even when that group has one rank.
- Gradient accumulation (grad_accum = A > 1): with grad_sync='last' (the default) the reductions run on
  the last micro-step only, the others under `no_sync()` / `set_requires_gradient_sync(False)`; with
  'every' each micro-step issues them (A times the calls, same message sizes). The all-gathers do not
  change, except SHARD_GRAD_OP's, which all-gathers every micro-step when each one syncs.
- DeepSpeed (`--framework deepspeed`): modelled from DeepSpeed's source, NOT validated (no DeepSpeed
  here); see `_deepspeed`.

A collective's time follows NCCL's own tuner (NVIDIA/nccl src/graph/tuning.cc `ncclTopoTuneModel`,
src/enqueue.cc): ring (LL or Simple protocol), tree and NVLSTree across nodes, NVLS on NVSwitch nodes,
PAT at one GPU per node, the fastest one picked; bandwidths are the catalog's nccl-tests bus
bandwidths (doc/PERFORMANCE.md), judged against published nccl-tests figures in
tests/test_nccl_published.py.

Known limitations: CollNet (network SHARP), NVLS for all-gather/reduce-scatter (measured slower than
the ring on one node), NCCL's per-size tree correction table, channel counts, contention between
concurrent collectives and vendor tuner plugins (AWS's ofi tuner) are not modelled. Tensor/pipeline
parallel groups are absent.
"""

from __future__ import annotations

from math import prod

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from .config import Cluster, TrainConfig
from .model import ModelSpec, unit_sizes
# One collective's time on the links (nccl_model.py), re-exported: importers of comm keep finding it here.
from .nccl_model import (LAUNCH_S, NVLS_MIN_RANKS, NVLS_TREE_EFFICIENCY, NVLS_TUNER_LATENCY_S, OPS,  # noqa: F401
                         PAT_BW, PAT_STEP_S, RING_PLATEAU, TREE_BW, TREE_LL_BW, LinkModel, _BASE_S, _HW_CLASS,
                         _LL_MAX_NET, _LL_STEP_RATIO, _flat_time, _group_time, _group_times, _interconnect,
                         _link_model, _ring, _tuner_pick, bus_factor, cluster_links, collective_time, latency_steps,
                         nccl_algorithm, nccl_algorithms)
from .strategies import get_strategy

DDP_BUCKET_CAP_MB: int | None = None
"""DDP's bucket_cap_mb as `validate/wrap.py` passes it: None, PyTorch's default (25 MiB buckets after a
1 MiB first bucket). An explicit 25 would make every bucket, the first included, 25 MiB."""
DDP_DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024
"""`torch.distributed._DEFAULT_FIRST_BUCKET_BYTES` (1 MiB), used only when bucket_cap_mb is None."""
FSDP2_ROOT_RESHARD_EXPLICIT = False
"""`validate/wrap.py` leaves the root's reshard_after_forward at FSDP2's default for zero3 (the root is
not resharded after forward) and passes False for zero2."""

# DeepSpeed defaults, deepspeedai/DeepSpeed deepspeed/runtime/zero/config.py (DeepSpeedZeroConfig):
DS_REDUCE_BUCKET_SIZE = 500_000_000
"""`reduce_bucket_size: int = Field(pp_int(5e8))`, elements."""
DS_ALLGATHER_BUCKET_SIZE = 500_000_000
"""`allgather_bucket_size: int = Field(pp_int(5e8))`, elements."""
DS_PREFETCH_BUCKET_SIZE = 50_000_000
"""`stage3_prefetch_bucket_size: Field(pp_int(5e7))`, elements (prefetch only; no change to volume)."""
DS_PARAM_PERSISTENCE_THRESHOLD = 100_000
"""`stage3_param_persistence_threshold: Field(pp_int(1e5))`: smaller params are never partitioned."""

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class Collective(NamedTuple):
    """One kind of collective of an optimizer step (identical calls merged). Immutable: schedules are
    cached and shared; a named tuple because a sweep builds thousands (a frozen dataclass's __init__
    costs four times as much)."""

    op: str
    """'all_reduce' | 'all_gather' | 'reduce_scatter' | 'broadcast'."""
    group: str
    """'world' (all ranks), 'intra_node' (the node's ranks), 'inter_node' (one rank per node); with
    tensor parallelism (`tp.py`) 'dp' (the data-parallel mesh dimension's ranks) and 'tp' (the
    tensor-parallel group, inside a node)."""
    group_size: int
    dtype: str
    """'float32' | 'bfloat16' | 'float16' on the wire."""
    message_bytes: int
    """all_gather: gathered OUTPUT bytes; reduce_scatter: INPUT bytes; all_reduce/broadcast: the tensor."""
    calls: int
    """Calls per optimizer step (grad_accum micro-steps included)."""
    phase: str
    """'forward' | 'backward' | 'optimizer'."""
    bytes_per_gpu: int = 0
    """Bytes each GPU sends over all calls: nccl-tests factor x message_bytes x calls."""
    time_s: float = 0.0
    """Modelled time of all calls, seconds."""
    unit: str = ""
    """What it moves: 'block' (one per decoder block), 'root' (embed + final norm + head), 'bucket',
    'last_bucket' (the DDP bucket reduced last), 'param' (per-tensor broadcasts), 'bucket_ds'."""

    def to_dict(self) -> dict:
        return self._asdict()




# -- unit sizes (cached per model) -----------------------------------------------------------------


@lru_cache(maxsize=2048)
def _fsdp2_numel(shapes: tuple, ws: int) -> int:
    """FSDP2 all-gather output / reduce-scatter input elements: each param padded on dim 0 to ws."""
    return sum(-(-s[0] // ws) * ws * prod(s[1:]) for s in shapes)


def _fsdp1_numel(n: int, ws: int) -> int:
    """FSDP1 FlatParameter (use_orig_params=False): the unit's `n` elements padded to a multiple of ws."""
    return -(-n // ws) * ws


def _autocast(precision: str) -> bool:
    """Whether DDP/ZeRO-1 run this precision under `torch.autocast` (fp32 parameters, 16-bit compute)."""
    return precision in ("bf16-mixed", "fp16-mixed")


def grad_ready_order(named_shapes, autocast: bool = False) -> list[int]:
    """Parameter numels in autograd's gradient-ready order (what DDP's rebuilt buckets follow), from
    (name, shape) pairs in registration order.

    Measured with `register_post_accumulate_grad_hook` (tests/test_comm.py on the reference decoder,
    the MNIST CNN for `--module`): modules in reverse registration order; inside a module, registration
    order (a norm's weight before its bias: native_layer_norm's outputs; a convolution's weight before
    its bias), except that a Linear's bias (its module's weight is 2-D) is ready before its weight in
    full precision (addmm(bias, input, weight.t()) lists the bias edge first); under autocast each
    reaches its AccumulateGrad through its own cast node (ToCopyBackward), the weight's first.
    """
    modules: list[list[tuple[str, tuple]]] = []
    prev = None
    for name, shape in named_shapes:
        mod = name.rsplit(".", 1)[0] if "." in name else ""
        if mod != prev:
            modules.append([])
            prev = mod
        modules[-1].append((name, tuple(shape)))
    out: list[int] = []
    for params in reversed(modules):
        weight = next((sh for n, sh in params if n.endswith("weight")), None)
        if weight is not None and len(weight) == 2 and not autocast:
            params = ([p for p in params if p[0].endswith(".bias")]
                      + [p for p in params if not p[0].endswith(".bias")])
        out += [prod(sh) for _, sh in params]
    return out


def bucket_sizes(ready_sizes, elem_bytes: int, bucket_cap_mb: int | None = DDP_BUCKET_CAP_MB) -> tuple[int, ...]:
    """Bucket sizes in bytes, in reduction order, of DDP's rebuilt buckets (iteration >= 2).

    `compute_bucket_assignment_by_size` (torch/csrc/distributed/c10d/reducer.cpp) with limits
    [first_bucket_bytes_cap, bucket_bytes_cap]: a tensor is appended, then the bucket closes when its
    size >= the current limit. One dtype (the model has one), so one key.
    """
    cap = (bucket_cap_mb if bucket_cap_mb is not None else 25) * 1024 * 1024
    first = DDP_DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
    out, size = [], 0
    for n in ready_sizes:
        size += n * elem_bytes
        if size >= (first if not out else cap):
            out.append(size)
            size = 0
    if size:
        out.append(size)
    return tuple(out)


@lru_cache(maxsize=512)
def ready_order_sizes(model: ModelSpec, autocast: bool = False) -> tuple[int, ...]:
    """`grad_ready_order` of the reference decoder (tied embeddings count once).

    No module spans two units, so the order is the units' own orders, last unit first; the blocks are
    identical, so one block's order is computed once and repeated."""
    embed_u, block_u, head_u = model.units()
    head = grad_ready_order(head_u.params, autocast)
    block = grad_ready_order(block_u.params, autocast)
    embed = grad_ready_order(embed_u.params, autocast)
    return tuple(head + block * model.layers + embed)


@lru_cache(maxsize=512)
def _param_size_counts(model: ModelSpec) -> tuple[tuple[int, int], ...]:
    """(numel, how many parameters have it), largest first."""
    counts: dict[int, int] = {}
    embed, block, head = model.units()
    for unit, times in ((embed, 1), (head, 1), (block, model.layers)):
        for _, shape in unit.params:
            n = prod(shape)
            counts[n] = counts.get(n, 0) + times
    return tuple(sorted(counts.items(), reverse=True))


@lru_cache(maxsize=1024)
def ddp_buckets(model: ModelSpec, elem_bytes: int, bucket_cap_mb: int | None = DDP_BUCKET_CAP_MB,
                autocast: bool = False) -> tuple[int, ...]:
    """`bucket_sizes` of the reference decoder's ready order."""
    return bucket_sizes(ready_order_sizes(model, autocast), elem_bytes, bucket_cap_mb)


@lru_cache(maxsize=1024)
def _ddp_bucket_counts(model: ModelSpec, elem_bytes: int, bucket_cap_mb: int | None,
                       autocast: bool) -> tuple[tuple[tuple[int, int], ...], int]:
    """(((bytes, how many buckets), ...) for all but the last bucket, the last bucket's bytes): a large
    model has tens of thousands of buckets, so the schedule counts them once per model."""
    buckets = ddp_buckets(model, elem_bytes, bucket_cap_mb, autocast)
    counts: dict[int, int] = {}
    for b in buckets[:-1]:
        counts[b] = counts.get(b, 0) + 1
    return tuple(counts.items()), buckets[-1]


# -- dtypes ----------------------------------------------------------------------------------------

_PARAM_DTYPES = {"fp32": "float32", "bf16-mixed": "bfloat16", "fp16-mixed": "float16", "bf16": "bfloat16"}


def _param_dtype(precision: str) -> str:
    """Dtype of all-gathered params: param_dtype of the MixedPrecision policy, else the param dtype."""
    return _PARAM_DTYPES[precision]


def _grad_dtype(precision: str) -> str:
    """Dtype of reduced gradients: fp32 (autocast keeps fp32 params; reduce_dtype=fp32), bf16 if pure."""
    return "bfloat16" if precision == "bf16" else "float32"


def _stored_dtype(precision: str) -> str:
    return "bfloat16" if precision == "bf16" else "float32"


# -- schedules -------------------------------------------------------------------------------------


class Schedule(list):
    """A list of `Collective`s as `collective_schedule` returns it, with `totals` (see `schedule_totals`)
    computed once per cached schedule rather than once per evaluated configuration. The totals describe
    the list as returned: to edit a schedule, copy it into a plain list first."""

    __slots__ = ("totals",)  # one is made per evaluated configuration: no instance dict

    def __init__(self, collectives=(), totals: "ScheduleTotals | None" = None):
        super().__init__(collectives)
        self.totals = totals


@dataclass(frozen=True)
class ScheduleTotals:
    """Sums over a schedule's entries, computed once per cached schedule (`schedule_totals`)."""

    time_s: float
    """Serial sum of the collectives' times."""
    calls: int
    per_call: dict
    """(op, phase, unit) -> (seconds of one call, calls); the per-call time averaged over merged entries."""
    time_by_phase: dict
    """phase -> seconds."""
    time_by_unit: dict
    """unit -> seconds."""
    bytes_by_op_dtype: dict
    """(op, dtype) -> message_bytes x calls, summed."""


def schedule_totals(schedule: list[Collective]) -> ScheduleTotals:
    """Totals of a schedule: those `collective_schedule` attached, else computed from the list."""
    totals = getattr(schedule, "totals", None)
    if totals is not None:
        return totals
    by_kind: dict[tuple, list] = {}
    by_phase: dict[str, float] = {}
    by_unit: dict[str, float] = {}
    by_bytes: dict[tuple, int] = {}
    time_s, n_calls = 0.0, 0
    for op, _, _, dtype, msg, calls, phase, _, t, unit in schedule:  # Collective fields, in order
        acc = by_kind.get((op, phase, unit))
        if acc is None:
            by_kind[op, phase, unit] = [t, calls]
        else:
            acc[0] += t
            acc[1] += calls
        by_phase[phase] = by_phase.get(phase, 0.0) + t
        by_unit[unit] = by_unit.get(unit, 0.0) + t
        by_bytes[op, dtype] = by_bytes.get((op, dtype), 0) + msg * calls
        time_s += t
        n_calls += calls
    per_call = {k: (t / n if n else 0.0, n) for k, (t, n) in by_kind.items()}
    return ScheduleTotals(time_s, n_calls, per_call, by_phase, by_unit, by_bytes)


@lru_cache(maxsize=8192)
def _timed_schedule(key: tuple, cluster: Cluster) -> tuple[tuple, ScheduleTotals]:
    """The schedule with times and its totals; depends on (model, precision, accum, framework,
    strategy, cluster) only, so a sweep over sequence length and micro-batch reuses it."""
    out = timed_collectives(_raw_schedule(*key), cluster)
    return tuple(out), schedule_totals(out)


def timed_collectives(raw, cluster: Cluster) -> list[Collective]:
    """`Collective`s, with bytes sent per GPU and time, from (op, group, group_size, dtype, message_bytes,
    calls, phase, unit) tuples."""
    out = []
    times = _group_times(cluster)
    for (op, group, n, dtype, msg, calls, phase, unit) in raw:
        t = times.get((op, group, n, msg))
        if t is None:
            t = times[op, group, n, msg] = _group_time(op, group, n, msg, cluster)
        out.append(Collective(op, group, n, dtype, msg, calls, phase,
                              round(bus_factor(op, n) * msg * calls), t * calls, unit))
    return out


def _schedule_key(train: TrainConfig, name: str, world: int, g: int, nodes: int, cap, root_explicit):
    return (train.model, train.precision, train.grad_accum, train.sync_every, train.framework, name, world, g,
            nodes, cap, root_explicit)


@lru_cache(maxsize=4096)
def _raw_schedule(model: ModelSpec, precision: str, A: int, every: bool, framework: str, name: str, world: int,
                  g: int, nodes: int, cap, root_explicit) -> tuple:
    """Tuples (op, group, group_size, dtype, message_bytes, calls, phase, unit), cached.

    `every`: gradients are reduced on each of the A micro-steps (grad_sync='every'), else on the last
    one only. DeepSpeed keeps its own schedule either way."""
    s = get_strategy(name)
    if not s.distributed:
        return ()
    if framework == "deepspeed" and s.zero_stage:
        return tuple(_deepspeed(model, precision, A, s.zero_stage, world))
    L = model.layers
    root, block, root_n, block_n, _ = unit_sizes(model)
    pdt, gdt = _param_dtype(precision), _grad_dtype(precision)
    pb, gb = _DTYPE_BYTES[pdt], _DTYPE_BYTES[gdt]
    out: list[tuple] = []

    def add(op, group, n, dtype, msg, calls, phase, unit):
        if calls > 0 and msg > 0:  # (a pipeline stage between the first and the last has no root)
            out.append((op, group, n, dtype, int(msg), int(calls), phase, unit))

    # Micro-steps that reduce gradients: all A unless the others run without sync (DDP's and FSDP1's
    # `no_sync()`: `require_backward_grad_sync` / `_sync_gradients` False, FSDP2's
    # `set_requires_gradient_sync(False)`: `FSDPParamGroup.reduce_grads` False).
    R = A if every else 1
    if s.ddp_reducer:
        counts, last = _ddp_bucket_counts(model, gb, cap, _autocast(precision))
        for b, c in counts:
            add("all_reduce", "world", world, gdt, b, c * R, "backward", "bucket")
        add("all_reduce", "world", world, gdt, last, R, "backward", "last_bucket")
        if model.hf_model_type and model.position == "rope":
            # DDP broadcasts the module's buffers before each synchronised forward (`_check_sync_bufs_pre_fwd`,
            # `_broadcast_coalesced`: one message per dtype): a transformers model's rotary embedding keeps
            # `inv_freq` and `original_inv_freq` (head_dim / 2 each, fp32; the model's dtype once cast to bf16)
            # as buffers (`<Type>RotaryEmbedding.__init__`), once per optimizer step, or per micro-step when
            # each one syncs (the trace's `module_plan.module_collectives` counts the same from the module)
            bdt = _stored_dtype(precision)
            add("broadcast", "world", world, bdt, model.head_dim * _DTYPE_BYTES[bdt], R, "forward", "buffers")
        if s.zero_optimizer:
            sdt = _stored_dtype(precision)
            for n, c in _param_size_counts(model):
                add("broadcast", "world", world, sdt, n * _DTYPE_BYTES[sdt], c, "optimizer", "param")
        return tuple(out)

    if s.fsdp2:
        blk, rt = _fsdp2_numel(block, world), _fsdp2_numel(root, world)
        reshard = s.reshard_after_forward
        root_bwd = reshard and root_explicit
        add("all_gather", "world", world, pdt, blk * pb, L * A, "forward", "block")
        add("all_gather", "world", world, pdt, rt * pb, A, "forward", "root")
        if reshard:
            add("all_gather", "world", world, pdt, blk * pb, L * A, "backward", "block")
        if root_bwd:
            add("all_gather", "world", world, pdt, rt * pb, A, "backward", "root")
        add("reduce_scatter", "world", world, gdt, blk * gb, L * R, "backward", "block")
        add("reduce_scatter", "world", world, gdt, rt * gb, R, "backward", "root")
        return tuple(out)

    if s.fsdp1:
        if s.fsdp_no_shard:
            add("all_reduce", "world", world, gdt, block_n * gb, L * R, "backward", "block")
            add("all_reduce", "world", world, gdt, root_n * gb, R, "backward", "root")
            return tuple(out)
        if s.hybrid:
            shard_n, group = min(world, g), "intra_node"
        else:
            shard_n, group = world, "world"
        blk, rt = _fsdp1_numel(block_n, shard_n), _fsdp1_numel(root_n, shard_n)
        # SHARD_GRAD_OP keeps params unsharded under no_sync (`_should_free_in_backward`), so only the first
        # micro-step all-gathers; a synced micro-step frees them, so with every one synced all A do.
        fwd_calls = 1 if s.fsdp1_shard_grad_op and not every else A
        add("all_gather", group, shard_n, pdt, blk * pb, L * fwd_calls, "forward", "block")
        add("all_gather", group, shard_n, pdt, rt * pb, fwd_calls, "forward", "root")
        if s.reshard_after_forward:
            add("all_gather", group, shard_n, pdt, blk * pb, L * A, "backward", "block")
        add("reduce_scatter", group, shard_n, gdt, blk * gb, L * R, "backward", "block")
        add("reduce_scatter", group, shard_n, gdt, rt * gb, R, "backward", "root")
        if s.hybrid:
            replicas = max(1, world // shard_n)
            add("all_reduce", "inter_node", replicas, gdt, blk // shard_n * gb, L * R, "backward", "block")
            add("all_reduce", "inter_node", replicas, gdt, rt // shard_n * gb, R, "backward", "root")
        return tuple(out)
    raise AssertionError(f"no schedule for family {s.family!r}")


def _deepspeed(model: ModelSpec, precision: str, A: int, stage: int, world: int) -> list[tuple]:
    """DeepSpeed ZeRO-1/2/3 with its default config. NOT validated: DeepSpeed is not installed here.

    Read from deepspeedai/DeepSpeed `deepspeed/runtime/zero/stage_1_and_2.py` and `stage3.py`:
    - stage 1/2: gradients go into IPG buckets of `reduce_bucket_size` (5e8) elements; with the default
      `reduce_scatter=True` and `use_multi_rank_bucket_allreduce=True`, `average_tensor` ->
      `allreduce_and_scatter` ALL-REDUCES each bucket (in chunks of <= reduce_bucket_size elements) and
      each rank keeps its partition. Stage 2 reduces in backward on every micro-step; stage 1 only at
      the accumulation boundary. After the step, updated 16-bit partitions are all-gathered
      (`all_gather_dp_groups`, runtime/utils.py) in `num_shards = max(1, P_partition * dp // allgather_bucket_size)`
      calls. Communication dtype: the 16-bit param/grad dtype (fp32 for fp32 training).
    - stage 3: every leaf module's partitioned params (each padded to a multiple of world size) are
      all-gathered before its forward and again before its backward, per micro-step; params with fewer
      than `param_persistence_threshold` (1e5) elements stay unpartitioned (no all-gather). Gradients
      are reduce-scattered every micro-step in `reduce_bucket_size` buckets. No post-step all-gather.
    The single IPG buffer / module order is approximated by contiguous chunks of the total.
    """
    ws = world
    dt = "float32" if precision == "fp32" else ("float16" if precision == "fp16-mixed" else "bfloat16")
    eb = _DTYPE_BYTES[dt]
    P = model.param_count()
    out: list[tuple] = []
    if stage in (1, 2):
        nb = max(1, -(-P // DS_REDUCE_BUCKET_SIZE))
        rounds = A if stage == 2 else 1
        base, rem = divmod(P, nb)  # rem buckets of base + 1 elements, then nb - rem of base
        sizes = {sz: c for sz, c in ((base + 1, rem), (base, nb - rem)) if c}
        for sz, c in sizes.items():
            out.append(("all_reduce", "world", ws, dt, sz * eb, c * rounds, "backward", "bucket_ds"))
        part = -(-P // ws)
        shards = max(1, part * ws // DS_ALLGATHER_BUCKET_SIZE)
        out.append(("all_gather", "world", ws, dt, (part // shards) * ws * eb, shards, "optimizer", "bucket_ds"))
        return out
    # stage 3: leaf modules with partitioned params
    mods: dict[str, list] = {}
    for unit in model.param_inventory():
        for name, shape in unit.params:
            mods.setdefault(name.rsplit(".", 1)[0], []).append(shape)
    ag: dict[int, int] = {}
    for shapes in mods.values():
        part = [s for s in shapes if prod(s) >= DS_PARAM_PERSISTENCE_THRESHOLD]
        if part:
            n = sum(-(-prod(s) // ws) * ws for s in part)
            ag[n] = ag.get(n, 0) + 1
    for n, c in ag.items():
        out.append(("all_gather", "world", ws, dt, n * eb, c * A, "forward", "module"))
        out.append(("all_gather", "world", ws, dt, n * eb, c * A, "backward", "module"))
    nb = max(1, -(-P // DS_REDUCE_BUCKET_SIZE))
    out.append(("reduce_scatter", "world", ws, dt, (-(-P // nb)) * eb, nb * A, "backward", "bucket_ds"))
    return out


def comm_summary(schedule: list[Collective]) -> dict:
    """Totals of a schedule: {'bytes_per_gpu': int, 'time_s': float} (serial sum, no overlap)."""
    return {"bytes_per_gpu": sum(c.bytes_per_gpu for c in schedule),
            "time_s": sum(c.time_s for c in schedule)}
