"""What a GPU validation run showed, per open issue, from its results file (`distplan validate --out`).

    python benchmarks/gpu_summary.py RESULTS.jsonl [MORE.jsonl ...] [--json]
    python benchmarks/gpu_summary.py RESULTS.jsonl --relativize ROOT --write OUT.jsonl
    python benchmarks/gpu_summary.py COMMITTED.jsonl --absolutize ROOT --write RESUME.jsonl   # the inverse
    python benchmarks/gpu_summary.py benchmarks/results/h100-*.jsonl --repredict   # the planner as it is now

The records are judged by `distplan validate` itself (validate/compare.py); this only gathers them the way
the issues ask for them, so a session with a lent GPU can read its numbers off one screen and commit them:

- issue 11 (real models): the Hugging Face probes (`--hf-config`, the transformers model itself): how many,
  which model types, depths, precisions, checkpointings, strategies and world sizes; the peak's median and
  max |error| (bar: 2% / 5%), how many within 5%, the worst ones;
- issue 15 (the OOM line): `max_memory_reserved` judged against the predicted reserved peak, by allocator
  configuration (bar: 10% median, 20% max);
- issue 12 (step time): the judged step times (a probe alone on its GPU, a GPU-bound prediction; bar 15%),
  and why the others were not judged;
- issue 13 (tensor parallelism): the `--tp` probes' peaks and collectives.

`--relativize ROOT --write OUT` rewrites the absolute paths the CLI records for `--hf-config` (the probes
may run elsewhere, so the spec holds an absolute path) relative to ROOT, the repository on the machine that
ran them, so that the committed file re-predicts from a clone anywhere (tests chdir to the repository).
Medians and maxima are over the newest record of each probe id. `--repredict` judges the measurements
against the planner as it is now (`predict_probe` of each record's spec, run from the repository root,
where committed records name their configs) instead of the prediction stored when they ran.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

PEAK_BAR = (0.02, 0.05)
"""Issue 11: peak median |error| <= 2%, max <= 5%."""
RESERVED_BAR = (0.10, 0.20)
"""Issue 15: reserved median |error| <= 10%, max <= 20%."""
TIME_BAR = 0.15
"""Issue 12: each judged single-GPU step time within 15%."""


def load(paths: list[str], every: bool = False) -> list[dict]:
    """The newest record of each probe id over the files, in first-seen order (`every`: all of them, as
    written: what --relativize/--absolutize rewrite, so that a file keeps a probe run twice)."""
    out: dict = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a killed run
                    continue
                out[len(out) if every else rec.get("id")] = rec
    return list(out.values())


def _replace_paths(obj, prefix: str):
    if isinstance(obj, str):
        return obj.replace(prefix, "")
    if isinstance(obj, list):
        return [_replace_paths(v, prefix) for v in obj]
    if isinstance(obj, dict):
        return {k: _replace_paths(v, prefix) for k, v in obj.items()}
    return obj


def relativize(rec: dict, root: str) -> dict:
    """`rec` with every string's `ROOT/` prefix removed (ids, inputs, measurement)."""
    return _replace_paths(rec, os.path.join(os.path.abspath(root), ""))


def repredict(recs: list[dict]) -> list[dict]:
    """The records compared again with the planner's prediction as it is now (needs the planner; torch
    and transformers for --hf-config records)."""
    from distplan.planner.api import predict_probe
    from distplan.validate.compare import compare
    from distplan.validate.results import record_spec
    out = []
    for r in recs:
        if r.get("status") != "ok":
            out.append(r)
            continue
        cmp = compare(predict_probe(record_spec(r)), r["measurement"],
                      (r.get("comparison") or {}).get("tolerance") or 0.05)
        out.append(dict(r, comparison=cmp, verdict=cmp["verdict"]))
    return out


