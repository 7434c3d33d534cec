"""Text output of a plan: the strategy table (tabulate's formats), notes, the recommendation line.

Output fits the terminal: `terminal_width()` is $COLUMNS, else the terminal's width when stdout is one,
else unlimited (a file or a pipe gets the whole table on one line per row). A table wider than that
is split into column groups, each repeating the strategy column; prose lines wrap with a hanging
indent. `--format tsv` is never split (it is for machines).

The SVG chart and the notebook HTML live in `chart.py`; this module re-exports them so callers have
one place to ask for any rendering.

Tables are tabulate's; the default format of plain-text cells is drawn here (`table`), so that a cold
`distplan estimate` does not import tabulate (20-30 ms on the 2-core VM, most of it the
`importlib.metadata` it imports for its version).
"""

from __future__ import annotations

import os
import sys

from .chart import plan_html as _html, plan_svg as _svg, plot_matplotlib as _plot
from .accuracy import memory_line, time_line
from .front_end import target_line
from .pp import bubble_fraction
from .units import fmt_bytes, fmt_count, fmt_gib, fmt_seconds

MEM_COLUMNS = (("params", "params"), ("grads", "grads"), ("optimizer", "optim"),
               ("activations", "acts"), ("comm_buffers", "buffers"), ("temporaries", "temps"))


def terminal_width() -> int | None:
    """Columns to fit: $COLUMNS, else the terminal's width when stdout is a terminal, else None."""
    env = os.environ.get("COLUMNS", "").strip()
    if env.isdigit() and int(env) > 0:
        return max(40, int(env))
    try:
        if sys.stdout.isatty():
            return max(40, os.get_terminal_size(sys.stdout.fileno()).columns)
    except (OSError, ValueError, AttributeError):
        pass
    return None


def wrap(line: str, width: int | None = None, indent: str = "    ") -> str:
    """One prose line wrapped to `width` (default: the terminal's) with a hanging indent."""
    width = terminal_width() if width is None else width
    if not width or len(line) <= width:
        return line
    import textwrap  # lazy: only a terminal narrower than a line needs it

    lead = line[:len(line) - len(line.lstrip())]
    return textwrap.fill(line, width=width, subsequent_indent=lead + indent, break_long_words=False,
                         break_on_hyphens=False)


def _plain_cell(c) -> bool:
    """A cell `_simple_table` draws as tabulate does: text (or an int) of printable ASCII, one line."""
    t = type(c)
    return t is int or t is str and c.isascii() and c.isprintable()


