"""A deep Hugging Face model's profile from a shallow trace: TRACE_LAYERS layers traced, the middle one
repeated (`expand_layers`), and the step's allocation log written for every layer (`_expanded_log`;
under every-K checkpointing a period of layers, `_periodic_log`)."""

from __future__ import annotations

TRACE_LAYERS = 4
"""Decoder layers traced for a deeper Hugging Face model: the first (it saves the rotary tables the
others share), two middle layers (every middle layer saves what the first of them saves, byte for
byte; the second shows what each layer adds to what the forward holds without saving it: autocast's
cached casts of biases) and the last (the final norm, LM head and loss join its segment);
`expand_layers` repeats the middle one."""


def periodic_trace_layers(depth: int, every: int) -> int:
    """Layers to trace for a `depth`-deep model's allocation log under every-K checkpointing (K = `every`):
    layers 0 .. K, a window of K layers (K + 1 .. 2K) and at least one after it, the last traced one of the
    deep last layer's kind (`_expanded_log`'s `period`)."""
    last = depth - 1
    first_after = 2 * every + 1
    return first_after + (last - first_after) % every + 1


def _layer_names(prefix: str):
    """(renamed(text, old, new): `prefix`.old renumbered to `prefix`.new in a name; layer_of(text): the layer
    number a name has under `prefix`, or None) for the decoder layers' names ("model.layers")."""
    import re

    pat = re.compile(re.escape(prefix) + r"\.(\d+)(?=\.|$)")

    def renamed(text: str, old: int, new: int) -> str:
        return pat.sub(lambda m: f"{prefix}.{new}" if int(m.group(1)) == old else m.group(0), text)

    def layer_of(text: str):
        m = pat.search(text)
        return int(m.group(1)) if m else None
    return renamed, layer_of


def _periodic_log(prof: dict, depth: int, every: int, traced: int) -> dict:
    """The `traced`-deep profile whose allocation log is the `depth`-deep model's under every-K checkpointing
    (`_expanded_log` with period K), for `ModuleDesc.with_checkpointed_log`, which reads only the log; the
    log dropped where it cannot be expanded."""
    layer_units = [u for u in prof["units"] if u["name"] != "root"]
    out = dict(prof)
    out.pop("alloc_log", None)
    if len(layer_units) != traced:
        return out
    renamed, layer_of = _layer_names(layer_units[0]["name"].rsplit(".", 1)[0])
    log = _expanded_log(prof.get("alloc_log") or {}, depth, layer_of, renamed, every, traced)
    if log is not None:
        out["alloc_log"] = log
    return out


