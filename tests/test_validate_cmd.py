"""`distplan validate` as a product: runner, results file, comparison, matrix, CLI.

Fast: probes are `tests/fake_probe.py` (no torch). One smoke test runs the real probe on the fake process
group when `validate/probe.py` and the planner's `predict_probe` exist.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import fake_probe  # noqa: E402

from distplan.planner.footprint import CUDA_CONTEXT_BYTES  # noqa: E402
from distplan.planner.model import ModelSpec  # noqa: E402
from distplan.planner.strategies import NAMES  # noqa: E402
from distplan.validate.command import validate_command  # noqa: E402
from distplan.validate import matrix as mx  # noqa: E402
from distplan.validate import runner  # noqa: E402
from distplan.validate.compare import ABS_FLOOR_BYTES, compare, compare_collectives, rel_error  # noqa: E402
from distplan.validate.results import ResultsFile, read_records  # noqa: E402

FAKE = [sys.executable, str(HERE / "fake_probe.py")]
CPU_HW = {"torch_version": "0.0-fake", "gpus": 0, "gpu_names": [], "gpu_memory_bytes": [], "bf16": True,
          "cpu_count": 2, "ram_bytes": 8 * 2**30}


def _spec(i=0, strategy="ddp", mode="fake", world=2, **fake):
    s = mx.make_spec(strategy, dict(mx.SHAPES_CPU["llama-tiny"], name="llama-tiny"), world, mode)
    s["id"] = f"{s['id']}#{i}"
    if fake:
        s["fake"] = fake
    return s


def _exact_prediction(spec, **extra):
    """The prediction that matches what fake_probe measures."""
    r = fake_probe.result_for(spec)
    mem = dict(r["memory"]["components"], peak_allocated=r["memory"]["peak_allocated"], peak_phase="optimizer")
    return dict({"memory": mem, "collectives": r["collectives"], "step_time_s": None}, **extra)


# -- compare ------------------------------------------------------------------------------------------

def test_rel_error_conventions():
    assert rel_error(110, 100) == pytest.approx(0.10)
    assert rel_error(90, 100) == pytest.approx(-0.10)
    assert rel_error(0, 0) == 0.0
    assert rel_error(5, 0) is None


def test_compare_hand_made_numbers():
    MiB = 2**20
    measured = {"status": "ok", "memory": {
        "peak_allocated": 100 * MiB, "peak_phase": "optimizer",
        "components": {"params": 10 * MiB, "grads": 10 * MiB, "optimizer": 20 * MiB, "activations": 40 * MiB,
                       "comm_buffers": 0, "temporaries": 100 * 1024}},
        "collectives": [{"op": "all_reduce", "group_size": 2, "dtype": "float32", "message_bytes": 4096,
                         "calls": 3}], "step_time_s": None, "unmeasured": []}
    pred = {"memory": {"params": 10 * MiB, "grads": 10 * MiB, "optimizer": 21 * MiB,  # +5%: inside 10%
                       "activations": 43 * MiB,  # +7.5%: inside 2 x 5%
                       "comm_buffers": 60 * 1024,  # measured 0: ratio undefined, but under the 64 KiB floor
                       "temporaries": 150 * 1024,  # +50%, yet only 50 KiB off: the floor accepts it
                       "peak_allocated": 104 * MiB, "peak_phase": "optimizer"},
            "collectives": [{"op": "all_reduce", "group_size": 2, "dtype": "float32", "message_bytes": 4096,
                             "calls": 3}], "step_time_s": None}
    c = compare(pred, measured, 0.05)
    assert c["verdict"] == "PASS", c["reasons"]
    assert c["peak"]["error"] == pytest.approx(0.04)
    assert c["peak"]["abs_error_bytes"] == 4 * MiB
    assert c["components"]["optimizer"]["error"] == pytest.approx(0.05)
    assert c["components"]["comm_buffers"]["error"] is None and c["components"]["comm_buffers"]["ok"]
    assert c["components"]["temporaries"]["error"] == pytest.approx(0.5)
    assert c["worst_component"] == "comm_buffers"  # undefined ratio ranks worst
    assert c["collectives"]["exact"]
    assert "64 KiB" in c["rule"] and ABS_FLOOR_BYTES == 64 * 1024

    # peak 6% off fails at 5%, passes at 10%
    pred["memory"]["peak_allocated"] = 106 * MiB
    assert compare(pred, measured, 0.05)["verdict"] == "FAIL"
    assert compare(pred, measured, 0.10)["verdict"] == "PASS"
    # a big component 25% off fails even with the peak right
    pred["memory"]["peak_allocated"] = 100 * MiB
    pred["memory"]["activations"] = 50 * MiB
    c = compare(pred, measured, 0.05)
    assert c["verdict"] == "FAIL" and any("activations" in r for r in c["reasons"])
    # one collective call short is not exact
    pred["memory"]["activations"] = 40 * MiB
    pred["collectives"][0]["calls"] = 2
    c = compare(pred, measured, 0.05)
    assert c["verdict"] == "FAIL" and not c["collectives"]["exact"]
    assert c["collectives"]["rows"][0]["predicted_calls"] == 2 and c["collectives"]["rows"][0]["measured_calls"] == 3


def test_grads_and_temporaries_missing_in_opposite_directions_pass_together():
    """The stated exception: a weight gradient in autograd's buffer (temporary) vs already `.grad`."""
    MiB = 2**20
    comps = {"params": 10 * MiB, "grads": 8 * MiB, "optimizer": 20 * MiB, "activations": 40 * MiB,
             "comm_buffers": 0, "temporaries": 6 * MiB}
    measured = {"status": "ok", "memory": {"peak_allocated": 84 * MiB, "peak_phase": "backward",
                                           "components": dict(comps)},
                "collectives": [], "step_time_s": None, "unmeasured": []}
    pred = {"memory": dict(comps, grads=10 * MiB, temporaries=4 * MiB, peak_allocated=84 * MiB,
                           peak_phase="backward"), "collectives": [], "step_time_s": None}
    c = compare(pred, measured, 0.05)  # grads +25%, temporaries -33%, their sum exact
    assert c["verdict"] == "PASS", c["reasons"]
    assert c["components"]["grads"]["judged_with"] == "grads+temporaries"
    # the rule printed with the verdict states this exception, so "grads +25% ... PASS" agrees with it
    assert "grads and temporaries" in c["rule"] and "sum" in c["rule"]
    pred["memory"]["temporaries"] = 6 * MiB  # same direction now: grads alone is 25% over
    pred["memory"]["peak_allocated"] = 86 * MiB
    c = compare(pred, measured, 0.05)
    assert c["verdict"] == "FAIL" and any(r.startswith("grads:") for r in c["reasons"])


