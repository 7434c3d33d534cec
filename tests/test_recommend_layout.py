"""The parallel layout search of `recommend` (planner/layout.py): the 405B answer re-derived candidate by
candidate, TP inside a node, small models stay data-parallel, fixed flags search nothing, bad input."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from distplan.planner import layout as layout_mod
from distplan.planner.api import evaluate, recommend
from distplan.planner.cli import main
from distplan.planner.config import TrainConfig
from distplan.planner.layout import Layout, _pick
from distplan.planner.pp import PP_STRATEGIES
from distplan.planner.recommend import HEADROOM_FRACTION, SIMPLICITY, TIE_FRACTION
from distplan.planner.strategies import NAMES


def run(*args):
    return CliRunner().invoke(main, list(args))


def flat(text: str) -> str:
    """The output with its line wrapping undone (prose wraps to $COLUMNS)."""
    return " ".join(text.split())


@pytest.fixture(scope="module")
def p405():
    return recommend("llama-3-405b", gpus=256, node="dgx-h100", seq_len=8192)


def _independent_candidates(spec, cluster, base: TrainConfig, batch: int):
    """Every (tp, pp, sp) the search should consider, derived here from the rules, not from layout.py:
    tp divides the node's GPUs, the heads, KV heads and MLP width; pp a power of two dividing gpus / tp
    with pp <= layers; the global batch split into micro-batches of the user's size."""
    g, n = cluster.gpus_per_node, cluster.gpus
    out = []
    for tp in range(1, g + 1):
        if g % tp or spec.heads % tp or spec.kv_heads % tp or spec.ffn_hidden % tp:
            continue
        pp = 1
        while tp * pp <= n and pp <= spec.layers:
            if n % (tp * pp) == 0:
                dp = n // (tp * pp)
                steps = batch // (dp * base.micro_batch)
                for sp in ((False, True) if tp > 1 else (False,)):
                    t = replace(base, tp=tp, pp=pp, sequence_parallel=sp,
                                pp_microbatches=steps if pp > 1 else 1, grad_accum=1 if pp > 1 else steps)
                    out.append(((dp, tp, pp, sp), t))
            pp *= 2
    return out


def _strategies(dp: int, pp: int) -> list[str]:
    if dp == 1:  # (cp = 1 here)
        return ["single"]
    return [s for s in NAMES if s != "single" and (pp == 1 or s in PP_STRATEGIES)]


def _headroom_ok(r) -> bool:
    return r.fits and r.memory.headroom >= HEADROOM_FRACTION * r.memory.gpu_memory_bytes


def test_405b_on_256_h100_picks_a_fitting_layout_and_skips_no_faster_one(p405):
    rec, c = p405.recommendation, p405.cluster
    lay = rec.layout
    assert rec.strategy is not None and lay is not None, rec.reasons
    assert lay.dp * lay.tp * lay.pp == 256
    assert lay.tp <= c.gpus_per_node and c.gpus_per_node % lay.tp == 0
    best = p405.best
    # the picked rank fits: the reserved peak (allocator replay or its margin) plus the process overhead
    assert best.memory.peak_reserved < c.gpu_memory_bytes
    assert best.memory.device_total <= c.gpu_memory_bytes
    assert _headroom_ok(best)
    print(f"405B pick: {lay.words()} {rec.strategy}: step {best.step_time_s:.2f} s, "
          f"device {best.memory.device_total / 2**30:.2f} of {c.gpu_memory_bytes / 2**30:.2f} GiB")

    # Re-derive every candidate independently under the pick's training config (the change included).
    spec = p405.train.model
    base = replace(p405.train, tp=1, pp=1, sequence_parallel=False, pp_microbatches=1, grad_accum=1)
    batch = 256 * 1  # --gpus x --micro-batch x --grad-accum as given
    cands = _independent_candidates(spec, c, base, batch)
    searched = {(x.layout.dp, x.layout.tp, x.layout.pp, x.layout.sequence_parallel) for x in p405.search.candidates}
    assert searched == {k for k, _ in cands}
    fitting = []
    for (dp, tp, pp, sp), t in cands:
        for name in _strategies(dp, pp):
            r = evaluate(t, c, name)
            if r.memory.allocated_fits and _headroom_ok(r):
                fitting.append(((tp * pp, pp, sp, SIMPLICITY.index(name)), (dp, tp, pp, sp), name, r.step_time_s))
    assert fitting, "no candidate fits: the pick cannot be right"
    fastest = min(f[3] for f in fitting)
    assert best.step_time_s <= fastest * (1 + TIE_FRACTION) * (1 + 1e-9), (best.step_time_s, fastest)
    key = (lay.tp * lay.pp, lay.pp, lay.sequence_parallel, SIMPLICITY.index(rec.strategy))
    for k, where, name, step in fitting:
        if step < best.step_time_s:  # a faster fitting candidate was passed over only for a simpler pick
            assert key <= k, (where, name, step, best.step_time_s)
    assert any(where == (lay.dp, lay.tp, lay.pp, lay.sequence_parallel) and name == rec.strategy
               and abs(step - best.step_time_s) <= 1e-9 * step for _, where, name, step in fitting)


