"""The trace front end's memory walk: the most loaded rank's memory of one strategy for a measured module
(`walk_module_memory`; module_plan.py's docstring says what it counts) and the events its reserved peak replays
(`logged_module_events`)."""

from __future__ import annotations

from math import prod

from .alloc_trace import (LOGGED_FAMILIES, LOGGED_FSDP1, LOGGED_FSDP2, LOGGED_OPTIMIZERS, logged_fsdp1_events,
                          logged_fsdp2_events, logged_step_events)
from .comm import DDP_BUCKET_CAP_MB
from .config import Cluster, checkpoint_every, fsdp2_first_microstep_grads_in_reduce_dtype, fsdp2_reduce_keeps_last_grad
from .footprint import device_footprint
from .memory import COMPONENTS, MemoryEstimate, Snapshot, library_workspace_bytes
from .module_desc import ModuleDesc, ModuleTrain, _autocast_cast_bytes, _regime, _shard_group, _unit_sizes, _zero1_owned
from .module_step import ddp_buckets
from .precision import optimizer_state_elems
from .strategies import DDP, Strategy, ZERO1, get_strategy


# -- memory ------------------------------------------------------------------------------------

PADDING_NOTE_FRACTION = 0.10
"""FSDP2's dim-0 padding is named in a note once it adds this fraction to a rank's parameter shard."""