def test_compare_collectives_matches_by_key_and_sums_calls():
    a = [{"op": "all_gather", "group_size": 8, "dtype": "bfloat16", "message_bytes": 100, "calls": 2},
         {"op": "all_gather", "group_size": 8, "dtype": "bfloat16", "message_bytes": 100, "calls": 1}]
    b = [{"op": "all_gather", "group_size": 8, "dtype": "bfloat16", "message_bytes": 100, "calls": 3}]
    assert compare_collectives(a, b)["exact"]
    b[0]["dtype"] = "float32"
    r = compare_collectives(a, b)
    assert not r["exact"] and len(r["rows"]) == 2


def test_compare_oom_and_failures():
    oom = {"status": "oom", "error": "CUDA out of memory"}
    assert compare({"memory": {}, "fits": False}, oom)["verdict"] == "PASS"
    c = compare({"memory": {}, "fits": True}, oom)
    assert c["verdict"] == "FAIL" and "OOM" in c["reasons"][0]
    for status in ("timeout", "crashed", "error"):
        c = compare({"memory": {}}, {"status": status, "error": "why not"})
        assert c["verdict"] == "FAIL" and status in c["reasons"][0] and "why not" in c["reasons"][0]
    with pytest.raises(ValueError):
        compare({}, {"status": "ok"}, -0.01)