def test_405b_needs_the_change_it_names(p405):
    """Nothing fits without activation checkpointing at any layout, and 'selective' is not enough either;
    full checkpointing is the change named (the allocated peak alone rules out every candidate)."""
    rec = p405.recommendation
    assert rec.change and rec.change.startswith("--activation-checkpointing full")
    assert p405.train.checkpointing == "full"
    c = p405.cluster
    for mode in ("none", "selective"):
        base = replace(p405.train, tp=1, pp=1, sequence_parallel=False, pp_microbatches=1, grad_accum=1,
                       checkpointing=mode)
        for (dp, tp, pp, sp), t in _independent_candidates(p405.train.model, c, base, 256):
            for name in _strategies(dp, pp):
                assert not evaluate(t, c, name, comm=False).fits, (mode, dp, tp, pp, sp, name)


def test_405b_reasons_name_layout_links_bubble_headroom_runners_up(p405):
    rec = p405.recommendation
    text = "\n".join(rec.reasons)
    lay = rec.layout
    assert f"dp {lay.dp} x tp {lay.tp} x pp {lay.pp}" in rec.reasons[1]
    assert f"--tp {lay.tp}" in text and f"--pp {lay.pp}" in text
    assert f"tp {lay.tp} stays inside a node" in text and "nvlink4" in text and "ib-ndr" in text
    assert f"pp {lay.pp} spans nodes" in text and "bubble" in text
    from distplan.planner.pp import bubble_fraction
    assert f"{100 * bubble_fraction(lay.pp_schedule, lay.pp, lay.pp_microbatches):.1f}% of compute" in text
    assert "GiB free" in text and "runners-up:" in text
    assert "searched 47 layouts (tp in {1, 2, 4, 8}, pp in {1, 2, 4, 8, 16, 32, 64}, sequence parallel on/off)" in text
    assert "nothing fits" in rec.reasons[0] and "in any of the" in rec.reasons[0]