def fsdp2_padding_note(desc: ModuleDesc, names, shard: int) -> str | None:
    """A note where FSDP2's dim-0 sharding pads the shards well beyond 1/shard of the parameters: a
    parameter with fewer rows than the shard group (a mixture-of-experts layer's stacked experts, whose
    dim 0 is the number of experts) gives every rank ceil(rows / shard) rows, the all-gathers move
    shard x that, and ranks past the last row hold padding (`FSDPParam._init_sharded_param`: `torch.chunk`
    on dim 0, padded to `padded_sharded_param_size`). None when the padding is under
    PADDING_NOTE_FRACTION or no FSDP2 strategy is planned."""
    names = [n for n in names if get_strategy(n).fsdp2]
    if not names or shard <= 1:
        return None
    padded = exact = 0
    worst = (0, "", ())
    for _, ps in desc.units:
        for pname, s in ps:
            rows = -(-s[0] // shard) * prod(s[1:]) if s else 1
            padded += rows
            exact += prod(s) / shard
            extra = rows - prod(s) / shard
            if extra > worst[0]:
                worst = (extra, pname, s)
    if not exact or padded <= (1 + PADDING_NOTE_FRACTION) * exact:
        return None
    _, pname, s = worst
    return (f"{', '.join(names)}: FSDP2 shards each parameter on dim 0, and {pname} ({'x'.join(map(str, s))}) has "
            f"{s[0]} rows for {shard} ranks, so each rank holds {-(-s[0] // shard)} row(s) and the all-gathers "
            f"move {shard} x that: the parameter shards come to {padded / exact:.1f}x 1/{shard} of the model. "
            f"fully_shard(shard_placement_fn=...) can shard such parameters on another dim (not planned), or "
            f"FSDP1's flat parameters (fsdp) avoid it")


def walk_module_memory(desc: ModuleDesc, train: ModuleTrain, cluster: Cluster,
                       strategy: str | Strategy, device: str = "cuda", backend: str = "nccl",
                       workspaces: dict | None = None, rank: int | None = None,
                       init: str = "device", snapshots: list | None = None) -> MemoryEstimate:
    """Most loaded rank's memory of one strategy for a measured module (module docstring); `rank`: that
    rank's instead, where ranks differ (ZeRO-1's partition of the optimizer state: a probe on the fake process
    group measures rank 0). `init`: how the written run builds the model under FSDP (logged_module_events).

    On 'cuda' `peak_allocated` adds two cuBLAS workspaces (forward and backward threads) and cuBLASLt's
    when a Linear has a bias (`memory.library_workspace_bytes`'s rule), and each convolution's cuDNN
    workspace from `workspaces` ({kernel key: bytes}, measured by `validate.kernel_workspace`) at the
    instant its call runs: the components are those of the tensors' peak, `peak_allocated` is the
    highest of tensors plus the workspace of the moment, and `workspace` what it adds to the components.
    `backend` 'gloo' adds the copy its reduce_scatter_tensor makes of its input (as memory.py)."""
    st = get_strategy(strategy)
    family = st.family
    world, shard = _shard_group(st, cluster)
    prec = train.prec
    pb, gb, cb = prec.param_bytes, prec.grad_bytes, prec.compute_bytes
    notes: list[str] = []
    shapes = desc.all_shapes()
    total = desc.param_count()
    largest = max((prod(s) for s in shapes), default=0)
    fsdp = st.fsdp
    sharding = fsdp and shard > 1 and st.shards_params
    sizes = _unit_sizes(desc, family, shard, sharding) if fsdp else {}

    # Optimizer state (precision.optimizer_state_elems) on this rank's elements.
    if st.zero_optimizer and shard > 1:
        owned = _zero1_owned(shapes, shard, rank)
        elems, extra = optimizer_state_elems(train.optimizer, owned)
        step_elems = sum(prod(s) for s in owned)
    elif sharding:
        # The most loaded rank's shards: FSDP2 keeps each parameter's dim-0 chunk (rank 0 has
        # ceil(d0/shard) rows), FSDP1 one flat 1-D shard per unit; states are zeros_like(shard).
        if st.fsdp2:
            local = [(-(-s[0] // shard),) + tuple(s[1:]) if s else (1,) for s in shapes]
        else:
            local = [(v[0],) for v in sizes.values()]
        elems, extra = optimizer_state_elems(train.optimizer, local)
        step_elems = sum(v[0] for v in sizes.values())
    else:
        elems, extra = optimizer_state_elems(train.optimizer, shapes)
        step_elems = total
    opt = elems * pb + int(extra)
    if train.optimizer in ("adam", "adamw"):
        opt_tmp = {"foreach": step_elems * pb, "for-loop": 2 * min(largest, step_elems) * pb}.get(
            train.optimizer_impl, 0)
    elif train.optimizer == "adafactor":
        opt_tmp = 2 * largest * pb
    else:
        opt_tmp = 0

    # Forward segments, with checkpointing.
    segs = [s for s in desc.segments if s[0] != "loss"]
    loss_act = sum(s[1] for s in desc.segments if s[0] == "loss")
    acts = [s[1] for s in segs]
    every = checkpoint_every(train.checkpointing)
    kept_in = [0 if j in desc.batch_inputs else s[2] for j, s in enumerate(segs)]  # a checkpointed unit's input
    # the units the probes checkpoint (`workload.enable_checkpointing`: the parameter-owning children), not the
    # segments of parameter-free children (a pooling module: measured, the MNIST CNN under full checkpointing,
    # +21% on the peak while its pools counted as checkpointed units keeping their inputs)
    owners = {u for u, ps in desc.units if ps and u != "root"}
    unit_index = {u: i for i, u in enumerate(dict.fromkeys(s[0] for s in segs if s[0] in owners))}
    ckpt = [bool(every) and s[0] in unit_index and unit_index[s[0]] % every == 0 for s in segs]
    if every:
        # Each checkpointed unit (every one for full, every K-th from the first for every-K: transformers'
        # `every_n_layers`) keeps its input; what the root's own ops after it saved (a decoder's final
        # norm, LM head and loss) stays; the unit's own saved tensors are recomputed in its backward.
        # A segment without a unit (the root's first ops: embedding) is not checkpointed. Its other tensor
        # inputs (a decoder layer's masks, RoPE tables, position ids: shared by the units) stay alive with
        # it, each counted once, at the first checkpointed unit given it.
        # A unit whose input is the batch itself keeps nothing new for it (the batch is a temporary).
        kept: set = set()
        acts = []
        for j, (s, c) in enumerate(zip(segs, ckpt)):
            if not c:
                acts.append(s[1])
                continue
            acts.append(kept_in[j] + s[5] + sum(b for i, b in s[8] if i not in kept))
            kept.update(i for i, _ in s[8])
    elif train.checkpointing in ("selective", "selective-op"):
        notes.append(f"{train.checkpointing} checkpointing is not defined for an arbitrary module: planned as none")
    inputs = [s[2] for s in segs] + [desc.output_bytes]
    ends = [s[6] for s in segs]  # transient bytes at each segment's backward end (measured)
    out_tmp = desc.output_bytes
    buffers = desc.buffers_bytes

    snaps: list[Snapshot] = []
    extra: list[int] = []  # cuDNN workspace taken at each snapshot's instant
    ws = workspaces if device == "cuda" and workspaces else {}
    fwd_kernels: dict = {}  # segment -> [(workspace, (forward bytes,))]
    bwd_kernels: dict = {}  # segment -> [(workspace, (transient, grads, saved))]
    for i, phase, key, at in desc.kernels:
        if i < len(segs) and key in ws:
            (fwd_kernels if phase == "forward" else bwd_kernels).setdefault(i, []).append((ws[key], at))

    def snap(phase, workspace=0, **parts):
        full = {k: 0 for k in COMPONENTS}
        for k, v in parts.items():
            full[k] += int(v)
        # the step's input batches, one per micro-step, alive through the step (a loader hands the step
        # its micro-batches together; the probe makes them before the first forward)
        full["temporaries"] += desc.batch_bytes * train.grad_accum
        snaps.append(Snapshot(phase, full))
        extra.append(int(workspace))

    def instants(k: int, split: tuple = (), kernel_grads: bool = True):
        """Segment k's backward: its measured peaks before and after its unit's output gradient is
        ready (no workspace), then each convolution's instant with its workspace (after), as
        ((transient, own grads, saved), workspace, before). With full checkpointing the unit's saved
        tensors are the recomputed ones, made after the hook (temporaries). `split`: other per-segment
        (before, after) peaks than the profile's `backward` (ModuleDesc.backward_accumulating);
        `kernel_grads` False: no gradients at the convolutions' instants."""
        if ckpt[k]:
            # The recomputation's own forward peak, right after the hook (non-reentrant checkpoint runs the
            # unit's forward again to its end: what its forward held at its peak, the block's locals
            # through its last op), next to its kept input and its output's gradient (measured: the CIFAR
            # ResNet's basic blocks under full checkpointing, -9.4% on the peak without this instant)
            if desc.unit_forward:
                fwd_peak, out = desc.unit_forward[k]
                yield (out + fwd_peak, 0, kept_in[k]), 0, False
        for before, (tmp, g, saved) in zip((True, False), split[k] if split else segs[k][3]):
            if ckpt[k]:
                # Its input, and before the hook what the root's ops after the unit still hold; the
                # unit's own saved tensors exist only once the recomputation (after the hook) made
                # them again, in the backward phase: temporaries to the probes, as many still alive
                # as the traced run had at that instant.
                unit_saved = segs[k][1] - segs[k][5]
                if before:
                    saved = kept_in[k] + max(0, saved - unit_saved)
                else:
                    # (where the unit saves its input itself, the recompute saves the kept input again:
                    # counted once, in `saved`; its first op's backward, the last, frees it)
                    tmp, saved = tmp + max(0, min(saved, unit_saved) - segs[k][9]), kept_in[k]
            yield (tmp, g, saved), 0, before
        for w, at in bwd_kernels.get(k, ()):
            g = at[1] if kernel_grads else 0
            if ckpt[k]:
                yield (at[0] + at[2], g, acts[k]), w, False
            else:
                yield (at[0], g, at[2]), w, False

    accumulating = desc.backward_accumulating

    def instants_accumulating(k: int):
        """`instants` of a micro-step after the first of gradient accumulation, every .grad already there:
        ((transient, fresh, saved), workspace, before), `fresh` the new gradients made and not yet added in
        place into their .grad (ModuleDesc.backward_accumulating); a profile without them counts none,
        and a convolution's instant counts none."""
        if accumulating:
            yield from instants(k, accumulating, kernel_grads=False)
            return
        for (tmp, _g, saved), w, before in instants(k):
            yield (tmp, 0, saved), w, before

    # Gradients of the root's parameters made in another unit's segment: the root's own ops that run
    # after that unit (a decoder's final norm and LM head, after its last block) join its segment,
    # ahead of the unit's output gradient (the "before" instant). They stay alive until the root
    # reduces at the very end of backward (FSDP: the root's post-backward; DDP: .grad).
    # The gradients the segment's backward made (measured: the storages alive when the whole backward
    # ends) less its unit's own (in the traced dtype). A profile without that figure: the segment's
    # gradients at its before-hook instant, which misses a root gradient still autograd's transient at
    # that instant (a 16-bit LM head's at long sequences: Llama-3-8B's 1 GiB at 1024 tokens).
    traced_gb = 2 if prec.mixed and fsdp or train.precision == "bf16" else 4  # the trace's parameters' dtype
    numel = {u: sum(prod(s) for _, s in ps) for u, ps in desc.units}  # each unit's parameters, real shapes
    own_g = {u: n * traced_gb for u, n in numel.items()}
    root_g = [0 if s[0] == "root" else max(0, s[7] - own_g.get(s[0], 0)) if s[7] >= 0 else s[3][0][1]
              for s in segs]

    def root_grads(k: int, before: bool, g: int) -> int:
        """Bytes of root gradients alive at segment k's instant: those of the segments after it, plus
        this segment's so far (at its before-hook instant, `g` itself)."""
        return sum(root_g[k + 1:]) + (g if before else root_g[k])

    all_acts = sum(acts) + loss_act
    # Segment k's forward at its measured peak: the earlier segments' saved tensors plus what its own
    # forward holds (saved so far, its input, intermediates: a block's two branches before their sum);
    # the probes' tracker counts all of it as activations. Checkpointed: its input and its output.
    # Checkpointed, the transient its forward holds beyond what it saves and its input (the root's ops
    # after a decoder's last block: logits and their fp32 copy at the loss) is there too; and under
    # autocast the 16-bit casts of every checkpointed unit's weights so far stay in autocast's cache until
    # the forward ends (`autocast_mode.cpp` cached_casts), though the unit saves none of them.
    casts = _autocast_cast_bytes(desc) if every and _regime(train.precision, family).startswith("autocast") else {}
    cached = [sum(casts.get(x[0], 0) for x, c in zip(segs[:k + 1], ckpt) if c) for k in range(len(segs))]
    fwd_act = [sum(acts[:k + 1]) + max(0, s[4] - s[1] - s[2]) + cached[k] if c else sum(acts[:k]) + s[4] + cached[k]
               for k, (s, c) in enumerate(zip(segs, ckpt))]
    # (a checkpointed segment's output is a transient, unless the root's ops after the unit saved it: the MNIST
    # CNN's ReLUs, whose outputs are in `outside`; measured, zero3 fp32 over 2 micro-steps, +1.1% counting it twice)
    fwd_tmp = [inputs[k + 1] if c and k + 1 not in desc.saved_inputs else 0 for k, c in enumerate(ckpt)]
    loss_fwd = [] if every else [sum(acts) + s[4] for s in desc.segments if s[0] == "loss"]

    def fwd_instants(k: int):
        """Segment k's forward: its peak (no workspace), then each convolution's instant with its
        workspace, as (activations, temporaries, workspace); unmeasured, the peak bounds them."""
        yield fwd_act[k], fwd_tmp[k], 0
        for w, at in fwd_kernels.get(k, ()):
            yield (fwd_act[k], fwd_tmp[k], w) if ckpt[k] else (sum(acts[:k]) + at[0], 0, w)
    later, every_sync = train.grad_accum > 1, train.sync_every  # as memory.estimate_memory
    if not st.fsdp:
        unit_grad = {u: n * gb for u, n in numel.items()}
        base = dict(params=total * pb + buffers, optimizer=opt,
                    comm_buffers=total * gb if st.distributed else 0)
        if later:
            # Accumulation: every .grad is alive from the first micro-step on, later gradients added in
            # place (AccumulateGrad), synced or not (memory.estimate_memory's DDP walk).
            notes.append("gradient accumulation keeps every parameter's gradient between micro-steps")
            plain = snap

            def snap(phase, workspace=0, grads=0, **parts):  # noqa: F811
                plain(phase, workspace, grads=max(grads, total * gb) if phase != "optimizer" else grads, **parts)
        for k in range(len(segs)):
            for a, t, w in fwd_instants(k):
                snap("forward", w, **base, activations=a, temporaries=t)
        for a in loss_fwd:
            snap("forward", **base, activations=a)
        snap("forward", **base, activations=all_acts, temporaries=out_tmp)
        snap("backward", **base, activations=all_acts, temporaries=2 * out_tmp)
        reached: set = set()
        for k in range(len(segs) - 1, -1, -1):
            u = segs[k][0]
            own = unit_grad.get(u, 0) if u not in reached else 0
            reached.add(u)
            done = sum(unit_grad.get(x, 0) for x in reached if x != u)
            for (tmp, g, saved), w, before in (instants_accumulating(k) if later else instants(k)):
                if later:  # every .grad is kept (`snap` above); the new gradients not yet added in: temporaries
                    snap("backward", w, **base, activations=sum(acts[:k]) + saved, temporaries=tmp + g)
                    continue
                rg = root_grads(k, before, g)
                if u == "root":
                    mine = min(max(0, own - rg), g)
                else:  # after the hook, g also counts the root's gradients made before it
                    mine = 0 if before else min(own, max(0, g - root_g[k]))
                snap("backward", w, **base, activations=sum(acts[:k]) + saved,
                     grads=done + mine + (rg if u != "root" else min(rg, own)), temporaries=tmp)
        snap("optimizer", **base, grads=total * gb, temporaries=opt_tmp)
    else:
        udt = cb if prec.mixed else pb  # param_dtype of the unsharded unit
        red = 4 if prec.mixed else gb  # reduce_dtype
        sg = 4 if prec.mixed else gb  # sharded gradient (fp32 under mixed precision)
        reshard = st.reshard_after_forward and sharding
        shard_params = sum(v[0] for v in sizes.values())
        base = dict(params=shard_params * pb + buffers, optimizer=opt)
        # FSDP1's BatchNorm units keep fp32 (no mixed precision: `ModuleDesc.fp32_units`); so small they are
        # counted with the shards, not walked (their unsharded parameters and gradients live within their
        # parent unit's segment)
        unit_dt = {u: pb if u in desc.fp32_units else udt for u in sizes}
        unsh = {u: v[1] * unit_dt[u] for u, v in sizes.items()}
        if not sharding:  # NO_SHARD: only a 16-bit copy of the unit in use under mixed precision
            unsh = {u: (v[1] * cb if prec.mixed and u not in desc.fp32_units else 0) for u, v in sizes.items()}
        root = unsh.get("root", 0)
        order = [s[0] for s in segs if s[0] in sizes and s[0] != "root"]
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
            unit_carry = {u: numel[u] * red for u in sizes}
        in_place = later and not every_sync and sharding and st.fsdp2 and not prec.mixed
        if later:
            notes.append("gradient accumulation keeps " + ("sharded" if every_sync and sharding else "unsharded")
                         + " gradients of every unit between micro-steps")

        def carried(reduced) -> int:
            return sum(v for x, v in unit_carry.items() if x not in reduced)
        carry_now = [carried(())]  # the units that have not reduced yet, at the instant walked
        plain = snap

        def snap(phase, workspace=0, grads=0, **parts):  # noqa: F811
            plain(phase, workspace, grads=grads + (carry_now[0] if phase != "optimizer" else 0), **parts)
        held: list = []  # units unsharded and kept to backward (no reshard)
        # NO_SHARD under mixed precision frees each unit's 16-bit copy when it "reshards" after its forward
        # (`FlatParamHandle.post_reshard` -> `_free_low_precision_sharded_param`) and casts it again for
        # its backward: one unit's copy at a time, as memory.estimate_memory's `held`
        one_copy = not sharding and prec.mixed
        copied: set = set()  # FSDP2 units past their pre-forward copy-out
        for k, (u, *_) in enumerate(segs):
            cur = unsh.get(u, 0) if u != "root" else 0
            if u in sizes and u != "root" and not reshard and u not in held:
                if one_copy:
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
                     activations=sum(acts[:k]) + inputs[k])
                copied.add(u)
            for a, t, w in fwd_instants(k):
                snap("forward", w, **base, comm_buffers=root + (cur + pre if reshard else kept) + ag,
                     activations=a, temporaries=t)
        kept_fwd = root + sum(unsh[x] for x in held)
        ag_tail = unsh.get(order[-1], 0) if st.fsdp2 and sharding and not reshard and order else 0
        for a in loss_fwd:
            snap("forward", **base, comm_buffers=kept_fwd + ag_tail, activations=a)
        snap("forward", **base, comm_buffers=kept_fwd + ag_tail, activations=all_acts, temporaries=out_tmp)
        # The root's pre-backward hook (on its outputs: it fires as backward starts) prefetches the last unit
        # when the root has parameters of its own: FSDP2 `FSDPParamGroup.pre_backward` -> `_backward_prefetch`,
        # FSDP1 `_pre_backward_hook` -> `_prefetch_handle` (BACKWARD_PRE). A root without parameters has no
        # group or handle: the last unit is all-gathered in its own hook.
        root_prefetch = unsh.get(order[-1], 0) if reshard and root and order else 0
        root_prefetch_copy = one_copy and "root" in sizes and sum(sizes["root"]) > 0
        snap("backward", **base, comm_buffers=kept_fwd + root_prefetch, activations=all_acts,
             temporaries=2 * out_tmp)
        def unit_grads_now(k: int, u: str, before: bool, g: int, g_unit: int) -> tuple[int, int]:
            """(gradient bytes of unit `u` and the root alive at a segment-k instant, those of them the probes'
            tracker counts as grads): FSDP2's unsharded parameters' .grad (read through
            FSDPParam._unsharded_param); FSDP1's view gradients wait in autograd's buffer (temporaries)."""
            rg = root_grads(k, before, g)
            if u == "root":  # its own gradients so far include those made in other segments
                mine = min(g_unit, max(g, rg))
            else:  # after the hook, g also counts the root's gradients made before it
                mine = (0 if before else min(g_unit, max(0, g - root_g[k]))) + rg
            return mine, mine if st.fsdp2 else 0

        reached = set()
        resharded: set = set()  # FSDP2 reshards each unit in its post-backward, before reducing
        # FSDP2 keeps a unit's reduce-scatter input until the next unit's post-backward replaces it
        # (`comm_ctx.reduce_scatter_state`), as the decoder walk's `rs_held`.
        rs_held = 0
        for k in range(len(segs) - 1, -1, -1):
            u = segs[k][0]
            first = u not in reached
            reached.add(u)
            if one_copy and u in sizes and u != "root":
                held[:] = [u]  # its 16-bit copy made again for its backward, the previous one freed
            in_use = unsh.get(u, 0) if u != "root" else 0
            prev = next((x for x in reversed(order[:order.index(u)])), None) if u in order else None
            # (NO_SHARD under mixed precision prefetches the unit before too: its 16-bit copy, made by
            # `_unshard` -> `pre_unshard` -> `_use_low_precision_shard`)
            pre = unsh.get(prev, 0) if (reshard or one_copy) and prev else 0
            fsdp1 = st.fsdp1
            g_unit = sizes[u][1] * udt if u in sizes and first else 0
            # The unit's reduction input: FSDP1 NO_SHARD all-reduces its flat gradient where the sharded
            # strategies reduce-scatter it (`_reduce_grad_no_shard`), at the same instant.
            rs = sizes[u][1] * red if u in sizes and first and (sharding or fsdp1) else 0
            done = [x for x in reached if x in sizes and x != u]
            carry_now[0] = carried(done)
            grads = (sum(sizes[x][0] for x in done) * sg if sharding
                     else sum(sizes[x][1] for x in done) * gb)
            kept_now = sum(unsh[x] for x in held if x not in resharded)
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
                unsharded_before = root + (unsh[nxt] if nxt and (nxt != order[-1] or root_prefetch) else 0)
                if u not in order:
                    unsharded = unsharded_before
            elif one_copy and u in order:
                # the unit's copy is the one the unit after it prefetched (the last unit's: the root's, when
                # the root has parameters), then its hook prefetches the unit before (measured: the MNIST
                # CNN bf16-mixed on 8 fake ranks over 2 micro-steps, fc1's copy and conv3's at fc1's backward)
                unsharded_before = root + (in_use if u != order[-1] or root_prefetch_copy else 0)
                unsharded = root + in_use + pre
            # During the segment's backward, at its measured peaks: its saved tensors not yet freed,
            # the activation gradients alive, its parameters' gradients made so far (temporaries, as
            # the probes' tracker sees them: FSDP1's are views of the flat parameter waiting in
            # autograd's buffer, FSDP2's the unsharded parameters' .grad, read by no collective).
            for (tmp, g, saved), w, before in (instants_accumulating(k) if in_place else instants(k)):
                comm = unsharded_before if before else unsharded
                if in_place:
                    # every unit's .grad is kept (`carry_now`): the new gradients made and not yet added
                    # into it are temporaries (measured: Llama-3.2-1B's width at 2 layers, zero3 fp32 over 2
                    # micro-steps, the tied embedding's gradient, the head's and their sum alive at once
                    # next to the kept one: -17% when they were not counted)
                    mine, own_grads = g, 0
                else:
                    mine, own_grads = unit_grads_now(k, u, before, g, g_unit)
                snap("backward", w, **base, comm_buffers=comm + rs_held,
                     activations=sum(acts[:k]) + saved, grads=grads + own_grads,
                     temporaries=tmp + mine - own_grads)
            if later and not every_sync and u in sizes:
                # The first micro-step without sync, at the same instants: the units already reached keep
                # their unsharded gradients (`unit_carry`), none reduced, none resharded in backward
                # (FSDP1's SHARD_GRAD_OP keeps them unsharded: `_should_free_in_backward`), nothing carried from
                # before. Measured: the CIFAR ResNet, every FSDP strategy in fp32 over 2 micro-steps with full
                # checkpointing, its peak at layer1's recomputation of the first micro-step, next to the
                # unsharded gradients of layer2, layer3 and fc (the later units are the larger in a CNN).
                kept_first = sum(unit_carry.get(x, 0) for x in done)
                # (FSDP2 reshards a unit after its backward without sync too: reshard_after_backward)
                held_first = root + (in_use + pre if reshard else
                                     sum(unsh[x] for x in held if st.fsdp1 or x not in done))
                for (tmp, g, saved), w, before in instants(k):
                    mine, own_grads = unit_grads_now(k, u, before, g, g_unit)
                    plain("backward", w, **base, comm_buffers=unsharded_before if before and reshard else held_first,
                          activations=sum(acts[:k]) + saved, grads=kept_first + own_grads,
                          temporaries=tmp + mine - own_grads)
            if rs:
                if not every_sync and st.fsdp2:  # `post_backward` collects the accumulated gradient
                    carry_now[0] = carried(done + [u])
                # The unit's post-backward: its backward is over (its saved tensors and its output's
                # gradient are freed). FSDP2 reshards the unit, then reduces (`FSDPParamGroup.
                # post_backward`). FSDP1 is measured (MNIST CNN, gloo and fake process group alike) with
                # its flat parameter still unsharded and no extra copy at this point, and is walked so.
                if st.fsdp2 and u != "root":
                    resharded.add(u)
                    unsharded = root + (pre if reshard else sum(unsh[x] for x in held if x not in resharded))
                elif st.fsdp2:  # the root too: its post-backward reshards before it reduces
                    unsharded = 0
                # The root's gradients made so far wait for the root's own reduction at the end.
                rg = root_grads(k, False, 0) if u != "root" else 0
                if fsdp1 and u == "root":
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
                        carry_now[0] = carried(done + [u])
                    # on gloo the output shard is a buffer the collective writes and the input is split once
                    # more (memory.estimate_memory's root reduce-scatter; measured on gloo, 2 ranks)
                    gloo = backend == "gloo" and sharding
                    # (the tied head's gradient, in `ends` at the embedding's last op, is summed into the
                    # flat gradient by now)
                    snap("backward", **base, comm_buffers=unsharded - root + rs + (out if gloo else 0),
                         activations=sum(acts[:k]), grads=grads + (0 if gloo else out),
                         temporaries=(g_unit if prec.mixed else 0) + (rs if gloo else 0))
                elif fsdp1:
                    # The view gradients are concatenated into flat_param.grad (both alive), which is
                    # the reduce-scatter (NO_SHARD: all-reduce) input unless mixed precision casts it
                    # to reduce_dtype first. Accumulating without sync, the flat gradient kept from the
                    # earlier micro-steps (`carry_now`) takes the concatenation in place: a temporary
                    # (measured: the MNIST CNN, fsdp fp32 over 2 micro-steps on 8 fake ranks); so does
                    # NO_SHARD's reduced gradient, kept as the flat gradient when each micro-step syncs.
                    into = later and (not every_sync or not sharding) and u in unit_carry
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
                    if prec.mixed:
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
                else:
                    # FSDP2 `foreach_reduce` (_fsdp_collectives.py): the unsharded gradients are copied
                    # into the reduce-scatter input and freed only then (`unsharded_grads.clear()`);
                    # next the output (one shard of the input) is allocated and the collective runs,
                    # gloo's reduce-scatter copying its input once more.
                    end = 0 if u == "root" else ends[k]  # a tied head's gradient is summed in by then
                    snap("backward", **base, comm_buffers=unsharded + rs, activations=sum(acts[:k]),
                         grads=grads + rg, temporaries=end + g_unit)
                    split = rs if backend == "gloo" else 0
                    # through torch 2.14 the last parameter's unsharded gradient stays, held by
                    # `foreach_reduce`'s loop variable until it returns (an untied LM head's, V x h, at
                    # the root; config.fsdp2_reduce_keeps_last_grad)
                    last_g = (prod(desc.unit_shapes(u)[-1]) * udt
                              if u in sizes and fsdp2_reduce_keeps_last_grad(train) else 0)
                    snap("backward", **base, comm_buffers=unsharded + rs + sizes[u][0] * red,
                         activations=sum(acts[:k]), grads=grads + rg, temporaries=end + split + last_g)
                    rs_held = rs
        k = next((i for i, s_ in enumerate(segs) if s_[0] == "root"), None)  # the root's last backward segment
        if later and not every_sync and sharding and st.fsdp1 and "root" in sizes and k is not None:
            # The first micro-step, without sync, at the root's last gradients (memory.estimate_memory walks
            # the same instant): every other unit's unsharded flat gradient is kept, none reduced, nothing
            # accumulated yet, and SHARD_GRAD_OP has freed no unit (`_should_free_in_backward` is False
            # without sync). Measured: Qwen2.5-0.5B at 8 layers, fsdp-grad-op fp32 over 2 micro-steps, its
            # tied 152K-vocabulary gradients next to every unit's: -4.69% without it.
            carry_now[0] = 0
            comm = root + (0 if reshard else sum(unsh[x] for x in held))
            kept_grads = sum(v[1] for x, v in sizes.items() if x != "root") * udt
            g_root = sizes["root"][1] * udt
            for (tmp, g, saved), w, before in instants(k):
                snap("backward", w, **base, comm_buffers=comm, activations=sum(acts[:k]) + saved,
                     grads=kept_grads, temporaries=tmp + min(g_root, max(g, root_grads(k, before, g))))
            snap("backward", **base, comm_buffers=comm + g_root, activations=sum(acts[:k]), grads=kept_grads,
                 temporaries=g_root)
        if (later and not every_sync and sharding and st.fsdp2 and prec.mixed and desc.tied
                and "root" in sizes and fsdp2_first_microstep_grads_in_reduce_dtype(train)):
            # torch 2.15, the first micro-step without sync (from the second step on; memory.estimate_memory
            # walks the same instant): its gradients land in reduce_dtype, so at the tied embedding's
            # backward its gradient and the head's are fp32 copies and their sum a third, next to every
            # other unit's unsharded gradient of this micro-step and the root's others; nothing accumulated
            # yet, every unit but the root resharded. Measured: GPT-2 medium, zero3 bf16-mixed over 2
            # micro-steps on 8 fake ranks, 15% above the peak walked without it.
            carry_now[0] = 0
            tied = sum(desc.tied)
            others = sum(n for u, n in numel.items() if u != "root") + max(0, numel["root"] - tied)
            snap("backward", **base, comm_buffers=root, grads=others * red, temporaries=3 * tied * red)
        grads_end = shard_params * sg if sharding else total * gb
        snap("optimizer", **base, grads=grads_end, temporaries=opt_tmp)

    if snapshots is not None:  # debugging: every instant the walk looked at
        snapshots[:] = snaps
    peak = max(snaps, key=lambda s: s.total)
    library = library_workspace_bytes(train, cluster.gpu_name, desc.linear_bias) if device == "cuda" else 0
    peak_allocated = max(s.total + e for s, e in zip(snaps, extra)) + library
    workspace = peak_allocated - peak.total
    # The reserved peak: the traced step's own allocations replayed through the caching allocator where
    # they are written (logged_module_events); a Hugging Face model whose own run is not written, or whose
    # embeddings are tied, pairs with the analytic front end's replay (module_result, pair_tied,
    # pair_reserved); else the allocated peak plus the margin
    # (memory.RESERVED_MARGIN). `reserved_source` says which.
    events = (logged_module_events(desc, train, family, world, shard, library, ws, rank, st.name, init)
              if device == "cuda" else None)
    # The CUDA context and each NCCL communicator's buffers (footprint.py); none on gloo or fake.
    fp = device_footprint(cluster, world if backend == "nccl" else 1, st.shard_group)
    return MemoryEstimate(st.name, dict(peak.parts), peak_allocated, peak.phase, fp.total,
                          cluster.gpu_memory_bytes, notes, workspace, footprint=fp,
                          reserved_replay=("events", events, train.alloc_conf) if events else None)


def logged_module_events(desc: ModuleDesc, train: "ModuleTrain", family: str, world: int, shard: int,
                         workspace: int = 0, conv_workspaces: dict | None = None,
                         rank: int | None = None, strategy: str = "", init: str = "device") -> tuple | None:
    """The events of the module's run (alloc_trace.logged_step_events; zero2 / zero3 sharded over more than
    one rank: alloc_trace.logged_fsdp2_events; FSDP1: alloc_trace.logged_fsdp1_events, the units'
    collectives where the trace marked FSDP's hooks) from its traced step's allocations, as a tuple (replay
    results are remembered by it; under activation checkpointing the log of the checkpointed trace,
    `ModuleDesc.alloc_log_every`; pure bf16: the cast after construction from `ModuleDesc.construct_built`);
    None where they are not written: FSDP2 on one rank, FSDP2 accumulating under mixed precision where the
    installed torch makes the first micro-step's gradients in fp32 (2.15), a log traced without the run's
    checkpointing,
    optimizers outside alloc_trace.LOGGED_OPTIMIZERS, and a profile
    without a log (another batch than the traced). `init` "device": the model built on the device, then
    wrapped (what the probes do); "meta": under FSDP built on the meta device and only this rank's shards
    materialized (alloc_trace.logged_fsdp2_events / logged_fsdp1_events `meta`: what a plan of a large model
    assumes, as the analytic front end's)."""
    pure, mixed = train.precision == "bf16", train.precision in ("bf16-mixed", "fp16-mixed")
    if (not desc.alloc_log or not desc.construct or train.optimizer not in LOGGED_OPTIMIZERS
            or train.precision not in ("fp32", "bf16-mixed", "fp16-mixed", "bf16")
            or (pure and not desc.construct_built) or checkpoint_every(train.checkpointing) != desc.alloc_log_every):
        return None
    built = desc.construct_built if pure else ()
    if (strategy in LOGGED_FSDP2 and mixed and train.grad_accum > 1 and not train.sync_every
            and fsdp2_first_microstep_grads_in_reduce_dtype(train)):
        return None  # torch 2.15's fp32 gradients of the first micro-step (the walk has them; the writer does not)
    if strategy in LOGGED_FSDP2 and shard > 1 and desc.alloc_grads and desc.construct_names:
        return tuple(logged_fsdp2_events(desc.construct, desc.construct_names, desc.alloc_log, desc.alloc_grads,
                                         desc.units, (desc.batch_bytes,) * train.grad_accum, shard,
                                         get_strategy(strategy).reshard_after_forward, mixed, train.optimizer,
                                         train.optimizer_impl, train.grad_accum, train.sync_every,
                                         fsdp2_reduce_keeps_last_grad(train), workspace, conv_workspaces,
                                         built, 2 if pure else 4, init == "meta"))
    if strategy in LOGGED_FSDP1 and desc.alloc_grads and desc.construct_names:
        return tuple(logged_fsdp1_events(desc.construct, desc.construct_names, desc.alloc_log, desc.alloc_grads,
                                         desc.units, (desc.batch_bytes,) * train.grad_accum, shard, strategy,
                                         mixed, desc.fp32_units, train.optimizer,
                                         train.optimizer_impl, train.grad_accum, train.sync_every, workspace,
                                         conv_workspaces, built, 2 if pure else 4, init == "meta"))
    if family not in LOGGED_FAMILIES:
        return None
    prec = train.prec
    shapes = desc.all_shapes()
    owned = _zero1_owned(shapes, shard, rank) if family == ZERO1 and shard > 1 else shapes
    autocast = mixed
    total = sum(prod(s) for s in shapes)
    buckets = (total * prec.grad_bytes,) if family in (DDP, ZERO1) else ()
    rebuilt = tuple(ddp_buckets(desc, prec.grad_bytes, DDP_BUCKET_CAP_MB, autocast)) if buckets else ()
    return tuple(logged_step_events(desc.construct, desc.alloc_log, desc.alloc_kept,
                                    (desc.batch_bytes,) * train.grad_accum, family, world,
                                    tuple(prod(s) * prec.param_bytes for s in owned), train.optimizer,
                                    train.optimizer_impl, train.grad_accum, buckets, rebuilt,
                                    tuple(sum(sizes) for _, sizes in desc.buffers), workspace,
                                    conv_workspaces, built))