def test_compare_predicted_failure():
    """A prediction that PyTorch refuses the run (`fails`) agrees with a probe that raised the error it names,
    and with nothing else."""
    pred = {"memory": {"peak_allocated": 100}, "collectives": [],
            "fails": {"reason": "BatchNorm under FSDP2", "error_contains": ["running_mean"]}}
    raised = {"status": "error", "error": "RuntimeError: Expected running_mean to have type BFloat16"}
    c = compare(pred, raised)
    assert c["verdict"] == "PASS" and "as predicted" in c["reasons"][0]
    assert compare(pred, {"status": "error", "error": "RuntimeError: shapes do not match"})["verdict"] == "FAIL"
    assert compare(pred, {"status": "crashed", "error": "running_mean"})["verdict"] == "FAIL"
    ran = {"status": "ok", "memory": {"peak_allocated": 100, "components": {}}, "collectives": []}
    c = compare(pred, ran)
    assert c["verdict"] == "FAIL" and any("refuses" in r for r in c["reasons"])


# -- runner and results file ----------------------------------------------------------------------------

def test_fake_mode_launches_probe_module_and_torchrun_for_ranks():
    s = _spec(mode="fake", world=8)
    assert runner.probe_argv(s, "s.json", "r.json")[:3] == [sys.executable, "-m", "distplan.validate.probe"]
    s = _spec(mode="cpu", world=2)
    argv = runner.probe_argv(s, "s.json", "r.json")
    assert argv[:3] == [sys.executable, "-m", "distplan.validate.launch"]  # torchrun, workers forked
    # one node: a rendezvous that never leaves the machine (no --standalone: it names this host)
    assert "--standalone" not in argv and "--nproc-per-node=2" in argv
    assert "--rdzv-endpoint=127.0.0.1:0" in argv and "--local-addr=127.0.0.1" in argv
    argv = runner.probe_argv(s, "s.json", "r.json", nnodes=2, rdzv_endpoint="h:29500")
    assert "--nproc-per-node=1" in argv and "h:29500" in argv and "--local-addr=127.0.0.1" not in argv
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]  # several nodes: torchrun as users run it
    assert runner.probe_argv(s, "s.json", "r.json", probe_cmd=FAKE) == FAKE + ["--spec", "s.json", "--out", "r.json"]


def test_choose_mode():
    assert runner.choose_mode(CPU_HW) == ("cpu", 2)
    assert runner.choose_mode(CPU_HW, simulate_world_size=8) == ("fake", 8)
    assert runner.choose_mode(dict(CPU_HW, gpus=4)) == ("gpu", 4)
    with pytest.raises(ValueError, match="--nproc"):
        runner.choose_mode(dict(CPU_HW, gpus=1), nproc=2)


def test_crash_is_recorded_and_later_probes_still_append(tmp_path):
    out = tmp_path / "r.jsonl"
    specs = [_spec(0, behavior="crash"), _spec(1, behavior="ok"), _spec(2, behavior="exit0")]
    recs = runner.run_validation(specs, str(out), probe_cmd=FAKE, predict=_exact_prediction, jobs=2)
    assert [r["status"] for r in recs] == ["crashed", "ok", "crashed"]
    assert "RuntimeError: probe blew up on purpose" == recs[0]["measurement"]["error"]
    assert "without writing a result" in recs[2]["measurement"]["error"]
    assert recs[1]["verdict"] == "PASS" and recs[0]["verdict"] == "FAIL"
    on_disk = read_records(str(out))
    assert sorted(r["id"] for r in on_disk) == sorted(s["id"] for s in specs)
    for r in on_disk:
        assert set(r) >= {"id", "inputs", "prediction", "measurement", "comparison", "device",
                          "torch_version", "date", "status"}