def test_405b_json_has_the_layout_and_its_groups():
    r = run("recommend", "--model", "llama-3-405b", "--gpus", "256", "--node", "dgx-h100", "--seq-len", "8192",
            "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    rec = d["recommendation"]
    assert {"strategy", "reasons", "max_micro_batch", "change"} <= set(rec)  # the contract's keys kept
    lay = rec["layout"]
    assert {"dp", "tp", "pp", "sequence_parallel", "pp_schedule", "pp_microbatches"} <= set(lay)
    assert lay["dp"] * lay["tp"] * lay["pp"] == 256
    assert set(rec["groups"]) == {"dp", "tp", "pp"}
    for g, tot in rec["groups"].items():
        mine = [c for c in rec["collectives"] if c["group"] == g]
        assert tot["bytes_per_gpu"] == sum(c["bytes_per_gpu"] for c in mine)
        assert tot["calls"] == sum(c["calls"] for c in mine)
    # the plan JSON is the picked layout's: its mesh and its strategies
    mesh = d["inputs"]["mesh"]
    assert (mesh["dp"], mesh["tp"], mesh["pp"]) == (lay["dp"], lay["tp"], lay["pp"])
    pick = next(s for s in d["strategies"] if s["name"] == rec["strategy"])
    assert pick["comm"]["collectives"] == rec["collectives"] and pick["fits"]
    s = rec["search"]
    assert s["layouts"] == len(s["candidates"]) and s["global_batch"] == 256 and s["seconds"] >= 0
    assert s["candidates"][0]["fits"]


def test_405b_search_is_bounded(p405):
    """The search prunes by the closed-form allocated peak: three searches (as given, selective, full)
    of 47 layouts evaluate a few hundred configurations each and take seconds, not minutes."""
    s = p405.search
    assert len(s.candidates) == 47 and s.evaluated < 300 and s.skipped == 0  # the whole space, within budget
    assert s.seconds < 15, s.seconds


def test_budget_bounds_a_huge_search_simplest_first(monkeypatch):
    """A search whose estimated work exceeds the budget evaluates the simplest layouts first and says how
    many it left (a million GPUs with 1,024 per node would otherwise walk thousands of pipelines)."""
    monkeypatch.setattr(layout_mod, "SEARCH_BUDGET_S", 0.05)
    p = recommend(params="7B", gpus=64)
    s = p.search
    assert s.skipped > 0 and s.candidates
    done = sorted(c.layout.simplicity for c in s.candidates)
    assert done[0] == (1, 1, 1, False)  # pure data parallelism is never the one left out
    text = "\n".join(p.recommendation.reasons)
    assert f"left {s.skipped} of the most model-parallel layouts unevaluated" in text


def test_tp_never_leaves_the_node():
    for gpn, gpus in ((4, 16), (8, 64), (2, 8)):
        p = recommend(params="13B", gpus=gpus, gpus_per_node=gpn)
        tps = {c.layout.tp for c in p.search.candidates}
        assert tps and max(tps) <= gpn and all(gpn % t == 0 for t in tps), (gpn, tps)
        assert all(c.layout.dp * c.layout.tp * c.layout.pp == gpus for c in p.search.candidates)
        if p.recommendation.layout is not None:
            assert p.recommendation.layout.tp <= gpn


def test_small_model_stays_data_parallel():
    p = recommend(params="7B", gpus=8)
    lay = p.recommendation.layout
    assert (lay.tp, lay.pp, lay.dp) == (1, 1, 8), p.recommendation.reasons
    assert p.recommendation.strategy in NAMES and p.best.fits
    assert "no tensor parallelism" in "\n".join(p.recommendation.reasons)
    # the search looked at model-parallel layouts too, and they were slower
    assert any(c.layout.tp > 1 for c in p.search.candidates) and any(c.layout.pp > 1 for c in p.search.candidates)


def test_fixed_tp_and_pp_search_nothing(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("searched although --tp and --pp were given")
    monkeypatch.setattr(layout_mod, "search_layouts", boom)
    r = run("recommend", "--model", "llama-3-405b", "--gpus", "256", "--node", "dgx-h100", "--tp", "8", "--pp", "4",
            "--seq-len", "8192", "--json")
    assert r.exit_code == 0, r.output
    rec = json.loads(r.output)["recommendation"]
    assert "search" not in rec
    # the layout given (or the smallest change's, here more stages / sequence parallelism) is reported
    assert rec["layout"]["tp"] == 8 and rec["layout"]["dp"] * rec["layout"]["tp"] * rec["layout"]["pp"] == 256
    p = recommend("llama-3-8b", gpus=16, tp=2, pp=2)
    assert p.search is None and (p.train.tp, p.train.pp) == (2, 2)
    assert p.recommendation.layout == Layout.of(p.train, p.cluster)
    # estimate never searches, and prints the mesh it was given
    r = run("estimate", "--model", "llama-3-405b", "--gpus", "256", "--node", "dgx-h100", "--tp", "8", "--pp", "4",
            "--seq-len", "8192", "--strategy", "zero3")
    assert r.exit_code == 0, r.output
    out = flat(r.output)
    assert "mesh: pp 4 (1f1b, 8 micro-batches" in out and "x dp 8 x tp 8 (inside a node)" in out


def test_one_fixed_dimension_searches_the_other():
    p = recommend("llama-3-70b", gpus=64, node="dgx-h100", tp=8)
    assert {c.layout.tp for c in p.search.candidates} == {8}
    assert len({c.layout.pp for c in p.search.candidates}) > 1
    p = recommend("llama-3-70b", gpus=64, node="dgx-h100", pp=1, sequence_parallel=True)
    assert {c.layout.pp for c in p.search.candidates} == {1}
    assert all(c.layout.sequence_parallel and c.layout.tp > 1 for c in p.search.candidates)


def test_every_layout_runs_the_same_global_batch():
    p = recommend("llama-3-70b", gpus=64, node="dgx-h100", micro_batch=2, grad_accum=2)
    for c in p.search.candidates:
        lay = c.layout
        assert lay.dp * lay.micro_batch * lay.micro_steps == 64 * 2 * 2
        for r in c.results:
            if r.time is not None:  # tokens per step equal too, so step times compare
                assert r.time.tokens_per_s * r.time.step_time_s == pytest.approx(64 * 2 * 2 * 2048)


def test_pipeline_refusals_keep_pp_at_one():
    # a tied embedding cannot be pipelined (pp.check_pp): only pp = 1 is searched, and the reason is kept
    p = recommend("llama-3-8b", gpus=16, tie_embeddings=True)
    assert {c.layout.pp for c in p.search.candidates} == {1}
    assert any("tied embedding" in x for x in p.search.refused)
    # the schedule given is the one every pipelined layout uses
    p = recommend("llama-3-70b", gpus=64, node="dgx-h100", pp_schedule="interleaved-1f1b")
    assert {c.layout.pp_schedule for c in p.search.candidates if c.layout.pp > 1} == {"interleaved-1f1b"}


@pytest.mark.slow
def test_context_parallel_degree_given_is_kept():
    """A --cp given runs in every layout, whose dp is gpus / (tp pp cp), pipelined ones included (CP
    inside each stage, torchtitan's mesh pp, dp, cp, tp)."""
    p = recommend("llama-3-70b", gpus=64, node="dgx-h100", seq_len=32768, cp=4)
    assert p.search.candidates
    for c in p.search.candidates:
        lay = c.layout
        assert lay.cp == 4 and lay.dp * lay.tp * lay.pp * lay.cp == 64
        assert c.train.cp == 4
    assert any(c.layout.pp > 1 for c in p.search.candidates)
    rec = p.recommendation
    assert rec.layout.cp == 4 and rec.to_dict()["layout"]["cp"] == 4
    assert "--cp 4" in rec.reasons[1] or "--cp 4" in "\n".join(rec.reasons)


@pytest.mark.slow
def test_long_sequences_search_context_parallelism():
    """From layout.CP_MIN_SEQ tokens the search tries cp in the powers of two that split the sequence
    (with pipeline stages too); Llama-3-8B at 128K tokens on 16 H100s needs it (one GPU cannot hold a
    sequence's activations even with full checkpointing at tp 8 alone)."""
    from distplan.planner.layout import CP_MIN_SEQ, cp_degrees
    p = recommend("llama-3-8b", gpus=16, node="dgx-h100", seq_len=131072)
    cps = {c.layout.cp for c in p.search.candidates}
    assert cps == {1, 2, 4, 8, 16}
    assert any(c.layout.pp > 1 for c in p.search.candidates if c.layout.cp > 1)
    rec = p.recommendation
    assert rec.strategy and rec.layout.cp > 1
    cand, result = p.search.pick
    assert cand.layout.cp == rec.layout.cp and result.fits
    # short sequences: cp = 1 only
    short = recommend("llama-3-8b", gpus=16, node="dgx-h100", seq_len=8192)
    assert {c.layout.cp for c in short.search.candidates} == {1}
    t = short.train
    from dataclasses import replace
    assert cp_degrees(replace(t, seq_len=CP_MIN_SEQ), 16) == [1, 2, 4, 8, 16]
    assert cp_degrees(replace(t, seq_len=CP_MIN_SEQ, attention="eager"), 16) == [1]


def test_nothing_fits_anywhere_names_the_closest_layout():
    r = run("recommend", "--model", "llama-3-405b", "--gpus", "8", "--node", "dgx-h100")
    assert r.exit_code == 0, r.output
    out = flat(r.output)
    assert "recommendation: nothing fits" in out
    assert "no layout fits in 79.65 GiB per GPU even with --activation-checkpointing full" in out
    assert "the closest, dp " in out


def test_pick_rule_simpler_layout_wins_ties():
    """Within TIE_FRACTION of the fastest, the smaller tp x pp wins; beyond it, the faster."""
    def row(tp, pp, step, name="zero3", fits=True):
        mem = SimpleNamespace(allocated_fits=fits, fits=fits, headroom=40 * 2**30, gpu_memory_bytes=80 * 2**30)
        r = SimpleNamespace(memory=mem, time=object(), step_time_s=step, name=name, fits=fits, fits_cleanly=fits)
        cand = SimpleNamespace(layout=Layout(64 // (tp * pp), tp, pp), nodes=8)
        return cand, r
    fast = row(8, 4, 10.0)
    near = row(8, 1, 10.0 * (1 + TIE_FRACTION / 2))
    assert _pick([fast, near], 8) is near
    far = row(8, 1, 10.0 * (1 + 2 * TIE_FRACTION))
    assert _pick([fast, far], 8) is fast
    assert _pick([row(8, 4, 5.0, fits=False), far], 8) is far
    assert _pick([row(1, 1, 5.0, fits=False)], 8) is None


@pytest.mark.parametrize("args, needle", [
    (["--tp", "3"], "--tp=3"),
    (["--tp", "16"], "--tp=16"),
    (["--pp", "3"], "--pp=3"),
    (["--pp", "0"], "--pp=0"),
    (["--pp-microbatches", "4"], "--pp-microbatches=4: needs --pp > 1"),
    (["--tp", "1", "--sequence-parallel"], "--sequence-parallel: needs --tp > 1"),
    (["--pp-schedule", "zb"], "--pp-schedule"),
    (["--gpus", "0"], "--gpus"),
])
def test_bad_inputs_one_line_exit_2(args, needle):
    r = run("recommend", "--model", "llama-3-8b", "--gpus", "16", *args)
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert "\n" not in line and needle in line and "Traceback" not in line, line


def _versus(what, pick, other, rule="simplicity"):
    lay = Layout(dp=8, tp=2, pp=1, sequence_parallel=True).to_dict()
    return {"layout": lay, "strategy": "zero3", "step_time_s": 1.0, "headroom_bytes": 2**30,
            "pick_headroom_bytes": 8 * 2**30, "rule": rule, "what": what, "pick": pick, "other": other,
            "headroom": 0.05}


def test_versus_fastest_words_follow_the_comparison():
    """The reason a layout beat a faster one is worded from the comparison's own figures, in the direction
    they go (issue 61: "fewer model-parallel GPUs (2 vs 1)" for the layout with more)."""
    from distplan.planner.layout import versus_fastest_words
    gpu = 80 * 2**30
    assert versus_fastest_words(_versus("pipeline stages (pp)", 1, 2), gpu).endswith("fewer pipeline stages (pp): 1 vs 2")
    assert versus_fastest_words(_versus("model-parallel GPUs (tp x pp x cp)", 2, 1), gpu).endswith(
        "more model-parallel GPUs (tp x pp x cp): 2 vs 1")
    assert versus_fastest_words(_versus("sequence parallelism", False, True), gpu).endswith("no sequence parallelism")
    assert versus_fastest_words(_versus("strategy", "ddp", "zero3"), gpu).endswith("with ddp instead of zero3")
    words = versus_fastest_words(_versus(None, None, None, rule="headroom"), gpu)
    assert "leaves 1.00 GiB free (1.2%), under the 5% headroom this pick keeps (8.00 GiB)" in words


def test_a_layout_chosen_for_headroom_says_so():
    """Llama-3-8B, 16 H100s, 8K tokens (issue 61): the fastest layout that fits leaves under 5% free; the pick
    keeps it, and the reason (data and words) is the headroom, with the figures of the two results."""
    p = recommend("llama-3-8b", gpus=16, node="dgx-h100", seq_len=8192)
    v = p.to_dict()["recommendation"]["search"]["versus_fastest"]
    gpu = p.cluster.gpu_memory_bytes
    best = p.best
    assert v is not None and v["rule"] == "headroom"
    assert v["headroom_bytes"] < HEADROOM_FRACTION * gpu <= best.memory.headroom == v["pick_headroom_bytes"]
    assert v["step_time_s"] < best.step_time_s
    assert any(f"leaves {v['headroom_bytes'] / 2**30:.2f} GiB free" in r for r in p.recommendation.reasons)
    assert not any("fewer model-parallel" in r for r in p.recommendation.reasons)


@pytest.mark.parametrize("flags", [["--tp", "1", "--pp", "1"], []], ids=["strategy", "layout"])
@pytest.mark.parametrize("headroom, fraction", [("5%", 0.05), ("0.3", 0.3), ("50%", 0.5)])
def test_headroom_is_kept_or_warned(flags, headroom, fraction):
    """Issue 61 item 2: the pick leaves --headroom free, or the output (text and JSON) carries a warning line
    saying that nothing that fits does."""
    args = ["recommend", "--model", "llama-3-8b", "--gpus", "8", "--headroom", headroom, *flags]
    r = run(*args, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    rec = d["recommendation"]
    pick = next(s for s in d["strategies"] if s["name"] == rec["strategy"])
    free = pick["memory"]["device_total"]
    gpu = d["inputs"]["cluster"]["gpu_memory_bytes"]
    kept = gpu - free >= fraction * gpu
    assert (rec["warning"] is None) == kept, (rec["warning"], (gpu - free) / gpu)
    text = flat(run(*args).output)
    assert ("warning: no " in text) == (not kept)
    if not kept:
        assert f"{rec['strategy']}, the pick among those that fit" in rec["warning"]


def test_headroom_from_the_api():
    from distplan.planner.api import plan
    strict = plan("llama-3-8b", gpus=8, headroom=0.5, strategies=["zero2"]).recommendation
    assert strict.strategy == "zero2" and "50% headroom" in strict.warning
    assert plan("llama-3-8b", gpus=8, headroom="5%", strategies=["zero2"]).recommendation.warning is None


@pytest.mark.parametrize("value", ["5", "60%", "-0.1", "abc", "nan", "1e400"])
def test_bad_headroom_is_one_line(value):
    r = run("recommend", "--model", "llama-3-8b", "--gpus", "8", "--headroom", value)
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert "\n" not in line and "--headroom" in line and value in line and "5%" in line, line
    from distplan.planner.api import plan
    with pytest.raises(ValueError, match="--headroom"):
        plan("llama-3-8b", gpus=8, headroom=value)


@pytest.mark.parametrize("kw", [
    dict(model="llama-3-8b", gpus=8, gpu="h100"),  # fits as given
    dict(model="llama-3-8b", gpus=8, gpu="h100", micro_batch=8),  # a smaller micro-batch
    dict(model="llama-3-8b", gpus=8, gpu_mem=40, micro_batch=16, activation_checkpointing="full"),  # CPU offload
    dict(model="mistral-7b", gpus=16, gpu="h100", checkpoint="full"),  # the save does not fit: a sharded one
    dict(params="7B", gpus=4, gpu_mem=24, seq_len=8192),  # no change tried fits
], ids=["fits", "micro-batch", "offload", "checkpoint", "nothing"])
def test_pick_is_recommends_strategy_and_change(kw):
    """`recommend.pick` (what a sweep marks) gives the strategy and change `recommend` gives, without its reasons."""
    from distplan.planner.api import plan
    from distplan.planner.recommend import pick
    from distplan.planner.recommend import recommend as recommend_plan
    got = pick(plan(**kw))
    rec = recommend_plan(plan(**kw))
    assert got == (rec.strategy, rec.change)
    assert (got[1] is None) == (got[0] is not None and rec.changed_plan is None)