def absolutize(rec: dict, root: str) -> dict:
    """`relativize`'s inverse on what the CLI writes absolute: `hf:PATH` in ids and model names and the
    spec's `hf_config` (so that `--resume` on another machine matches committed records by id and inputs)."""
    import re
    root = os.path.abspath(root)

    def fix(obj, key=None):
        if isinstance(obj, str):
            if key == "hf_config" and not os.path.isabs(obj):
                return os.path.join(root, obj)
            return re.sub(r"hf:(?!/)", f"hf:{root}/", obj)
        if isinstance(obj, list):
            return [fix(v) for v in obj]
        if isinstance(obj, dict):
            return {k: fix(v, k) for k, v in obj.items()}
        return obj
    return fix(rec)


def _config(rec: dict) -> dict:
    path = ((rec.get("inputs") or {}).get("module") or {}).get("hf_config") or ""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def model_type(rec: dict) -> str:
    cfg = _config(rec)
    path = rec["inputs"]["module"]["hf_config"]
    return cfg.get("model_type") or os.path.basename(path).split("-")[0].split(".")[0]


def depth(rec: dict) -> int | None:
    layers = rec["inputs"]["module"].get("layers")
    if layers:
        return int(layers)
    cfg = _config(rec)
    n = cfg.get("num_hidden_layers", cfg.get("n_layer"))
    return int(n) if n is not None else None


def _abs_errors(recs: list[dict], key: str) -> list[float]:
    out = []
    for r in recs:
        cell = (r.get("comparison") or {}).get(key) or {}
        if cell.get("error") is not None:
            out.append(abs(cell["error"]))
    return out


def _stats(errs: list[float]) -> dict:
    return {"n": len(errs), "median": statistics.median(errs) if errs else None, "max": max(errs) if errs else None}


def summarize(records: list[dict]) -> dict:
    """{"probes", "not_ok", "hf", "reserved", "time", "tp"}: the figures each issue asks for."""
    ok = [r for r in records if r.get("status") == "ok"]
    out: dict = {"probes": len(records), "not_ok": [(r.get("id"), r.get("status"), r.get("verdict"))
                                                   for r in records if r.get("status") != "ok"]}
    hf = [r for r in ok if ((r.get("inputs") or {}).get("module") or {}).get("hf_config")]
    errs = _abs_errors(hf, "peak")
    signed = sorted(((r["comparison"]["peak"]["error"], r["id"]) for r in hf
                     if (r.get("comparison") or {}).get("peak", {}).get("error") is not None), key=lambda e: -abs(e[0]))
    out["hf"] = dict(_stats(errs), within_5=sum(e <= 0.05 for e in errs), worst=signed[:5],
                     types=sorted({model_type(r) for r in hf}),
                     depths=sorted({d for d in (depth(r) for r in hf) if d is not None}),
                     precisions=sorted({r["inputs"]["train"]["precision"] for r in hf}),
                     checkpointing=sorted({r["inputs"]["train"].get("checkpointing", "none") for r in hf}),
                     strategies=sorted({r["inputs"]["strategy"] for r in hf}),
                     worlds=sorted({int(r["inputs"]["world_size"]) for r in hf}),
                     passed=sum(r.get("verdict") == "PASS" for r in hf))
    by_conf: dict[str, list[float]] = {}
    for r in ok:
        cell = (r.get("comparison") or {}).get("reserved") or {}
        if cell.get("error") is not None:
            conf = (r.get("inputs") or {}).get("train", {}).get("alloc_conf") or "default"
            by_conf.setdefault(conf, []).append(abs(cell["error"]))
    out["reserved"] = {"all": _stats([e for v in by_conf.values() for e in v]),
                       "by_alloc_conf": {k: _stats(v) for k, v in sorted(by_conf.items())}}
    judged, why_not = [], {}
    for r in ok:
        st = (r.get("comparison") or {}).get("step_time") or {}
        if st.get("judged"):
            judged.append((r["id"], st["predicted"], st["measured"], st["error"]))
        elif st.get("measured") is not None:
            reason = ("shared its GPU" if st.get("shared_gpu") else "host-bound" if st.get("bound") == "host"
                      else "not predicted" if st.get("predicted") is None else "other")
            why_not[reason] = why_not.get(reason, 0) + 1
    out["time"] = dict(_stats([abs(e) for *_, e in judged]), within=sum(abs(e) <= TIME_BAR for *_, e in judged),
                       judged=judged, not_judged=why_not)
    tp = [r for r in ok if int((r.get("inputs") or {}).get("tp", 1)) > 1]
    out["tp"] = dict(_stats(_abs_errors(tp, "peak")),
                     collectives_exact=sum(bool(((r.get("comparison") or {}).get("collectives") or {}).get("exact"))
                                           for r in tp))
    return out


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def _bar(stats: dict, bar: tuple[float, float]) -> str:
    if not stats["n"]:
        return "no probes"
    met = stats["median"] <= bar[0] and stats["max"] <= bar[1]
    return (f"median {_pct(stats['median'])}, max {_pct(stats['max'])} over {stats['n']} "
            f"(bar {_pct(bar[0])} / {_pct(bar[1])}: {'met' if met else 'NOT met'})")


