"""The allocations of one pipeline stage's rank under torch.distributed.pipelining
(`stage_allocation_events`: a plain stage, DDP with no_sync until the last micro-batch, FSDP2), and their
reserved peak replayed through the caching allocator (`stage_reserved_peak`, `stage_reserved_peak_within`)."""

from __future__ import annotations

from functools import lru_cache
from math import prod

from .activations import activations_in, regime_for, sp_tokens
from .allocator import alloc_rounding, replay_fit, replay_peaks
from .block_backward import _block_backward_peak
from .block_trace import _block_saved_shapes, _split
from .comm import DDP_BUCKET_CAP_MB, bucket_sizes, ready_order_sizes
from .config import TrainConfig, fsdp2_reduce_keeps_last_grad, pp_recv_buffers_per_receive
from .model import unit_sizes
from .pp_schedule import stage_actions, virtual_stages
from .pp_stage import releases_sent_outputs, stage_train
from .state_layout import _opt_state, layout
from .strategies import DDP, FSDP2, SINGLE, get_strategy
from .trace_events import (_Events, _adam_temporaries, _broadcast_coalesced, _collector_paused, _fsdp2_construct,
                           _fsdp2_post_backward, _fsdp2_unshard)


STAGE_FAMILIES = (SINGLE, DDP, FSDP2)
"""The strategy families whose pipeline stages `stage_allocation_events` writes, those the PP probe runs and
the recorded traces check: a plain stage module, DDP with no_sync until the last micro-batch, FSDP2
(zero2/zero3: `fully_shard` per block and the stage, reshard_after_forward off as torchtitan applies it
with PP, sharded over more than one rank). ZeRO-1 stages keep the margin (pp.PP_STRATEGIES: no FSDP1)."""


