"""`distplan validate`'s output: the progress line, the results table, why probes failed, one probe's
detail and the summary per strategy."""

from __future__ import annotations

import statistics

from tabulate import tabulate

from distplan.planner.model import ModelSpec
from distplan.planner.units import fmt_bytes, fmt_seconds

from .compare import ABS_FLOOR_BYTES


COMPONENTS = ("params", "grads", "optimizer", "activations", "comm_buffers", "temporaries")


def _param_count(model: dict) -> int:
    fields = set(ModelSpec.__dataclass_fields__)
    return ModelSpec(**{k: v for k, v in model.items() if k in fields}).param_count()


# -- output ------------------------------------------------------------------------------------------


class _Progress:
    """One updating line on a terminal; one line per finished probe otherwise."""

    def __init__(self, total: int, stream):
        self.total, self.stream, self.done, self.running = total, stream, 0, []
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self._width = 0

    def event(self, kind, index, spec, record):
        if kind == "start":
            self.running.append(spec["id"])
        elif kind in ("done", "skip"):
            self.done += 1
            if spec["id"] in self.running:
                self.running.remove(spec["id"])
            line = (f"[{self.done}/{self.total}] {spec['id']}: "
                    + ("resumed " if kind == "skip" else "")
                    + f"{record.get('status')} {record.get('verdict')}"
                    + (f" ({record['measurement'].get('wall_s'):.1f} s)" if kind == "done"
                       and record["measurement"].get("wall_s") is not None else ""))
            if self.tty:
                self._write("\r" + " " * self._width + "\r" + line + "\n")
                self._width = 0
            else:
                self._write(line + "\n")
        if self.tty and self.running:
            bar_n = 20 * self.done // max(1, self.total)
            line = f"[{'#' * bar_n}{'.' * (20 - bar_n)}] {self.done}/{self.total} running {', '.join(self.running)}"
            line = line[:150]
            self._write("\r" + line + " " * max(0, self._width - len(line)))
            self._width = len(line)

    def clear(self):
        if self.tty and self._width:
            self._write("\r" + " " * self._width + "\r")
            self._width = 0

    def _write(self, s):
        self.stream.write(s)
        self.stream.flush()


def _pct(e) -> str:
    return "n/a" if e is None else f"{e * 100:+.1f}%"


def _b(n) -> str:
    return "-" if n is None else fmt_bytes(n)


def _row(rec: dict) -> list:
    spec, cmp = rec.get("inputs") or {}, rec.get("comparison") or {}
    peak = cmp.get("peak") or {}
    pred_peak = peak.get("predicted", ((rec.get("prediction") or {}).get("memory") or {}).get("peak_allocated"))
    meas_peak = peak.get("measured", ((rec.get("measurement") or {}).get("memory") or {}).get("peak_allocated"))
    worst = cmp.get("worst_component")
    worst_s = _worst_cell(cmp) if worst else "-"
    coll = cmp.get("collectives")
    coll_s = "-" if not coll or coll.get("exact") is None else ("exact" if coll["exact"] else "DIFF")
    status = rec.get("status")
    if status == "oom":
        meas_s = "OOM"
    else:
        meas_s = _b(meas_peak) if status == "ok" else status
    world = f"{spec.get('world_size')}" + (" fake" if spec.get("mode") == "fake" else "")
    return [spec.get("strategy"), (spec.get("model") or {}).get("name"), world,
            (spec.get("train") or {}).get("checkpointing"), (spec.get("train") or {}).get("precision"),
            _b(pred_peak), meas_s, _pct(peak.get("error")), worst_s, coll_s,
            rec.get("verdict") + (" (resumed)" if rec.get("resumed") else "")]


def _worst_cell(cmp: dict) -> str:
    """`grads -40.7% (-176.00 KiB; with temporaries within 10%)`: the component whose ratio is worst,
    and, when that ratio is beyond the component tolerance, the bytes and the rule that judged it."""

    name = cmp.get("worst_component")
    cell = (cmp.get("components") or {}).get(name) or {}
    err, diff = cell.get("error"), cell.get("abs_error_bytes")
    out = f"{name} {_pct(err)}"
    ctol = cmp.get("component_tolerance") or 0.1
    floor = cmp.get("abs_floor_bytes") or ABS_FLOOR_BYTES
    floor_s = f"{floor // 1024} KiB" if floor % 1024 == 0 else fmt_bytes(floor)
    if diff is None or (err is not None and abs(err) <= ctol):
        return out
    signed = ("-" if diff < 0 else "+") + fmt_bytes(abs(diff))
    if cell.get("judged_with"):
        other = [c for c in cell["judged_with"].split("+") if c != name]
        return f"{out} ({signed}; with {', '.join(other)} within {ctol:.0%})"
    if abs(diff) <= floor:
        return f"{out} ({signed}, under the {floor_s} floor)"
    if cell.get("judged") is False:
        return f"{out} ({signed}, shown, not judged: gloo processes)"
    return f"{out} ({signed}, beyond {ctol:.0%} and the {floor_s} floor)"


def render_table(records: list[dict]) -> str:

    headers = ["strategy", "model", "world", "ckpt", "precision", "pred peak", "meas peak", "error",
               "worst component", "collectives", "verdict"]
    return tabulate([_row(r) for r in records], headers=headers, disable_numparse=True)


def render_why(records: list[dict]) -> str:
    """Below the table, in full: why each probe that did not PASS got its verdict."""
    lines = []
    for r in records:
        if r.get("verdict") == "PASS":
            continue
        reasons = (r.get("comparison") or {}).get("reasons") or ["no reason recorded"]
        lines.append(f"{r.get('verdict')} {r.get('id')}:")
        lines += [f"  - {x}" for x in reasons]
    return ("\nwhy\n" + "\n".join(lines)) if lines else ""