def render(s: dict) -> str:
    h, res, t, tp = s["hf"], s["reserved"], s["time"], s["tp"]
    lines = [f"{s['probes']} probes; not ok: {len(s['not_ok'])}"]
    lines += [f"  {i} {st} {v}" for i, st, v in s["not_ok"]]
    lines.append(f"issue 11, Hugging Face models: {h['n']} probes ({h['passed']} PASS), peak {_bar(h, PEAK_BAR)}; "
                 f"within 5%: {h['within_5']}/{h['n']}")
    lines.append(f"  types {', '.join(h['types'])}; layers {h['depths']}; {', '.join(h['precisions'])}; "
                 f"checkpointing {', '.join(h['checkpointing'])}; worlds {h['worlds']}; "
                 f"{len(h['strategies'])} strategies")
    lines += [f"  worst: {e:+.2%} {i}" for e, i in h["worst"]]
    lines.append(f"issue 15, max_memory_reserved: {_bar(res['all'], RESERVED_BAR)}")
    lines += [f"  {conf}: {_bar(v, RESERVED_BAR)}" for conf, v in res["by_alloc_conf"].items()]
    lines.append(f"issue 12, step time judged: {t['n']} probes, {t['within']} within {TIME_BAR:.0%}"
                 + (f", median {_pct(t['median'])}, max {_pct(t['max'])}" if t["n"] else "")
                 + (f"; not judged: {t['not_judged']}" if t["not_judged"] else ""))
    lines += [f"  {e:+.1%} predicted {p * 1e3:.1f} ms measured {m * 1e3:.1f} ms {i}" for i, p, m, e in t["judged"]]
    lines.append(f"issue 13, tensor parallel: {tp['n']} probes"
                 + (f", peak median {_pct(tp['median'])}, max {_pct(tp['max'])}, collectives exact "
                    f"{tp['collectives_exact']}/{tp['n']}" if tp["n"] else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--relativize", metavar="ROOT")
    ap.add_argument("--write", metavar="OUT", help="with --relativize or --absolutize: the rewritten records")
    ap.add_argument("--repredict", action="store_true", help="judge against the planner as it is now")
    ap.add_argument("--absolutize", metavar="ROOT", help="the inverse of --relativize (to --resume from a "
                    "committed file on another machine)")
    a = ap.parse_args(argv)
    recs = load(a.results)
    if a.relativize or a.absolutize:
        if a.write:  # every record, not the newest of each id (the summary's view)
            with open(a.write, "w") as f:
                f.writelines(json.dumps(relativize(r, a.relativize) if a.relativize else absolutize(r, a.absolutize))
                             + "\n" for r in load(a.results, every=True))
        recs = [relativize(r, a.relativize) if a.relativize else absolutize(r, a.absolutize) for r in recs]
    if a.repredict:
        recs = repredict(recs)
    s = summarize(recs)
    print(json.dumps(s, indent=2, default=str) if a.json else render(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
