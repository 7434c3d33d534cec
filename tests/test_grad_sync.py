"""Gradient accumulation with and without `no_sync` (`grad_sync`: 'last' or 'every').

'last' (the default): micro-steps before the last run under DDP's / FSDP1's `no_sync()` or FSDP2's
`set_requires_gradient_sync(False)`, which keep unsharded gradients; 'every': each micro-step reduces
and the sharded gradient accumulates (torchtitan's loop). Fast: the collectives, the exposed
communication and the memory walk against closed forms. Slow: real probes (fake process group of 8,
and gloo with 2 ranks) of the reference decoder in both modes: collectives exact, peak within 5%.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

from distplan.planner.api import plan
from distplan.planner.cli import main
from distplan.planner.comm_schedule import collective_schedule
from distplan.planner.compute import exposed_comm
from distplan.planner.config import Cluster, TrainConfig
from distplan.planner.kernels import kernel_times
from distplan.planner.activations import regime_for
from distplan.planner.memory import estimate_memory, layout
from distplan.planner.model import ModelSpec
from distplan.planner.strategies import NAMES, get_strategy

# the CPU matrix's llama-tiny (validate/matrix.py SHAPES_CPU)
TINY = ModelSpec("llama-tiny", layers=2, hidden=128, heads=4, kv_heads=2, ffn_hidden=352, vocab=512,
                 max_positions=128)
REDUCTIONS = ("all_reduce", "reduce_scatter")


def _train(A=4, sync="last", **kw):
    kw.setdefault("seq_len", 64)
    kw.setdefault("micro_batch", 2)
    kw.setdefault("precision", "fp32")
    return TrainConfig(TINY, grad_accum=A, grad_sync=sync, **kw)


def _calls(train, cluster, name) -> dict:
    out: dict = {}
    for c in collective_schedule(train, cluster, name):
        k = (c.op, c.phase, c.unit, c.message_bytes)
        out[k] = out.get(k, 0) + c.calls
    return out


# -- collectives -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [n for n in NAMES if n != "single"])
def test_every_micro_step_reduces_and_only_reductions_multiply(name):
    cl = Cluster(gpus=16, gpus_per_node=8)
    last, every = _calls(_train(4, "last"), cl, name), _calls(_train(4, "every"), cl, name)
    assert set(last) == set(every)  # same collectives, same message sizes
    for k, n in last.items():
        if k[0] in REDUCTIONS:
            assert every[k] == 4 * n, k
        elif name == "fsdp-grad-op" and k[:2] == ("all_gather", "forward"):
            # SHARD_GRAD_OP keeps parameters unsharded only between no_sync micro-steps
            assert (n, every[k]) == (last[("all_gather", "forward", k[2], k[3])], 4 * n), k
        else:
            assert every[k] == n, k  # all-gathers and zero1's broadcasts do not change


def test_grad_sync_is_moot_without_accumulation():
    cl = Cluster(gpus=8)
    for name in NAMES:
        assert _calls(_train(1, "last"), cl, name) == _calls(_train(1, "every"), cl, name)
        assert (estimate_memory(_train(1, "last"), cl, name, device="cpu", backend="fake").components
                == estimate_memory(_train(1, "every"), cl, name, device="cpu", backend="fake").components)


def test_deepspeed_keeps_its_own_schedule():
    cl = Cluster(gpus=8)
    for name in ("zero1", "zero2", "zero3"):
        a = _calls(_train(4, "last", framework="deepspeed"), cl, name)
        assert a == _calls(_train(4, "every", framework="deepspeed"), cl, name)


# -- exposed communication -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["ddp", "zero3", "fsdp"])
def test_exposed_comm_per_reducing_micro_step(name):
    """Synced every micro-step, each of the A micro-steps is a whole step's communication: exposure is
    A times that of grad_accum=1; without sync, DDP exposes only the last micro-step's buckets."""
    cl = Cluster(gpus=16, gpus_per_node=8, inter_link="eth-100g-tcp", nics_per_node=1)
    gpu = _h100()

    def exposed(train):
        kt = kernel_times(train, gpu, regime_for(train, get_strategy(name).family))
        return exposed_comm(train, name, collective_schedule(train, cl, name), kt)
    one, last, every = exposed(_train(1)), exposed(_train(4, "last")), exposed(_train(4, "every"))
    assert one > 0
    assert every == pytest.approx(4 * one, rel=1e-9)
    assert last < every
    if name == "ddp":
        assert last == pytest.approx(one, rel=1e-9)


def _h100():
    from distplan.planner.compute import _gpu
    return _gpu("h100-sxm")


def test_step_time_grows_with_every_on_a_slow_network():
    kw = dict(params="7B", gpus=32, gpu="h100-sxm", gpus_per_node=8, inter="eth-100g-tcp", grad_accum=8,
              strategies=["ddp", "zero3", "fsdp"])
    last, every = plan(**kw, grad_sync="last"), plan(**kw, grad_sync="every")
    for name in ("ddp", "zero3", "fsdp"):
        assert every[name].step_time_s > last[name].step_time_s
        assert every[name].comm_bytes_per_gpu > last[name].comm_bytes_per_gpu


