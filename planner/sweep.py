"""`distplan sweep`: one row per (value, strategy) over GPU counts, micro-batches or sequence lengths."""

from __future__ import annotations

from .from_flags import build_plan
from .accuracy import error_band, memory_line, time_line
from .front_end import use_trace
from .hf_config import SUPPORTED_MODEL_TYPES, load_hf_config
from .ranking import headroom_warning
from .recommend import pick
from .report import table as draw
from .report import wrap
from .units import LIMITS, fmt_gib, fmt_seconds, short_repr

MAX_SWEEP_VALUES = 32
"""Values per sweep: one plan each (every strategy evaluated), so a list is bounded; 32 covers every
power of two up to the largest cluster accepted (2^20 GPUs) and more."""


def _parse_list(flag: str, text: str | None) -> list[int]:
    if not text:
        return []
    key = {"--sweep-gpus": "gpus", "--sweep-micro-batch": "micro_batch", "--sweep-seq-len": "seq_len"}[flag]
    lo, hi, why = LIMITS[key]
    example = (f"accepted: a comma-separated list of at most {MAX_SWEEP_VALUES} integers from {lo:,} to "
               f"{hi:,}, e.g. 8,16,32")
    if not isinstance(text, str) or len(text) > 32 * MAX_SWEEP_VALUES:
        raise ValueError(f"{flag}={short_repr(text)}: {example}")
    parts = text.split(",")
    if len(parts) > MAX_SWEEP_VALUES:
        raise ValueError(f"{flag}={short_repr(text)}: {len(parts)} values; accepted: at most {MAX_SWEEP_VALUES} "
                         f"(one plan each)")
    out = []
    for part in parts:
        part = part.strip()
        if not (part.isascii() and part.isdigit()):
            raise ValueError(f"{flag}={short_repr(text)}: {example}")
        n = int(part) if len(part) <= 12 else hi + 1  # int() of a hostile digit string costs its length
        if not lo <= n <= hi:
            raise ValueError(f"{flag}={short_repr(text)}: {short_repr(part, 20)} is out of range; accepted: "
                             f"integers from {lo:,} to {hi:,} ({why})")
        out.append(n)
    return out


def run_sweep(kw: dict, strategies, sweep_gpus, sweep_micro_batch, sweep_seq_len) -> list[dict]:
    axes = [("gpus", _parse_list("--sweep-gpus", sweep_gpus)),
            ("micro_batch", _parse_list("--sweep-micro-batch", sweep_micro_batch)),
            ("seq_len", _parse_list("--sweep-seq-len", sweep_seq_len))]
    axes = [(k, v) for k, v in axes if v]
    if len(axes) != 1:
        raise ValueError("sweep: give exactly one of --sweep-gpus, --sweep-micro-batch, --sweep-seq-len "
                         "(a comma-separated list)")
    key, values = axes[0]
    if kw.get("front_end") in (None, "auto"):
        # one trace per point would take seconds each: the analytic front end where it reads the model type;
        # the trace (when torch and transformers are installed) for the types it does not (MoE models, ...)
        analytic = True
        if kw.get("hf_config"):
            cfg, _ = load_hf_config(kw["hf_config"])
            analytic = cfg.get("model_type") in SUPPORTED_MODEL_TYPES or not use_trace(kw)
        kw = dict(kw, front_end="analytic" if analytic else "trace")
    front_end = "trace" if use_trace(kw) else "analytic"  # stated on every row, as estimate's notes state it
    rows = []
    for value in values:
        args = dict(kw)
        args[key] = value
        p = build_plan(args, strategies, detect_local=False)
        # The recommendation's pick (recommend.pick: its strategy and change, not its reasons). Where nothing
        # fits as given, it is of a changed run (`change`, e.g. a smaller micro-batch): no row of this point
        # is it, so none is marked; the change is on every row.
        strategy, change = pick(p)
        picked = None if change else strategy
        # a pick that fits but leaves less than the headroom asked is named with recommend's warning line
        warning = headroom_warning(p[picked], p.headroom) if picked else None
        band = error_band(p.error_front_end)
        for r in p.results:
            rows.append({key: value, "strategy": r.name, "fits": r.fits,
                         "alloc_retries": int(r.memory.alloc_retries),
                         "peak_allocated": int(r.memory.peak_allocated),
                         "total_required": int(r.memory.total_required),
                         "comm_bytes_per_gpu": int(r.comm_bytes_per_gpu),
                         "step_time_s": r.step_time_s,
                         "tokens_per_s": r.time.tokens_per_s if r.time is not None else None,
                         "recommended": r.name == picked,
                         "smallest_change": change and (f"{change}; then {strategy}" if strategy else change),
                         "warning": warning,
                         "front_end": front_end, "error_band": band})
            if kw.get("tokens"):
                tps = rows[-1]["tokens_per_s"]
                rows[-1]["time_to_train_s"] = kw["tokens"] / tps if tps else None
    return rows


def render_sweep(rows: list[dict], table_format: str = "simple") -> str:
    if not rows:
        return "(no rows)"
    key = next(iter(rows[0]))
    table = [[r[key], r["strategy"] + (" *" if r["recommended"] else ""), fmt_gib(r["peak_allocated"]),
              fmt_gib(r["total_required"]),
              ("retry" if r.get("alloc_retries") else "yes") if r["fits"] else "NO",
              fmt_seconds(r["step_time_s"]) if r["step_time_s"] else "-",
              f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"]
             + ([fmt_seconds(r["time_to_train_s"]) if r["time_to_train_s"] else "-"] if "time_to_train_s" in r else [])
             for r in rows]
    headers = [key, "strategy", "peak GiB", "total GiB", "fits", "step", "tokens/s"]
    if "time_to_train_s" in rows[0]:
        headers.append("time to train")
    front = rows[0].get("front_end", "analytic")
    band = rows[0]["error_band"]  # one front end and one band for every row of a sweep
    changes = {}  # point -> its smallest change, where nothing fits there as given
    warnings = {}  # point -> the headroom warning of its pick
    for r in rows:
        if r.get("smallest_change"):
            changes.setdefault(r[key], r["smallest_change"])
        if r.get("warning"):
            warnings.setdefault(r[key], r["warning"])
    return (draw(table, headers, table_format) + "\n* recommended; front end: "
            + ("trace (the model run on fake tensors, traced again at each point)" if front == "trace"
               else "analytic (the formulas)")
            + "".join(f"\n{key} {v}: nothing fits as given; smallest change: {c}" for v, c in changes.items())
            + "".join(f"\n{key} {v}: warning: {w}" for v, w in warnings.items())
            + "\n" + wrap(memory_line(band)) + "\n" + wrap(time_line(band)))
