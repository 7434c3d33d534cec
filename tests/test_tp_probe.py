"""The tensor-parallel activation and collective formulas against PyTorch itself: one reference block
split by `parallelize_module` (torchtitan's plan) on the fake process group, rank 0 of tp ranks, CPU
(`validate/tp_probe.py`): saved bytes exact, the TP collectives of forward and backward exact; and the
whole decoder (vocabulary-sharded embedding and LM head, loss parallel): saved bytes exact."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from distplan.planner.activations import activations_in, block_linears, block_saved  # noqa: E402
from distplan.planner.config import TrainConfig  # noqa: E402
from distplan.planner.model import ModelSpec  # noqa: E402
from distplan.planner.tp import tp_raw_schedule  # noqa: E402

LLAMA = {"name": "llama-gqa", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 4, "ffn_hidden": 96, "vocab": 100}
GPT = {"name": "gpt2-mha", "layers": 2, "hidden": 48, "heads": 4, "kv_heads": 4, "ffn_hidden": 192, "vocab": 120,
       "max_positions": 64, "mlp": "gelu", "norm": "layernorm", "position": "learned", "linear_bias": True}
FUNCOL = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
          "reduce_scatter_tensor": "reduce_scatter"}


def _cases(t, full):
    llama = dict(LLAMA, kv_heads=2) if t == 2 else LLAMA  # GQA where tp divides kv_heads
    if full:
        combos = itertools.product((llama, GPT), ("bf16", "fp32", "bf16-mixed"), ("sdpa", "eager"), (False, True))
    else:
        combos = [(llama, "bf16", "sdpa", False), (llama, "bf16", "sdpa", True),
                  (GPT, "fp32", "eager", False), (GPT, "fp32", "eager", True), (llama, "bf16-mixed", "sdpa", True)]
    blocks = [{"model": m, "train": {"seq_len": 16, "micro_batch": 2, "precision": p, "attention": a},
               "tp": t, "sequence_parallel": sp} for m, p, a, sp in combos]
    # the whole decoder (RoPE), embedding and loss-parallel head included
    whole = [{"model": llama, "train": {"seq_len": 16, "micro_batch": 2, "precision": p, "attention": "sdpa"},
              "tp": t, "sequence_parallel": sp, "whole_model": True}
             for p, sp in ((("bf16", False), ("bf16", True), ("fp32", False), ("fp32", True)) if full
                           else (("bf16", False), ("bf16", True)))]
    return blocks + whole


def _probe(cases, tmp_path):
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases))
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-m", "distplan.validate.tp_probe", "--cases", str(path)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def _check(cases, results):
    assert len(results) == len(cases)
    for c, r in zip(cases, results):
        tr = c["train"]
        train = TrainConfig(ModelSpec(**c["model"]), seq_len=tr["seq_len"], micro_batch=tr["micro_batch"],
                            precision=tr["precision"], attention=tr["attention"], tp=c["tp"],
                            sequence_parallel=c["sequence_parallel"])
        regime = {"bf16": "lowp", "fp32": "fp32", "bf16-mixed": "autocast"}[tr["precision"]]
        label = f"{c['model']['name']}/{tr['precision']}/{tr['attention']}/tp{c['tp']}/sp={c['sequence_parallel']}"
        if c.get("whole_model"):
            # + cross_entropy's scalar total_weight (as tests/test_activations.py)
            assert activations_in(train, regime, "cpu").total + 4 == r["saved_bytes"], label
            continue
        # autocast (fp32 parameters): its cache keeps a 16-bit copy of each of the rank's Linear weights
        # for backward (`activations.weight_cache`, not part of `block_saved`)
        cache = 2 * sum(i * o for i, o, _ in block_linears(train.model, train.tp)) if regime == "autocast" else 0
        assert block_saved(train, regime, "cpu") + cache == r["saved_bytes"], label
        # per block, per micro-step: the schedule's "tp_block" calls / layers
        family = "fsdp2" if regime == "lowp" else "ddp"
        want = {"forward": {}, "backward": {}}
        for op, _, _, _, _, calls, phase, unit in tp_raw_schedule(train, family):
            if unit == "tp_block":
                want[phase][op] = want[phase].get(op, 0) + calls // train.model.layers
        for phase in ("forward", "backward"):
            got = {FUNCOL[k]: v for k, v in r[phase].items()}
            assert got == want[phase], (label, phase)


@pytest.mark.slow
@pytest.mark.newest
def test_tp2_block_matches_probe(tmp_path):
    cases = _cases(2, full=False)
    _check(cases, _probe(cases, tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("t", [2, 4])
def test_tp_block_matrix_matches_probe(t, tmp_path):
    cases = _cases(t, full=True)
    _check(cases, _probe(cases, tmp_path))
