"""The walk of one training run's steps that `alloc_trace.allocation_events` writes: construction, then each
step's micro-steps (forward, the loss and the head, the blocks' backward, the root's) and the optimizer step,
with the strategy families' hooks (DDP's buckets, FSDP1's flat parameters, FSDP2's all-gathers and
reduce-scatters, tensor parallelism's reductions). See alloc_trace's module docstring for what it follows.

`TrainStepWalk` holds the walk's state: the events writer, the sizes (bytes, or shapes in elements) of what
a step allocates, and what lives from one micro-step or step to the next (the optimizer states, the kept
gradients, DDP's buckets). Event keys are the integers `_Events.a` returns."""

from __future__ import annotations

from math import prod

from .activations import _norm_parts, activations_in, regime_for, sp_tokens
from .block_backward import _block_backward_peak
from .block_trace import (_block_saved_shapes, _compiled, _consumed, _grads_by_peak, _split, _split_to_peak,
                          block_program)
from .comm import DDP_BUCKET_CAP_MB, bucket_sizes, ready_order_sizes
from .config import TrainConfig, fsdp2_reduce_keeps_last_grad
from .construction_trace import _construction_events
from .model import unit_sizes
from .state_layout import layout
from .strategies import FSDP1, FSDP2
from .trace_events import (_adam_temporaries, _Events, _fsdp2_copy_out, _fsdp2_gather, _fsdp2_post_backward,
                           _fsdp2_unshard)


