"""What a probe measures on one rank: live tensor memory by category, collectives, step time.

`Tracker` is one `TorchDispatchMode`, entered before the model exists and left after the measured
steps. It does two jobs, because both need to see every op, including the ones issued from C++
(DDP's reducer, autograd's gradient accumulation) and from backward hooks:

- Memory: every untyped storage an op returns is recorded with its bytes, the phase it was created in
  and a sequence number; a weakref on the (preserved) Python storage object removes it when the
  storage dies, and `UntypedStorage.resize_` is patched (FSDP1 and FSDP2 free and re-allocate
  unsharded parameters that way, outside the dispatcher). Live bytes have a running peak; the state at
  the peak is classified into the planner's categories: `params` (the wrapped model's parameter
  storages: DTensor locals for FSDP2, `_local_shard` of FSDP1 flat parameters), `grads` (their `.grad`,
  FSDP1's saved grad shard), `optimizer` (optimizer.state tensors), `comm_buffers` (any other storage
  that a collective read or wrote: DDP buckets, FSDP all-gather / reduce-scatter buffers, unsharded
  flat parameters), `activations` (created during forward, still alive) and `temporaries` (the rest:
  input batch, logits' gradients, optimizer-step intermediates).
- Collectives: every `c10d.*` and `_c10d_functional.*` op, normalised to all_reduce / all_gather /
  reduce_scatter / broadcast / all_to_all / barrier (others keep their own name), with its group size,
  dtype and message bytes (all_gather: the gathered output; reduce_scatter: the pre-scatter input;
  others: the tensor), counted only while `counting` is on.

PyTorch's `torch.distributed._tools.MemTracker` / `FSDPMemTracker` were the first choice; they only
track storages created inside the tracker and attribute them by module hooks, so DDP's reducer
buckets (created at wrap time), FSDP1 flat parameters and ZeroRedundancyOptimizer's state are
misattributed or missed; this tracker classifies by role at the peak instead.

Known limitations: with activation checkpointing, block activations recomputed during backward are
created in the backward phase and so count as temporaries, not activations. Allocations made inside a single op and freed before it returns (kernel
workspaces, gloo/NCCL internal buffers, cuBLAS workspace) are invisible; on GPU the headline peak is
`torch.cuda.max_memory_allocated`, and the tracker's own peak is reported beside it.
"""

from __future__ import annotations

import os
import time
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # a torch built without distributed
    _DTensor = None

CATEGORIES = ("params", "grads", "optimizer", "activations", "comm_buffers", "temporaries")

# c10d op -> (normalised name, which argument carries the message: "out" | "in" | "both")
_C10D = {
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
    "allgather_": ("all_gather", 0), "_allgather_base_": ("all_gather", 0),
    "allgather_coalesced_": ("all_gather", 0), "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "reduce_scatter_": ("reduce_scatter", 1), "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "broadcast_": ("broadcast", 0), "alltoall_": ("all_to_all", 1), "alltoall_base_": ("all_to_all", 1),
    "barrier": ("barrier", None), "monitored_barrier_": ("barrier", None),
    "reduce_": ("reduce", 0), "gather_": ("gather", 1), "scatter_": ("scatter", 0),
    "send": ("send", 0), "recv_": ("recv", 0), "recv_any_source_": ("recv", 0),
}
# _c10d_functional op -> (normalised name, index of the message argument (-1: the output), group arg index)
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", 0, 2), "all_reduce_": ("all_reduce", 0, 2),
    "all_reduce_coalesced": ("all_reduce", 0, 2), "all_reduce_coalesced_": ("all_reduce", 0, 2),
    "all_gather_into_tensor": ("all_gather", -1, 2), "all_gather_into_tensor_out": ("all_gather", -1, 2),
    "all_gather_into_tensor_coalesced": ("all_gather", -1, 2),
    "reduce_scatter_tensor": ("reduce_scatter", 0, 3), "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0, 3),
    "broadcast": ("broadcast", 0, 2), "broadcast_": ("broadcast", 0, 2),
    "all_to_all_single": ("all_to_all", 0, 3),
}


