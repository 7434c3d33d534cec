"""The memory walk of FSDP1, FSDP2 and ZeRO-3-like strategies (sharded or not): memory.estimate_memory's
phases for a rank that holds parameter shards, each instant taken by the walk's `snap` (bytes).

Split along the step's phases (forward and the loss; each block's backward; the root's backward; the
optimizer step) and per strategy family (FSDP2's hooks in `_fsdp_param_group.py`, FSDP1's in
`_runtime_utils.py`); memory.py's module docstring gives the sources.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod

from .activations import _norm_saved
from .config import TrainConfig, fsdp2_first_microstep_grads_in_reduce_dtype, fsdp2_reduce_keeps_last_grad
from .model import unit_sizes
from .walk_terms import WalkTerms


@dataclass(frozen=True)
class FsdpTerms:
    """The FSDP walk's own terms (bytes unless a per-element width), from `fsdp_terms`."""
    unsharded_elem_bytes: int  # bytes per element of unsharded parameters and of their gradients
    reduce_elem_bytes: int  # reduce_dtype bytes per element
    grad_shard_elem_bytes: int  # sharded gradient bytes per element (the fp32 parameter's)
    gpu_grad_shard_elem_bytes: int  # the same, of shards kept on the GPU through backward (0: FSDP2's CPU offload)
    sharding: bool
    reshard: bool  # reshard after forward
    block_unsharded_bytes: int  # one block's unsharded parameters
    root_unsharded_bytes: int  # the root's unsharded parameters
    blocks_held: int  # blocks unsharded at the end of forward
    root_carried_bytes: int  # gradients earlier micro-steps accumulated in the root
    block_carried_bytes: int  # gradients earlier micro-steps accumulated in one block
    fresh: int  # 1 unless a later micro-step's gradients are added in place (FSDP2 fp32 without sync)
    forward_unsharded_bytes: int  # unsharded parameters through forward
    prefetch_bytes: int  # backward prefetch of the next block's all-gather
    head_grad_bytes: int  # the head's (and final norm's) unsharded gradient
    new_wgrad_bytes: int  # the weight gradient just made at a block's backward peak
    keep_all: bool  # SHARD_GRAD_OP keeps its parameters unsharded between no_sync micro-steps
    first_bwd_unsharded_bytes: int  # unsharded blocks at the first block's backward
    last_bwd_unsharded_bytes: int  # unsharded blocks at the last block's (block 0's) backward
    later_blocks_grad_bytes: int  # gradients of blocks 1..L-1 at block 0's backward
    rs_input_held_bytes: int  # FSDP2's kept reduce-scatter input (one block's)
    L: int
    later: bool

    def carry(self, j: int) -> int:
        """Gradients accumulated by earlier micro-steps, held by the root and blocks 0..j."""
        if not self.later:  # nothing accumulated: the walk asks dozens of times per estimate
            return 0
        return self.root_carried_bytes + min(j + 1, self.L) * self.block_carried_bytes if j >= 0 else 0

    def unsharded_during(self, j: int) -> int:
        """FSDP2: bytes of unsharded blocks while block j's backward runs (blocks run L-1 .. 0).
        Resharding after forward: block j and the prefetched block j-1 (`_backward_prefetch`).
        Not resharding: blocks 0..j, which forward left unsharded; FSDPParamGroup.post_backward
        reshards each block once its backward is done (`reshard_after_backward`)."""
        ub = self.block_unsharded_bytes
        return ub + (self.prefetch_bytes if j > 0 else 0) if self.reshard else (j + 1) * ub


def fsdp_walk(snap, w: WalkTerms) -> tuple[int, int]:
    """The walk's phases for a rank holding FSDP shards: forward and the loss, each block's and the root's
    backward (FSDP2's hooks or FSDP1's), the optimizer step. Returns (the parameters' bytes, 0: no
    buckets)."""
    f = fsdp_terms(w)
    params = 0 if w.offload_params else w.lay.shard_total * w.pb
    fsdp_forward_and_loss(snap, w, f)
    if w.st.fsdp2:
        fsdp2_blocks_backward(snap, w, f)
        if f.sharding:
            fsdp2_block_hooks(snap, w, f)
        fsdp2_root_backward(snap, w, f)
    else:
        fsdp1_blocks_backward(snap, w, f)
        fsdp1_root_backward(snap, w, f)
    grads_final = w.lay.shard_total * f.grad_shard_elem_bytes if f.sharding else w.lay.total * w.gb
    if w.offload_params:
        grads_final = 0
    snap("optimizer", grads=grads_final, temporaries=w.opt_tmp + w.act.held_inputs)  # (the batch: memory.py)
    return params, 0