def expand_layers(prof: dict, depth: int, work, checkpoint_every: int = 0) -> dict:
    """A TRACE_LAYERS-deep profile as the `depth`-deep model's: the middle layer's unit, segment,
    gradient-ready entries and FLOPs repeated (depth - 2) times, names renumbered. Equal to tracing
    every layer (tests/test_hf_trace.py compares both), at a fraction of the time.

    `checkpoint_every` (the step's allocation log was traced with every k-th layer checkpointed): with k >= 2
    the deep model's middle layers are of two kinds (layer t checkpointed where t % k == 0) while the traced
    middle layer is of one, so the log is not expanded here (with k = 4 the 4 traced layers checkpoint layer 0
    only); `profile_hf` traces such a log deeper and repeats a period of layers (`_periodic_log`)."""
    import copy

    units = prof["units"]
    layer_units = [u for u in units if u["name"] != "root"]
    if len(layer_units) != TRACE_LAYERS or any(s.get("kernels") for s in prof["segments"]):
        return prof
    renamed, layer_of = _layer_names(layer_units[0]["name"].rsplit(".", 1)[0])  # "model.layers"

    last = depth - 1
    # traced layer -> the layers it stands for; traced layer 2 only measures the per-layer growth
    mapping = {0: [0], 1: list(range(1, last)), 2: [], 3: [last]}
    out = copy.deepcopy(prof)
    new_units = []
    for u in units:
        j = layer_of(u["name"]) if u["name"] != "root" else None
        if j is None:
            new_units.append(u)
            continue
        for i in mapping[j]:
            new_units.append({**u, "name": renamed(u["name"], j, i),
                              "params": [[renamed(n, j, i), sh] for n, sh in u["params"]]})
    out["units"] = new_units
    segs = _expanded_segments(prof, depth, mapping, layer_of, renamed)
    out["segments"] = segs
    ready = _expanded_grad_ready(prof.get("grad_ready", ()), mapping, layer_of, renamed)
    out["grad_ready"] = ready
    # the construction and the step's allocations, the middle layer's repeated (`_expanded_log`)
    construct, expanded_construct = _expanded_construct(prof, mapping, layer_of, renamed)
    log = _expanded_log(prof.get("alloc_log") or {}, depth, layer_of, renamed) if checkpoint_every < 2 else None
    if log is not None and [(e[1], e[3]) for e in construct if layer_of(e[0]) == 1] == [
            (e[1], e[3]) for e in construct if layer_of(e[0]) == 2]:
        for key, k in (("construct_paths", 0), ("construct_bytes", 1), ("construct_names", 2), ("construct_built", 3)):
            out[key] = [e[k] for e in expanded_construct]
        out["alloc_log"] = log
    else:  # (not a stack of identical layers: no allocation log, the plan's reserved peak is the margin's)
        for key in ("construct_paths", "construct_bytes", "construct_names", "construct_built", "alloc_log"):
            out.pop(key, None)
    extra = depth - TRACE_LAYERS
    out["params"] = prof["params"] + extra * layer_units[1]["numel"]
    out["activation_bytes"] = sum(s["activation_bytes"] for s in segs)
    out["forward_flops"] = prof["forward_flops"] + extra * prof.get("layer_flops", 0)
    out["workload"] = work.to_spec()
    out["factory"] = work.label
    out["traced_layers"] = TRACE_LAYERS
    return out


def _expanded_segments(prof: dict, depth: int, mapping: dict, layer_of, renamed) -> list:
    """The profile's segments with each traced layer's repeated for the layers it stands for (`mapping`),
    their forward bytes grown by what each layer adds to what the forward holds."""
    fwd = {layer_of(sg["unit"]): sg["forward_bytes"] for sg in prof["segments"]
           if sg["unit"] not in ("root", "loss")}
    grow = fwd[2] - fwd[1]  # autocast's cache of bias casts: one more layer's each layer
    ufwd = {layer_of(sg["unit"]): sg.get("unit_forward_bytes", 0) for sg in prof["segments"]
            if sg["unit"] not in ("root", "loss")}
    ugrow = ufwd[2] - ufwd[1]  # the same cache, in the unit's own forward peak

    def shifted(sgm: dict, j: int, i: int) -> dict:
        layers = (i - 1) if j == 1 else ((depth - TRACE_LAYERS) if j == 3 else 0)
        out_ = {**sgm, "unit": renamed(sgm["unit"], j, i), "forward_bytes": sgm["forward_bytes"] + layers * grow}
        if "unit_forward_bytes" in sgm:
            out_["unit_forward_bytes"] = sgm["unit_forward_bytes"] + layers * ugrow
        return out_

    segs = []
    for sgm in prof["segments"]:
        j = layer_of(sgm["unit"]) if sgm["unit"] not in ("root", "loss") else None
        if j is None:
            segs.append(sgm)
        else:
            segs.extend(shifted(sgm, j, i) for i in mapping[j])
    return segs


def _expanded_grad_ready(grad_ready, mapping: dict, layer_of, renamed) -> list:
    """The gradient-ready order with each traced layer's run of parameters repeated, deeper layers first."""
    ready, run = [], []

    def flush():
        if run:
            j = layer_of(run[0][0])
            for i in sorted(mapping[j], reverse=True):  # backward reaches deeper layers first
                ready.extend([renamed(n, j, i), k] for n, k in run)
            run.clear()
    for n, k in grad_ready:
        j = layer_of(n)
        if j is None:
            flush()
            ready.append([n, k])
        else:
            if run and layer_of(run[0][0]) != j:
                flush()
            run.append([n, k])
    flush()
    return ready