def _tensors(x) -> list:
    """Plain tensors in a pytree; wrapper subclasses (DTensor) are replaced by their inner tensors."""
    out = []
    for t in tree_flatten(x)[0]:
        if isinstance(t, torch.Tensor):
            out.extend(_inner(t))
    return out


def _inner(t) -> list:
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        return [u for a in attrs for u in _inner(getattr(t, a))]
    return [t]


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _storage(t):
    try:
        if t.device.type == "meta":
            return None
        return t.untyped_storage()
    except Exception:  # sparse, nested, or a subclass without storage
        return None


def storage_key(t) -> int | None:
    """The tracker's key for the storage behind `t` (None: no storage)."""
    st = _storage(t)
    return None if st is None else id(st)


SETTLE_S = 0.005
"""Without /proc (not Linux): how long a gloo `Work.wait()` is extended for gloo's worker thread to let
go of the work's buffers (see `Tracker.settle_waits`)."""
QUIESCE_POLL_S = 5e-5
"""How often `quiesce_gloo_workers` looks at gloo's worker threads (the GIL is released in between)."""
QUIESCE_LIMIT_S = 0.5
"""Give up waiting for gloo's worker threads after this long (counted in `Tracker.quiesce_timeouts`)."""
GLOO_WORKER_THREAD = "pt_gloo_runloop"
"""The name ProcessGroupGloo gives its worker threads (/proc/self/task/TID/comm)."""


