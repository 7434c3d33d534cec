"""What a traced step holds per segment, measured on fake tensors (`_SegmentTracker`), its allocation log,
and the convolutions' arguments that pick cuDNN's kernel (`conv_args`, `conv_key`)."""

from __future__ import annotations

from .census import _KernelCensus
from .layer_expansion import _frees_in_order, _post_backward_first


class _SegmentTracker:
    """What the forward and the backward hold, per segment, measured on fake tensors.

    Forward (`forward_mode`): after each op, the bytes alive of every storage the forward created, the
    highest per segment (`fwd_peak`); the convolutions' arguments and that figure when each runs; whether
    an addmm ran. Backward, below.

    A dispatch mode sees every op of the backward; each new output storage is kept as a weak reference
    (`StorageWeakRef`), so after every op the bytes autograd still references are known, as the
    allocator would see them. The segment an op belongs to: backward runs the segments in reverse, and a
    gradient hook on each segment's input (`mark_input`) fires when that segment's backward is done.
    Storages still alive when the backward ends are the parameters' gradients. After each op, three
    figures of the current segment: `transient` (the other storages the backward created and still
    holds: gradients of activations), `grads` (this segment's parameter gradients created so far) and
    `saved` (this segment's saved tensors not yet freed). Per segment the instant where their sum is
    highest is kept: the planner's walk adds the segments before (their saved tensors, the gradients
    already reduced) and the strategy's own buffers to it."""

    def __init__(self, torch):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        self._torch, self._ref = torch, StorageWeakRef
        self.census = _KernelCensus(torch)
        self.live: dict = {}  # storage key -> (weak ref, bytes, unique id)
        self.born: dict = {}  # unique id -> segment it was created in
        self.saved: dict = {}  # segment -> [(weak ref, bytes)] of the storages it saved for backward
        self.timeline: list = []  # (segment, [(unique id, bytes) alive], saved bytes of it alive, started)
        self.segment = None  # None: the loss (the last segment) until its input's hook fires
        self.started: set = set()  # segments whose unit's output gradient is ready (`mark_output`)
        self.survivors: set = set()
        self.accumulated_at: dict = {}  # unique id of a parameter's gradient -> timeline length when it was
        # accumulated (`Tensor.register_post_accumulate_grad_hook`: after its AccumulateGrad)
        self._uid = 0
        self._log_uid = 0
        # The step's allocations in host order, as the caching allocator would see them (the planner's
        # allocator replay of a module, module_plan.logged_module_events): [1, id, bytes] when an op's
        # output storage is new, [0, id] when a storage the step made is gone (found after each op: what the
        # previous one's callers dropped), [2, key] where a convolution's cuDNN workspace is taken and given
        # back (its size is measured on a GPU). Parameters, buffers and the input batch are not in it.
        # Where FSDP's hooks run (module_plan's FSDP2 events, alloc_trace.logged_fsdp2_events): [3, unit] a
        # unit's forward starts (its pre-forward hook: the unshard), [4, unit] it ends (the reshard after
        # forward), [5, unit] its outputs' gradient is ready (pre-backward: unshard and prefetch), [6, unit]
        # its inputs' gradient is (post-backward: reshard and reduce-scatter), [7, unit] every gradient of its
        # parameters is accumulated (FSDP1's post-backward hook, on its flat parameter's AccumulateGrad).
        self.log: list = []
        self.grad_names: dict = {}  # log id of a parameter's gradient (as AccumulateGrad keeps it) -> its name
        self.logging = True
        self._log_live: dict = {}  # storage key -> (weak ref, id)
        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker.census.count(tracker.segment if tracker.segment is not None else tracker._last, "backward",
                                     func, args, kwargs or {}, out)
                outs, ins = tree_leaves(out), tree_leaves((args, kwargs))
                tracker._log(outs, ins)
                tracker._after(outs, ins)
                if func is torch.ops.aten.convolution_backward.default:
                    tracker._kernel(conv_args(args, "backward"))
                    if tracker.logging:
                        tracker.log.append([2, conv_key(conv_args(args, "backward"))])
                return out

        self._mode = _Mode()
        self.kernels: dict = {}  # segment -> [{"phase", "args", "at"}]: convolutions (cuDNN workspaces)
        self.linear_bias = False  # an addmm in forward: cuBLASLt's workspace on CUDA
        self.forward_segment = lambda: 0

        self.fwd_live: dict = {}  # storage key -> (weak ref, bytes): what the forward created
        self.fwd_peak: dict = {}  # segment -> highest bytes alive of what the forward created
        self.not_activations: set = set()  # parameters and the input batch

        class _Forward(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten.addmm.default:
                    tracker.linear_bias = True
                out = func(*args, **(kwargs or {}))
                tracker.census.count(tracker.forward_segment(), "forward", func, args, kwargs or {}, out)
                outs, ins = tree_leaves(out), tree_leaves((args, kwargs))
                tracker._log(outs, ins)
                alive = tracker._forward_after(outs, ins)
                if func is torch.ops.aten.convolution.default:  # with its output alive, as cuDNN runs
                    tracker.kernels.setdefault(tracker.forward_segment(), []).append(
                        {"phase": "forward", "args": conv_args(args, "forward"), "at": alive})
                    if tracker.logging:
                        tracker.log.append([2, conv_key(conv_args(args, "forward"))])
                return out

        self.forward_mode = _Forward()

    def _created(self, outs, ins, live: dict):
        """(key, storage) of each output storage an op allocated: not one of its inputs' (views, detach
        -- how saved tensors come back -- and in-place ops return an input's storage) and not already
        alive. `live` is pruned of freed storages first: a freed storage's address (the key) comes back."""
        Tensor = self._torch.Tensor
        for k in [k for k, v in live.items() if v[0].expired()]:
            del live[k]
        aliased = {t.untyped_storage()._cdata for t in ins if isinstance(t, Tensor)}
        for t in outs:
            if isinstance(t, Tensor):
                st = t.untyped_storage()
                k = st._cdata
                if k not in live and k not in aliased:
                    yield k, st

    def _log_frees(self) -> None:
        for k in [k for k, v in self._log_live.items() if v[0].expired()]:
            self.log.append([0, self._log_live.pop(k)[1]])

    def _log(self, outs, ins) -> None:
        """After each op of the step: the storages gone since the last one, then the op's new outputs."""
        if not self.logging:
            return
        self._log_frees()
        aliased = {t.untyped_storage()._cdata for t in ins if isinstance(t, self._torch.Tensor)}
        for t in outs:
            if isinstance(t, self._torch.Tensor):
                st = t.untyped_storage()
                k = st._cdata
                # (a zero-byte storage takes no block: CUDA's allocator returns no memory for it)
                if (k not in self._log_live and k not in aliased and k not in self.not_activations
                        and st.nbytes()):
                    self._log_uid += 1
                    self._log_live[k] = (self._ref(st), self._log_uid)
                    self.log.append([1, self._log_uid, int(st.nbytes())])

    def close_log(self) -> dict:
        """The step's log once its tensors are dropped: {"events": the log, "kept": the ids still alive
        (the parameters' gradients, which `zero_grad(set_to_none=True)` drops after the optimizer step),
        "grads": [[id, parameter name], ...] of those}."""
        self._log_frees()
        return {"events": _post_backward_first(_frees_in_order(self.log)), "kept": sorted(v[1] for v in self._log_live.values()),
                "grads": sorted([i, n] for i, n in self.grad_names.items())}

    def log_marker(self, kind: int, unit: str | None) -> None:
        """A unit's hook point in the log (kinds 3-6, see `log`), after the frees of the op before."""
        if self.logging and unit is not None:
            self._log_frees()
            self.log.append([kind, unit])

    def _forward_after(self, outs, ins) -> int:
        """After each forward op: the bytes alive of every storage the forward created (saved or not:
        the probes' tracker counts them all as activations while the forward runs)."""
        for k, st in self._created(outs, ins, self.fwd_live):
            if k not in self.not_activations:
                self.fwd_live[k] = (self._ref(st), int(st.nbytes()))
        seg = self.forward_segment()
        alive = sum(v[1] for v in self.fwd_live.values())
        self.fwd_peak[seg] = max(self.fwd_peak.get(seg, 0), alive)
        return alive

    def mark_input(self, args, index: int, unit: str | None = None) -> None:
        fired = []

        def done(_grad, index=index):
            self.segment = index - 1
            if not fired:  # once, at the first input's gradient (FSDP2's RegisterPostBackwardFunction)
                fired.append(1)
                self.log_marker(6, unit)
        for a in args:
            if isinstance(a, self._torch.Tensor) and a.requires_grad:
                a.register_hook(done)

    def mark_output(self, outs, index: int, unit: str | None = None) -> None:
        """A gradient hook on the outputs of segment `index`'s unit: it fires when their gradient is
        ready, where FSDP's pre-backward hook (registered on the same outputs) unshards the unit and
        prefetches the next; the segment's ops before it (functional ops after the unit's forward:
        ReLU, pooling) run without them."""
        def started(_grad, index=index):
            if index not in self.started:
                self.log_marker(5, unit)
            self.started.add(index)
        for a in outs:
            if isinstance(a, self._torch.Tensor) and a.requires_grad:
                a.register_hook(started)

    def mark_accumulated(self, param, name: str | None = None) -> None:
        """A parameter's AccumulateGrad has run (its post-accumulate-grad hook): the timeline entries before
        this instant are those where its new gradient was made and not yet accumulated."""
        g = param.grad
        if g is None:
            return
        logged = self._log_live.get(g.untyped_storage()._cdata)
        if logged is not None and name is not None:
            self.grad_names.setdefault(logged[1], name)
        hit = self.live.get(g.untyped_storage()._cdata)
        if hit is not None:
            self.accumulated_at.setdefault(hit[2], len(self.timeline))

    def mark_saved(self, storage, nbytes: int, index: int) -> None:
        self.saved.setdefault(index, []).append((self._ref(storage), nbytes))

    def _after(self, outs, ins) -> None:
        seg = self.segment if self.segment is not None else self._last
        for k, st in self._created(outs, ins, self.live):
            self._uid += 1
            self.live[k] = (self._ref(st), int(st.nbytes()), self._uid)
            self.born[self._uid] = seg
        saved = sum(n for ref, n in self.saved.get(seg, ()) if not ref.expired())
        self.timeline.append((seg, [(v[2], v[1]) for v in self.live.values()], saved, seg in self.started))

    def _kernel(self, args: dict) -> None:
        """A backward convolution: where it runs and what is alive then (its outputs included; cuDNN
        takes its workspace while they exist)."""
        seg, alive, saved, _ = self.timeline[-1]
        self.kernels.setdefault(seg, []).append({"phase": "backward", "args": args, "at": (alive, saved)})

    def run(self, loss, n_segments: int) -> None:
        self._last = n_segments - 1
        with self._mode:
            loss.backward()
        self.survivors = {v[2] for v in self.live.values() if not v[0].expired()}

    def _split(self, seg, alive, saved) -> tuple:
        trans = sum(n for uid, n in alive if uid not in self.survivors)
        grads = sum(n for uid, n in alive if uid in self.survivors and self.born[uid] == seg)
        return trans, grads, saved

    def segment_peaks(self, started: bool | None = None) -> dict:
        """{segment index: (transient, grads, saved) at the instant of its backward where their sum
        is highest}; with `started` only among the instants after (True) or before (False) the
        segment's unit output gradient is ready (`mark_output`)."""
        peaks: dict = {}
        for seg, alive, saved, s in self.timeline:
            if started is not None and s != started:
                continue
            t = self._split(seg, alive, saved)
            if seg not in peaks or sum(t) > sum(peaks[seg]):
                peaks[seg] = t
        return peaks

    def segment_peaks_accumulating(self, started: bool | None = None) -> dict:
        """As `segment_peaks` for a micro-step after the first of gradient accumulation, where every
        parameter already has a .grad and AccumulateGrad adds each new gradient into it in place
        (torch/csrc/autograd/functions/accumulate_grad.h `accumulateGrad`: `variable_grad += new_grad`
        outside grad mode) and frees it: {segment index: (transient, fresh, saved)} at the instant where
        their sum is highest, `fresh` being the bytes of the parameters' gradients made and not yet
        accumulated at that instant (all of them: a tied LM head's, summed with the embedding's in
        autograd's input buffer, is accumulated only after the embedding's backward). The kept .grad
        itself is the walk's (every unit's, from the first micro-step on)."""
        peaks: dict = {}
        never = len(self.timeline) + 1
        for i, (seg, alive, saved, s) in enumerate(self.timeline):
            if started is not None and s != started:
                continue
            trans = fresh = 0
            for uid, n in alive:
                if uid not in self.survivors:
                    trans += n
                elif self.accumulated_at.get(uid, never) > i:
                    fresh += n
            t = (trans, fresh, saved)
            if seg not in peaks or sum(t) > sum(peaks[seg]):
                peaks[seg] = t
        return peaks

    def segment_grads(self) -> dict:
        """{segment index: bytes of the parameters' gradients (the storages alive when the backward ends)
        made in its backward}: its unit's own, and those of the root's ops that ran after the unit in
        forward (a decoder's final norm and LM head join the last block's segment)."""
        made: dict = {}
        for _, n, uid in self.live.values():
            if uid in self.survivors:
                made[self.born[uid]] = made.get(self.born[uid], 0) + n
        return made

    def segment_ends(self) -> dict:
        """{segment index: transient bytes alive when its backward is over}, read at the next segment's
        first op: the gradient it passes on, plus whatever waits in autograd's buffers (a tied LM head's
        gradient until the embedding's half arrives)."""
        ends: dict = {}
        prev = None
        for seg, alive, saved, _ in self.timeline:
            if prev is not None and seg != prev and prev not in ends:
                # the next segment's first op: what is still alive of the earlier ones (a storage
                # the last op of `prev` replaced is gone by now, as when FSDP's post-backward runs)
                ends[prev] = sum(n for uid, n in alive if uid not in self.survivors and self.born[uid] != seg)
            prev = seg
        if self.timeline and prev not in ends:
            # the last segment (the root's first ops) has no next one: what is alive at its first op
            _, alive, saved, _ = next(e for e in self.timeline if e[0] == prev)
            ends[prev] = self._split(prev, alive, saved)[0]
        return ends

    def segment_kernels(self, seg: int, saved_before: int) -> list:
        """The segment's convolutions: {"phase", "key", "args", "at"}: in backward (transient, grads,
        saved) as `segment_peaks`; in forward [bytes alive of what the forward created, less the
        earlier segments' saved tensors (`saved_before`)], as the segments' `forward_bytes`."""
        out = []
        for k in self.kernels.get(seg, ()):
            if k["phase"] == "forward":
                at = [max(0, k["at"] - saved_before)]
            else:
                at = list(self._split(seg, *k["at"]))
            out.append({"phase": k["phase"], "key": conv_key(k["args"]), "args": k["args"], "at": at})
        return out


def conv_args(args, phase: str) -> dict:
    """The arguments of aten.convolution (forward) or aten.convolution_backward that pick cuDNN's
    kernel, as plain data: enough to run the same call on a GPU (`planner/workload/kernel_workspace.py`)."""
    if phase == "forward":
        x, w, b, stride, padding, dilation, transposed, out_pad, groups = args[:9]
        mask = None
    else:
        _g, x, w, b, stride, padding, dilation, transposed, out_pad, groups, mask = args[:11]
        b = b is not None
        mask = [bool(m) for m in mask]
    return {"phase": phase, "input": list(x.shape), "weight": list(w.shape), "bias": bool(b is not None
            if phase == "forward" else b), "stride": list(stride), "padding": list(padding),
            "dilation": list(dilation), "transposed": bool(transposed), "output_padding": list(out_pad),
            "groups": int(groups), "dtype": str(x.dtype).replace("torch.", ""), "output_mask": mask}


def _ints(v) -> str:
    return ",".join(map(str, v))


def conv_key(args: dict) -> str:
    """One line naming a convolution call: the key of its measured workspace."""
    a = args
    return (f"conv {a['phase']} x={'x'.join(map(str, a['input']))} w={'x'.join(map(str, a['weight']))} "
            f"s={_ints(a['stride'])} p={_ints(a['padding'])} d={_ints(a['dilation'])} g={a['groups']}"
            f"{' T' + _ints(a['output_padding']) if a['transposed'] else ''} {a['dtype']}"
            + (f" mask={''.join('1' if m else '0' for m in a['output_mask'])}" if a["output_mask"] else ""))
