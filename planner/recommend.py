"""The recommendation: which strategy to use, the largest micro-batch, and why, in actionable words.

Unless the user fixed both --tp and --pp (`api.recommend`), the mesh is searched first (layout.py) and
the same rule picks the (layout, strategy) pair; `_recommend_searched` words it. At a given mesh:

Rule: among strategies that fit with headroom (at least `plan.headroom` of GPU memory free after the
allocator and process overhead: --headroom, default `HEADROOM_FRACTION`; where none that fits leaves it,
among those that fit, and `Recommendation.warning` says so), the one with the lowest step time; a simpler strategy wins when
it is within `TIE_FRACTION` of the fastest. Without a time model, the simplest that fits. When nothing
fits, the smallest change that would: a smaller micro-batch, activation checkpointing, CPU offload, or
more GPUs. DeepSpeed autotuning (deepspeed/autotuning/autotuner.py: ZeRO stages tried in order) follows the same "simplest stage that fits and is not
slower" idea, measured instead of modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .accuracy import memory_line, time_line
from .checkpoint import estimate_checkpoint
from .config import Cluster, TrainConfig
from .layout import Layout, layout_reasons, nothing_fits_words
from .memory import estimate_memory
from .pp import ZERO_BUBBLE, virtual_stages
from .ranking import HEADROOM_FRACTION, SIMPLICITY, TIE_FRACTION, _headroom_ok, _rank, headroom_warning
from .report import comm_table, header, layout_table, memory_table, recommended_rows, wrap
from .resolve import _catalog
from .strategies import get_strategy
from .units import LIMITS, fmt_bytes, fmt_gib, fmt_seconds

__all__ = ["HEADROOM_FRACTION", "SIMPLICITY", "TIE_FRACTION", "Recommendation", "max_micro_batch", "pick",
           "recommend", "render_recommendation"]

@dataclass
class Recommendation:
    strategy: str | None
    reasons: list = field(default_factory=list)
    max_micro_batch: int | None = None
    change: str | None = None
    """When nothing fits: the smallest change that makes something fit."""
    changed_plan: object = field(default=None, repr=False, compare=False)
    """The plan under `change` (its rows are what is recommended); not part of the JSON."""
    pick_reason: str | None = None
    """Why this strategy among those that fit, in words (the first of `reasons` without the change)."""
    layout: object = None
    """The mesh the pick runs on (`layout.Layout`): the one given, or the one the search picked."""
    result: object = field(default=None, repr=False, compare=False)
    """The picked strategy's `api.StrategyResult` on that layout."""
    search: object = field(default=None, repr=False, compare=False)
    """The `layout.LayoutSearch` when the layout was searched (the user fixed neither --tp nor --pp)."""
    warning: str | None = None
    """When the pick leaves less than the headroom asked (nothing fitting did): the line saying so."""

    @property
    def summary(self) -> str:
        if self.strategy is None:
            return "nothing fits; " + (self.change or (self.reasons[0] if self.search is not None else ""))
        mb = f"; largest micro-batch that fits: {self.max_micro_batch}" if self.max_micro_batch else ""
        why = self.pick_reason or (self.reasons[0] if self.reasons else "")
        on = f" on {self.layout.words()}" if self.search is not None and self.layout is not None else ""
        if self.change:
            return f"nothing fits as given; with {self.change}: {self.strategy}{on}, {why}{mb}"
        return f"{self.strategy}{on}, {why}{mb}"

    def to_dict(self) -> dict:
        d = {"strategy": self.strategy, "reasons": list(self.reasons),
             "max_micro_batch": self.max_micro_batch, "change": self.change,
             "layout": self.layout.to_dict() if self.layout is not None else None, "warning": self.warning}
        r = self.result
        if r is not None:
            # the pick's collectives on its mesh, grouped as the estimate's (dp, tp, pp, or the
            # data-parallel groups intra_node / inter_node / world without a mesh)
            groups: dict = {}
            for c in r.collectives:
                g = groups.setdefault(c.group, {"calls": 0, "bytes_per_gpu": 0, "time_s": 0.0})
                g["calls"] += int(c.calls)
                g["bytes_per_gpu"] += int(c.bytes_per_gpu)
                g["time_s"] += c.time_s
            d.update(step_time_s=r.step_time_s, collectives=[c.to_dict() for c in r.collectives], groups=groups)
        if self.search is not None:
            d["search"] = self.search.to_dict()
        return d


