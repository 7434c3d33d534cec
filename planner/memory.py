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

On CUDA `peak_allocated` also holds the cuBLAS/cuBLASLt workspaces (`library_workspace_bytes`), which
no tensor owns and no component counts.

Known limitations: the CUDA caching allocator's rounding (a cached block less than 1 MiB larger than the
request is handed out whole) and fragmentation are not in `peak_allocated` (they are in `peak_reserved`,
alloc_trace.py; measured on an H100: 0 to 13 MiB above the tensors and workspaces); FSDP's CUDA-stream reuse (`recordStream`) can hold an extra
all-gather buffer on GPUs; DeepSpeed figures follow its estimators and are not validated here.
"""

from __future__ import annotations

from functools import lru_cache

from .alloc_trace import MAX_LAYERS
from .activations import ActivationBreakdown, activations_in, regime_for, sp_tokens
from .block_backward import _block_backward_peak
from .config import Cluster, TrainConfig
from .cp import cp_view
from .deepspeed import estimate_deepspeed
# The answer, its workspaces and the states' layout live below the walk (estimate.py, state_layout.py);
# importers of memory keep finding them here.
from .estimate import (COMPONENTS, RESERVED_MARGIN, MemoryEstimate, Snapshot, _alloc_conf,  # noqa: F401
                       cublas_workspace_bytes, library_workspace_bytes)
from .footprint import CUDA_CONTEXT_BYTES, DeviceFootprint, device_footprint  # noqa: F401 (re-exported)
from .fsdp_walk import fsdp_walk
from .pp import pp_memory
from .state_layout import (Layout, _all_state_elems, _opt_state, _size_runs, layout, zero1_owned_shapes,  # noqa: F401
                           zero1_partition)
from .strategies import Strategy, get_strategy
from .tp import tp_view
from .walk_terms import WalkTerms

DDP_BUCKET_CAP_BYTES = 25 * 2**20  # DistributedDataParallel(bucket_cap_mb=25)
DDP_FIRST_BUCKET_BYTES = 1 * 2**20  # dist._DEFAULT_FIRST_BUCKET_BYTES


# -- the walk ------------------------------------------------------------------------------------

def _replica_walk(snap, w: WalkTerms) -> tuple[int, int]:
    """The walk's phases for a full replica per rank (single, DDP, ZeRO-1): forward, the loss's and the head's
    backward, the first and last blocks' backward, the optimizer step, each instant taken by `snap` (bytes).
    Returns (the parameters' bytes, DDP's gradient buckets' bytes)."""
    train, st, m, act, lay, notes = w.train, w.st, w.m, w.act, w.lay, w.notes
    pb, gb, later, L, v, h, ev = w.pb, w.gb, w.later, w.L, w.v, w.h, w.ev
    head_elems, freed, blk_tmp, wgrad_elems = w.head_elems, w.freed, w.blk_tmp, w.wgrad_elems
    params = lay.total * pb
    buckets = 0 if not st.distributed else lay.total * gb
    base_comm = buckets
    # Gradient accumulation, synced or not: every parameter's unsharded .grad is alive from the first
    # micro-step's backward to the optimizer step; AccumulateGrad adds each later gradient in place
    # (torch/csrc/autograd/functions/accumulate_grad.h `accumulateGrad`: `variable_grad += new_grad`
    # outside grad mode), so the new gradient is the same transient as at grad_accum=1. DDP's reducer
    # all-reduces a bucket copy and copies it back into .grad (`Reducer::copy_bucket_to_grad`).
    if later:
        notes.append("gradient accumulation keeps every parameter's gradient between micro-steps")
        carried, snap_inner = lay.total * gb, snap

        def snap(phase, grads=0, **parts):  # noqa: F811 -- every .grad of a later micro-step is alive
            snap_inner(phase, grads=max(grads, carried) if phase != "optimizer" else grads, **parts)
    snap("forward", activations=w.acts_fwd)
    snap("backward", activations=w.acts_bwd, temporaries=w.loss_bwd_tmp)
    if w.head_bwd:  # the head's weight gradient: .grad, or (tied; or a later micro-step's, before its add)
        # waiting in autograd's input buffer
        w_head = v * h * gb
        pending = m.tie_embeddings or later
        snap("backward", activations=w.head_acts, grads=0 if pending else w_head,
             temporaries=w.head_bwd + (w_head if pending else 0))
    # First block's MLP backward: the head's gradient exists, every block's activations live.
    # The weight gradient just computed waits in autograd's input buffer (a temporary) until its
    # AccumulateGrad runs; so does a tied head's, until the embedding's half arrives.
    head_in_buf = head_elems * gb if m.tie_embeddings else 0
    # Last block (block 0): every gradient but the embedding's and most of block 0's.
    emb = v * h + (m.max_positions * h if m.position == "learned" else 0)
    grads_last = (lay.total - emb - lay.block) * gb
    if not ev:
        snap("backward", activations=w.first_acts + w.outside_first - freed,
             grads=head_elems * gb - head_in_buf, temporaries=blk_tmp + wgrad_elems * gb + head_in_buf)
        snap("backward", activations=w.last_acts + w.outside_last - freed, grads=grads_last,
             temporaries=blk_tmp + wgrad_elems * gb + head_in_buf)
    for j in walked_blocks((), L, ev):  # every-K: block j's backward, recomputed or not
        fr, tmp = w.block_backward_bytes(j)
        snap("backward", activations=act.through(j) + act.inputs + act.cache_below(j + 1) - fr,
             grads=grads_last if j == 0 else head_elems * gb - head_in_buf + (L - 1 - j) * lay.block * gb,
             temporaries=tmp + wgrad_elems * gb + head_in_buf)
    if m.tie_embeddings:
        # The embedding's backward, the step's last: its dense (V x h) gradient is made while the tied
        # head's half still waits in autograd's input buffer, and the two are summed there
        # (`InputBuffer::accumulate`) before the parameter's one AccumulateGrad runs. Measured (CPU
        # probe of a tied Gemma-2 with a 64k vocabulary, torch 2.13, and the trace on fake tensors):
        # three V x h gradients alive at once beside every other parameter's, the peak of a
        # large-vocabulary model (-13% without this instant).
        snap("backward", activations=act.inputs, grads=(lay.total - emb) * gb, temporaries=3 * v * h * gb)
    # Tensor parallelism: the vocabulary-sharded embedding's gradient is the whole vocabulary on every
    # TP rank, a Replicate DTensor: DTensor's `embedding_dense_backward` strategies
    # (`tensor/_ops/_embedding_ops.py`) have no row-sharded output, so the replicated incoming
    # gradient gives a replicated (V x h) weight gradient; `.grad` keeps that placement.
    emb_full = (m.vocab - v) * h * gb if train.tp > 1 else 0
    # the optimizer step: the batch's ids and targets are still held by the loop (measured by every CPU and
    # H100 probe whose peak is there: +16 bytes per token without them)
    snap("optimizer", grads=lay.total * gb + emb_full, temporaries=w.opt_tmp + act.held_inputs)
    return params, base_comm


def estimate_memory(train: TrainConfig, cluster: Cluster, strategy: str | Strategy,
                    device: str = "cuda", backend: str = "nccl", gpu_name: str | None = None,
                    init: str = "meta") -> MemoryEstimate:
    """Predict the most loaded rank's memory for one strategy (see module docstring).

    `device` ('cuda' or 'cpu') picks the activation terms that differ between the two; `backend`
    ('nccl', 'gloo' or 'fake') adds what the collective backend allocates itself: gloo's
    `reduce_scatter_tensor` splits its input into per-rank copies (one input-sized copy), which
    NCCL and the fake process group do not. The CPU validation path runs on gloo. On 'cuda',
    `peak_allocated` adds the cuBLAS workspaces of `gpu_name` (default: the cluster's GPU). `init`
    ('meta' or 'device') and `train.alloc_conf` go to the allocator replay (`peak_reserved`).
    """
    st = get_strategy(strategy)
    if train.cp > 1:  # one context-parallel rank: s / cp tokens of each sequence, a ring attention (cp.py)
        train = cp_view(train)
    if train.pp > 1:  # pipeline stages: the most loaded stage's walk (pp.py)
        return pp_memory(train, cluster, st, device, backend, gpu_name)
    if train.tp > 1:  # one TP rank's parameters, the strategy over the data-parallel ranks (tp.py)
        train, cluster = tp_view(train, cluster)
    if train.framework == "deepspeed" and st.zero_stage:
        return estimate_deepspeed(train, cluster, st)
    family = st.family
    world = cluster.gpus if st.distributed else 1
    group = st.shard_group
    shard = world if group == "world" else (min(world, cluster.local_size) if group == "node" else 1)
    if st.fsdp_no_shard:
        shard = 1
    notes_pre = []
    if st.hybrid and shard == 1 and world > 1:
        notes_pre.append("hsdp with 1 GPU per node: PyTorch's HYBRID_SHARD falls back to NO_SHARD and "
                         "all-reduces only inside the node's group of one; use ddp or fsdp instead")
    prec = train.prec
    m = train.model
    lay = layout(m, family, shard, st.shards_params, st.shards_optimizer)
    regime = regime_for(train, family)
    act: ActivationBreakdown = activations_in(train, regime, device)
    notes: list[str] = list(notes_pre)

    pb = prec.param_bytes
    state_bytes = pb  # torch.optim states: zeros_like(param)
    opt_elems, opt_extra = _opt_state(m, train.optimizer, family, shard)
    opt = opt_elems * state_bytes + int(opt_extra)

    offload_params = train.cpu_offload == "params" and st.fsdp
    if train.cpu_offload != "none" and not offload_params:
        notes.append(f"cpu_offload={train.cpu_offload} is not supported by {st.implementation}; ignored")

    n_tok = train.micro_batch * train.seq_len
    opt_tmp = _optimizer_step_temp_bytes(train, st, lay, shard, state_bytes)

    # Every snapshot of a walk holds the same base (parameters, optimizer state; DDP's buckets), so
    # `snap` takes only the parts that vary and the peak is the first snapshot with the largest sum.
    best: list = [-1, "", None]  # total, phase, parts
    tp_emb = _tp_embedding_comm_bytes(train, regime, act, n_tok)

    def snap(phase, activations=0, comm_buffers=0, grads=0, temporaries=0):
        if tp_emb and phase != "optimizer" and activations - tp_emb >= act.inputs:
            activations, comm_buffers = activations - tp_emb, comm_buffers + tp_emb
        total = activations + comm_buffers + grads + temporaries
        if total > best[0]:
            best[:] = total, phase, (activations, comm_buffers, grads, temporaries)

    host_bytes = 0
    if offload_params:
        host_bytes = _offload_host_bytes(cluster, st, lay, prec, world, opt, notes)
        opt = 0
        opt_tmp = 0
    w = _walk_terms(train, st, act, lay, regime, shard, device, backend, notes, offload_params, opt_tmp)
    params, base_comm = (fsdp_walk if st.fsdp else _replica_walk)(snap, w)
    _, phase, parts = best
    return _estimate_at_peak(train, cluster, st, device, backend, gpu_name, init, phase, parts, params, opt, base_comm,
                             world, shard, offload_params, host_bytes, notes)


def _optimizer_step_temp_bytes(train: TrainConfig, st: Strategy, lay: Layout, shard: int, state_bytes: int) -> int:
    """Optimizer-step intermediates, bytes (adam.py _multi_tensor_adam: exp_avg_sq_sqrt)."""
    step_elems = lay.shard_total if st.fsdp else (
        lay.opt_owned if st.zero_optimizer and shard > 1 else lay.total)
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
    return opt_tmp


def _tp_embedding_comm_bytes(train: TrainConfig, regime: str, act, n_tok: int) -> int:
    """Bytes of the token embedding's output a probe books with the communication buffers under TP (0 without)."""
    m = train.model
    # Tensor parallelism with fp32 embeddings (fp32, autocast): the token embedding's output, which the
    # first block's norm keeps (its fp32 `x.float()` is that tensor) to block 0's backward, is the TP group's
    # collective output (RowwiseParallel: the all-reduce of the partial embeddings, with SP their
    # reduce-scatter), so a probe's tracker books it with the communication buffers: same bytes, another
    # component. With 16-bit embeddings the norm keeps its own fp32 copy and the collective's output dies
    # after block 0's forward, unless block 0 is checkpointed (full, every-K), which keeps its input.
    # Measured: transformers Llama and the reference decoder, gloo and the fake process group, tp = 2,
    # with and without SP.
    return (sp_tokens(train, n_tok) * (2 if regime == "lowp" else 4) * m.hidden
            if train.tp > 1 and train.cp == 1 and (regime != "lowp" or act.every or train.checkpointing == "full")
            else 0)


def _offload_host_bytes(cluster: Cluster, st: Strategy, lay: Layout, prec, world: int, opt: int,
                        notes: list) -> int:
    """FSDP CPU offload: the node's CPU memory bytes (the notes say whether they fit)."""
    pb = prec.param_bytes
    # What the node's ranks hold in CPU memory: the fp32 parameter shards, the gradient shards
    # (FSDP1 `_cpu_grad`, FSDP2 `sharded_param.grad` on the CPU; the parameter's dtype) and the
    # optimizer states, which step on the CPU.
    local = min(cluster.gpus_per_node, world)
    host_bytes = local * (lay.shard_total * (pb + (4 if prec.mixed else prec.grad_bytes)) + opt)
    if cluster.host_memory_bytes:
        notes.append(f"{st.name}: CPU offload holds {host_bytes / 2**30:,.0f} GiB of CPU memory per node "
                     f"(of {cluster.host_memory_bytes / 2**30:,.0f} GiB"
                     + ("" if host_bytes <= cluster.host_memory_bytes else ": does not fit") + ")")
    else:
        notes.append(f"{st.name}: CPU offload holds {host_bytes / 2**30:,.0f} GiB of CPU memory per node "
                     f"(not checked: the node's memory is not in the catalog; --node names one that has it)")
    notes.append("CPU offload: parameters and optimizer state live in CPU memory, and each gradient shard is "
                 "copied there once reduced (FSDP2 frees the GPU copy at once; FSDP1 keeps it until the end "
                 "of backward); the step time leaves out the optimizer step on the CPU and the PCIe copies")
    return host_bytes


def _walk_terms(train: TrainConfig, st: Strategy, act: ActivationBreakdown, lay: Layout, regime: str, shard: int,
                device: str, backend: str, notes: list, offload_params: bool, opt_tmp: int) -> WalkTerms:
    """The terms both walks share: activations at each phase, the loss's, the head's and a block's backward."""
    prec, m = train.prec, train.model
    n_tok = train.micro_batch * train.seq_len
    v = -(-m.vocab // train.tp)  # one tensor-parallel rank's vocabulary shard (embedding, head, loss)
    L = m.layers
    h = m.hidden
    r = 4 if regime in ("fp32", "autocast") else 2  # residual stream bytes
    # Categories follow what the probes measure: storages made in forward and alive are activations
    # (logits included), those made in backward or the optimizer step are temporaries.
    acts_fwd = act.blocks_total + act.outside + act.weight_cache_forward + act.loss_saved + act.logits_transient
    acts_bwd = act.blocks_total + act.outside + act.weight_cache + act.loss_saved
    loss_bwd_tmp = 2 * n_tok * v * 4  # nll_loss_backward's dense grad + log_softmax_backward's output
    if train.tp > 1:
        # loss parallel fuses both backwards (`tensor/parallel/loss.py` `_nll_loss_and_log_softmax_backward`):
        # `grad_input = zeros_like(x)`, then `(grad_input + exp(x)) * grad_output`: the zeros, the sum and
        # the product alive at once (exp(x) is freed by then), three n x V/t fp32 tensors
        loss_bwd_tmp = 3 * n_tok * v * 4
    freed, blk_tmp, wgrad_elems = _block_backward_peak(train, regime, n_tok, device)
    # FSDP2 without sync and without mixed precision: a later micro-step adds each new gradient into the
    # kept .grad in place, so only the weight gradient just made is alive (`_in_place_block_peak`)
    in_place = (train.grad_accum > 1 and not train.sync_every and st.fsdp2 and not prec.mixed
                and shard > 1 and st.shards_params)
    if in_place:
        freed, blk_tmp, wgrad_elems = _in_place_block_peak(train, regime, n_tok, (freed, blk_tmp, wgrad_elems),
                                                           prec.param_bytes)
    head_elems = v * h + h * (2 if m.norm == "layernorm" else 1)  # LM head (or tied) + final norm
    ev = act.every  # every-K checkpointing: blocks differ (activations.ActivationBreakdown.kept)
    plain_freed, plain_tmp = freed, blk_tmp
    # At the first block's backward every block's activations are alive; at the last's (block 0), block 0's
    # and what the blocks share (`act.shared`: RoPE tables, the masks checkpointed blocks keep).
    first_acts, last_acts = act.blocks_total, act.below(1) if L else 0
    if train.checkpointing != "none":
        # A checkpointed block is recomputed inside its backward: what it rebuilds is made in the
        # backward phase (a temporary to the probes), and the freed tensor is one of those.
        blk_tmp = blk_tmp + act.recompute_block - freed
        freed = 0
    # Once the head's backward is done its saved tensors (final norm, LM head input, its weight cast)
    # are freed; each block's weight casts go with that block's backward.
    outside_first = act.inputs + L * act.block_cache
    outside_last = act.inputs + act.block_cache
    head_bwd, head_acts = _head_backward_bytes(train, regime, act, acts_bwd, n_tok, v)
    return WalkTerms(
        train=train, st=st, m=m, act=act, lay=lay, notes=notes, walked_blocks=walked_blocks, regime=regime,
        device=device, backend=backend, pb=prec.param_bytes, gb=prec.grad_bytes, cb=prec.compute_bytes,
        mixed=prec.mixed, shard=shard, L=L, v=v, h=h, n_tok=n_tok, r=r, ev=ev,
        later=train.grad_accum > 1,  # the walk is of a micro-step after the first (the worst one)
        every=train.sync_every, offload_params=offload_params, in_place=in_place,
        acts_fwd=acts_fwd, acts_bwd=acts_bwd, loss_bwd_tmp=loss_bwd_tmp, head_bwd=head_bwd, head_acts=head_acts,
        head_elems=head_elems, first_acts=first_acts, outside_first=outside_first,
        last_acts=last_acts, outside_last=outside_last, freed=freed, blk_tmp=blk_tmp,
        wgrad_elems=wgrad_elems, plain_freed=plain_freed, plain_tmp=plain_tmp, opt_tmp=opt_tmp)


def _head_backward_bytes(train: TrainConfig, regime: str, act: ActivationBreakdown, acts_bwd: int, n_tok: int,
                         v: int) -> tuple[int, int]:
    """(the LM head's backward transients, 0 where no such instant; the activations then), bytes."""
    m, h, cb = train.model, train.model.hidden, train.prec.compute_bytes
    # The LM head's backward (fp32 runs, one TP rank): log_softmax's saved output and
    # nll_loss's gradient are gone, the logits' gradient (n x V) is alive while the head's matmul backward
    # makes the hidden states' gradient (n x h) and the head's weight gradient (V x h). That weight gradient
    # outweighs the two n x V tensors of the loss instant when h > 2n: a wide model at few tokens per
    # micro-batch. Measured by the trace (Qwen2.5-0.5B, 256 tokens, zero2: -2.96% without this instant;
    # Gemma-2-2B at 512 tokens, -1.66%). Gemma-2's soft-capped logits: the tanh's saved output (n x V, in
    # `outside`) is gone by then too. In a later micro-step of accumulation the new weight gradient is alive
    # until AccumulateGrad adds it into the kept .grad (measured, Qwen2.5-0.5B at 8 and 24 layers and GPT-2
    # medium at 8, zero2 and zero3 fp32 over 2 micro-steps: -1.6% to -3.75% without this instant there).
    head_bwd = (n_tok * v * 4 + n_tok * h * 4) if (regime == "fp32" and train.tp == 1) else 0
    head_acts = acts_bwd - act.loss_saved - (n_tok * v * 4 if m.final_softcap else 0)
    if regime == "autocast" and train.tp == 1:
        # Under autocast (single, DDP, ZeRO-1: fp32 parameters) the head's matmul ran on its 16-bit weight
        # cast; the highest instant is the cast's backward (ToCopyBackward), where the matmul's node is done
        # (its saved 16-bit weight cast and input freed, the logits' gradients too) and its 16-bit weight
        # gradient becomes the fp32 one (the walks' `w_head`), both alive, beside the hidden states' fp32
        # gradient. Measured by the trace at 192, 256 and 320 tokens and a probe (GPT-2 medium, ddp
        # bf16-mixed over 2 micro-steps, 256 tokens: -1.36% without this instant).
        head_bwd = v * h * cb + n_tok * h * 4
        head_acts -= v * h * cb + n_tok * h * cb
    return head_bwd, head_acts


def _estimate_at_peak(train: TrainConfig, cluster: Cluster, st: Strategy, device: str, backend: str,
                      gpu_name: str | None, init: str, phase: str, parts: tuple, params: int, opt: int,
                      base_comm: int, world: int, shard: int,
                      offload_params: bool, host_bytes: int, notes: list) -> MemoryEstimate:
    """The answer from the walk's peak `parts` (activations, comm buffers, grads, temporaries; bytes): the
    components, the workspaces, the device footprint and the allocator replay's arguments."""
    a, c, g, t = parts
    comps = {"params": int(params), "grads": int(g), "optimizer": int(opt), "activations": int(a),
             "comm_buffers": int(base_comm + c), "temporaries": int(t)}  # COMPONENTS' order
    workspace = library_workspace_bytes(train, gpu_name or cluster.gpu_name) if device == "cuda" else 0
    peak_allocated = sum(comps.values()) + workspace
    # The CUDA context and what NCCL allocates for each communicator (the data-parallel group; HSDP's
    # shard and replicate groups; the tensor-parallel group); gloo and the fake process group: none.
    fp = device_footprint(cluster, world if backend == "nccl" else 1, st.shard_group,
                          train.tp if backend == "nccl" else 1)
    overhead = fp.total
    replay_args = None
    if device == "cuda" and train.model.layers > MAX_LAYERS:
        notes.append(f"reserved peak: the allocated peak + {RESERVED_MARGIN:.0%} (no allocator replay beyond "
                     f"{MAX_LAYERS} layers)")
    if device == "cuda" and offload_params:
        notes.append(f"reserved peak: the allocated peak + {RESERVED_MARGIN:.0%} (the allocator replay does not "
                     f"follow CPU offload)")
    if device == "cuda" and train.model.layers <= MAX_LAYERS and not offload_params:
        # The most loaded rank's allocations replayed through the caching allocator. `init`: the probes
        # build the model on the device and wrap it; a plan assumes FSDP runs materialize shards from the
        # meta device (torchtitan's way); see alloc_trace.allocation_events.
        expandable, max_split, _ = _alloc_conf(train.alloc_conf)
        replay_args = (train, st.name, world, shard, device, backend, workspace, expandable, init, max_split)
    return MemoryEstimate(st.name, comps, peak_allocated, phase, overhead, cluster.gpu_memory_bytes, notes,
                          workspace, replay_args, footprint=fp, host_bytes=host_bytes,
                          host_memory_bytes=cluster.host_memory_bytes)

@lru_cache(maxsize=1024)
def walked_blocks(base: tuple, layers: int, every: int) -> tuple[int, ...]:
    """The blocks whose backward the walk takes: `base` (the ends and their neighbours, which bound blocks
    that are all alike: every term is linear in the block's index), and under every-K checkpointing the
    first two and last two periods of K blocks. Then each term is a function of j mod K plus a linear one
    of j, so over each residue class its maximum is at the class's first or last block. (Cached: every
    estimate asks it several times.)"""
    js = {j for j in base if 0 <= j < layers}
    if every > 1:
        js.update(j for j in range(layers) if j < 2 * every or j >= layers - 2 * every)
    return tuple(sorted(js))


def _in_place_block_peak(train: TrainConfig, regime: str, n: int, peak: tuple[int, int, int],
                         grad_bytes: int) -> tuple[int, int, int]:
    """`_block_backward_peak` of a micro-step whose weight gradients are added in place into a kept .grad
    (gradient accumulation, FSDP2 without sync or mixed precision): AccumulateGrad runs as soon as a weight
    gradient is made (its node has the engine's highest priority) and `variable_grad += new_grad` frees the new
    one (torch/csrc/autograd/functions/accumulate_grad.h), so none of the gradients of `peak`'s instant is
    still alive there; the one that is, is at the MLP's output projection's backward: its weight gradient
    (h x f) and the input gradient (n x f) made, the input it saved (the product, or the activation's
    output) not yet freed. Of the two instants, the higher. Measured by the trace and the probe
    (Llama-3.2-1B, 16 layers, 256 tokens, zero3 fp32 over 2 micro-steps): the output projection's, -0.57%
    when the walk had no weight gradient there."""
    m = train.model
    h, f = m.hidden, m.ffn_hidden // train.tp
    e = 4 if regime == "fp32" else 2
    r = 4 if regime in ("fp32", "autocast") else 2
    down = (0, sp_tokens(train, n) * h * r + n * f * e, h * f)
    freed, tmp, _ = peak
    return down if down[1] + down[2] * grad_bytes > tmp - freed else (freed, tmp, 0)

