"""The event list the allocation walks write (`_Events`: allocations and frees on streams) and the pieces every
writer shares: the probes' warm-up and measured steps, DDP's coalesced broadcasts, the optimizer step's
temporaries, FSDP2's construction, all-gather, copy-out and post-backward. Below the writers
(alloc_trace.py's `allocation_events`, logged_trace.py, stage_trace.py, checkpoint_trace.py)."""

from __future__ import annotations

from functools import wraps
from math import prod

from .allocator import collector_paused


WARMUP_STEPS = 2  # validate/probe.py: optimizer state, FSDP lazy init, DDP's bucket rebuild


MEASURED_STEPS = 1
"""Later steps repeat the second one's allocations, but the caching allocator settles only by the third step's
end (the second is the first with optimizer state): after it a long run reserves no more, with the default
allocator and with expandable segments; under max_split_size_mb up to 1% more by the fifth
(tests/test_alloc_trace.py test_three_steps_reach_a_long_runs_reserved_peak)."""


def _collector_paused(write):
    """`write` (an event writer) under allocator.collector_paused, as allocator.replay runs: a trace is
    thousands of new tuples, which would trigger a collection every 700 of them and now and then a full one
    over every object of the process (14 ms of a cold 7B estimate's 230 on the 2-core VM); they hold no
    cycles, so nothing is left to collect. The collector looks at them once, after."""

    @wraps(write)
    def paused(*args, **kwargs):
        with collector_paused():
            return write(*args, **kwargs)
    return paused


class _Events:
    """An event list with handles: `a(size, stream)` returns a key, `f(key)` frees it."""

    __slots__ = ("ev", "n")

    def __init__(self) -> None:
        self.ev: list = []
        self.n = 0

    def a(self, size: int, stream: int = 0) -> int:
        self.n += 1
        self.ev.append(("alloc", self.n, int(size), stream))
        return self.n

    def f(self, *keys) -> None:
        for k in keys:
            if k is not None:
                self.ev.append(("free", k))

    def put(self, template: tuple, count: int, x: int) -> int:
        """`_compiled` events, the input's key `x`: returns the base its keys count from."""
        base = self.n
        self.ev.extend([("alloc", base + i, size, 0) if size is not None else ("free", base + i if i else x)
                        for size, i in template])
        self.n = base + count
        return base


BROADCAST_BUCKET = 250 << 20
"""DistributedDataParallel's `broadcast_bucket_size` (torch/nn/parallel/distributed.py: int(250 * 1024 * 1024))."""


def _broadcast_coalesced(E: _Events, sizes) -> None:
    """DistributedDataParallel.__init__'s `_sync_module_states`: the module's states (its parameters, then
    its buffers: `sizes`, the bytes of each) broadcast from rank 0 by `_broadcast_coalesced`
    (torch/csrc/distributed/c10d/comm.cpp `broadcast_coalesced`). `compute_bucket_assignment_by_size`
    (reducer.cpp) fills a bucket in order until it holds at least BROADCAST_BUCKET bytes; each bucket's
    BroadcastWork flattens its tensors into one new tensor (`flatten_dense_tensors`: `at::cat`, or a view of a
    bucket's only tensor, which allocates nothing), at most 2 in flight: the third waits for the first's
    `finish()`, which copies it back and frees it; the last two are freed in order at the end."""
    buckets, cur, n = [], 0, 0
    for b in sizes:
        cur, n = cur + b, n + 1
        if cur >= BROADCAST_BUCKET:
            buckets.append((cur, n))
            cur, n = 0, 0
    if n:
        buckets.append((cur, n))
    flight: list = []
    for nbytes, count in buckets:
        if len(flight) >= 2:
            E.f(flight.pop(0))
        flight.append(E.a(nbytes) if count > 1 else None)
    E.f(*flight)


def _adam_temporaries(E: _Events, sizes, optimizer: str, impl: str) -> None:
    """Adam(W)'s step temporaries over parameters of `sizes` bytes: `_multi_tensor_adam`'s exp_avg_sq_sqrt,
    one per parameter at once (foreach), or `_single_tensor_adam`'s two at a time per parameter (for-loop);
    the fused kernel and the other optimizers make none."""
    if optimizer in ("adam", "adamw"):
        if impl == "foreach":
            E.f(*[E.a(n) for n in sizes])
        elif impl == "for-loop":
            for n in sizes:
                E.f(E.a(n), E.a(n))


def _logged_optimizer_step(E: _Events, states: list, owned, optimizer: str, impl: str) -> None:
    """A traced module's optimizer step (torch/optim/adam.py, sgd.py) over parameters of `owned` bytes: in the
    first step `_init_group` makes each one's state into `states` -- Adam(W) `exp_avg` and `exp_avg_sq`
    (fused: a 4-byte `step` on the device before them), SGD with momentum the `momentum_buffer` -- then
    Adam's step temporaries (`_adam_temporaries`)."""
    if not states:
        for n in owned:
            if optimizer in ("adam", "adamw"):
                if impl == "fused":
                    states.append(E.a(4))
                states.extend((E.a(n), E.a(n)))
            elif optimizer == "sgd-momentum":
                states.append(E.a(n))
    _adam_temporaries(E, owned, optimizer, impl)


