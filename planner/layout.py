"""The parallel layout search: which (dp, tp, pp) mesh, with or without sequence parallelism, and which
data-parallel strategy on it, for one model, cluster and sequence length.

Candidates (`candidate_layouts`):
- tp: the divisors of the GPUs of a node that split the model's heads, KV heads and MLP width
  (`config.tp_divisors`, `config.check_tp`): tensor parallelism stays inside an NVLink domain, its
  per-layer collectives on the critical path (tp.py). Narayanan et al. 2021 (arXiv:2104.04473) §3.2,
  takeaway #1: tensor parallelism up to the GPUs of a server, pipeline parallelism across servers.
- pp: the divisors of gpus / tp that are powers of two or divide the layers, with p x v stages no more
  than the layers (`pp.check_pp`: uneven splits are allowed, the first L mod p stages one layer more);
  1 where the run cannot pipeline (tied embeddings, DeepSpeed, CPU offload: `check_pp` refuses).
- dp = gpus / (tp x pp); sequence parallelism on and off for every tp > 1.
- cp (context parallelism, cp.py): the degree given (--cp) in every layout; else 1 and, for sequences of
  `CP_MIN_SEQ` tokens or more, the powers of two that split the sequence (without pipeline stages: CP
  with PP is not modelled).
A dimension the user fixed (--tp, --pp, --sequence-parallel) is not searched.

Every layout runs the same global batch, the one the flags give as written (dp x micro-batch x
accumulation or pipeline micro-batches, with the unfixed dimensions at 1): the micro-batch stays the
user's and each layout takes global / (micro-batch x dp) micro-batches per step, as Megatron-LM does
(`megatron/core/num_microbatches_calculator.py`, `ConstantNumMicroBatchesCalculator`), as pipeline
micro-batches when pp > 1 and as gradient accumulation otherwise. So every candidate's step processes
the same tokens and step times compare directly.

Each (layout, strategy) is first judged by the closed-form allocated peak (`MemoryEstimate.allocated_fits`,
microseconds); only those that pass get a collective schedule and a step time, and only those walked in
step-time order up to the pick pay the reserved peak's allocator replay (`peak_reserved`).

Pick (`recommend.py`'s rule over layouts): among (layout, strategy) pairs that fit with headroom, the
fastest; within `TIE_FRACTION` of it the simplest: smaller tp x pp, then smaller pp, then sequence
parallelism off, then the simpler strategy (Narayanan et al. §3.2 takeaway #2: the smallest model-parallel
size that fits, data parallelism for the rest).

Known limitations: pipeline schedules are not searched (`--pp-schedule` picks one for every pp > 1);
the micro-batch and activation checkpointing change only when nothing fits (the smallest change, as in
recommend.py); CPU offload is not tried with a layout; context parallelism only from `CP_MIN_SEQ` tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from .comm import cluster_links
from .config import Cluster, TrainConfig, tp_divisors
from .memory import estimate_memory
from .pp import PP_STRATEGIES, _stages_to_walk, bubble_fraction, virtual_stages
from .ranking import HEADROOM_FRACTION, TIE_FRACTION, _headroom_ok, _rank
from .strategies import NAMES, get_strategy
from .strategy_result import drop_conflicts, evaluate
from .units import LIMITS, fmt_gib, fmt_seconds

SEARCH_BUDGET_S = 4.0
"""Work one layout search may do (all its tries: as given, a smaller micro-batch, checkpointing), in
`eval_cost_s`'s estimated seconds, which overstate the CPU time about fourfold (Llama-3-405B on 256 GPUs:
three tries of 204 configurations, 1.24 s estimated, 0.3 s of CPU on the 2-core CI VM). Realistic inputs
stay far below it; a hostile one (1,024 GPUs per node, a million GPUs) evaluates its simplest layouts
first and says how many it left."""
EVAL_COST_S = 1.5e-3
"""Estimated cost of one (layout, strategy): the memory walk and, where it fits, schedule and time."""
STAGE_MICROBATCH_COST_S = 2.5e-6
"""Added per pipeline micro-batch per stage walked: `pp.stage_memory` walks the schedule's actions."""

