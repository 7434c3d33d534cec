"""The trace front end's memory walk under FSDP (FSDP1's flat parameters and FSDP2's per-parameter
sharding; module_memory.walk_module_memory): `FsdpWalk`, the shared walk (module_walk.ModuleWalk) with the
units' unsharded parameters, their reductions and the gradients carried between micro-steps. Every size is
in bytes."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from .config import fsdp2_first_microstep_grads_in_reduce_dtype, fsdp2_reduce_keeps_last_grad
from .module_walk import ModuleWalk


@dataclass
class SegmentBackward:
    """What one segment's backward (segment k, of unit u) holds, bytes: `in_use` the unit's unsharded
    parameters, `pre` the unsharded parameters prefetched (the unit before), `g_unit` the unit's unsharded
    gradients, `rs` its reduction's input, `grads` the gradients of the units already reduced, `unsharded`
    and `unsharded_before` the unsharded parameters alive after and before the unit's pre-backward hook;
    `prev` the unit before, `done` the units already reached."""
    k: int
    u: str
    in_use: int
    prev: str | None
    pre: int
    g_unit: int
    rs: int
    done: list
    grads: int
    unsharded: int
    unsharded_before: int


class FsdpWalk(ModuleWalk):
    """The walk of FSDP1 and FSDP2: `unsharded_bytes` each unit's unsharded parameters, `held` the units
    unsharded and kept, `carried_grad_bytes` the gradients earlier micro-steps left in the units not yet
    reduced at the instant walked; `unsharded_elem_bytes`, `reduce_elem_bytes`, `shard_grad_elem_bytes`:
    bytes of an element of the unsharded parameters (param_dtype), of the reduction (reduce_dtype) and of
    a gradient shard."""

    def __init__(self, *args):
        super().__init__(*args)
        st, prec, sizes, sharding, later, every_sync = \
            self.st, self.prec, self.sizes, self.sharding, self.later, self.every_sync
        self.unsharded_elem_bytes = udt = self.cb if prec.mixed else self.pb  # param_dtype of the unsharded unit
        self.reduce_elem_bytes = red = 4 if prec.mixed else self.gb  # reduce_dtype
        self.shard_grad_elem_bytes = sg = 4 if prec.mixed else self.gb  # sharded gradient (fp32 under mixed precision)
        self.reshard = st.reshard_after_forward and sharding
        self.shard_params = sum(v[0] for v in sizes.values())
        self.base = dict(params=self.shard_params * self.pb + self.buffers, optimizer=self.optimizer_bytes)
        # FSDP1's BatchNorm units keep fp32 (no mixed precision: `ModuleDesc.fp32_units`); so small they are
        # counted with the shards, not walked (their unsharded parameters and gradients live within their
        # parent unit's segment)
        unit_dt = {u: self.pb if u in self.desc.fp32_units else udt for u in sizes}
        unsh = {u: v[1] * unit_dt[u] for u, v in sizes.items()}
        if not sharding:  # NO_SHARD: only a 16-bit copy of the unit in use under mixed precision
            unsh = {u: (v[1] * self.cb if prec.mixed and u not in self.desc.fp32_units else 0)
                    for u, v in sizes.items()}
        self.unsharded_bytes = unsh
        self.root_unsharded_bytes = unsh.get("root", 0)
        self.order = [s[0] for s in self.segs if s[0] in sizes and s[0] != "root"]
        # Gradient accumulation (memory.estimate_memory's `carry`): what earlier micro-steps left in each
        # unit until the unit reduces on this (the last) micro-step: without sync its unsharded gradient
        # (FSDP1: param_dtype; FSDP2: reduce_dtype), synced every micro-step its shard (sg), NO_SHARD
        # its full flat gradient. FSDP2 in fp32 without sync adds the new gradients in place.
        if not later:
            unit_carry = {}
        elif not sharding:
            unit_carry = {u: v[1] * (red if every_sync else unit_dt[u]) for u, v in sizes.items()}
        elif every_sync:
            unit_carry = {u: v[0] * sg for u, v in sizes.items()}
        elif st.fsdp1:  # the padded flat gradient
            unit_carry = {u: v[1] * unit_dt[u] for u, v in sizes.items()}
        else:
            # FSDP2's are the unsharded parameters' own .grad, of their real shapes
            # (`FSDPParam.to_accumulated_grad_if_needed`), not the dim-0-padded all-gather size (measured:
            # Mixtral's experts at 16 fake ranks, 4 rows padded to 16, accumulating over 2 micro-steps: +62%
            # before)
            unit_carry = {u: self.numel[u] * red for u in sizes}
        self.unit_carry_bytes = unit_carry
        self.in_place = later and not every_sync and sharding and st.fsdp2 and not prec.mixed
        if later:
            self.notes.append("gradient accumulation keeps " + ("sharded" if every_sync and sharding else "unsharded")
                              + " gradients of every unit between micro-steps")
        self.carried_grad_bytes = self.carried(())  # the units that have not reduced yet, at the instant walked
        self.held: list = []  # units unsharded and kept to backward (no reshard)
        # NO_SHARD under mixed precision frees each unit's 16-bit copy when it "reshards" after its forward
        # (`FlatParamHandle.post_reshard` -> `_free_low_precision_sharded_param`) and casts it again for
        # its backward: one unit's copy at a time, as memory.estimate_memory's `held`
        self.one_copy = not sharding and prec.mixed

    def carried(self, reduced) -> int:
        return sum(v for x, v in self.unit_carry_bytes.items() if x not in reduced)

    def snap(self, phase, workspace=0, grads=0, **parts):
        self.record(phase, workspace, grads=grads + (self.carried_grad_bytes if phase != "optimizer" else 0), **parts)

    def walk(self) -> None:
        """The step's forward, backward and optimizer step, instant by instant into `snaps`."""
        self.forward()
        self.backward()
        self.last_microstep_root_instants()
        grads_end = self.shard_params * self.shard_grad_elem_bytes if self.sharding else self.total * self.gb
        self.snap("optimizer", **self.base, grads=grads_end, temporaries=self.optimizer_tmp_bytes)

    def forward(self) -> None:
        """The forward, unit by unit, to the root's pre-backward hook."""
        st, sharding, reshard, base, snap, unsh, order, held, root, acts = (
            self.st, self.sharding, self.reshard, self.base, self.snap, self.unsharded_bytes, self.order, self.held,
            self.root_unsharded_bytes, self.acts)
        copied: set = set()  # FSDP2 units past their pre-forward copy-out
        for k, (u, *_) in enumerate(self.segs):
            cur = unsh.get(u, 0) if u != "root" else 0
            if u in self.sizes and u != "root" and not reshard and u not in held:
                if self.one_copy:
                    held[:] = [u]
                else:
                    held.append(u)
            nxt = next((x for x in order[order.index(u) + 1:]), None) if u in order else None
            pre = unsh.get(nxt, 0) if reshard and nxt else 0
            kept = sum(unsh[x] for x in held)
            # FSDP2 copies the unit's all-gather output out into its parameters and keeps that output
            # until the next unit's all-gather (`FSDPParamGroup._all_gather_result`; measured on the
            # CIFAR ResNet: only the current unit's is alive), the last one until the root's
            # post-forward (as the decoder walk's `ag_tail`).
            ag = cur if st.fsdp2 and sharding else 0
            if ag and u not in copied:
                # The unit's pre-forward copy-out (`FSDPParamGroup.wait_for_unshard`): the previous
                # group's all-gather output (the root's, for the first unit), dropped from
                # `comm_ctx.all_gather_state` but held by the local `prev_all_gather_state` until the
                # method returns, next to this unit's output and its copied-out parameters.
                prev = order[order.index(u) - 1] if order.index(u) > 0 else "root"
                snap("forward", **base, comm_buffers=root + (cur if reshard else kept) + ag + unsh.get(prev, 0),
                     activations=sum(acts[:k]) + self.inputs[k])
                copied.add(u)
            for a, t, w in self.fwd_instants(k):
                snap("forward", w, **base, comm_buffers=root + (cur + pre if reshard else kept) + ag,
                     activations=a, temporaries=t)
        kept_fwd = root + sum(unsh[x] for x in held)
        ag_tail = unsh.get(order[-1], 0) if st.fsdp2 and sharding and not reshard and order else 0
        for a in self.loss_fwd:
            snap("forward", **base, comm_buffers=kept_fwd + ag_tail, activations=a)
        snap("forward", **base, comm_buffers=kept_fwd + ag_tail, activations=self.all_acts, temporaries=self.out_tmp)
        # The root's pre-backward hook (on its outputs: it fires as backward starts) prefetches the last unit
        # when the root has parameters of its own: FSDP2 `FSDPParamGroup.pre_backward` -> `_backward_prefetch`,
        # FSDP1 `_pre_backward_hook` -> `_prefetch_handle` (BACKWARD_PRE). A root without parameters has no
        # group or handle: the last unit is all-gathered in its own hook.
        self.root_prefetch = unsh.get(order[-1], 0) if reshard and root and order else 0
        self.root_prefetch_copy = self.one_copy and "root" in self.sizes and sum(self.sizes["root"]) > 0
        snap("backward", **base, comm_buffers=kept_fwd + self.root_prefetch, activations=self.all_acts,
             temporaries=2 * self.out_tmp)

    def unit_grads_now(self, k: int, u: str, before: bool, g: int, g_unit: int) -> tuple[int, int]:
        """(gradient bytes of unit `u` and the root alive at a segment-k instant, those of them the probes'
        tracker counts as grads): FSDP2's unsharded parameters' .grad (read through
        FSDPParam._unsharded_param); FSDP1's view gradients wait in autograd's buffer (temporaries)."""
        rg = self.root_grads(k, before, g)
        if u == "root":  # its own gradients so far include those made in other segments
            mine = min(g_unit, max(g, rg))
        else:  # after the hook, g also counts the root's gradients made before it
            mine = (0 if before else min(g_unit, max(0, g - self.root_grad_bytes[k]))) + rg
        return mine, mine if self.st.fsdp2 else 0

    def backward(self) -> None:
        """The backward, segment by segment from the last: each segment's instants, the first micro-step's
        where gradients accumulate without sync, and the unit's post-backward (its reduction)."""
        self.reached: set = set()
        self.resharded: set = set()  # FSDP2 reshards each unit in its post-backward, before reducing
        # FSDP2 keeps a unit's reduce-scatter input until the next unit's post-backward replaces it
        # (`comm_ctx.reduce_scatter_state`), as the decoder walk's `rs_held`.
        self.rs_held_bytes = 0
        for k in range(len(self.segs) - 1, -1, -1):
            seg = self.segment_backward(k)
            self.segment_instants(seg)
            if self.later and not self.every_sync and seg.u in self.sizes:
                self.first_microstep_instants(seg)
            if seg.rs:
                self.post_backward(seg)

    def segment_backward(self, k: int) -> SegmentBackward:
        """Segment k's backward as it starts: its unit's unsharded parameters, the prefetched ones, its
        gradients and its reduction's input (bytes); sets the gradients carried at its instants."""
        sizes, unsh, order, held, root, reshard, one_copy = (
            self.sizes, self.unsharded_bytes, self.order, self.held, self.root_unsharded_bytes, self.reshard,
            self.one_copy)
        segs = self.segs
        u = segs[k][0]
        first = u not in self.reached
        self.reached.add(u)
        if one_copy and u in sizes and u != "root":
            held[:] = [u]  # its 16-bit copy made again for its backward, the previous one freed
        in_use = unsh.get(u, 0) if u != "root" else 0
        prev = next((x for x in reversed(order[:order.index(u)])), None) if u in order else None
        # (NO_SHARD under mixed precision prefetches the unit before too: its 16-bit copy, made by
        # `_unshard` -> `pre_unshard` -> `_use_low_precision_shard`)
        pre = unsh.get(prev, 0) if (reshard or one_copy) and prev else 0
        fsdp1 = self.st.fsdp1
        g_unit = sizes[u][1] * self.unsharded_elem_bytes if u in sizes and first else 0
        # The unit's reduction input: FSDP1 NO_SHARD all-reduces its flat gradient where the sharded
        # strategies reduce-scatter it (`_reduce_grad_no_shard`), at the same instant.
        rs = sizes[u][1] * self.reduce_elem_bytes if u in sizes and first and (self.sharding or fsdp1) else 0
        done = [x for x in self.reached if x in sizes and x != u]
        self.carried_grad_bytes = self.carried(done)
        grads = (sum(sizes[x][0] for x in done) * self.shard_grad_elem_bytes if self.sharding
                 else sum(sizes[x][1] for x in done) * self.gb)
        kept_now = sum(unsh[x] for x in held if x not in self.resharded)
        unsharded = root + (in_use + pre if reshard else kept_now)
        unsharded_before = unsharded
        if reshard:
            # FSDP1's pre-backward hook (`_runtime_utils._pre_backward_hook`) unshards the unit and
            # prefetches the one before (BACKWARD_PRE); until it runs only what the unit after it
            # prefetched is there.
            # FSDP2's pre-backward hook (on the unit's outputs) copies the unit's all-gather output
            # out into its parameters, frees it and prefetches the unit before; until it runs (the
            # segment's ops after the unit's forward, ReLU, pooling, and segments without
            # parameters) the next unit's prefetched all-gather output is what is alive. The first
            # unit of the backward is all-gathered in its own hook, not prefetched.
            nxt = u if u in order else next((s[0] for s in reversed(segs[:k]) if s[0] in order), None)
            unsharded_before = root + (unsh[nxt] if nxt and (nxt != order[-1] or self.root_prefetch) else 0)
            if u not in order:
                unsharded = unsharded_before
        elif one_copy and u in order:
            # the unit's copy is the one the unit after it prefetched (the last unit's: the root's, when
            # the root has parameters), then its hook prefetches the unit before (measured: the MNIST
            # CNN bf16-mixed on 8 fake ranks over 2 micro-steps, fc1's copy and conv3's at fc1's backward)
            unsharded_before = root + (in_use if u != order[-1] or self.root_prefetch_copy else 0)
            unsharded = root + in_use + pre
        return SegmentBackward(k, u, in_use, prev, pre, g_unit, rs, done, grads, unsharded, unsharded_before)

    def segment_instants(self, seg: SegmentBackward) -> None:
        """The segment's backward instants, with the gradients carried from earlier micro-steps."""
        k, u = seg.k, seg.u
        # During the segment's backward, at its measured peaks: its saved tensors not yet freed,
        # the activation gradients alive, its parameters' gradients made so far (temporaries, as
        # the probes' tracker sees them: FSDP1's are views of the flat parameter waiting in
        # autograd's buffer, FSDP2's the unsharded parameters' .grad, read by no collective).
        for (tmp, g, saved), w, before in (self.instants_accumulating(k) if self.in_place else self.instants(k)):
            comm = seg.unsharded_before if before else seg.unsharded
            if self.in_place:
                # every unit's .grad is kept (`carried_grad_bytes`): the new gradients made and not yet added
                # into it are temporaries (measured: Llama-3.2-1B's width at 2 layers, zero3 fp32 over 2
                # micro-steps, the tied embedding's gradient, the head's and their sum alive at once
                # next to the kept one: -17% when they were not counted)
                mine, own_grads = g, 0
            else:
                mine, own_grads = self.unit_grads_now(k, u, before, g, seg.g_unit)
            self.snap("backward", w, **self.base, comm_buffers=comm + self.rs_held_bytes,
                      activations=sum(self.acts[:k]) + saved, grads=seg.grads + own_grads,
                      temporaries=tmp + mine - own_grads)

    def first_microstep_instants(self, seg: SegmentBackward) -> None:
        """The segment's instants on the first micro-step, accumulating without sync."""
        k, u, unsh, done = seg.k, seg.u, self.unsharded_bytes, seg.done
        # The first micro-step without sync, at the same instants: the units already reached keep
        # their unsharded gradients (`unit_carry`), none reduced, none resharded in backward
        # (FSDP1's SHARD_GRAD_OP keeps them unsharded: `_should_free_in_backward`), nothing carried from
        # before. Measured: the CIFAR ResNet, every FSDP strategy in fp32 over 2 micro-steps with full
        # checkpointing, its peak at layer1's recomputation of the first micro-step, next to the
        # unsharded gradients of layer2, layer3 and fc (the later units are the larger in a CNN).
        kept_first = sum(self.unit_carry_bytes.get(x, 0) for x in done)
        # (FSDP2 reshards a unit after its backward without sync too: reshard_after_backward)
        held_first = self.root_unsharded_bytes + (seg.in_use + seg.pre if self.reshard else
                                  sum(unsh[x] for x in self.held if self.st.fsdp1 or x not in done))
        for (tmp, g, saved), w, before in self.instants(k):
            mine, own_grads = self.unit_grads_now(k, u, before, g, seg.g_unit)
            self.record("backward", w, **self.base,
                        comm_buffers=seg.unsharded_before if before and self.reshard else held_first,
                        activations=sum(self.acts[:k]) + saved, grads=kept_first + own_grads,
                        temporaries=tmp + mine - own_grads)

    def post_backward(self, seg: SegmentBackward) -> None:
        """The unit's post-backward: its reshard and its reduction, per FSDP flavour."""
        u, st, root = seg.u, self.st, self.root_unsharded_bytes
        if not self.every_sync and st.fsdp2:  # `post_backward` collects the accumulated gradient
            self.carried_grad_bytes = self.carried(seg.done + [u])
        # The unit's post-backward: its backward is over (its saved tensors and its output's
        # gradient are freed). FSDP2 reshards the unit, then reduces (`FSDPParamGroup.
        # post_backward`). FSDP1 is measured (MNIST CNN, gloo and fake process group alike) with
        # its flat parameter still unsharded and no extra copy at this point, and is walked so.
        unsharded = seg.unsharded
        if st.fsdp2 and u != "root":
            self.resharded.add(u)
            unsharded = root + (seg.pre if self.reshard else
                                sum(self.unsharded_bytes[x] for x in self.held if x not in self.resharded))
        elif st.fsdp2:  # the root too: its post-backward reshards before it reduces
            unsharded = 0
        # The root's gradients made so far wait for the root's own reduction at the end.
        rg = self.root_grads(seg.k, False, 0) if u != "root" else 0
        if st.fsdp1 and u == "root":
            self.fsdp1_root_post_backward(seg, unsharded)
        elif st.fsdp1:
            self.fsdp1_post_backward(seg, unsharded, rg)
        else:
            self.fsdp2_post_backward(seg, unsharded, rg)
    def fsdp1_root_post_backward(self, seg: SegmentBackward, unsharded: int) -> None:
        """FSDP1's root at the end of backward: the concatenation of its view gradients, then its reduction."""
        k, u, g_unit, rs, grads, done = seg.k, seg.u, seg.g_unit, seg.rs, seg.grads, seg.done
        sizes, red, sharding, root, base, snap, acts, every_sync = (
            self.sizes, self.reduce_elem_bytes, self.sharding, self.root_unsharded_bytes, self.base, self.snap,
            self.acts, self.every_sync)
        # The root's post-backward runs after every other unit's (the end of backward):
        # `_post_backward_hook` reshards first (`_post_backward_reshard`; the root too
        # frees its unsharded flat parameter, `_should_free_in_backward`), casts
        # flat_param.grad to reduce_dtype under mixed precision (the 16-bit gradient
        # stays alive as `autograd_computed_grad` to the hook's end) and `_reduce_grad`
        # reduce-scatters into a new shard. Before it, at the root's last AccumulateGrad,
        # the view gradients and their concatenation (flat_param.grad) are both alive next
        # to the unsharded flat parameter. Measured (fake process group of 8, untied 65K
        # vocabulary: the root dominates): fp32 peaks at the concatenation, bf16-mixed at
        # the reduce (16-bit gradient + fp32 input + fp32 shard). NO_SHARD keeps its flat
        # parameter but frees the 16-bit copy mixed precision made (`post_reshard` ->
        # `_free_low_precision_sharded_param`) and all-reduces the cast gradient in place.
        # (`ends` of the root, the last segment, is what its first op held: a tied head's
        # gradient and the embedding's, summed into the view gradient, g_unit, by now; as at
        # FSDP2's root below. Measured: a tied Llama of 64K vocabulary, fsdp and fsdp-grad-op
        # fp32 on 8 fake ranks, where counting them put this instant 11-14% above the peak)
        snap("backward", **base, comm_buffers=unsharded + g_unit, activations=sum(acts[:k]),
             grads=grads, temporaries=g_unit)
        out = sizes[u][0] * red if sharding else 0
        if not every_sync:  # the accumulated flat gradient is the reduction's input
            self.carried_grad_bytes = self.carried(done + [u])
        # on gloo the output shard is a buffer the collective writes and the input is split once
        # more (memory.estimate_memory's root reduce-scatter; measured on gloo, 2 ranks)
        gloo = self.backend == "gloo" and sharding
        # (the tied head's gradient, in `ends` at the embedding's last op, is summed into the
        # flat gradient by now)
        snap("backward", **base, comm_buffers=unsharded - root + rs + (out if gloo else 0),
             activations=sum(acts[:k]), grads=grads + (0 if gloo else out),
             temporaries=(g_unit if self.prec.mixed else 0) + (rs if gloo else 0))

    def fsdp1_post_backward(self, seg: SegmentBackward, unsharded: int, rg: int) -> None:
        """An FSDP1 unit's post-backward: the flat gradient, the reshard, under mixed precision the reduction."""
        k, u, g_unit, rs, grads, done, prev, pre = (
            seg.k, seg.u, seg.g_unit, seg.rs, seg.grads, seg.done, seg.prev, seg.pre)
        sizes, red, sharding, root, base, snap, acts, ends, held, unsh = (
            self.sizes, self.reduce_elem_bytes, self.sharding, self.root_unsharded_bytes, self.base, self.snap,
            self.acts, self.ends, self.held,
            self.unsharded_bytes)
        later, every_sync, reshard, one_copy, resharded = (
            self.later, self.every_sync, self.reshard, self.one_copy, self.resharded)
        # The view gradients are concatenated into flat_param.grad (both alive), which is
        # the reduce-scatter (NO_SHARD: all-reduce) input unless mixed precision casts it
        # to reduce_dtype first. Accumulating without sync, the flat gradient kept from the
        # earlier micro-steps (`carried_grad_bytes`) takes the concatenation in place: a temporary
        # (measured: the MNIST CNN, fsdp fp32 over 2 micro-steps on 8 fake ranks); so does
        # NO_SHARD's reduced gradient, kept as the flat gradient when each micro-step syncs.
        into = later and (not every_sync or not sharding) and u in self.unit_carry_bytes
        snap("backward", **base, comm_buffers=unsharded + (0 if into else g_unit),
             activations=sum(acts[:k]), grads=grads, temporaries=ends[k] + g_unit * (1 + into) + rg)
        if sharding and u != "root" or one_copy:
            # freed by `_post_backward_reshard` (`_should_free_in_backward`: FULL_SHARD and
            # SHARD_GRAD_OP alike when gradients sync): later units no longer hold it. NO_SHARD
            # under mixed precision frees its 16-bit copy there (`post_reshard` ->
            # `_free_low_precision_sharded_param`; measured: the MNIST CNN's fc1 bf16-mixed on 8
            # fake ranks, +1.9% on the peak while the segments after it still held the copy)
            resharded.add(u)
            if one_copy and prev:
                held[:] = [prev]  # the copy its hook prefetched, alive to the unit before's backward
        if self.prec.mixed:
            # `_runtime_utils._post_backward_hook` reshards first (the unit's 16-bit unsharded
            # flat parameter goes, sharded strategies), then casts flat_param.grad to
            # reduce_dtype (the 16-bit gradient stays alive as `autograd_computed_grad` to the
            # hook's end) and `_reduce_grad` reduce-scatters it into a new shard (NO_SHARD:
            # all-reduces it in place). Measured: a transformers Llama (width 1024, 4 and 8 blocks,
            # vocabulary 2048, 256 tokens) bf16-mixed on 8 fake ranks, this instant exact;
            # counting the cast next to the unsharded parameter was 19% above
            # (benchmarks/results/cpu-torch2.13-2026-11-24-blockpeak-hf.jsonl).
            after = root + (pre if reshard or one_copy else
                            sum(unsh[x] for x in held if x not in resharded))
            # the new shard: the unit's gradient shard, unless an earlier micro-step's is kept
            # (`_accumulate_sharded_grad` adds it into `_saved_grad_shard`, and it goes)
            out = sizes[u][0] * red if sharding else 0
            added = later and every_sync
            snap("backward", **base, comm_buffers=after + rs + (out if added else 0),
                 activations=sum(acts[:k]), grads=grads + (0 if added else out),
                 temporaries=ends[k] + g_unit + rg)

    def fsdp2_post_backward(self, seg: SegmentBackward, unsharded: int, rg: int) -> None:
        """An FSDP2 unit's post-backward: `foreach_reduce`'s copy-in, then its reduce-scatter."""
        k, u, g_unit, rs, grads = seg.k, seg.u, seg.g_unit, seg.rs, seg.grads
        sizes, red, base, snap, acts, ends, udt = (
            self.sizes, self.reduce_elem_bytes, self.base, self.snap, self.acts, self.ends, self.unsharded_elem_bytes)
        # FSDP2 `foreach_reduce` (_fsdp_collectives.py): the unsharded gradients are copied
        # into the reduce-scatter input and freed only then (`unsharded_grads.clear()`);
        # next the output (one shard of the input) is allocated and the collective runs,
        # gloo's reduce-scatter copying its input once more.
        end = 0 if u == "root" else ends[k]  # a tied head's gradient is summed in by then
        snap("backward", **base, comm_buffers=unsharded + rs, activations=sum(acts[:k]),
             grads=grads + rg, temporaries=end + g_unit)
        split = rs if self.backend == "gloo" else 0
        # through torch 2.14 the last parameter's unsharded gradient stays, held by
        # `foreach_reduce`'s loop variable until it returns (an untied LM head's, V x h, at
        # the root; config.fsdp2_reduce_keeps_last_grad)
        last_g = (prod(self.desc.unit_shapes(u)[-1]) * udt
                  if u in sizes and fsdp2_reduce_keeps_last_grad(self.train) else 0)
        snap("backward", **base, comm_buffers=unsharded + rs + sizes[u][0] * red,
             activations=sum(acts[:k]), grads=grads + rg, temporaries=end + split + last_g)
        self.rs_held_bytes = rs

    def last_microstep_root_instants(self) -> None:
        """After the backward: the first micro-step's instants at the root's last gradients, where gradients
        accumulate without sync."""
        st, desc, prec, segs, sizes, unsh, held, root, base, snap, acts, udt, red = (
            self.st, self.desc, self.prec, self.segs, self.sizes, self.unsharded_bytes, self.held,
            self.root_unsharded_bytes, self.base,
            self.snap, self.acts, self.unsharded_elem_bytes, self.reduce_elem_bytes)
        later, every_sync, sharding, reshard, numel = (
            self.later, self.every_sync, self.sharding, self.reshard, self.numel)
        k = next((i for i, s_ in enumerate(segs) if s_[0] == "root"), None)  # the root's last backward segment
        if later and not every_sync and sharding and st.fsdp1 and "root" in sizes and k is not None:
            # The first micro-step, without sync, at the root's last gradients (memory.estimate_memory walks
            # the same instant): every other unit's unsharded flat gradient is kept, none reduced, nothing
            # accumulated yet, and SHARD_GRAD_OP has freed no unit (`_should_free_in_backward` is False
            # without sync). Measured: Qwen2.5-0.5B at 8 layers, fsdp-grad-op fp32 over 2 micro-steps, its
            # tied 152K-vocabulary gradients next to every unit's: -4.69% without it.
            self.carried_grad_bytes = 0
            comm = root + (0 if reshard else sum(unsh[x] for x in held))
            kept_grads = sum(v[1] for x, v in sizes.items() if x != "root") * udt
            g_root = sizes["root"][1] * udt
            for (tmp, g, saved), w, before in self.instants(k):
                snap("backward", w, **base, comm_buffers=comm, activations=sum(acts[:k]) + saved,
                     grads=kept_grads, temporaries=tmp + min(g_root, max(g, self.root_grads(k, before, g))))
            snap("backward", **base, comm_buffers=comm + g_root, activations=sum(acts[:k]), grads=kept_grads,
                 temporaries=g_root)
        if (later and not every_sync and sharding and st.fsdp2 and prec.mixed and desc.tied
                and "root" in sizes and fsdp2_first_microstep_grads_in_reduce_dtype(self.train)):
            # torch 2.15, the first micro-step without sync (from the second step on; memory.estimate_memory
            # walks the same instant): its gradients land in reduce_dtype, so at the tied embedding's
            # backward its gradient and the head's are fp32 copies and their sum a third, next to every
            # other unit's unsharded gradient of this micro-step and the root's others; nothing accumulated
            # yet, every unit but the root resharded. Measured: GPT-2 medium, zero3 bf16-mixed over 2
            # micro-steps on 8 fake ranks, 15% above the peak walked without it.
            self.carried_grad_bytes = 0
            tied = sum(desc.tied)
            others = sum(n for u, n in numel.items() if u != "root") + max(0, numel["root"] - tied)
            snap("backward", **base, comm_buffers=root, grads=others * red, temporaries=3 * tied * red)
