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

from math import prod

from functools import lru_cache

from .alloc_trace import MAX_LAYERS
from .activations import ActivationBreakdown, _norm_saved, activations_in, regime_for, sp_tokens
from .block_backward import _block_backward_peak
from .config import Cluster, TrainConfig, fsdp2_first_microstep_grads_in_reduce_dtype, fsdp2_reduce_keeps_last_grad
from .cp import cp_view
from .deepspeed import estimate_deepspeed
# The answer, its workspaces and the states' layout live below the walk (estimate.py, state_layout.py);
# importers of memory keep finding them here.
from .estimate import (COMPONENTS, RESERVED_MARGIN, MemoryEstimate, Snapshot, _alloc_conf,  # noqa: F401
                       cublas_workspace_bytes, library_workspace_bytes)
from .footprint import CUDA_CONTEXT_BYTES, DeviceFootprint, device_footprint  # noqa: F401 (re-exported)
from .model import unit_sizes
from .pp import pp_memory
from .state_layout import (Layout, _all_state_elems, _opt_state, _size_runs, layout, zero1_owned_shapes,  # noqa: F401
                           zero1_partition)
from .strategies import Strategy, get_strategy
from .tp import tp_view

DDP_BUCKET_CAP_BYTES = 25 * 2**20  # DistributedDataParallel(bucket_cap_mb=25)
DDP_FIRST_BUCKET_BYTES = 1 * 2**20  # dist._DEFAULT_FIRST_BUCKET_BYTES


# -- the walk ------------------------------------------------------------------------------------

