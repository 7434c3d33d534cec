"""Per-rank memory: live bytes per component at each phase boundary that can hold the peak.

For the most loaded rank of one strategy this walks one measured training step (after a warm-up step,
so optimizer state exists and `zero_grad(set_to_none=True)` has freed the gradients):

    forward (each unit)  ->  loss  ->  backward (loss, each unit, last to first)  ->  optimizer step

and reports the maximum of the live bytes, split into the components the probes measure: `params`,
`grads`, `optimizer`, `activations`, `comm_buffers` (DDP buckets, FSDP all-gathered/unsharded
parameters, unsharded gradients and reduce-scatter buffers), `temporaries` (logits, loss gradients,
optimizer-step intermediates, backward transients). The blocks are identical, so each walk looks at the
first and last block of a phase; live bytes are linear in the block index in between.

Sources, by family (installed torch, `torch/...`):
- DDP (`nn/parallel/distributed.py`, `csrc/distributed/c10d/reducer.cpp`): buckets are flat tensors
  of the gradients' dtype allocated at construction; with the default `gradient_as_bucket_view=False`
  `.grad` is a separate tensor, so gradients exist twice after backward.
- ZeroRedundancyOptimizer (`distributed/optim/zero_redundancy_optimizer.py` `_partition_parameters`):
  parameters sorted by size, largest first, each to the rank with the smallest total so far.
- FSDP2 (`distributed/fsdp/_fully_shard/_fsdp_param.py`, `_fsdp_collectives.py`): each parameter
  sharded on dim 0, padded to a multiple of the shard group; the all-gather output is copied out into
  per-parameter unsharded tensors (both alive for a moment); gradients of the unsharded parameters are
  copied into one reduce-scatter input in `reduce_dtype`; forward prefetches the next block.
- FSDP1 (`distributed/fsdp/_flat_param.py`, `_runtime_utils.py`): one FlatParameter per wrapped unit,
  padded to a multiple of the shard group; with mixed precision a 16-bit copy of the shard is made
  before the all-gather; the unsharded gradient is cast to `reduce_dtype` before reduce-scatter.
- Optimizers (`optim/adam.py` `_multi_tensor_adam`): foreach keeps one intermediate the size of the
  step's parameters (`exp_avg_sq_sqrt`); fused none; the for-loop one per parameter, twice its size.

Known limitations: the CUDA caching allocator's rounding (512 B blocks) and fragmentation are not in
`peak_allocated` (see `reserved_estimate`); FSDP's CUDA-stream reuse (`recordStream`) can hold an extra
all-gather buffer on GPUs; DeepSpeed figures follow its estimators and are not validated here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from .activations import ActivationBreakdown, activations
from .config import Cluster, TrainConfig
from .model import ModelSpec
from .precision import optimizer_state_elems
from .strategies import Strategy, get_strategy

COMPONENTS = ("params", "grads", "optimizer", "activations", "comm_buffers", "temporaries")
DDP_BUCKET_CAP_BYTES = 25 * 2**20  # DistributedDataParallel(bucket_cap_mb=25)
DDP_FIRST_BUCKET_BYTES = 1 * 2**20  # dist._DEFAULT_FIRST_BUCKET_BYTES
CUDA_CONTEXT_BYTES = 600 * 2**20  # CUDA context + cuBLAS handles (references.md §3: 0.3-2 GiB)
NCCL_COMM_BYTES = 250 * 2**20  # per communicator group, buffers (NCCL_BUFFSIZE 4 MiB x channels)
CUBLAS_WORKSPACE_BYTES = 8 * 2**20 + 4 * 2**20 * 0  # Hopper: 32 MiB; counted in temporaries on GPU


@dataclass
class Snapshot:
    phase: str
    parts: dict

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass
class MemoryEstimate:
    """Per-rank memory of one strategy: the components at the peak, and what surrounds them."""

    strategy: str
    components: dict
    peak_allocated: int
    peak_phase: str
    reserved_estimate: int
    process_overhead: int
    gpu_memory_bytes: int
    fits: bool
    notes: list = field(default_factory=list)

    @property
    def total_required(self) -> int:
        return self.peak_allocated + self.reserved_estimate + self.process_overhead

    @property
    def headroom(self) -> int:
        return self.gpu_memory_bytes - self.total_required

    def to_dict(self) -> dict:
        d = {k: int(self.components[k]) for k in COMPONENTS}
        d.update(peak_allocated=int(self.peak_allocated), reserved_estimate=int(self.reserved_estimate),
                 process_overhead=int(self.process_overhead))
        return d


# -- parameter layout -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """Element counts per rank for one (model, strategy, shard group) — cached."""

    total: int  # all parameters (unsharded)
    block: int  # one block, unsharded
    root: int  # embed + head (+ final norm), unsharded
    shard_total: int  # this rank's stored parameter elements (most loaded rank)
    shard_block: int  # one block's shard
    shard_root: int
    unshard_block: int  # one block as all-gathered (padded)
    unshard_root: int
    largest_param: int
    opt_shapes_key: tuple  # shapes whose optimizer state this rank holds


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@lru_cache(maxsize=4096)
def layout(model: ModelSpec, family: str, shard: int, shards_params: bool, shards_optimizer: bool) -> Layout:
    units = model.param_inventory()
    embed, blocks, head = units[0], units[1:-1], units[-1]
    root_params = embed.params + head.params
    block_params = blocks[0].params if blocks else ()
    root = sum(_numel(s) for _, s in root_params)
    block = sum(_numel(s) for _, s in block_params)
    total = model.param_count()
    largest = max(_numel(s) for u in units for _, s in u.params)

    if family == "fsdp2":
        def fsdp2_shard(params):  # per-parameter dim-0 sharding, padded (FSDPParam._init_sharded_param)
            return sum(-(-s[0] // shard) * _numel(s[1:]) for _, s in params)
        sb, sr = fsdp2_shard(block_params), fsdp2_shard(root_params)
        shard_total = sr + model.layers * sb
        ub, ur = sb * shard, sr * shard
        opt_key = ()
    elif family == "fsdp1":
        def fsdp1_shard(params):  # one FlatParameter, padded to a multiple of the group (_flat_param.py)
            n = sum(_numel(s) for _, s in params)
            return -(-n // shard) if shards_params or shards_optimizer else n
        sb, sr = fsdp1_shard(block_params), fsdp1_shard(root_params)
        shard_total = sr + model.layers * sb
        ub = sb * shard if shards_params or shards_optimizer else sb
        ur = sr * shard if shards_params or shards_optimizer else sr
        opt_key = ()
    else:
        sb, sr, ub, ur = block, root, block, root
        shard_total = total
        opt_key = ()
        if family == "zero1" and shard > 1:
            # ZeroRedundancyOptimizer._partition_parameters: sorted by numel, largest first, each to
            # the rank with the smallest total so far; report the most loaded rank's shapes.
            shapes = sorted((s for u in units for _, s in u.params), key=_numel, reverse=True)
            totals = [0] * shard
            owned = [[] for _ in range(shard)]
            for s in shapes:
                r = totals.index(min(totals))
                totals[r] += _numel(s)
                owned[r].append(s)
            r = totals.index(max(totals))
            opt_key = tuple(owned[r])
    return Layout(total, block, root, shard_total, sb, sr, ub, ur, largest, opt_key)


def _all_shapes(model: ModelSpec) -> tuple:
    return tuple(s for u in model.param_inventory() for _, s in u.params)


@lru_cache(maxsize=4096)
def _opt_state(model: ModelSpec, optimizer: str, family: str, shard: int, key: tuple) -> tuple[int, float]:
    """(state elements, extra bytes) held by the most loaded rank."""
    if family == "zero1" and shard > 1:
        return optimizer_state_elems(optimizer, list(key))
    shapes = _all_shapes(model)
    if family in ("fsdp2", "fsdp1") and shard > 1:
        # Sharded flat/dim-0 shards: states are elementwise (Adam, momentum): shard elements.
        elems, extra = optimizer_state_elems(optimizer, list(shapes))
        return -(-elems // shard), extra / shard
    return optimizer_state_elems(optimizer, list(shapes))


# -- the walk ------------------------------------------------------------------------------------

def estimate_memory(train: TrainConfig, cluster: Cluster, strategy: str | Strategy,
                    device: str = "cuda") -> MemoryEstimate:
    """Predict the most loaded rank's memory for one strategy (see module docstring)."""
    st = strategy if isinstance(strategy, Strategy) else get_strategy(strategy)
    if train.framework == "deepspeed" and st.name in ("zero1", "zero2", "zero3"):
        from .deepspeed import estimate_deepspeed
        return estimate_deepspeed(train, cluster, st)
    family = st.family
    world = 1 if st.name == "single" else cluster.gpus
    shard = {"world": world, "node": min(world, cluster.local_size), "none": 1}[st.shard_group]
    if family == "fsdp1" and st.name == "fsdp-no-shard":
        shard = 1
    prec = train.prec
    m = train.model
    lay = layout(m, family, shard, st.shards_params, st.shards_optimizer)
    act: ActivationBreakdown = activations(train, family, device)
    notes: list[str] = []

    pb, gb = prec.param_bytes, prec.grad_bytes
    cb = prec.compute_bytes  # FSDP param_dtype / activation dtype
    state_bytes = pb  # torch.optim states: zeros_like(param)
    opt_elems, opt_extra = _opt_state(m, train.optimizer, family, shard, lay.opt_shapes_key)
    opt = opt_elems * state_bytes + int(opt_extra)

    offload_params = train.cpu_offload == "params" and family in ("fsdp1", "fsdp2")
    if train.cpu_offload != "none" and not offload_params:
        notes.append(f"cpu_offload={train.cpu_offload} is not supported by {st.implementation}; ignored")

    n_tok = train.micro_batch * train.seq_len
    v = m.vocab
    L = m.layers
    blocks_act = act.blocks_total
    per_block_act = (blocks_act - 0) // L if L else 0
    base_act = act.outside + act.weight_cache

    # Optimizer-step intermediates (adam.py _multi_tensor_adam: exp_avg_sq_sqrt).
    step_elems = lay.shard_total if family in ("fsdp1", "fsdp2") else (
        sum(_numel(s) for s in lay.opt_shapes_key) if family == "zero1" and shard > 1 else lay.total)
    if train.optimizer in ("adam", "adamw"):
        if train.optimizer_impl == "foreach":
            opt_tmp = step_elems * state_bytes
        elif train.optimizer_impl == "for-loop":
            opt_tmp = 2 * min(lay.largest_param, step_elems) * state_bytes
        else:
            opt_tmp = 0
    elif train.optimizer == "adafactor":
        opt_tmp = 2 * lay.largest_param * state_bytes
    else:
        opt_tmp = 0

    snaps: list[Snapshot] = []

    def snap(phase, **parts):
        full = {k: 0 for k in COMPONENTS}
        for k, val in parts.items():
            full[k] += int(val)
        snaps.append(Snapshot(phase, full))

    loss_fwd_tmp = act.logits_transient  # 16-bit logits + fp32 copy at cross_entropy
    loss_bwd_tmp = 2 * n_tok * v * 4  # nll_loss grad + log_softmax backward output (fp32)
    # Backward through one block: gradient of the residual stream plus the largest pair of
    # intermediate gradients (SwiGLU: d(silu*up) split to gate and up, n*f each).
    f = m.ffn_hidden
    e_act = 4 if prec.compute_bytes == 4 else 2
    block_bwd_tmp = n_tok * (4 * m.hidden + 2 * e_act * f)

    if offload_params:
        params = grads_full = 0
        opt = 0
        opt_tmp = 0
        notes.append("parameters, gradients and optimizer state live in CPU memory (CPU offload)")

    if family in ("single", "ddp", "zero1"):
        params = lay.total * pb
        buckets = 0 if family == "single" else lay.total * gb
        grads = lay.total * gb
        base = dict(params=params, optimizer=opt, comm_buffers=buckets)
        snap("forward", **base, activations=blocks_act + base_act + act.loss_saved, temporaries=loss_fwd_tmp)
        snap("backward", **base, activations=blocks_act + base_act + act.loss_saved, temporaries=loss_bwd_tmp)
        # End of the head's backward: head grads exist, all block activations still alive.
        head_grads = lay.root * gb if not m.tie_embeddings else (lay.root - m.vocab * m.hidden) * gb
        snap("backward", **base, activations=blocks_act + base_act, grads=head_grads,
             temporaries=block_bwd_tmp)
        # Last block (block 0) backward: all block grads exist but the embedding's.
        emb = m.vocab * m.hidden + (m.max_positions * m.hidden if m.position == "learned" else 0)
        snap("backward", **base, activations=per_block_act + act.outside,
             grads=(lay.total - emb) * gb, temporaries=block_bwd_tmp)
        snap("optimizer", **base, grads=grads, temporaries=opt_tmp)
    else:
        unsharded_dtype = cb if prec.mixed else pb
        reduce_bytes = 4 if prec.mixed else gb  # reduce_dtype=fp32 under mixed precision
        params = 0 if offload_params else lay.shard_total * pb
        grads_sharded = 0 if offload_params else lay.shard_total * (4 if prec.mixed else gb)
        ub, ur = lay.unshard_block * unsharded_dtype, lay.unshard_root * unsharded_dtype
        sharding = shard > 1 and st.shards_params
        reshard = st.reshard_after_forward and sharding
        base = dict(params=params, optimizer=opt)
        if not sharding:  # fsdp-no-shard: full flat params, all-reduce per unit
            # Mixed precision keeps a 16-bit copy of each unit's flat parameter while it is used.
            ub = lay.unshard_block * cb if prec.mixed else 0
            ur = lay.unshard_root * cb if prec.mixed else 0
        # Forward, end: root stays unsharded (FSDP1: root not resharded after forward; FSDP2:
        # root post_forward_mesh_info=None); zero3/full shard keep 1 block (+1 prefetched is freed).
        held_blocks = 1 if reshard else L
        if not sharding and prec.mixed:
            held_blocks = 1 if family == "fsdp1" else L
        fwd_comm = ur + held_blocks * ub
        # Gradient accumulation without sync (FSDP1 no_sync, FSDP2 set_requires_gradient_sync(False)):
        # FSDP1 keeps each unit's unsharded flat gradient (param_dtype) in flat_param.grad
        # (_runtime_utils._post_backward_hook returns before reducing); FSDP2 keeps unsharded
        # accumulated gradients in reduce_dtype (_fsdp_param.to_accumulated_grad_if_needed). From the
        # second micro-step on they exist for every unit through forward and backward.
        if train.grad_accum > 1 and sharding:
            acc_bytes = unsharded_dtype if family == "fsdp1" else reduce_bytes
            fwd_comm += (lay.unshard_root + L * lay.unshard_block) * acc_bytes
            notes.append("gradient accumulation keeps unsharded gradients of every unit between micro-steps")
        snap("forward", **base, comm_buffers=fwd_comm + (ub if reshard else 0),
             activations=blocks_act + base_act - act.outside + act.outside + act.loss_saved - act.loss_saved,
             temporaries=0)
        snap("forward", **base, comm_buffers=fwd_comm,
             activations=blocks_act + base_act + act.loss_saved, temporaries=loss_fwd_tmp)
        # Backward at the loss: root unsharded; the head's gradient appears.
        snap("backward", **base, comm_buffers=fwd_comm,
             activations=blocks_act + base_act + act.loss_saved, temporaries=loss_bwd_tmp)
        # Backward through the last block: it is unsharded (+ the next prefetched when resharding),
        # its unsharded grads (param dtype) and the reduce-scatter input (reduce dtype) coexist.
        rs_block = lay.unshard_block * reduce_bytes if sharding else 0
        g_block = lay.unshard_block * unsharded_dtype
        acc = fwd_comm - (ur + held_blocks * ub)
        bwd_unsharded = ur + (2 * ub if reshard else held_blocks * ub) + acc
        snap("backward", **base, comm_buffers=bwd_unsharded + g_block + rs_block,
             activations=blocks_act + base_act, grads=0, temporaries=block_bwd_tmp)
        # Backward through the first block: all block grads but one are reduced to shards.
        # After a block's backward its parameters are resharded, except FSDP1 SHARD_GRAD_OP under
        # no_sync (_should_free_in_backward is False), which keeps every unit unsharded.
        keep_all = family == "fsdp1" and not st.reshard_after_forward and train.grad_accum > 1
        bwd_unsharded_first = ur + (held_blocks * ub if keep_all else ub) + acc
        snap("backward", **base, comm_buffers=bwd_unsharded_first + g_block + rs_block,
             activations=per_block_act + act.outside,
             grads=max(0, lay.shard_total - lay.shard_root) * (4 if prec.mixed else gb) if sharding else
             (lay.total - lay.root) * gb,
             temporaries=block_bwd_tmp)
        snap("optimizer", **base, grads=grads_sharded if sharding else lay.total * gb, temporaries=opt_tmp)

    peak = max(snaps, key=lambda s: s.total)
    comps = dict(peak.parts)
    reserved = int(0.10 * peak.total)  # caching-allocator fragmentation (references.md §3)
    groups = 0 if world == 1 else (2 if st.shard_group == "node" and cluster.nodes > 1 else 1)
    overhead = CUDA_CONTEXT_BYTES + groups * NCCL_COMM_BYTES
    total = peak.total + reserved + overhead
    return MemoryEstimate(st.name, comps, peak.total, peak.phase, reserved, overhead,
                          cluster.gpu_memory_bytes, total <= cluster.gpu_memory_bytes, notes)