def _expanded_construct(prof: dict, mapping: dict, layer_of, renamed) -> tuple:
    """(the traced construction entries (path, bytes, name, built bytes), the deep model's: each layer's run of
    entries repeated for the layers it stands for)."""
    construct = [(p, n, nm, b) for p, n, nm, b in zip(prof.get("construct_paths", ()), prof.get("construct_bytes", ()),
                                                     prof.get("construct_names", ()), prof.get("construct_built", ()))]
    expanded_construct = []
    runs: list = []  # consecutive entries of one layer (`Module._apply` moves a child's tensors together)
    for entry in construct:
        j = layer_of(entry[0])
        if runs and runs[-1][0] == j:
            runs[-1][1].append(entry)
        else:
            runs.append((j, [entry]))
    for j, run in runs:
        expanded_construct.extend(run if j is None else [(renamed(p, j, i), n, renamed(nm, j, i), b)
                                                         for i in mapping[j] for p, n, nm, b in run])
    return construct, expanded_construct


def _frees_in_order(events: list) -> list:
    """`events` with each run of consecutive frees in allocation (id) order. Which op's end finds a storage
    gone can differ between fake and real tensors (the same frees, one op apart); the caching allocator's
    state after a run of frees does not depend on their order (a freed block merges with its free
    neighbours, whichever went first), so a log is kept in this one order."""
    out: list = []
    run: list = []
    for e in events:
        if e[0] == 0:
            run.append(e)
            continue
        out.extend(sorted(run, key=lambda f: f[1]))
        run = []
        out.append(e)
    out.extend(sorted(run, key=lambda f: f[1]))
    return out


def _post_backward_first(events: list) -> list:
    """`events` with a unit's inputs' gradient ([6, unit]) ahead of the unit before it's outputs' gradient
    ([5, unit]) where the two are one tensor's (nothing between them). The trace hooks both on that tensor,
    the earlier unit's first; FSDP2 passes a unit's inputs through `RegisterPostBackwardFunction`
    (_fully_shard/_fsdp_state.py `_pre_forward` -> _fsdp_param_group.py `_register_post_backward_hook`), whose
    backward runs before the gradient reaches the tensor's own hooks, so its post-backward comes first."""
    out = list(events)
    for i in range(len(out) - 1):
        if out[i][0] == 5 and out[i + 1][0] == 6:
            out[i], out[i + 1] = out[i + 1], out[i]
    return out


def _expanded_log(log: dict, depth: int, layer_of, renamed, period: int = 1,
                  traced: int = TRACE_LAYERS) -> dict | None:
    """A TRACE_LAYERS-deep step's allocation log (`_SegmentTracker.log`) as the `depth`-deep model's, or None
    where it cannot be said so. Each event belongs to a layer's region -- its forward from its pre-forward to
    its post-forward marker ([3, unit] .. [4, unit]), its backward from its outputs' gradient ([5, unit]) to
    the next layer's (the first layer's: to its inputs' gradient, [6, unit]) -- or to the root's ops between
    them (a layer's forward runs on to the next one's, the last one's to the root's post-forward: the final
    norm, the head and the loss). Traced layer 2's regions are repeated for layers 2 .. depth - 2 (deeper layers first in backward),
    layer 3's stand for the last. A tensor is named by its layer and its place among that region's
    allocations; an event of a region that frees (or a marker that names) another layer's tensor names the
    one at the same offset from the region's layer as traced (a layer's backward frees the input the
    layer before it passed it, and the gradient the layer after it passed back). The root's ops free every
    copy of a middle layer's tensor (autocast's cache at the end of the forward). Ids are renumbered in
    allocation order and each run of frees is in that order, as `close_log` lists them; equal to tracing
    every layer (tests/test_hf_trace.py). None when the repeated layers' allocations differ in size, or a
    repeated region frees a tensor of the root or names a layer past the ends.

    `period` P, `traced` T (every-K checkpointing, P = K: the deep model's layers are of P kinds by t % P):
    the T traced layers are layers 0 .. P kept as they are, a window of P layers W = P + 1 .. 2P repeated
    periodically (deep layer t >= P + 1 is window layer P + 1 + (t - P - 1) % P, the same kind), the traced
    layers after the window only as its neighbours, and the last traced layer (of the deep last layer's kind)
    as the last. P = 1, T = 4 is the scheme above."""
    events = log.get("events")
    if not events:
        return None
    x = _LogExpansion(depth, layer_of, renamed, period, traced)
    x.tag_regions(events)
    if not x.repeats_alike():
        return None
    if not x.group_blocks():
        return None
    try:
        out = x.deep_events()
    except (LookupError, KeyError):
        return None
    return x.renumbered(out, log)