def _replica_walk(snap, train, st, m, act, lay, notes: list, pb: int, gb: int, later: bool, L: int, v: int, h: int,
                  ev: int, acts_fwd: int, acts_bwd: int, loss_bwd_tmp: int, head_bwd: int, head_acts: int,
                  head_elems: int, first_acts: int, outside_first: int, last_acts: int, outside_last: int,
                  freed: int, blk_tmp: int, wgrad_elems: int, blk_bwd, opt_tmp: int) -> tuple[int, int]:
    """The walk's phases for a full replica per rank (single, DDP, ZeRO-1): forward, the loss's and the head's
    backward, the first and last blocks' backward, the optimizer step, each instant taken by `snap` (bytes).
    Returns (the parameters' bytes, DDP's gradient buckets' bytes)."""
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
    snap("forward", activations=acts_fwd)
    snap("backward", activations=acts_bwd, temporaries=loss_bwd_tmp)
    if head_bwd:  # the head's weight gradient: .grad, or (tied; or a later micro-step's, before its add)
        # waiting in autograd's input buffer
        w_head = v * h * gb
        pending = m.tie_embeddings or later
        snap("backward", activations=head_acts, grads=0 if pending else w_head,
             temporaries=head_bwd + (w_head if pending else 0))
    # First block's MLP backward: the head's gradient exists, every block's activations live.
    # The weight gradient just computed waits in autograd's input buffer (a temporary) until its
    # AccumulateGrad runs; so does a tied head's, until the embedding's half arrives.
    head_in_buf = head_elems * gb if m.tie_embeddings else 0
    # Last block (block 0): every gradient but the embedding's and most of block 0's.
    emb = v * h + (m.max_positions * h if m.position == "learned" else 0)
    grads_last = (lay.total - emb - lay.block) * gb
    if not ev:
        snap("backward", activations=first_acts + outside_first - freed,
             grads=head_elems * gb - head_in_buf, temporaries=blk_tmp + wgrad_elems * gb + head_in_buf)
        snap("backward", activations=last_acts + outside_last - freed, grads=grads_last,
             temporaries=blk_tmp + wgrad_elems * gb + head_in_buf)
    for j in walked_blocks((), L, ev):  # every-K: block j's backward, recomputed or not
        fr, tmp = blk_bwd(j)
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
    snap("optimizer", grads=lay.total * gb + emb_full, temporaries=opt_tmp)
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

    pb, gb = prec.param_bytes, prec.grad_bytes
    cb = prec.compute_bytes  # FSDP param_dtype / activation dtype
    state_bytes = pb  # torch.optim states: zeros_like(param)
    opt_elems, opt_extra = _opt_state(m, train.optimizer, family, shard)
    opt = opt_elems * state_bytes + int(opt_extra)

    offload_params = train.cpu_offload == "params" and st.fsdp
    if train.cpu_offload != "none" and not offload_params:
        notes.append(f"cpu_offload={train.cpu_offload} is not supported by {st.implementation}; ignored")

    n_tok = train.micro_batch * train.seq_len
    v = -(-m.vocab // train.tp)  # one tensor-parallel rank's vocabulary shard (embedding, head, loss)
    L = m.layers

    # Optimizer-step intermediates (adam.py _multi_tensor_adam: exp_avg_sq_sqrt).
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

    # Every snapshot of a walk holds the same base (parameters, optimizer state; DDP's buckets), so
    # `snap` takes only the parts that vary and the peak is the first snapshot with the largest sum.
    best: list = [-1, "", None]  # total, phase, parts

    # Tensor parallelism with fp32 embeddings (fp32, autocast): the token embedding's output, which the
    # first block's norm keeps (its fp32 `x.float()` is that tensor) to block 0's backward, is the TP group's
    # collective output (RowwiseParallel: the all-reduce of the partial embeddings, with SP their
    # reduce-scatter), so a probe's tracker books it with the communication buffers: same bytes, another
    # component. With 16-bit embeddings the norm keeps its own fp32 copy and the collective's output dies
    # after block 0's forward, unless block 0 is checkpointed (full, every-K), which keeps its input.
    # Measured: transformers Llama and the reference decoder, gloo and the fake process group, tp = 2,
    # with and without SP.
    tp_emb = (sp_tokens(train, n_tok) * (2 if regime == "lowp" else 4) * m.hidden
              if train.tp > 1 and train.cp == 1 and (regime != "lowp" or act.every or train.checkpointing == "full")
              else 0)

    def snap(phase, activations=0, comm_buffers=0, grads=0, temporaries=0):
        if tp_emb and phase != "optimizer" and activations - tp_emb >= act.inputs:
            activations, comm_buffers = activations - tp_emb, comm_buffers + tp_emb
        total = activations + comm_buffers + grads + temporaries
        if total > best[0]:
            best[:] = total, phase, (activations, comm_buffers, grads, temporaries)

    host_bytes = 0
    if offload_params:
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
        opt = 0
        opt_tmp = 0
        notes.append("CPU offload: parameters and optimizer state live in CPU memory, and each gradient shard is "
                     "copied there once reduced (FSDP2 frees the GPU copy at once; FSDP1 keeps it until the end "
                     "of backward); the step time leaves out the optimizer step on the CPU and the PCIe copies")

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

    def blk_bwd(j: int) -> tuple[int, int]:
        """Every-K: (saved bytes freed, transient bytes) at block j's backward peak, recomputed or not (without
        every-K, every block's: `freed` and `blk_tmp`)."""
        if not ev:
            return freed, blk_tmp
        if j % ev == 0:
            return 0, plain_tmp + act.recompute_block - plain_freed
        return plain_freed, plain_tmp
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

    later = train.grad_accum > 1  # the walk is of a micro-step after the first (the worst one)
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
        # gradient becomes the fp32 one (the `w_head` below), both alive, beside the hidden states' fp32
        # gradient. Measured by the trace at 192, 256 and 320 tokens and a probe (GPT-2 medium, ddp
        # bf16-mixed over 2 micro-steps, 256 tokens: -1.36% without this instant).
        head_bwd = v * h * cb + n_tok * h * 4
        head_acts -= v * h * cb + n_tok * h * cb
    every = train.sync_every
    if not st.fsdp:
        params, base_comm = _replica_walk(snap, train, st, m, act, lay, notes, pb, gb, later, L, v, h, ev, acts_fwd,
                                          acts_bwd, loss_bwd_tmp, head_bwd, head_acts, head_elems, first_acts,
                                          outside_first, last_acts, outside_last, freed, blk_tmp, wgrad_elems,
                                          blk_bwd, opt_tmp)
    else:
        ud = cb if prec.mixed else pb  # dtype of unsharded parameters and of their gradients
        rb = 4 if prec.mixed else gb  # reduce_dtype
        gsh = 4 if prec.mixed else gb  # sharded gradient dtype (the fp32 parameter's)
        # Sharded gradients on the GPU through backward. FSDP2 with CPUOffloadPolicy copies each new shard to
        # the CPU in `foreach_reduce` (`new_sharded_grad.to(torch.device("cpu"))`, _fsdp_collectives.py) and
        # accumulates it there: none stays. FSDP1 with CPUOffload keeps the GPU shard in `_saved_grad_shard`
        # after copying it to `_cpu_grad` (`_runtime_utils._offload_grad`) until the end-of-backward callback
        # deletes it (`FlatParamHandle.prepare_gradient_for_optim`).
        gsh_gpu = 0 if offload_params and st.fsdp2 else gsh
        params = 0 if offload_params else lay.shard_total * pb
        sharding = shard > 1 and st.shards_params
        reshard = st.reshard_after_forward and sharding
        ub, ur = lay.unshard_block * ud, lay.unshard_root * ud
        base_comm = 0
        if not sharding:  # fsdp-no-shard: full flat params; mixed precision adds 16-bit copies
            ub = lay.unshard_block * cb if prec.mixed else 0
            ur = lay.unshard_root * cb if prec.mixed else 0
        # Blocks unsharded at the end of forward. NO_SHARD under mixed precision frees each unit's 16-bit
        # copy when it reshards after forward (`FlatParamHandle.post_reshard` ->
        # `_free_low_precision_sharded_param`), and makes it again in backward.
        held = 1 if reshard or (not sharding and prec.mixed) else L
        # Gradient accumulation (grad_accum > 1): the walk is of the last micro-step, which holds what the
        # earlier ones accumulated. carry(j): those gradients while block j's backward runs (j = L: forward
        # and the loss); the blocks after j have reduced in this micro-step and are counted as shards.
        # - grad_sync 'last' (no_sync before the last micro-step): UNSHARDED gradients of every unit.
        #   FSDP1 keeps the unsharded flat gradient in param_dtype (`_runtime_utils._post_backward_hook`
        #   returns before reducing when `not state._sync_gradients`; `prepare_gradient_for_backward`
        #   keeps it); FSDP2 keeps `_unsharded_param.grad`, upcast to reduce_dtype when that differs
        #   (`FSDPParamGroup.post_backward` with `reduce_grads` False ->
        #   `FSDPParam.to_accumulated_grad_if_needed`), and adds each later one to it
        #   (`accumulate_unsharded_grad_if_needed`). On the last micro-step a unit's accumulated gradient
        #   is what it reduce-scatters.
        # - grad_sync 'every': the SHARDED gradients: FSDP2 adds each micro-step's reduce-scatter output
        #   into `sharded_param.grad` (`_fsdp_collectives.foreach_reduce`, `to_accumulate_grad`); FSDP1
        #   keeps the previous shard in `_saved_grad_shard` (`FlatParamHandle.prepare_gradient_for_backward`)
        #   and adds the new one (`_runtime_utils._accumulate_sharded_grad`). Their dtype is the sharded
        #   parameter's (fp32 under mixed precision).
        # - NO_SHARD: the full flat gradient, either way (param_dtype without sync; all-reduced in
        #   reduce_dtype when synced).
        acc_bytes = ud if st.fsdp1 else rb
        if not later:
            unit_root = unit_block = 0
        elif not sharding:  # without sync in param_dtype (as FSDP1's unsharded gradient), else reduced
            g_b = rb if every else ud
            unit_root, unit_block = lay.root * g_b, lay.block * g_b
        elif every:
            unit_root, unit_block = lay.shard_root * gsh_gpu, lay.shard_block * gsh_gpu
        else:
            unit_root, unit_block = lay.unshard_root * acc_bytes, lay.unshard_block * acc_bytes
            if train.tp > 1 and not m.tie_embeddings:
                # the vocabulary-sharded embedding's unsharded gradient is the whole vocabulary (a Replicate
                # DTensor: see `emb_full` in the non-FSDP walk), upcast and kept so between micro-steps
                # (measured: transformers Llama and the reference decoder, zero3, tp = 2, bf16 mixed
                # precision over 2 micro-steps: -1.1% with the shard counted). Tied to the head's Shard(0)
                # gradient, the sum keeps the head's placement (measured: Qwen2, the same run: +1.0% with it)
                unit_root += (m.vocab - v) * h * acc_bytes

        def carry(j: int) -> int:
            """Gradients accumulated by earlier micro-steps, held by the root and blocks 0..j."""
            return unit_root + min(j + 1, L) * unit_block if j >= 0 else 0
        if not later:  # nothing accumulated: the walk asks dozens of times per estimate
            def carry(j: int) -> int:  # noqa: F811
                return 0

        def snap_tied_embedding(comm_buffers: int, shard_bytes: int) -> None:
            """A tied embedding's backward, before the root's post-backward: three V x h gradients in the
            unsharded dtype (its dense gradient, the tied head's half waiting in autograd's input buffer,
            their sum; the DDP walk says where this was measured) next to `comm_buffers` and every block's
            gradient (shards of `shard_bytes` each when sharded)."""
            snap("backward", comm_buffers=comm_buffers, activations=act.inputs,
                 grads=carry(L - 1) if later and (every or not sharding)
                 else (L * lay.shard_block * shard_bytes if sharding else L * lay.block * gb) + unit_root,
                 temporaries=3 * v * h * ud)
        acc = carry(L)
        # FSDP2 in fp32 without sync: a later micro-step's gradients are added in place into the kept
        # .grad (AccumulateGrad), so the block's and head's earlier gradients are not extra; the weight
        # gradient just made is, until its add (`_in_place_block_peak` picked the block's instant and
        # that gradient, `cur_g`); under mixed precision the bf16 .grad is new and added to the fp32
        # accumulator in `post_backward`.
        fresh = 0 if in_place else 1
        if later:
            notes.append("gradient accumulation keeps " + ("sharded" if every and sharding else "unsharded")
                         + " gradients of every unit between micro-steps")
        fwd_comm = ur + (0 if reshard else held * ub)
        # FSDP2 without resharding keeps the last block's all-gather output until the root's
        # post-forward (measured: freed right after the loss).
        ag_tail = ub if (st.fsdp2 and sharding and not reshard and L) else 0
        if st.fsdp2 and sharding and L:
            # A block's pre-forward copy-out (FSDPParamGroup.wait_for_unshard in FORWARD): the previous
            # group's all-gather output, kept in `comm_ctx.all_gather_state` for implicit prefetching,
            # is dropped from comm_ctx first, but the walrus local `prev_all_gather_state` holds it until
            # the method returns, so it is alive through `foreach_all_gather_copy_out` of this block:
            # that previous flat output, this block's flat output and its copied-out parameters at once,
            # over the blocks forward keeps unsharded (none when resharding after forward). Block 0's
            # previous group is the root; for j >= 1 everything is linear in j, so block L-1 bounds it.
            for j in sorted({0, L - 1}):
                prev_flat = ur if j == 0 else ub
                snap("forward", comm_buffers=ur + (0 if reshard else j * ub) + prev_flat + 2 * ub, grads=acc,
                     activations=act.inputs + act.below(j))
        snap("forward", comm_buffers=fwd_comm + ag_tail, grads=acc, activations=acts_fwd)
        prefetch = ub if reshard and L > 1 else 0  # backward prefetch of the next block's all-gather
        # At the loss: the root is unsharded; the last block's all-gather is prefetched.
        snap("backward", comm_buffers=fwd_comm + (ub if reshard else 0), grads=acc,
             activations=acts_bwd, temporaries=loss_bwd_tmp)
        if head_bwd:
            # the head's weight gradient: FSDP2's untied head's .grad; a tied one's (FSDP2) and FSDP1's views'
            # wait in autograd's input buffer, and so does one a later micro-step adds into the kept .grad
            w_head = v * h * ud
            as_grad = st.fsdp2 and not m.tie_embeddings and fresh
            snap("backward", comm_buffers=fwd_comm + (ub if reshard else 0), grads=acc + (w_head if as_grad else 0),
                 activations=head_acts, temporaries=head_bwd + (0 if as_grad else w_head))
        # Gradients of the unsharded parameters. FSDP2: each parameter's .grad; the root reduces at the
        # very end, so the head's gradient stays unsharded until then. FSDP1 (use_orig_params=False):
        # the module parameters are views of the FlatParameter, so their gradients wait in autograd's
        # input buffer (temporaries) until the unit's last one arrives, then are concatenated into
        # flat_param.grad (both alive for a moment).
        head_g = head_elems * ud
        cur_g = wgrad_elems * ud
        # SHARD_GRAD_OP keeps its parameters unsharded between no_sync micro-steps (`_should_free_in_backward`)
        keep_all = st.fsdp1 and not st.reshard_after_forward and later and not every
        blocks_unsharded = ub + prefetch if reshard else held * ub
        shards = max(0, L - 1) * lay.shard_block * gsh_gpu if sharding else max(0, L - 1) * lay.block * gb
        rs_held = lay.unshard_block * rb if (sharding and st.fsdp2 and L > 1) else 0
        blocks_unsharded_last = (held * ub if keep_all else ub)
        at_rs = prefetch if reshard else (held * ub if keep_all else max(0, held - 1) * ub)

        def unsharded_during(j: int) -> int:
            """FSDP2: bytes of unsharded blocks while block j's backward runs (blocks run L-1 .. 0).
            Resharding after forward: block j and the prefetched block j-1 (`_backward_prefetch`).
            Not resharding: blocks 0..j, which forward left unsharded; FSDPParamGroup.post_backward
            reshards each block once its backward is done (`reshard_after_backward`)."""
            return ub + (prefetch if j > 0 else 0) if reshard else (j + 1) * ub
        if st.fsdp2:
            tied_buf = head_g if m.tie_embeddings else 0
            head_new = fresh * (head_g - tied_buf)  # the head's gradient not yet added to an accumulator
            shard_unit = lay.shard_block * gsh_gpu if sharding else lay.block * gb
            for j in walked_blocks((), L, ev):  # every-K: block j's backward, recomputed or not
                fr, tmp = blk_bwd(j)
                snap("backward", comm_buffers=ur + unsharded_during(j) + (rs_held if j < L - 1 else 0),
                     activations=act.through(j) + act.inputs + act.cache_below(j + 1) - fr,
                     grads=(L - 1 - j) * shard_unit + head_new + carry(j),
                     temporaries=tmp + cur_g + tied_buf)
            if not ev:
                snap("backward", comm_buffers=ur + blocks_unsharded,
                     activations=first_acts + outside_first - freed, grads=head_new + carry(L - 1),
                     temporaries=blk_tmp + cur_g + tied_buf)
                snap("backward", comm_buffers=ur + blocks_unsharded_last + rs_held,
                     activations=last_acts + outside_last - freed, grads=shards + head_new + carry(0),
                     temporaries=blk_tmp + cur_g + tied_buf)
            # A middle block j (0 < j < L-1) is the only one that has all three at once: its
            # unsharded parameters, the prefetched all-gather of block j-1, and block j+1's
            # reduce-scatter input, which FSDP2 keeps until the next reduce-scatter
            # (`comm_ctx.reduce_scatter_state(s)`). Without resharding, blocks 0..j are all still
            # unsharded (`unsharded_during`). Activations, gradient shards and unsharded blocks are
            # linear in j, so the two middle blocks next to the ends bound it. (Measured on the H100
            # with 4 blocks.)
            for j in sorted({1, L - 2}) if L >= 3 and not ev else ():
                snap("backward", comm_buffers=ur + unsharded_during(j) + rs_held,
                     activations=last_acts + j * (first_acts - last_acts) // (L - 1)
                     + act.inputs + (j + 1) * act.block_cache - freed,
                     grads=(L - 1 - j) * (lay.shard_block * gsh_gpu if sharding else lay.block * gb)
                     + head_new + carry(j),
                     temporaries=blk_tmp + cur_g + tied_buf)
            if sharding:
                # Each block's own backward, from FSDP2's hooks (_fsdp_param_group.py), per block j (run
                # L-1 .. 0). Gradient shards of the blocks after j are alive (`foreach_reduce`'s
                # `reduce_output`, viewed as the sharded parameters' .grad); so are the saved
                # activations of blocks 0..j-1, and block j+1's reduce-scatter input, which
                # `comm_ctx.reduce_scatter_states` keeps until block j's `post_backward` pops it.
                block_elems = lay.block
                shard_g = lay.shard_block * gsh_gpu
                e = 4 if regime == "fp32" else 2

                def below(j: int) -> int:
                    """Activations saved by blocks 0..j-1 (each block's by itself under checkpointing;
                    the RoPE tables with them), and the batch's inputs."""
                    return act.inputs + act.below(j) + act.cache_below(j)

                def rs_prev(j: int) -> int:
                    return rs_held if j < L - 1 else 0

                def shards_after(j: int) -> int:
                    """Gradient shards of the blocks after j, the head's new gradient, and what earlier
                    micro-steps accumulated in block j, those before it and the root."""
                    return (L - 1 - j) * shard_g + head_new + carry(j)

                # Activations, gradient shards and unsharded blocks are linear in j between the steps
                # at j = 0 (nothing prefetched) and j = L-1 (no reduce-scatter input kept): those, and
                # the blocks next to them, bound every block.
                ends = walked_blocks((0, 1, L - 2, L - 1), L, ev)
                # 1. `pre_backward` -> `wait_for_unshard` (resharding after forward): the all-gather
                #    output (prefetched by block j+1's `_backward_prefetch`, by the root's for the last
                #    block) and the parameters `foreach_all_gather_copy_out` copies it into, both alive
                #    until `_all_gather_result = None`; block j's activations and the gradient entering
                #    it. Block j-1 is prefetched only after this. Without resharding the group is still
                #    unsharded from forward and both calls return at once.
                if reshard:
                    for j in ends:
                        snap("backward", comm_buffers=ur + 2 * ub + rs_prev(j),
                             activations=below(j + 1), grads=shards_after(j),
                             temporaries=n_tok * h * r + tied_buf)
                # 2. The block's last weight gradient: autograd accumulates each unsharded parameter's
                #    gradient into its .grad (AccumulateGrad), which FSDP2 collects only in the
                #    block's `post_backward` (`unsharded_grads.append(fsdp_param.unsharded_grad_data)`),
                #    so when the first Linear's backward runs (backward reaches it last) the block's
                #    other gradients are all alive, its parameters unsharded, block j-1 prefetched.
                #    `unit_sizes` lists the block's parameters in registration order: the norm before
                #    the first Linear has its gradient still to come, the Linear's (and its bias's) is
                #    in autograd's buffer. Still saved: that norm's tensors (recomputed, so temporaries,
                #    under checkpointing). Transient: the residual stream's gradient, the gradient of the
                #    norm's output summed over the other projections, the first Linear's output
                #    gradient (made contiguous for its `view`'s backward) and its input gradient.
                shapes = unit_sizes(m)[1]
                in_buffer, pending = _first_linear_grads(m)
                norm_kept = _first_norm_saved(train, regime, n_tok, device)
                for j in ends:
                    ckpt = act.checkpointed(j, train.checkpointing)
                    snap("backward", comm_buffers=ur + unsharded_during(j) + rs_prev(j),
                         activations=below(j) + (0 if ckpt else norm_kept),
                         grads=shards_after(j) + fresh * (block_elems - pending) * ud,
                         temporaries=n_tok * h * (r + 3 * e) + in_buffer * ud + (norm_kept if ckpt else 0)
                         + tied_buf)
                # 3. `post_backward`: the gradients are collected, the block resharded (`reshard` ->
                #    `FSDPParam.free_unsharded_param`), block j+1's reduce-scatter input dropped from
                #    `reduce_scatter_states` (at most `reduce_scatter_max_input_buffers` = 1 kept), then
                #    `foreach_reduce` (_fsdp_collectives.py) allocates the reduce-scatter input
                #    (reduce dtype) and `foreach_reduce_scatter_copy_in` fills it while every unsharded
                #    gradient is alive. Still unsharded: with resharding the prefetched block j-1 (its
                #    all-gather output; its parameters are copied out only in its own
                #    `wait_for_unshard`); without, blocks 0..j-1 from forward (`_backward_prefetch` ->
                #    `unshard` is a no-op on an unsharded group: `if self.is_unsharded: return`).
                # 4. After the copy-in, `unsharded_grads.clear()` frees the gradients (through torch 2.14
                #    except the last parameter's, which the `for i, (fsdp_param, unsharded_grad) in ...`
                #    loop variable keeps until it returns: `fsdp2_reduce_keeps_last_grad`); then the output
                #    `reduce_output` (one shard) is allocated before the collective; gloo's
                #    reduce_scatter_tensor also splits its input (one more input-sized copy).
                split = lay.unshard_block * rb if backend == "gloo" else 0
                rs_in = lay.unshard_block * rb
                rs_out = lay.shard_block * rb
                last_g = prod(shapes[-1]) * ud if fsdp2_reduce_keeps_last_grad(train) else 0
                for j in ends:
                    held_at_rs = (prefetch if j > 0 else 0) if reshard else j * ub
                    # (without sync, block j's accumulated gradient, in carry(j), is what is collected)
                    collected = block_elems * ud if not (later and not every) else 0
                    snap("backward", comm_buffers=ur + held_at_rs + rs_in, activations=below(j),
                         grads=shards_after(j) + collected, temporaries=n_tok * h * r + tied_buf)
                    snap("backward", comm_buffers=ur + held_at_rs + rs_in + rs_out,
                         activations=below(j), grads=shards_after(j) - carry(j) + carry(j - 1 if not every else j),
                         temporaries=n_tok * h * r + split + last_g + tied_buf)
            if m.tie_embeddings:  # next to the unsharded root and the last block's reduce-scatter input
                snap_tied_embedding(ur + (rs_held if sharding else 0), gsh_gpu)  # (`reduce_scatter_states`)
            if (m.tie_embeddings and sharding and prec.mixed and later and not every
                    and fsdp2_first_microstep_grads_in_reduce_dtype(train)):
                # torch 2.15, the first micro-step without sync (from the second step on): its gradients
                # land in reduce_dtype, so at the tied embedding's backward its gradient and the head's are
                # fp32 copies and their sum a third, next to every block's unsharded fp32 gradient of this
                # micro-step (resharded, nothing reduced: no reduce-scatter input held) and the root's
                # others (a learned position embedding's, the final norm's), nothing accumulated before
                # (config.fsdp2_first_microstep_grads_in_reduce_dtype; measured: GPT-2 medium, zero3 over
                # 2 micro-steps, this instant the peak within 4 KiB)
                snap("backward", comm_buffers=ur, activations=act.inputs,
                     grads=L * unit_block + max(0, lay.unshard_root - v * h) * rb, temporaries=3 * v * h * rb)
            if sharding:
                # The root's post_backward, last: it reshards first (the root too: FSDP2 keeps it
                # unsharded from forward to backward only, `_auto_reshard_after_forward`), then
                # `foreach_reduce` copies its unsharded gradients (collected from .grad, so no longer
                # counted as gradients) into the reduce-scatter input, frees them and allocates the
                # output shard; gloo's reduce_scatter_tensor splits the input once more.
                rs_root = lay.unshard_root * rb
                root_old = unit_root if every else 0  # the root's accumulated shard (sync every micro-step)
                snap("backward", comm_buffers=rs_root, grads=L * lay.shard_block * gsh_gpu + root_old,
                     temporaries=lay.unshard_root * ud)
                # As at the blocks' (`last_g`), the root's last parameter's unsharded gradient (an untied
                # LM head's, V x h) is kept by the loop variable until `foreach_reduce` returns (to 2.14).
                last_root_g = prod(unit_sizes(m)[0][-1]) * ud if fsdp2_reduce_keeps_last_grad(train) else 0
                snap("backward", comm_buffers=rs_root + lay.shard_root * rb,
                     grads=L * lay.shard_block * gsh_gpu + root_old,
                     temporaries=(rs_root if backend == "gloo" else 0) + last_root_g)
        else:
            # (with accumulation, the new flat gradient is added in place to the kept one: a transient)
            if not ev:
                snap("backward", comm_buffers=ur + blocks_unsharded, grads=carry(L - 1),
                     activations=first_acts + outside_first - freed, temporaries=blk_tmp + head_g + cur_g)
            # Block j's MLP backward (every-K: each block's, recomputed or not). Uniform blocks: the middle ones,
            # as FSDP2's above: its parameters and the prefetched block j-1's unsharded, the gradient shards of
            # the blocks after it; linear in j, so blocks 1 and L-2 bound them. Under checkpointing the shards
            # outweigh the activations and block 1 is the peak (the trace of Mistral-7B, 16 ranks, 1 x 4096
            # tokens, bf16-mixed, full checkpointing: -3.6% with only blocks L-1 and 0 walked)
            for j in walked_blocks((1, L - 2) if L >= 3 and not ev else (), L, ev):
                fr, tmp = blk_bwd(j)
                in_bwd = (ub + (prefetch if j > 0 else 0) if reshard
                          else held * ub if keep_all else min(j + 1, held) * ub)
                snap("backward", comm_buffers=ur + in_bwd,
                     grads=(L - 1 - j) * (lay.shard_block * gsh if sharding else lay.block * gb) + carry(j),
                     activations=act.through(j) + act.inputs + act.cache_below(j + 1) - fr,
                     temporaries=tmp + head_g + cur_g)
            # End of the first block's backward: its view gradients and their concatenation (which is
            # the reduce-scatter's input, a comm buffer, unless mixed precision casts it first).
            # Every block ends so (run L-1 .. 0); as at its reduce-scatter below, blocks L-1, 1 and 0
            # bound it (measured: fp32 with full checkpointing peaks here at block 1, next to the
            # gradient shards of the blocks after it; the first block alone was 7.9% under).
            flat = lay.unshard_block * ud
            walked = walked_blocks((0, 1, L - 1), L, ev)

            def acts_before(j: int) -> int:
                """Activations at block j's end: blocks 0..j-1's and their caches, the batch's inputs."""
                return (act.below(j) + act.inputs
                        + act.cache_below(j))

            def shards_after(j: int) -> int:
                """Gradient shards of blocks j+1..L-1 (synced every micro-step: inside the carried ones)."""
                return 0 if later and every else (L - 1 - j) * lay.shard_block * gsh
            for j in walked:
                if reshard:
                    unsharded_j = ub + (prefetch if j > 0 else 0)
                else:
                    unsharded_j = held * ub if keep_all else min(j + 1, held) * ub
                snap("backward", comm_buffers=ur + unsharded_j + (0 if prec.mixed else flat),
                     grads=(shards_after(j) if sharding else 0) + carry(L - 1 if every else j),
                     activations=acts_before(j), temporaries=n_tok * h * r + head_g + flat + (flat if prec.mixed else 0))
            if not ev:
                snap("backward", comm_buffers=ur + blocks_unsharded_last,
                     activations=last_acts + outside_last - freed, grads=shards + carry(0),
                     temporaries=blk_tmp + head_g + cur_g)
            if sharding:
                # The first block's reduce-scatter: its flat gradient (the input, unless mixed precision
                # casts it to reduce_dtype first), the output shard (flat_param.grad; on gloo a buffer
                # the collective writes) and, on gloo, the split copy of the input.
                # Every block j reduce-scatters so (run L-1 .. 0): the gradient shards of the blocks
                # after it are alive, the activations of the blocks before it; with resharding the
                # block before it is prefetched (none at block 0), without, blocks 0..j-1 are still
                # unsharded from forward. Linear in j between those, so blocks L-1, 1 and 0 bound it:
                # the first where activations dominate (no checkpointing), block 1 where the gradient
                # shards do (checkpointing: measured, a transformers Llama of 8 wide blocks, fsdp full
                # checkpointing on 8 fake ranks; the first block alone was 11% under).
                flat = lay.unshard_block * ud
                cast = lay.unshard_block * rb if prec.mixed else 0
                out_shard = lay.shard_block * rb
                split = lay.unshard_block * rb if backend == "gloo" else 0
                for j in walked:
                    if reshard:
                        unsharded_j = prefetch if j > 0 else 0
                    else:
                        unsharded_j = held * ub if keep_all else min(j, max(0, held - 1)) * ub
                    # without sync the block's accumulated gradient is the input (blocks 0..j-1 still
                    # carry theirs); synced every micro-step each block's `_saved_grad_shard` is kept
                    # (the blocks after j have added their new shard into it) and waits for the new one.
                    # Without sync, the last micro-step's new flat gradient, added in place into the kept
                    # one, is still alive: the post-backward hook is a hook of the FlatParameter's
                    # AccumulateGrad node (`_register_post_backward_hook`), called with it (measured:
                    # Mistral-7B's width, fsdp bf16-mixed over 2 micro-steps, -1.09% without it). Counted
                    # where measured, resharding after forward (FULL_SHARD, HYBRID_SHARD); not under
                    # SHARD_GRAD_OP, whose probes show no such instant (GPT-2 medium, Qwen2.5-0.5B and
                    # Llama-3.2-1B at 8 layers over 2 micro-steps: exact without it).
                    new_flat = flat if later and not every and reshard else 0
                    snap("backward",
                         comm_buffers=ur + unsharded_j + cast + (0 if prec.mixed else flat)
                         + (out_shard if backend == "gloo" else 0),
                         grads=(0 if backend == "gloo" else out_shard) + shards_after(j)
                         + carry(L - 1 if every else j - 1),
                         activations=acts_before(j),
                         temporaries=n_tok * h * r + head_g + split + (flat if prec.mixed else 0) + new_flat)
            if m.tie_embeddings:  # next to the unsharded root
                snap_tied_embedding(ur, gsh)
            if sharding and later and not every:
                # The first micro-step, without sync, at its end: `_post_backward_hook` returned before
                # reducing, so every block's unsharded flat gradient is kept (`prepare_gradient_for_backward`
                # leaves it in .grad), nothing is accumulated yet, and SHARD_GRAD_OP has not freed a block
                # (`_should_free_in_backward` is False without sync); then the root's last gradients, as in
                # the walk's later micro-step: a tied embedding's three V x h ones, or the view gradients and
                # their concatenation. Where every block's parameters and gradients outweigh what a later
                # micro-step carries (SHARD_GRAD_OP, a wide tied vocabulary), this instant is the peak
                # (measured: Qwen2.5-0.5B at 8 layers, fsdp-grad-op fp32 over 2 micro-steps, -4.69% without it).
                first_comm = ur + (0 if reshard else held * ub)
                first_grads = L * unit_block
                if m.tie_embeddings:
                    snap("backward", comm_buffers=first_comm, activations=act.inputs, grads=first_grads,
                         temporaries=3 * v * h * ud)
                snap("backward", comm_buffers=first_comm + lay.unshard_root * ud, grads=first_grads,
                     temporaries=lay.unshard_root * ud)
            if sharding:
                # The root at the end (its post-backward runs last): its view gradients and their
                # concatenation (flat_param.grad) next to the unsharded flat parameter; then
                # `_post_backward_hook` reshards it (`_should_free_in_backward`), casts the gradient to
                # reduce_dtype under mixed precision (the 16-bit one alive to the hook's end) and
                # `_reduce_grad` reduce-scatters into a new shard.
                g_root = lay.unshard_root * ud
                shards_done = L * lay.shard_block * gsh
                root_old = unit_root if every else 0  # the root's `_saved_grad_shard` (synced every micro-step)
                snap("backward", comm_buffers=ur + g_root, grads=shards_done + root_old, temporaries=g_root)
                # On gloo, as at the blocks' reduce-scatter: the output shard is a buffer the collective
                # writes, and it splits the input once more (measured: CPU probes of a 64k-vocabulary
                # Gemma-2 under bf16-mixed, tied head and untied, the root being the largest unit).
                gloo = backend == "gloo"
                snap("backward", comm_buffers=lay.unshard_root * rb + (lay.shard_root * rb if gloo else 0),
                     grads=shards_done + (0 if gloo else lay.shard_root * rb) + root_old,
                     temporaries=(g_root if prec.mixed else 0) + (lay.unshard_root * rb if gloo else 0))
            else:
                # The root at the end: its view gradients, their concatenation, then the cast.
                root_tmp = max(2 * lay.unshard_root * ud, lay.unshard_root * (ud + rb) if prec.mixed else 0)
                snap("backward", comm_buffers=ur, grads=L * lay.block * gb + unit_root,
                     temporaries=root_tmp)
        grads_final = lay.shard_total * gsh if sharding else lay.total * gb
        if offload_params:
            grads_final = 0
        snap("optimizer", grads=grads_final, temporaries=opt_tmp)

    _, phase, (a, c, g, t) = best
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
def _first_linear_grads(m) -> tuple[int, int]:
    """(elements of the block's first Linear's gradients: its weight and its bias if it has one; those plus
    every parameter registered before it, the norm's) of `unit_sizes(m)`'s block shapes, for FSDP2's
    last-weight-gradient instant in `estimate_memory` (computed once per model)."""
    shapes = unit_sizes(m)[1]
    first = next((i for i, s in enumerate(shapes) if len(s) == 2), len(shapes) - 1)
    last = first + 1 if (first + 1 < len(shapes) and len(shapes[first + 1]) == 1
                         and shapes[first + 1][0] == shapes[first][0]) else first
    in_buffer = sum(prod(s) for s in shapes[first:last + 1])
    return in_buffer, in_buffer + sum(prod(s) for s in shapes[:first])


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


def _first_norm_saved(train: TrainConfig, regime: str, n: int, device: str = "cuda") -> int:
    """Bytes the block's first norm (before attention) still keeps for backward while the first Linear's
    backward runs: its input, statistics and output (`activations._norm_saved`; the output's consumers
    matter only under autocast, which FSDP does not run)."""
    return _norm_saved(train, regime, n, 3, device)