CP_MIN_SEQ = 16384
"""Context parallelism is searched from this sequence length up (powers of two that split the sequence
into 2 x cp chunks, cp.check_cp); below it cp = 1 unless --cp is given. A design choice: CP exists for
sequences whose activations outgrow a GPU, and at a few thousand tokens its per-layer ring collectives
only cost (the search would still only pick it when faster)."""


def cp_degrees(train: TrainConfig, gpus: int) -> list[int]:
    """Context-parallel degrees the search tries: the one given, else 1 and, for sequences of at least
    `CP_MIN_SEQ` tokens with SDPA on PyTorch, the powers of two up to the GPUs that split the sequence."""
    if train.cp > 1:
        return [train.cp]
    out = [1]
    if train.seq_len >= CP_MIN_SEQ and train.attention == "sdpa" and train.framework == "pytorch":
        c = 2
        while c <= gpus and train.seq_len % (2 * c) == 0:
            out.append(c)
            c *= 2
    return out


@dataclass(frozen=True)
class Layout:
    """One device mesh (torchtitan's order: pp outermost, then dp, cp, tp innermost)."""

    dp: int
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 1
    micro_batch: int = 1
    grad_accum: int = 1
    cp: int = 1
    """Context-parallel degree (cp.py): the one given, or searched for long sequences (`cp_degrees`)."""

    @property
    def simplicity(self) -> tuple:
        """Smaller is simpler: model-parallel size, then pipeline stages, then sequence parallelism."""
        return (self.tp * self.pp * self.cp, self.pp, self.cp, self.sequence_parallel)

    @property
    def micro_steps(self) -> int:
        return self.pp_microbatches if self.pp > 1 else self.grad_accum

    def words(self) -> str:
        """'dp 2 x tp 8 x pp 16 (sequence parallel, 1f1b, 128 micro-batches)'."""
        mesh = " x ".join(f"{k} {v}" for k, v in (("dp", self.dp), ("cp", self.cp), ("tp", self.tp),
                                                  ("pp", self.pp)) if k in ("dp", "tp", "pp") or v > 1)
        extra = []
        if self.tp > 1:
            extra.append("sequence parallel" if self.sequence_parallel else "no sequence parallelism")
        if self.pp > 1:
            extra.append(f"{self.pp_schedule}, {self.pp_microbatches} micro-batches")
        elif self.grad_accum > 1:
            extra.append(f"{self.grad_accum} accumulation steps")
        return mesh + (f" ({', '.join(extra)})" if extra else "")

    def flags(self) -> str:
        """The CLI flags that fix this layout."""
        out = [f"--tp {self.tp}"] + (["--sequence-parallel"] if self.sequence_parallel else [])
        out.append(f"--pp {self.pp}")
        if self.cp > 1:
            out.append(f"--cp {self.cp}")
        if self.pp > 1:
            out.append(f"--pp-schedule {self.pp_schedule} --pp-microbatches {self.pp_microbatches}")
        elif self.grad_accum > 1:
            out.append(f"--grad-accum {self.grad_accum}")
        return " ".join(out)

    def to_dict(self) -> dict:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp, "sequence_parallel": self.sequence_parallel,
                "pp_schedule": self.pp_schedule if self.pp > 1 else None,
                "pp_microbatches": self.pp_microbatches, "micro_batch": self.micro_batch,
                "grad_accum": self.grad_accum}

    @classmethod
    def of(cls, train: TrainConfig, cluster: Cluster) -> "Layout":
        return cls(cluster.gpus // (train.tp * train.pp * train.cp), train.tp, train.pp, train.sequence_parallel,
                   train.pp_schedule, train.pp_microbatches, train.micro_batch, train.grad_accum, train.cp)


def global_batch(train: TrainConfig, cluster: Cluster) -> int:
    """Sequences per optimizer step: dp x micro-batch x (pipeline micro-batches or accumulation); the cp
    ranks of a data-parallel replica share its sequences."""
    dp = cluster.gpus // (train.tp * train.pp * train.cp)
    return dp * train.micro_batch * (train.pp_microbatches if train.pp > 1 else train.grad_accum)