def test_hung_probe_killed_at_timeout_with_its_process_group(tmp_path):
    pidfile = tmp_path / "pids"
    spec = _spec(behavior="hang", pidfile=str(pidfile))
    t0 = time.monotonic()
    m = runner.run_probe(spec, probe_cmd=FAKE, timeout_s=1.5)
    assert time.monotonic() - t0 < 1.5 + runner.KILL_GRACE_S + 5
    assert m["status"] == "timeout" and "1.5 s" in m["error"]
    pids = [int(p) for p in pidfile.read_text().split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    while any(fake_probe.alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(fake_probe.alive(p) for p in pids), "probe or its child survived the timeout"
    c = compare(_exact_prediction(spec), m)
    assert c["verdict"] == "FAIL" and "timeout" in c["reasons"][0]


def test_oom_probe_recorded_and_compared_with_fits(tmp_path):
    out = tmp_path / "r.jsonl"
    specs = [_spec(0, behavior="oom"), _spec(1, behavior="oom")]
    fits = {specs[0]["id"]: False, specs[1]["id"]: True}
    recs = runner.run_validation(specs, str(out), probe_cmd=FAKE,
                                 predict=lambda s: _exact_prediction(s, fits=fits[s["id"]]))
    assert [r["status"] for r in recs] == ["oom", "oom"]
    assert [r["verdict"] for r in recs] == ["PASS", "FAIL"]
    assert len(read_records(str(out))) == 2


def _gpu_fake_specs(n, sleep):
    specs = [_spec(i, behavior="ok", sleep=sleep) for i in range(n)]
    for s in specs:
        s["device_type"] = "cuda"  # fake process group on a GPU: probes that may share it
    return specs


def _starts_and_ends(specs, out, device_memory_bytes):
    events = []
    recs = runner.run_validation(specs, str(out), probe_cmd=FAKE, predict=_exact_prediction, jobs=3,
                                 device_memory_bytes=device_memory_bytes,
                                 on_event=lambda kind, i, *_: events.append((kind, i)))
    return recs, [e for e in events if e[0] in ("start", "done")]


def test_probes_share_a_gpu_only_while_their_predicted_needs_fit(tmp_path):
    """Each fake probe needs its predicted peak or the whole fp32 model, plus a CUDA context: on a GPU
    too small for two, --jobs 3 runs them one after another; on a large one, side by side, and a probe
    that shared the GPU is marked so its time is not judged."""
    specs = _gpu_fake_specs(3, sleep=0.3)
    need = runner.gpu_need_bytes(specs[0], _exact_prediction(specs[0]))
    params = 4 * ModelSpec(**specs[0]["model"]).param_count()
    assert need == max(params, fake_probe.result_for(specs[0])["memory"]["peak_allocated"]) + CUDA_CONTEXT_BYTES
    # room for one (90% of the device is the budget): strictly one after another
    recs, ev = _starts_and_ends(specs, tmp_path / "one.jsonl", int(1.5 * need / runner.GPU_SHARE))
    assert ev == [("start", 0), ("done", 0), ("start", 1), ("done", 1), ("start", 2), ("done", 2)]
    assert [r["verdict"] for r in recs] == ["PASS"] * 3
    assert not any(r["measurement"].get("shared_gpu") for r in recs)
    # room for all three: they start together and every one is marked
    recs, ev = _starts_and_ends(specs, tmp_path / "all.jsonl", int(3.5 * need / runner.GPU_SHARE))
    assert [e for e in ev[:3]] == [("start", 0), ("start", 1), ("start", 2)]
    assert all(r["measurement"].get("shared_gpu") for r in recs)
    # room for two: the third waits for a slot in memory, not in --jobs
    recs, ev = _starts_and_ends(specs, tmp_path / "two.jsonl", int(2.5 * need / runner.GPU_SHARE))
    assert ev[:2] == [("start", 0), ("start", 1)] and ev[2][0] == "done" and ev.index(("start", 2)) >= 3
    # a probe bigger than the GPU still runs (alone), and CPU probes ignore the GPU budget
    recs, ev = _starts_and_ends(_gpu_fake_specs(2, 0.1), tmp_path / "big.jsonl", need // 2)
    assert ev == [("start", 0), ("done", 0), ("start", 1), ("done", 1)]
    cpu = [_spec(i, behavior="ok", sleep=0.3) for i in range(3)]
    recs, ev = _starts_and_ends(cpu, tmp_path / "cpu.jsonl", need // 2)
    assert ev[:3] == [("start", 0), ("start", 1), ("start", 2)]


def test_step_time_of_a_probe_that_shared_its_gpu_is_not_judged():
    spec = _spec()
    pred = dict(_exact_prediction(spec), step_time_s=0.10, step_time_bound="gpu")
    meas = dict(fake_probe.result_for(spec), step_time_s=0.20)
    alone = compare(pred, meas)
    assert alone["verdict"] == "FAIL" and alone["step_time"]["judged"] and "step time" in alone["reasons"][0]
    beside = compare(pred, dict(meas, shared_gpu=True))
    assert beside["verdict"] == "PASS" and not beside["step_time"]["judged"]
    assert beside["step_time"]["shared_gpu"] and beside["step_time"]["error"] == pytest.approx(-0.5)


def test_truncated_last_line_is_tolerated_and_cut_before_appending(tmp_path):
    out = tmp_path / "r.jsonl"
    rf = ResultsFile(str(out))
    rf.append({"id": "a", "status": "ok"})
    with open(out, "a") as f:
        f.write('{"id": "b", "stat')  # killed mid-write
    assert [r["id"] for r in read_records(str(out))] == ["a"]
    rf = ResultsFile(str(out))
    assert rf.repaired_bytes > 0
    rf.append({"id": "c", "status": "ok"})
    assert [r["id"] for r in read_records(str(out))] == ["a", "c"]
    assert all(json.loads(ln) for ln in out.read_text().splitlines())


# -- CLI ----------------------------------------------------------------------------------------------

@pytest.fixture
def cli(monkeypatch, tmp_path):
    monkeypatch.setattr(runner, "detect_hardware", lambda *a, **k: dict(CPU_HW))
    monkeypatch.setattr(runner, "default_predict", _exact_prediction)
    monkeypatch.chdir(tmp_path)

    def invoke(*args, env=None):
        return CliRunner().invoke(validate_command, ["--probe-cmd", " ".join(FAKE), *args],
                                  env=env, catch_exceptions=False)
    return invoke


def test_cli_default_runs_every_strategy_and_passes(cli, tmp_path):
    r = cli()
    assert r.exit_code == 0, r.output
    assert "CPU, gloo, 2 processes" in r.output and "no GPU step time" in r.output
    recs = read_records(str(tmp_path / "distplan-results.jsonl"))
    assert sorted(rec["inputs"]["strategy"] for rec in recs) == sorted(NAMES)
    assert {rec["inputs"]["world_size"] for rec in recs if rec["inputs"]["strategy"] == "single"} == {1}
    assert "summary: median / max" in r.output


def test_cli_single_strategy_shows_components_and_collectives(cli):
    r = cli("--strategy", "fsdp", "--simulate-world-size", "8", "--json")
    assert r.exit_code == 0
    report = json.loads(r.stdout)
    assert report["ok"] and len(report["probes"]) == 1
    assert report["probes"][0]["inputs"]["mode"] == "fake" and report["probes"][0]["inputs"]["world_size"] == 8
    r = cli("--strategy", "fsdp", "--simulate-world-size", "8")
    assert "fake process group on CPU: rank 0 of 8" in r.output
    assert "memory (bytes on the most loaded rank)" in r.output and "counted calls" in r.output


def test_cli_fail_exit_code_1(cli):
    r = cli("--strategy", "ddp", env={"DISTPLAN_FAKE_PROBE": json.dumps({"behavior": "crash"})})
    assert r.exit_code == 1
    assert "FAIL" in r.output and "probe blew up" in r.output


def test_cli_resume_skips_done_ids(cli, tmp_path):
    out = tmp_path / "res.jsonl"
    r = cli("--strategy", "ddp,zero3", "--out", str(out))
    assert r.exit_code == 0
    assert len(read_records(str(out))) == 2
    r = cli("--strategy", "ddp,zero3,fsdp", "--out", str(out), "--resume")
    assert r.exit_code == 0
    recs = read_records(str(out))
    assert [x["inputs"]["strategy"] for x in recs] == ["ddp", "zero3", "fsdp"]
    assert r.output.count("(resumed)") == 2
    # same id, different inputs (another seq len): not skipped
    r = cli("--strategy", "ddp", "--out", str(out), "--resume", "--seq-len", "32")
    assert len(read_records(str(out))) == 4


def test_cli_ctrl_c_kills_probe_and_leaves_parseable_file(cli, tmp_path):
    out = tmp_path / "int.jsonl"
    pidfile = tmp_path / "pids"
    env = {"DISTPLAN_FAKE_PROBE": json.dumps({"behavior": "ok", "by_id": {
        "zero3/llama-tiny/w2/none/fp32": {"behavior": "hang", "pidfile": str(pidfile)}}})}
    stop = threading.Event()

    def interrupt_when_hanging():  # Ctrl-C once the hanging probe has started (its pidfile exists)
        deadline = time.monotonic() + 120
        while not stop.is_set() and time.monotonic() < deadline:
            if pidfile.exists() and pidfile.read_text().strip():
                time.sleep(0.3)
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.05)

    # Ctrl-C raises KeyboardInterrupt, as in a terminal, also where this process was started with SIGINT
    # ignored (a background command of a shell without job control: `nohup pytest ... &`, xdist workers of it)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    watcher = threading.Thread(target=interrupt_when_hanging, daemon=True)
    watcher.start()
    try:
        r = cli("--strategy", "ddp,zero1,zero3,fsdp", "--out", str(out), "--jobs", "1", "--timeout", "60",
                env=env)
    finally:
        stop.set()
        signal.signal(signal.SIGINT, previous)
    assert r.exit_code == 130, r.output
    assert "interrupted: 2 probes saved" in r.output and "--resume" in r.output
    lines = out.read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(ln)["status"] == "ok" for ln in lines)
    for pid in (int(p) for p in pidfile.read_text().split()):
        deadline = time.monotonic() + 5
        while fake_probe.alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not fake_probe.alive(pid)


@pytest.mark.parametrize("args, flag", [
    (["--strategy", "nope"], "--strategy"),
    (["--tolerance", "-1"], "--tolerance"),
    (["--timeout", "0"], "--timeout"),
    (["--nproc", "0"], "--nproc"),
    (["--precision", "fp8"], "--precision"),
    (["--nnodes", "2"], "--rdzv-endpoint"),
    (["--matrix", "--layers", "4"], "--layers"),
    (["--heads", "5"], "heads"),
])
def test_cli_bad_input_exit_2_one_line(cli, args, flag):
    r = cli(*args)
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    errors = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and flag in errors[0], r.output
    assert r.output.strip() == errors[0], r.output  # one line: no usage banner
    if args[0] == "--strategy":
        assert "'nope'" in errors[0] and "fsdp" in errors[0] and "all" in errors[0]


def test_validate_cmd_imports_no_torch():
    code = ("import sys, distplan.validate.command as m; "
            "assert 'torch' not in sys.modules, 'torch imported'; print(m.validate_command.name)")
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert cp.returncode == 0 and cp.stdout.strip() == "validate", cp.stderr


# -- matrix -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("hw, worlds", [
    (CPU_HW, {("cpu", 2), ("fake", 8)}),
    (dict(CPU_HW, gpus=1, gpu_names=["H100"], gpu_memory_bytes=[80 * 2**30]), {("fake", 2), ("fake", 8)}),
    (dict(CPU_HW, gpus=8, gpu_names=["H100"] * 8), {("gpu", 8), ("fake", 16)}),
])
def test_standard_matrix_covers_strategies_shapes_worlds(hw, worlds):
    # tensor-, context- and pipeline-parallel ones: test_tp_validate.py, test_cp.py, test_pp_validate.py
    specs = [s for s in mx.standard_matrix(hw) if not (s.get("tp") or s.get("cp") or s.get("pp"))]
    assert len({s["id"] for s in specs}) == len(specs)
    assert {s["strategy"] for s in specs} == set(NAMES)
    assert len({s["model"]["name"] for s in specs}) >= 3
    assert {(s["mode"], s["world_size"]) for s in specs if s["strategy"] != "single"} == worlds
    assert {s["world_size"] for s in specs if s["strategy"] == "single"} == {1}
    prec = set(mx.matrix_precisions(hw))
    for name in NAMES:  # each strategy meets every (checkpointing, precision) pair
        pairs = {(s["train"]["checkpointing"], s["train"]["precision"]) for s in specs if s["strategy"] == name}
        assert pairs == {(c, p) for c in ("none", "full") for p in prec}, name
    models = {s["model"]["name"] for s in specs}
    for s in specs:
        assert s["train"]["seq_len"] <= s["model"]["max_positions"]
    full = [s for s in mx.standard_matrix(hw, full=True) if not (s.get("tp") or s.get("cp") or s.get("pp"))]
    assert len(full) == 3 * 4 + (len(NAMES) - 1) * len(models) * 2 * 4
    assert {s["strategy"] for s in mx.standard_matrix(hw, ["fsdp"])} == {"fsdp"}


