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
from math import prod

from .activations import _norm_parts, activations_in, regime_for, sp_tokens
from .allocator import alloc_rounding, replay_fit, replay_peaks
from .block_backward import _block_backward_peak
from .block_trace import _block_saved_shapes, _compiled, _consumed, _grads_by_peak, _split, block_program
# The other writers (a traced module's run, a pipeline stage, a checkpoint save) live in their own modules
# above the shared pieces (trace_events.py, block_trace.py); importers of alloc_trace keep finding them here.
from .checkpoint_trace import CHECKPOINT_REPLAY_MODES, CHECKPOINT_REPLAY_STRATEGIES, checkpoint_events  # noqa: F401
from .comm import DDP_BUCKET_CAP_MB, bucket_sizes, ready_order_sizes
from .config import TrainConfig
from .construction_trace import _construction_events
from .logged_trace import (LOGGED_FAMILIES, LOGGED_FSDP1, LOGGED_FSDP2, LOGGED_OPTIMIZERS,  # noqa: F401
                           _built_and_cast, logged_fsdp1_events, logged_fsdp2_events, logged_step_events)
from .model import unit_sizes
from .stage_trace import (STAGE_FAMILIES, _stage_reserved_peak, _stage_reserved_peak_within,  # noqa: F401
                          stage_allocation_events, stage_reserved_peak, stage_reserved_peak_within)
