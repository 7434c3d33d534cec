"""One answer whatever is installed (issue 61, item 1): `distplan recommend --hf-config` searches the layout with
the analytic front end for every layout, on the README's pure-Python install and with torch and transformers
alike; the trace front end, where installed, plans the data-parallel layout too, as a check it prints
(planner/trace_check.py).

The pure-Python install is run as a subprocess in which torch and transformers cannot be imported, and its JSON
is compared whole with the torch run's (`--front-end trace`), less what only the trace adds and the seconds.
"""
from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from distplan.planner.api import recommend
from distplan.planner.cli import main
from distplan.planner.config import NEWEST_TORCH, Cluster, torch_followed
from distplan.planner.strategy_result import evaluate
from distplan.planner.trace_check import TraceCheck, dp_only

ROOT = Path(__file__).resolve().parent.parent
HF = ROOT / "tests" / "data" / "hf"

PURE_PYTHON = ("import sys; sys.modules.update(torch=None, transformers=None); "
               "from distplan.planner.cli import main; main()")
"""`distplan` as the README's pure-Python install runs it: `import torch` and `import transformers` fail."""


def _pure_python(args: list[str]) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", PURE_PYTHON, "recommend", *args, "--json"], capture_output=True,
                       text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def _with_torch(args: list[str]) -> dict:
    pytest.importorskip("transformers")
    r = CliRunner().invoke(main, ["recommend", *args, "--front-end", "trace", "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output[-2000:]
    return json.loads(r.output)


_SECONDS = re.compile(r"in [0-9.]+ s \([0-9.]+ s of CPU\)")


def _comparable(d: dict) -> dict:
    """`d` less the seconds the search took, the trace's check and the front-end note (compared apart)."""
    d = copy.deepcopy(d)
    search = d["recommendation"]["search"]
    for key in ("seconds", "cpu_seconds", "trace_check"):
        search.pop(key)
    d["recommendation"]["reasons"] = [_SECONDS.sub("in - s", x) for x in d["recommendation"]["reasons"]]
    d["inputs"]["notes"] = [n for n in d["inputs"]["notes"] if not n.startswith("front end: ")]
    return d


def _front_end_note(d: dict) -> str:
    notes = [n for n in d["inputs"]["notes"] if n.startswith("front end: ")]
    assert len(notes) == 1, d["inputs"]["notes"]
    return notes[0]


def _pick(d: dict) -> tuple:
    rec = d["recommendation"]
    return rec["strategy"], rec["layout"], rec["max_micro_batch"], rec["change"], rec["warning"]


def _same_answer(args: list[str]) -> tuple[dict, dict]:
    """Both installs' JSON for `recommend args`, checked equal but for what the trace adds. The pure-Python
    install plans the newest PyTorch release (config.NEWEST_TORCH) where the other follows the installed one:
    its run is checked whole at the installed torch's release (--torch-version), and its pick as the user
    runs it, without the flag."""
    release = torch_followed()
    pure, torch_run = _pure_python(args + ["--torch-version", release]), _with_torch(args)
    assert torch_run["inputs"]["train"]["torch_version"] == release
    assert pure["recommendation"]["search"]["trace_check"] is None
    check = torch_run["recommendation"]["search"]["trace_check"]
    assert check is not None and check["layout"]["tp"] == check["layout"]["pp"] == check["layout"]["cp"] == 1
    assert check["strategies"] and all(s["device_total_trace"] is None or s["device_total_trace"] > 0
                                       for s in check["strategies"])
    for d, named in ((pure, "with torch and transformers"), (torch_run, "trace (the transformers model")):
        note = _front_end_note(d)
        assert note.startswith("front end: analytic for every layout searched") and named in note, note
    assert _comparable(pure) == _comparable(torch_run)
    as_installed = _pure_python(args)
    assert as_installed["inputs"]["train"]["torch_version"] == "%d.%d" % NEWEST_TORCH
    assert _pick(as_installed) == _pick(torch_run)
    return pure, torch_run


def test_small_model_same_answer_with_and_without_torch():
    """A 256M model on 8 GPUs of 6 GiB: the pick needs tensor parallelism, which the trace does not model; the
    pure-Python install and the torch one answer the same (layout, strategy, micro-batch, every figure)."""
    args = ["--hf-config", str(ROOT / "examples" / "hf" / "llama-w1024-16l.json"), "--gpus", "8", "--gpu-mem", "6",
            "--seq-len", "8192"]
    pure, torch_run = _same_answer(args)
    rec = pure["recommendation"]
    assert rec["strategy"] and rec["layout"]["tp"] > 1, rec["layout"]
    assert torch_run["recommendation"]["search"]["trace_check"]["same_pick"] is True


@pytest.mark.slow
@pytest.mark.parametrize("config", ["qwen2.5-7b", "llama-3-8b"])
def test_7b_same_answer_with_and_without_torch(config):
    """Issue 61's question: 16 H100s in DGX nodes at 8K tokens. The trace answered by itself, at dp 16 only:
    "nothing fits" (Qwen2.5-7B) and zero3 on dp 16 with 1.65 GiB free (Llama-3-8B); the analytic search a tp 2
    layout. Now both installs give the search's answer, and the trace's own rows for dp 16 are printed beside
    the analytic ones."""
    args = ["--hf-config", str(HF / f"{config}.json"), "--gpus", "16", "--node", "dgx-h100", "--seq-len", "8192"]
    pure, torch_run = _same_answer(args)
    rec = pure["recommendation"]
    assert rec["strategy"] is not None and rec["max_micro_batch"] >= 1 and rec["warning"] is None
    check = torch_run["recommendation"]["search"]["trace_check"]
    assert check["layout"]["dp"] == 16
    # the two front ends within 1% wherever both fit the allocated peak (tests/test_analytic_vs_trace.py)
    both = [(s["device_total_analytic"], s["device_total_trace"]) for s in check["strategies"]
            if s["device_total_analytic"] and s["device_total_trace"]]
    assert both and all(abs(t / a - 1) < 0.01 for a, t in both), both
    # where their verdicts agree, the trace's rows cannot move the pick; where they differ it is printed
    agree = all(s["verdict_analytic"] == s["verdict_trace"] for s in check["strategies"])
    assert check["same_pick"] or not agree
    # one line per table row whatever $COLUMNS the suite runs under (report.terminal_width)
    text = CliRunner().invoke(main, ["recommend", *args, "--front-end", "trace"], env={"COLUMNS": ""}).output
    rows = [x.split() for x in text.splitlines() if x.startswith("16 x 1 x 1 ")]
    assert [r[-1] for r in rows] == ["analytic", "trace"], rows
    assert sum(x.startswith("trace check: ") for x in text.splitlines()) >= 3


def _llama_search(**kw):
    return recommend("llama-3-8b", gpus=16, node="dgx-h100", seq_len=8192, **kw)


def test_trace_rows_that_decide_otherwise_are_said():
    """Where the trace's rows for the data-parallel layout would move the pick, the check says so and names
    the flags that plan that layout by the trace; the recommendation stays the analytic search's. Here the
    "trace" rows are the analytic ones on a GPU with 8 GiB more, so dp 16's zero3 (1.96 GiB free of 79.65,
    under the 5% headroom) keeps the headroom: the rule would pick it, 9% faster than the tp 2 pick."""
    p = _llama_search()
    s = p.search
    cand = dp_only(s)
    assert (cand.layout.dp, cand.layout.tp, cand.layout.pp) == (16, 1, 1)
    roomy: Cluster = replace(p.cluster, gpu_memory_bytes=p.cluster.gpu_memory_bytes + 8 * 2**30)
    results = [evaluate(cand.train, roomy, r.strategy) for r in cand.results]
    check = TraceCheck.of(s, results, 0.5)
    assert s.pick[0].layout.tp == 2 and not check.same_pick
    assert check.pick[0].layout == cand.layout and check.pick[1].name == "zero3"
    differ = [(n, va, vt) for n, _, _, va, vt in check.rows() if va != vt]
    assert ("zero3", "fits", "headroom") in differ, differ
    words = check.lines()
    assert any("zero3 on dp 16 x tp 1 x pp 1 fits with the headroom by the trace" in x for x in words), words
    assert any("would pick zero3 on dp 16 x tp 1 x pp 1" in x and "--tp 1 --pp 1" in x for x in words), words
    d = check.to_dict()
    assert d["same_pick"] is False and d["pick_by_trace"]["strategy"] == "zero3"
    # the agreeing case: the same rows as the analytic ones change nothing
    same = TraceCheck.of(s, [evaluate(cand.train, p.cluster, r.strategy) for r in cand.results], 0.5)
    assert same.same_pick and all(va == vt for _, _, _, va, vt in same.rows())


def test_unsearched_when_the_analytic_front_end_does_not_read_the_model(monkeypatch):
    """A model_type only the trace reads is planned by the trace at data parallelism, and the note says the
    layout was not searched and why (the trace itself is stubbed: what is tested is the routing)."""
    import distplan.planner.api as api
    seen = {}
    base = _llama_search(tp=1, pp=1)

    def fake_plan(model=None, **kw):
        seen.update(kw)
        return replace(base, notes=[])
    monkeypatch.setattr(api, "plan", fake_plan)
    monkeypatch.setattr(api, "use_trace", lambda kw: True)
    p = api.recommend(hf_config=str(HF / "mixtral-8x7b.json"), gpus=16, front_end="auto")
    assert seen["front_end"] == "auto" and seen["tp"] == 1 and seen["pp"] == 1
    assert any(n.startswith("layout: not searched") and "'mixtral'" in n for n in p.notes), p.notes


def test_a_fixed_model_parallel_flag_leaves_nothing_to_check():
    """--tp 2 given: no searched layout is data-parallel only, so the trace (auto, torch installed or not)
    checks none, and the note says why rather than promising a check."""
    r = CliRunner().invoke(main, ["recommend", "--hf-config", str(ROOT / "examples" / "hf" / "llama-8l.json"),
                                  "--gpus", "8", "--tp", "2", "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output[-2000:]
    d = json.loads(r.output)
    assert d["recommendation"]["search"]["trace_check"] is None and d["recommendation"]["layout"]["tp"] == 2
    assert "--tp=2 given: the trace, which does not follow it, checks no layout" in _front_end_note(d)