# -- memory --------------------------------------------------------------------------------------------

def _mem(train, name, world=8, backend="fake"):
    return estimate_memory(train, Cluster(gpus=world, gpu_memory_bytes=10**15), name, device="cpu",
                           backend=backend)


@pytest.mark.parametrize("sync", ["last", "every"])
@pytest.mark.parametrize("name", ["single", "ddp", "zero1"])
def test_ddp_keeps_every_gradient_from_the_first_micro_step(name, sync):
    """DDP's .grad exists after the first micro-step either way (AccumulateGrad adds in place); the
    walk at grad_accum=1 has only the head's at the last-but-one micro-step's instants."""
    world = 1 if name == "single" else 8
    acc, one = _mem(_train(2, sync), name, world), _mem(_train(1), name, world)
    total = layout(TINY, get_strategy(name).family, world, False, name == "zero1").total
    assert acc.peak_phase == "backward"
    assert acc.components["grads"] == total * 4
    assert acc.peak_allocated > one.peak_allocated


@pytest.mark.parametrize("precision, fsdp1_bytes, fsdp2_bytes", [("fp32", 4, 4), ("bf16-mixed", 2, 4)])
def test_no_sync_holds_unsharded_gradients_every_keeps_shards(precision, fsdp1_bytes, fsdp2_bytes):
    """At forward of a later micro-step: without sync every unit's unsharded gradient (FSDP1 in
    param_dtype, FSDP2 in reduce_dtype); synced every micro-step only the shards (fp32 master dtype)."""
    for name, nbytes in (("zero2", fsdp2_bytes), ("zero3", fsdp2_bytes), ("fsdp", fsdp1_bytes)):
        fam = get_strategy(name).family
        lay = layout(TINY, fam, 8, True, True)
        full = (lay.unshard_root + TINY.layers * lay.unshard_block) * nbytes
        shards = (lay.shard_root + TINY.layers * lay.shard_block) * 4
        last, every = _mem(_train(3, "last", precision=precision), name), _mem(_train(3, "every", precision=precision), name)
        assert last.peak_allocated - every.peak_allocated >= full - shards - lay.unshard_block * 4, name
        if name == "zero2":  # its peak is the end of forward: nothing reduced yet in that micro-step
            assert last.peak_phase == every.peak_phase == "forward"
            assert last.components["grads"] == full
            assert every.components["grads"] == shards


def test_more_micro_steps_do_not_add_memory():
    """What accumulates is one gradient per parameter: 2 or 16 micro-steps hold the same bytes."""
    for name in NAMES:
        world = 1 if name == "single" else 8
        for sync in ("last", "every"):
            a, b = _mem(_train(2, sync), name, world), _mem(_train(16, sync), name, world)
            assert a.peak_allocated == b.peak_allocated, (name, sync)


# -- CLI, API, JSON ------------------------------------------------------------------------------------

def test_cli_json_carries_grad_sync_and_the_counts():
    args = ["estimate", "--params", "1B", "--gpus", "16", "--gpu", "h100-sxm", "--grad-accum", "4",
            "--strategy", "zero3", "--json"]
    last = json.loads(CliRunner().invoke(main, args).output)
    every = json.loads(CliRunner().invoke(main, args + ["--grad-sync", "every"]).output)
    assert last["inputs"]["train"]["grad_sync"] == "last"
    assert every["inputs"]["train"]["grad_sync"] == "every"

    def rs_calls(d):
        return sum(c["calls"] for c in d["strategies"][0]["comm"]["collectives"] if c["op"] == "reduce_scatter")
    assert rs_calls(every) == 4 * rs_calls(last) > 0


def test_bad_grad_sync_is_one_line_exit_2():
    r = CliRunner().invoke(main, ["estimate", "--params", "1B", "--grad-sync", "sometimes"])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "--grad-sync" in lines[0] and "sometimes" in lines[0], r.output
    assert "Traceback" not in r.output


def test_api_rejects_an_unknown_grad_sync():
    with pytest.raises(ValueError, match="grad_sync='sometimes': accepted values are last, every"):
        plan(params="1B", gpus=8, gpu="h100-sxm", grad_sync="sometimes")
    with pytest.raises(ValueError, match="grad_sync"):
        replace(_train(), grad_sync=None)


# -- the module front end (trace) ----------------------------------------------------------------------