from .state_layout import layout
from .strategies import FSDP1, FSDP2, REGISTRY, get_strategy
from .trace_events import (MEASURED_STEPS, WARMUP_STEPS, _adam_temporaries, _broadcast_coalesced,  # noqa: F401
                           _collector_paused, _Events, _fsdp2_construct, _fsdp2_copy_out, _fsdp2_gather,
                           _fsdp2_post_backward, _fsdp2_unshard, _logged_optimizer_step)

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
    st = get_strategy(strategy)
    family = st.family
    m = train.model
    prec = train.prec
    regime = regime_for(train, family)
    act = activations_in(train, regime, device)
    lay = layout(m, family, shard, st.shards_params, st.shards_optimizer)
    L = m.layers
    n = train.micro_batch * train.seq_len
    t = train.tp
    v = -(-m.vocab // t)  # one tensor-parallel rank's vocabulary (loss parallel: logits sharded over it)
    pb, gb, cb = prec.param_bytes, prec.grad_bytes, prec.compute_bytes
    r = 4 if regime in ("fp32", "autocast") else 2
    e = 4 if regime == "fp32" else 2
    root_shapes, block_shapes, _, _, _ = unit_sizes(m)
    n_embed = 1 + (m.position == "learned")
    embed_shapes, head_shapes = root_shapes[:n_embed], root_shapes[n_embed:]
    sharding = shard > 1 and st.shards_params
    fsdp = st.fsdp
    ud = (cb if prec.mixed else pb) if fsdp else pb  # unsharded parameter / gradient dtype
    rb = 4 if prec.mixed else gb  # FSDP reduce dtype
    ckpt = train.checkpointing != "none"
    A, every = train.grad_accum, train.sync_every
    E = _Events()

    # -- construction -------------------------------------------------------------------------------
    buckets, state_sizes, owned = _construction_events(E, train, st, world, shard, lay, init)
    E.a(train.micro_batch * train.seq_len * 8), E.a(train.micro_batch * train.seq_len * 8)  # ids, targets

    # -- one step -------------------------------------------------------------------------------------
    listed = _block_saved_shapes(train, regime, n, device)
    blk_saved = _split(act.per_block, listed)
    rest = 1 if len(blk_saved) > len(listed) else 0  # `_split`'s last entry: what the list leaves out
    kept = act.kept_each  # per block through forward (checkpointing: its input)
    kept_saved = blk_saved if not ckpt else _split(kept, [n * m.hidden * r])
    if act.every:  # every-K: blocks 0, K, 2K, ... keep their input, the others all they save
        kept_saved = _split(act.ckpt_kept, [n * m.hidden * r])

    def ck(j: int) -> bool:
        return j % act.every == 0 if act.every else ckpt

    def kept_by(j: int) -> list:
        return kept_saved if ck(j) else blk_saved
    blk_peak = _block_backward_peak(train, regime, n, device)
    blk_tmp = blk_peak[1]
    tmp_shapes = _split(blk_tmp, [n * m.hidden * r] + [n * m.ffn_hidden * e] * 3)
    early = _grads_by_peak(block_shapes, blk_peak[2])
    # A checkpointed block's recomputation saves what its forward saved, but its first norm's saved input is the
    # kept block input itself, not a new tensor (activations_in's `recompute_block`)
    rec_saved = blk_saved[1:] if m.hf_model_type and (m.norm == "layernorm" or regime != "lowp") else blk_saved
    weight_casts = [prod(s) * 2 for s in block_shapes if len(s) == 2] if regime == "autocast" else []
    cast_sizes = tuple(weight_casts)
    head_cast = [prod(s) * 2 for s in head_shapes if len(s) == 2] if regime == "autocast" else []
    outside = act.outside - act.inputs
    final_norm = (_norm_parts(train, regime, n, 1, device) if not m.sandwich_norms and t == 1
                  and not train.sequence_parallel and (m.norm == "rmsnorm" or not m.hf_model_type) else [])
    if sum(final_norm) > outside or len(final_norm) < 4:
        final_norm = []
    # The forward op by op (block_program) where every block and the final norm are written so: each block reads
    # the one before's output (the embedding's for block 0), which its first norm saves (fp32 hidden states) or
    # a checkpointed block keeps, and recomputes the same way in backward; else a block's saved tensors as one
    # burst (selective checkpointing among them: its forward saves some of them)
    no_grad = train.checkpointing == "full" or bool(act.every)
    fwd_ops = block_program(train, regime, n, device) if no_grad else None
    grad_ops = block_program(train, regime, n, device, True)
    carry = (bool(final_norm) and grad_ops is not None and (fwd_ops is not None if ckpt else True)
             and kept_saved[0] == n * m.hidden * r)
    if not carry:
        fwd_ops = grad_ops = None
    # nll_loss_backward's dense gradient + log_softmax_backward's output; loss parallel's fused backward
    # holds three (memory.estimate_memory's `loss_bwd_tmp`)
    loss_tmp = [n * v * 4] * (3 if t > 1 else 2)
    # Tensor parallelism (tp.py): each rowwise Linear's output (attention, MLP) is a partial sum that
    # DTensor's redistribution reduces into a new tensor (functional all_reduce; reduce_scatter to the
    # rank's tokens with sequence parallelism), the partial freed after it; backward does the same for
    # the gradient of the colwise Linears' input (the two norms' outputs). Allocated on the caller's
    # stream. (The all-gathered inputs that the colwise Linears save are in the block's saved bytes.)
    nt = sp_tokens(train, n)
    # (the vocabulary-sharded embedding's gradient is a Replicate DTensor of the whole vocabulary,
    # memory.estimate_memory's `emb_full`)
    emb_shapes = ([(m.vocab,) + tuple(embed_shapes[0][1:])] + list(embed_shapes[1:])) if t > 1 else list(embed_shapes)
    tp_pairs = [(n * m.hidden * e, nt * m.hidden * e)] * 2 if t > 1 else []
    states: list = []
    grads: list = []
    bucket_rebuilt = [False]

    def unshard_flat(u_shapes):
        return _fsdp2_gather(E, u_shapes, shard, ud, prec.mixed)

    def unshard(u_shapes):
        return _fsdp2_unshard(E, u_shapes, shard, ud, prec.mixed)

    def tp_reduce():
        for partial, out in tp_pairs:
            a = E.a(partial)
            b = E.a(out)
            E.f(a, b)

    def fsdp1_unshard(elems_shard):
        """`_unshard`: the low-precision shard (`_use_low_precision_shard`, on the pre-unshard stream) under
        mixed precision; sharded, the padded unsharded flat parameter on the unshard stream, the shard freed
        (`post_unshard`); NO_SHARD does not unshard (`needs_unshard`): the low-precision copy is the
        unsharded parameter until the reshard frees it."""
        mp = E.a(elems_shard * cb, 3) if prec.mixed else None
        if not sharding:
            return mp
        flat = E.a(elems_shard * shard * ud, 1)
        E.f(mp)
        return flat

    def fsdp1_reduce(u, view_grads, unsharded, elems, elems_shard, sync, keep):
        """A unit's backward end: the views' gradients concatenated into the flat gradient, then
        `_post_backward_hook` (on the post-backward stream): reshard, the cast to reduce_dtype under
        mixed precision, `_reduce_grad`'s output shard (reduce-scatter), or the all-reduced flat gradient
        (NO_SHARD). The tensor a collective reads goes to that stream's pool (allocator.comm_streams).
        Accumulation: a later micro-step's flat gradient is added in place to the kept one (AccumulateGrad)
        and freed; without sync (`_post_backward_hook` returns early) the unsharded flat gradient is kept
        in param_dtype, and SHARD_GRAD_OP keeps the unit unsharded (`_should_free_in_backward`); synced
        every micro-step, the new shard is added to `_saved_grad_shard` (`_accumulate_sharded_grad`)."""
        comm = world > 1
        # The flat gradient (the reduction reads it, or the one kept since the first micro-step): made by the
        # backward of the views `_use_unsharded_views` takes inside `_unshard`'s unshard-stream context, and
        # CUDA autograd runs a backward op on its forward op's stream: the unshard stream's pool
        flat_g = E.a(elems * ud, 1)
        E.f(*view_grads)
        if u in acc:  # added to the unsharded gradient kept by earlier micro-steps (without sync)
            E.f(flat_g)
            flat_g = acc.pop(u)
        if not sync:
            acc[u] = flat_g
            if not keep:
                E.f(unsharded)
            return unsharded if keep else None
        E.f(unsharded)
        src = flat_g
        if prec.mixed:
            src = E.a(elems * rb, 2 if comm else 0)
            E.f(flat_g)
        if sharding:
            out = E.a(elems_shard * rb, 2)
            E.f(src)
            if u in saved:  # `_saved_grad_shard += sharded_grad`
                E.f(out)
            else:
                saved[u] = out
                grads.append(out)
        elif u in saved:  # NO_SHARD synced every micro-step: added to the kept gradient
            E.f(src)
        else:
            saved[u] = src
            grads.append(src)
        return None

    acc: dict = {}  # unit -> gradient kept unsharded between micro-steps without sync
    saved: dict = {}  # unit -> gradient kept (sharded when synced) for this step's later micro-steps
    kept_unsharded: dict = {}  # FSDP1 SHARD_GRAD_OP without sync: units left unsharded between micro-steps

    def micro_step(k: int):
        """Micro-step k of grad_accum: gradients made on the first are kept (or reduced and kept as
        shards); later ones add theirs into those (memory.estimate_memory's `carry`)."""
        sync = every or k == A - 1
        first = k == 0
        held: dict = dict(kept_unsharded)
        kept_unsharded.clear()
        keep = family == FSDP1 and not st.reshard_after_forward and not sync
        in_place = not fsdp or (family == FSDP2 and not prec.mixed)  # AccumulateGrad adds into .grad
        # the tied weight's gradients at the root's backward: of the parameter itself (single, DDP, ZeRO-1),
        # FSDP2's unsharded parameter or FSDP1's view of its flat parameter
        tied = m.tie_embeddings and t == 1
        tied_b = (ud if fsdp else gb)  # their dtype: FSDP's unsharded gradients are in param_dtype

        def new_grads(u, shapes):
            """The unit's new gradients; where a kept .grad takes them in place (AccumulateGrad:
            `variable_grad += new_grad`), each is freed as soon as it is added."""
            if not first and in_place and (u in acc or not fsdp):
                for s in shapes:  # each weight gradient is added as its Linear's backward makes it
                    E.f(E.a(prod(s) * (ud if fsdp else gb)))
                return []
            return [E.a(prod(s) * (ud if fsdp else gb)) for s in shapes]

        def keep_grads(u, g):
            if first:
                grads.extend(g)
            else:  # (FSDP2 on one rank: added into the kept .grad)
                E.f(*g)

        def fsdp2_post(u, g, params, rs_kept, unsharded, sharded):
            return _fsdp2_post_backward(E, u, g, params, rs_kept, unsharded, sharded,
                                        block_shapes if u != "root" else list(head_shapes) + emb_shapes,
                                        sync=sync, reshard=True, mixed=prec.mixed, rb=rb, acc=acc, saved=saved,
                                        grads=grads)
        # forward
        if buckets and not bucket_rebuilt[0] and states:
            E.f(*buckets)
            buckets[:] = [E.a(b) for b in bucket_sizes(ready_order_sizes(m, regime == "autocast"), gb,
                                                        DDP_BUCKET_CAP_MB)]
            bucket_rebuilt[0] = True
        if family == FSDP2 and sharding:
            held["root"] = unshard(root_shapes)
            prev_flat = held["root"][0]
        elif family == FSDP1 and (sharding or prec.mixed) and "root" not in held:
            held["root"] = fsdp1_unshard(lay.shard_root)
        out_emb = E.a(n * m.hidden * r)
        cur = out_emb  # the hidden states (written op by op: `carry`)
        saved_sizes: dict = {}  # block -> the bytes of what it saved (written op by op)
        # what the blocks share (RoPE tables; eager attention's masks that checkpointed blocks keep), to the
        # end of block 0's backward
        shared = E.a(act.shared) if act.shared and L else None
        blocks: list = []
        # autocast's cache (aten/src/ATen/autocast_mode.cpp `cached_cast`: the 16-bit cast of a leaf that
        # requires grad is kept for the whole autocast region): a checkpointed block saves none of its
        # weights' casts, yet they stay alive until the region exits after the loss (`clear_cache` when
        # torch.autocast's __exit__ takes the nesting to 0; memory.py counts them as `weight_cache_forward`)
        cached: list = []
        for j in range(L):
            if family == FSDP2 and sharding:
                flat, params = unshard(block_shapes)
                E.f(prev_flat)
                prev_flat = flat
                held[j] = params
            elif family == FSDP1 and (sharding or prec.mixed) and j not in held:
                held[j] = fsdp1_unshard(lay.shard_block)
            if carry:  # op by op; a checkpointed block runs without saving and keeps its input
                template, count, out_i, saved_i, saved_b, cast_i, _ = _compiled(
                    fwd_ops if ck(j) else grad_ops, cast_sizes, n * m.hidden * r)
                base = E.put(template, count, cur)
                casts_kept = [base + i for i in cast_i]
                if ck(j):
                    cached.extend(casts_kept)
                    blocks.append(([cur] + [E.a(s) for s in kept_saved[1:]], []))
                else:
                    blocks.append(([base + i if i else cur for i in saved_i], casts_kept))
                    saved_sizes[j] = list(saved_b)
                cur = base + out_i
            else:
                casts = [E.a(c) for c in weight_casts]
                if ck(j):  # the block runs without saving (one burst), then keeps its input
                    tr = [E.a(s) for s in blk_saved]
                    E.f(*tr)
                    casts_kept = []
                    cached.extend(casts)
                else:
                    casts_kept = casts
                blocks.append(([E.a(s) for s in kept_by(j)], casts_kept))
            tp_reduce()
            # resharded after forward: FULL_SHARD / zero3; NO_SHARD under mixed precision frees its 16-bit
            # copy (`_runtime_utils._post_forward` -> `_reshard` -> `handle.post_reshard`)
            no_shard_mp = family == FSDP1 and not sharding and prec.mixed
            if ((st.reshard_after_forward and sharding) or no_shard_mp) and j in held:
                E.f(*(held.pop(j) if family == FSDP2 else [held.pop(j)]))
        # the final norm and the LM head's input (activations.ActivationBreakdown.outside): an RMSNorm's saved
        # tensors one by one in the order its forward makes them (`pow`'s output and, in lowp, the fp32 x * rstd
        # are transients), then under autocast the head's cached weight cast and its cast of the input
        if final_norm and m.norm == "layernorm":  # its input (the last block's output), its output, mean, rstd
            head_saved = [cur if carry else E.a(final_norm[0])]
            out_n = E.a(final_norm[3]) if regime != "autocast" else E.a(n * m.hidden * 4)
            head_saved += [E.a(final_norm[1]), E.a(final_norm[2])]
            hc = [E.a(c) for c in head_cast]
            if regime == "autocast":  # the head saves its 16-bit cast of the fp32 output
                head_saved += [E.a(x) for x in final_norm[3:]]
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
            if regime != "autocast":  # the norm's output, which the head saves
                head_saved += [E.a(x) for x in final_norm[3:]]
            if carry and r != 4:
                E.f(cur)  # the 16-bit hidden states (the recorded CPU traces drop them here)
            E.f(xr)  # a local to the norm's return
            hc = [E.a(c) for c in head_cast]
            if regime == "autocast":  # the head's 16-bit cast of its input, after its weight's
                head_saved += [E.a(x) for x in final_norm[3:]]
            if outside > sum(final_norm):
                head_saved.append(E.a(outside - sum(final_norm)))
        else:
            hc = [E.a(c) for c in head_cast]
            head_saved = [E.a(outside)]
        # The loss as transformers' ForCausalLMLoss (loss/loss_utils.py) and the reference decoder compute it:
        # 16-bit logits are upcast (`logits.float()`, a new n x V fp32 tensor alive beside log_softmax's
        # output, then dropped); in backward the logits' fp32 gradient is cast back (ToCopyBackward, n x V in
        # the logits' dtype) before the head's matmul backward reads it (the recorded CPU traces' order).
        # The walk counts both (activations `logits_transient`, memory `loss_bwd_tmp`).
        upcast = cb != 4 and t == 1
        logits = E.a(n * v * cb)
        up = E.a(n * v * 4) if upcast else None
        logp = E.a(act.loss_saved)
        E.f(up)  # the loss function's upcast, a local of ForCausalLMLoss
        if family == FSDP2 and sharding:
            # the last block's all-gather output is kept for the copy-out's overlap with a next all-gather
            # (`comm_ctx.all_gather_state`) until the root's `_post_forward` frees it, the loss computed inside
            # the model's forward (transformers' and the reference decoder's); the logits are the output's,
            # dropped after (the recorded CPU traces' order)
            E.f(prev_flat)
        E.f(logits)
        E.f(*cached)  # the autocast region exits with the loss computed
        pending: dict = {}  # FSDP2: prefetched all-gather outputs not yet copied out
        if family == FSDP2 and sharding and L and L - 1 not in held:
            # backward begins at the root's pre-backward hook on the loss (`FSDPState._pre_backward`), whose
            # `_backward_prefetch` all-gathers the unit before it in post-forward order, the last block, before
            # the loss's and the head's backward run (their n x V tensors beside it)
            pending[L - 1] = unshard_flat(block_shapes)
        elif family == FSDP1 and (sharding or prec.mixed) and L and L - 1 not in held:
            # FSDP1 the same: the root handle's `_pre_backward_hook` on the loss, then `_prefetch_handle`
            # (BACKWARD_PRE) unshards the handle before it in post-forward order, the last block's
            # (`_exec_order_utils.py` get_handle_to_backward_prefetch)
            held[L - 1] = fsdp1_unshard(lay.shard_block)
        # backward: the loss and the head
        lt = [E.a(x) for x in loss_tmp]
        E.f(*lt[:-1], logp)
        grad_logits = lt[-1]
        if upcast:
            grad_logits = E.a(n * v * cb)
            E.f(lt[-1])
        done = [grad_logits, *hc, *head_saved]  # freed when the head's matmul backward node has run
        if regime == "autocast" and t == 1:
            # fp32 parameters under autocast: the head's matmul backward makes its weight's gradient in 16 bits
            # (the matmul ran on the weight's cast), its node then drops what it saved and the logits'
            # gradient, and the cast's backward (ToCopyBackward) makes the fp32 gradient, the 16-bit one freed
            # after (the H100's recorded events; memory.py's `w_head` instant)
            w16 = [E.a(prod(s) * 2) for s in head_shapes if len(s) == 2]
            E.f(*done)
            done = w16
        head_g = new_grads("root", head_shapes)
        # A tied weight (the parameter, FSDP2's unsharded parameter, FSDP1's view): the head's matmul backward
        # makes its gradient beside the logits' gradient it reads (the recorded traces' order), and autograd holds
        # it in the weight's input buffer through every block's backward, until the embedding's arrives (below)
        tied_g = E.a(v * m.hidden * tied_b) if tied and carry else None
        E.f(*done)
        if tied and not carry:
            tied_g = E.a(v * m.hidden * tied_b)
        rs_kept = None

        def fsdp2_ready(j):
            """`wait_for_unshard` in pre_backward: copy out the (prefetched) all-gather output."""
            if j in held or j < 0:
                return
            flat = pending.pop(j, None)
            if flat is None:
                flat = unshard_flat(block_shapes)
            held[j] = _fsdp2_copy_out(E, block_shapes, shard, ud)
            E.f(flat)

        for j in reversed(range(L)):
            # pre_backward: this block unsharded (or still so from forward), then `_backward_prefetch`
            # issues the next one's all-gather (BACKWARD_PRE for FSDP1)
            if family == FSDP2 and sharding:
                fsdp2_ready(j)
                if j > 0 and j - 1 not in held and j - 1 not in pending:
                    pending[j - 1] = unshard_flat(block_shapes)
            elif family == FSDP1 and (sharding or prec.mixed):
                for k in (j, j - 1):
                    if k >= 0 and k not in held:
                        held[k] = fsdp1_unshard(lay.shard_block)
            keys, casts = blocks[j]
            if t > 1:
                # tensor parallelism: the block's backward as one burst (its recorded CPU runs agree better so:
                # single at tp 2, 0.2% against 2.6% written in phases as below)
                if ck(j):
                    casts = [E.a(c) for c in weight_casts]
                    E.f(*keys)
                    keys = [E.a(s) for s in blk_saved]
                tp_reduce()
                tmp = [E.a(s) for s in tmp_shapes]
                g = new_grads(j, block_shapes)
                E.f(*keys, *casts, *tmp)
            else:
                sizes = saved_sizes.get(j) or kept_by(j)
                rest_j = 0 if j in saved_sizes else rest
                if ck(j) and carry:  # recomputed op by op beside its kept input, to the early stop
                    template, count, _, saved_i, saved_b, cast_i, unwind = _compiled(
                        grad_ops, cast_sizes, n * m.hidden * r, True)
                    base = E.put(template, count, keys[0])
                    E.f(*(base + i for i in unwind))
                    casts = [base + i for i in cast_i]
                    keys = keys + [base + i for i in saved_i if i]
                    sizes = sizes + [b for i, b in zip(saved_i, saved_b) if i]
                elif ck(j):  # recomputed next to its kept input, which the checkpoint holds to the block's end
                    rest_j = rest
                    casts = [E.a(c) for c in weight_casts]
                    keys = keys + [E.a(s) for s in rec_saved]
                    sizes = sizes + rec_saved
                # The block's backward runs from its end: by its peak (memory._block_backward_peak) the ops there
                # have consumed their saved tensors (the last ones forward made: the MLP's product) and made their
                # transients and those Linears' weight gradients; then the rest of its gradients, and the saved
                # tensors go
                cut = _consumed(sizes, blk_peak[0], rest_j)
                E.f(*keys[cut:len(keys) - rest_j])
                tmp = [E.a(s) for s in tmp_shapes]
                g_early = new_grads(j, [block_shapes[i] for i in early])
                E.f(*tmp)
                late = [i for i in range(len(block_shapes)) if i not in early]
                g_late = new_grads(j, [block_shapes[i] for i in late])
                order = dict(zip(early + late, g_early + g_late))
                g = [order[i] for i in sorted(order)]
                E.f(*keys[:cut], *keys[len(keys) - rest_j:], *casts)
            if family == FSDP2 and sharding:
                rs_kept = fsdp2_post(j, g, held.pop(j), rs_kept, lay.unshard_block, lay.shard_block)
            elif family == FSDP1:
                u = fsdp1_reduce(j, g, held.pop(j, None), lay.unshard_block, lay.shard_block, sync, keep)
                if u is not None:
                    kept_unsharded[j] = u
            else:
                keep_grads(j, g)
        if shared is not None:
            E.f(shared)
        # the embedding's gradient and the root
        if tied:
            # embedding_dense_backward's gradient and its sum with the head's (input_buffer.cpp `accumulate`:
            # `old_var + var`, a new tensor, as the recorded traces show), both addends then freed: three
            # vocab x hidden gradients at once; the sum is the weight's gradient (or, in a later micro-step,
            # added into .grad and freed)
            addend = E.a(prod(emb_shapes[0]) * tied_b)
            total = E.a(prod(emb_shapes[0]) * tied_b)
            E.f(tied_g, addend)
            emb_g = [total] + new_grads("root", emb_shapes[1:])
            if not first and in_place and ("root" in acc or not fsdp):  # as new_grads
                E.f(*emb_g)
                emb_g = []
        else:
            emb_g = new_grads("root", emb_shapes)
        if not carry:  # (else block 0's input, freed with it)
            E.f(out_emb)
        if family == FSDP2 and sharding:
            E.f(fsdp2_post("root", head_g + emb_g, held.pop("root")[1], rs_kept, lay.unshard_root,
                           lay.shard_root))
        elif family == FSDP1:
            u = fsdp1_reduce("root", head_g + emb_g, held.pop("root", None), lay.unshard_root, lay.shard_root,
                             sync, keep)
            if u is not None:
                kept_unsharded["root"] = u
        else:
            keep_grads("root", head_g + emb_g)
        for k in list(held):
            E.f(*(held.pop(k) if isinstance(held[k], list) else [held.pop(k)]))

    def step():
        # grad_accum micro-steps, then the optimizer. The micro-steps between the second and the last repeat
        # the second's allocations (each frees what it makes but the kept gradients), so the caching
        # allocator is back in the same state after each: the first, the second and the last bound the run
        # (and keep a grad_accum of 2**20 as cheap as 3)
        for k in sorted({0, min(1, A - 1), A - 1}):
            micro_step(k)
        if state_sizes and not states:  # made lazily in the first step (`_init_group`)
            states.extend(E.a(z) for z in state_sizes)
        _adam_temporaries(E, [s * pb for s in owned], train.optimizer, train.optimizer_impl)
        E.f(*grads)
        grads.clear()
        saved.clear()
        assert not acc, "unsynced gradients at the optimizer step"

    first = True
    for _ in range(WARMUP_STEPS + MEASURED_STEPS):
        if first and workspace:
            E.a(workspace)  # the first GEMM's cuBLAS workspace (CublasHandlePool.cpp), kept
        first = False
        step()
    return E.ev


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


