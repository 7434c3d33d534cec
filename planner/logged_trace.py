"""The events of a traced module's run (`--module`): the traced step's own allocations (module_plan's log)
wrapped in what each wrapper adds around them, for a plain module, DDP and ZeRO-1 (`logged_step_events`),
FSDP2 (`logged_fsdp2_events`) and FSDP1 (`logged_fsdp1_events`), over the probes' warm-up and measured
steps."""

from __future__ import annotations

from math import prod

from .strategies import DDP, REGISTRY, SINGLE, ZERO1, get_strategy
from .trace_events import (MEASURED_STEPS, WARMUP_STEPS, _Events, _broadcast_coalesced, _collector_paused,
                           _fsdp2_copy_out, _fsdp2_gather, _fsdp2_post_backward, _fsdp2_unshard, _logged_optimizer_step)


LOGGED_FAMILIES = (SINGLE, DDP, ZERO1)
"""The families `logged_step_events` writes: the parameters stay whole, so the traced step's own allocations
are the run's, plus DDP's buckets and ZeRO-1's partition of the optimizer state. FSDP's unit all-gathers
and reduce-scatters between a module's ops are not written for a traced module (the margin instead)."""


LOGGED_OPTIMIZERS = ("adam", "adamw", "sgd", "sgd-momentum")
"""The optimizers whose state and temporaries `logged_step_events` writes (torch.optim's `_init_group`
and foreach, for-loop and fused kernels); the others keep the margin."""


@_collector_paused
def logged_step_events(construct: tuple, log: tuple, kept: tuple, batches: tuple, family: str, world: int,
                       owned: tuple, optimizer: str, optimizer_impl: str, grad_accum: int = 1,
                       buckets: tuple = (), rebuilt: tuple = (), buffers: tuple = (), workspace: int = 0,
                       conv_workspaces: dict | None = None, built: tuple = ()) -> list:
    """The events of a traced module's run (the `--module` front end) on one rank of `family` in
    LOGGED_FAMILIES, over WARMUP_STEPS + MEASURED_STEPS steps, as validate/probe.py runs it:

    - `construct`: the bytes of each parameter and buffer in the order `model.to(device)` copies them
      (planner.workload.trace's `construct_bytes`); DDP (world > 1) then broadcasts them from rank 0
      (`_sync_module_states`: buckets of 250 MiB or more, two in flight; `_broadcast_coalesced`) and makes its
      Reducer's first bucket of
      every gradient; `batches`: the input tensors' bytes, made before the first step;
    - each micro-step replays the traced step's `log` ([1, id, bytes] made, [0, id] gone, [2, conv key]: a
      cuDNN workspace taken and given back, of `conv_workspaces[key]` bytes where measured), `kept` being
      the ids that outlive it (the parameters' gradients); from the second micro-step of an accumulating
      step each new gradient is added into .grad and freed (AccumulateGrad). DDP: in the second step's
      forward the rebuilt `rebuilt` buckets replace the first (`_rebuild_buckets`), and every forward
      broadcasts the module's `buffers` (bytes per dtype: one flat tensor each, `_sync_buffers`);
    - the optimizer (torch/optim/adam.py, sgd.py): in the first step `_init_group` makes each owned
      parameter's state (`owned`: their bytes, ZeRO-1's partition for zero1) -- Adam(W) `exp_avg` and
      `exp_avg_sq` (fused: a 4-byte `step` on the device before them), SGD with momentum the
      `momentum_buffer` (a clone of the gradient); `_multi_tensor_adam`'s `exp_avg_sq_sqrt` (one per
      parameter, foreach) or `_single_tensor_adam`'s two per parameter (for-loop); then
      `zero_grad(set_to_none=True)` drops the gradients.
    `workspace`: the cuBLAS workspaces, taken at the first GEMM and kept. `built`: the tensors' bytes as the
    factory built them, where a pure 16-bit run then casts the module (`model.to(dtype)`, validate/wrap.py:
    each tensor cast anew in `Module._apply`'s order, the old one freed) to `construct`'s."""
    E = _Events()
    keys = [E.a(n) for n in (built or construct)]
    for i, n in enumerate(construct if built else ()):
        if n != built[i]:
            k = E.a(n)
            E.f(keys[i])
            keys[i] = k
    bucket_keys: list = []
    if family in (DDP, ZERO1) and world > 1:
        _broadcast_coalesced(E, construct)  # (in construction order: a buffer made among the parameters moves
        # a bucket's boundary by its bytes)
        bucket_keys = [E.a(b) for b in buckets]
    for n in batches:
        E.a(n)
    ws = conv_workspaces or {}
    kept_ids = set(kept)
    states: list = []
    for step in range(WARMUP_STEPS + MEASURED_STEPS):
        if step == 0 and workspace:
            E.a(workspace)
        grads: list = []
        for k in sorted({0, min(1, grad_accum - 1), grad_accum - 1}):
            if bucket_keys and step == 1 and k == 0 and rebuilt:
                E.f(*bucket_keys)
                bucket_keys = [E.a(b) for b in rebuilt]
            if family in (DDP, ZERO1) and world > 1:
                for n in buffers:
                    E.f(E.a(n))
            keys: dict = {}
            for ev in log:
                if ev[0] == 1:
                    if k and ev[1] in kept_ids:  # added into the kept .grad, then freed
                        E.f(E.a(ev[2]))
                    else:
                        keys[ev[1]] = E.a(ev[2])
                elif ev[0] == 0:
                    key = keys.pop(ev[1], None)
                    if key is not None:
                        E.f(key)
                elif ws.get(ev[1]):
                    E.f(E.a(ws[ev[1]]))
            if not k:
                grads = [keys.pop(i) for i in kept if i in keys]
            E.f(*keys.values())  # (nothing else outlives a micro-step)
        _logged_optimizer_step(E, states, owned, optimizer, optimizer_impl)
        E.f(*grads)
    return E.ev