def _gloo_worker_tids() -> list[str] | None:
    """Thread ids of this process's gloo worker threads; None where /proc is not there."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    out = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == GLOO_WORKER_THREAD:
                    out.append(tid)
        except OSError:
            pass
    return out


def _thread_states(tids: list[str]) -> list:
    """(scheduler state, voluntary + involuntary context switches) per thread; None for a gone thread."""
    out = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/self/task/{tid}/status") as f:
                switches = sum(int(ln.split()[1]) for ln in f if "ctxt_switches" in ln)
            out.append((state, switches))
        except (OSError, ValueError, IndexError):
            out.append(None)
    return out


def quiesce_gloo_workers(limit_s: float = QUIESCE_LIMIT_S) -> bool:
    """Sleep (the GIL released) until every gloo worker thread of this process is blocked and stays
    blocked, context switches unchanged, across one poll: then none is running or waiting for the GIL,
    so none still holds a finished collective's buffers (see `Tracker.settle_waits`). True when they
    settled, False after `limit_s`. Without /proc: a plain `SETTLE_S` sleep, True."""
    tids = _gloo_worker_tids()
    if tids is None:
        time.sleep(SETTLE_S)
        return True
    if not tids:
        return True
    deadline = time.perf_counter() + limit_s
    prev = None
    while True:
        time.sleep(QUIESCE_POLL_S)
        cur = _thread_states(tids)
        if cur == prev and all(x is not None and x[0] in "SD" for x in cur):
            return True
        if time.perf_counter() > deadline:
            return False
        prev = cur


class Tracker(TorchDispatchMode):
    """Live storages with a classified peak, and a collective counter. See the module docstring.

    `settle_waits` (the probe sets it on gloo): gloo runs a collective on its worker threads
    (`pt_gloo_runloop`), and the worker holds the Work, with the collective's input and output
    tensors, until a moment after the caller's `Work.wait()` has returned. When the caller drops its
    own references first (FSDP2 drops the all-gather output right after the copy-out), the worker
    thread is the last owner and frees the buffers; that needs the GIL (the tracker's weak references
    give each storage a Python object), which the caller's thread holds while it runs on, up to the
    interpreter's 5 ms switch interval. How long a buffer outlives its collective then depended on the
    OS scheduler: zero3 on llama-tiny, gloo, 2 ranks, measured 8,518,500 B in some runs and 8,716,132 B
    in others (block 1's 721 KiB all-gather output alive through block 1's whole backward, up to block
    0's all-gather), and the MNIST CNN under FSDP2 14.66 vs 15.77 MiB. With `settle_waits`, every
    `Work.wait()` (warm-up and measured steps) returns only after `quiesce_gloo_workers()`: the caller
    sleeps, GIL released, until every gloo worker thread is blocked and stays blocked across a poll
    (context switches unchanged), so none is still running or waiting for the GIL with a finished
    collective's tensors; the buffers then die on the caller's side where the program drops them, and
    a probe measures the same peak every run (zero3 CPU probe: one measured peak in 10 of 10 runs,
    tests/test_faults.py). A wait that does not settle within `QUIESCE_LIMIT_S` is counted in
    `quiesce_timeouts` (the probe reports it).
    """

    def __init__(self, settle_waits: bool = False):
        super().__init__()
        self.settle_waits = settle_waits
        self.quiesce_timeouts = 0
        self._orig_wait = None
        self.phase = "setup"
        self.op = "?"  # the op whose outputs are being recorded (kept per storage, for diagnosis)
        self.live: dict[int, list] = {}  # key -> [nbytes, phase, seq, weakref]
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_phase = None
        self.snapshotting = False
        self._dirty = False
        self._snapshot = None  # (role bytes dict, [(seq, nbytes, phase)] unclassified)
        self._seq = 0
        self.comm_seqs: set[int] = set()
        self.counting = False
        self.collectives: dict[tuple, int] = {}
        self.roles = lambda: {}  # set by the probe: key -> category for params/grads/optimizer
        self._orig_resize = None
        self.events: list | None = None
        """With a list here: every storage allocation ("alloc", key, bytes[, stream]) and free ("free", key)
        in host order, and ("comm", key, op) when a collective reads or writes a live storage, for replaying
        through a model of the CUDA caching allocator (planner/allocator.py). `stream` (left out when 0, the
        stream current when recording began): the stream a GPU would allocate on (`_stream_tag`)."""
        self._comm_op = "?"
        self._streams: dict = {}  # id(stream object) -> (the object, its tag: 1, 2, ... in order of use)
        self._node_streams: dict = {}  # (autograd node's sequence number, its type) -> its forward's stream tag
        self._default_stream = None

    # -- streams (allocation traces) ------------------------------------------------------------
    def _host_stream(self) -> int:
        """The current stream as a tag: 0 for the stream current when the events began, then 1, 2, ... for
        each other stream in order of first use. On the CPU, FSDP's `device_handle.stream(...)` contexts are
        `torch.cpu.stream`, which `torch.cpu.current_stream()` follows."""
        cur = torch.cpu.current_stream()
        if self._default_stream is None:
            self._default_stream = cur
        if cur is self._default_stream:
            return 0
        hit = self._streams.get(id(cur))
        if hit is None or hit[0] is not cur:
            hit = self._streams[id(cur)] = (cur, len(self._streams) + 1)
        return hit[1]

    def _stream_tag(self) -> int:
        """The stream a GPU would allocate on now: inside a backward node, the stream its forward op ran on
        (CUDA autograd runs each backward op on its forward op's stream; `StreamTags` records them on the
        CPU), else the current stream."""
        node = torch._C._current_autograd_node() if self._node_streams else None
        if node is not None:
            hit = self._node_streams.get((node._sequence_nr(), type(node)))
            if hit is not None:
                return hit
        return self._host_stream()

    # -- storage bookkeeping -------------------------------------------------------------------
    def _track(self, st) -> None:
        key = id(st)
        rec = self.live.get(key)
        n = st.nbytes()
        if rec is not None:
            if rec[0] != n:
                self._resized(rec, n)
            return
        if st.device.type == "meta":
            # no memory: DTensor's sharding propagation runs ops on meta tensors (the first call of each
            # op signature; its cache serves later steps), e.g. full-size foreach outputs in a TP
            # optimizer step, which an allocation trace must not count
            return
        self._seq += 1
        rec = [0, self.phase, self._seq, None, self.op]
        rec[3] = weakref.ref(st, lambda _r, key=key: self._freed(key))
        self.live[key] = rec
        self._resized(rec, n)

    def _resized(self, rec, n: int) -> None:
        delta = n - rec[0]
        if self.events is not None and delta:
            key = id(rec[3]) if rec[3] is not None else rec[2]
            if rec[0]:
                self.events.append(("free", key))
            if n:
                tag = self._stream_tag()
                self.events.append(("alloc", key, n, tag) if tag else ("alloc", key, n))
        if delta < 0 and self._dirty:
            self._take_snapshot()
        rec[0] = n
        if delta > 0:  # a storage grown in place counts as created now (FSDP's resize_ re-allocation)
            self._seq += 1
            rec[1], rec[2] = self.phase, self._seq
        self.live_bytes += delta
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self.peak_phase = self.phase
            self._dirty = self.snapshotting

    def _freed(self, key: int) -> None:
        rec = self.live.get(key)
        if rec is None:
            return
        if self._dirty and rec[0]:
            self._take_snapshot()
        if self.events is not None and rec[0]:
            self.events.append(("free", id(rec[3])))
        del self.live[key]
        self.live_bytes -= rec[0]

    def _take_snapshot(self) -> None:
        self._dirty = False
        roles = self.roles()
        by_role = dict.fromkeys(CATEGORIES, 0)
        rest = []
        for key, (n, phase, seq, _, op) in list(self.live.items()):  # gloo threads free storages too
            if not n:
                continue
            role = roles.get(key)
            if role is None:
                rest.append((seq, n, phase, op))
            else:
                by_role[role] += n
        self._snapshot = (by_role, rest)

    def reset_peak(self) -> None:
        """Start the measured window: peak = what is live now; snapshots on."""
        self.snapshotting = True
        self.peak_bytes = self.live_bytes
        self.peak_phase = self.phase
        self._dirty = True

    def components(self) -> dict:
        """Bytes per category at the peak of the measured window."""
        if self._dirty or self._snapshot is None:
            self._take_snapshot()
        by_role, rest = self._snapshot
        out = dict(by_role)
        for seq, n, phase, _ in rest:
            if seq in self.comm_seqs:
                out["comm_buffers"] += n
            elif phase == "forward":
                out["activations"] += n
            else:
                out["temporaries"] += n
        return out

    # -- the mode ------------------------------------------------------------------------------
    def __enter__(self):
        orig = self._orig_resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st, size):
            out = orig(st, size)
            rec = tracker.live.get(id(st))
            if rec is None:
                tracker._track(st)
                rec = tracker.live.get(id(st))
            elif rec[0] != st.nbytes():
                tracker._resized(rec, st.nbytes())
            if rec is not None and size > 0:  # FSDP's unsharded parameters are allocated this way
                tracker.comm_seqs.add(rec[2])
            return out

        torch.UntypedStorage.resize_ = resize_
        if self.settle_waits:
            from torch.distributed.distributed_c10d import Work

            orig_wait = self._orig_wait = Work.wait

            def wait(work, *args, **kwargs):
                out = orig_wait(work, *args, **kwargs)
                tracker._settle()
                return out

            Work.wait = wait
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._orig_resize
        if self._orig_wait is not None:
            from torch.distributed.distributed_c10d import Work

            Work.wait = self._orig_wait
            self._orig_wait = None
        return super().__exit__(*args)

    def _settle(self) -> None:
        """After a gloo `Work.wait()`: let gloo's worker threads let go of the work (see `settle_waits`)."""
        if not quiesce_gloo_workers():
            self.quiesce_timeouts += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _DTensor is not None and any(issubclass(t, _DTensor) for t in types):
            # Let DTensor run first, with this mode still on: its sharding propagation, redistributions
            # and custom handlers (loss parallel's all-reduces, a replicated parameter's Partial gradient
            # all-reduced) then reach this mode as ops on plain local tensors, collectives and
            # temporaries included, as PyTorch's CommDebugMode does (`debug/_comm_mode.py`).
            return NotImplemented
        kwargs = kwargs or {}
        ns = func.namespace
        if ns in ("c10d", "_c10d_functional"):
            self._collective(ns, func, args, kwargs)
        out = func(*args, **kwargs)
        self.op = func._schema.name
        for t in _tensors(out):
            st = _storage(t)
            if st is not None:
                self._track(st)
        if ns == "_c10d_functional":
            self._mark_comm(_tensors(out))
        return out

    # -- collectives ---------------------------------------------------------------------------
    def _mark_comm(self, ts) -> None:
        for t in ts:
            st = _storage(t)
            if st is None:
                continue
            rec = self.live.get(id(st))
            if rec is None:
                self._track(st)
                rec = self.live.get(id(st))
            if rec is not None:
                self.comm_seqs.add(rec[2])
                if self.events is not None:
                    self.events.append(("comm", id(rec[3]), self._comm_op))

    def _collective(self, ns, func, args, kwargs) -> None:
        name = func._schema.name.split("::")[-1]
        ts = _tensors((args, kwargs))
        if ns == "c10d":
            op, idx = _C10D.get(name, (name, 0))
            group_size = next((n for n in map(_pg_size, args) if n is not None), -1)
            msg = [] if idx is None else _tensors(args[idx])
        else:
            if name in ("wait_tensor", "_wrap_tensor_autograd"):  # not collectives
                return
            op, idx, gidx = _FUNCTIONAL.get(name, (name, 0, None))
            group_size = -1
            if gidx is not None and gidx < len(args):
                g = args[gidx]
                group_size = g if isinstance(g, int) else _group_size(g)
            msg = _tensors(args[idx]) if idx >= 0 else _tensors(args[0])
            if op == "all_gather" and group_size > 0:  # the output is group_size x the input
                msg = msg * group_size
        # ("comm", key, op) events: functional collectives (DTensor's redistributions: tensor parallelism)
        # are named "_c10d_functional.<op>", those of a checkpoint save "checkpoint.<op>": their buffers
        # are allocated on the caller's stream (FSDP1's state-dict unshard runs on the current stream,
        # `_unshard_fsdp_state_params`), not on FSDP's communication streams
        self._comm_op = op if ns == "c10d" else f"{ns}.{op}"
        if self.phase == "checkpoint":
            self._comm_op = f"checkpoint.{self._comm_op}"
        self._mark_comm(ts)
        if not self.counting:
            return
        dtype = str(msg[0].dtype if msg else (ts[0].dtype if ts else "none")).replace("torch.", "")
        key = (op, group_size, dtype, _nbytes(msg))
        self.collectives[key] = self.collectives.get(key, 0) + 1

    def collective_list(self, steps: int) -> list[dict]:
        """Calls per optimizer step, aggregated by (op, group_size, dtype, message_bytes)."""
        out = []
        for (op, g, dtype, nbytes), calls in sorted(self.collectives.items()):
            if calls % steps:
                raise RuntimeError(
                    f"{calls} calls of {op}({nbytes} B, group {g}) over {steps} steps is not a whole "
                    f"number per step")
            out.append({"op": op, "group_size": g, "dtype": dtype, "message_bytes": nbytes,
                        "calls": calls // steps})
        return out


def _pg_size(a) -> int | None:
    """Size of a ProcessGroup argument as the dispatcher passes it (a boxed ScriptObject); else None."""
    if not isinstance(a, torch.ScriptObject):
        return None
    try:
        if "ProcessGroup" not in str(a._type()):
            return None
        from torch.distributed import ProcessGroup

        return ProcessGroup.unbox(a).size()
    except Exception:
        return None


def _group_size(name) -> int:
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(name).size()
    except Exception:
        return -1


class StreamTags(TorchFunctionMode):
    """With a `Tracker` recording events on the CPU: remembers the stream each autograd node was made under
    (an op's outputs' `grad_fn`, seen above autograd, where a dispatch mode cannot see it), so that an
    allocation during that node's backward is tagged with the stream a GPU would run it on (FSDP1 makes
    the views of its flat parameter inside `_unshard`'s unshard-stream context: their backward, which
    builds the flat gradient, runs on the unshard stream). Forgets the nodes when a forward begins
    (`reset`)."""

    def __init__(self, tracker: Tracker):
        super().__init__()
        self.tracker = tracker

    def reset(self) -> None:
        self.tracker._node_streams.clear()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tag = self.tracker._host_stream()
        if tag:
            for t in tree_flatten(out)[0]:
                fn = t.grad_fn if isinstance(t, torch.Tensor) else None
                if fn is not None:  # (keyed by its sequence number: a node cannot be weakly referenced,
                    # and holding it would keep what it saves)
                    self.tracker._node_streams[(fn._sequence_nr(), type(fn))] = tag
        return out


class StepTimer:
    """Wall-clock seconds per step; synchronises the GPU around each step."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.times: list[float] = []

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            if self.cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._t0)

    def median(self) -> float | None:
        if not self.times:
            return None
        s = sorted(self.times)
        n = len(s)
        return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