@dataclass
class Candidate:
    layout: Layout
    train: TrainConfig
    nodes: int = 1
    """The cluster's nodes (HSDP on one node is never the simpler pick: `recommend._rank`)."""
    results: list = field(default_factory=list)
    """`api.StrategyResult` per strategy; `time` is None where the allocated peak alone does not fit."""
    headroom: float = HEADROOM_FRACTION
    """The fraction of GPU memory a pick must leave free (ranking._headroom_ok)."""

    _best: tuple | None = field(default=None, repr=False)

    def best(self):
        """This layout's strategy by the same rule as the whole search; None when none fits."""
        if self._best is None:
            x = _pick([(self, r) for r in self.results], self.nodes, self.headroom)
            self._best = (x[1] if x else None,)
        return self._best[0]

    def closest(self):
        """The result needing the least memory (by the allocated peak: no replay)."""
        return min(self.results, key=lambda r: r.memory.peak_allocated + r.memory.process_overhead)


@dataclass
class LayoutSearch:
    """What was searched, what fits, and the pick."""

    candidates: list
    pick: tuple | None
    """(Candidate, StrategyResult) or None when nothing fits."""
    global_batch: int
    seconds: float = 0.0
    """Wall-clock seconds of the whole search (all its tries, each layout's best judged)."""
    cpu_seconds: float = 0.0
    """The same in this process's CPU time (what a loaded machine does not inflate)."""
    tp_values: tuple = ()
    pp_values: tuple = ()
    sp_values: tuple = ()
    refused: list = field(default_factory=list)
    """One line per dimension value the checks refused (why pp was not searched, say)."""
    change: str | None = None
    """When nothing fits as given: the change under which the pick was found (flags)."""
    tried: str | None = None
    """When nothing fits even with a change: the last change tried (this search's candidates are under it)."""
    given_failed: "LayoutSearch | None" = None
    """The search as given, when a change was needed."""
    skipped: int = 0
    """Layouts left unevaluated when `SEARCH_BUDGET_S` ran out (the least simple ones)."""
    headroom: float = HEADROOM_FRACTION
    """The fraction of GPU memory the pick must leave free (ranking._headroom_ok)."""
    trace: object = None
    """`trace_check.TraceCheck`: the data-parallel layout also planned by the trace front end (every layout is
    judged by the analytic one); None without the trace."""

    @property
    def evaluated(self) -> int:
        return sum(len(c.results) for c in self.candidates)

    def layout_bests(self) -> list:
        """(Candidate, best or None) per layout: fitting ones by step time, then the rest by memory."""
        rows = [(c, c.best()) for c in self.candidates if c.results]
        fit = sorted((x for x in rows if x[1] is not None), key=lambda x: (_time(x[1]), x[0].layout.simplicity))
        rest = sorted((x for x in rows if x[1] is None),
                      key=lambda x: x[0].closest().memory.peak_allocated + x[0].closest().memory.process_overhead)
        return fit + rest

    def to_dict(self) -> dict:
        return {"seconds": self.seconds, "cpu_seconds": self.cpu_seconds, "global_batch": self.global_batch,
                "evaluated": self.evaluated,
                "skipped_layouts": self.skipped,
                "layouts": len(self.candidates), "tp": list(self.tp_values), "pp": list(self.pp_values),
                "sequence_parallel": list(self.sp_values), "change": self.change,
                "headroom": self.headroom, "versus_fastest": versus_fastest(self),
                "front_end": "analytic", "trace_check": self.trace.to_dict() if self.trace is not None else None,
                "candidates": [_candidate_dict(c, b) for c, b in self.layout_bests()]}


def _candidate_dict(c: Candidate, best) -> dict:
    r = best or c.closest()
    m = r.memory
    return {"layout": c.layout.to_dict(), "strategy": r.name, "fits": best is not None,
            "alloc_retries": int(m.alloc_retries),
            "peak_allocated": int(m.peak_allocated),
            "device_total": int(m.device_total) if best is not None or m.reserved_replay is None else None,
            "device_lower_bound": int(m.peak_allocated + m.process_overhead),
            "step_time_s": r.step_time_s}


def _time(r) -> float:
    return r.step_time_s if r.step_time_s is not None else float("inf")


def _rank_key(cand: Candidate, r, nodes: int) -> tuple:
    return cand.layout.simplicity + (_rank(r.name, nodes),)