def fsdp_terms(w: WalkTerms) -> FsdpTerms:
    """The FSDP walk's dtypes, unsharded sizes and accumulated gradients (see `FsdpTerms`)."""
    st, lay, L, prec_mixed = w.st, w.lay, w.L, w.mixed
    ud = w.cb if prec_mixed else w.pb  # dtype of unsharded parameters and of their gradients
    rb = 4 if prec_mixed else w.gb  # reduce_dtype
    gsh = 4 if prec_mixed else w.gb  # sharded gradient dtype (the fp32 parameter's)
    # Sharded gradients on the GPU through backward. FSDP2 with CPUOffloadPolicy copies each new shard to
    # the CPU in `foreach_reduce` (`new_sharded_grad.to(torch.device("cpu"))`, _fsdp_collectives.py) and
    # accumulates it there: none stays. FSDP1 with CPUOffload keeps the GPU shard in `_saved_grad_shard`
    # after copying it to `_cpu_grad` (`_runtime_utils._offload_grad`) until the end-of-backward callback
    # deletes it (`FlatParamHandle.prepare_gradient_for_optim`).
    gsh_gpu = 0 if w.offload_params and st.fsdp2 else gsh
    sharding = w.shard > 1 and st.shards_params
    reshard = st.reshard_after_forward and sharding
    ub, ur = lay.unshard_block * ud, lay.unshard_root * ud
    if not sharding:  # fsdp-no-shard: full flat params; mixed precision adds 16-bit copies
        ub = lay.unshard_block * w.cb if prec_mixed else 0
        ur = lay.unshard_root * w.cb if prec_mixed else 0
    # Blocks unsharded at the end of forward. NO_SHARD under mixed precision frees each unit's 16-bit
    # copy when it reshards after forward (`FlatParamHandle.post_reshard` ->
    # `_free_low_precision_sharded_param`), and makes it again in backward.
    held = 1 if reshard or (not sharding and prec_mixed) else L
    unit_root, unit_block = _accumulated_grad_bytes(w, ud, rb, gsh_gpu, sharding)
    # FSDP2 in fp32 without sync: a later micro-step's gradients are added in place into the kept
    # .grad (AccumulateGrad), so the block's and head's earlier gradients are not extra; the weight
    # gradient just made is, until its add (`_in_place_block_peak` picked the block's instant and
    # that gradient, `new_wgrad_bytes`); under mixed precision the bf16 .grad is new and added to the fp32
    # accumulator in `post_backward`.
    fresh = 0 if w.in_place else 1
    if w.later:
        w.notes.append("gradient accumulation keeps " + ("sharded" if w.every and sharding else "unsharded")
                       + " gradients of every unit between micro-steps")
    prefetch = ub if reshard and L > 1 else 0  # backward prefetch of the next block's all-gather
    # Gradients of the unsharded parameters. FSDP2: each parameter's .grad; the root reduces at the
    # very end, so the head's gradient stays unsharded until then. FSDP1 (use_orig_params=False):
    # the module parameters are views of the FlatParameter, so their gradients wait in autograd's
    # input buffer (temporaries) until the unit's last one arrives, then are concatenated into
    # flat_param.grad (both alive for a moment).
    # SHARD_GRAD_OP keeps its parameters unsharded between no_sync micro-steps (`_should_free_in_backward`)
    keep_all = st.fsdp1 and not st.reshard_after_forward and w.later and not w.every
    return FsdpTerms(
        unsharded_elem_bytes=ud, reduce_elem_bytes=rb, grad_shard_elem_bytes=gsh, gpu_grad_shard_elem_bytes=gsh_gpu,
        sharding=sharding, reshard=reshard, block_unsharded_bytes=ub, root_unsharded_bytes=ur, blocks_held=held,
        root_carried_bytes=unit_root, block_carried_bytes=unit_block, fresh=fresh,
        forward_unsharded_bytes=ur + (0 if reshard else held * ub),
        prefetch_bytes=prefetch, head_grad_bytes=w.head_elems * ud, new_wgrad_bytes=w.wgrad_elems * ud,
        keep_all=keep_all,
        first_bwd_unsharded_bytes=ub + prefetch if reshard else held * ub,
        last_bwd_unsharded_bytes=(held * ub if keep_all else ub),
        later_blocks_grad_bytes=(max(0, L - 1) * lay.shard_block * gsh_gpu if sharding
                                 else max(0, L - 1) * lay.block * w.gb),
        rs_input_held_bytes=lay.unshard_block * rb if (sharding and st.fsdp2 and L > 1) else 0, L=L, later=w.later)