class TrainStepWalk:
    """One run's events on the most loaded rank, written step by step into `E` (construction on creation,
    then `step()` per training step)."""

    def __init__(self, train: TrainConfig, st, world: int, shard: int, device: str, init: str):
        self.train, self.st, self.world, self.shard = train, st, world, shard
        family = self.family = st.family
        m = self.m = train.model
        prec = self.prec = train.prec
        regime = self.regime = regime_for(train, family)
        self.act = activations_in(train, regime, device)
        lay = self.lay = layout(m, family, shard, st.shards_params, st.shards_optimizer)
        self.L = m.layers
        self.n = train.micro_batch * train.seq_len
        t = self.t = train.tp
        self.v = -(-m.vocab // t)  # one tensor-parallel rank's vocabulary (loss parallel: logits sharded over it)
        pb, gb, cb = self.pb, self.gb, self.cb = prec.param_bytes, prec.grad_bytes, prec.compute_bytes
        self.r = 4 if regime in ("fp32", "autocast") else 2
        self.e = 4 if regime == "fp32" else 2
        self.root_shapes, self.block_shapes, _, _, _ = unit_sizes(m)
        n_embed = 1 + (m.position == "learned")
        self.embed_shapes, self.head_shapes = self.root_shapes[:n_embed], self.root_shapes[n_embed:]
        self.sharding = shard > 1 and st.shards_params
        fsdp = self.fsdp = st.fsdp
        self.ud = (cb if prec.mixed else pb) if fsdp else pb  # unsharded parameter / gradient dtype
        self.rb = 4 if prec.mixed else gb  # FSDP reduce dtype
        self.ckpt = train.checkpointing != "none"
        self.A, self.every = train.grad_accum, train.sync_every
        E = self.E = _Events()

        # -- construction -------------------------------------------------------------------------------
        self.buckets, self.state_sizes, self.owned = _construction_events(E, train, st, world, shard, lay, init)
        E.a(train.micro_batch * train.seq_len * 8), E.a(train.micro_batch * train.seq_len * 8)  # ids, targets

        # -- one step -------------------------------------------------------------------------------------
        self._block_sizes(device)
        self._head_and_loss_sizes(device)
        self.states: list = []
        self.grads: list = []
        self.bucket_rebuilt = False
        self.acc: dict = {}  # unit -> gradient kept unsharded between micro-steps without sync
        self.saved: dict = {}  # unit -> gradient kept (sharded when synced) for this step's later micro-steps
        self.kept_unsharded: dict = {}  # FSDP1 SHARD_GRAD_OP without sync: units left unsharded between micro-steps
        # the tied weight's gradients at the root's backward: of the parameter itself (single, DDP, ZeRO-1),
        # FSDP2's unsharded parameter or FSDP1's view of its flat parameter
        self.tied = m.tie_embeddings and t == 1
        self.tied_b = (self.ud if fsdp else gb)  # their dtype: FSDP's unsharded gradients are in param_dtype

    def _block_sizes(self, device: str) -> None:
        """The bytes a block saves, keeps and holds transiently in backward, and its weights' autocast casts."""
        train, m, act, regime, n, r, e = self.train, self.m, self.act, self.regime, self.n, self.r, self.e
        listed = _block_saved_shapes(train, regime, n, device)
        blk_peak = self.blk_peak = _block_backward_peak(train, regime, n, device)
        # (`rest`: 1 where the last entry is what the list leaves out)
        blk_saved, self.rest = _split_to_peak(act.per_block, listed, blk_peak[0])
        self.blk_saved = blk_saved
        kept = act.kept_each  # per block through forward (checkpointing: its input)
        self.kept_saved = blk_saved if not self.ckpt else _split(kept, [n * m.hidden * r])
        if act.every:  # every-K: blocks 0, K, 2K, ... keep their input, the others all they save
            self.kept_saved = _split(act.ckpt_kept, [n * m.hidden * r])
        blk_tmp = blk_peak[1]
        tmp_parts = [n * m.hidden * r] + [n * m.ffn_hidden * e] * 3
        self.tmp_shapes = _split(blk_tmp, tmp_parts)
        # The residual stream's gradient (the first of a block's transients) is one tensor from the head's backward
        # to the embedding's: autograd's InputBuffer accumulates a block input's gradient in place into the one it
        # received (torch/csrc/autograd/input_buffer.cpp `accumulate`), so it outlives each block's transients and
        # is alive through the blocks' late gradients and post-backward hooks (fsdp_walk's hook instants count it)
        self.resid_carried = self.t == 1 and blk_tmp >= sum(tmp_parts)
        self.early = _grads_by_peak(self.block_shapes, blk_peak[2])
        # A checkpointed block's recomputation saves what its forward saved, but its first norm's saved input is the
        # kept block input itself, not a new tensor (activations_in's `recompute_block`)
        self.rec_saved = (blk_saved[1:] if m.hf_model_type and (m.norm == "layernorm" or regime != "lowp")
                          else blk_saved)
        self.weight_casts = [prod(s) * 2 for s in self.block_shapes if len(s) == 2] if regime == "autocast" else []
        self.cast_sizes = tuple(self.weight_casts)
        self.head_cast = [prod(s) * 2 for s in self.head_shapes if len(s) == 2] if regime == "autocast" else []

    def _head_and_loss_sizes(self, device: str) -> None:
        """The final norm's and the loss's bytes, whether the forward is written op by op (`carry`), and tensor
        parallelism's reductions."""
        train, m, act, regime, n, r, t = self.train, self.m, self.act, self.regime, self.n, self.r, self.t
        self.outside = act.outside - act.inputs
        final_norm = (_norm_parts(train, regime, n, 1, device) if not m.sandwich_norms and t == 1
                      and not train.sequence_parallel and (m.norm == "rmsnorm" or not m.hf_model_type) else [])
        if sum(final_norm) > self.outside or len(final_norm) < 4:
            final_norm = []
        self.final_norm = final_norm
        # The forward op by op (block_program) where every block and the final norm are written so: each block reads
        # the one before's output (the embedding's for block 0), which its first norm saves (fp32 hidden states) or
        # a checkpointed block keeps, and recomputes the same way in backward; else a block's saved tensors as one
        # burst (selective checkpointing among them: its forward saves some of them)
        no_grad = train.checkpointing == "full" or bool(act.every)
        fwd_ops = block_program(train, regime, n, device) if no_grad else None
        grad_ops = block_program(train, regime, n, device, True)
        self.carry = (bool(final_norm) and grad_ops is not None and (fwd_ops is not None if self.ckpt else True)
                      and self.kept_saved[0] == n * m.hidden * r)
        if not self.carry:
            fwd_ops = grad_ops = None
        # Written as one burst per block (not `carry`), block 0 saves the embedding output itself where its first
        # saved tensor is its input (fp32 hidden states: an RMSNorm's `x.float()` returns x, a LayerNorm saves x;
        # a checkpointed block keeps its input); else (16-bit hidden states, whose norm saves a new fp32 copy)
        # nothing saves it: the reference decoder drops it after block 0 (`x = block(x, ...)`), transformers'
        # <Model>.forward at its return, after the final norm (its local `inputs_embeds`)
        self.emb_saved_by_block0 = (not self.carry and self.L > 0
                                    and (self.ck(0) or self.regime in ("fp32", "autocast")))
        self.fwd_ops, self.grad_ops = fwd_ops, grad_ops
        # nll_loss_backward's dense gradient + log_softmax_backward's output; loss parallel's fused backward
        # holds three (memory.estimate_memory's `loss_bwd_tmp`)
        self.loss_tmp = [n * self.v * 4] * (3 if t > 1 else 2)
        # Tensor parallelism (tp.py): each rowwise Linear's output (attention, MLP) is a partial sum that
        # DTensor's redistribution reduces into a new tensor (functional all_reduce; reduce_scatter to the
        # rank's tokens with sequence parallelism), the partial freed after it; backward does the same for
        # the gradient of the colwise Linears' input (the two norms' outputs). Allocated on the caller's
        # stream. (The all-gathered inputs that the colwise Linears save are in the block's saved bytes.)
        nt = sp_tokens(train, n)
        # (the vocabulary-sharded embedding's gradient is a Replicate DTensor of the whole vocabulary,
        # memory.estimate_memory's `emb_full`)
        embed_shapes = self.embed_shapes
        self.emb_shapes = (([(m.vocab,) + tuple(embed_shapes[0][1:])] + list(embed_shapes[1:])) if t > 1
                           else list(embed_shapes))
        self.tp_pairs = [(n * m.hidden * self.e, nt * m.hidden * self.e)] * 2 if t > 1 else []

    def ck(self, j: int) -> bool:
        """Whether block j is checkpointed."""
        return j % self.act.every == 0 if self.act.every else self.ckpt

    def kept_by(self, j: int) -> list:
        """The bytes block j keeps through forward."""
        return self.kept_saved if self.ck(j) else self.blk_saved

    # -- the strategy families' hooks ----------------------------------------------------------------------

    def unshard_flat(self, u_shapes):
        return _fsdp2_gather(self.E, u_shapes, self.shard, self.ud, self.prec.mixed)

    def unshard(self, u_shapes):
        return _fsdp2_unshard(self.E, u_shapes, self.shard, self.ud, self.prec.mixed)

    def tp_reduce(self) -> None:
        E = self.E
        for partial, out in self.tp_pairs:
            a = E.a(partial)
            b = E.a(out)
            E.f(a, b)

    def fsdp1_unshard(self, elems_shard):
        """`_unshard`: the low-precision shard (`_use_low_precision_shard`, on the pre-unshard stream) under
        mixed precision; sharded, the padded unsharded flat parameter on the unshard stream, the shard freed
        (`post_unshard`); NO_SHARD does not unshard (`needs_unshard`): the low-precision copy is the
        unsharded parameter until the reshard frees it."""
        E = self.E
        mp = E.a(elems_shard * self.cb, 3) if self.prec.mixed else None
        if not self.sharding:
            return mp
        flat = E.a(elems_shard * self.shard * self.ud, 1)
        E.f(mp)
        return flat

    def fsdp1_reduce(self, u, view_grads, unsharded, elems, elems_shard, sync, keep):
        """A unit's backward end: the views' gradients concatenated into the flat gradient, then
        `_post_backward_hook` (on the post-backward stream): reshard, the cast to reduce_dtype under
        mixed precision, `_reduce_grad`'s output shard (reduce-scatter), or the all-reduced flat gradient
        (NO_SHARD). The tensor a collective reads goes to that stream's pool (allocator.comm_streams).
        Accumulation: a later micro-step's flat gradient is added in place to the kept one (AccumulateGrad)
        and freed after the hook (a post-hook of that AccumulateGrad node, called with it); without sync
        (`_post_backward_hook` returns early) the unsharded flat gradient is kept in param_dtype, and
        SHARD_GRAD_OP keeps the unit unsharded (`_should_free_in_backward`); synced every micro-step, the new
        shard is added to `_saved_grad_shard` (`_accumulate_sharded_grad`)."""
        E, acc, saved, grads, rb = self.E, self.acc, self.saved, self.grads, self.rb
        comm = self.world > 1
        # The flat gradient (the reduction reads it, or the one kept since the first micro-step): made by the
        # backward of the views `_use_unsharded_views` takes inside `_unshard`'s unshard-stream context, and
        # CUDA autograd runs a backward op on its forward op's stream: the unshard stream's pool
        flat_g = E.a(elems * self.ud, 1)
        E.f(*view_grads)
        new_g = None
        if u in acc:  # added to the unsharded gradient kept by earlier micro-steps (without sync)
            new_g, flat_g = flat_g, acc.pop(u)
            if not sync:
                E.f(new_g)
        if not sync:
            acc[u] = flat_g
            if not keep:
                E.f(unsharded)
            return unsharded if keep else None
        E.f(unsharded)
        # Under mixed precision the flat gradient stays alive to the hook's end beside its cast (the hook's
        # local `autograd_computed_grad`, torch/distributed/fsdp/_runtime_utils.py, _post_backward_hook)
        src = E.a(elems * rb, 2 if comm else 0) if self.prec.mixed else flat_g
        if self.sharding:
            out = E.a(elems_shard * rb, 2)
            if u in saved:  # `_saved_grad_shard += sharded_grad` (`_accumulate_sharded_grad`)
                E.f(out)
            else:
                saved[u] = out
                grads.append(out)
            E.f(src)  # `_reduce_grad`'s `unsharded_grad`, gone when it returns
        elif u in saved:  # NO_SHARD synced every micro-step: added to the kept gradient
            E.f(src)
        else:
            saved[u] = src
            grads.append(src)
        if src is not flat_g:
            E.f(flat_g)
        if new_g is not None:  # the hook is a post-hook of the FlatParameter's AccumulateGrad node, called
            E.f(new_g)  # with the new gradient it added (`_register_post_backward_hook`)
        return None

    def new_grads(self, u, shapes):
        """The unit's new gradients; where a kept .grad takes them in place (AccumulateGrad:
        `variable_grad += new_grad`), each is freed as soon as it is added."""
        E, fsdp = self.E, self.fsdp
        if not self.first and self.in_place and (u in self.acc or not fsdp):
            for s in shapes:  # each weight gradient is added as its Linear's backward makes it
                E.f(E.a(prod(s) * (self.ud if fsdp else self.gb)))
            return []
        return [E.a(prod(s) * (self.ud if fsdp else self.gb)) for s in shapes]

    def keep_grads(self, u, g):
        if self.first:
            self.grads.extend(g)
        else:  # (FSDP2 on one rank: added into the kept .grad)
            self.E.f(*g)

    def fsdp2_post(self, u, g, params, rs_kept, unsharded, sharded):
        return _fsdp2_post_backward(self.E, u, g, params, rs_kept, unsharded, sharded,
                                    self.block_shapes if u != "root" else list(self.head_shapes) + self.emb_shapes,
                                    sync=self.sync, reshard=True, mixed=self.prec.mixed, rb=self.rb, acc=self.acc,
                                    saved=self.saved, grads=self.grads,
                                    last_grad_late=self.shard > 1 and fsdp2_reduce_keeps_last_grad(self.train))

    def fsdp2_ready(self, j):
        """`wait_for_unshard` in pre_backward: copy out the (prefetched) all-gather output."""
        held = self.held
        if j in held or j < 0:
            return
        flat = self.pending.pop(j, None)
        if flat is None:
            flat = self.unshard_flat(self.block_shapes)
        held[j] = _fsdp2_copy_out(self.E, self.block_shapes, self.shard, self.ud)
        self.E.f(flat)

    def rebuild_ddp_buckets(self) -> None:
        """DDP's second forward: the first iteration's bucket freed, the buckets in gradient-ready order made."""
        E = self.E
        if self.buckets and not self.bucket_rebuilt and self.states:
            E.f(*self.buckets)
            self.buckets[:] = [E.a(b) for b in bucket_sizes(ready_order_sizes(self.m, self.regime == "autocast"),
                                                             self.gb, DDP_BUCKET_CAP_MB)]
            self.bucket_rebuilt = True

    # -- a step ------------------------------------------------------------------------------------------

    def step(self) -> None:
        # grad_accum micro-steps, then the optimizer. The micro-steps between the second and the last repeat
        # the second's allocations (each frees what it makes but the kept gradients), so the caching
        # allocator is back in the same state after each: the first, the second and the last bound the run
        # (and keep a grad_accum of 2**20 as cheap as 3)
        A, E = self.A, self.E
        for k in sorted({0, min(1, A - 1), A - 1}):
            self.micro_step(k)
        if self.state_sizes and not self.states:  # made lazily in the first step (`_init_group`)
            self.states.extend(E.a(z) for z in self.state_sizes)
        _adam_temporaries(E, [s * self.pb for s in self.owned], self.train.optimizer, self.train.optimizer_impl)
        E.f(*self.grads)
        self.grads.clear()
        self.saved.clear()
        assert not self.acc, "unsynced gradients at the optimizer step"

    def micro_step(self, k: int) -> None:
        """Micro-step k of grad_accum: gradients made on the first are kept (or reduced and kept as
        shards); later ones add theirs into those (memory.estimate_memory's `carry`)."""
        st, prec, family = self.st, self.prec, self.family
        self.sync = self.every or k == self.A - 1
        self.first = k == 0
        self.held = dict(self.kept_unsharded)
        self.kept_unsharded.clear()
        self.keep = family == FSDP1 and not st.reshard_after_forward and not self.sync
        self.in_place = not self.fsdp or (family == FSDP2 and not prec.mixed)  # AccumulateGrad adds into .grad
        self.forward()
        head_saved, hc, head_own, norm = self.final_norm_forward()
        if not self.carry and not self.emb_saved_by_block0:
            self.E.f(self.out_emb)  # transformers' model forward returns (or no block saved it)
        logp, upcast = self.loss_forward()
        self.prefetch_last_block()
        head_g, tied_g = self.head_backward(head_saved, hc, head_own, norm, logp, upcast)
        self.rs_kept = None
        for j in reversed(range(self.L)):
            self.block_backward(j)
        self.root_backward(head_g, tied_g)

    # -- forward -----------------------------------------------------------------------------------------

    def forward(self) -> None:
        """The embedding and every block's forward: what each keeps for backward (`self.blocks`)."""
        E, m, family, held = self.E, self.m, self.family, self.held
        self.rebuild_ddp_buckets()
        if family == FSDP2 and self.sharding:
            held["root"] = self.unshard(self.root_shapes)
            self.prev_flat = held["root"][0]
        elif family == FSDP1 and (self.sharding or self.prec.mixed) and "root" not in held:
            held["root"] = self.fsdp1_unshard(self.lay.shard_root)
        self.out_emb = E.a(self.n * m.hidden * self.r)
        # learned position embeddings (GPT-2): the position ids, int64, one row (`torch.arange` after the token
        # embedding), which the position embedding saves for its backward (activations' `inputs`)
        self.positions = E.a(self.train.seq_len * 8) if m.position == "learned" else None
        self.cur = self.out_emb  # the hidden states (written op by op: `carry`)
        self.saved_sizes: dict = {}  # block -> the bytes of what it saved (written op by op)
        # what the blocks share (RoPE tables; eager attention's masks that checkpointed blocks keep), to the
        # end of block 0's backward
        self.shared = E.a(self.act.shared) if self.act.shared and self.L else None
        self.blocks: list = []
        # autocast's cache (aten/src/ATen/autocast_mode.cpp `cached_cast`: the 16-bit cast of a leaf that
        # requires grad is kept for the whole autocast region): a checkpointed block saves none of its
        # weights' casts, yet they stay alive until the region exits after the loss (`clear_cache` when
        # torch.autocast's __exit__ takes the nesting to 0; memory.py counts them as `weight_cache_forward`)
        self.cached: list = []
        for j in range(self.L):
            self.block_forward(j)

    def block_forward(self, j: int) -> None:
        E, family, held, sharding, ck = self.E, self.family, self.held, self.sharding, self.ck
        if family == FSDP2 and sharding:
            flat, params = self.unshard(self.block_shapes)
            E.f(self.prev_flat)
            self.prev_flat = flat
            held[j] = params
        elif family == FSDP1 and (sharding or self.prec.mixed) and j not in held:
            held[j] = self.fsdp1_unshard(self.lay.shard_block)
        if self.carry:  # op by op; a checkpointed block runs without saving and keeps its input
            template, count, out_i, saved_i, saved_b, cast_i, _ = _compiled(
                self.fwd_ops if ck(j) else self.grad_ops, self.cast_sizes, self.n * self.m.hidden * self.r)
            base = E.put(template, count, self.cur)
            casts_kept = [base + i for i in cast_i]
            if ck(j):
                self.cached.extend(casts_kept)
                self.blocks.append(([self.cur] + [E.a(s) for s in self.kept_saved[1:]], []))
            else:
                self.blocks.append(([base + i if i else self.cur for i in saved_i], casts_kept))
                self.saved_sizes[j] = list(saved_b)
            self.cur = base + out_i
        else:
            casts = [E.a(c) for c in self.weight_casts]
            if ck(j):  # the block runs without saving (one burst), then keeps its input
                tr = [E.a(s) for s in self.blk_saved]
                E.f(*tr)
                casts_kept = []
                self.cached.extend(casts)
            else:
                casts_kept = casts
            kept = self.kept_by(j)
            if j == 0 and self.emb_saved_by_block0:
                self.blocks.append(([self.out_emb] + [E.a(s) for s in kept[1:]], casts_kept))
            else:
                self.blocks.append(([E.a(s) for s in kept], casts_kept))
            if j == 0 and not self.emb_saved_by_block0 and not self.m.hf_model_type:
                E.f(self.out_emb)  # the reference decoder's `x = block(x, ...)`: the embedding output dropped
                self.out_emb = None
        self.tp_reduce()
        # resharded after forward: FULL_SHARD / zero3; NO_SHARD under mixed precision frees its 16-bit
        # copy (`_runtime_utils._post_forward` -> `_reshard` -> `handle.post_reshard`)
        no_shard_mp = family == FSDP1 and not sharding and self.prec.mixed
        if ((self.st.reshard_after_forward and sharding) or no_shard_mp) and j in held:
            E.f(*(held.pop(j) if family == FSDP2 else [held.pop(j)]))

    def final_norm_forward(self) -> tuple:
        """The final norm and the head's cached casts: (the saved tensors the head's backward frees, its weight
        casts, under autocast what its matmul saved of its own, else None: all of them; and the final norm's
        (x, rstd, x * rstd) where its backward is written op by op, `final_norm_backward`, else ())."""
        E, m, n, r, regime, carry, cur = self.E, self.m, self.n, self.r, self.regime, self.carry, self.cur
        final_norm, outside, head_cast = self.final_norm, self.outside, self.head_cast
        head_own, norm = None, ()
        # the final norm and the LM head's input (activations.ActivationBreakdown.outside): an RMSNorm's saved
        # tensors one by one in the order its forward makes them (`pow`'s output and, in lowp, the fp32 x * rstd
        # are transients), then under autocast the head's cached weight cast and its cast of the input
        if final_norm and m.norm == "layernorm":  # its input (the last block's output), its output, mean, rstd
            head_saved = [cur if carry else E.a(final_norm[0])]
            out_n = E.a(final_norm[3]) if regime != "autocast" else E.a(n * m.hidden * 4)
            head_saved += [E.a(final_norm[1]), E.a(final_norm[2])]
            hc = [E.a(c) for c in head_cast]
            if regime == "autocast":  # the head saves its 16-bit cast of the fp32 output
                head_own = [E.a(x) for x in final_norm[3:]]
                head_saved += head_own
                E.f(out_n)
            else:
                head_saved.append(out_n)
            if outside > sum(final_norm):
                head_saved.append(E.a(outside - sum(final_norm)))
        elif final_norm:
            # (written op by op, its fp32 input is the last block's output, which `x.float()` returns)
            head_saved = [cur if carry and r == 4 else E.a(final_norm[0])]
            E.f(E.a(n * m.hidden * 4))  # pow(2), read by mean
            head_saved.append(E.a(final_norm[1]))
            xr = E.a(n * m.hidden * 4) if regime == "lowp" else None  # x * rstd, cast to 16 bits and dropped
            head_saved.append(E.a(final_norm[2]))
            if r == 4 and carry and self.resid_carried and self.t == 1:  # its backward written op by op
                norm, head_saved = tuple(head_saved), []
            if regime != "autocast":  # the norm's output, which the head saves
                head_saved += [E.a(x) for x in final_norm[3:]]
            if carry and r != 4:
                E.f(cur)  # the 16-bit hidden states (the recorded CPU traces drop them here)
            E.f(xr)  # a local to the norm's return
            hc = [E.a(c) for c in head_cast]
            if regime == "autocast":  # the head's 16-bit cast of its input, after its weight's
                head_own = [E.a(x) for x in final_norm[3:]]
                head_saved += head_own
            if outside > sum(final_norm):
                head_saved.append(E.a(outside - sum(final_norm)))
        else:
            hc = [E.a(c) for c in head_cast]
            head_saved = [E.a(outside)]
        return head_saved, hc, head_own, norm

    def loss_forward(self) -> tuple:
        """The logits and the loss: (log_softmax's saved output, whether the logits were upcast)."""
        E, n, v, t = self.E, self.n, self.v, self.t
        # The loss as transformers' ForCausalLMLoss (loss/loss_utils.py) and the reference decoder compute it:
        # 16-bit logits are upcast (`logits.float()`, a new n x V fp32 tensor alive beside log_softmax's
        # output, then dropped); in backward the logits' fp32 gradient is cast back (ToCopyBackward, n x V in
        # the logits' dtype) before the head's matmul backward reads it (the recorded CPU traces' order).
        # The walk counts both (activations `logits_transient`, memory `loss_bwd_tmp`).
        upcast = self.cb != 4 and t == 1
        logits = E.a(n * v * self.cb)
        up = E.a(n * v * 4) if upcast else None
        logp = E.a(self.act.loss_saved)
        E.f(up)  # the loss function's upcast, a local of ForCausalLMLoss
        if self.family == FSDP2 and self.sharding:
            # the last block's all-gather output is kept for the copy-out's overlap with a next all-gather
            # (`comm_ctx.all_gather_state`) until the root's `_post_forward` frees it, the loss computed inside
            # the model's forward (transformers' and the reference decoder's); the logits are the output's,
            # dropped after (the recorded CPU traces' order)
            E.f(self.prev_flat)
        E.f(logits)
        E.f(*self.cached)  # the autocast region exits with the loss computed
        return logp, upcast

    # -- backward ----------------------------------------------------------------------------------------

    def prefetch_last_block(self) -> None:
        """The root's pre-backward hook on the loss: the last block's all-gather (FSDP2) or unshard (FSDP1)."""
        L, family, held = self.L, self.family, self.held
        self.pending: dict = {}  # FSDP2: prefetched all-gather outputs not yet copied out
        if family == FSDP2 and self.sharding and L and L - 1 not in held:
            # backward begins at the root's pre-backward hook on the loss (`FSDPState._pre_backward`), whose
            # `_backward_prefetch` all-gathers the unit before it in post-forward order, the last block, before
            # the loss's and the head's backward run (their n x V tensors beside it)
            self.pending[L - 1] = self.unshard_flat(self.block_shapes)
        elif family == FSDP1 and (self.sharding or self.prec.mixed) and L and L - 1 not in held:
            # FSDP1 the same: the root handle's `_pre_backward_hook` on the loss, then `_prefetch_handle`
            # (BACKWARD_PRE) unshards the handle before it in post-forward order, the last block's
            # (`_exec_order_utils.py` get_handle_to_backward_prefetch)
            held[L - 1] = self.fsdp1_unshard(self.lay.shard_block)

    def head_backward(self, head_saved: list, hc: list, head_own, norm: tuple, logp, upcast: bool) -> tuple:
        """The loss's and the head's backward: (the head's gradients, the tied weight's held gradient or None)."""
        E, m, n, v, t, cb = self.E, self.m, self.n, self.v, self.t, self.cb
        # backward: the loss and the head
        lt = [E.a(x) for x in self.loss_tmp]
        E.f(*lt[:-1], logp)
        grad_logits = lt[-1]
        if upcast:
            grad_logits = E.a(n * v * cb)
            E.f(lt[-1])
        done = [grad_logits, *hc, *head_saved]  # freed when the head's matmul backward node has run
        self.resid_g = self.head_input_grad()
        if self.regime == "autocast" and t == 1:
            # fp32 parameters under autocast: the head's matmul backward makes its weight's gradient in 16 bits
            # (the matmul ran on the weight's cast), its node then drops what it saved and the logits'
            # gradient, and the cast's backward (ToCopyBackward) makes the fp32 gradient, the 16-bit one freed
            # after (the H100's recorded events; memory.py's `w_head` instant)
            # The final norm's saved tensors stay to its backward, which runs after the cast's backward
            w16 = [E.a(prod(s) * 2) for s in self.head_shapes if len(s) == 2]
            own = done if head_own is None else [grad_logits, *hc, *head_own]
            E.f(*own)
            done = w16 + [k for k in done if k not in own]
        head_g = self.new_grads("root", self.head_shapes)
        # A tied weight (the parameter, FSDP2's unsharded parameter, FSDP1's view): the head's matmul backward
        # makes its gradient beside the logits' gradient it reads (the recorded traces' order), and autograd holds
        # it in the weight's input buffer through every block's backward, until the embedding's arrives (below)
        tied_g = E.a(v * m.hidden * self.tied_b) if self.tied and self.carry else None
        E.f(*done)
        if self.tied and not self.carry:
            tied_g = E.a(v * m.hidden * self.tied_b)
        if norm:
            self.final_norm_backward(*norm)
        return head_g, tied_g

    def final_norm_backward(self, x, rstd, xr) -> None:
        """The final RMSNorm's backward op by op where its input is fp32 (`x`; `rstd`, `xr` = x * rstd its other
        saved tensors), from the head input's gradient (`resid_g`), as autograd runs `weight * xr.to(dtype)`,
        `x * rstd`, mean and pow backward (derivatives.yaml: mul_tensor_backward per factor, a factor's gradient
        summed to its shape in validate_outputs; pow_backward `grad * (2 * x.pow(1))`): the two gradients of x
        are summed in its input buffer (input_buffer.cpp `accumulate`: `old_var + var`, a new tensor), which is
        the residual stream's gradient the last block's backward reads."""
        E, b = self.E, self.n * self.m.hidden * 4
        g_xr, g_weight = E.a(b), E.a(b)  # grad * weight, grad * xr (summed to the weight's shape)
        E.f(g_weight, xr, self.resid_g)  # the node's saved xr released, then its input
        g_rstd, g_x = E.a(b), E.a(b)  # grad * x (summed to n x 1), grad * rstd
        E.f(g_rstd, g_xr)
        E.f(rstd)  # rsqrt's backward (n x 1), its saved result released
        g_sq = E.a(b)  # mean's backward: the n x 1 gradient expanded and divided by h
        pow1, twice, g_x2 = E.a(b), E.a(b), E.a(b)
        E.f(twice, pow1, x, g_sq)
        self.resid_g = E.a(b)
        E.f(g_x, g_x2)

    def head_input_grad(self):
        """The head input's gradient, which its matmul's backward node makes with the weight's (both alive until
        the node returns and AccumulateGrad takes the weight's): the residual stream's gradient, carried to the
        embedding's backward (`resid_carried`); None where the block's transients hold it."""
        return self.E.a(self.tmp_shapes[0]) if self.resid_carried else None

    def block_backward(self, j: int) -> None:
        """Block j's backward: its pre-backward hooks, its gradients, its post-backward hooks."""
        family, held, sharding, lay = self.family, self.held, self.sharding, self.lay
        # pre_backward: this block unsharded (or still so from forward), then `_backward_prefetch`
        # issues the next one's all-gather (BACKWARD_PRE for FSDP1)
        if family == FSDP2 and sharding:
            self.fsdp2_ready(j)
            if j > 0 and j - 1 not in held and j - 1 not in self.pending:
                self.pending[j - 1] = self.unshard_flat(self.block_shapes)
        elif family == FSDP1 and (sharding or self.prec.mixed):
            for k in (j, j - 1):
                if k >= 0 and k not in held:
                    held[k] = self.fsdp1_unshard(lay.shard_block)
        keys, casts = self.blocks[j]
        if self.t > 1:
            g = self.block_backward_tp(j, keys, casts)
        else:
            g = self.block_backward_in_phases(j, keys, casts)
        if family == FSDP2 and sharding:
            self.rs_kept = self.fsdp2_post(j, g, held.pop(j), self.rs_kept, lay.unshard_block, lay.shard_block)
        elif family == FSDP1:
            u = self.fsdp1_reduce(j, g, held.pop(j, None), lay.unshard_block, lay.shard_block, self.sync, self.keep)
            if u is not None:
                self.kept_unsharded[j] = u
        else:
            self.keep_grads(j, g)

    def block_backward_tp(self, j: int, keys: list, casts: list) -> list:
        """Block j's backward under tensor parallelism; returns its gradients."""
        E = self.E
        # tensor parallelism: the block's backward as one burst (its recorded CPU runs agree better so:
        # single at tp 2, 0.2% against 2.6% written in phases as below)
        if self.ck(j):
            casts = [E.a(c) for c in self.weight_casts]
            E.f(*keys)
            keys = [E.a(s) for s in self.blk_saved]
        self.tp_reduce()
        tmp = [E.a(s) for s in self.tmp_shapes]
        g = self.new_grads(j, self.block_shapes)
        E.f(*keys, *casts, *tmp)
        return g

    def block_backward_in_phases(self, j: int, keys: list, casts: list) -> list:
        """Block j's backward in two phases, to its peak and after it; returns its gradients."""
        E, ck, rest, block_shapes = self.E, self.ck, self.rest, self.block_shapes
        sizes = self.saved_sizes.get(j) or self.kept_by(j)
        rest_j = 0 if j in self.saved_sizes else rest
        if ck(j) and self.carry:  # recomputed op by op beside its kept input, to the early stop
            template, count, _, saved_i, saved_b, cast_i, unwind = _compiled(
                self.grad_ops, self.cast_sizes, self.n * self.m.hidden * self.r, True)
            base = E.put(template, count, keys[0])
            E.f(*(base + i for i in unwind))
            casts = [base + i for i in cast_i]
            keys = keys + [base + i for i in saved_i if i]
            sizes = sizes + [b for i, b in zip(saved_i, saved_b) if i]
        elif ck(j):  # recomputed next to its kept input, which the checkpoint holds to the block's end
            rest_j = rest
            casts = [E.a(c) for c in self.weight_casts]
            keys = keys + [E.a(s) for s in self.rec_saved]
            sizes = sizes + self.rec_saved
        # The block's backward runs from its end: by its peak (memory._block_backward_peak) the ops there
        # have consumed their saved tensors (the last ones forward made: the MLP's product) and made their
        # transients and those Linears' weight gradients; then the rest of its gradients, and the saved
        # tensors go
        cut = _consumed(sizes, self.blk_peak[0], rest_j)
        E.f(*keys[cut:len(keys) - rest_j])
        tmp = [E.a(s) for s in self.tmp_shapes[self.resid_carried:]]
        early = self.early
        g_early = self.new_grads(j, [block_shapes[i] for i in early])
        E.f(*tmp)
        late = [i for i in range(len(block_shapes)) if i not in early]
        g_late = self.new_grads(j, [block_shapes[i] for i in late])
        order = dict(zip(early + late, g_early + g_late))
        g = [order[i] for i in sorted(order)]
        E.f(*keys[:cut], *keys[len(keys) - rest_j:], *casts)
        return g

    def root_backward(self, head_g: list, tied_g) -> None:
        """The embedding's backward and the root's post-backward hooks; whatever is still unsharded freed."""
        E, family, held, lay, emb_shapes = self.E, self.family, self.held, self.lay, self.emb_shapes
        E.f(self.resid_g)
        if self.shared is not None:
            E.f(self.shared)
        # the embedding's gradient and the root
        if self.tied:
            # embedding_dense_backward's gradient and its sum with the head's (input_buffer.cpp `accumulate`:
            # `old_var + var`, a new tensor, as the recorded traces show), both addends then freed: three
            # vocab x hidden gradients at once; the sum is the weight's gradient (or, in a later micro-step,
            # added into .grad and freed)
            addend = E.a(prod(emb_shapes[0]) * self.tied_b)
            total = E.a(prod(emb_shapes[0]) * self.tied_b)
            E.f(tied_g, addend)
            emb_g = [total] + self.new_grads("root", emb_shapes[1:])
            if not self.first and self.in_place and ("root" in self.acc or not self.fsdp):  # as new_grads
                E.f(*emb_g)
                emb_g = []
        else:
            emb_g = self.new_grads("root", emb_shapes)
        if self.positions is not None:
            E.f(self.positions)
        if family == FSDP2 and self.sharding:
            E.f(self.fsdp2_post("root", head_g + emb_g, held.pop("root")[1], self.rs_kept, lay.unshard_root,
                                lay.shard_root))
        elif family == FSDP1:
            u = self.fsdp1_reduce("root", head_g + emb_g, held.pop("root", None), lay.unshard_root, lay.shard_root,
                                  self.sync, self.keep)
            if u is not None:
                self.kept_unsharded["root"] = u
        else:
            self.keep_grads("root", head_g + emb_g)
        for k in list(held):
            E.f(*(held.pop(k) if isinstance(held[k], list) else [held.pop(k)]))