def _meta_built(E: _Events, construct: tuple, names: tuple, shape_of: dict) -> dict:
    """A traced module built on the meta device and wrapped there (torchtitan's way for FSDP): only its
    buffers are made whole on the device; the parameters are made by the wrapper, this rank's shards
    (FSDP2) or one unit at a time (FSDP1's `_materialize_meta_module`). Returns {} (no whole parameter)."""
    for n, name in zip(construct, names):
        if name not in shape_of:
            E.a(n)
    return {}


def _built_and_cast(E: _Events, construct: tuple, names: tuple, built: tuple, shape_of: dict,
                    param_bytes: int) -> dict:
    """`model.to(device)` of a traced module: each tensor as the factory built it (`built`, else a parameter
    in fp32 from its shape, a buffer as traced), in `Module._apply`'s order; for pure 16-bit training
    (`param_bytes` 2) then `model.to(dtype)` (validate/wrap.py): each one cast anew, the old one freed.
    Returns {parameter name: key of its tensor}."""
    full: dict = {}
    keys = []
    for i, (n, name) in enumerate(zip(construct, names)):
        keys.append(E.a(built[i] if built else prod(shape_of[name]) * 4 if name in shape_of else n))
    if param_bytes == 2:
        for i, (n, name) in enumerate(zip(construct, names)):
            size = prod(shape_of[name]) * 2 if name in shape_of else n
            if size != (built[i] if built else n):
                k = E.a(size)
                E.f(keys[i])
                keys[i] = k
    for k, name in zip(keys, names):
        if name in shape_of:
            full[name] = k
    return full


LOGGED_FSDP2 = tuple(n for n, s in REGISTRY.items() if s.fsdp2)
"""The FSDP2 strategies `logged_fsdp2_events` writes for a traced module (`fully_shard` per unit, then the
root, sharded over the data-parallel ranks)."""