def test_matrix_shapes_are_valid_models():
    from distplan.planner.model import ModelSpec
    for device in ("cpu", "gpu"):
        kinds = set()
        for name, shape in mx.shapes_for(device).items():
            m = ModelSpec(name=name, **{k: v for k, v in shape.items()})
            kinds.add((m.mlp, m.norm, m.position, m.kv_heads < m.heads, m.tie_embeddings, m.qkv_bias))
        assert len(kinds) == 3


# -- real probe (smoke) -------------------------------------------------------------------------------

def _real_probe_ready() -> bool:
    if not (HERE.parent / "validate" / "probe.py").exists():
        return False
    try:
        from distplan.planner.api import predict_probe  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _real_probe_ready(), reason="validate/probe.py or planner.api.predict_probe absent")
@pytest.mark.slow  # launches a real probe process (seconds)
def test_real_probe_fake_pg_smoke(tmp_path):
    spec = mx.make_spec("ddp", dict(mx.SHAPES_CPU["llama-tiny"], name="llama-tiny"), 2, "fake", steps=1)
    recs = runner.run_validation([spec], str(tmp_path / "r.jsonl"), timeout_s=240)
    m = recs[0]["measurement"]
    assert m["status"] == "ok", m.get("error") or m.get("stderr_tail")
    assert m["memory"]["peak_allocated"] > 0 and m["collectives"]
    assert recs[0]["comparison"]["peak"]["measured"] == m["memory"]["peak_allocated"]


