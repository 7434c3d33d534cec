"""Text output of a plan: the strategy table (tabulate), notes, the recommendation line.

The SVG chart and the notebook HTML live in `chart.py`; this module re-exports them so callers have
one place to ask for any rendering.
"""

from __future__ import annotations

from tabulate import tabulate

from .units import fmt_bytes, fmt_count, fmt_gib, fmt_seconds

MEM_COLUMNS = (("params", "params"), ("grads", "grads"), ("optimizer", "optim"),
               ("activations", "acts"), ("comm_buffers", "buffers"), ("temporaries", "temps"))


def header(plan) -> str:
    if hasattr(plan, "header_lines"):  # a --module plan describes its own model
        return "\n".join(plan.header_lines())
    t, c, m = plan.train, plan.cluster, plan.train.model
    lines = [
        f"model: {m.name}: {m.param_count():,} params ({fmt_count(m.param_count())}), {m.layers} layers, "
        f"hidden {m.hidden}, {m.heads} heads ({m.kv_heads} KV), FFN {m.ffn_hidden} {m.mlp}, vocab {m.vocab}",
        f"training: seq {t.seq_len} x micro-batch {t.micro_batch} x accum {t.grad_accum}, {t.precision}, "
        f"{t.optimizer} ({t.optimizer_impl}), checkpointing {t.checkpointing}, attention {t.attention}"
        + (f", offload {t.cpu_offload}" if t.cpu_offload != "none" else "")
        + (f", framework {t.framework}" if t.framework != "pytorch" else ""),
        f"cluster: {c.gpus} x {c.gpu_name} ({fmt_gib(c.gpu_memory_bytes)} GiB) in {c.nodes} node(s) of "
        f"{c.gpus_per_node}; intra {c.intra_link}, inter {c.inter_link} x {c.nics_per_node}"
        + (f" ({c.inter_bytes_per_s * 8 / 1e9:g} Gbit/s per node)" if c.inter_bytes_per_s else ""),
    ]
    for n in plan.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def memory_table(plan, table_format: str = "simple") -> str:
    rows = []
    for r in plan.results:
        mem = r.memory
        row = [r.name] + [fmt_gib(mem.components[k]) for k, _ in MEM_COLUMNS]
        row += [fmt_gib(getattr(mem, "workspace", 0)), fmt_gib(mem.peak_allocated), mem.peak_phase, fmt_gib(mem.reserved_estimate + mem.process_overhead),
                fmt_gib(mem.total_required), "yes" if mem.fits else "NO", fmt_gib(mem.headroom)]
        rows.append(row)
    headers = ["strategy"] + [h for _, h in MEM_COLUMNS] + ["cublas", "peak", "phase", "+overhead", "total", "fits",
                                                            "headroom"]
    return "memory per GPU (GiB, most loaded rank)\n" + tabulate(rows, headers, tablefmt=table_format,
                                                                 disable_numparse=True)


def comm_table(plan, table_format: str = "simple") -> str:
    rows = []
    for r in plan.results:
        if r.time is None:
            continue
        t = r.time
        req = r.required_inter_bytes_per_s
        rows.append([r.name, fmt_bytes(r.comm_bytes_per_gpu), fmt_seconds(r.comm_time_s),
                     fmt_seconds(t.exposed_comm_s), fmt_seconds(t.compute_s), fmt_seconds(t.step_time_s),
                     f"{t.tokens_per_s:,.0f}", f"{100 * t.mfu:.0f}%",
                     "-" if req is None else ("unreachable" if req == float("inf") else f"{req * 8 / 1e9:,.0f} Gb/s")])
    if not rows:
        return ""
    headers = ["strategy", "sent/GPU/step", "comm", "exposed", "compute", "step", "tokens/s", "MFU",
               "inter-node BW to hide comm"]
    return "communication and time per optimizer step\n" + tabulate(rows, headers, tablefmt=table_format,
                                                                    disable_numparse=True)


def render_estimate(plan, table_format: str = "simple") -> str:
    parts = [header(plan), "", memory_table(plan, table_format)]
    ct = comm_table(plan, table_format)
    if ct:
        parts += ["", ct]
    notes = sorted({n for r in plan.results for n in r.memory.notes})
    for n in notes:
        parts.append(f"note: {n}")
    rec = plan.recommendation
    parts += ["", f"recommendation: {rec.summary}"]
    return "\n".join(parts)


def plan_svg(plan) -> str:
    from .chart import plan_svg as _svg
    return _svg(plan)


def plan_html(plan) -> str:
    from .chart import plan_html as _html
    return _html(plan)


def plot_matplotlib(plan, path=None):
    from .chart import plot_matplotlib as _plot
    return _plot(plan, path)