class _LogExpansion:
    """`_expanded_log`'s state: the layer scheme (`period`, `traced`, the deep model's `last` layer), each
    event's region, each traced allocation's owner (region and place, or the root) and each region's
    allocation sizes in order."""

    def __init__(self, depth: int, layer_of, renamed, period: int, traced: int):
        self.layer_of, self.renamed, self.period = layer_of, renamed, period
        self.last = depth - 1
        self.w0, self.m_last = period + 1, traced - 1  # the window's first traced layer, the last traced layer
        # traced layer -> its layer in the deep model (the window's: w0 .. last - 1, by kind)
        self.target = {**{j: j for j in range(self.w0)}, self.m_last: self.last}

    def tmpl(self, j: int) -> int:  # the window layer a traced (or deep) layer j >= w0 repeats, by its kind
        return self.w0 + (j - self.w0) % self.period

    def tag_regions(self, events: list) -> None:
        """`tagged`: (region (kind, traced layer) or None, event) of each event; `owner`: traced id -> (kind,
        traced layer, place) or ("root", id); `sizes`: (kind, traced layer) -> the region's allocation sizes in order."""
        region = None
        tagged = []  # (region (kind, traced layer) or None, event)
        backward = False  # (a checkpointed layer's recomputation runs its forward hooks again inside its backward)
        for e in events:
            j = self.layer_of(e[1]) if e[0] >= 3 and isinstance(e[1], str) else None
            backward = backward or e[0] == 5
            if e[0] == 3 and j is not None and not backward:
                region = ("F", j)
            elif e[0] == 5 and j is not None:
                region = ("B", j)
            if e[0] == 4 and e[1] == "root":
                region = None
            tagged.append((region, e))
            if e[0] == 6 and j == 0:
                region = None
        owner: dict = {}  # traced id -> (kind, traced layer, place) or ("root", id)
        sizes: dict = {}  # (kind, traced layer) -> the region's allocation sizes in order
        for r, e in tagged:
            if e[0] == 1:
                if r is None:
                    owner[e[1]] = ("root", e[1])
                else:
                    got = sizes.setdefault(r, [])
                    owner[e[1]] = (r[0], r[1], len(got))
                    got.append(e[2])
        self.tagged, self.owner, self.sizes = tagged, owner, sizes

    def repeats_alike(self) -> bool:
        """Whether the repeated layers' allocations are alike in size."""
        sizes, w0, period, m_last = self.sizes, self.w0, self.period, self.m_last
        for kind in ("F", "B"):  # (the last layer's forward goes on with the root's ops after it: the head, the loss)
            for j in range(w0, w0 + period):  # each window layer as the layer of its kind one period before
                middle = sizes.get((kind, j))
                if not middle or sizes.get((kind, j - period)) != middle:
                    return False
            if any(sizes.get((kind, u)) != sizes.get((kind, self.tmpl(u))) for u in range(w0 + period, m_last)):
                return False
            middle = sizes[(kind, self.tmpl(m_last))]
            if sizes.get((kind, m_last), [])[:len(middle)] != middle:
                return False
        return True

    def layers(self, j: int) -> list:  # the deep model's layers traced layer j stands for, in forward order
        if j < self.w0 or j == self.m_last:
            return [self.target[j]]
        return [t for t in range(self.w0, self.last) if self.tmpl(t) == j] if j < self.w0 + self.period else []

    def source(self, t: int) -> int:  # the traced layer whose tensors layer t's are
        return t if t < self.w0 else self.m_last if t == self.last else self.tmpl(t)

    def name(self, x, t: int):  # the deep model's tensor: x (traced) of layer t
        o = self.owner[x]
        if o[0] == "root":
            return o
        src = self.sizes.get((o[0], self.source(t)), ())
        if not 0 <= t <= self.last or o[2] >= len(src) or src[o[2]] != self.sizes[(o[0], o[1])][o[2]]:
            raise LookupError
        return (o[0], t, o[2])

    def group_blocks(self) -> bool:
        """`blocks`: (region, its events), consecutive; `by_region`: region -> its block. False where a
        region's events are not one run."""
        blocks: list = []  # (region, its events), consecutive
        for r, e in self.tagged:
            if blocks and blocks[-1][0] == r:
                blocks[-1][1].append(e)
            else:
                blocks.append((r, [e]))
        by_region: dict = {}
        for r, block in blocks:
            if r is not None:
                if r in by_region:
                    return False
                by_region[r] = block
        self.blocks, self.by_region = blocks, by_region
        return True

    def emitted(self, r) -> list:
        """(region, deep layer, events) to write where region r's events stand: a layer kept as traced or the
        last as itself; at the window's first region in run order (forward: its first layer; backward, which
        reaches deeper layers first: its last), every window copy in deep-layer order, each its kind's region;
        the window's other regions and the neighbours after it nothing."""
        kind, j = r
        w0, last = self.w0, self.last
        if j < w0 or j == self.m_last:
            return [(r, self.target[j], self.by_region[r])]
        if j != (w0 if kind == "F" else w0 + self.period - 1):
            return []
        deep = range(w0, last) if kind == "F" else range(last - 1, w0 - 1, -1)
        return [((kind, self.tmpl(t)), t, self.by_region[(kind, self.tmpl(t))]) for t in deep]

    def run(self):  # (region, deep layer, event) in the deep model's order
        for r0, block0 in self.blocks:
            for r, t, block in (self.emitted(r0) if r0 is not None else [(None, None, block0)]):
                for e in block:
                    yield r, t, e

    def deep_events(self) -> list:
        """The deep model's events, tensors named (kind, deep layer, place) or ("root", id); raises
        LookupError where a repeated region frees a tensor of the root or names a layer past the ends."""
        layer_of, renamed, owner, name = self.layer_of, self.renamed, self.owner, self.name
        out: list = []
        for r, t, e in self.run():
            shift = 0 if r is None else t - r[1]
            if e[0] == 1:
                out.append((1, name(e[1], t) if r is not None else owner[e[1]], e[2]))
            elif e[0] == 0:
                o = owner.get(e[1])
                if o is None:  # (not made in the step: never logged)
                    continue
                if o[0] == "root":
                    if r is not None and self.w0 <= r[1] < self.w0 + self.period:  # (a repeated region)
                        raise LookupError
                    out.append((0, o))
                elif r is None:  # every copy's, where a middle layer's
                    out.extend((0, name(e[1], t_)) for t_ in self.layers(o[1]))
                else:
                    out.append((0, name(e[1], o[1] + shift)))
            elif e[0] >= 3 and isinstance(e[1], str) and layer_of(e[1]) is not None and r is not None:
                m = layer_of(e[1]) + shift
                if not 0 <= m <= self.last:
                    raise LookupError
                out.append((e[0], renamed(e[1], layer_of(e[1]), m)))
            elif e[0] >= 3 and isinstance(e[1], str) and layer_of(e[1]) is not None:
                out.append((e[0], renamed(e[1], layer_of(e[1]), self.target.get(layer_of(e[1]), layer_of(e[1])))))
            else:
                out.append(tuple(e))
        return out

    def renumbered(self, out: list, log: dict) -> dict:
        """{"events", "kept", "grads"} as `close_log`'s, ids renumbered in allocation order."""
        layer_of, renamed = self.layer_of, self.renamed
        ids: dict = {}
        for e in out:
            if e[0] == 1:
                ids[e[1]] = len(ids) + 1
        events_out = _frees_in_order([[1, ids[e[1]], e[2]] if e[0] == 1 else [0, ids[e[1]]] if e[0] == 0 else list(e)
                                      for e in out])

        def every(x):  # the deep model's tensors of traced id x that outlive the step (each middle layer's)
            o = self.owner.get(x)
            if o is None or o[0] == "root":
                return [(o, None)] if o is not None else []
            return [((o[0], t, o[2]), t) for t in self.layers(o[1])]
        kept = sorted(ids[n] for x in log.get("kept", ()) for n, _ in every(x) if n in ids)
        grads = sorted([ids[n], renamed(g, layer_of(g), t) if t is not None and layer_of(g) is not None else g]
                       for x, g in log.get("grads", ()) for n, t in every(x) if n in ids)
        return {"events": events_out, "kept": kept, "grads": grads}