def _simple_table(rows: list, headers: list) -> str:
    """tabulate(rows, headers, tablefmt="simple", disable_numparse=True) for rows of `_plain_cell`s, as
    tabulate draws it (its `_align_column`, `_align_header`, `_build_simple_row`): every column
    left-aligned (numbers are not parsed), as wide as its widest cell and at least its header + 2
    (MIN_PADDING); cells stripped of surrounding spaces, headers not; columns joined by two spaces,
    each row's end stripped; the header, a line of dashes, then the rows."""
    cells = [[str(c).strip() for c in r] for r in rows]
    widths = [max(len(h) + 2, *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


def table(rows: list, headers: list, table_format: str = "simple") -> str:
    """`tabulate(rows, headers, tablefmt=table_format, disable_numparse=True)`: the "simple" format of
    plain cells (every table the planner prints) drawn by `_simple_table` without importing tabulate,
    any other format or cell by tabulate itself (tests/test_table_render.py holds the two to the byte)."""
    if (table_format == "simple" and rows and headers and all(type(h) is str and _plain_cell(h) for h in headers)
            and all(len(r) == len(headers) and all(map(_plain_cell, r)) for r in rows)):
        return _simple_table(rows, headers)
    from tabulate import tabulate
    return tabulate(rows, headers, tablefmt=table_format, disable_numparse=True)


def fit_table(title: str, headers: list, rows: list, table_format: str = "simple",
              width: int | None = None) -> str:
    """`title` and a tabulate table; split into column groups (each keeping the first column) when
    wider than `width` (default: the terminal's)."""
    width = terminal_width() if width is None else width
    full = table(rows, headers, table_format)
    if not width or table_format == "tsv" or max(map(len, full.splitlines()), default=0) <= width:
        return f"{wrap(title, width)}\n{full}"

    def render(cols):
        return table([[r[0]] + [r[c] for c in cols] for r in rows], [headers[0]] + [headers[c] for c in cols],
                     table_format)

    groups, cur = [], []
    for c in range(1, len(headers)):
        if cur and max(map(len, render(cur + [c]).splitlines())) > width:
            groups.append(cur)
            cur = []
        cur.append(c)
    groups.append(cur)
    parts = [render(g) for g in groups]
    return wrap(f"{title} ({len(parts)} parts to fit {width} columns)", width) + "\n" + "\n\n".join(parts)


def header(plan) -> str:
    if hasattr(plan, "header_lines"):  # a --module plan describes its own model
        return "\n".join(wrap(x) for x in plan.header_lines())
    t, c, m = plan.train, plan.cluster, plan.train.model
    lines = [
        f"model: {m.name}: {m.param_count():,} params ({fmt_count(m.param_count())}), {m.layers} layers, "
        f"hidden {m.hidden}, {m.heads} heads ({m.kv_heads} KV), FFN {m.ffn_hidden} {m.mlp}, vocab {m.vocab}",
        f"training: seq {t.seq_len} x micro-batch {t.micro_batch} x accum {t.grad_accum}"
        + (f" (gradients reduced {'every micro-step' if t.sync_every else 'on the last micro-step'})"
           if t.grad_accum > 1 else "") + f", {t.precision}, "
        f"{t.optimizer} ({t.optimizer_impl}), checkpointing {t.checkpointing}, attention {t.attention}"
        + (f" ({t.attention_kernel})" if getattr(t, "attention_kernel", "flash") != "flash" else "")
        + (f", offload {t.cpu_offload}" if t.cpu_offload != "none" else "")
        + (f", framework {t.framework}" if t.framework != "pytorch" else ""),
        *([_mesh_line(t, c)] if max(getattr(t, "tp", 1), getattr(t, "pp", 1), getattr(t, "cp", 1)) > 1 else []),
        f"cluster: {c.gpus} x {c.gpu_name} ({fmt_gib(c.gpu_memory_bytes)} GiB) in {c.nodes} node(s) of "
        f"{c.gpus_per_node}; intra {c.intra_link}, inter {c.inter_link} x {c.nics_per_node} per node"
        + (f" ({c.inter_bytes_per_s * 8 / 1e9:g} Gbit/s per node)" if c.inter_bytes_per_s else ""),
        target_line(getattr(plan, "device", "cuda")),
    ]
    for n in plan.notes:
        lines.append(f"note: {n}")
    return "\n".join(wrap(x) for x in lines)


def _rate_unit(plan) -> str:
    """'tokens/s' for language models; 'samples/s' for a --module whose input is not token sequences."""
    return "samples/s" if getattr(plan.train, "tokens_per_sample", None) == 1 else "tokens/s"


def memory_table(plan, table_format: str = "simple", results=None, title: str | None = None) -> str:
    rows = []
    for r in plan.results if results is None else results:
        mem = r.memory
        row = [r.name] + [fmt_gib(mem.components[k]) for k, _ in MEM_COLUMNS]
        row += [fmt_gib(getattr(mem, "workspace", 0)), fmt_gib(mem.peak_allocated), mem.peak_phase,
                fmt_gib(mem.peak_reserved), fmt_gib(mem.device_total),
                ("retry" if mem.alloc_retries else "yes") if mem.fits else "NO", fmt_gib(mem.headroom)]
        rows.append(row)
    # reserved: the caching allocator's segments (max_memory_reserved); device: + CUDA context and NCCL
    headers = ["strategy"] + [h for _, h in MEM_COLUMNS] + ["cublas", "peak", "phase", "reserved", "device",
                                                            "fits", "headroom"]
    return fit_table(title or "memory per GPU (GiB, most loaded rank)", headers, rows, table_format)


def comm_table(plan, table_format: str = "simple", results=None, title: str | None = None) -> str:
    rows = []
    tokens = getattr(plan, "tokens", None)
    for r in plan.results if results is None else results:
        if r.time is None:
            continue
        t = r.time
        req = r.required_inter_bytes_per_s
        row = [r.name, fmt_bytes(r.comm_bytes_per_gpu), fmt_seconds(r.comm_time_s),
               fmt_seconds(t.exposed_comm_s), fmt_seconds(t.compute_s), fmt_seconds(t.optimizer_s),
               fmt_seconds(t.overhead_s), fmt_seconds(t.step_time_s),
               f"{t.tokens_per_s:,.0f}", f"{100 * t.mfu:.0f}%"]
        if tokens:
            row.append(fmt_seconds(tokens / t.tokens_per_s) if t.tokens_per_s else "-")
        row.append("-" if req is None else ("unreachable" if req == float("inf") else f"{req * 8 / 1e9:,.0f} Gb/s"))
        rows.append(row)
    if not rows:
        return ""
    # step = compute + exposed + optimizer + other (the copies and launches around the collectives)
    headers = ["strategy", "sent/GPU/step", "comm", "exposed", "compute", "optimizer", "other", "step",
               _rate_unit(plan), "MFU"]
    if tokens:
        headers.append(f"time for {fmt_count(tokens)} tokens")
    headers.append("inter-node BW to hide comm")
    return fit_table(title or "communication and time per optimizer step", headers, rows, table_format)


def checkpoint_table(plan, table_format: str = "simple") -> str:
    """The checkpoint save per strategy (`plan(checkpoint=...)`): device peak, host bytes, save time."""
    mode = getattr(plan, "checkpoint", None)
    if not mode:
        return ""
    rows = []
    for r in plan.results:
        c = r.checkpoint
        if c is None:
            rows.append([r.name, "-", "-", "-", "-", "-", "not modelled"])
            continue
        rows.append([r.name, fmt_gib(c.resident_bytes), fmt_gib(c.device_extra_bytes), fmt_gib(c.device_peak_bytes),
                     fmt_gib(c.host_bytes), fmt_seconds(c.save_time_s), "yes" if c.fits else "NO"])
    bw = plan.storage_bytes_per_s / 1e9 if plan.storage_bytes_per_s else 0
    headers = ["strategy", "resident", "+save", "GPU peak", "host (rank 0)", f"time @ {bw:g} GB/s", "fits"]
    return fit_table(f"checkpoint save, {mode} (GiB, most loaded rank)", headers, rows, table_format)


def recommended_rows(plan, table_format: str = "simple") -> list[str]:
    """When the recommendation changes the configuration: the recommended strategy's rows under the
    change (the tables above show the configuration as given)."""
    rec = plan.recommendation
    changed = getattr(rec, "changed_plan", None)
    if changed is None or rec.strategy is None:
        return []
    row = [r for r in changed.results if r.name == rec.strategy]
    out = ["", memory_table(changed, table_format, row, f"with {rec.change}: memory per GPU (GiB)")]
    ct = comm_table(changed, table_format, row, f"with {rec.change}: communication and time per step")
    if ct:
        out += ["", ct]
    return out


LAYOUT_ROWS = 12
"""Layouts shown in the search table (the fitting ones by step time first, then the closest misses)."""


def _layout_row(c, best, pick, ref) -> list:
    """One row of `layout_table`: the layout's best strategy (else the one needing the least memory)."""
    r = best or c.closest()
    m = r.memory
    known = best is not None or m.reserved_replay is None or m._reserved is not None
    dev = fmt_gib(m.device_total) if known else ">= " + fmt_gib(m.peak_allocated + m.process_overhead)
    st = r.step_time_s if best is not None or m.allocated_fits else None  # (the trace times every row)
    vs = "-" if st is None or not ref else ("pick" if pick is not None and c is pick[0] else
                                            f"{100 * (st - ref) / ref:+.1f}%")
    lay = c.layout
    return [f"{lay.dp} x {lay.tp} x {lay.pp}", "on" if lay.sequence_parallel else "off",
            str(lay.micro_steps), r.name, fmt_gib(m.peak_allocated), dev,
            "yes" if best is not None else ("retry" if r.fits else "NO"),
            fmt_seconds(st) if st is not None else "-", vs]


def layout_table(plan, table_format: str = "simple", rows: int = LAYOUT_ROWS) -> str:
    """The layout search (`plan.search`, layout.py): per layout its best strategy, memory, fit and step
    time against the pick. A device figure with '>=' is the allocated peak plus the process overhead
    (the reserved peak not replayed for a layout that cannot fit). With the trace's check of the
    data-parallel layout (`search.trace`, trace_check.py) a `front end` column, and the trace's row of that
    layout after the analytic one (or last, when that is not shown)."""
    s = plan.search
    pick = s.pick
    ref = pick[1].step_time_s if pick is not None else None
    trace = s.trace
    out = []
    for c, best in s.layout_bests()[:rows]:
        out.append(_layout_row(c, best, pick, ref) + (["analytic"] if trace is not None else []))
        if trace is not None and c is trace.analytic:
            out.append(_layout_row(trace.traced, trace.traced.best(), None, ref) + ["trace"])
    if trace is not None and not any(row[-1] == "trace" for row in out):  # the pair compared, last
        out.append(_layout_row(trace.analytic, trace.analytic.best(), pick, ref) + ["analytic"])
        out.append(_layout_row(trace.traced, trace.traced.best(), None, ref) + ["trace"])
    more = len(s.candidates) - sum(row[-1] != "trace" for row in out)
    title = (f"layout search: {len(s.candidates)} layouts, {s.evaluated} configurations, {s.seconds:.2f} s "
             f"({s.cpu_seconds:.2f} s CPU)"
             + (f" (under {s.change.split(' (')[0]})" if s.change else "")
             + (f"; {more} more not shown" if more > 0 else "")
             + (f"; {s.skipped} not evaluated (the search's budget)" if s.skipped else ""))
    headers = ["dp x tp x pp", "SP", "micro-steps", "strategy", "peak", "device", "fits", "step", "vs pick"]
    return fit_table(title, headers + (["front end"] if trace is not None else []), out, table_format)


def render_estimate(plan, table_format: str = "simple") -> str:
    parts = [header(plan), "", memory_table(plan, table_format), wrap(memory_line(plan.error_front_end))]
    ct = comm_table(plan, table_format)
    if ct:
        parts += ["", ct, wrap(time_line(plan.error_front_end))]
    ck = checkpoint_table(plan, table_format)
    if ck:
        parts += ["", ck]
    notes = sorted({n for r in plan.results for n in r.memory.notes}
                   | {n for r in plan.results if r.checkpoint is not None for n in r.checkpoint.notes})
    for n in notes:
        parts.append(wrap(f"note: {n}"))
    rec = plan.recommendation
    parts += recommended_rows(plan, table_format)
    parts += ["", wrap(f"recommendation: {rec.summary}")]
    if rec.warning:
        parts.append(wrap(f"warning: {rec.warning}"))
    return "\n".join(parts)


def plan_svg(plan) -> str:
    return _svg(plan)


def plan_html(plan) -> str:
    return _html(plan)


def plot_matplotlib(plan, path=None):
    return _plot(plan, path)


def _mesh_line(t, c) -> str:
    """The device mesh in words: pp (outermost) x dp x cp x tp, and what the strategies run over."""
    parts = []
    if t.pp > 1:
        b = bubble_fraction(t.pp_schedule, t.pp, t.pp_microbatches)
        parts.append(f"pp {t.pp} ({t.pp_schedule}, {t.pp_microbatches} micro-batches of {t.micro_batch}, "
                     f"bubble {b:.0%} of compute)")
    cp = getattr(t, "cp", 1)
    parts.append(f"dp {c.gpus // (t.tp * t.pp * cp)}")
    if cp > 1:
        parts.append(f"cp {cp} ({t.seq_len // cp} tokens of each sequence)")
    if t.tp > 1:
        parts.append(f"tp {t.tp} (inside a node{', sequence parallel' if t.sequence_parallel else ''})")
    share = " x ".join(x for x, on in ((f"1/{t.pp} of the layers", t.pp > 1), (f"1/{t.tp} of each", t.tp > 1)) if on)
    ranks = "dp x cp ranks" if cp > 1 else "dp ranks"
    return f"mesh: {' x '.join(parts)}; the strategies below run over the {ranks}" + (f", on {share}" if share else "")

