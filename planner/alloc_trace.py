"""The allocations of a training run, as the analytic model sees them, replayed through the caching allocator.

`estimate_memory` (memory.py) gives the peak of *allocated* bytes in closed form. What decides an OOM is
the *reserved* peak (`torch.cuda.max_memory_reserved`): the segments the caching allocator holds, which
depend on the sizes, order, lifetimes and streams of every allocation. `allocation_events` writes those
events for the reference decoder (or a Hugging Face model read into a `ModelSpec`) under one strategy,
tensor by tensor, from model construction through the warm-up and measured steps the probes run
(validate/probe.py), and `reserved_peak` replays them through `allocator.CachingAllocator`.

The sizes are the planner's own (memory.layout, activations.activations_in, memory._block_backward_peak),
so this is one model, not a second one: it adds the order and the streams. What it follows, per phase:

- Construction: the model is built on the host and moved with `.to(device)`, each parameter its own
  allocation in registration order. FSDP2 (`fully_shard`, `_fsdp_param.py` `FSDPParam._init_sharded_param`)
  then allocates each parameter's padded dim-0 shard and drops the full tensor; FSDP1
  (`_flat_param.py` `FlatParamHandle.flatten_tensors_into_flat_param`, `shard`) concatenates each unit's
  parameters into one flat tensor, keeps one padded chunk of it, then drops the flat tensor and the
  originals. DDP's `Reducer` allocates one flat gradient buffer per bucket (`initialize_buckets`,
  `bucket.gradients`) and its rebuild in the second iteration allocates new ones before dropping the old
  (`_rebuild_buckets`). A tied transformers model also makes and drops its LM head's own weight
  (construction_trace.py `_tied_head_transient`).
- Forward, per block: the tensors the block's backward keeps (activations_in: the same bytes, split in the
  shapes the ops save: norm statistics and outputs, q/k/v, the attention output, the MLP's n*f tensors),
  autocast's 16-bit weight casts (single/DDP/ZeRO-1 under *-mixed), and under checkpointing only the
  block's input. FSDP2: the block's all-gather output on the all-gather stream (`foreach_all_gather`,
  one flat buffer), copied out into per-parameter unsharded tensors on the compute stream
  (`foreach_all_gather_copy_out`), freed at `post_forward` when resharding. FSDP1: the low-precision
  shard (`_use_low_precision_shard`) and the padded unsharded flat parameter on the unshard stream.
- Backward: the root's pre-backward hook on the loss prefetches the last block (FSDP2 `_backward_prefetch`,
  FSDP1 `_prefetch_handle`) before the loss's and the head's backward. Per block in reverse: the prefetch of
  the next block's all-gather, the recomputation of a checkpointed block beside its kept input, then two
  phases: to the block backward's peak (memory._block_backward_peak) the saved tensors its last ops consumed
  freed, the MLP's transients and the weight gradients made by then (the output projection's), after it the
  other weight gradients (per parameter; FSDP1 concatenates them into the flat gradient) and the frees of
  the block's saved tensors (under tensor parallelism one burst); FSDP2's `post_backward`: reshard, the
  reduce-scatter input on the compute
  stream (kept until the next reduce-scatter, `reduce_scatter_state`), the output shard that becomes
  `.grad`; FSDP1's `_post_backward_hook` the same on its post-backward stream. A tied weight that is the
  parameter itself, FSDP2's unsharded parameter or FSDP1's view of its flat parameter: the head's gradient
  held to the embedding's backward, then the embedding's and their sum, a new tensor.
- Optimizer: AdamW's states are made lazily in the first step (`_init_group`: `zeros_like` per parameter,
  exp_avg then exp_avg_sq), `_multi_tensor_adam`'s `exp_avg_sq_sqrt` temporaries (foreach), and
  `zero_grad(set_to_none=True)` drops the gradients.
- Gradient accumulation: every micro-step is written. The first makes the gradients that later ones add
  into in place (AccumulateGrad, one weight gradient at a time); without sync (grad_sync 'last') FSDP2
  keeps the unsharded gradients (upcast to reduce_dtype under mixed precision:
  `to_accumulated_grad_if_needed`) and FSDP1 the unsharded flat gradient (SHARD_GRAD_OP also the unsharded
  parameters); synced every micro-step, the new shards are added to the kept ones.
- Tensor parallelism: one TP rank's parameter shapes (tp.tp_view), the probes' whole-model construction
  before `parallelize_module`, each rowwise output's reduction (partial sum, then the all-reduced or
  reduce-scattered tensor), loss parallel's vocabulary shard and three backward buffers, the embedding's
  full-vocabulary Replicate gradient.
- The walk itself: train_step_trace.py `TrainStepWalk` (one method per phase and per strategy hook),
  construction in construction_trace.py.
- Pipeline stages (`stage_allocation_events`: a plain stage, DDP, FSDP2 zero2/zero3) and checkpoint saves
  (`checkpoint_events`): see there.

Checked against allocation traces the CPU probes recorded (tests/test_alloc_trace.py): one micro-step at
16 layers (benchmarks/alloc_depth.py), accumulation and TP (benchmarks/alloc_accum.py), pipeline stages
(benchmarks/alloc_pp.py), checkpoint saves (benchmarks/alloc_ckpt.py), a tied model under mixed precision
(benchmarks/alloc_tied.py).

Streams: 0 compute, 1 all-gather (FSDP2 `all_gather_copy_in_stream`: the flat buffer and the
mixed-precision cast of the shards; FSDP1 `_unshard_stream`: the unsharded flat parameter and the flat
gradient, made by its views' backward), 2 reduce-scatter (FSDP2 `reduce_scatter_stream`: its output;
FSDP1 `_post_backward_stream`), 3 FSDP1's `_pre_unshard_stream` (the low-precision shard); checked against
the streams the CPU probes record (validate.measure.StreamTags, allocator.comm_streams). What is
approximate: the exact transients of each forward op (only the block MLP's backward transients, the TP
reductions and the loss's are written), and the host order inside a block. Not written
(memory.RESERVED_MARGIN instead): the `--hf-config` trace front end where module_plan cannot pair it with
this writer's run (a `--module` trace: `logged_step_events`, `logged_fsdp2_events`, `logged_fsdp1_events`;
not under checkpointing, pure 16-bit or FSDP2 on one rank), DeepSpeed, ZeRO-1 pipeline stages
(and FSDP2 stages on one data-parallel rank), interleaved and zero-bubble schedules, autocast under
pipelining, more than MAX_MICROBATCHES micro-batches, `full-offload`, NO_SHARD, HSDP and tensor-parallel
saves, models over MAX_LAYERS.
"""

