"""The memory chart of a plan: inline SVG (no dependency), notebook HTML, and a matplotlib figure.

One horizontal stacked bar per strategy (the most loaded rank's bytes at its peak: params, grads,
optimizer, activations, comm_buffers, temporaries, then the allocator's fragmentation plus the process
overhead, hatched), a vertical line at the GPU's memory, the total in GiB at the end of each bar, a
fits mark, and a second panel with the bytes each GPU sends per optimizer step. Works for any
Plan-like object with `.results` (StrategyResult), `.cluster` and `.recommendation`; a plan with
`header_lines()` (the `--module` plan) gives its own title.

Pure Python: `plot_matplotlib` imports matplotlib inside the function, so importing the planner never needs it.
Known limitations: when every bar is under a third of the GPU memory the scale follows the bars and the
memory line sits at the right edge, labelled with its value ("off scale").
"""

from __future__ import annotations

from html import escape as _html_escape

from .units import GiB, fmt_bytes, fmt_gib, fmt_seconds



def _xml_escape(text: str) -> str:
    """`&`, `<` and `>` as entities: xml.sax.saxutils.escape, whose import pulls in urllib and http (a
    quarter of a cold `distplan estimate`'s imports)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def quoteattr(text: str) -> str:
    """An XML attribute value with its quotes, as xml.sax.saxutils.quoteattr writes it."""
    text = _xml_escape(text).replace("\n", "&#10;").replace("\r", "&#13;").replace("\t", "&#9;")
    if '"' not in text:
        return f'"{text}"'
    if "'" not in text:
        return f"'{text}'"
    return '"' + text.replace('"', "&quot;") + '"'


SEGMENTS = (  # (component, label, colour): colour-blind-safe palette (Okabe-Ito)
    ("params", "params", "#0072B2"),
    ("grads", "grads", "#E69F00"),
    ("optimizer", "optimizer", "#009E73"),
    ("activations", "activations", "#CC79A7"),
    ("comm_buffers", "comm buffers", "#56B4E9"),
    ("temporaries", "temporaries", "#D55E00"),
)
OVERHEAD = ("overhead", "cuBLAS workspaces + allocator + CUDA/NCCL overhead", "#9e9e9e")
COMM_COLOUR = "#7f7f7f"

# Layout, px.
_NAME_W = 130
_BAR_W = 520
_GAP = 40
_COMM_W = 200
_ROW_H = 26
_BAR_H = 16
_TOP = 56
_PAD = 12


def _esc(text) -> str:
    return _xml_escape(str(text))


def _title(plan) -> tuple[str, str]:
    """(model line, cluster line) for headings."""
    if hasattr(plan, "header_lines"):
        lines = plan.header_lines()
        model = lines[0].removeprefix("model: ").split("; ")[0]
    else:
        m = plan.train.model
        model = f"{m.name}: {m.param_count():,} params"
    c = plan.cluster
    cluster = (f"{c.gpus} x {c.gpu_name} ({fmt_gib(c.gpu_memory_bytes)} GiB), {c.nodes} node(s) of "
               f"{c.gpus_per_node}; {c.intra_link} / {c.inter_link}")
    return model, cluster


def _overhead_bytes(mem) -> int:
    """The grey segment: cuBLAS workspaces, what the caching allocator reserves beyond the allocated peak,
    and the process overhead (CUDA context, NCCL)."""
    return int(mem.workspace + mem.device_total - mem.peak_allocated)


def _totals(r) -> tuple[list[tuple[str, str, str, int]], int]:
    mem = r.memory
    parts = [(k, label, colour, int(mem.components.get(k, 0))) for k, label, colour in SEGMENTS]
    parts.append((OVERHEAD[0], OVERHEAD[1], OVERHEAD[2], _overhead_bytes(mem)))
    return parts, sum(p[3] for p in parts)


def _comm_bytes(r) -> int | None:
    try:
        return int(r.comm_bytes_per_gpu) if getattr(r, "collectives", None) is not None else None
    except (AttributeError, TypeError):
        return None


def _fmt_gib_short(nbytes: float) -> str:
    g = nbytes / GiB
    return f"{g:.3f}" if g < 0.1 else (f"{g:.2f}" if g < 10 else f"{g:.1f}")


def plan_svg(plan) -> str:
    """The chart as a standalone SVG document (valid XML; one `<g class="bar">` per strategy)."""
    results = list(plan.results)
    gpu_bytes = int(plan.cluster.gpu_memory_bytes)
    rows = [(r, *_totals(r)) for r in results]
    max_total = max((t for _, _, t in rows), default=0)
    off_scale = max_total > 0 and gpu_bytes > 3 * max_total
    scale_max = max_total * 1.15 if off_scale else max(gpu_bytes, max_total) * 1.05
    scale_max = scale_max or 1
    comm = [_comm_bytes(r) for r in results]
    show_comm = any(c for c in comm if c)
    comm_max = max((c for c in comm if c), default=1)

    width = _PAD + _NAME_W + _BAR_W + 70 + ((_GAP + _COMM_W + 60) if show_comm else 0) + _PAD
    n = len(results)
    legend_y = _TOP + n * _ROW_H + 30
    height = legend_y + 2 * 18 + _PAD
    x0 = _PAD + _NAME_W

    def x_of(nbytes: float) -> float:
        return x0 + _BAR_W * nbytes / scale_max

    model, cluster = _title(plan)
    max_chars = int((width - 2 * _PAD) / 8)
    if len(model) > max_chars:
        model = model[:max_chars - 1] + "\u2026"
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" font-size="12" '
        f'role="img" aria-label="per-GPU memory by strategy">',
        "<title>" + _esc(f"per-GPU memory by strategy: {model}") + "</title>",
        '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="6" height="6" fill="#d9d9d9"/>'
        '<line x1="0" y1="0" x2="0" y2="6" stroke="#8c8c8c" stroke-width="2"/></pattern></defs>',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{_PAD}" y="20" font-size="14" font-weight="bold">{_esc(model)}</text>',
        f'<text x="{_PAD}" y="38" fill="#444">{_esc(cluster)}; memory per GPU (GiB, most loaded rank)</text>',
    ]
    if show_comm:
        cx = x0 + _BAR_W + 70 + _GAP
        out.append(f'<text x="{cx}" y="{_TOP - 6}" fill="#444">sent per GPU per step</text>')

    for i, (r, parts, total) in enumerate(rows):
        y = _TOP + i * _ROW_H
        yb = y + (_ROW_H - _BAR_H) / 2
        fits = bool(r.memory.fits)
        mark, mark_colour = ("\u2713", "#1a7f37") if fits else ("\u2717", "#cf222e")
        out.append(f'<g class="bar" data-strategy={quoteattr(str(r.name))} data-fits="{str(fits).lower()}">')
        out.append(f'<title>{_esc(_tooltip(r, parts, total))}</title>')
        out.append(f'<text x="{_PAD}" y="{yb + _BAR_H - 3}" fill="{mark_colour}" font-weight="bold">{mark}</text>')
        out.append(f'<text x="{_PAD + 16}" y="{yb + _BAR_H - 3}">{_esc(r.name)}</text>')
        x = x0
        for key, label, colour, nbytes in parts:
            if nbytes <= 0:
                continue
            w = _BAR_W * nbytes / scale_max
            fill = "url(#hatch)" if key == OVERHEAD[0] else colour
            out.append(f'<rect class="seg seg-{key}" x="{x:.2f}" y="{yb:.2f}" width="{w:.2f}" '
                       f'height="{_BAR_H}" fill="{fill}"><title>{_esc(label)}: '
                       f'{_esc(fmt_bytes(nbytes))}</title></rect>')
            x += w
        out.append(f'<text class="total" x="{x + 4:.2f}" y="{yb + _BAR_H - 3}" fill="#222">'
                   f'{_esc(_fmt_gib_short(total))}</text>')
        if show_comm:
            c = comm[i] or 0
            w = _COMM_W * c / comm_max
            out.append(f'<rect class="comm" x="{cx}" y="{yb:.2f}" width="{w:.2f}" height="{_BAR_H}" '
                       f'fill="{COMM_COLOUR}"/>')
            out.append(f'<text x="{cx + w + 4:.2f}" y="{yb + _BAR_H - 3}" fill="#222">'
                       f'{_esc(fmt_bytes(c) if c else "none")}</text>')
        out.append("</g>")

    # The GPU memory line.
    y_top, y_bot = _TOP - 4, _TOP + n * _ROW_H + 2
    gx = x0 + _BAR_W if off_scale else x_of(gpu_bytes)
    label = f"GPU memory {fmt_gib(gpu_bytes)} GiB" + (" (off scale \u2192)" if off_scale else "")
    out.append(f'<line class="gpu-mem" x1="{gx:.2f}" y1="{y_top}" x2="{gx:.2f}" y2="{y_bot}" stroke="#cf222e" '
               f'stroke-width="1.5" stroke-dasharray="5,3"/>')
    out.append(f'<text class="gpu-mem-label" x="{gx:.2f}" y="{y_bot + 14}" text-anchor="middle" '
               f'fill="#cf222e">{_esc(label)}</text>')

    # Legend, two rows.
    items = [(label, colour) for _, label, colour in SEGMENTS] + [(OVERHEAD[1], "url(#hatch)")]
    lx, ly = _PAD, legend_y
    for j, (label, colour) in enumerate(items):
        if j == 4:
            lx, ly = _PAD, ly + 18
        out.append(f'<rect x="{lx}" y="{ly}" width="12" height="12" fill="{colour}"/>')
        out.append(f'<text x="{lx + 16}" y="{ly + 10}">{_esc(label)}</text>')
        lx += 16 + 7 * len(label) + 18
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _tooltip(r, parts, total) -> str:
    mem = r.memory
    bits = [f"{label} {fmt_gib(nb)}" for _, label, _, nb in parts if nb]
    return (f"{r.name}: {fmt_gib(total)} GiB ({'fits' if mem.fits else 'does not fit'}; peak "
            f"{fmt_gib(mem.peak_allocated)} GiB in {mem.peak_phase}): " + ", ".join(bits))


# -- notebook HTML -----------------------------------------------------------------------------

def plan_html(plan) -> str:
    """Jupyter rendering: heading, the strategy table, the SVG chart and the recommendation."""
    e = _html_escape
    model, cluster = _title(plan)
    head = ["strategy"] + [label for _, label, _ in SEGMENTS] + ["peak", "phase", "fits", "headroom",
                                                                 "sent/GPU/step", "step"]
    rows = []
    for r in plan.results:
        mem = r.memory
        c = _comm_bytes(r)
        step = getattr(r, "step_time_s", None)
        cells = [e(str(r.name))] + [fmt_gib(mem.components.get(k, 0)) for k, _, _ in SEGMENTS]
        cells += [fmt_gib(mem.peak_allocated), e(str(mem.peak_phase)),
                  "\u2713" if mem.fits else "<b style='color:#cf222e'>\u2717</b>", fmt_gib(mem.headroom),
                  e(fmt_bytes(c)) if c is not None else "-", e(fmt_seconds(step)) if step else "-"]
        rows.append("<tr>" + "".join(f"<td>{x}</td>" for x in cells) + "</tr>")
    try:
        summary = plan.recommendation.summary
    except Exception as exc:  # a rendering must not fail because the recommendation did
        summary = f"(no recommendation: {type(exc).__name__}: {exc})"
    svg = plan_svg(plan)
    return (
        '<div class="distplan-plan">'
        f"<p><b>{e(model)}</b><br>{e(cluster)}</p>"
        '<table class="distplan-table"><thead><tr>'
        + "".join(f"<th>{e(h)}</th>" for h in head)
        + "</tr></thead><tbody>" + "".join(rows) + "</tbody></table>"
        "<p style='font-size:smaller'>GiB per GPU, most loaded rank; fits includes allocator and "
        "CUDA/NCCL overhead.</p>"
        + svg
        + f"<p><b>recommendation:</b> {e(summary)}</p></div>"
    )


# -- matplotlib --------------------------------------------------------------------------------

def plot_matplotlib(plan, path: str | None = None):
    """The same chart with matplotlib; returns the Figure and saves it to `path` when given."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plan.plot() needs matplotlib: pip install 'distplan[plot]' "
                          "(or use plan.svg(), which needs nothing)") from None
    results = list(plan.results)
    comm = [_comm_bytes(r) for r in results]
    show_comm = any(c for c in comm if c)
    fig = Figure(figsize=(11 if show_comm else 8, 1.2 + 0.45 * len(results)))
    if show_comm:
        ax, axc = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [3, 1]})
    else:
        ax, axc = fig.subplots(1, 1), None
    names = [str(r.name) for r in results]
    ys = list(range(len(results)))[::-1]
    left = [0.0] * len(results)
    for key, label, colour in list(SEGMENTS) + [OVERHEAD]:
        vals = []
        for r in results:
            mem = r.memory
            nb = _overhead_bytes(mem) if key == OVERHEAD[0] else mem.components.get(key, 0)
            vals.append(nb / GiB)
        kw = {"hatch": "//", "edgecolor": "#8c8c8c"} if key == OVERHEAD[0] else {}
        ax.barh(ys, vals, left=left, color=colour, label=label, height=0.6, **kw)
        left = [a + b for a, b in zip(left, vals)]
    gpu = plan.cluster.gpu_memory_bytes / GiB
    ax.axvline(gpu, color="#cf222e", linestyle="--", linewidth=1.2)
    ax.text(gpu, len(results) - 0.4, f"GPU {gpu:.1f} GiB", color="#cf222e", ha="center", va="bottom")
    for y, total, r in zip(ys, left, results):
        ax.text(total, y, f" {_fmt_gib_short(total * GiB)} {'✓' if r.memory.fits else '✗'}", va="center")
    ax.set_yticks(ys, names)
    ax.set_xlabel("GiB per GPU (most loaded rank)")
    model, cluster = _title(plan)
    ax.set_title(f"{model}\n{cluster}", fontsize=9, loc="left")
    ax.legend(fontsize=8, loc="lower right")
    if axc is not None:
        axc.barh(ys, [(c or 0) / GiB for c in comm], color=COMM_COLOUR, height=0.6)
        axc.set_xlabel("GiB sent per GPU per step")
    fig.tight_layout()
    if path:
        fig.savefig(path)
    return fig