def _accumulated_grad_bytes(w: WalkTerms, ud: int, rb: int, gsh_gpu: int, sharding: bool) -> tuple[int, int]:
    """(root's, one block's) gradient bytes that earlier micro-steps accumulated (0, 0 without accumulation)."""
    lay, every = w.lay, w.every
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
    acc_bytes = ud if w.st.fsdp1 else rb
    if not w.later:
        unit_root = unit_block = 0
    elif not sharding:  # without sync in param_dtype (as FSDP1's unsharded gradient), else reduced
        g_b = rb if every else ud
        unit_root, unit_block = lay.root * g_b, lay.block * g_b
    elif every:
        unit_root, unit_block = lay.shard_root * gsh_gpu, lay.shard_block * gsh_gpu
    else:
        unit_root, unit_block = lay.unshard_root * acc_bytes, lay.unshard_block * acc_bytes
        if w.train.tp > 1 and not w.m.tie_embeddings:
            # the vocabulary-sharded embedding's unsharded gradient is the whole vocabulary (a Replicate
            # DTensor: see `emb_full` in the non-FSDP walk), upcast and kept so between micro-steps
            # (measured: transformers Llama and the reference decoder, zero3, tp = 2, bf16 mixed
            # precision over 2 micro-steps: -1.1% with the shard counted). Tied to the head's Shard(0)
            # gradient, the sum keeps the head's placement (measured: Qwen2, the same run: +1.0% with it)
            unit_root += (w.m.vocab - w.v) * w.h * acc_bytes
    return unit_root, unit_block


def snap_tied_embedding(snap, w: WalkTerms, f: FsdpTerms, comm_buffers: int, shard_bytes: int) -> None:
    """A tied embedding's backward, before the root's post-backward: three V x h gradients in the
    unsharded dtype (its dense gradient, the tied head's half waiting in autograd's input buffer,
    their sum; the DDP walk says where this was measured) next to `comm_buffers` and every block's
    gradient (shards of `shard_bytes` each when sharded)."""
    L, lay = w.L, w.lay
    snap("backward", comm_buffers=comm_buffers, activations=w.act.inputs,
         grads=f.carry(L - 1) if w.later and (w.every or not f.sharding)
         else (L * lay.shard_block * shard_bytes if f.sharding else L * lay.block * w.gb) + f.root_carried_bytes,
         temporaries=3 * w.v * w.h * f.unsharded_elem_bytes)


def fsdp_forward_and_loss(snap, w: WalkTerms, f: FsdpTerms) -> None:
    """Forward (FSDP2's copy-out instants, the end of forward), the loss's and the LM head's backward."""
    st, act, L, ub, ur = w.st, w.act, w.L, f.block_unsharded_bytes, f.root_unsharded_bytes
    acc = f.carry(L)
    # FSDP2 without resharding keeps the last block's all-gather output until the root's
    # post-forward (measured: freed right after the loss).
    ag_tail = ub if (st.fsdp2 and f.sharding and not f.reshard and L) else 0
    if st.fsdp2 and f.sharding and L:
        # A block's pre-forward copy-out (FSDPParamGroup.wait_for_unshard in FORWARD): the previous
        # group's all-gather output, kept in `comm_ctx.all_gather_state` for implicit prefetching,
        # is dropped from comm_ctx first, but the walrus local `prev_all_gather_state` holds it until
        # the method returns, so it is alive through `foreach_all_gather_copy_out` of this block:
        # that previous flat output, this block's flat output and its copied-out parameters at once,
        # over the blocks forward keeps unsharded (none when resharding after forward). Block 0's
        # previous group is the root; for j >= 1 everything is linear in j, so block L-1 bounds it.
        for j in sorted({0, L - 1}):
            prev_flat = ur if j == 0 else ub
            snap("forward", comm_buffers=ur + (0 if f.reshard else j * ub) + prev_flat + 2 * ub, grads=acc,
                 activations=act.inputs + act.below(j))
    snap("forward", comm_buffers=f.forward_unsharded_bytes + ag_tail, grads=acc, activations=w.acts_fwd)
    # At the loss: the root is unsharded; the last block's all-gather is prefetched.
    snap("backward", comm_buffers=f.forward_unsharded_bytes + (ub if f.reshard else 0), grads=acc,
         activations=w.acts_bwd, temporaries=w.loss_bwd_tmp)
    if w.head_bwd:
        # the head's weight gradient: FSDP2's untied head's .grad; a tied one's (FSDP2) and FSDP1's views'
        # wait in autograd's input buffer, and so does one a later micro-step adds into the kept .grad
        w_head = w.v * w.h * f.unsharded_elem_bytes
        as_grad = st.fsdp2 and not w.m.tie_embeddings and f.fresh
        snap("backward", comm_buffers=f.forward_unsharded_bytes + (ub if f.reshard else 0),
             grads=acc + (w_head if as_grad else 0),
             activations=w.head_acts, temporaries=w.head_bwd + (0 if as_grad else w_head))


