"""A model whose root (embedding + untied LM head) outweighs its blocks, as in Llama-3 (128K vocabulary)
and Qwen2.5 (152K): Qwen2, 4 layers, width 512, vocabulary 65,536, untied, rank 0 of 8 on the fake
process group (`benchmarks/results/cpu-*-hf-vocab64k.jsonl`, probed with `distplan validate --hf-config
examples/hf/qwen2-vocab64k-4l.json`). Here the peak is at the root's own instants: FSDP1's root
post-backward (reshard, reduce_dtype cast, reduce-scatter), FSDP2's root reduce and the first block's
pre-forward copy-out next to the root's all-gather output. Both front ends re-predict the records."""

from __future__ import annotations

import glob
import json
import os

import pytest

from distplan.planner.api import predict_probe
from distplan.validate.results import record_spec
from test_analytic_on_hf import _analytic_peak  # the record's config through the formulas

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "cpu-*-hf-vocab64k.jsonl")))
STRATEGIES = {"ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp-grad-op", "fsdp-no-shard"}


def records():
    out = []
    for path in FILES:
        with open(path) as f:
            out += [json.loads(line) for line in f if line.strip()]
    return out


def test_records_cover_the_matrix():
    recs = records()
    assert {r["inputs"]["strategy"] for r in recs} == STRATEGIES
    combos = {(r["inputs"]["train"]["precision"], r["inputs"]["train"]["checkpointing"]) for r in recs}
    assert combos == {(p, c) for p in ("fp32", "bf16-mixed") for c in ("none", "full")}
    assert all(r["status"] == "ok" and r["inputs"]["world_size"] == 8 for r in recs)




def test_analytic_front_end_repredicts_the_peaks():
    """The decoder formulas (what --params/--model/--front-end analytic use) at the root's instants."""
    errors = {r["id"]: _analytic_peak(r) / r["measurement"]["memory"]["peak_allocated"] - 1 for r in records()}
    bad = {i: round(100 * e, 2) for i, e in errors.items() if abs(e) > 0.01}
    assert not bad, bad


@pytest.mark.slow
def test_trace_front_end_repredicts_the_peaks_and_collectives():
    pytest.importorskip("transformers")
    from distplan.validate.compare import compare
    cwd = os.getcwd()
    os.chdir(ROOT)  # the records name examples/hf/... relative to the repository
    try:
        results = [(r, compare(predict_probe(record_spec(r)), r["measurement"])) for r in records()]
    finally:
        os.chdir(cwd)
    bad = {r["id"]: round(100 * c["peak"]["error"], 2) for r, c in results if abs(c["peak"]["error"]) > 0.01}
    assert not bad, bad
    assert all(c["collectives"]["exact"] for _, c in results)