def test_fits_filled_from_device_memory_when_prediction_has_none():
    p = {"memory": {"peak_allocated": 100}}
    assert runner.with_fits(p, 99)["fits"] is False
    assert runner.with_fits(p, 100)["fits"] is True
    assert runner.with_fits(p, None) is p
    assert runner.with_fits(dict(p, fits=True), 1)["fits"] is True


def test_other_node_without_result_is_remote_skip():
    spec = _spec(mode="cpu", behavior="exit0")
    m = runner.run_probe(spec, probe_cmd=FAKE, nnodes=2, rdzv_endpoint="h:1")
    assert m["status"] == "remote"
    assert compare(_exact_prediction(spec), m)["verdict"] == "SKIP"


def test_snapshot_peak_replays_alloc_and_free():
    """validate/snapshot.py: the peak of a trace and the blocks live there (free_completed frees)."""
    from distplan.validate.snapshot import peak_blocks

    ev = lambda action, addr, size: {"action": action, "addr": addr, "size": size, "frames": []}  # noqa: E731
    trace = [ev("alloc", 1, 100), ev("alloc", 2, 50), ev("free_requested", 1, 100), ev("free_completed", 1, 100),
             ev("alloc", 3, 120), ev("alloc", 4, 10), ev("free_completed", 3, 120)]
    peak, at, blocks = peak_blocks({"device_traces": [trace]})
    assert peak == 180 and at == 5 and sorted(b["addr"] for b in blocks) == [2, 3, 4]