def _pick(rows: list, nodes: int | None = None, headroom: float = HEADROOM_FRACTION):
    """recommend.py's rule over (Candidate, StrategyResult) rows: fits with headroom (else fits),
    fastest, the simplest within TIE_FRACTION. Walks the rows in step-time order so that the reserved
    peak is replayed only for the rows it must judge."""
    live = [x for x in rows if x[1].memory.allocated_fits and x[1].time is not None]
    if not live:
        return None
    live.sort(key=lambda x: (_time(x[1]), x[0].layout.simplicity))
    n = nodes if nodes is not None else live[0][0].nodes
    for ok in (lambda r: _headroom_ok(r, headroom), lambda r: r.fits_cleanly):
        fastest = next((x for x in live if ok(x[1])), None)
        if fastest is None:
            continue
        limit = _time(fastest[1]) * (1 + TIE_FRACTION)
        near = [x for x in live if _time(x[1]) <= limit and ok(x[1])]
        return min(near, key=lambda x: _rank_key(x[0], x[1], n))
    return None


def candidate_layouts(train: TrainConfig, cluster: Cluster, *, fixed_tp: int | None = None,
                      fixed_pp: int | None = None, fixed_sp: bool | None = None,
                      batch: int | None = None) -> tuple[list, list, tuple, tuple, tuple]:
    """([(Layout, TrainConfig)], [refusal lines], tp values, pp values, sp values) for the search.

    `batch`: the global batch in sequences (default: what `train` runs on `cluster`)."""
    batch = batch or global_batch(train, cluster)
    m = train.model
    gpus, local = cluster.gpus, cluster.local_size
    tps = [fixed_tp] if fixed_tp else tp_divisors(m, gpus, local)
    refused: list[str] = []
    out = []
    pps_seen: set = set()
    sps_seen: set = set()
    v = virtual_stages(train.pp_schedule)
    cps = cp_degrees(train, gpus)
    for tp, cp in ((t, c) for t in tps for c in cps):
        if gpus % (tp * cp):
            continue
        rest = gpus // (tp * cp)
        if fixed_pp:
            pps = [fixed_pp]
        else:
            pps = [p for p in range(1, rest + 1) if rest % p == 0 and p * v <= m.layers
                   and (p & (p - 1) == 0 or m.layers % p == 0)]
        sps = [fixed_sp] if fixed_sp is not None else ([False, True] if tp > 1 else [False])
        for pp in pps:
            if gpus % (tp * pp * cp):
                continue
            dp = gpus // (tp * pp * cp)
            if (batch * tp * pp * cp) % (gpus * train.micro_batch):
                refused.append(f"dp {dp} x tp {tp} x pp {pp}: the global batch of {batch} sequences is not a "
                               f"multiple of dp x micro-batch = {dp * train.micro_batch}")
                continue
            steps = batch * tp * pp * cp // (gpus * train.micro_batch)
            if steps > LIMITS["grad_accum"][1]:
                continue
            for sp in sps:
                if sp and tp == 1:
                    continue
                try:
                    t = replace(train, tp=tp, pp=pp, cp=cp, sequence_parallel=sp,
                                pp_microbatches=steps if pp > 1 else 1, grad_accum=1 if pp > 1 else steps)
                except ValueError as exc:
                    line = str(exc).splitlines()[0]
                    if line not in refused:
                        refused.append(line)
                    continue
                pps_seen.add(pp)
                sps_seen.add(sp)
                out.append((Layout(dp, tp, pp, sp, train.pp_schedule, t.pp_microbatches, t.micro_batch,
                                   t.grad_accum, cp), t))
    tps_seen = tuple(sorted({lay.tp for lay, _ in out}))
    return out, refused, tps_seen, tuple(sorted(pps_seen)), tuple(sorted(sps_seen))


def layout_strategies(layout: Layout, strategies=None, optimizer: str = "adamw",
                      framework: str = "pytorch") -> list[str]:
    """The strategies evaluated on a layout: those `api.plan` would (`single` only with dp = 1; the
    pipeline's with pp > 1; none that cannot run `optimizer`, `api.drop_conflicts`), limited to `strategies`
    when given."""
    if strategies:
        names = [n for n in strategies if layout.pp == 1 or n in PP_STRATEGIES]
        return names
    if layout.dp * layout.cp == 1:  # the strategies run over the dp x cp ranks
        return ["single"]
    return drop_conflicts([n for n in NAMES if get_strategy(n).distributed and (layout.pp == 1 or n in PP_STRATEGIES)],
                          optimizer, False, framework)[0]