CHART_FORMATS = {".svg": "svg", ".png": "png", ".pdf": "pdf"}
"""`--plot` by extension: SVG from `plan_svg` (no dependency); PNG and PDF through matplotlib."""


def _shown(value) -> str:
    """A value as an error shows it: its repr, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_chart_path(path: str, flag: str = "--plot") -> str:
    """The chart format for `path`, or ValueError naming the flag, the value and what is accepted:
    checked before any planning, so a bad path costs nothing."""
    import os
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{flag}={_shown(path)}: give a file name ending in {', '.join(CHART_FORMATS)}")
    ext = os.path.splitext(path)[1].lower()
    if ext not in CHART_FORMATS:
        raise ValueError(f"{flag}={_shown(path)}: unknown chart format {ext or '(no extension)'}; "
                         f"accepted: {', '.join(CHART_FORMATS)}")
    if os.path.isdir(path):
        raise ValueError(f"{flag}={_shown(path)}: is a directory; give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{flag}={_shown(path)}: its folder does not exist")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{flag}={_shown(path)}: not writable")
    import tempfile
    try:  # the folder must take a new file (os.access says yes for root, and for /proc)
        with tempfile.NamedTemporaryFile(prefix=".distplan-chart-", dir=parent):
            pass
    except OSError as exc:
        raise ValueError(f"{flag}={_shown(path)}: cannot write in its folder ({exc.strerror or exc})") from None
    fmt = CHART_FORMATS[ext]
    if fmt != "svg":
        import importlib.util
        if importlib.util.find_spec("matplotlib") is None:
            raise ValueError(f"{flag}={_shown(path)}: {fmt.upper()} needs matplotlib (pip install 'distplan[plot]'); "
                             f"or write .svg, which needs nothing")
    return fmt


def _umask() -> int:
    """The process's umask (read by setting it and setting it back: POSIX has no call that only reads it)."""
    import os
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_chart(plan, path: str, flag: str = "--plot") -> None:
    """Write the chart to `path` (format by extension) atomically: a temporary file in the same
    folder, renamed over `path` only once complete, so a failed write (full disk) leaves the old file.
    A symlink is followed (the file it names is replaced, the link stays); the file keeps its mode, and a
    new one gets the mode `open` would give it (0o666 less the umask; mkstemp's own is 0o600)."""
    import os
    import tempfile
    fmt = check_chart_path(path, flag)
    target = os.path.realpath(path)
    parent = os.path.dirname(target)
    tmp = None
    try:
        mode = os.stat(target).st_mode & 0o7777 if os.path.exists(target) else 0o666 & ~_umask()
        fd, tmp = tempfile.mkstemp(prefix=".distplan-chart-", suffix=os.path.splitext(path)[1], dir=parent)
        os.fchmod(fd, mode)
        if fmt == "svg":
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(plan_svg(plan))
                fh.flush()
                os.fsync(fh.fileno())
        else:
            os.close(fd)
            plot_matplotlib(plan).savefig(tmp, format=fmt)
        os.replace(tmp, target)
    except OSError as exc:
        raise ValueError(f"{flag}={_shown(path)}: could not write the chart ({exc.strerror or exc})") from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
