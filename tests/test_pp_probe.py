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
    # FSDP2 stages as torchtitan applies them with PP (reshard_after_forward off): parameters all-gathered
    # once per step, gradients accumulated unsharded, one reduce-scatter per unit at the last micro-batch
    ("llama8-pp2-dp2-zero3-1f1b-m4", LLAMA_8L, 2, "1f1b", 4, "none", 2, "zero3"),
    # ZeRO-1: DDP and ZeroRedundancyOptimizer over the stage's dp ranks (the parameters' broadcast after the step)
    ("llama8-pp2-dp2-zero1-1f1b-m4", LLAMA_8L, 2, "1f1b", 4, "none", 2, "zero1"),
    ("llama8-pp2-dp2-zero2-gpipe-m4-full", LLAMA_8L, 2, "gpipe", 4, "full", 2, "zero2"),
]


def spec_of(name, model, pp, sched, M, ckpt, dp=1, strategy=None, cp=1) -> dict:
    return {"id": name, "model": model, "train": {"seq_len": 80, "micro_batch": 2, "checkpointing": ckpt},
            "pp": pp, "dp": dp, "cp": cp, "strategy": strategy or ("ddp" if dp > 1 else "single"),
            "schedule": sched, "microbatches": M, "steps": 1, "warmup_steps": 2 if dp * cp > 1 else 1}


def _sorted(colls):
    return sorted(colls, key=lambda c: (c["op"], c["group_size"], c["message_bytes"], c["dtype"]))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_pp_probe_matches_stage_walk(case):
    spec = spec_of(*case)
    world = spec["pp"] * spec["dp"] * spec["cp"]
    result = run_pp_probe(spec)
    assert result["status"] == "ok", result.get("hung_stacks") or result  # a hang: where each rank waited
    predicted = predict(spec)
    assert len(result["ranks"]) == world
    # ZeRO-1: the planner predicts the most loaded rank of each stage's partition (ZeroRedundancyOptimizer's
    # greedy one); the other ranks hold less optimizer state, so their components are not compared
    most = {}
    for meas in result["ranks"]:
        k = meas["stage"]
        if k not in most or meas["components"]["optimizer"] > most[k]["components"]["optimizer"]:
            most[k] = meas
    for meas, pred in zip(result["ranks"], predicted):
        err = (pred["peak_bytes"] - meas["peak_bytes"]) / meas["peak_bytes"]
        detail = f"rank {meas['rank']}: predicted {pred['peak_bytes']:,} measured {meas['peak_bytes']:,} ({err:+.4%})"
        assert abs(err) < 0.05, detail
        assert _sorted(meas["collectives"]) == _sorted(pred["collectives"]), detail
        if spec["strategy"] == "zero1" and most[meas["stage"]] is not meas:
            continue
        for k in COMPONENTS:
            assert abs(pred["components"][k] - meas["components"][k]) <= 4096, (
                f"{detail}; {k}: predicted {pred['components'][k]:,} measured {meas['components'][k]:,}")
        assert pred["peak_phase"] == meas["peak_phase"], detail


# Interleaved 1F1B (`ScheduleInterleaved1F1B`, 2 stages per rank), walked in the schedule's own action
# order (`pp.interleaved_actions`, checked against torch's `_calculate_single_rank_operations` below),
# every sent tensor alive until the step ends. Measured per rank on 2026-11-24: -1.3% to +3.6% (the
# previous in-flight estimate: -7.0% to +8.3%). Components are not asserted: the walk's instants are the
# chunk's last layer's MLP backward (two), not 1F1B's whole set (no first-layer or loss instant).
INTERLEAVED = [
    ("llama8-pp2-il-m4", LLAMA_8L, 2, "interleaved-1f1b", 4, "none"),
    ("llama8-pp2-il-m8", LLAMA_8L, 2, "interleaved-1f1b", 8, "none"),
    ("llama8-pp4-il-m4", LLAMA_8L, 4, "interleaved-1f1b", 4, "none"),
    ("llama8-pp2-il-m4-full", LLAMA_8L, 2, "interleaved-1f1b", 4, "full"),
    # FSDP2 on each of the rank's stages (DDP stops in torch's reducer under this schedule and GPipe:
    # pp_probe.DDP_SCHEDULE_ERROR); with context parallelism too
    ("llama8-pp2-dp2-zero3-il-m4", LLAMA_8L, 2, "interleaved-1f1b", 4, "none", 2, "zero3"),
    ("llama8-pp2-cp2-zero3-il-m4-full", LLAMA_8L, 2, "interleaved-1f1b", 4, "full", 1, "zero3", 2),
    # the zero-bubble schedules (input and weight gradients in separate passes; without checkpointing,
    # pp.check_pp): measured 2026-11-24 within -3.4% / +4.8% per rank
    ("llama8-pp2-zbv-m4", LLAMA_8L, 2, "zbv", 4, "none"),
    ("llama8-pp2-izb-m8", LLAMA_8L, 2, "interleaved-zb", 8, "none"),
    ("gelu10-pp4-zbv-m8", GELU_10L, 4, "zbv", 8, "none"),
    ("gelu10-pp4-izb-m8", GELU_10L, 4, "interleaved-zb", 8, "none"),
    ("llama8-pp2-dp2-zero3-zbv-m4", LLAMA_8L, 2, "zbv", 4, "none", 2, "zero3"),
    ("llama8-pp2-cp2-zero3-zbv-m4", LLAMA_8L, 2, "zbv", 4, "none", 1, "zero3", 2),
]