def test_module_collectives_follow_grad_sync():
    pytest.importorskip("torch")
    from distplan.planner.module_plan import ModuleDesc, ModuleModel, ModuleTrain, module_collectives
    from distplan.planner.workload.trace import profile_module

    desc = ModuleDesc.from_profile(profile_module("examples.mnist_cnn:make_model", (4, 1, 28, 28), "float32"))
    model = ModuleModel(desc.name, "cnn", desc.param_count(), desc.units, layers=len(desc.units))
    cl = Cluster(gpus=8)
    for name in ("ddp", "zero3", "fsdp", "fsdp-grad-op", "fsdp-no-shard"):
        def calls(sync):
            t = ModuleTrain(model, precision="fp32", grad_accum=3, grad_sync=sync, input_shape=(4, 1, 28, 28))
            return {(c.op, c.phase, c.unit, c.message_bytes): c.calls for c in module_collectives(desc, t, cl, name)}
        last, every = calls("last"), calls("every")
        assert set(last) == set(every)
        for k, n in last.items():
            grad_op_fwd = name == "fsdp-grad-op" and k[:2] == ("all_gather", "forward")
            assert every[k] == (3 * n if k[0] in REDUCTIONS or grad_op_fwd else n), (name, k)


# -- real probes ---------------------------------------------------------------------------------------

PROBES = [
    # (mode, world, precision, grad_accum)
    ("fake", 8, "fp32", 2),
    ("fake", 8, "bf16-mixed", 3),
    ("cpu", 2, "fp32", 2),
]
PROBE_STRATEGIES = ("ddp", "zero2", "zero3", "fsdp")


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["last", "every"])
@pytest.mark.parametrize("mode, world, precision, A", PROBES)
def test_probe_accumulation(tmp_path, mode, world, precision, A, sync):
    """The reference decoder under DDP, FSDP2 (zero2, zero3) and FSDP1 (fsdp), with `no_sync` /
    `set_requires_gradient_sync(False)` before the last micro-step or without: collectives exact, peak
    within 5%; on the fake process group (one process, deterministic) the gradients at the peak too."""
    from distplan.validate import matrix as mx
    from distplan.validate import runner

    specs = [mx.make_spec(s, dict(mx.SHAPES_CPU["llama-tiny"], name="llama-tiny"), world, mode, seq_len=64,
                          micro_batch=2, grad_accum=A, grad_sync=sync, precision=precision)
             for s in PROBE_STRATEGIES]
    assert all(s["id"].endswith(f"/accum{A}-{sync}") for s in specs)
    recs = runner.run_validation(specs, str(tmp_path / "r.jsonl"), timeout_s=300)
    bad = []
    for r in recs:
        m, cmp = r["measurement"], r["comparison"]
        assert m["status"] == "ok", (r["id"], m.get("error") or m.get("stderr_tail"))
        if not cmp["collectives"]["exact"] or abs(cmp["peak"]["error"]) > 0.05:
            bad.append((r["id"], cmp["peak"], cmp["collectives"]))
        if mode == "fake" and not cmp["components"]["grads"]["ok"]:
            bad.append((r["id"], "grads", cmp["components"]["grads"]))
    assert not bad, bad


# -- the committed probes, re-predicted ----------------------------------------------------------------
# benchmarks/results/cpu-*-accum.jsonl: `distplan validate --strategy all --grad-accum A --grad-sync S`,
# the fake process group of 8 (fp32 at A=2, bf16-mixed at A=3) and gloo with 2 ranks (fp32, A=2), both
# modes. Re-predicted with the planner as it is now: peaks within 5%, collectives exact; on the fake
# process group (one process, deterministic) every component passes but the gaps named here.

ACCUM_GAPS = {
    # FSDP2 without sync in fp32: the walk's peak is the last block's MLP backward with three n x f
    # gradients; the measured one is the instant before, w_down's input still saved and its weight
    # gradient not yet added in place (temporaries 606,208 vs 430,116 B; activations -6.7%; the peak -0.03%)
    "zero3/llama-tiny/w8-fake/none/fp32/accum2-last",
}


def _committed_accum():
    import glob
    import os

    from distplan.planner.api import predict_probe
    from distplan.validate.results import record_spec
    from distplan.validate.compare import compare

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    recs = []
    for path in sorted(glob.glob(os.path.join(root, "benchmarks", "results", "cpu-*-accum.jsonl"))):
        with open(path) as f:
            recs += [json.loads(line) for line in f if line.strip()]
    return [(r, compare(predict_probe(record_spec(r)), r["measurement"])) for r in recs]


def test_committed_accumulation_probes_repredicted():
    rows = _committed_accum()
    assert len(rows) >= 46
    assert {r["inputs"]["train"]["grad_sync"] for r, _ in rows} == {"last", "every"}
    assert all(r["measurement"]["status"] == "ok" and r["inputs"]["train"]["grad_accum"] > 1 for r, _ in rows)
    bad = {r["id"]: round(100 * c["peak"]["error"], 2) for r, c in rows if abs(c["peak"]["error"]) > 0.05}
    assert not bad, bad
    assert [r["id"] for r, c in rows if not c["collectives"]["exact"]] == []
    fake = {r["id"]: c["verdict"] for r, c in rows if r["inputs"]["mode"] == "fake" or r["inputs"]["world_size"] == 1}
    failed = {i for i, v in fake.items() if v != "PASS"}
    assert failed == ACCUM_GAPS & set(fake), failed