# -- FSDP2 (`_fully_shard`): each parameter's .grad, the hooks of `_fsdp_param_group.py` ------------------

def _fsdp2_head_bytes(w: WalkTerms, f: FsdpTerms) -> tuple[int, int]:
    """(a tied head's gradient waiting in autograd's input buffer, the head's gradient not yet added to an
    accumulator), bytes."""
    tied_buf = f.head_grad_bytes if w.m.tie_embeddings else 0
    return tied_buf, f.fresh * (f.head_grad_bytes - tied_buf)


def fsdp2_blocks_backward(snap, w: WalkTerms, f: FsdpTerms) -> None:
    """FSDP2: each block's backward peak (every-K: block j's, recomputed or not; else the first, the last and
    the middle blocks next to them)."""
    act, lay, L, ur, carry = w.act, w.lay, w.L, f.root_unsharded_bytes, f.carry
    tied_buf, head_new = _fsdp2_head_bytes(w, f)
    shard_unit = lay.shard_block * f.gpu_grad_shard_elem_bytes if f.sharding else lay.block * w.gb
    for j in w.walked_blocks((), L, w.ev):  # every-K: block j's backward, recomputed or not
        fr, tmp = w.block_backward_bytes(j)
        snap("backward", comm_buffers=ur + f.unsharded_during(j) + (f.rs_input_held_bytes if j < L - 1 else 0),
             activations=act.through(j) + act.inputs + act.cache_below(j + 1) - fr,
             grads=(L - 1 - j) * shard_unit + head_new + carry(j),
             temporaries=tmp + f.new_wgrad_bytes + tied_buf)
    if not w.ev:
        snap("backward", comm_buffers=ur + f.first_bwd_unsharded_bytes,
             activations=w.first_acts + w.outside_first - w.freed, grads=head_new + carry(L - 1),
             temporaries=w.blk_tmp + f.new_wgrad_bytes + tied_buf)
        snap("backward", comm_buffers=ur + f.last_bwd_unsharded_bytes + f.rs_input_held_bytes,
             activations=w.last_acts + w.outside_last - w.freed, grads=f.later_blocks_grad_bytes + head_new + carry(0),
             temporaries=w.blk_tmp + f.new_wgrad_bytes + tied_buf)
    # A middle block j (0 < j < L-1) is the only one that has all three at once: its
    # unsharded parameters, the prefetched all-gather of block j-1, and block j+1's
    # reduce-scatter input, which FSDP2 keeps until the next reduce-scatter
    # (`comm_ctx.reduce_scatter_state(s)`). Without resharding, blocks 0..j are all still
    # unsharded (`unsharded_during`). Activations, gradient shards and unsharded blocks are
    # linear in j, so the two middle blocks next to the ends bound it. (Measured on the H100
    # with 4 blocks.)
    for j in sorted({1, L - 2}) if L >= 3 and not w.ev else ():
        snap("backward", comm_buffers=ur + f.unsharded_during(j) + f.rs_input_held_bytes,
             activations=w.last_acts + j * (w.first_acts - w.last_acts) // (L - 1)
             + act.inputs + (j + 1) * act.block_cache - w.freed,
             grads=(L - 1 - j) * (lay.shard_block * f.gpu_grad_shard_elem_bytes if f.sharding else lay.block * w.gb)
             + head_new + carry(j),
             temporaries=w.blk_tmp + f.new_wgrad_bytes + tied_buf)


