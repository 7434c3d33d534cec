"""Pipeline parallelism in the analytic planner (issue 13): stage split, schedules, per-stage memory,
point-to-point traffic, bubble, CLI/API/JSON. The probes that check the walk against
`torch.distributed.pipelining` on gloo are in tests/test_pp_probe.py (slow)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

from distplan.planner import plan
from distplan.planner.cli import main
from distplan.planner.config import Cluster, TrainConfig
from distplan.planner.memory import COMPONENTS, estimate_memory
from distplan.planner.model import ModelSpec, tp_rank_spec
from distplan.planner.pp import (PP_STRATEGIES, boundary_bytes, bubble_fraction, in_flight, p2p_counts,
                                 stage_actions, stage_layers, stage_memory, stage_spec)

TINY = ModelSpec(name="pp-tiny", layers=10, hidden=128, heads=4, kv_heads=2, ffn_hidden=352, vocab=1024)


def _run(*args):
    return CliRunner().invoke(main, list(args))


def _train(pp=2, sched="1f1b", M=4, **kw):
    return TrainConfig(TINY, seq_len=64, micro_batch=2, precision=kw.pop("precision", "fp32"), pp=pp,
                       pp_schedule=sched, pp_microbatches=M, **kw)


# -- stages and schedules --------------------------------------------------------------------------

@pytest.mark.parametrize("L, p", [(8, 2), (10, 4), (126, 4), (126, 8), (7, 7), (80, 3)])
def test_stage_split_is_even_first_stages_longer(L, p):
    sizes = [stage_layers(L, p, s) for s in range(p)]
    assert sum(sizes) == L
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("tp", [1, 2])
def test_stage_parameters_add_up_to_the_model(tp):
    """Every parameter on exactly one stage: the embedding on the first, norm + head on the last."""
    p = 4
    specs = [stage_spec(TINY, tp, stage_layers(TINY.layers, p, s), s == 0, s == p - 1) for s in range(p)]
    assert sum(s.param_count() for s in specs) == tp_rank_spec(TINY, tp).param_count()
    emb = -(-TINY.vocab // tp) * TINY.hidden
    block = tp_rank_spec(TINY, tp).block_param_count()
    assert specs[0].param_count() == emb + 3 * block
    assert specs[1].param_count() == 3 * block
    assert specs[3].param_count() == 2 * block + TINY.hidden + emb  # final norm + LM head


@pytest.mark.parametrize("sched", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, M", [(2, 4), (4, 4), (4, 9), (8, 8)])
def test_in_flight_is_what_the_action_order_holds(sched, p, M):
    for s in range(p):
        f = b = most = 0
        for kind, _ in stage_actions(sched, p, M, s):
            if kind == "F":
                f += 1
            else:
                most = max(most, f - b)
                b += 1
        assert f == b == M
        assert most == in_flight(sched, p, M, s)
    assert in_flight("1f1b", p, M, 0) == min(M, p)
    assert in_flight("gpipe", p, M, p - 1) == M


def test_interleaved_in_flight_follows_torch_warmup_ops():
    from torch.distributed.pipelining.schedules import _get_warmup_ops
    for p, M in [(2, 4), (4, 8), (4, 4), (8, 16)]:
        rounds = max(1, M // p)
        for r in range(p):
            warm = _get_warmup_ops(r, 2, M // rounds, p, M, multiply_factor=2)
            assert in_flight("interleaved-1f1b", p, M, r) == min(warm + 1, 2 * M)


def test_bubble_fraction_papers():
    # GPipe (arXiv:1811.06965 §2.2) and 1F1B (arXiv:2104.04473 §2.2.1): (p-1)/m; interleaved: /v
    assert bubble_fraction("gpipe", 4, 8) == pytest.approx(3 / 8)
    assert bubble_fraction("1f1b", 8, 32) == pytest.approx(7 / 32)
    assert bubble_fraction("interleaved-1f1b", 4, 8) == pytest.approx(3 / 16)


# -- memory ----------------------------------------------------------------------------------------

def test_gpipe_activations_grow_with_micro_batches_1f1b_do_not():
    c = Cluster(gpus=2)

    def acts(sched, M):
        return stage_memory(_train(sched=sched, M=M), c, "single", 0, device="cpu").components["activations"]

    g4, g5, g6 = (acts("gpipe", M) for M in (4, 5, 6))
    assert g5 - g4 == g6 - g5 > 0  # one micro-batch of stage 0's activations each
    assert acts("1f1b", 4) == acts("1f1b", 8) == acts("1f1b", 16)  # min(M, p - 0) = 2 in flight


def test_receive_buffers_one_per_micro_batch():
    """On torch 2.13 a middle stage keeps one activation and one gradient buffer per micro-batch (stage.py
    `_setup_forward_recv_info`, `_setup_backward_recv_info`)."""
    c = Cluster(gpus=4)
    nh = boundary_bytes(_train(pp=4, M=8))
    # both well past 1F1B's warm-up, so the peak is at the same steady-state backward
    a = stage_memory(_train(pp=4, M=8, torch_version="2.13"), c, "single", 1, device="cpu")
    b = stage_memory(_train(pp=4, M=12, torch_version="2.13"), c, "single", 1, device="cpu")
    assert a.components["activations"] == b.components["activations"]
    assert b.components["comm_buffers"] - a.components["comm_buffers"] == 2 * 4 * nh


def test_receive_buffers_per_receive_from_torch_2_15():
    """On torch 2.15 (`_recv_buffers.py`) a middle stage's buffers are its in-flight micro-batches' inputs,
    one gradient buffer and the pending gradient send, whatever the number of micro-batches: under 1F1B on
    stage 1 of 4, 3 + 1 + 1 boundary tensors (measured on gloo: cpu-torch2.15-2026-11-29-pp-hf.jsonl); the
    last stage's inputs stay to the step's end (the returned losses keep their graphs): M of them."""
    c = Cluster(gpus=4)
    nh = boundary_bytes(_train(pp=4, M=8))
    for M in (8, 12):
        mid = stage_memory(_train(pp=4, M=M, torch_version="2.15"), c, "single", 1, device="cpu")
        assert mid.components["comm_buffers"] == 5 * nh
        last = stage_memory(_train(pp=4, M=M, torch_version="2.15"), c, "single", 3, device="cpu")
        assert last.components["comm_buffers"] == (M + 1) * nh  # and the last input gradient's send
        first = stage_memory(_train(pp=4, M=M, torch_version="2.15"), c, "single", 0, device="cpu")
        assert first.components["comm_buffers"] == nh  # the gradient buffer: sent outputs dropped


@pytest.mark.parametrize("sched", ["interleaved-1f1b", "interleaved-zb", "zbv"])
def test_runtime_schedules_lowered_as_torch_2_15_lowers_them(sched):
    """pp.lowered_actions ports the passes torch 2.15's `_PipelineScheduleRuntime` lowers a compute schedule
    with (`_add_unshard_reshard`, `_add_reduce_grad`, `_add_send_recv`, `_add_wait_send`); where a torch that
    has them is installed, the port must give its actions, action for action, from the same compute order.
    Without one (the pinned 2.13): the invariants every lowering keeps."""
    from distplan.planner.pp import lowered_actions, runtime_compute_actions, stage_rank, virtual_stages

    def compute(p, M, r):
        return runtime_compute_actions(sched, p, M, r)
    try:
        import torch.distributed.pipelining.schedules as S
        have = all(hasattr(S, f) for f in ("_add_wait_send", "_add_send_recv", "_add_unshard_reshard",
                                          "_add_reduce_grad"))
    except ImportError:
        have = False
    for p, M in ((2, 4), (2, 8), (3, 6), (4, 8), (4, 16)):
        got = lowered_actions(sched, p, M)
        for r in range(p):  # the rank's compute actions in their order; each send with its wait after it
            assert [a for a in got[r] if a[0] in "FBIW"] == compute(p, M, r)
            for a in got[r]:
                if a[0].startswith("SEND_"):
                    assert got[r].index(("WAIT_" + a[0],) + a[1:]) > got[r].index(a)
                if a[0].startswith("RECV_"):  # each receive is some other rank's send
                    src = a[1] - 1 if a[0] == "RECV_F" else a[1] + 1
                    assert ("SEND_" + a[0][5:], src, a[2]) in got[stage_rank(sched, p, src)]
        if not have:
            continue
        names = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
        kinds = {"F": S.F, "B": S.B, "I": S.I, "W": S.W}
        order = {r: [S._Action(sid, kinds[k], mb) for k, sid, mb in compute(p, M, r)] for r in range(p)}
        for r in order:
            order[r] = S._add_reduce_grad(S._add_unshard_reshard(order[r], max_active_stages=3), M)
        order = S._add_wait_send(S._add_send_recv(order, stage_to_rank=lambda s: stage_rank(sched, p, s),
                                                  num_stages=p * virtual_stages(sched)))
        theirs = tuple(tuple((names.get(a.computation_type.name, a.computation_type.name), a.stage_index,
                              a.microbatch_index) for a in order[r]) for r in range(p))
        assert got == theirs, (sched, p, M)


def test_runtime_schedules_on_torch_2_15_free_their_boundary_tensors():
    """Interleaved 1F1B on 2 ranks, 4 micro-batches: through torch 2.14 rank 0 keeps 2 receive buffers per
    micro-batch for the run and every send to the step's end (21 boundary tensors at its peak); 2.15 makes
    each buffer at its receive and retires each forward send after its backward: 10 (measured on gloo,
    the transformers Llama: cpu-torch2.15-2026-11-29-pp-hf.jsonl, comm buffers exact)."""
    c = Cluster(gpus=2)
    nh = boundary_bytes(_train(pp=2, sched="interleaved-1f1b", M=4))
    new = stage_memory(_train(pp=2, sched="interleaved-1f1b", M=4, torch_version="2.15"), c, "single", 0,
                       device="cpu")
    old = stage_memory(_train(pp=2, sched="interleaved-1f1b", M=4, torch_version="2.13"), c, "single", 0,
                       device="cpu")
    assert new.components["comm_buffers"] == 10 * nh
    assert old.components["comm_buffers"] > new.components["comm_buffers"]


def test_most_loaded_stage_is_the_peak():
    t = _train(pp=4, sched="gpipe", M=8)
    c = Cluster(gpus=4)
    per_stage = [stage_memory(t, c, "single", s, device="cpu").peak_allocated for s in range(4)]
    assert estimate_memory(t, c, "single", device="cpu").peak_allocated == max(per_stage)


def test_more_stages_fewer_bytes_per_gpu():
    m = ModelSpec(name="x", layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=32000)
    peaks = []
    for p in (1, 2, 4, 8):
        t = TrainConfig(m, seq_len=4096, pp=p, pp_microbatches=max(p, 1) if p > 1 else 1,
                        checkpointing="full")
        peaks.append(estimate_memory(t, Cluster(gpus=8), "ddp").peak_allocated)
    assert peaks == sorted(peaks, reverse=True) and peaks[-1] < peaks[0] / 3


@pytest.mark.parametrize("strategy", PP_STRATEGIES)
@pytest.mark.parametrize("sched", ["gpipe", "1f1b", "interleaved-1f1b"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16"])
def test_components_nonnegative_and_sum_to_peak(strategy, sched, precision):
    t = _train(pp=2, sched=sched, M=4, precision=precision)
    c = Cluster(gpus=8, gpus_per_node=8)
    if strategy == "single":
        c = Cluster(gpus=2, gpus_per_node=2)
    e = estimate_memory(t, c, strategy)
    assert all(e.components[k] >= 0 for k in COMPONENTS)
    assert sum(e.components.values()) + e.workspace == e.peak_allocated


def test_sharded_strategies_shard_the_static_state_over_dp():
    t = _train(pp=2, M=4, precision="bf16-mixed")
    small, big = (estimate_memory(t, Cluster(gpus=g, gpus_per_node=g), "zero3") for g in (4, 8))
    assert big.components["params"] < small.components["params"]
    assert big.components["optimizer"] < small.components["optimizer"]


# -- communication and time ------------------------------------------------------------------------

def test_p2p_counts_per_rank():
    t = _train(pp=4, M=6)
    assert p2p_counts(t, 0) == (6, 0, 0, 6)
    assert p2p_counts(t, 1) == (6, 6, 6, 6)
    assert p2p_counts(t, 3) == (0, 6, 6, 0)
    ti = _train(pp=2, sched="interleaved-1f1b", M=4)  # stages 0, 2 on rank 0; 1, 3 on rank 1
    assert p2p_counts(ti, 0) == (8, 4, 4, 8)
    assert p2p_counts(ti, 1) == (4, 8, 8, 4)


def test_boundary_dtype_follows_the_regime():
    t = _train(precision="bf16-mixed")
    assert boundary_bytes(t, "ddp") == 2 * 64 * 128 * 4  # autocast: the residual stream stays fp32
    assert boundary_bytes(t, "fsdp2") == 2 * 64 * 128 * 2  # MixedPrecisionPolicy(param_dtype=bf16)


def test_bubble_in_the_step_time():
    p8 = plan("llama-3-8b", gpus=16, pp=4, pp_microbatches=8, strategies=["ddp"])
    p32 = plan("llama-3-8b", gpus=16, pp=4, pp_microbatches=32, strategies=["ddp"])
    t8, t32 = p8["ddp"].time, p32["ddp"].time
    # compute = M micro-batches x (1 + (p-1)/M): (M + p - 1) micro-batch slots
    per_mb8 = t8.compute_s / (8 + 3)
    per_mb32 = t32.compute_s / (32 + 3)
    assert per_mb8 == pytest.approx(per_mb32, rel=0.02)
    assert t32.tokens_per_s > t8.tokens_per_s  # the bubble is a smaller share


def test_pp1_plans_unchanged():
    a = plan("llama-3-8b", gpus=8)
    b = plan("llama-3-8b", gpus=8, pp=1, pp_schedule="gpipe")
    assert a.to_dict()["strategies"] == b.to_dict()["strategies"]


def test_405b_must_show_json_groups():
    r = _run("estimate", "--model", "llama-3-405b", "--gpus", "256", "--node", "dgx-h100", "--tp", "8",
             "--pp", "4", "--seq-len", "8192", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    mesh = d["inputs"]["mesh"]
    assert (mesh["pp"], mesh["dp"], mesh["tp"], mesh["pp_microbatches"]) == (4, 8, 8, 8)
    assert mesh["pp_bubble_fraction"] == pytest.approx(3 / 8)
    names = [s["name"] for s in d["strategies"]]
    assert set(names) <= set(PP_STRATEGIES) and "ddp" in names
    for s in d["strategies"]:
        groups = {c["group"] for c in s["comm"]["collectives"]}
        assert groups == {"dp", "tp", "pp"}, groups
        sends = [c for c in s["comm"]["collectives"] if c["op"] == "send"]
        msg = 8192 * 16384 * (4 if s["name"] in ("ddp", "zero1") else 2)
        assert {c["message_bytes"] for c in sends} == {msg}
        assert sum(c["bytes_per_gpu"] for c in sends) == sum(c["calls"] for c in sends) * msg
        assert sum(c["calls"] for c in sends) == 16  # a middle stage: 8 forward, 8 backward


def test_405b_recommend_names_a_layout():
    r = _run("recommend", "--model", "llama-3-405b", "--gpus", "256", "--node", "dgx-h100", "--tp", "8",
             "--pp", "4", "--seq-len", "8192", "--json")
    assert r.exit_code == 0, r.output
    rec = json.loads(r.output)["recommendation"]
    assert rec["strategy"] in PP_STRATEGIES
    assert "--pp " in rec["change"] or "--sequence-parallel" in rec["change"]


# -- inputs ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, needle", [
    (["--pp", "3"], "--pp=3: tp x pp = 3 must divide --gpus=16"),
    (["--pp", "0"], "--pp=0"),
    (["--pp", "2", "--grad-accum", "2"], "--grad-accum=2 with --pp=2"),
    (["--pp", "4", "--pp-microbatches", "2"], "--pp-microbatches=2: Schedule1F1B needs at least"),
    (["--pp-microbatches", "4"], "--pp-microbatches=4: needs --pp > 1"),
    (["--pp", "2", "--strategy", "fsdp"], "--strategy='fsdp' with --pp=2"),
    (["--pp", "2", "--pp-schedule", "zb"], "--pp-schedule"),
    (["--pp", "2", "--framework", "deepspeed"], "--framework"),
])
def test_pp_errors_one_line_exit_2(args, needle):
    r = _run("estimate", "--model", "llama-3-8b", "--gpus", "16", *args)
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert "\n" not in line and needle in line, line
    assert "Traceback" not in r.output


def test_pp_refuses_tied_embeddings_and_too_few_layers():
    with pytest.raises(ValueError, match="tied embedding"):
        plan("gpt2-small", gpus=2, pp=2)
    with pytest.raises(ValueError, match=r"--pp=16: 16 stages .* has 10; accepted: --pp <= 10"):
        plan(TINY, gpus=16, pp=16)
    with pytest.raises(ValueError, match="pp_microbatches=0"):
        replace(_train(), pp_microbatches=0)


def test_estimate_prints_the_mesh_and_the_stage():
    r = _run("estimate", "--model", "llama-3-8b", "--gpus", "16", "--pp", "2", "--pp-schedule", "gpipe",
             "--pp-microbatches", "8")
    assert r.exit_code == 0, r.output
    assert "mesh: pp 2 (gpipe, 8 micro-batches of 1, bubble 12% of compute) x dp 8" in r.output
    assert "pipeline stage" in r.output


# -- zero-bubble schedules ---------------------------------------------------------------------------

def test_zero_bubble_schedules_are_planned_without_checkpointing():
    from distplan.planner.api import plan
    for sched in ("interleaved-zb", "zbv"):
        p = plan("llama-3-8b", gpus=16, pp=4, pp_schedule=sched, pp_microbatches=8, strategies=["zero3"])
        assert p["zero3"].memory.peak_allocated > 0
        with pytest.raises(ValueError, match="zero-bubble schedule"):
            plan("llama-3-8b", gpus=16, pp=4, pp_schedule=sched, pp_microbatches=8,
                 activation_checkpointing="full", strategies=["zero3"])


def test_zero_bubble_bubbles_and_stage_placement():
    from distplan.planner.pp import bubble_fraction, rank_stage_ids
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 8)
    assert bubble_fraction("interleaved-1f1b", 4, 8) == pytest.approx(3 / 16)
    assert bubble_fraction("interleaved-zb", 4, 8) == pytest.approx(3 / 48)  # ZB-H1's third, over v = 2
    assert bubble_fraction("zbv", 4, 8) == 0.0
    assert rank_stage_ids("zbv", 4, 0) == [0, 7] and rank_stage_ids("zbv", 4, 3) == [3, 4]
    assert rank_stage_ids("interleaved-zb", 4, 1) == [1, 5]


def test_zbv_neighbours_on_one_rank_send_nothing():
    """zbv's rank p - 1 holds stages p - 1 and p: the tensor between them is handed over, not sent; rank 0
    holds the first and the last stage: it receives only gradients for stage 0 and activations for 2p - 1."""
    from distplan.planner.api import plan
    from distplan.planner.pp import p2p_counts
    t = plan("llama-3-8b", gpus=8, pp=4, pp_schedule="zbv", pp_microbatches=8, strategies=["zero3"]).train
    assert p2p_counts(t, 3) == (8, 8, 8, 8)  # stage 3 -> (local 4); stage 4 -> rank 2's stage 5, and back
    assert p2p_counts(t, 0) == (8, 8, 8, 8)  # stage 0 sends forward, stage 7 sends its input's gradient
    looped = plan("llama-3-8b", gpus=8, pp=4, pp_schedule="interleaved-zb", pp_microbatches=8, strategies=["zero3"]).train
    assert p2p_counts(looped, 1) == (16, 16, 16, 16)


def test_zbv_fsdp2_rank_0_has_two_roots():
    """FSDP2 on zbv's rank 0: the first stage's module (the embedding) and the last's (final norm + head)
    are two FSDP roots, each all-gathered once per step."""
    from distplan.planner.api import plan
    p = plan("llama-3-8b", gpus=16, pp=4, pp_schedule="zbv", pp_microbatches=8, strategies=["zero3"])
    roots = [c for c in p["zero3"].collectives if c.unit == "root" and c.op == "all_gather"]
    assert len(roots) == 2 and all(c.calls == 1 for c in roots)
    emb = 128256 * 4096 * 2  # bf16 parameters all-gathered (dp 4 divides the rows)
    assert sorted(c.message_bytes for c in roots) == sorted([emb, emb + 4096 * 2])