# Context parallelism inside the stages (ring attention over each stage's cp ranks, the strategy over its
# dp x cp ranks): peaks within 5% and collectives exact (ring, data-parallel, sends); components are
# not asserted (the ring backward's transient is a fit within -7.7%..+3.9%, planner/cp.py).
CP_CASES = [
    ("llama8-pp2-cp2-ddp-1f1b-m4", LLAMA_8L, 2, "1f1b", 4, "none", 1, "ddp", 2),
    ("llama8-pp2-cp2-zero3-gpipe-m4-full", LLAMA_8L, 2, "gpipe", 4, "full", 1, "zero3", 2),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", INTERLEAVED + CP_CASES, ids=[c[0] for c in INTERLEAVED + CP_CASES])
def test_peak_and_collectives_match_stage_walk(case):
    """Interleaved 1F1B, the zero-bubble schedules and CP inside the stages: every rank's peak within 5%,
    its collectives exact (with cp > 1 the ring's all-to-alls among them)."""
    spec = spec_of(*case)
    result = run_pp_probe(spec)
    assert result["status"] == "ok", result.get("hung_stacks") or result  # a hang: where each rank waited
    predicted = predict(spec)
    assert len(result["ranks"]) == len(predicted) == spec["pp"] * spec["dp"] * spec["cp"]
    for meas, pred in zip(result["ranks"], predicted):
        assert _sorted(meas["collectives"]) == _sorted(pred["collectives"]), meas["rank"]
        assert any(c["op"] == "all_to_all" for c in meas["collectives"]) == (spec["cp"] > 1)  # the ring ran
    errors = [(p["peak_bytes"] - m["peak_bytes"]) / m["peak_bytes"] for m, p in zip(result["ranks"], predicted)]
    print(case[0], [f"{e:+.2%}" for e in errors])
    assert max(map(abs, errors)) < 0.05, errors


def test_zero_bubble_order_is_torchs():
    """`pp.zero_bubble_actions` against `ScheduleInterleavedZeroBubble` / `ScheduleZBVZeroBubble`'s own
    `_calculate_single_rank_operations` (the bubbles it pads with removed: a rank's order is unchanged)."""
    from torch.distributed.pipelining.schedules import (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble,
                                                        _ComputationType)

    from distplan.planner.pp import rank_stage_ids, zero_bubble_actions
    kind = {_ComputationType.FORWARD: "F", _ComputationType.BACKWARD_INPUT: "I",
            _ComputationType.BACKWARD_WEIGHT: "W"}
    checked = 0
    for pp in (2, 4, 8):
        for M in sorted({pp, 2 * pp - 1, 2 * pp, 3 * pp, 4 * pp}):
            for name, cls in (("interleaved-zb", ScheduleInterleavedZeroBubble), ("zbv", ScheduleZBVZeroBubble)):
                sched = cls.__new__(cls)  # the order needs no stages
                sched.pp_group_size, sched.n_local_stages, sched._n_microbatches, sched.num_stages = pp, 2, M, 2 * pp
                sched.number_of_rounds = max(1, M // pp)
                sched.microbatches_per_round = M // sched.number_of_rounds
                if name == "interleaved-zb" and M % sched.number_of_rounds:
                    continue  # the schedule refuses it (and so does pp.check_pp)
                for rank in range(pp):
                    sids = rank_stage_ids(name, pp, rank)
                    ops = [a for a in sched._calculate_single_rank_operations(rank) if a is not None]
                    theirs = [(sids.index(a.stage_index), kind[a.computation_type], a.microbatch_index) for a in ops]
                    assert zero_bubble_actions(name, pp, M, rank) == theirs, (name, pp, M, rank)
                    checked += 1
    assert checked > 100


def test_interleaved_order_is_torchs():
    """`pp.interleaved_actions` against `ScheduleInterleaved1F1B._calculate_single_rank_operations`."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    from distplan.planner.pp import interleaved_actions
    for pp in (2, 4, 8):
        for M in (pp, 2 * pp, 3 * pp, 4 * pp):
            for rank in range(pp):
                sched = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)  # the order needs no stages
                sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = pp, 2, M
                sched.number_of_rounds = max(1, M // pp)
                sched.microbatches_per_round = M // sched.number_of_rounds
                ops = [a for a in sched._calculate_single_rank_operations(rank) if a is not None]
                theirs = [((a.stage_index - rank) // pp, "F" if a.computation_type == _ComputationType.FORWARD
                           else "B", a.microbatch_index) for a in ops]
                assert interleaved_actions(pp, M, rank, 2) == theirs, (pp, M, rank)
