"""Golden test: every configuration of tests/golden_cases.py answered again and compared, to the bit, with the
answer recorded in tests/data/golden/ (see golden_cases' docstring for what is recorded and THE RULE: a golden
number changes only by `python -m tests.golden_cases --write`, in a commit naming the bug it fixes and the probe
that shows it).

One test per family, so a failure names what moved; each prints the configuration and its first differing keys
(`path: recorded -> now`). A sample of each analytic family (every FAST_EVERY-th case) runs in the fast tier,
the rest of it in the slow one; the trace front end (torch + transformers), `--module` and the re-prediction of
every committed probe record are `slow`.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import golden_cases as G  # noqa: E402

HINT = ("\n\nThe planner's answer changed. A behaviour-preserving change must not do this; a fix that means to "
        "change it regenerates with `python -m tests.golden_cases --write` in a commit naming the bug and the "
        "probe that shows it.")


@pytest.fixture(scope="module")
def stored():
    return {g: G.stored_by_family(g) for g in G.GROUPS}


def _check(stored, group: str, family: str, part: int = 0, keep=None) -> None:
    rows = stored[group].get(family) or []
    assert rows, f"no recorded answers for {family} in {G.data_path(group)}"
    problems = G.check_family(family, rows, part=part, keep=keep)
    if problems:
        pytest.fail(f"{family}: {len(problems)} differing\n\n" + "\n\n".join(problems) + HINT, pytrace=False)


FAST_EVERY = 8
"""The fast tier answers every 8th analytic case of each family (a sixth of the suite's time went to the
whole set); the slow tier answers the other seven in eight, so CI answers each case once."""


def _in_fast_sample(i: int) -> bool:
    return i % FAST_EVERY == 0


def _not_in_fast_sample(i: int) -> bool:
    return i % FAST_EVERY != 0


@pytest.mark.parametrize("family", G.GROUPS["analytic"])
def test_analytic(stored, family):
    """The analytic front end (--params, --model, --hf-config --front-end analytic), the layout search and
    the configurations the planner refuses: every FAST_EVERY-th case of each family."""
    _check(stored, "analytic", family, keep=_in_fast_sample)


@pytest.mark.slow
@pytest.mark.parametrize("family", G.GROUPS["analytic"])
def test_analytic_rest(stored, family):
    """The analytic cases test_analytic leaves to the slow tier."""
    _check(stored, "analytic", family, keep=_not_in_fast_sample)


def _parts(group: str) -> list:
    return [pytest.param(f, k, id=f"{f}-{k + 1}of{len(G.parts(f))}" if len(G.parts(f)) > 1 else f)
            for f in G.GROUPS[group] for k in G.parts(f)]


@pytest.mark.slow
@pytest.mark.parametrize("family, part", _parts("trace"))
def test_trace_and_module(stored, family, part):
    """The trace front end (transformers models on fake tensors) and --module (a torch nn.Module factory)."""
    pytest.importorskip("torch")
    if family == "trace":
        pytest.importorskip("transformers")
    _check(stored, "trace", family, part)


@pytest.mark.slow
@pytest.mark.parametrize("family, part", _parts("records"))
def test_records(stored, family, part):
    """Every committed probe record (benchmarks/results/*.jsonl) re-predicted: by `predict_probe` of its spec
    (the trace for the transformers models, which needs torch + transformers), and the Hugging Face ones
    also by the analytic front end."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    _check(stored, "records", family, part)


COLD_EVERY = 40


def test_answers_do_not_depend_on_what_ran_before(stored):
    """A sample of the analytic cases (every 40th, in reverse order) answered cold, the planner's caches cleared
    before each: the same answers as the families answered in order with warm caches."""
    A = G.api()
    rows = [r for fam in G.GROUPS["analytic"] for r in stored["analytic"][fam]][::COLD_EVERY][::-1]
    by_id = {c["id"]: c for fam in G.GROUPS["analytic"] for c in G.cases(fam)}
    problems = []
    for row in rows:
        A["clear_caches"]()
        r = G.report(row, G.answer(by_id[row["id"]], A))
        if r:
            problems.append(r)
    A["clear_caches"]()
    assert len(rows) >= 25
    if problems:
        pytest.fail("answered cold, differs from the recorded answer\n\n" + "\n\n".join(problems), pytrace=False)


def test_the_golden_set_covers_the_planner(stored):
    """What the brief of the golden set asks it to cover is in it (so a pruned family is noticed)."""
    rows = [r for g in G.GROUPS for fam in stored[g].values() for r in fam]
    analytic = [r for fam in stored["analytic"].values() for r in fam]
    assert len(analytic) >= 1000
    ok = [r for r in analytic if "error" not in r["answer"]]
    planned = {s["name"] for r in ok for s in r["answer"].get("strategies", [])}
    assert planned == set(G.NAMES)
    kw = [r["kwargs"] for r in analytic]

    def seen(key):
        return {str(k.get(key)) for k in kw if k.get(key) is not None}
    assert seen("framework") >= {"deepspeed"} and seen("cpu_offload") >= {"optimizer", "params"}
    assert seen("precision") >= set(G.PRECISIONS) and seen("optimizer") >= set(G.OPTIMIZERS)
    assert seen("activation_checkpointing") >= set(G.CHECKPOINTING)
    assert seen("pp_schedule") >= set(G.PP_SCHEDULES) and seen("checkpoint") >= {"full", "full-offload", "sharded"}
    assert {"2", "4", "8"} <= seen("tp") and {"2", "4"} <= seen("cp") and {"True"} <= seen("sequence_parallel")
    assert seen("model") >= set(G.CATALOG_MODELS) and seen("node") >= set(G.NODES) and seen("gpu") >= set(G.GPUS)
    assert {f"{G.HF_DIR}/{h}" for h in G.HF_CONFIGS} <= seen("hf_config") and seen("params")
    assert {"2", "4", "8"} <= seen("grad_accum") and seen("grad_sync") >= {"last", "every"} and seen("alloc_conf")
    assert {r["call"] for r in rows} == {"plan", "recommend", "cli", "record", "record_analytic"}
    records = stored["records"]["records"]
    assert len(records) == sum(1 for _ in G._results())  # every committed record, none left out
