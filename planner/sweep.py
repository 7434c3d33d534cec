"""`distplan sweep`: one row per (value, strategy) over GPU counts, micro-batches or sequence lengths."""

from __future__ import annotations

from tabulate import tabulate

from .units import fmt_gib, fmt_seconds


def _parse_list(flag: str, text: str | None) -> list[int]:
    if not text:
        return []
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"{flag}={text!r}: expected a comma-separated list of positive integers, e.g. 8,16,32")
        out.append(int(part))
    return out


def run_sweep(kw: dict, strategies, sweep_gpus, sweep_micro_batch, sweep_seq_len) -> list[dict]:
    from .cli import build_plan
    axes = [("gpus", _parse_list("--sweep-gpus", sweep_gpus)),
            ("micro_batch", _parse_list("--sweep-micro-batch", sweep_micro_batch)),
            ("seq_len", _parse_list("--sweep-seq-len", sweep_seq_len))]
    axes = [(k, v) for k, v in axes if v]
    if len(axes) != 1:
        raise ValueError("sweep: give exactly one of --sweep-gpus, --sweep-micro-batch, --sweep-seq-len "
                         "(a comma-separated list)")
    key, values = axes[0]
    if kw.get("front_end") in (None, "auto"):
        kw = dict(kw, front_end="analytic")  # one trace per point would take seconds each
    rows = []
    for value in values:
        args = dict(kw)
        args[key] = value
        p = build_plan(args, strategies, detect_local=False)
        rec = p.recommendation.strategy
        for r in p.results:
            rows.append({key: value, "strategy": r.name, "fits": r.fits,
                         "peak_allocated": int(r.memory.peak_allocated),
                         "total_required": int(r.memory.total_required),
                         "comm_bytes_per_gpu": int(r.comm_bytes_per_gpu),
                         "step_time_s": r.step_time_s,
                         "tokens_per_s": r.time.tokens_per_s if r.time is not None else None,
                         "recommended": r.name == rec})
    return rows


def render_sweep(rows: list[dict], table_format: str = "simple") -> str:
    if not rows:
        return "(no rows)"
    key = next(iter(rows[0]))
    table = [[r[key], r["strategy"] + (" *" if r["recommended"] else ""), fmt_gib(r["peak_allocated"]),
              fmt_gib(r["total_required"]), "yes" if r["fits"] else "NO",
              fmt_seconds(r["step_time_s"]) if r["step_time_s"] else "-",
              f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"] for r in rows]
    headers = [key, "strategy", "peak GiB", "total GiB", "fits", "step", "tokens/s"]
    return tabulate(table, headers, tablefmt=table_format, disable_numparse=True) + "\n* recommended"