def _stage_construction_events(E: _Events, train: TrainConfig, st, m, first: bool, last: bool, world: int,
                               shard: int, lay) -> tuple[list, list, list]:
    """A stage's construction (as allocation_events'): its parameters, DDP's broadcast and first bucket,
    FSDP2's shards, then the batch's token ids (first stage) and targets (last stage). Returns (the elements
    of the parameters or shards this rank owns, DDP's gradient buckets, each optimizer state's bytes)."""
    family = st.family
    fsdp2 = st.fsdp2
    L = m.layers
    n = train.micro_batch * train.seq_len
    M = train.pp_microbatches
    pb, gb = train.prec.param_bytes, train.prec.grad_bytes
    root_shapes, block_shapes, _, _, _ = unit_sizes(m)
    n_embed = (1 + (m.position == "learned")) if first else 0
    embed_shapes, head_shapes = root_shapes[:n_embed], root_shapes[n_embed:]
    units = [list(embed_shapes)] + [list(block_shapes)] * L + [list(head_shapes)]
    full = [[E.a(prod(s) * pb) for s in u] for u in units]
    if fsdp2:
        owned = _fsdp2_construct(E, units, full, shard, pb)
    else:
        owned = [prod(s) for u in units for s in u]
    buckets: list = []
    if family == DDP and world > 1:
        _broadcast_coalesced(E, [prod(x) * pb for u in units for x in u])
        buckets = [E.a(lay.total * gb)]
    st_elems, st_extra = _opt_state(m, train.optimizer, family, shard)
    st_total = st_elems * pb + int(st_extra)
    per_param = 1 if train.optimizer == "sgd-momentum" else 2
    owned_sum = sum(owned) or 1
    state_sizes = [st_total * s // owned_sum // per_param for s in owned for _ in range(per_param)] if st_total else []
    if first:
        E.a(M * n * 8)  # the batch's token ids
    if last:
        E.a(M * n * 8)  # its targets
    return owned, buckets, state_sizes


@_collector_paused
def stage_allocation_events(train: TrainConfig, strategy, stage: int, world: int, shard: int,
                            device: str = "cuda", workspace: int = 0, steps: int = 2) -> list:
    """The events of pipeline stage `stage` (planner/pp.py) over `steps` steps (validate/pp_probe.py: one
    warm-up step and one measured), for the families in STAGE_FAMILIES and one stage per rank
    (GPipe, 1F1B). `world`/`shard`: the stage's data-parallel ranks (DDP, FSDP2) and its shard group (1;
    FSDP2: the ranks its parameters are sharded over, more than one).

    What `torch.distributed.pipelining` allocates (`stage.py`, `schedules.py`), in the order of
    `pp.stage_actions`: in the first step `_prepare_forward_infra` makes one receive buffer per
    micro-batch (not on the first stage) and `_prepare_backward_infra` one gradient buffer per micro-batch
    (not on the last), kept for the run; a forward keeps the micro-batch's saved activations (a
    non-first stage's first block saves the receive buffer, not a new tensor) and its output in
    `fwd_cache` (the last stage: the logits, and the loss's log-probabilities); a backward frees them,
    makes the block transients and the weight gradients (kept from the first micro-batch on, later ones
    added in place: AccumulateGrad) and the input's gradient, which the pending send keeps (GPipe:
    `bwd_sends_to_wait` to the step's end; 1F1B: `bwd_sends`, until the next backward's send). GPipe's
    `fwd_sends_to_wait` keep every output to the step's end.

    FSDP2 (`_fsdp_param_group.py`, `_fsdp_collectives.py`, `_fsdp_param.py`), as the probe and torchtitan
    apply it (`fully_shard` per block, then the stage module: the root, the embedding and/or the final
    norm and head; reshard_after_forward=False): construction as `allocation_events` (each parameter's
    shard, then the full one goes). The first step's `_prepare_forward_infra`/`_prepare_backward_infra`
    infer the shapes with a real forward (and, but on the first stage, a backward to the stage's input) of
    one micro-batch (`_forward_metadata_inference`, `_backward_metadata_inference`): every unit is
    unsharded for it, the backward reshards each block after its own (FSDP's defaults), and
    `_post_metadata_inference_cleanup` reshards the rest. In each step the first micro-batch's forward
    all-gathers the root, then each block before its forward (`foreach_all_gather` on the all-gather
    stream, `foreach_all_gather_copy_out` into the unsharded parameters, the flat output freed after the
    next unit's copy-out); they stay unsharded through the step. Each backward runs under
    `backward_maybe_with_nosync` (set_requires_gradient_sync(False), set_reshard_after_backward(False)):
    the unsharded gradients are kept (`unsharded_accumulated_grad` in reduce_dtype under mixed precision,
    each later micro-batch's 16-bit one added and freed; else `.grad`, added in place). After the last
    backward (and the pending sends) `perform_reduce_grad` runs `post_backward` on the root and then each
    block: reshard, the previous reduce-scatter input dropped, the new one on the reduce-scatter stream,
    the unsharded gradients freed (the unit's last one when `foreach_reduce` returns), the gradient shard;
    the last input goes with `_root_post_backward_final_callback`. The optimizer's states are the shards'.
    zero2 and zero3 are written alike (both reshard_after_forward=False under PP). The recorded traces
    are fp32; mixed precision's upcast accumulation is `allocation_events`' (checked there, without PP)."""
    st = get_strategy(strategy)
    if st.family not in STAGE_FAMILIES or virtual_stages(train.pp_schedule) != 1 or (st.fsdp2 and shard <= 1):
        raise ValueError(f"stage_allocation_events: {st.name} / {train.pp_schedule} / shard {shard}: accepted: "
                         f"{', '.join(STAGE_FAMILIES)} with one stage per rank (fsdp2 sharded over > 1 rank)")
    w = _StageWriter(train, st, stage, world, shard, device)
    for k in range(steps):
        if k == 0 and workspace:
            w.E.a(workspace)
        w.step(k)
    return w.E.ev


class _StageWriter:
    """`stage_allocation_events`' writer: the stage's sizes, its construction (written when made), the events
    so far (`E`) and what lives across micro-batches and steps; one method per phase of the schedule."""

    def __init__(self, train: TrainConfig, st, stage: int, world: int, shard: int, device: str):
        self.train, self.st, self.stage, self.shard = train, st, stage, shard
        self.family, self.fsdp2 = st.family, st.fsdp2
        self.stages, self.microbatches = train.pp, train.pp_microbatches
        self.first, self.last = stage == 0, stage == train.pp - 1
        strain = stage_train(train, stage)
        self.m = m = strain.model
        self.prec = prec = train.prec
        self.regime = regime = regime_for(strain, self.family)
        self.act = act = activations_in(strain, regime, device)
        self.lay = lay = layout(m, self.family, shard, st.shards_params, st.shards_optimizer)
        self.layers = L = m.layers
        self.tokens = n = train.micro_batch * train.seq_len  # tokens in a micro-batch
        self.tp = t = train.tp
        self.vocab_shard = -(-m.vocab // t)  # the head's output columns on this rank
        self.param_bytes, self.grad_bytes = prec.param_bytes, prec.grad_bytes
        # FSDP2's unsharded parameter / gradient dtype (bytes)
        self.unsharded_bytes = prec.compute_bytes if prec.mixed else prec.param_bytes
        self.reduce_bytes = 4 if prec.mixed else prec.grad_bytes  # its reduce dtype (bytes)
        self.resid_bytes = r = 4 if regime in ("fp32", "autocast") else 2
        self.out_bytes = e = 4 if regime == "fp32" else 2
        self.boundary_bytes = sp_tokens(strain, n) * m.hidden * r  # the boundary tensor
        self.root_shapes, self.block_shapes, _, _, _ = unit_sizes(m)
        n_embed = (1 + (m.position == "learned")) if self.first else 0
        self.embed_shapes, self.head_shapes = self.root_shapes[:n_embed], self.root_shapes[n_embed:]
        self.ckpt = train.checkpointing != "none"
        self.per_receive = pp_recv_buffers_per_receive(train)  # torch >= 2.15: buffers made per receive
        # outputs dropped once sent
        self.releasable = self.per_receive and releases_sent_outputs(self.family, self.last)
        self.E = _Events()

        # -- construction: the stage's parameters; DDP's broadcast and first bucket, FSDP2's shards (as
        # allocation_events)
        self.owned, self.buckets, self.state_sizes = _stage_construction_events(self.E, train, st, m, self.first,
                                                                                self.last, world, shard, lay)

        # a block's saved tensors and its backward's temporaries, bytes each
        self.block_saved_bytes = _split(act.per_block, _block_saved_shapes(strain, regime, n, device))
        kept = act.blocks_total // L if L else 0
        self.kept_saved_bytes = self.block_saved_bytes if not self.ckpt else _split(kept, [n * m.hidden * r])
        _, blk_tmp, _ = _block_backward_peak(strain, regime, n, device)
        self.block_temp_bytes = _split(blk_tmp, [n * m.hidden * r] + [n * m.ffn_hidden // t * e] * 3)
        self.states: list = []
        self.grads: list = []
        self.recv: list = []
        self.held: dict = {}  # FSDP2: unit ("root" or block j) -> its unsharded parameters
        self.acc: dict = {}  # FSDP2: unit -> its unsharded gradients, kept through the step's micro-batches

    def accumulate(self, shapes, i: int):
        """Weight gradients: kept from the first micro-batch on; later ones added in place (AccumulateGrad),
        each freed as its Linear's backward makes it."""
        E = self.E
        for s in shapes:
            g = E.a(prod(s) * self.grad_bytes)
            if i == 0:
                self.grads.append(g)
            else:
                E.f(g)

    def new_grads(self, u, shapes) -> list:
        """FSDP2: unit u's new unsharded gradients; where the kept .grad takes them in place (fp32 / pure
        16-bit: AccumulateGrad), each is freed as its Linear's backward makes it."""
        E, ud = self.E, self.unsharded_bytes
        if u in self.acc and not self.prec.mixed:
            for s in shapes:
                E.f(E.a(prod(s) * ud))
            return []
        return [E.a(prod(s) * ud) for s in shapes]

    def post_backward(self, u, g, sync: bool, rs_kept=None):
        lay, held = self.lay, self.held
        unsharded, sharded, shapes = ((lay.unshard_root, lay.shard_root, self.root_shapes) if u == "root"
                                      else (lay.unshard_block, lay.shard_block, self.block_shapes))
        return _fsdp2_post_backward(self.E, u, g, held.pop(u, []) if sync else held.get(u, []), rs_kept, unsharded,
                                    sharded, shapes, sync=sync, reshard=sync, mixed=self.prec.mixed,
                                    rb=self.reduce_bytes, acc=self.acc, saved={}, grads=self.grads,
                                    last_grad_late=fsdp2_reduce_keeps_last_grad(self.train))

    def gather(self, u, shapes, prev):
        """FSDP2 pre_forward: unit u all-gathered and copied out unless it is unsharded; the previous
        unit's all-gather output goes after the copy-out. Returns the all-gather output now held."""
        if not self.fsdp2 or u in self.held or not shapes:
            return prev
        flat, self.held[u] = _fsdp2_unshard(self.E, shapes, self.shard, self.unsharded_bytes, self.prec.mixed)
        self.E.f(prev)
        return flat

    def forward(self):
        """One micro-batch's forward: (embedding output, each block's saved tensors, the head's), and the
        stage output (not on the last stage)."""
        E, first, r, act = self.E, self.first, self.resid_bytes, self.act
        blk_saved = self.block_saved_bytes
        ag = self.gather("root", self.root_shapes, None)
        # The embedding's output (sequence-sharded with SP: torchtitan's RowwiseParallel(output_layouts=
        # Shard(1)) on the embedding) is block 0's input, as the receive buffer is on a later stage: what
        # checkpointing keeps of block 0, and in fp32/autocast the tensor the first norm's x.float() saves.
        # In 16-bit the norm saves a new fp32 copy and the output is dropped after block 0.
        emb = E.a(self.boundary_bytes) if first else None
        blocks = []
        for j in range(self.layers):
            ag = self.gather(j, self.block_shapes, ag)
            # checkpointed: run without saving, keep the block's input (the receive buffer or the embedding's output)
            if self.ckpt:
                E.f(*[E.a(s) for s in blk_saved])
                shapes = self.kept_saved_bytes if j else []
            else:
                shapes = blk_saved if (j or (first and r == 2)) else blk_saved[1:]
            blocks.append([E.a(s) for s in shapes])
            if j == 0 and first and r == 2 and not self.ckpt:
                E.f(emb)
                emb = None
        E.f(ag)
        head = []
        if self.last:
            head.append(E.a(act.outside - act.inputs))  # final norm, the head's input
            head.append(E.a(self.tokens * self.vocab_shard * self.out_bytes))  # the logits, kept in fwd_cache
            head.append(E.a(act.loss_saved))  # log_softmax's output
        # the stage output, in fwd_cache and the send
        return (emb, blocks, head), (None if self.last else E.a(self.boundary_bytes))

    def block_backward(self, j, blocks, grads_of):
        E = self.E
        rec = []
        if self.ckpt:  # recomputed: everything but its kept input
            rec = [E.a(s) for s in self.block_saved_bytes[1:]]
        tmp = [E.a(s) for s in self.block_temp_bytes]
        g = grads_of(j)
        E.f(*tmp, *rec, *blocks[j])
        return g

    def loss_grads(self) -> list:
        """The last stage's loss backward: the fp32 logits-sized gradients (three with TP)."""
        return [self.E.a(self.tokens * self.vocab_shard * 4) for _ in range(3 if self.tp > 1 else 2)]

    def metadata_inference(self):
        """FSDP2, first step: the shape inference's real forward of one micro-batch (every unit unsharded),
        the backward to the input on a non-first stage (each block resharded after its backward, then the
        root), the receive buffers, then `_post_metadata_inference_cleanup`'s reshard."""
        E, first, last, nh, M, held = self.E, self.first, self.last, self.boundary_bytes, self.microbatches, self.held
        x = None if first else E.a(nh)  # the inferred input (an empty tensor)
        (emb, blocks, head), out = self.forward()
        if not first and not self.per_receive:
            self.recv.extend(E.a(nh) for _ in range(M))
        if not first:
            lt = self.loss_grads() if last else []
            E.f(*lt[:-1])
            E.f(*lt[-1:], *head[::2])  # (the logits stay in the inference's outputs until the cleanup)
            for j in reversed(range(self.layers)):
                self.block_backward(j, blocks, lambda j: [])
                E.f(*held.pop(j))
            E.f(*held.pop("root", []))
            gi = E.a(nh)  # the input's gradient
            E.f(gi)
        else:
            for j in reversed(range(self.layers)):
                E.f(*blocks[j])
        E.f(emb, out, x, *head[1:2])
        if not last and not self.per_receive:
            self.recv.extend(E.a(nh) for _ in range(M))
        for u in list(held):
            E.f(*held.pop(u))

    def step(self, k_step: int):
        """One training step: the first step's buffers, the schedule's forwards and backwards, FSDP2's
        gradient reduction, the optimizer step."""
        self.step_buffers(k_step)
        self.saved: dict = {}
        self.outs: dict = {}
        self.sends: list = []
        self.inputs: dict = {}  # torch >= 2.15: micro-batch -> its received activation
        self.grad_in = None
        for kind, i in stage_actions(self.train.pp_schedule, self.stages, self.microbatches, self.stage):
            if kind == "F":
                self.forward_action(i)
            else:
                self.backward_action(i)
        if self.fsdp2:  # perform_reduce_grad: the root's post_backward, then the blocks'
            rs = None
            for u in (["root"] if self.root_shapes else []) + list(range(self.layers)):
                rs = self.post_backward(u, [], sync=True, rs_kept=rs)
            self.E.f(rs)  # _root_post_backward_final_callback
        self.optimizer_step()

    def step_buffers(self, k_step: int):
        """The buffers a step makes before its first action: in the first, FSDP2's metadata inference or the
        receive / gradient buffers; in the second, DDP's rebuilt buckets."""
        E, first, last = self.E, self.first, self.last
        if self.fsdp2 and k_step == 0:
            self.metadata_inference()
        elif k_step == 0 and not self.per_receive:  # _prepare_forward_infra / _prepare_backward_infra, first step
            self.recv.extend(E.a(self.boundary_bytes) for _ in range(self.microbatches * ((not first) + (not last))))
        if self.buckets and k_step == 1:  # DDP's rebuild in the second step's first forward
            E.f(*self.buckets)
            self.buckets[:] = [E.a(b) for b in bucket_sizes(ready_order_sizes(self.m, self.regime == "autocast"),
                                                             self.grad_bytes, DDP_BUCKET_CAP_MB)]

    def forward_action(self, i: int):
        """The schedule's forward of micro-batch i."""
        E, outs = self.E, self.outs
        if self.per_receive and not self.first:
            self.inputs[i] = E.a(self.boundary_bytes)
        self.saved[i], out = self.forward()
        if out is not None:
            outs[i] = out
        if self.releasable and self.train.pp_schedule != "gpipe":  # 1F1B's warm-up: the previous forward's
            # send waited for and released
            E.f(*[outs.pop(j) for j in list(outs) if j < i])

    def backward_action(self, i: int):
        """The schedule's backward of micro-batch i: the head's (last stage), each block's, the embedding's
        (first stage) or the input's gradient."""
        E, outs, gpipe, fsdp2 = self.E, self.outs, self.train.pp_schedule == "gpipe", self.fsdp2
        if self.releasable:  # every forward send waited for and released before a backward (GPipe: before
            # its backward loop; 1F1B: fused with this backward's receive, its buffer made first)
            if not gpipe:
                self.grad_in = E.a(self.boundary_bytes)
            E.f(*outs.values())
            outs.clear()
        if self.per_receive and not self.last and self.grad_in is None:
            self.grad_in = E.a(self.boundary_bytes)
        emb, blocks, head = self.saved.pop(i)
        head_g = self.head_backward(i, head) if self.last else []
        if not gpipe:
            E.f(outs.pop(i, None))
        for j in reversed(range(self.layers)):
            if fsdp2:
                g = self.block_backward(j, blocks, lambda j: self.new_grads(j, self.block_shapes))
                self.post_backward(j, g, sync=False)
            else:
                self.block_backward(j, blocks, lambda j: self.accumulate(self.block_shapes, i))
        E.f(emb)
        emb_g: list = []
        if self.first:
            if fsdp2:
                emb_g = self.new_grads("root", self.embed_shapes)
            else:
                self.accumulate(self.embed_shapes, i)
        else:
            gi = E.a(self.boundary_bytes)  # the input's gradient, kept by its send
            if not gpipe:
                E.f(*self.sends)
                self.sends.clear()
            self.sends.append(gi)
        if self.per_receive:  # the gradient buffer goes with its backward, and so does a middle stage's input
            E.f(self.grad_in, None if self.last else self.inputs.pop(i, None))
            self.grad_in = None
        if fsdp2 and self.root_shapes:  # (its gradients in parameter order: the embedding's, the head's)
            self.post_backward("root", emb_g + head_g, sync=False)

    def head_backward(self, i: int, head: list) -> list:
        """The last stage's loss and head backward of micro-batch i: FSDP2's new head gradients."""
        E = self.E
        head_g: list = []
        lt = self.loss_grads()
        # log_softmax's saved output goes with its backward node, before the head's matmul backward
        # makes the weight gradient (as in allocation_events); the logits' gradient lives through it
        E.f(*lt[:-1], head[2])
        if self.fsdp2:
            head_g = self.new_grads("root", self.head_shapes)
        else:
            self.accumulate(self.head_shapes, i)
        E.f(lt[-1], *head[:2])
        return head_g

    def optimizer_step(self):
        """The step's end: the pending sends and outputs freed, the optimizer's states (made in the first
        step), its temporaries, the gradients freed."""
        E = self.E
        E.f(*self.sends, *self.outs.values())
        if self.state_sizes and not self.states:
            self.states.extend(E.a(z) for z in self.state_sizes)
        _adam_temporaries(E, [s * self.param_bytes for s in self.owned], self.train.optimizer,
                          self.train.optimizer_impl)
        E.f(*self.grads)
        self.grads.clear()
        E.f(*self.inputs.values())  # the last stage's: the returned losses' graphs kept them to the step's end
        assert not self.acc and not self.held, "FSDP2: gradients or parameters left unsharded at the optimizer step"


def stage_reserved_peak(train: TrainConfig, strategy, stage: int, world: int, shard: int, device: str = "cuda",
                        workspace: int = 0, expandable_segments: bool = False,
                        max_split_size: int | None = None) -> tuple[int, int]:
    """(reserved peak, allocated peak) of pipeline stage `stage`'s replayed run."""
    return _stage_reserved_peak(train, get_strategy(strategy).name, stage, world, shard, device, workspace,
                                expandable_segments, max_split_size)


@lru_cache(maxsize=256)
def _stage_reserved_peak(train, name, stage, world, shard, device, workspace, expandable_segments,
                         max_split_size):
    return replay_peaks(stage_allocation_events(train, name, stage, world, shard, device, workspace),
                        expandable_segments=expandable_segments, max_split_size=max_split_size,
                        rounding=alloc_rounding(train.alloc_conf))


def stage_reserved_peak_within(limit: int, train: TrainConfig, strategy, stage: int, world: int, shard: int,
                               device: str = "cuda", workspace: int = 0, expandable_segments: bool = False,
                               max_split_size: int | None = None) -> tuple[int, int, int] | None:
    """`reserved_peak_within` for pipeline stage `stage` (`stage_reserved_peak`'s run)."""
    return _stage_reserved_peak_within(limit, train, get_strategy(strategy).name, stage, world, shard, device,
                                       workspace, expandable_segments, max_split_size)


@lru_cache(maxsize=256)
def _stage_reserved_peak_within(limit, train, name, stage, world, shard, device, workspace, expandable_segments,
                                max_split_size):
    return replay_fit(stage_allocation_events(train, name, stage, world, shard, device, workspace), limit,
                      expandable_segments=expandable_segments, max_split_size=max_split_size,
                      rounding=alloc_rounding(train.alloc_conf))