from __future__ import annotations

from functools import lru_cache

from .allocator import alloc_rounding, replay_fit, replay_peaks
from .block_trace import _block_saved_shapes, block_program  # noqa: F401
# The other writers (a traced module's run, a pipeline stage, a checkpoint save) live in their own modules
# above the shared pieces (trace_events.py, block_trace.py); importers of alloc_trace keep finding them here.
from .checkpoint_trace import CHECKPOINT_REPLAY_MODES, CHECKPOINT_REPLAY_STRATEGIES, checkpoint_events  # noqa: F401
from .config import TrainConfig
from .logged_trace import (LOGGED_FAMILIES, LOGGED_FSDP1, LOGGED_FSDP2, LOGGED_OPTIMIZERS,  # noqa: F401
                           _built_and_cast, logged_fsdp1_events, logged_fsdp2_events, logged_step_events)
from .stage_trace import (STAGE_FAMILIES, _stage_reserved_peak, _stage_reserved_peak_within,  # noqa: F401
                          stage_allocation_events, stage_reserved_peak, stage_reserved_peak_within)
from .strategies import REGISTRY, get_strategy
from .trace_events import MEASURED_STEPS, WARMUP_STEPS, _broadcast_coalesced, _collector_paused  # noqa: F401
# The walk of a run's steps (construction, forward, backward, the optimizer step, the strategies' hooks)
from .train_step_trace import TrainStepWalk

MAX_MICROBATCHES = 64
"""Pipeline stages with more micro-batches per step are not replayed (GPipe writes every micro-batch's
forward before the first backward: the work grows with them); the margin instead, and the output says so."""
MAX_LAYERS = 160
"""Deeper models are not replayed (the work grows with the layers): 160 covers the deepest published
dense models (Llama-3.1-405B 126 layers, PaLM 540B 118, GPT-3 96); beyond it the reserved peak is the
margin (memory.RESERVED_MARGIN) and the output says so."""


@_collector_paused
def allocation_events(train: TrainConfig, strategy, world: int, shard: int, device: str = "cuda",
                      backend: str = "nccl", workspace: int = 0, init: str = "device") -> list:
    """The events of a run (construction, WARMUP_STEPS + MEASURED_STEPS steps) on the most loaded rank; see
    the module docstring. `world`/`shard`: the data-parallel ranks and the shard group size. `init`:
    'device' builds the whole model on the device and then wraps it (what the probes do); 'meta' builds
    it on the meta device and materializes only this rank's parameters after wrapping (`to_empty` +
    `init_weights`, torchtitan's way for FSDP), so no full-model copy ever exists on the device.
    `backend` does not change the events: what only gloo allocates (reduce_scatter's split copy) is on the
    CPU, where nothing is reserved."""
    walk = TrainStepWalk(train, get_strategy(strategy), world, shard, device, init)
    # (MEASURED_STEPS read here, at call time: tests/test_alloc_trace.py sets alloc_trace.MEASURED_STEPS)
    for i in range(WARMUP_STEPS + MEASURED_STEPS):
        if i == 0 and workspace:
            walk.E.a(workspace)  # the first GEMM's cuBLAS workspace (CublasHandlePool.cpp), kept
        walk.step()
    return walk.E.ev


def _trace_fields(st) -> tuple:
    """What `allocation_events` reads of a strategy: two with the same write the same events."""
    return st.family, st.shards_params, st.shards_optimizer, st.reshard_after_forward


_TRACE_NAMES = {s.name: next(t.name for t in REGISTRY.values() if _trace_fields(t) == _trace_fields(s))
                for s in REGISTRY.values()}
