"""The trace front end's memory walk, phase by phase (module_memory.walk_module_memory): `ModuleWalk` holds
what every strategy family's walk shares (the optimizer state, the forward segments under checkpointing,
each segment's forward and backward instants, the snapshots walked); `DdpWalk` walks DDP and ZeRO-1 (and a
single rank), module_walk_fsdp.FsdpWalk FSDP1 and FSDP2. Every size is in bytes unless named `*_elems`."""

from __future__ import annotations

from math import prod

from .config import Cluster, checkpoint_every
from .memory import COMPONENTS, Snapshot
from .module_desc import ModuleDesc, ModuleTrain, _autocast_cast_bytes, _regime, _shard_group, _unit_sizes, _zero1_owned
from .precision import optimizer_state_elems
from .strategies import Strategy


class ModuleWalk:
    """One walk of a measured module's step for one strategy: its shared state, set up in the order the
    step's phases need it, and `snaps` (the instants walked) with `workspace_bytes` (the cuDNN workspace
    taken at each instant). `pb`, `gb`, `cb`: bytes of a parameter, a gradient and a compute-dtype element;
    `optimizer_bytes` the optimizer state on this rank, `optimizer_tmp_bytes` the optimizer step's
    temporaries."""

    def __init__(self, desc: ModuleDesc, train: ModuleTrain, cluster: Cluster, st: Strategy, device: str,
                 backend: str, workspaces: dict | None, rank: int | None):
        self.desc, self.train, self.st, self.backend = desc, train, st, backend
        self.family = st.family
        self.world, self.shard = _shard_group(st, cluster)
        self.prec = prec = train.prec
        self.pb, self.gb, self.cb = prec.param_bytes, prec.grad_bytes, prec.compute_bytes
        self.notes: list[str] = []
        self.shapes = desc.all_shapes()
        self.total = desc.param_count()
        self.largest = max((prod(s) for s in self.shapes), default=0)
        self.fsdp = st.fsdp
        self.sharding = self.fsdp and self.shard > 1 and st.shards_params
        self.sizes = _unit_sizes(desc, self.family, self.shard, self.sharding) if self.fsdp else {}
        self.optimizer_bytes, self.optimizer_tmp_bytes = self._optimizer_bytes(rank)
        self._checkpointed_segments()
        self._convolution_kernels(device, workspaces)
        self._root_gradients()
        self._forward_peaks()
        self.later, self.every_sync = train.grad_accum > 1, train.sync_every  # as memory.estimate_memory

    def _optimizer_bytes(self, rank: int | None) -> tuple[int, int]:
        """(the optimizer state's bytes on this rank, the optimizer step's temporaries' bytes)."""
        st, shard, shapes, sizes, train, pb = self.st, self.shard, self.shapes, self.sizes, self.train, self.pb
        # Optimizer state (precision.optimizer_state_elems) on this rank's elements.
        if st.zero_optimizer and shard > 1:
            owned = _zero1_owned(shapes, shard, rank)
            elems, extra = optimizer_state_elems(train.optimizer, owned)
            step_elems = sum(prod(s) for s in owned)
        elif self.sharding:
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
            step_elems = self.total
        opt = elems * pb + int(extra)
        if train.optimizer in ("adam", "adamw"):
            opt_tmp = {"foreach": step_elems * pb, "for-loop": 2 * min(self.largest, step_elems) * pb}.get(
                train.optimizer_impl, 0)
        elif train.optimizer == "adafactor":
            opt_tmp = 2 * self.largest * pb
        else:
            opt_tmp = 0
        return opt, opt_tmp

    def _checkpointed_segments(self) -> None:
        """The forward segments (`segs`) and each one's saved bytes (`acts`) under the step's checkpointing:
        `ckpt` which segments are checkpointed, `kept_in` the input bytes a checkpointed one keeps."""
        desc, train = self.desc, self.train
        # Forward segments, with checkpointing.
        segs = [s for s in desc.segments if s[0] != "loss"]
        self.loss_act = sum(s[1] for s in desc.segments if s[0] == "loss")
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
            self.notes.append(f"{train.checkpointing} checkpointing is not defined for an arbitrary module: "
                              f"planned as none")
        self.segs, self.acts, self.every, self.kept_in, self.ckpt = segs, acts, every, kept_in, ckpt
        self.inputs = [s[2] for s in segs] + [desc.output_bytes]
        self.ends = [s[6] for s in segs]  # transient bytes at each segment's backward end (measured)
        self.out_tmp = desc.output_bytes
        self.buffers = desc.buffers_bytes

    def _convolution_kernels(self, device: str, workspaces: dict | None) -> None:
        """Each segment's convolutions with the cuDNN workspace (bytes) they take, forward and backward."""
        self.snaps: list[Snapshot] = []
        self.workspace_bytes: list[int] = []  # cuDNN workspace taken at each snapshot's instant
        self.ws = ws = workspaces if device == "cuda" and workspaces else {}
        self.fwd_kernels: dict = {}  # segment -> [(workspace, (forward bytes,))]
        self.bwd_kernels: dict = {}  # segment -> [(workspace, (transient, grads, saved))]
        for i, phase, key, at in self.desc.kernels:
            if i < len(self.segs) and key in ws:
                (self.fwd_kernels if phase == "forward" else self.bwd_kernels).setdefault(i, []).append((ws[key], at))

    def record(self, phase, workspace=0, **parts):
        """One instant walked: its components (bytes) and the cuDNN workspace it takes."""
        full = {k: 0 for k in COMPONENTS}
        for k, v in parts.items():
            full[k] += int(v)
        # the step's input batches, one per micro-step, alive through the step (a loader hands the step
        # its micro-batches together; the probe makes them before the first forward)
        full["temporaries"] += self.desc.batch_bytes * self.train.grad_accum
        self.snaps.append(Snapshot(phase, full))
        self.workspace_bytes.append(int(workspace))

    def snap(self, phase, workspace=0, **parts):
        """An instant of the walk: `record`, with what the strategy family's walk adds to every instant."""
        self.record(phase, workspace, **parts)

    def instants(self, k: int, split: tuple = (), kernel_grads: bool = True):
        """Segment k's backward: its measured peaks before and after its unit's output gradient is
        ready (no workspace), then each convolution's instant with its workspace (after), as
        ((transient, own grads, saved), workspace, before). With full checkpointing the unit's saved
        tensors are the recomputed ones, made after the hook (temporaries). `split`: other per-segment
        (before, after) peaks than the profile's `backward` (ModuleDesc.backward_accumulating);
        `kernel_grads` False: no gradients at the convolutions' instants."""
        desc, segs, ckpt, kept_in = self.desc, self.segs, self.ckpt, self.kept_in
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
        for w, at in self.bwd_kernels.get(k, ()):
            g = at[1] if kernel_grads else 0
            if ckpt[k]:
                yield (at[0] + at[2], g, self.acts[k]), w, False
            else:
                yield (at[0], g, at[2]), w, False

    def instants_accumulating(self, k: int):
        """`instants` of a micro-step after the first of gradient accumulation, every .grad already there:
        ((transient, fresh, saved), workspace, before), `fresh` the new gradients made and not yet added in
        place into their .grad (ModuleDesc.backward_accumulating); a profile without them counts none,
        and a convolution's instant counts none."""
        accumulating = self.desc.backward_accumulating
        if accumulating:
            yield from self.instants(k, accumulating, kernel_grads=False)
            return
        for (tmp, _g, saved), w, before in self.instants(k):
            yield (tmp, 0, saved), w, before

    def _root_gradients(self) -> None:
        """`root_g`: bytes of the root's gradients made in each segment; `numel`: each unit's parameters."""
        desc, segs, prec = self.desc, self.segs, self.prec
        # Gradients of the root's parameters made in another unit's segment: the root's own ops that run
        # after that unit (a decoder's final norm and LM head, after its last block) join its segment,
        # ahead of the unit's output gradient (the "before" instant). They stay alive until the root
        # reduces at the very end of backward (FSDP: the root's post-backward; DDP: .grad).
        # The gradients the segment's backward made (measured: the storages alive when the whole backward
        # ends) less its unit's own (in the traced dtype). A profile without that figure: the segment's
        # gradients at its before-hook instant, which misses a root gradient still autograd's transient at
        # that instant (a 16-bit LM head's at long sequences: Llama-3-8B's 1 GiB at 1024 tokens).
        # the trace's parameters' dtype
        traced_gb = 2 if prec.mixed and self.fsdp or self.train.precision == "bf16" else 4
        self.numel = {u: sum(prod(s) for _, s in ps) for u, ps in desc.units}  # each unit's parameters, real shapes
        own_g = {u: n * traced_gb for u, n in self.numel.items()}
        self.root_grad_bytes = [0 if s[0] == "root" else max(0, s[7] - own_g.get(s[0], 0)) if s[7] >= 0 else s[3][0][1]
                       for s in segs]

    def root_grads(self, k: int, before: bool, g: int) -> int:
        """Bytes of root gradients alive at segment k's instant: those of the segments after it, plus
        this segment's so far (at its before-hook instant, `g` itself)."""
        return sum(self.root_grad_bytes[k + 1:]) + (g if before else self.root_grad_bytes[k])

    def _forward_peaks(self) -> None:
        """Each segment's forward peak: `fwd_act` the activations' bytes, `fwd_tmp` the transient's;
        `loss_fwd` the loss's forward (activations), `all_acts` every saved tensor at the forward's end."""
        desc, segs, acts, ckpt, inputs = self.desc, self.segs, self.acts, self.ckpt, self.inputs
        self.all_acts = sum(acts) + self.loss_act
        # Segment k's forward at its measured peak: the earlier segments' saved tensors plus what its own
        # forward holds (saved so far, its input, intermediates: a block's two branches before their sum);
        # the probes' tracker counts all of it as activations. Checkpointed: its input and its output.
        # Checkpointed, the transient its forward holds beyond what it saves and its input (the root's ops
        # after a decoder's last block: logits and their fp32 copy at the loss) is there too; and under
        # autocast the 16-bit casts of every checkpointed unit's weights so far stay in autocast's cache until
        # the forward ends (`autocast_mode.cpp` cached_casts), though the unit saves none of them.
        casts = (_autocast_cast_bytes(desc)
                 if self.every and _regime(self.train.precision, self.family).startswith("autocast") else {})
        cached = [sum(casts.get(x[0], 0) for x, c in zip(segs[:k + 1], ckpt) if c) for k in range(len(segs))]
        self.fwd_act = [sum(acts[:k + 1]) + max(0, s[4] - s[1] - s[2]) + cached[k] if c
                        else sum(acts[:k]) + s[4] + cached[k] for k, (s, c) in enumerate(zip(segs, ckpt))]
        # (a checkpointed segment's output is a transient, unless the root's ops after the unit saved it: the MNIST
        # CNN's ReLUs, whose outputs are in `outside`; measured, zero3 fp32 over 2 micro-steps, +1.1% counting it twice)
        self.fwd_tmp = [inputs[k + 1] if c and k + 1 not in desc.saved_inputs else 0 for k, c in enumerate(ckpt)]
        self.loss_fwd = [] if self.every else [sum(acts) + s[4] for s in desc.segments if s[0] == "loss"]

    def fwd_instants(self, k: int):
        """Segment k's forward: its peak (no workspace), then each convolution's instant with its
        workspace, as (activations, temporaries, workspace); unmeasured, the peak bounds them."""
        yield self.fwd_act[k], self.fwd_tmp[k], 0
        for w, at in self.fwd_kernels.get(k, ()):
            yield (self.fwd_act[k], self.fwd_tmp[k], w) if self.ckpt[k] else (sum(self.acts[:k]) + at[0], 0, w)