def fsdp2_block_hooks(snap, w: WalkTerms, f: FsdpTerms) -> None:
    """FSDP2, sharded: the instants of each block's own hooks (pre_backward's copy-out, the last weight
    gradient, post_backward's reduce-scatter)."""
    # Each block's own backward, from FSDP2's hooks (_fsdp_param_group.py), per block j (run
    # L-1 .. 0). Gradient shards of the blocks after j are alive (`foreach_reduce`'s
    # `reduce_output`, viewed as the sharded parameters' .grad); so are the saved
    # activations of blocks 0..j-1, and block j+1's reduce-scatter input, which
    # `comm_ctx.reduce_scatter_states` keeps until block j's `post_backward` pops it.
    train, m, act, L, ur, ub, carry = w.train, w.m, w.act, w.L, f.root_unsharded_bytes, f.block_unsharded_bytes, f.carry
    n_tok, h, r = w.n_tok, w.h, w.r
    tied_buf, head_new = _fsdp2_head_bytes(w, f)
    block_elems = w.lay.block
    shard_g = w.lay.shard_block * f.gpu_grad_shard_elem_bytes
    e = 4 if w.regime == "fp32" else 2

    def below(j: int) -> int:
        """Activations saved by blocks 0..j-1 (each block's by itself under checkpointing;
        the RoPE tables with them), and the batch's inputs."""
        return act.inputs + act.below(j) + act.cache_below(j)

    def rs_prev(j: int) -> int:
        return f.rs_input_held_bytes if j < L - 1 else 0

    def shards_after(j: int) -> int:
        """Gradient shards of the blocks after j, the head's new gradient, and what earlier
        micro-steps accumulated in block j, those before it and the root."""
        return (L - 1 - j) * shard_g + head_new + carry(j)

    # Activations, gradient shards and unsharded blocks are linear in j between the steps
    # at j = 0 (nothing prefetched) and j = L-1 (no reduce-scatter input kept): those, and
    # the blocks next to them, bound every block.
    ends = w.walked_blocks((0, 1, L - 2, L - 1), L, w.ev)
    # 1. `pre_backward` -> `wait_for_unshard` (resharding after forward): the all-gather
    #    output (prefetched by block j+1's `_backward_prefetch`, by the root's for the last
    #    block) and the parameters `foreach_all_gather_copy_out` copies it into, both alive
    #    until `_all_gather_result = None`; block j's activations and the gradient entering
    #    it. Block j-1 is prefetched only after this. Without resharding the group is still
    #    unsharded from forward and both calls return at once.
    if f.reshard:
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
    norm_kept = _first_norm_saved(train, w.regime, n_tok, w.device)
    for j in ends:
        ckpt = act.checkpointed(j, train.checkpointing)
        snap("backward", comm_buffers=ur + f.unsharded_during(j) + rs_prev(j),
             activations=below(j) + (0 if ckpt else norm_kept),
             grads=shards_after(j) + f.fresh * (block_elems - pending) * f.unsharded_elem_bytes,
             temporaries=n_tok * h * (r + 3 * e) + in_buffer * f.unsharded_elem_bytes + (norm_kept if ckpt else 0)
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
    split = w.lay.unshard_block * f.reduce_elem_bytes if w.backend == "gloo" else 0
    rs_in = w.lay.unshard_block * f.reduce_elem_bytes
    rs_out = w.lay.shard_block * f.reduce_elem_bytes
    last_g = prod(shapes[-1]) * f.unsharded_elem_bytes if fsdp2_reduce_keeps_last_grad(train) else 0
    for j in ends:
        held_at_rs = (f.prefetch_bytes if j > 0 else 0) if f.reshard else j * ub
        # (without sync, block j's accumulated gradient, in carry(j), is what is collected)
        collected = block_elems * f.unsharded_elem_bytes if not (w.later and not w.every) else 0
        snap("backward", comm_buffers=ur + held_at_rs + rs_in, activations=below(j),
             grads=shards_after(j) + collected, temporaries=n_tok * h * r + tied_buf)
        snap("backward", comm_buffers=ur + held_at_rs + rs_in + rs_out,
             activations=below(j), grads=shards_after(j) - carry(j) + carry(j - 1 if not w.every else j),
             temporaries=n_tok * h * r + split + last_g + tied_buf)


def fsdp2_root_backward(snap, w: WalkTerms, f: FsdpTerms) -> None:
    """FSDP2: a tied embedding's backward, then the root's post_backward (its reduce-scatter), last."""
    train, m, lay, L, ur, v, h = w.train, w.m, w.lay, w.L, f.root_unsharded_bytes, w.v, w.h
    if m.tie_embeddings:  # next to the unsharded root and the last block's reduce-scatter input
        snap_tied_embedding(snap, w, f, ur + (f.rs_input_held_bytes if f.sharding else 0),  # (`reduce_scatter_states`)
                            f.gpu_grad_shard_elem_bytes)
    if (m.tie_embeddings and f.sharding and w.mixed and w.later and not w.every
            and fsdp2_first_microstep_grads_in_reduce_dtype(train)):
        # torch 2.15, the first micro-step without sync (from the second step on): its gradients
        # land in reduce_dtype, so at the tied embedding's backward its gradient and the head's are
        # fp32 copies and their sum a third, next to every block's unsharded fp32 gradient of this
        # micro-step (resharded, nothing reduced: no reduce-scatter input held) and the root's
        # others (a learned position embedding's, the final norm's), nothing accumulated before
        # (config.fsdp2_first_microstep_grads_in_reduce_dtype; measured: GPT-2 medium, zero3 over
        # 2 micro-steps, this instant the peak within 4 KiB)
        snap("backward", comm_buffers=ur, activations=w.act.inputs,
             grads=L * f.block_carried_bytes + max(0, lay.unshard_root - v * h) * f.reduce_elem_bytes,
             temporaries=3 * v * h * f.reduce_elem_bytes)
    if f.sharding:
        # The root's post_backward, last: it reshards first (the root too: FSDP2 keeps it
        # unsharded from forward to backward only, `_auto_reshard_after_forward`), then
        # `foreach_reduce` copies its unsharded gradients (collected from .grad, so no longer
        # counted as gradients) into the reduce-scatter input, frees them and allocates the
        # output shard; gloo's reduce_scatter_tensor splits the input once more.
        rs_root = lay.unshard_root * f.reduce_elem_bytes
        root_old = f.root_carried_bytes if w.every else 0  # the root's accumulated shard (sync every micro-step)
        snap("backward", comm_buffers=rs_root, grads=L * lay.shard_block * f.gpu_grad_shard_elem_bytes + root_old,
             temporaries=lay.unshard_root * f.unsharded_elem_bytes)
        # As at the blocks' (`last_g`), the root's last parameter's unsharded gradient (an untied
        # LM head's, V x h) is kept by the loop variable until `foreach_reduce` returns (to 2.14).
        last_root_g = prod(unit_sizes(m)[0][-1]) * f.unsharded_elem_bytes if fsdp2_reduce_keeps_last_grad(train) else 0
        snap("backward", comm_buffers=rs_root + lay.shard_root * f.reduce_elem_bytes,
             grads=L * lay.shard_block * f.gpu_grad_shard_elem_bytes + root_old,
             temporaries=(rs_root if w.backend == "gloo" else 0) + last_root_g)


# -- FSDP1 (`FullyShardedDataParallel`): one FlatParameter per unit, the hooks of `_runtime_utils.py` ------

def _fsdp1_acts_before(w: WalkTerms, j: int) -> int:
    """Activations at block j's end: blocks 0..j-1's and their caches, the batch's inputs."""
    return (w.act.below(j) + w.act.inputs
            + w.act.cache_below(j))


def _fsdp1_shards_after(w: WalkTerms, f: FsdpTerms, j: int) -> int:
    """Gradient shards of blocks j+1..L-1 (synced every micro-step: inside the carried ones)."""
    return 0 if w.later and w.every else (w.L - 1 - j) * w.lay.shard_block * f.grad_shard_elem_bytes


def fsdp1_blocks_backward(snap, w: WalkTerms, f: FsdpTerms) -> None:
    """FSDP1: each block's backward peak, the end of each block's backward and (sharded) its reduce-scatter."""
    act, lay, L, ur, ub, carry = w.act, w.lay, w.L, f.root_unsharded_bytes, f.block_unsharded_bytes, f.carry
    held, keep_all, prefetch = f.blocks_held, f.keep_all, f.prefetch_bytes
    # (with accumulation, the new flat gradient is added in place to the kept one: a transient)
    if not w.ev:
        snap("backward", comm_buffers=ur + f.first_bwd_unsharded_bytes, grads=carry(L - 1),
             activations=w.first_acts + w.outside_first - w.freed,
             temporaries=w.blk_tmp + f.head_grad_bytes + f.new_wgrad_bytes)
    # Block j's MLP backward (every-K: each block's, recomputed or not). Uniform blocks: the middle ones,
    # as FSDP2's above: its parameters and the prefetched block j-1's unsharded, the gradient shards of
    # the blocks after it; linear in j, so blocks 1 and L-2 bound them. Under checkpointing the shards
    # outweigh the activations and block 1 is the peak (the trace of Mistral-7B, 16 ranks, 1 x 4096
    # tokens, bf16-mixed, full checkpointing: -3.6% with only blocks L-1 and 0 walked)
    for j in w.walked_blocks((1, L - 2) if L >= 3 and not w.ev else (), L, w.ev):
        fr, tmp = w.block_backward_bytes(j)
        in_bwd = (ub + (prefetch if j > 0 else 0) if f.reshard
                  else held * ub if keep_all else min(j + 1, held) * ub)
        snap("backward", comm_buffers=ur + in_bwd,
             grads=(L - 1 - j) * (lay.shard_block * f.grad_shard_elem_bytes if f.sharding else lay.block * w.gb)
             + carry(j),
             activations=act.through(j) + act.inputs + act.cache_below(j + 1) - fr,
             temporaries=tmp + f.head_grad_bytes + f.new_wgrad_bytes)
    # End of the first block's backward: its view gradients and their concatenation (which is
    # the reduce-scatter's input, a comm buffer, unless mixed precision casts it first).
    # Every block ends so (run L-1 .. 0); as at its reduce-scatter below, blocks L-1, 1 and 0
    # bound it (measured: fp32 with full checkpointing peaks here at block 1, next to the
    # gradient shards of the blocks after it; the first block alone was 7.9% under).
    flat = lay.unshard_block * f.unsharded_elem_bytes
    walked = w.walked_blocks((0, 1, L - 1), L, w.ev)
    for j in walked:
        if f.reshard:
            unsharded_j = ub + (prefetch if j > 0 else 0)
        else:
            unsharded_j = held * ub if keep_all else min(j + 1, held) * ub
        snap("backward", comm_buffers=ur + unsharded_j + (0 if w.mixed else flat),
             grads=(_fsdp1_shards_after(w, f, j) if f.sharding else 0) + carry(L - 1 if w.every else j),
             activations=_fsdp1_acts_before(w, j),
             temporaries=w.n_tok * w.h * w.r + f.head_grad_bytes + flat + (flat if w.mixed else 0))
    if not w.ev:
        snap("backward", comm_buffers=ur + f.last_bwd_unsharded_bytes,
             activations=w.last_acts + w.outside_last - w.freed, grads=f.later_blocks_grad_bytes + carry(0),
             temporaries=w.blk_tmp + f.head_grad_bytes + f.new_wgrad_bytes)
    if f.sharding:
        fsdp1_blocks_reduce_scatter(snap, w, f, walked)


def fsdp1_blocks_reduce_scatter(snap, w: WalkTerms, f: FsdpTerms, walked) -> None:
    """FSDP1, sharded: each walked block's reduce-scatter."""
    lay, L, carry, mixed = w.lay, w.L, f.carry, w.mixed
    ur, ub, rb = f.root_unsharded_bytes, f.block_unsharded_bytes, f.reduce_elem_bytes
    gloo = w.backend == "gloo"
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
    flat = lay.unshard_block * f.unsharded_elem_bytes
    cast = lay.unshard_block * rb if mixed else 0
    out_shard = lay.shard_block * rb
    split = lay.unshard_block * rb if gloo else 0
    for j in walked:
        if f.reshard:
            unsharded_j = f.prefetch_bytes if j > 0 else 0
        else:
            unsharded_j = f.blocks_held * ub if f.keep_all else min(j, max(0, f.blocks_held - 1)) * ub
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
        new_flat = flat if w.later and not w.every and f.reshard else 0
        snap("backward",
             comm_buffers=ur + unsharded_j + cast + (0 if mixed else flat)
             + (out_shard if gloo else 0),
             grads=(0 if gloo else out_shard) + _fsdp1_shards_after(w, f, j)
             + carry(L - 1 if w.every else j - 1),
             activations=_fsdp1_acts_before(w, j),
             temporaries=w.n_tok * w.h * w.r + f.head_grad_bytes + split + (flat if mixed else 0) + new_flat)


def fsdp1_root_backward(snap, w: WalkTerms, f: FsdpTerms) -> None:
    """FSDP1: a tied embedding's backward, the first micro-step's end without sync, the root's post-backward."""
    m, lay, L, v, h = w.m, w.lay, w.L, w.v, w.h
    ur, ub = f.root_unsharded_bytes, f.block_unsharded_bytes
    ud, rb = f.unsharded_elem_bytes, f.reduce_elem_bytes
    if m.tie_embeddings:  # next to the unsharded root
        snap_tied_embedding(snap, w, f, ur, f.grad_shard_elem_bytes)
    if f.sharding and w.later and not w.every:
        # The first micro-step, without sync, at its end: `_post_backward_hook` returned before
        # reducing, so every block's unsharded flat gradient is kept (`prepare_gradient_for_backward`
        # leaves it in .grad), nothing is accumulated yet, and SHARD_GRAD_OP has not freed a block
        # (`_should_free_in_backward` is False without sync); then the root's last gradients, as in
        # the walk's later micro-step: a tied embedding's three V x h ones, or the view gradients and
        # their concatenation. Where every block's parameters and gradients outweigh what a later
        # micro-step carries (SHARD_GRAD_OP, a wide tied vocabulary), this instant is the peak
        # (measured: Qwen2.5-0.5B at 8 layers, fsdp-grad-op fp32 over 2 micro-steps, -4.69% without it).
        first_comm = ur + (0 if f.reshard else f.blocks_held * ub)
        first_grads = L * f.block_carried_bytes
        if m.tie_embeddings:
            snap("backward", comm_buffers=first_comm, activations=w.act.inputs, grads=first_grads,
                 temporaries=3 * v * h * ud)
        snap("backward", comm_buffers=first_comm + lay.unshard_root * ud, grads=first_grads,
             temporaries=lay.unshard_root * ud)
    if f.sharding:
        # The root at the end (its post-backward runs last): its view gradients and their
        # concatenation (flat_param.grad) next to the unsharded flat parameter; then
        # `_post_backward_hook` reshards it (`_should_free_in_backward`), casts the gradient to
        # reduce_dtype under mixed precision (the 16-bit one alive to the hook's end) and
        # `_reduce_grad` reduce-scatters into a new shard.
        g_root = lay.unshard_root * ud
        shards_done = L * lay.shard_block * f.grad_shard_elem_bytes
        root_old = f.root_carried_bytes if w.every else 0  # the root's `_saved_grad_shard` (synced every micro-step)
        snap("backward", comm_buffers=ur + g_root, grads=shards_done + root_old, temporaries=g_root)
        # On gloo, as at the blocks' reduce-scatter: the output shard is a buffer the collective
        # writes, and it splits the input once more (measured: CPU probes of a 64k-vocabulary
        # Gemma-2 under bf16-mixed, tied head and untied, the root being the largest unit).
        gloo = w.backend == "gloo"
        snap("backward", comm_buffers=lay.unshard_root * rb + (lay.shard_root * rb if gloo else 0),
             grads=shards_done + (0 if gloo else lay.shard_root * rb) + root_old,
             temporaries=(g_root if w.mixed else 0) + (lay.unshard_root * rb if gloo else 0))
    else:
        # The root at the end: its view gradients, their concatenation, then the cast.
        root_tmp = max(2 * lay.unshard_root * ud, lay.unshard_root * (ud + rb) if w.mixed else 0)
        snap("backward", comm_buffers=ur, grads=L * lay.block * w.gb + f.root_carried_bytes,
             temporaries=root_tmp)


@lru_cache(maxsize=1024)
def _first_linear_grads(m) -> tuple[int, int]:
    """(elements of the block's first Linear's gradients: its weight and its bias if it has one; those plus
    every parameter registered before it, the norm's) of `unit_sizes(m)`'s block shapes, for FSDP2's
    last-weight-gradient instant in `fsdp2_block_hooks` (computed once per model)."""
    shapes = unit_sizes(m)[1]
    first = next((i for i, s in enumerate(shapes) if len(s) == 2), len(shapes) - 1)
    last = first + 1 if (first + 1 < len(shapes) and len(shapes[first + 1]) == 1
                         and shapes[first + 1][0] == shapes[first][0]) else first
    in_buffer = sum(prod(s) for s in shapes[first:last + 1])
    return in_buffer, in_buffer + sum(prod(s) for s in shapes[:first])


def _first_norm_saved(train: TrainConfig, regime: str, n: int, device: str = "cuda") -> int:
    """Bytes the block's first norm (before attention) still keeps for backward while the first Linear's
    backward runs: its input, statistics and output (`activations._norm_saved`; the output's consumers
    matter only under autocast, which FSDP does not run)."""
    return _norm_saved(train, regime, n, 3, device)