def _fsdp2_construct(E: _Events, units: list, full: list, shard: int, pb: int, meta: bool = False) -> list[int]:
    """FSDP2 construction (`fully_shard` per block, then the root: units[0] and units[-1], the embedding and
    the head): each parameter's padded dim-0 shard (`FSDPParam._init_sharded_param`, kept for the run),
    then its full tensor (`full`'s key) goes. Built on the meta device (`meta`), `fully_shard` allocates
    nothing and `to_empty` materializes the shards in module order instead (`nn.Module._apply`: children
    first, depth first: the embedding, the blocks, the final norm and the head), as the recorded CPU traces
    show. Returns the shards' elements in parameter order."""
    def shard_of(s):
        return -(-s[0] // shard) * prod(s[1:])
    L = len(units) - 2
    for u in (range(L + 2) if meta else list(range(1, L + 1)) + [0, L + 1]):
        for i, s in enumerate(units[u]):
            E.a(shard_of(s) * pb)
            E.f(full[u][i])
    return [shard_of(s) for u in units for s in u]


def _fsdp2_gather(E: _Events, shapes, shard: int, ud: int, mixed: bool = False) -> int:
    """FSDP2 `foreach_all_gather`: one flat output (padded shards of every rank) on the copy-in stream.
    Under mixed precision `_get_param_all_gather_inputs` first casts the unit's shards into one
    `flat_foreach_copy_input` there (param_dtype), gone once the copy-in has read it."""
    elems = sum(-(-s[0] // shard) * prod(s[1:]) for s in shapes)
    cast = E.a(elems * ud, 1) if mixed else None
    out = E.a(elems * shard * ud, 1)
    E.f(cast)
    return out


def _fsdp2_unshard(E: _Events, shapes, shard: int, ud: int, mixed: bool = False) -> tuple[int, list[int]]:
    """All-gather + `foreach_all_gather_copy_out`: (flat output, per-parameter unsharded tensors)."""
    flat = _fsdp2_gather(E, shapes, shard, ud, mixed)
    return flat, _fsdp2_copy_out(E, shapes, shard, ud)


def _fsdp2_copy_out(E: _Events, shapes, shard: int, ud: int) -> list[int]:
    """The unsharded parameters `foreach_all_gather_copy_out` copies into: `FSDPParam.init_all_gather_outputs`
    makes each one of its padded shard's numel x the shard group's ranks (_fsdp_param.py), the parameter
    being an `as_strided` view of it, so a parameter whose dim 0 does not divide by the ranks (a MoE's
    experts: 4 rows over 8 ranks) holds its padding too."""
    return [E.a(-(-s[0] // shard) * prod(s[1:]) * shard * ud if s else ud) for s in shapes]


def _fsdp2_post_backward(E: _Events, u, g: list, params: list, rs_kept, unsharded: int, sharded: int, shapes,
                         *, sync: bool, reshard: bool, mixed: bool, rb: int, acc: dict, saved: dict,
                         grads: list, last_grad_late: bool = False):
    """FSDP2 `post_backward` (_fsdp_param_group.py) of unit `u`: `accumulate_unsharded_grad_if_needed`
    adds a new 16-bit gradient `g` to the kept reduce_dtype one (`acc`); without sync, reshard (unless
    `reshard` is off: set_reshard_after_backward(False)) and keep the gradients
    (`to_accumulated_grad_if_needed` upcasts them under mixed precision: the copy of each of `shapes`,
    then the 16-bit one goes); else collect, reshard, drop the previous reduce-scatter input, then
    `foreach_reduce`: its input, the new shard (added to `sharded_param.grad` if one is kept, `saved`:
    `to_accumulate_grad`; else appended to `grads`). `last_grad_late`: the unit's last
    gradient outlives the copy-in's `unsharded_grads.clear()` until `foreach_reduce` returns (its loop over
    `zip(fsdp_params, unsharded_grads)` leaves it in `unsharded_grad` when the shard group has more than one
    rank). Returns the reduce-scatter input now kept."""
    if u in acc:
        E.f(*g)
        g = []
    if not sync:
        if reshard:
            E.f(*params)
        if u not in acc:
            if mixed:
                up = []
                for x, s in zip(g, shapes):
                    up.append(E.a(prod(s) * rb))
                    E.f(x)
                g = up
            acc[u] = g
        return rs_kept
    collected = acc.pop(u, g)
    E.f(*params, rs_kept)
    rs_in = E.a(unsharded * rb)  # on the compute stream: foreach_reduce allocates it before entering the RS stream
    late = collected[-1:] if last_grad_late else []
    E.f(*collected[:len(collected) - len(late)])
    out = E.a(sharded * rb, 2)
    E.f(*late)
    if u in saved:
        E.f(out)
    else:
        saved[u] = out
        grads.append(out)
    return rs_in