class DdpWalk(ModuleWalk):
    """The walk of a strategy that keeps every parameter on every rank (DDP, ZeRO-1, a single rank)."""

    def snap(self, phase, workspace=0, grads=0, **parts):
        if self.later:
            # Accumulation: every .grad is alive from the first micro-step on, later gradients added in
            # place (AccumulateGrad), synced or not (memory.estimate_memory's DDP walk).
            grads = max(grads, self.total * self.gb) if phase != "optimizer" else grads
        self.record(phase, workspace, grads=grads, **parts)

    def walk(self) -> None:
        """The step's forward, backward and optimizer step, instant by instant into `snaps`."""
        total, gb = self.total, self.gb
        self.unit_grad = {u: n * gb for u, n in self.numel.items()}
        self.base = dict(params=total * self.pb + self.buffers, optimizer=self.optimizer_bytes,
                         comm_buffers=total * gb if self.st.distributed else 0)
        if self.later:
            self.notes.append("gradient accumulation keeps every parameter's gradient between micro-steps")
        self.forward()
        self.backward()
        self.snap("optimizer", **self.base, grads=total * gb, temporaries=self.optimizer_tmp_bytes)

    def forward(self) -> None:
        base, snap = self.base, self.snap
        for k in range(len(self.segs)):
            for a, t, w in self.fwd_instants(k):
                snap("forward", w, **base, activations=a, temporaries=t)
        for a in self.loss_fwd:
            snap("forward", **base, activations=a)
        snap("forward", **base, activations=self.all_acts, temporaries=self.out_tmp)
        snap("backward", **base, activations=self.all_acts, temporaries=2 * self.out_tmp)

    def backward(self) -> None:
        base, snap, segs, acts, later, unit_grad = \
            self.base, self.snap, self.segs, self.acts, self.later, self.unit_grad
        reached: set = set()
        for k in range(len(segs) - 1, -1, -1):
            u = segs[k][0]
            own = unit_grad.get(u, 0) if u not in reached else 0
            reached.add(u)
            done = sum(unit_grad.get(x, 0) for x in reached if x != u)
            for (tmp, g, saved), w, before in (self.instants_accumulating(k) if later else self.instants(k)):
                if later:  # every .grad is kept (`snap` above); the new gradients not yet added in: temporaries
                    snap("backward", w, **base, activations=sum(acts[:k]) + saved, temporaries=tmp + g)
                    continue
                rg = self.root_grads(k, before, g)
                if u == "root":
                    mine = min(max(0, own - rg), g)
                else:  # after the hook, g also counts the root's gradients made before it
                    mine = 0 if before else min(own, max(0, g - self.root_grad_bytes[k]))
                snap("backward", w, **base, activations=sum(acts[:k]) + saved,
                     grads=done + mine + (rg if u != "root" else min(rg, own)), temporaries=tmp)
