"""The trace front end in the layout search (`distplan recommend --hf-config` with torch and transformers).

The search (layout.py) compares dp x tp x pp (x cp) meshes. The trace front end (module_plan.py) runs the
transformers model itself but models no tensor, pipeline or context parallelism: of the search's layouts it
can plan the data-parallel one (tp = pp = cp = 1) only. Judging that one layout by the trace and the others
by the formulas would compare two instruments (their memory differs by about 1% on the decoders both read,
tests/test_analytic_vs_trace.py), and the answer would depend on what is installed. So every layout is
judged by the analytic front end, with torch or without, and the pick is the same either way; with the trace
available the data-parallel layout is also planned by the trace, as a check (`TraceCheck`): the two front
ends' verdicts per strategy there, and the pick the search's own rule makes with the trace's rows in place of
the analytic ones. Where that differs, the output says so (`TraceCheck.lines`), and the flags that plan the
layout by the trace alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from .layout import Candidate, LayoutSearch, _pick
from .ranking import _headroom_ok
from .units import fmt_gib, fmt_percent

VERDICTS = {"headroom": "fits with the headroom", "fits": "fits under the headroom",
            "retry": "fits only by the allocator's retries", "no": "does not fit"}
"""A strategy's verdict on a layout, most to least room (ranking._headroom_ok, MemoryEstimate.fits...)."""


def verdict(r, headroom: float) -> str:
    """One of `VERDICTS`' keys for the StrategyResult `r` at `headroom`."""
    if _headroom_ok(r, headroom):
        return "headroom"
    if r.memory.fits_cleanly:
        return "fits"
    return "retry" if r.memory.fits else "no"


def dp_only(search: LayoutSearch) -> Candidate | None:
    """The search's data-parallel layout (tp = pp = cp = 1), the one the trace models; None if not searched."""
    return next((c for c in search.candidates
                 if c.layout.tp == 1 and c.layout.pp == 1 and c.layout.cp == 1 and c.results), None)


def search_note(hf_config, check: "TraceCheck | None", why_not: str | None = None) -> str:
    """The plan's `front end:` note for a searched layout: which front end judged which layouts."""
    rule = ("front end: analytic for every layout searched (decoder formulas, as transformers implements this "
            "model), with or without torch: the trace front end models no tp, pp or cp, and one model judges "
            "all layouts alike, so the pick does not depend on what is installed")
    if not hf_config:
        return "front end: analytic (decoder formulas)"
    if check is not None:
        return (rule + f"; trace (the transformers model run on fake tensors) for {check.analytic.layout.words()}, "
                f"the one layout it models, as a check (`trace check:` lines)")
    return rule + (f"; {why_not}" if why_not else "; with torch and transformers, --front-end trace or auto also "
                   "plans the data-parallel layout by the trace, as a check")