def _largest(fits, lo: int, hi: int) -> int:
    """Largest b in [lo, hi) with fits(b), given fits(lo) and a monotone `fits`."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def max_micro_batch(train: TrainConfig, cluster: Cluster, strategy: str, limit: int = 4096) -> int:
    """Largest micro-batch for which the strategy still fits (0 if even 1 does not).

    Two searches: first on the allocated peak alone (closed form, microseconds), which bounds the answer
    from above since the reserved peak is never below it; then on the whole device footprint, whose
    reserved part costs an allocator replay. That one starts where the plan's own run (replayed already)
    puts it: the largest micro-batch whose allocated peak plus that run's reserved-and-overhead excess
    fits, then gallops up or down from it (two replays where the guess is right, one of them stopping
    early above the line)."""
    def mem(b: int):
        return estimate_memory(replace(train, micro_batch=b), cluster, strategy)

    def alloc_fits(b: int) -> bool:
        return mem(b).allocated_fits

    def fits(b: int) -> bool:  # the whole footprint, without the allocator releasing its cache every step
        return mem(b).fits_cleanly
    if not alloc_fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and alloc_fits(hi):
        lo, hi = hi, hi * 2
    bound = _largest(alloc_fits, lo, min(hi, limit + 1))
    own = mem(train.micro_batch)
    excess = max(0, own.device_total - own.peak_allocated)
    cap = own.gpu_memory_bytes

    def guessed(b: int) -> bool:
        return mem(b).peak_allocated + excess <= cap
    return _gallop(fits, _largest(guessed, 1, bound + 1) if guessed(1) else 1, bound)


def _gallop(fits, start: int, bound: int) -> int:
    """Largest b in [1, bound] with fits(b) (monotone), 0 if none: from `start`, steps of 1, 2, 4, ... to the
    first b on the other side, then a bisection. Two calls where `start` is the answer or one above it;
    never more than about twice a bisection's."""
    step = 1
    if fits(start):
        lo = start
        while lo + step <= bound and fits(lo + step):
            lo, step = lo + step, 2 * step
        return _largest(fits, lo, min(lo + step, bound + 1))
    hi = start
    while hi - step >= 1 and not fits(hi - step):
        hi, step = hi - step, 2 * step
    if hi - step < 1:
        return _largest(fits, 1, hi) if fits(1) else 0
    return _largest(fits, hi - step, hi)


def _fitter(plan):
    """fits(train, cluster, name): the training step fits and, when the plan saves a checkpoint
    (`plan.checkpoint`), so does the save (checkpoint.py)."""
    mode = getattr(plan, "checkpoint", None)
    if not mode:
        return lambda t, c, n: estimate_memory(t, c, n).fits_cleanly


    def fits(t, c, n) -> bool:
        mem = estimate_memory(t, c, n)
        if not mem.fits_cleanly:
            return False
        ck = estimate_checkpoint(t, c, n, mode, plan.storage_bytes_per_s or 1.0, mem=mem)
        return ck is None or ck.fits
    return fits