def test_fit_check_skips_a_traced_model_it_cannot_predict(monkeypatch):
    """`validate --hf-config` whose trace fails (here: the planner raises) is not a traceback in the fit check:
    the traced spec has no architecture to fall back on, so the probe runs and its record says why it has no
    prediction. A spec of the reference decoder still falls back to 16 bytes per parameter."""
    from distplan.planner import api
    from distplan.validate.probe_specs import _check_fits

    def fail(spec):
        raise ValueError("--hf-config='x': the forward of x failed: RuntimeError: boom")
    monkeypatch.setattr(api, "predict_probe", fail)
    traced = mx.make_spec("zero3", {"name": "hf:x.json"}, 8, "fake")
    traced["module"] = {"hf_config": "x.json", "micro_batch": 1, "seq_len": 64, "layers": None}
    hw = {"gpus": 0, "ram_bytes": 2**30}
    _check_fits([traced], hw, 1)  # no exception
    big = mx.make_spec("ddp", ModelSpec("big", layers=32, hidden=4096, heads=32, kv_heads=32, ffn_hidden=11008,
                                        vocab=32000), 2, "cpu")
    import click
    with pytest.raises(click.UsageError, match="needs about"):
        _check_fits([big], hw, 1)


def test_fit_check_counts_the_model_built_whole_before_wrapping():
    """Every probe builds its model whole in fp32 before FSDP shards it: Mistral-7B as rank 0 of 64 needs
    about 0.5 GB per rank after `fully_shard` but 29 GB while it is built, which a 24 GiB machine cannot hold
    (it would be killed for memory, not refused). Two layers of it fit."""
    import click

    from distplan.validate.probe_specs import _check_fits
    from distplan.validate.runner import _full_param_bytes as _built_bytes
    hf = str(Path(__file__).parent / "data" / "hf" / "mistral-7b.json")
    spec = mx.make_spec("zero3", {"name": "hf:" + hf}, 64, "fake")
    spec["train"]["precision"] = "bf16-mixed"
    spec["module"] = {"hf_config": hf, "micro_batch": 1, "seq_len": 256, "layers": None}
    assert 7.1e9 * 4 < _built_bytes(spec) < 7.3e9 * 4  # 7.24B parameters, fp32
    hw = {"gpus": 0, "ram_bytes": 24 * 2**30}
    with pytest.raises(click.UsageError, match=r"while it is built, before it is wrapped\), more than half"):
        _check_fits([spec], hw, 1, hf_config=hf)
    spec["module"]["layers"] = 2
    _check_fits([spec], hw, 1, hf_config=hf)  # 2 of 32 layers: about 2 GB while built
    assert _built_bytes(dict(spec, module={"hf_config": None})) == 0  # a --module factory: not known