def eval_cost_s(layout: Layout, n_strategies: int) -> float:
    """Estimated seconds to evaluate `n_strategies` strategies on `layout` (`SEARCH_BUDGET_S`)."""
    walk = len(_stages_to_walk(layout.pp)) * layout.pp_microbatches if layout.pp > 1 else 0
    return n_strategies * (EVAL_COST_S + STAGE_MICROBATCH_COST_S * walk)


@dataclass
class Budget:
    """What is left of `SEARCH_BUDGET_S` across the tries of one search."""

    left_s: float = field(default_factory=lambda: SEARCH_BUDGET_S)


def evaluate_layout(layout: Layout, train: TrainConfig, cluster: Cluster, strategies=None, *,
                    checkpoint: str | None = None, storage_bytes_per_s: float | None = None,
                    catalog_dirs=(), headroom: float = HEADROOM_FRACTION) -> Candidate:
    """One layout's strategies: memory for each (closed form), communication and step time only for
    those whose allocated peak fits (the others cannot fit: the reserved peak is never below it)."""
    cand = Candidate(layout, train, cluster.nodes, headroom=headroom)
    for name in layout_strategies(layout, strategies, train.optimizer, train.framework):
        st = get_strategy(name)
        mem = estimate_memory(train, cluster, st)
        timed = mem.allocated_fits
        cand.results.append(evaluate(train, cluster, st, comm=timed, catalog_dirs=catalog_dirs, mem=mem,
                                     checkpoint=checkpoint if timed else None,
                                     storage_bytes_per_s=storage_bytes_per_s))
    return cand


def search_layouts(train: TrainConfig, cluster: Cluster, strategies=None, *, fixed_tp: int | None = None,
                   fixed_pp: int | None = None, fixed_sp: bool | None = None, checkpoint: str | None = None,
                   storage_bytes_per_s: float | None = None, catalog_dirs=(), batch: int | None = None,
                   budget: Budget | None = None, headroom: float = HEADROOM_FRACTION) -> LayoutSearch:
    """Evaluate every candidate layout's strategies and pick one (see the module docstring)."""
    t0 = time.perf_counter()
    budget = budget or Budget()
    batch = batch or global_batch(train, cluster)
    layouts, refused, tps, pps, sps = candidate_layouts(train, cluster, fixed_tp=fixed_tp, fixed_pp=fixed_pp,
                                                        fixed_sp=fixed_sp, batch=batch)
    cands, skipped = [], 0
    # simplest first, so that a search cut short by the budget has looked at the likeliest picks
    for lay, t in sorted(layouts, key=lambda x: x[0].simplicity):
        cost = eval_cost_s(lay, len(layout_strategies(lay, strategies, train.optimizer, train.framework)))
        if cost > budget.left_s:
            skipped += 1
            continue
        budget.left_s -= cost
        c = evaluate_layout(lay, t, cluster, strategies, checkpoint=checkpoint,
                            storage_bytes_per_s=storage_bytes_per_s, catalog_dirs=catalog_dirs, headroom=headroom)
        if c.results:  # --strategy may name none that runs there (FSDP1 with pp > 1)
            cands.append(c)
    pick = _pick([(c, r) for c in cands for r in c.results], cluster.nodes, headroom)
    return LayoutSearch(cands, pick, batch, seconds=time.perf_counter() - t0, tp_values=tps, pp_values=pps,
                        sp_values=sps, refused=refused, skipped=skipped, headroom=headroom)