def _smallest_change(plan):
    """(words, train, cluster) of the smallest change that makes a strategy fit, or (words, None, None)."""
    train, cluster = plan.train, plan.cluster
    names = [r.name for r in plan.results]
    fits_as = _fitter(plan)
    mode = getattr(plan, "checkpoint", None)
    if mode and mode != "sharded" and any(r.memory.fits for r in plan.results):
        # The training step fits; the save does not: a sharded save gathers nothing.
        return ("--checkpoint sharded (torch.distributed.checkpoint.save: nothing gathered)", train, cluster)
    sharded = [n for n in ("zero3", "fsdp", "hsdp") if n in names] or ["zero3"]
    if train.micro_batch > 1:
        # The largest smaller micro-batch with which a strategy fits: memory grows with the micro-batch
        # (and every candidate accumulates, grad_accum > 1), so fitting is monotone and a bisection
        # over [1, micro_batch - 1] finds what a downward scan would, in log2(micro_batch) steps.
        # The smallest candidate keeps grad_accum within units.LIMITS (1 unless that is enormous).
        def smaller(b: int):
            return replace(train, micro_batch=b, grad_accum=train.grad_accum * -(-train.micro_batch // b))

        def fits(b: int) -> bool:
            t = smaller(b)
            return any(fits_as(t, cluster, n) for n in names)

        k = LIMITS["grad_accum"][1] // train.grad_accum  # the largest ceil(micro_batch / b) allowed
        b_min = -(-train.micro_batch // k) if k >= 2 else train.micro_batch
        if b_min < train.micro_batch and fits(b_min):
            lo, hi = b_min, train.micro_batch  # fits(lo); hi: not tried or does not fit
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            t = smaller(lo)
            return (f"--micro-batch {lo} --grad-accum {t.grad_accum} (same global batch)", t, cluster)
    # the zero-bubble schedules are modelled without checkpointing (pp.check_pp): keep theirs as it is
    ckpt_ok = not (train.pp > 1 and train.pp_schedule in ZERO_BUBBLE)
    if train.checkpointing != "full" and ckpt_ok:
        for mode in ("selective", "full"):
            if train.checkpointing == "selective" and mode == "selective":
                continue
            t = replace(train, checkpointing=mode)
            if any(fits_as(t, cluster, n) for n in names):
                extra = "about 1/3 more compute" if mode == "full" else "recomputes norms and activations"
                return (f"--activation-checkpointing {mode} ({extra})", t, cluster)
    if train.pp == 1:  # offload is not modelled with pipeline stages
        t = replace(train, cpu_offload="params", checkpointing="full")
        for n in sharded:
            if fits_as(t, cluster, n):
                return ("--cpu-offload params --activation-checkpointing full (slow: bound by PCIe)", t, cluster)
    if train.pp > 1 or train.tp > 1:
        # The mesh: sequence parallelism (TP's norms and checkpointed block inputs split by tp), more
        # pipeline stages on the same GPUs (fewer layers, so fewer parameters per stage; 1F1B keeps at
        # least one micro-batch per stage), with full checkpointing.
        t0 = replace(train, checkpointing="full") if train.checkpointing != "full" and ckpt_ok else train
        ck = " --activation-checkpointing full" if t0 is not train else ""
        sps = [train.sequence_parallel] + ([True] if train.tp > 1 and not train.sequence_parallel else [])
        for sp in sps:
            p = train.pp
            while (p * virtual_stages(train.pp_schedule) <= train.model.layers
                   and cluster.gpus % (train.tp * p) == 0 and (p == 1) <= (train.pp == 1)):
                if (p, sp) != (train.pp, train.sequence_parallel):
                    t = replace(t0, pp=p, sequence_parallel=sp,
                                pp_microbatches=max(train.pp_microbatches, p) if p > 1 else 1)
                    if any(fits_as(t, cluster, n) for n in names):
                        words = " ".join(w for w in (
                            "--sequence-parallel" if sp != train.sequence_parallel else "",
                            f"--pp {p} --pp-microbatches {t.pp_microbatches}" if p != train.pp else "") if w)
                        return (words + ck, t, cluster)
                if train.pp == 1:
                    break
                p *= 2
    gpus = cluster.gpus
    t = replace(train, checkpointing="full") if train.checkpointing != "full" and ckpt_ok else train
    for _ in range(12):
        gpus *= 2
        if gpus > LIMITS["gpus"][1]:  # no cluster that large exists (units.LIMITS)
            break
        c = replace(cluster, gpus=gpus, gpus_per_node=min(cluster.gpus_per_node, gpus))
        if any(fits_as(t, c, n) for n in sharded):
            ck = " with --activation-checkpointing full" if t is not train else ""
            return (f"--gpus {gpus}{ck}", t, c)
    more = "more" if train.tp > 1 or train.pp > 1 else ""
    return (f"no change tried fits: this model needs {more + ' ' if more else ''}tensor/pipeline parallelism "
            f"or larger GPUs", None, None)


def _choose(plan) -> tuple:
    """(best, ok, timed): the result `recommend` picks among the plan's (None when nothing fits), the results
    it picked among (those with the headroom, else those that fit), and whether all of those are timed."""
    results = plan.results
    ok = [r for r in results if _headroom_ok(r, plan.headroom)] or [r for r in results if r.fits_cleanly]
    if not ok:
        return None, ok, False
    timed = all(r.step_time_s for r in ok)
    if timed:
        fastest = min(r.step_time_s for r in ok)
        near = [r for r in ok if r.step_time_s <= fastest * (1 + TIE_FRACTION)]
        best = min(near, key=lambda r: _rank(r.name, plan.cluster.nodes))
    else:
        best = min(ok, key=lambda r: _rank(r.name, plan.cluster.nodes))
    return best, ok, timed


def _changed_plan(plan, words: str, train, cluster):
    """The plan under the smallest change `words` (`_smallest_change`): every strategy evaluated again."""
    mode = getattr(plan, "checkpoint", None)
    if mode and words.startswith("--checkpoint sharded"):
        mode = "sharded"
    storage = getattr(plan, "storage_bytes_per_s", None)
    return plan.changed(train, cluster, mode, storage)


def pick(plan) -> tuple:
    """(strategy, change): what `recommend(plan)` answers in its `strategy` and `change`, without the reasons
    and the micro-batch search (whose allocator replays a sweep does not need): the strategy picked as
    given, or, when nothing fits, the smallest change and the strategy picked with it (None if none)."""
    if getattr(plan, "search", None) is not None:
        rec = recommend(plan)
        return rec.strategy, rec.change
    best, _, _ = _choose(plan)
    if best is not None:
        return best.name, None
    words, train, cluster = _smallest_change(plan)
    if train is None:
        return None, words
    best, _, _ = _choose(_changed_plan(plan, words, train, cluster))
    return (best.name if best is not None else None), words


def recommend(plan, _depth: int = 0) -> Recommendation:
    search = getattr(plan, "search", None)
    if search is not None:
        return _recommend_searched(plan, search)
    best, ok, timed = _choose(plan)
    if best is None:
        words, train, cluster = _smallest_change(plan)
        first = (f"nothing fits in {fmt_gib(plan.cluster.gpu_memory_bytes)} GiB per GPU as given; "
                 f"smallest change: {words}")
        if train is None or _depth > 0:
            return Recommendation(None, [first], None, words)
        changed = _changed_plan(plan, words, train, cluster)
        rec = recommend(changed, _depth=1)
        rec.reasons = [first] + [f"with that change: {r}" for r in rec.reasons]
        rec.change = words
        rec.changed_plan = changed
        return rec
    reasons = _reasons(plan, best, ok, timed)
    mb = max_micro_batch(plan.train, plan.cluster, best.name)
    return Recommendation(best.name, reasons, mb or None, pick_reason=reasons[0],
                          layout=Layout.of(plan.train, plan.cluster), result=best,
                          warning=headroom_warning(best, plan.headroom))


def _recommend_searched(plan, search) -> Recommendation:
    """The recommendation of a layout search (layout.py): `plan` is the picked layout's plan (or the plan
    as given when nothing fits anywhere)."""
    gpu = plan.cluster.gpu_memory_bytes
    if search.pick is None:
        # no layout fits, even with the checkpointing the search tries: the smallest change beyond the
        # mesh (CPU offload, more GPUs) as without a search, on the configuration as given
        rec = recommend(replace(plan, search=None))
        if rec.strategy is None:  # its "needs tensor/pipeline parallelism" is what was just searched
            return Recommendation(None, [nothing_fits_words(search, gpu)], None, None, search=search)
        rec.reasons.insert(0, nothing_fits_words(search, gpu, advice=False))
        rec.search = search
        return rec
    cand, best = search.pick
    ok = [r for r in plan.results if _headroom_ok(r, plan.headroom)] or [r for r in plan.results if r.fits_cleanly]
    timed = all(r.step_time_s for r in ok)
    reasons = layout_reasons(search, plan.cluster, gpu)
    strat = _reasons(plan, best, ok, timed)
    why = strat[0]
    strat[0] = f"{best.name} on this layout: {why}"
    reasons += strat
    if search.change:
        given = search.given_failed
        reasons.insert(0, f"nothing fits in {fmt_gib(gpu)} GiB per GPU in any of the {len(given.candidates)} layouts "
                          f"as given; smallest change: {search.change}")
    mb = max_micro_batch(plan.train, plan.cluster, best.name)
    return Recommendation(best.name, reasons, mb or None, change=search.change,
                          pick_reason=why, layout=cand.layout, result=best, search=search,
                          warning=headroom_warning(best, plan.headroom, "layout and strategy"))


def _reasons(plan, best, ok, timed) -> list[str]:
    gpu_gib = fmt_gib(plan.cluster.gpu_memory_bytes)
    by = {r.name: r for r in plan.results}
    out = []
    mem = best.memory
    if timed:
        fastest = min(ok, key=lambda r: r.step_time_s)
        speed = (f"step {fmt_seconds(best.step_time_s)} ({best.time.tokens_per_s:,.0f} tokens/s, "
                 f"MFU {100 * best.time.mfu:.0f}%), {fmt_gib(mem.headroom)} GiB free of {gpu_gib} GiB")
        if fastest is best or fastest.step_time_s == best.step_time_s:
            out.append(f"the fastest that fits: {speed}")
        else:
            out.append(f"the simplest of those within {100 * TIE_FRACTION:.0f}% of the fastest "
                       f"({fastest.name}, {fmt_seconds(fastest.step_time_s)}): {speed}")
    else:
        out.append(f"the simplest strategy that fits: peak {fmt_gib(mem.peak_allocated)} GiB allocated, "
                   f"{fmt_gib(mem.peak_reserved)} GiB reserved by the caching allocator, "
                   f"{fmt_gib(mem.device_total)} of {gpu_gib} GiB with the CUDA context and NCCL")
    too_big = [r for r in plan.results if not r.fits]
    if too_big:
        def why(r) -> str:
            if r.memory.fits and r.checkpoint is not None:  # the step fits, the save does not
                return f"{r.name} (its {r.checkpoint.mode} save: {fmt_gib(r.checkpoint.device_peak_bytes)} GiB)"
            return f"{r.name} ({fmt_gib(r.memory.total_required)} GiB)"
        out.append("does not fit: " + ", ".join(why(r) for r in sorted(too_big, key=lambda r: _rank(r.name))))
    retry = [r for r in plan.results if r.fits and r.memory.alloc_retries]
    if retry:
        out.append("fit only by the caching allocator releasing its cached segments and retrying (slower steps; "
                   "not picked): " + ", ".join(f"{r.name} ({r.memory.alloc_retries} retries)"
                                               for r in sorted(retry, key=lambda r: _rank(r.name))))
    ddp = by.get("ddp")
    sharded = best.strategy.shards_params and best.strategy.reshard_after_forward
    if timed and sharded and ddp is not None and ddp.comm_bytes_per_gpu and best.comm_bytes_per_gpu:
        ratio = best.comm_bytes_per_gpu / ddp.comm_bytes_per_gpu
        extra = best.time.exposed_comm_s - ddp.time.exposed_comm_s
        link = plan.cluster.inter_link if plan.cluster.nodes > 1 else plan.cluster.intra_link
        out.append(f"{best.name} moves {ratio:.2f}x DDP's bytes ({fmt_bytes(best.comm_bytes_per_gpu)} per GPU "
                   f"per step); over {link} that {'adds' if extra >= 0 else 'saves'} "
                   f"{fmt_seconds(abs(extra))} of exposed communication a step")
    hs = by.get("hsdp")
    if timed and sharded and hs is not None and plan.cluster.nodes > 1:
        z3 = by.get("zero3") or by.get("fsdp")
        if z3 is not None and z3.step_time_s:
            out.append(f"hsdp keeps all-gathers and reduce-scatters inside the node and sends only a gradient "
                       f"all-reduce across nodes: step {fmt_seconds(hs.step_time_s)} vs "
                       f"{fmt_seconds(z3.step_time_s)} for {z3.name}")
    req = best.required_inter_bytes_per_s
    if timed and req is not None:
        if req == float("inf"):
            out.append(f"{best.name}'s communication cannot hide behind compute at any inter-node bandwidth: "
                       f"the intra-node part alone ({plan.cluster.intra_link}) exceeds the compute it overlaps")
        else:
            out.append(f"{best.name}'s communication would hide behind compute at "
                       f"{req * 8 / 1e9:,.0f} Gbit/s per node between nodes (now "
                       f"{_inter_gbps(plan.cluster):,.0f} Gbit/s)")
    if timed:
        out += _comm_bound(plan, best)
    return out


COMM_BOUND_FRACTION = 1.0
"""A step is communication-bound when its exposed communication exceeds its compute (the step more
than doubles what the GPUs' arithmetic alone would take)."""


def _comm_bound(plan, best) -> list[str]:
    """When the pick's step is mostly waiting on the network: say so, with the step time each usual
    remedy gives on this model (HSDP, a NIC per GPU, RDMA instead of TCP sockets, fewer nodes)."""
    t = best.time
    if t is None or t.exposed_comm_s <= COMM_BOUND_FRACTION * t.compute_s:
        return []
    cl = plan.cluster
    options = []

    def step_of(cluster_, name):
        r = plan.evaluate_on(cluster_, name)  # a traced model's plan evaluates its own workload
        return r if r.fits_cleanly and r.time is not None else None

    by = {r.name: r for r in plan.results}
    hs = by.get("hsdp")
    if cl.nodes > 1 and not best.strategy.hybrid and hs is not None and hs.fits_cleanly and hs.step_time_s < best.step_time_s:
        options.append(f"hsdp: {fmt_seconds(hs.step_time_s)}")
    if cl.nodes > 1 and cl.nics_per_node < cl.gpus_per_node and not cl.inter_bytes_per_s:
        r = step_of(replace(cl, nics_per_node=cl.gpus_per_node), best.name)
        if r is not None:
            options.append(f"--nics-per-node {cl.gpus_per_node}: {fmt_seconds(r.step_time_s)}")
    if cl.nodes > 1 and cl.inter_link.endswith("-tcp") and not cl.inter_bytes_per_s:
        rdma = cl.inter_link[:-len("-tcp")] + "-roce"
        if rdma in _catalog(cl.catalog_dirs).names("interconnects"):
            r = step_of(replace(cl, inter_link=rdma), best.name)
            if r is not None:
                options.append(f"--inter {rdma} (RDMA): {fmt_seconds(r.step_time_s)}")
    nodes = cl.nodes // 2
    while nodes >= 1 and cl.nodes > 1:
        c = replace(cl, gpus=nodes * cl.gpus_per_node)
        r = step_of(c, best.name)
        if r is None:
            break
        if r.time.mfu > t.mfu * 1.5:
            options.append(f"--gpus {c.gpus} ({nodes} node{'s' if nodes > 1 else ''}): MFU "
                           f"{100 * r.time.mfu:.0f}%, {r.time.tokens_per_s / c.gpus:,.0f} tokens/s per GPU "
                           f"vs {t.tokens_per_s / cl.gpus:,.0f} now")
            break
        nodes //= 2
    line = (f"communication-bound: {fmt_seconds(t.exposed_comm_s)} of the {fmt_seconds(t.step_time_s)} step is "
            f"communication that compute does not hide (MFU {100 * t.mfu:.0f}%)")
    if options:
        line += "; step time with " + "; ".join(options)
    return [line]


def _inter_gbps(cluster) -> float:
    if cluster.inter_bytes_per_s:
        return cluster.inter_bytes_per_s * 8 / 1e9
    return _catalog().interconnect(cluster.inter_link).line_rate_bytes_per_s * cluster.nics_per_node * 8 / 1e9


def render_recommendation(plan, table_format: str = "simple") -> str:
    rec = plan.recommendation
    lines = [header(plan), ""]
    if rec.search is not None:
        lines += [layout_table(plan, table_format), ""]
    lines += [memory_table(plan, table_format), wrap(memory_line(plan.error_front_end))]
    ct = comm_table(plan, table_format)
    if ct:
        lines += ["", ct, wrap(time_line(plan.error_front_end))]
    lines.append("")
    if rec.strategy is None:
        lines.append("recommendation: nothing fits")
        lines.append(wrap(f"  - {rec.reasons[0]}"))
    else:
        lines[-1:] = recommended_rows(plan, table_format) + [""]
        mb = f", largest micro-batch that fits: {rec.max_micro_batch}" if rec.max_micro_batch else ""
        change = f" with {rec.change}" if rec.change else ""
        on = f" on {rec.layout.words()}" if rec.search is not None else ""
        lines.append(wrap(f"recommendation: {rec.strategy} ({get_strategy(rec.strategy).implementation}){on}"
                          f"{change}{mb}"))
        if rec.warning:
            lines.append(wrap(f"warning: {rec.warning}"))
        for reason in rec.reasons:
            lines.append(wrap(f"  - {reason}"))
    trace = rec.search.trace if rec.search is not None else None
    if trace is not None:  # the trace front end's check of the data-parallel layout (trace_check.py)
        lines += [wrap(line) for line in trace.lines()]
    return "\n".join(lines)