@_collector_paused
def logged_fsdp2_events(construct: tuple, construct_names: tuple, log: tuple, grads: tuple, units: tuple,
                        batches: tuple, shard: int, reshard: bool, mixed: bool, optimizer: str, optimizer_impl: str,
                        grad_accum: int = 1, sync_every: bool = False, last_grad_late: bool = True,
                        workspace: int = 0, conv_workspaces: dict | None = None, built: tuple = (),
                        param_bytes: int = 4, meta: bool = False) -> list:
    """The events of a traced module's run under FSDP2 (zero2: `reshard`=False, zero3: True) on rank 0 of
    `shard`, over WARMUP_STEPS + MEASURED_STEPS steps, as validate/probe.py runs it: the traced step's own
    allocations (`log`, as logged_step_events replays them) with FSDP2's between them where the trace marked
    its hooks (workload.trace._SegmentTracker.log: [3, unit] pre-forward, [4, unit] post-forward, [5, unit]
    pre-backward, [6, unit] post-backward; torch/distributed/fsdp/_fully_shard/_fsdp_state.py and
    _fsdp_param_group.py):

    - construction: `construct` (bytes per tensor in `Module._apply`'s order; `construct_names` its parameter's
      name, "" for a buffer; `built`: their bytes as the factory built them, else a parameter in fp32 from
      `units`' shapes; pure 16-bit (`param_bytes` 2): the module cast after, `_built_and_cast`), then
      `fully_shard` per unit and the root last (`units`: (name, ((parameter, shape),
      ...)), "root" for the parameters no unit owns): each parameter's padded dim-0 shard
      (`FSDPParam._init_sharded_param`), then the unit's full tensors go; then the input `batches`;
    - pre-forward: `unshard` (foreach_all_gather's flat output on the all-gather stream, under mixed
      precision after the cast of the shards into `flat_foreach_copy_input`) and `wait_for_unshard`'s copy-out
      (each unsharded parameter in param_dtype), the previous unit's all-gather output freed after it; the
      root's last one goes at the root's post-forward; post-forward: `reshard` (zero3; the root is never
      resharded after forward: reshard_after_forward=None);
    - pre-backward: the unit copied out (all-gathered first unless prefetched), then `_backward_prefetch`
      all-gathers the unit before it in post-forward order (the root, last in that order, prefetches the
      last unit); post-backward: `_fsdp2_post_backward` over the unit's gradients (`grads`: [log id,
      parameter name] of the traced step's parameter gradients) in parameter order; units whose inputs need
      no gradient (the first, taking the batch; the root) at `_root_post_backward_final_callback`, the root
      first, which then frees the last reduce-scatter input. Accumulation without sync keeps the unsharded
      gradients (fp32: later micro-steps add into .grad in place; mixed: upcast, later ones added and freed);
    - the optimizer over the shards (logged_step_events' states and temporaries), then `zero_grad`.
    `workspace`, `conv_workspaces`: as logged_step_events. `meta`: the module built on the meta device and
    wrapped there, then `to_empty` (`_meta_built`): no whole parameter is ever made, each shard as
    `fully_shard` makes it."""
    E = _Events()
    shape_of = {n: s for _, ps in units for n, s in ps}
    unit_of = {n: u for u, ps in units for n, _ in ps}
    pb = param_bytes
    ud, rb = (2, 4) if mixed else (pb, pb)

    def shard_of(s) -> int:
        return -(-s[0] // shard) * prod(s[1:]) if s else 1
    full = _meta_built(E, construct, construct_names, shape_of) if meta else \
        _built_and_cast(E, construct, construct_names, built, shape_of, pb)
    order = [u for u, ps in units if u != "root" and ps] + [u for u, ps in units if u == "root" and ps]
    shapes = {u: [s for _, s in ps] for u, ps in units}
    for u in order:
        for s in shapes[u]:
            E.a(shard_of(s) * pb)
        E.f(*[full.pop(n) for n, _ in dict(units)[u] if n in full])
    for n in batches:
        E.a(n)
    grad_unit = {i: unit_of[n] for i, n in grads if n in unit_of}
    grad_pos = {i: [n for n, _ in dict(units)[unit_of[n]]].index(n) for i, n in grads if n in unit_of}
    owned = [shard_of(s) * pb for u in order for s in shapes[u]]
    elems = {u: sum(shard_of(s) for s in shapes[u]) for u in order}
    ws = conv_workspaces or {}
    states: list = []
    A = grad_accum
    for step in range(WARMUP_STEPS + MEASURED_STEPS):
        if step == 0 and workspace:
            E.a(workspace)
        kept: list = []  # the sharded gradients, to zero_grad
        acc: dict = {}  # unit -> its unsharded gradients kept between micro-steps without sync
        saved: dict = {}  # unit -> its sharded gradient, reduced every micro-step
        for k in sorted({0, min(1, A - 1), A - 1}):
            sync = sync_every or k == A - 1
            _fsdp2_logged_micro_step(E, log, sync, acc, saved, kept, shapes, elems, order, shard, reshard, mixed,
                                     ud, rb, grad_unit, grad_pos, ws, last_grad_late)
        _logged_optimizer_step(E, states, owned, optimizer, optimizer_impl)
        E.f(*kept)
    return E.ev


def _fsdp2_logged_micro_step(E: _Events, log: tuple, sync: bool, acc: dict, saved: dict, kept: list, shapes: dict,
                             elems: dict, order: list, shard: int, reshard: bool, mixed: bool, ud: int, rb: int,
                             grad_unit: dict, grad_pos: dict, ws: dict, last_grad_late: bool) -> None:
    """One micro-step of `logged_fsdp2_events`: the traced step's allocations (`log`) with FSDP2's hooks where
    the trace marked them (pre-forward unshard, post-forward reshard, pre-backward copy-out and prefetch,
    post-backward reduce-scatter), then `_root_post_backward_final_callback`. `acc`, `saved`, `kept`: the
    unsharded gradients kept without sync, the sharded ones reduced every micro-step, and those `zero_grad`
    drops, carried between micro-steps; `ud`, `rb`: the unsharded parameters' and the reduction's bytes
    per element."""
    keys: dict = {}
    held: dict = {}  # unit -> its unsharded parameters
    pending: dict = {}  # unit -> its prefetched all-gather output, not yet copied out
    fwd_order: list = []
    done: set = set()
    made: dict = {}  # unit -> {position: key} of its new gradients
    flat = [None]
    rs = [None]

    def unshard(u) -> None:
        f, held[u] = _fsdp2_unshard(E, shapes[u], shard, ud, mixed)
        E.f(flat[0])
        flat[0] = f

    def ready(u) -> None:
        if u in held or u not in elems:
            return
        f = pending.pop(u, None)
        if f is None:
            f = _fsdp2_gather(E, shapes[u], shard, ud, mixed)
        held[u] = _fsdp2_copy_out(E, shapes[u], shard, ud)
        E.f(f)

    def post(u) -> None:
        if u in done or u not in elems:
            return
        done.add(u)
        g = [v for _, v in sorted(made.pop(u, {}).items())]
        rs[0] = _fsdp2_post_backward(E, u, g, held.pop(u, []), rs[0], elems[u] * shard, elems[u],
                                     shapes[u], sync=sync, reshard=True, mixed=mixed, rb=rb, acc=acc,
                                     saved=saved, grads=kept, last_grad_late=last_grad_late)
    for ev in log:
        kind = ev[0]
        if kind == 1:
            u = grad_unit.get(ev[1])
            if u is not None and u in acc and not mixed:  # AccumulateGrad into the kept .grad
                E.f(E.a(ev[2]))
            elif u is not None:
                made.setdefault(u, {})[grad_pos[ev[1]]] = E.a(ev[2])
            else:
                keys[ev[1]] = E.a(ev[2])
        elif kind == 0:
            E.f(keys.pop(ev[1], None))
        elif kind == 2:
            if ws.get(ev[1]):
                E.f(E.a(ws[ev[1]]))
        elif ev[1] in elems or ev[1] == "root":
            u = ev[1]
            if kind == 3 and u in elems and u not in held:
                unshard(u)
            elif kind == 4:
                if u == "root":
                    E.f(flat[0])
                    flat[0] = None
                elif reshard and u in held:
                    E.f(*held.pop(u))
                if u in elems:
                    fwd_order.append(u)
            elif kind == 5:
                ready(u)
                i = fwd_order.index(u) if u in fwd_order else 0
                if i > 0:
                    t = fwd_order[i - 1]
                    if t not in held and t not in pending:
                        pending[t] = _fsdp2_gather(E, shapes[t], shard, ud, mixed)
            elif kind == 6:
                post(u)
    # _root_post_backward_final_callback: the root's state first, then the units' (module order)
    for u in ["root"] + [u for u in order if u != "root"]:
        post(u)
    E.f(rs[0], flat[0], *pending.values())
    for u in list(held):
        E.f(*held.pop(u))
    E.f(*keys.values())


LOGGED_FSDP1 = tuple(n for n, s in REGISTRY.items() if s.fsdp1)
"""The FSDP1 strategies `logged_fsdp1_events` writes for a traced module (FULL_SHARD, SHARD_GRAD_OP,
HYBRID_SHARD within the node, NO_SHARD; `use_orig_params=False`, BACKWARD_PRE prefetch)."""


def _fsdp1_wrap_order(units: tuple) -> list:
    """FSDP1's auto-wrap order (`_recursive_wrap`, post-order): a unit's nested units (FSDP1's own units of
    its BatchNorm modules) before it, the root last."""
    names = [u for u, ps in units if u != "root" and ps]
    tops = [u for u in names if not any(u.startswith(o + ".") for o in names if o != u)]
    order = []
    for t in tops:
        order += [u for u in names if u.startswith(t + ".")] + [t]
    return order + [u for u, ps in units if u == "root" and ps]


@_collector_paused
def logged_fsdp1_events(construct: tuple, construct_names: tuple, log: tuple, grads: tuple, units: tuple,
                        batches: tuple, shard: int, strategy: str, mixed: bool, fp32_units: tuple,
                        optimizer: str, optimizer_impl: str, grad_accum: int = 1, sync_every: bool = False,
                        workspace: int = 0, conv_workspaces: dict | None = None, built: tuple = (),
                        param_bytes: int = 4, meta: bool = False) -> list:
    """The events of a traced module's run under FSDP1 (`strategy` in LOGGED_FSDP1) on rank 0 of `shard`,
    over WARMUP_STEPS + MEASURED_STEPS steps, as validate/probe.py runs it: the traced step's own allocations
    (`log`) with FSDP1's between them where the trace marked its hooks ([3]/[4] a unit's forward starts /
    ends, [5] its outputs' gradient is ready, [7] every gradient of its parameters is accumulated: the flat
    parameter's AccumulateGrad; torch/distributed/fsdp/_runtime_utils.py, _flat_param.py):

    - construction: `construct` as logged_fsdp2_events writes it, then per unit in auto-wrap order
      (`_fsdp1_wrap_order`) `FlatParamHandle`: the flat parameter, the rank's padded chunk kept and the flat
      freed (sharded; NO_SHARD keeps the flat one), the originals freed; then the input `batches`. The first
      forward's `_lazy_init` allocates and frees each handle's buffers (`init_flat_param_attributes`: under
      mixed precision `_mp_shard`, `_full_param_padded` and `_full_prec_full_param_padded`);
    - `_unshard` at a unit's pre-forward (and pre-backward, then the BACKWARD_PRE prefetch of the unit before
      it in post-forward order; the root's prefetches the last unit): the low-precision shard on the
      pre-unshard stream under mixed precision, the padded unsharded flat parameter on the unshard stream,
      the shard freed; NO_SHARD only makes the low-precision copy. `_reshard` at post-forward under
      FULL_SHARD / HYBRID_SHARD (never the root), and of NO_SHARD's low-precision copy;
    - at [7]: the views' gradients concatenated into the flat gradient (on the unshard stream), then
      `_post_backward_hook`: reshard, the cast to reduce_dtype, `_get_reduce_scatter_tensors` (`F.pad` where
      the flat gradient does not divide by the ranks, and the new shard), on the post-backward stream;
      `autograd_computed_grad` is freed as the hook returns. NO_SHARD all-reduces the flat gradient in place
      and keeps it. Accumulation without sync keeps the unsharded flat gradient (later micro-steps add into it
      and free theirs), SHARD_GRAD_OP keeps the unit unsharded;
    - the optimizer over the flat parameters (the root's first), then `zero_grad`.
    `fp32_units`: FSDP1's own units of BatchNorm modules, without mixed precision. `workspace`,
    `conv_workspaces`: as logged_step_events. `meta`: built on the meta device, each unit materialized just
    before it is flattened (`_init_utils.py` `_materialize_meta_module`: `to_empty` + `reset_parameters`)."""
    E = _Events()
    shape_of = {n: s for _, ps in units for n, s in ps}
    params_of = {u: [n for n, _ in ps] for u, ps in units}
    unit_of = {n: u for u, ps in units for n, _ in ps}
    st = get_strategy(strategy)
    sharded = st.shards_params and shard > 1  # all but NO_SHARD
    reshard_fwd = st.reshard_after_forward  # FULL_SHARD, HYBRID_SHARD
    pb = param_bytes  # the parameters' (and, without mixed precision, the gradients' and reductions') bytes
    full = _meta_built(E, construct, construct_names, shape_of) if meta else \
        _built_and_cast(E, construct, construct_names, built, shape_of, pb)
    order = _fsdp1_wrap_order(units)
    elems = {u: sum(prod(shape_of[n]) for n in params_of[u]) for u in order}
    chunk = {u: -(-elems[u] // shard) if sharded else elems[u] for u in order}
    low = {u: mixed and u not in fp32_units for u in order}
    flats: dict = {}
    for u in order:
        if meta:
            full.update((n, E.a(prod(shape_of[n]) * pb)) for n in params_of[u])
        flat = E.a(elems[u] * pb)
        if sharded:
            E.a(chunk[u] * pb)
            E.f(flat)
        else:
            flats[u] = flat
        E.f(*[full.pop(n) for n in reversed(params_of[u]) if n in full])
    for n in batches:
        E.a(n)
    grad_unit = {i: unit_of[n] for i, n in grads if n in unit_of}
    grad_pos = {i: params_of[unit_of[n]].index(n) for i, n in grads if n in unit_of}
    opt_order = [u for u in order if u == "root"] + [u for u in order if u != "root"]
    owned = [chunk[u] * pb for u in opt_order]
    ws = conv_workspaces or {}
    states: list = []
    A = grad_accum
    kept_unsharded: dict = {}  # SHARD_GRAD_OP without sync: units left unsharded between micro-steps

    def unshard(u):
        mp = E.a(chunk[u] * 2, 3) if low[u] else None
        if not sharded:
            return mp
        flat = E.a(chunk[u] * shard * (2 if low[u] else pb), 1)
        E.f(mp)
        return flat
    for step in range(WARMUP_STEPS + MEASURED_STEPS):
        if step == 0 and workspace:
            E.a(workspace)
        kept: list = []
        acc: dict = {}  # unit -> its unsharded flat gradient kept between micro-steps without sync
        saved: dict = {}  # unit -> its gradient (sharded when synced) kept for later micro-steps
        for k in sorted({0, min(1, A - 1), A - 1}):
            sync = sync_every or k == A - 1
            _fsdp1_logged_micro_step(E, log, sync, step == 0 and k == 0, acc, saved, kept, kept_unsharded, unshard,
                                     st, order, elems, chunk, low, shard, sharded, reshard_fwd, pb, grad_unit,
                                     grad_pos, ws)
        _logged_optimizer_step(E, states, owned, optimizer, optimizer_impl)
        E.f(*kept)
    return E.ev


def _fsdp1_logged_micro_step(E: _Events, log: tuple, sync: bool, lazy_init: bool, acc: dict, saved: dict, kept: list,
                             kept_unsharded: dict, unshard, st, order: list, elems: dict, chunk: dict, low: dict,
                             shard: int, sharded: bool, reshard_fwd: bool, pb: int, grad_unit: dict, grad_pos: dict,
                             ws: dict) -> None:
    """One micro-step of `logged_fsdp1_events`: the traced step's allocations (`log`) with FSDP1's hooks where
    the trace marked them (the root's `_lazy_init` on the first, pre-forward and pre-backward unshards with
    the backward prefetch, post-forward reshard, `_post_backward_hook`'s reduction). `acc`, `saved`, `kept`,
    `kept_unsharded`: the flat gradients kept without sync, the reduced ones, those `zero_grad` drops, and
    SHARD_GRAD_OP's units left unsharded, carried between micro-steps; `unshard(u)`: a unit's unshard
    (its key); `chunk`, `elems`: each unit's shard and flat elements; `low`: its mixed-precision units;
    `pb`: the parameters' bytes per element."""
    keys: dict = {}
    held: dict = dict(kept_unsharded)
    kept_unsharded.clear()
    fwd_order: list = []
    made: dict = {}
    for ev in log:
        kind = ev[0]
        if kind == 1:
            u = grad_unit.get(ev[1])
            if u is not None:
                made.setdefault(u, {})[grad_pos[ev[1]]] = E.a(ev[2])
            else:
                keys[ev[1]] = E.a(ev[2])
        elif kind == 0:
            E.f(keys.pop(ev[1], None))
        elif kind == 2:
            if ws.get(ev[1]):
                E.f(E.a(ws[ev[1]]))
        elif ev[1] in elems or (ev[1] == "root" and kind == 3):
            u = ev[1]
            if kind == 3:
                if u == "root" and lazy_init:  # _lazy_init
                    for v in order:
                        if sharded or low[v]:
                            pad = chunk[v] * shard if sharded else elems[v]
                            parts = ([chunk[v] * 2] if low[v] else []) + \
                                ([pad * (2 if low[v] else pb)] if sharded else []) + \
                                ([pad * pb] if low[v] and sharded else [])
                            for n in parts:
                                E.f(E.a(n))
                if u in elems and u not in held and (sharded or low[u]):
                    held[u] = unshard(u)
            elif kind == 4:
                if u not in fwd_order:  # (a recomputation's post-forward is not recorded again)
                    fwd_order.append(u)
                if u != "root" and u in held and (reshard_fwd or not sharded):
                    E.f(held.pop(u))
            elif kind == 5:
                i = fwd_order.index(u) if u in fwd_order else 0
                for v in ([u] + ([fwd_order[i - 1]] if i > 0 else [])):
                    if v not in held and (sharded or low[v]):
                        held[v] = unshard(v)
            elif kind == 7:
                g = [x for _, x in sorted(made.pop(u, {}).items())]
                flat_g = E.a(elems[u] * (2 if low[u] else pb), 1)
                E.f(*g)
                if u in acc:  # AccumulateGrad: added into the kept flat gradient
                    E.f(flat_g)
                    flat_g = acc.pop(u)
                unsh = held.pop(u, None)
                if not sync:
                    acc[u] = flat_g
                    if st.fsdp1_shard_grad_op and unsh is not None:
                        kept_unsharded[u] = unsh
                    else:
                        E.f(unsh)
                    continue
                E.f(unsh)
                cast = E.a(elems[u] * 4, 2) if low[u] else None
                src = cast if cast is not None else flat_g
                rb = 4 if low[u] else pb
                if sharded:
                    pad = E.a(chunk[u] * shard * rb, 2) if chunk[u] * shard != elems[u] else None
                    out = E.a(chunk[u] * rb, 2)
                    E.f(cast, pad, flat_g)
                    if u in saved:  # `_saved_grad_shard += sharded_grad`
                        E.f(out)
                    else:
                        saved[u] = out
                        kept.append(out)
                else:
                    if cast is not None:  # cast back to the parameter's dtype (fp32)
                        E.f(flat_g)
                    if u in saved:
                        E.f(src)
                    else:
                        saved[u] = src
                        kept.append(src)
    for u in list(held):
        E.f(held.pop(u))
    E.f(*keys.values())