"""Registry name -> the first registry strategy that writes the same events (`_trace_fields`): hsdp -> fsdp
(FSDP1 HYBRID_SHARD allocates as FULL_SHARD over its shard group, which the callers pass), the others
themselves. The replay caches below are keyed by it, so that hsdp inside one node (the same world and
shard as fsdp) is neither written nor replayed again (tests/test_alloc_trace.py checks the events)."""


def _trace_name(strategy) -> str:
    st = get_strategy(strategy)
    return _TRACE_NAMES[st.name] if REGISTRY.get(st.name) is st else st.name


def reserved_peak(train: TrainConfig, strategy, world: int, shard: int, device: str = "cuda",
                  backend: str = "nccl", workspace: int = 0, expandable_segments: bool = False,
                  init: str = "device", max_split_size: int | None = None) -> tuple[int, int]:
    """(reserved peak, allocated peak) of the replayed run: what `max_memory_reserved` and
    `max_memory_allocated` would read."""
    args = (train, _trace_name(strategy), world, shard, device, backend, workspace, expandable_segments,
            init, max_split_size)
    got = _REPLAYED.get(args)
    return got if got is not None else _reserved_peak(*args)


def reserved_peak_within(limit: int, train: TrainConfig, strategy, world: int, shard: int, device: str = "cuda",
                         backend: str = "nccl", workspace: int = 0, expandable_segments: bool = False,
                         init: str = "device", max_split_size: int | None = None) -> tuple[int, int, int] | None:
    """The run on a device where the caching allocator can reserve `limit` bytes: (reserved peak, allocated
    peak, retries), or None when it runs out of memory there. The allocator releases its cached segments and
    retries a cudaMalloc that fails before it gives up (allocator.CachingAllocator.capacity), so a run
    whose reserved peak without a limit (`reserved_peak`) is above `limit` may still fit, at `retries`
    releases of the cache."""
    args = (train, _trace_name(strategy), world, shard, device, backend, workspace, expandable_segments,
            init, max_split_size)
    got = _REPLAYED.get(args)
    if got is not None and got[0] <= limit:  # fits without reaching the limit
        return got + (0,)
    key = args + (limit,)
    fit = _FIT.get(key, _FIT)
    if fit is _FIT:
        fit = replay_fit(allocation_events(train, args[1], world, shard, device, backend, workspace, init), limit,
                         expandable_segments=expandable_segments, max_split_size=max_split_size,
                         rounding=alloc_rounding(train.alloc_conf))
        _remember(key, fit, _FIT)
        if fit is not None and not fit[2]:  # never reached the limit: the run without one
            _remember(args, fit[:2])
    return fit


def reserved_peak_below(limit: int, train: TrainConfig, strategy, world: int, shard: int, device: str = "cuda",
                        backend: str = "nccl", workspace: int = 0, expandable_segments: bool = False,
                        init: str = "device", max_split_size: int | None = None) -> tuple[int, int] | None:
    """`reserved_peak` where it is at most `limit` bytes, else None: a replay not made yet stops at the
    first segment that passes the limit (allocator.replay's `stop_above`; the reserved bytes only grow
    without one), so the question "fits without the allocator releasing its cache" answered no costs part
    of a replay (the micro-batch and layout searches ask it most)."""
    args = (train, _trace_name(strategy), world, shard, device, backend, workspace, expandable_segments,
            init, max_split_size)
    got = _REPLAYED.get(args)
    if got is None:
        if _ABOVE.get(args, -1) >= limit:  # an earlier replay stopped above this limit or a higher one
            return None
        got = replay_peaks(allocation_events(train, args[1], world, shard, device, backend, workspace, init),
                           expandable_segments=expandable_segments, max_split_size=max_split_size, stop_above=limit,
                           rounding=alloc_rounding(train.alloc_conf))
        if got is None:
            _remember(args, limit, _ABOVE)
            return None
        _remember(args, got)
    return None if got[0] > limit else got


_REPLAYED: dict = {}  # reserved_peak's arguments -> its result, from any function above
_FIT: dict = {}  # reserved_peak_within's arguments (the limit last) -> its result
_ABOVE: dict = {}  # reserved_peak's arguments -> a limit its reserved peak is known to be above


def _remember(args, got, into: dict = _REPLAYED) -> None:
    if len(into) >= 4096:  # bounded: cleared when full
        into.clear()
    into[args] = got


def _forget() -> None:
    _REPLAYED.clear()
    _FIT.clear()
    _ABOVE.clear()


_remember.cache_clear = _forget  # api.clear_caches finds it


@lru_cache(maxsize=1024)
def _reserved_peak(train, name, world, shard, device, backend, workspace, expandable_segments, init,
                   max_split_size):
    got = replay_peaks(allocation_events(train, name, world, shard, device, backend, workspace, init),
                       expandable_segments=expandable_segments, max_split_size=max_split_size,
                       rounding=alloc_rounding(train.alloc_conf))
    _remember((train, name, world, shard, device, backend, workspace, expandable_segments, init, max_split_size),
              got)
    return got


