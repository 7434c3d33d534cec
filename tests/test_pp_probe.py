"""Pipeline-parallel probes on gloo (issue 13): the reference decoder split into stages and run by
`torch.distributed.pipelining` (validate/pp_probe.py), one process per stage, against the planner's
stage walk (planner/pp.py). Each probe takes 10-30 s on 2 cores, so they are slow-marked.

What is asserted per rank: the peak of live tensor bytes within 5% of the prediction (the issue's
tolerance; measured: within 0.001%), every component within 4 KiB (what the walk leaves out are
scalars: AdamW's per-parameter `step` tensors and the schedule's per-micro-batch loss values, a few
hundred bytes), and the collectives exact (calls, bytes, dtype): the point-to-point sends and receives,
and with DDP the bucket all-reduces of the last micro-batch.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from distplan.planner.memory import COMPONENTS  # noqa: E402
from distplan.validate.pp_probe import predict, run_pp_probe  # noqa: E402

LLAMA_8L = {"name": "pp-llama-8l", "layers": 8, "hidden": 128, "heads": 4, "kv_heads": 2, "ffn_hidden": 352,
            "vocab": 1024}
# an uneven split (10 layers over 4 stages: 3, 3, 2, 2), GELU MLP, LayerNorm, MHA
GELU_10L = {"name": "pp-gelu-10l", "layers": 10, "hidden": 96, "heads": 4, "kv_heads": 4, "ffn_hidden": 384,
            "vocab": 768, "mlp": "gelu", "norm": "layernorm"}

# (id, model, stages, schedule, micro-batches, checkpointing); 2 x 80 tokens per micro-batch, so that
# the tokens (160) differ from the width (128, 96) and a weight gradient (h x f) from an activation
# gradient (n x f)
CASES = [
    ("llama8-pp2-1f1b-m4", LLAMA_8L, 2, "1f1b", 4, "none"),
    ("llama8-pp2-gpipe-m4", LLAMA_8L, 2, "gpipe", 4, "none"),
    ("llama8-pp2-1f1b-m2", LLAMA_8L, 2, "1f1b", 2, "none"),
    ("llama8-pp2-gpipe-m4-full", LLAMA_8L, 2, "gpipe", 4, "full"),
    ("gelu10-pp4-1f1b-m6", GELU_10L, 4, "1f1b", 6, "none"),
    ("gelu10-pp4-gpipe-m5", GELU_10L, 4, "gpipe", 5, "none"),
    ("gelu10-pp4-1f1b-m5-full", GELU_10L, 4, "1f1b", 5, "full"),
    # pp 2 x dp 2 (4 processes): each stage under DDP over its dp group; the bucket all-reduces counted
    # too. (GPipe with DDP stops inside PyTorch: reducer.cpp's rebuilt_param_indices assert, torch 2.13.)
    ("llama8-pp2-dp2-ddp-1f1b-m4", LLAMA_8L, 2, "1f1b", 4, "none", 2),
]


def spec_of(name, model, pp, sched, M, ckpt, dp=1) -> dict:
    return {"id": name, "model": model, "train": {"seq_len": 80, "micro_batch": 2, "checkpointing": ckpt},
            "pp": pp, "dp": dp, "strategy": "ddp" if dp > 1 else "single", "schedule": sched,
            "microbatches": M, "steps": 1, "warmup_steps": 2 if dp > 1 else 1}


def _sorted(colls):
    return sorted(colls, key=lambda c: (c["op"], c["group_size"], c["message_bytes"], c["dtype"]))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_pp_probe_matches_stage_walk(case):
    spec = spec_of(*case)
    world = spec["pp"] * spec["dp"]
    result = run_pp_probe(spec)
    assert result["status"] == "ok", result
    predicted = predict(spec)
    assert len(result["ranks"]) == world
    for meas, pred in zip(result["ranks"], predicted):
        err = (pred["peak_bytes"] - meas["peak_bytes"]) / meas["peak_bytes"]
        detail = f"rank {meas['rank']}: predicted {pred['peak_bytes']:,} measured {meas['peak_bytes']:,} ({err:+.4%})"
        assert abs(err) < 0.05, detail
        for k in COMPONENTS:
            assert abs(pred["components"][k] - meas["components"][k]) <= 4096, (
                f"{detail}; {k}: predicted {pred['components'][k]:,} measured {meas['components'][k]:,}")
        assert pred["peak_phase"] == meas["peak_phase"], detail
        assert _sorted(meas["collectives"]) == _sorted(pred["collectives"]), detail


# Interleaved 1F1B (`ScheduleInterleaved1F1B`, 2 stages per rank), probed for the first time on
# 2026-11-24: sends and receives exact, but the walk's count of chunks in flight (`pp.in_flight`: the
# warm-up ops + 1, each chunk half a rank's layers) is an estimate, not the schedule's action order.
# Measured per rank: pp 2, M 4: -2.0% / -2.5% (within the 5%); pp 2, M 8: -5.8% / -7.0%; pp 4,
# M 4: +4.7% to +8.3%. The walk should follow `_get_1f1b_rank_ops`' order, as it does 1F1B's.
INTERLEAVED = [("llama8-pp2-il-m4", LLAMA_8L, 2, "interleaved-1f1b", 4, "none")]
INTERLEAVED_GAP = [
    ("llama8-pp2-il-m8", LLAMA_8L, 2, "interleaved-1f1b", 8, "none"),
    ("llama8-pp4-il-m4", LLAMA_8L, 4, "interleaved-1f1b", 4, "none"),
]


def _interleaved(case):
    spec = spec_of(*case)
    result = run_pp_probe(spec)
    assert result["status"] == "ok", result
    predicted = predict(spec)
    for meas, pred in zip(result["ranks"], predicted):
        assert _sorted(meas["collectives"]) == _sorted(pred["collectives"]), meas["rank"]
    errors = [(p["peak_bytes"] - m["peak_bytes"]) / m["peak_bytes"] for m, p in zip(result["ranks"], predicted)]
    print(case[0], [f"{e:+.2%}" for e in errors])
    assert max(map(abs, errors)) < 0.05, errors


@pytest.mark.slow
@pytest.mark.parametrize("case", INTERLEAVED, ids=[c[0] for c in INTERLEAVED])
def test_interleaved_probe_matches_stage_walk(case):
    _interleaved(case)


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="interleaved 1F1B's walk counts chunks in flight from the warm-up "
                                       "ops: -7.0% (pp 2, M 8) and +8.3% (pp 4, M 4) on some ranks (2026-11-24)")
@pytest.mark.parametrize("case", INTERLEAVED_GAP, ids=[c[0] for c in INTERLEAVED_GAP])
def test_interleaved_probe_gap(case):
    _interleaved(case)