def search_with_changes(train: TrainConfig, cluster: Cluster, strategies=None, **kw) -> LayoutSearch:
    """`search_layouts`, and when no layout fits as given, the smallest change with which one does:
    a smaller micro-batch (same global batch), then activation checkpointing selective, then full."""
    t0, c0 = time.perf_counter(), time.process_time()
    batch = kw.pop("batch", None) or global_batch(train, cluster)
    kw.setdefault("budget", Budget())
    first = search_layouts(train, cluster, strategies, batch=batch, **kw)
    if first.pick is not None:
        first.layout_bests()
        first.seconds, first.cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
        return first
    tries = []
    failed = [first]
    mb = train.micro_batch
    smaller = [b for b in range(mb - 1, 0, -1) if mb % b == 0]
    if smaller:
        # memory falls with the micro-batch: bisect the divisors for the largest that fits
        lo, hi, found = 0, len(smaller) - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            # the layouts' micro-steps follow from `batch` (candidate_layouts)
            s = search_layouts(replace(train, micro_batch=smaller[mid]), cluster, strategies, batch=batch, **kw)
            if s.pick is not None:
                found, hi = (smaller[mid], s), mid - 1
            else:
                lo = mid + 1
        if found is not None:
            b, s = found
            s.change = f"--micro-batch {b} (same global batch of {batch} sequences)"
            tries.append(s)
    if not tries:
        for mode in ("selective", "full"):
            if train.checkpointing in (mode, "full"):
                continue
            s = search_layouts(replace(train, checkpointing=mode), cluster, strategies, batch=batch, **kw)
            failed.append(s)
            s.tried = f"--activation-checkpointing {mode}"
            if s.pick is not None:
                extra = "about 1/3 more compute" if mode == "full" else "recomputes norms and activations"
                s.change = f"--activation-checkpointing {mode} ({extra})"
                tries.append(s)
                break
    if tries:
        out = tries[0]
        out.given_failed = first
    else:  # the last try, unless the budget left it less to show than an earlier one
        out = max(reversed(failed), key=lambda x: len(x.candidates))
        out.skipped = max(x.skipped for x in failed)
    out.layout_bests()  # each layout's best (its reserved-peak replays) inside the time reported
    out.seconds, out.cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    return out


# -- words -------------------------------------------------------------------------------------------

_SIMPLICITY_FIELDS = ("model-parallel GPUs (tp x pp x cp)", "pipeline stages (pp)", "context parallelism (cp)",
                      "sequence parallelism")
"""What each entry of `Layout.simplicity` counts, in words."""


def versus_fastest(search: LayoutSearch) -> dict | None:
    """Why the pick and not the fastest layout that fits, as data read off the comparison itself (None when
    the pick is the fastest): `rule` "headroom" (the faster one leaves less than the headroom the pick
    keeps), or "simplicity" with the first entry of `Layout.simplicity` that differs (`what`, the pick's
    value and the other's) or, on the same mesh, the two strategies."""
    if search.pick is None:
        return None
    cand, r = search.pick
    fitting = [(c, b) for c, b in search.layout_bests() if b is not None]
    if not fitting or fitting[0][0] is cand or not _time(fitting[0][1]) < _time(r):
        return None
    other, o = fitting[0]
    out = {"layout": other.layout.to_dict(), "strategy": o.name, "step_time_s": o.step_time_s,
           "headroom_bytes": int(o.memory.headroom), "pick_headroom_bytes": int(r.memory.headroom)}
    if _headroom_ok(r, search.headroom) and not _headroom_ok(o, search.headroom):
        return dict(out, rule="headroom", headroom=search.headroom)
    for what, x, y in zip(_SIMPLICITY_FIELDS, cand.layout.simplicity, other.layout.simplicity):
        if x != y:
            return dict(out, rule="simplicity", what=what, pick=x, other=y)
    return dict(out, rule="simplicity", what="strategy", pick=r.name, other=o.name)


def versus_fastest_words(v: dict, gpu_memory_bytes: int) -> str:
    """`versus_fastest`'s data in words, each figure the comparison's own."""
    lay = Layout(**{k: x for k, x in v["layout"].items() if k != "pp_schedule"},
                 pp_schedule=v["layout"]["pp_schedule"] or "1f1b")
    head = f"{lay.words()}, {v['strategy']}, {fmt_seconds(v['step_time_s'])}"
    if v["rule"] == "headroom":
        free = v["headroom_bytes"]
        return (f"the fastest that fits ({head}) leaves {fmt_gib(free)} GiB free "
                f"({100 * free / gpu_memory_bytes:.1f}%), under the {100 * v['headroom']:.3g}% headroom this pick keeps "
                f"({fmt_gib(v['pick_headroom_bytes'])} GiB)")
    first = f"the simplest layout within {100 * TIE_FRACTION:.0f}% of the fastest that fits ({head}): "
    what, x, y = v["what"], v["pick"], v["other"]
    if what == "strategy":
        return first + f"the same mesh with {x} instead of {y}"
    if isinstance(x, bool):
        return first + ("no sequence parallelism" if not x else "sequence parallelism on (the faster one: off)")
    return first + f"{'fewer' if x < y else 'more'} {what}: {x} vs {y}"