FAIL_MEANS = ("FAIL means the planner's prediction and this machine's measurement disagree beyond the rule "
              "(peak off by more than {tol:.0%}, a component by more than {ctol:.0%} and the 64 KiB floor, or "
              "collective calls that differ), or the probe did not finish (crashed, timed out, raised, "
              "out of memory where the prediction said it fits); the reasons are listed under 'why'.")


def describe_model(m: dict, default: bool = False) -> str | None:
    """One line saying what a reference-decoder model is: layers, width, heads, vocabulary, parameters."""
    try:
        n = _param_count(m)
    except Exception:  # noqa: BLE001 - a description, never an error
        return None
    kv = f" ({m['kv_heads']} KV)" if m.get("kv_heads") and m.get("kv_heads") != m.get("heads") else ""
    what = "the default probe model: " if default else ""
    return (f"{m.get('name')}: {what}a Llama-style decoder, {m.get('layers')} layers, hidden {m.get('hidden')}, "
            f"{m.get('heads')} heads{kv}, FFN {m.get('ffn_hidden')}, vocab {m.get('vocab')}, "
            f"{_count(n)} parameters")


def _count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def render_detail(rec: dict) -> str:
    """Per-component predicted vs measured, and the collective table, for one probe."""

    cmp = rec.get("comparison") or {}
    out = []
    comps = cmp.get("components") or {}
    if comps:
        rows = []
        for name in COMPONENTS:
            c = comps.get(name) or {}
            ok = ("unmeasured" if c.get("unmeasured") else ("ok" if c.get("ok") else "OUT")
                  + (" (not judged)" if c.get("judged") is False else ""))
            rows.append([name, _b(c.get("predicted")), _b(c.get("measured")), _pct(c.get("error")),
                         _b(c.get("abs_error_bytes")), ok])
        p = cmp.get("peak") or {}
        rows.append(["peak_allocated", _b(p.get("predicted")), _b(p.get("measured")), _pct(p.get("error")),
                     _b(p.get("abs_error_bytes")),
                     f"{'ok' if p.get('ok') else 'OUT'} ({p.get('predicted_phase')} / {p.get('measured_phase')})"])
        out.append("\nmemory (bytes on the most loaded rank)")
        out.append(tabulate(rows, headers=["component", "predicted", "measured", "error", "abs diff", "judged"],
                            disable_numparse=True))
    coll = cmp.get("collectives") or {}
    if coll.get("rows"):
        rows = [[r["op"], r["group_size"], r["dtype"], _b(r["message_bytes"]), r["predicted_calls"],
                 r["measured_calls"], "yes" if r["match"] else "NO"] for r in coll["rows"]]
        out.append("\ncollectives per probe run (matched by op, group, dtype, message bytes)")
        out.append(tabulate(rows, headers=["op", "group", "dtype", "message", "predicted calls",
                                           "counted calls", "match"], disable_numparse=True))
    st = cmp.get("step_time") or {}
    if st.get("measured") is not None or st.get("predicted") is not None:
        pred = (f"predicted {fmt_seconds(st['predicted'])}" if st.get("predicted") is not None
                else "not predicted off the GPU")
        meas = f"measured {fmt_seconds(st['measured'])}" if st.get("measured") is not None else "not measured"
        err = f", error {_pct(st['error'])}" if st.get("error") is not None else ""
        if st.get("judged"):
            why = f"judged: within {st.get('tolerance', 0.15):.0%} for a GPU-bound step"
        elif st.get("shared_gpu"):
            why = "reported, not judged: other probes ran on the GPU beside it (--jobs > 1)"
        elif st.get("bound") == "host":
            why = "reported, not judged: predicted host-bound, the time is the host issuing eager ops"
        else:
            why = "reported, not judged: time is judged on a GPU only"
        out.append(f"\nstep time: {pred}, {meas}{err} ({why})")
    if cmp.get("reasons") and rec.get("verdict") == "PASS":  # notes; a FAIL's reasons are under 'why'
        out.append("\n" + "\n".join(f"  - {r}" for r in cmp["reasons"]))
    return "\n".join(out)


def summarize(records: list[dict]) -> dict:
    """Per strategy: probes, passes, and median/max |error| of the peak and each component."""
    by: dict[str, list[dict]] = {}
    for r in records:
        by.setdefault((r.get("inputs") or {}).get("strategy"), []).append(r)
    out = {}
    for strategy, recs in by.items():
        row = {"probes": len(recs), "pass": sum(r.get("verdict") == "PASS" for r in recs)}
        for name in ("peak",) + COMPONENTS:
            errs = []
            for r in recs:
                cmp = r.get("comparison") or {}
                cell = cmp.get("peak") if name == "peak" else (cmp.get("components") or {}).get(name)
                if cell and cell.get("error") is not None:
                    errs.append(abs(cell["error"]))
            row[name] = ({"median_abs_error": statistics.median(errs), "max_abs_error": max(errs)}
                         if errs else None)
        out[strategy] = row
    return out


def render_summary(records: list[dict]) -> str:

    rows = []
    for strategy, row in summarize(records).items():
        cells = []
        for name in ("peak",) + COMPONENTS:
            s = row[name]
            cells.append("-" if s is None else
                         f"{s['median_abs_error'] * 100:.1f} / {s['max_abs_error'] * 100:.1f}")
        rows.append([strategy, f"{row['pass']}/{row['probes']}"] + cells)
    return ("\nsummary: median / max |error| in % per strategy\n"
            + tabulate(rows, headers=["strategy", "pass", "peak", *COMPONENTS], disable_numparse=True))