@dataclass
class TraceCheck:
    """The data-parallel layout of a search planned by the trace front end too."""

    search: LayoutSearch
    analytic: Candidate
    """The layout as the search evaluated it (the analytic front end)."""
    traced: Candidate
    """The same layout and strategies, the trace front end's results."""
    pick: tuple | None
    """(Candidate, StrategyResult): the search's rule (layout._pick) with `traced`'s rows in place of
    `analytic`'s; None when nothing fits so."""
    profile_s: float = 0.0
    """Seconds the trace took (the model run on fake tensors)."""

    @classmethod
    def of(cls, search: LayoutSearch, results: list, profile_s: float = 0.0) -> "TraceCheck | None":
        """The check of `search` by the trace's `results` (StrategyResults of its data-parallel layout, the
        same run); None when the search has no data-parallel layout."""
        cand = dp_only(search)
        if cand is None:
            return None
        names = [r.name for r in cand.results]
        mine = sorted((r for r in results if r.name in names), key=lambda r: names.index(r.name))
        traced = Candidate(cand.layout, cand.train, cand.nodes, mine, headroom=search.headroom)
        rows = [(c, r) for c in search.candidates if c is not cand for r in c.results]
        rows += [(traced, r) for r in mine]
        nodes = cand.nodes
        return cls(search, cand, traced, _pick(rows, nodes, search.headroom), profile_s)

    def rows(self) -> list[tuple]:
        """(strategy, analytic result, trace result, analytic verdict, trace verdict) per strategy both planned."""
        h = self.search.headroom
        trace = {r.name: r for r in self.traced.results}
        return [(a.name, a, trace[a.name], verdict(a, h), verdict(trace[a.name], h))
                for a in self.analytic.results if a.name in trace]

    @property
    def same_pick(self) -> bool:
        a, t = self.search.pick, self.pick
        if a is None or t is None:
            return a is None and t is None
        return a[0].layout == t[0].layout and a[1].name == t[1].name

    def lines(self) -> list[str]:
        """The check in words: the figures of both front ends, where their verdicts differ, and whether the
        trace's numbers would change the pick."""
        lay = self.analytic.layout.words()
        gpu = self.search.candidates[0].results[0].memory.gpu_memory_bytes
        rows = self.rows()
        figures = ", ".join(f"{n} {_gib(t)} ({_gib(a)})" for n, a, t, va, vt in rows if not va == vt == "no")
        both = [abs(t.memory.device_total / a.memory.device_total - 1) for _, a, t, _, _ in rows
                if a.memory.allocated_fits and t.memory.allocated_fits]
        apart = f"; at most {fmt_percent(max(both))} apart" if both else ""
        out = [f"trace check: {lay} re-planned by the trace front end ({self.profile_s:.2f} s on fake tensors); "
               f"device GiB by the trace (analytic): {figures or 'no strategy fits by either'}{apart}"]
        differ = [(n, a, t, va, vt) for n, a, t, va, vt in rows if va != vt]
        for n, a, t, va, vt in differ:
            out.append(f"trace check: {n} on {lay} {VERDICTS[vt]} by the trace ({_free(t, gpu)}) but "
                       f"{VERDICTS[va]} by the analytic front end ({_free(a, gpu)})")
        if not differ and rows:
            h = self.search.headroom
            a, t = self.analytic.best(), self.traced.best()
            best = ("nothing fits there without the allocator's retries" if a is None and t is None else
                    f"its best by the trace, {_best(t, h, gpu)}; by the analytic front end, {_best(a, h, gpu)}")
            out.append(f"trace check: both front ends give every strategy on {lay} the same verdict (the "
                       f"{fmt_percent(h)} headroom, {fmt_gib(h * gpu)} GiB, kept, fits, or not): {best}")
        mine = self.search.pick
        if self.same_pick:
            what = (f"{mine[1].name} on {mine[0].layout.words()}" if mine is not None else "nothing fits")
            out.append(f"trace check: with the trace's rows for {lay} the search's rule picks the same: {what}")
        else:
            other = (f"{self.pick[1].name} on {self.pick[0].layout.words()} ({_free(self.pick[1], gpu)})"
                     if self.pick is not None else "nothing")
            out.append(f"trace check: with the trace's rows for {lay} the search's rule would pick {other}; this "
                       f"recommendation keeps the analytic front end's numbers for every layout, so that it does not "
                       f"depend on what is installed; --tp 1 --pp 1 plans {lay} by the trace alone")
        return out

    def to_dict(self) -> dict:
        p = self.pick
        return {"layout": self.analytic.layout.to_dict(), "profile_s": self.profile_s,
                "strategies": [{"strategy": n, "device_total_analytic": _total(a), "device_total_trace": _total(t),
                                "verdict_analytic": va, "verdict_trace": vt} for n, a, t, va, vt in self.rows()],
                "pick_by_trace": ({"layout": p[0].layout.to_dict(), "strategy": p[1].name} if p is not None else None),
                "same_pick": self.same_pick}


def _total(r) -> int | None:
    """The device total where the allocated peak fits (the reserved peak replayed), else None."""
    return int(r.memory.device_total) if r.memory.allocated_fits else None


def _gib(r) -> str:
    m = r.memory
    return fmt_gib(m.device_total) if m.allocated_fits else ">= " + fmt_gib(m.peak_allocated + m.process_overhead)


def _best(r, headroom: float, gpu: int) -> str:
    """'zero3, fits under the headroom (78.00 GiB, 1.65 free, 2.07%)'; 'none' for None."""
    return "none" if r is None else f"{r.name}, {VERDICTS[verdict(r, headroom)]} ({_free(r, gpu)})"


def _free(r, gpu: int) -> str:
    m = r.memory
    if not m.allocated_fits:
        return f"needs at least {fmt_gib(m.peak_allocated + m.process_overhead)} GiB"
    return f"{fmt_gib(m.device_total)} GiB, {fmt_gib(m.headroom)} free, {fmt_percent(m.headroom / gpu)}"