def layout_reasons(search: LayoutSearch, cluster: Cluster, gpu_memory_bytes: int) -> list[str]:
    """Why this layout: its mesh, why TP stays in a node and PP spans nodes, the bubble, the memory
    headroom, the runners-up, and what was searched."""
    cand, r = search.pick
    lay, t = cand.layout, cand.train
    gib = fmt_gib(gpu_memory_bytes)
    out = []
    mem = r.memory
    rate = f", {r.time.tokens_per_s:,.0f} tokens/s, MFU {100 * r.time.mfu:.0f}%" if r.time is not None else ""
    ranks = "dp x cp" if lay.cp > 1 else "dp"
    out.append(f"layout {lay.words()}, {r.name} over the {ranks} ranks: step {fmt_seconds(_time(r))}{rate} for "
               f"the global batch of {search.global_batch} sequences ({search.global_batch * t.seq_len:,} tokens); "
               f"flags: {lay.flags()}")
    bests = search.layout_bests()
    fitting = [(c, b) for c, b in bests if b is not None]
    versus = versus_fastest(search)
    if versus is not None:
        out.append(versus_fastest_words(versus, gpu_memory_bytes))
    intra, inter = cluster_links(cluster)
    ratio = intra.busbw_bytes_per_s / inter.busbw_bytes_per_s if inter.busbw_bytes_per_s else float("inf")
    link_words = (f"{cluster.intra_link} gives each GPU {intra.busbw_bytes_per_s / 1e9:,.0f} GB/s inside the "
                  f"node, {cluster.inter_link} x {cluster.nics_per_node} per node {inter.busbw_bytes_per_s / 1e9:,.1f} "
                  f"GB/s per GPU between nodes ({ratio:,.1f}x less)")
    tp_coll = [c for c in r.collectives if c.group == "tp"]
    if lay.tp > 1:
        tp_s = sum(c.time_s for c in tp_coll)
        out.append(f"tp {lay.tp} stays inside a node ({cluster.local_size} GPUs): its all-gathers and reduce-scatters "
                   f"run {sum(c.calls for c in tp_coll):,} times a step between the blocks' matmuls, on the critical "
                   f"path ({fmt_seconds(tp_s)} of the step), and {link_words}")
    else:
        better_tp = [(c, b) for c, b in fitting if c.layout.tp > 1]
        tail = (f"; the fastest with tp > 1 ({better_tp[0][0].layout.words()}) takes "
                f"{fmt_seconds(_time(better_tp[0][1]))}" if better_tp else "")
        out.append(f"no tensor parallelism: the model fits without it, and TP's per-layer collectives would sit on "
                   f"the critical path{tail}")
    if lay.pp > 1:
        stage_gpus = cluster.gpus // lay.pp
        spans = stage_gpus >= cluster.local_size and cluster.nodes > 1
        pp_coll = [c for c in r.collectives if c.group == "pp" and c.op == "send"]
        msg = max((c.message_bytes for c in pp_coll), default=0)
        b = bubble_fraction(lay.pp_schedule, lay.pp, lay.pp_microbatches)
        vm = virtual_stages(lay.pp_schedule) * lay.pp_microbatches
        where = (f"spans nodes (each stage's dp x tp = {stage_gpus} GPUs is {stage_gpus // cluster.local_size} "
                 f"node{'s' if stage_gpus // cluster.local_size > 1 else ''}): stages exchange only one micro-batch's "
                 f"boundary activations point to point ({msg / 2**20:,.0f} MiB per message), the traffic that "
                 f"tolerates the slower link" if spans else
                 f"stays inside a node (stages {stage_gpus} GPUs apart)")
        out.append(f"pp {lay.pp} {where}; {lay.pp_schedule} with {lay.pp_microbatches} micro-batches leaves a bubble "
                   f"of (p - 1) / (v M) = {lay.pp - 1}/{vm} "
                   f"= {100 * b:.1f}% of compute idle")
    elif cluster.nodes > 1:
        out.append("no pipeline parallelism: every GPU holds all the layers; no bubble")
    out.append(f"memory: peak {fmt_gib(mem.peak_allocated)} GiB allocated, {fmt_gib(mem.peak_reserved)} GiB reserved, "
               f"{fmt_gib(mem.device_total)} of {gib} GiB on the device with the CUDA context and NCCL: "
               f"{fmt_gib(mem.headroom)} GiB free ({100 * mem.headroom / gpu_memory_bytes:.0f}%)")
    others = [(c, b) for c, b in fitting if c is not cand][:3]
    if others:
        out.append("runners-up: " + "; ".join(
            f"{c.layout.words()}: {b.name}, {fmt_seconds(_time(b))} ({_pct(_time(b), _time(r))})" for c, b in others))
    faster_no = []
    for c in search.candidates:
        if c is cand or c.best() is not None:
            continue
        timed = [x for x in c.results if x.time is not None]
        quick = min(timed, key=_time, default=None)
        if quick is not None and _time(quick) < _time(r):
            faster_no.append((c, quick))
    faster_no.sort(key=lambda x: _time(x[1]))
    if faster_no:
        out.append("faster but does not fit: " + "; ".join(
            f"{c.layout.words()}: {q.name} would take {fmt_seconds(_time(q))} and needs "
            f"{fmt_gib(q.memory.device_total)} GiB" for c, q in faster_no[:3]))
    n_fit = len(fitting)
    sp = "on/off" if len(search.sp_values) > 1 else ("on" if True in search.sp_values else "off")
    if search.refused:
        out.append(f"left out: {search.refused[0]}"
                   + (f" (and {len(search.refused) - 1} more)" if len(search.refused) > 1 else ""))
    if search.skipped:
        out.append(f"the search's budget ({SEARCH_BUDGET_S:g} s of estimated work) left {search.skipped} of the "
                   f"most model-parallel layouts unevaluated; --tp or --pp narrow the search")
    cps = sorted({c.layout.cp for c in search.candidates})
    cp = ("" if cps == [1] else f", cp {cps[0]} as given" if len(cps) == 1 else f", cp in {_set(tuple(cps))}")
    out.append(f"searched {len(search.candidates)} layouts (tp in {_set(search.tp_values)}, pp in "
               f"{_set(search.pp_values)}, sequence parallel {sp}{cp}) "
               f"x their strategies = {search.evaluated} configurations in {search.seconds:.2f} s "
               f"({search.cpu_seconds:.2f} s of CPU); "
               f"{n_fit} layout{'s' if n_fit != 1 else ''} fit")
    return out


def _pct(x: float, ref: float) -> str:
    d = (x - ref) / ref if ref else 0.0
    return f"{100 * d:.1f}% slower" if d >= 0 else f"{-100 * d:.1f}% faster"


def _set(values) -> str:
    return "{" + ", ".join(str(v) for v in values) + "}"


def nothing_fits_words(search: LayoutSearch, gpu_memory_bytes: int, advice: bool = True) -> str:
    """One line for a search in which no layout fits: the closest candidate and what it needs."""
    rows = [(c, c.closest()) for c in search.candidates if c.results]
    if not rows:
        return "no layout could be formed: " + ("; ".join(search.refused[:2]) or "no candidates")
    c, r = min(rows, key=lambda x: x[1].memory.peak_allocated + x[1].memory.process_overhead)
    need = r.memory.peak_allocated + r.memory.process_overhead
    under = f" even with {search.tried}" if search.tried else ""
    return (f"no layout fits in {fmt_gib(gpu_memory_bytes)} GiB per GPU{under}; the closest, "
            f"{c.layout.words()} with {r.name}, needs at least {fmt_gib(need)} GiB"
            + (": more GPUs or GPUs with more memory" if advice else ""))
