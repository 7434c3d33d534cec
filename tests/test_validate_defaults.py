"""`distplan validate` on any machine (issue 14): the default world on a one-GPU (or one-rank) machine,
what the verdict says, the results file it will and will not touch, user code that raises or exits,
and small input checks. Fast: probes are `tests/fake_probe.py`; no torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import fake_probe  # noqa: E402

from distplan.validate.command import validate_command  # noqa: E402
from distplan.validate.render import _param_count, _worst_cell  # noqa: E402
from distplan.validate import matrix as mx  # noqa: E402
from distplan.validate import runner  # noqa: E402
from distplan.validate.compare import compare  # noqa: E402
from distplan.validate.results import SCHEMA, ResultsFile, check_results_path, read_records  # noqa: E402

FAKE = [sys.executable, str(HERE / "fake_probe.py")]
CPU_HW = {"torch_version": "0.0-fake", "gpus": 0, "gpu_names": [], "gpu_memory_bytes": [], "bf16": True,
          "cpu_count": 2, "ram_bytes": 8 * 2**30}


def gpu_hw(n: int) -> dict:
    return dict(CPU_HW, gpus=n, gpu_names=["NVIDIA H100 80GB HBM3"] * n, gpu_memory_bytes=[80 * 2**30] * n)


def _exact_prediction(spec, **extra):
    r = fake_probe.result_for(spec)
    mem = dict(r["memory"]["components"], peak_allocated=r["memory"]["peak_allocated"], peak_phase="optimizer")
    return dict({"memory": mem, "collectives": r["collectives"], "step_time_s": None}, **extra)


@pytest.fixture
def cli(monkeypatch, tmp_path):
    """validate with fake probes; `hw` is what the command sees as this machine (GPU count included)."""
    state = {"hw": dict(CPU_HW), "predict": _exact_prediction}
    monkeypatch.setattr(runner, "detect_hardware", lambda *a, **k: dict(state["hw"]))
    monkeypatch.setattr(runner, "default_predict", lambda spec: state["predict"](spec))
    monkeypatch.chdir(tmp_path)

    def invoke(*args, hw=None, predict=None, env=None):
        state["hw"] = dict(hw or CPU_HW)
        state["predict"] = predict or _exact_prediction
        return CliRunner().invoke(validate_command, ["--probe-cmd", " ".join(FAKE), *args], env=env,
                                  catch_exceptions=False)
    return invoke


def _probes(r) -> list[dict]:
    return json.loads(r.stdout)["probes"]


# -- 1. the default world -----------------------------------------------------------------------------

def test_one_gpu_runs_distributed_strategies_as_rank_0_of_8_on_the_fake_process_group(cli):
    r = cli("--strategy", "fsdp", "--strategy", "zero2", "--strategy", "ddp", "--json", hw=gpu_hw(1))
    assert r.exit_code == 0, r.output
    probes = _probes(r)
    assert [p["inputs"]["strategy"] for p in probes] == ["fsdp", "zero2", "ddp"]
    assert {(p["inputs"]["mode"], p["inputs"]["world_size"]) for p in probes} == {("fake", runner.DEFAULT_FAKE_WORLD)}
    assert all(p["verdict"] == "PASS" for p in probes)
    said = [ln for ln in r.output.splitlines() if "1 GPU here" in ln]
    assert len(said) == 1 and "fake process group" in said[0] and "--simulate-world-size" in said[0], r.output


def test_single_stays_one_rank_and_two_gpus_run_torchrun(cli):
    r = cli("--strategy", "single,ddp", "--json", hw=gpu_hw(1))
    worlds = {p["inputs"]["strategy"]: (p["inputs"]["mode"], p["inputs"]["world_size"]) for p in _probes(r)}
    assert worlds == {"single": ("gpu", 1), "ddp": ("fake", runner.DEFAULT_FAKE_WORLD)}
    r = cli("--strategy", "ddp", "--json", hw=gpu_hw(2))
    assert [(p["inputs"]["mode"], p["inputs"]["world_size"]) for p in _probes(r)] == [("gpu", 2)]
    assert "GPU here" not in r.output


def test_cpu_with_one_rank_and_an_explicit_world(cli):
    r = cli("--strategy", "zero3", "--nproc", "1", "--json")
    assert [(p["inputs"]["mode"], p["inputs"]["world_size"]) for p in _probes(r)] == [("fake", 8)]
    assert sum("--nproc 1" in ln and "fake process group" in ln for ln in r.output.splitlines()) == 1
    r = cli("--strategy", "zero3", "--simulate-world-size", "4", "--json", hw=gpu_hw(1))
    assert [(p["inputs"]["mode"], p["inputs"]["world_size"]) for p in _probes(r)] == [("fake", 4)]
    assert "GPU here" not in r.output  # asked for: nothing to explain
    r = cli("--strategy", "zero3", "--json")  # CPU default: 2 gloo ranks, as before
    assert [(p["inputs"]["mode"], p["inputs"]["world_size"]) for p in _probes(r)] == [("cpu", 2)]


def test_choose_mode_explains_only_the_fallback():
    assert runner.choose_mode(gpu_hw(1), explain=True)[:2] == ("fake", 8)
    assert runner.choose_mode(gpu_hw(1), explain=True)[2]
    assert runner.choose_mode(gpu_hw(4), explain=True) == ("gpu", 4, None)
    assert runner.choose_mode(gpu_hw(1), nnodes=2, explain=True) == ("gpu", 2, None)
    assert runner.choose_mode(CPU_HW, explain=True) == ("cpu", 2, None)
    with pytest.raises(ValueError, match="4096"):
        runner.choose_mode(CPU_HW, simulate_world_size=runner.MAX_FAKE_WORLD + 1)


# -- 2. what the verdict says -------------------------------------------------------------------------

def _measured(**comps):
    base = {"params": 4 << 20, "grads": 30 << 10, "optimizer": 8 << 20, "activations": 6 << 20,
            "comm_buffers": 0, "temporaries": 2 << 20}
    base.update(comps)
    return {"status": "ok", "memory": {"peak_allocated": sum(base.values()), "peak_phase": "backward",
                                       "components": base}, "collectives": [], "unmeasured": []}


def _pred(measured, **comps):
    m = dict(measured["memory"]["components"], **comps)
    return {"memory": dict(m, peak_allocated=sum(m.values()), peak_phase="backward"), "collectives": []}


def test_worst_component_says_which_rule_judged_it():
    meas = _measured()
    c = compare(_pred(meas, grads=18 << 10), meas, 0.05)  # -40%, -12 KiB
    assert c["verdict"] == "PASS" and c["worst_component"] == "grads"
    assert _worst_cell(c) == "grads -40.0% (-12.00 KiB, under the 64 KiB floor)"
    meas = _measured(grads=2 << 20, temporaries=1 << 20)
    c = compare(_pred(meas, grads=(2 << 20) - (200 << 10), temporaries=(1 << 20) + (200 << 10)), meas, 0.05)
    assert c["verdict"] == "PASS", c["reasons"]
    assert _worst_cell(c) == "temporaries +19.5% (+200.00 KiB; with grads within 10%)"
    c = compare(_pred(meas, activations=3 << 20), meas, 0.05)
    assert c["verdict"] == "FAIL"
    assert _worst_cell(c) == "activations -50.0% (-3.00 MiB, beyond 10% and the 64 KiB floor)"
    c = compare(_pred(meas, optimizer=(8 << 20) + 4096), meas, 0.05)
    assert _worst_cell(c).startswith("optimizer +0.0%") and "(" not in _worst_cell(c)  # inside 10%: no note


def test_failed_probe_reasons_in_full_model_described_fail_explained(cli):
    def off(spec):  # every collective a call short, every component 30% over: long reasons
        p = _exact_prediction(spec)
        p["memory"] = {k: (int(v * 1.3) if isinstance(v, int) else v) for k, v in p["memory"].items()}
        p["collectives"] = [dict(c, calls=c["calls"] - 1) for c in p["collectives"]]
        return p

    r = cli("--strategy", "ddp,zero3", predict=off)
    assert r.exit_code == 1
    out = r.output
    reasons = [x for rec in read_records("distplan-results.jsonl") for x in rec["comparison"]["reasons"]]
    assert any(len(x) > 70 for x in reasons)
    for x in reasons:  # nothing cut
        assert x in out, x
    assert "FAIL means" in out and "disagree" in out
    shape = mx.SHAPES_CPU["llama-tiny"]
    about = [ln for ln in out.splitlines() if "llama-tiny: the default probe model" in ln]
    assert len(about) == 1
    n = _param_count(dict(shape, name="llama-tiny"))
    assert f"{shape['layers']} layers" in about[0] and f"hidden {shape['hidden']}" in about[0]
    assert f"{n / 1e3:.2f}K parameters" in about[0]
    r = cli("--strategy", "ddp")
    assert r.exit_code == 0 and "FAIL means" not in r.output


# -- 4. the results file -------------------------------------------------------------------------------

def test_a_file_that_is_not_ours_is_refused_untouched_before_anything_runs(cli, tmp_path):
    big = tmp_path / "big.txt"
    big.write_bytes(b"x" * 400_000)  # one line, no newline
    not_record = tmp_path / "other.jsonl"
    not_record.write_bytes(b'{"foo": 1}\n{"bar": 2}')
    for f in (big, not_record):
        before = f.read_bytes()
        r = cli("--strategy", "ddp", "--out", str(f))
        assert r.exit_code == 2, r.output
        assert r.output.strip().count("\n") == 0 and r.output.startswith("Error: --out=")
        assert "not a distplan validate results file" in r.output
        assert "distplan validate:" not in r.output  # refused before the header, so before any probe
        assert f.read_bytes() == before
    with pytest.raises(ValueError):
        ResultsFile(str(big))
    assert big.read_bytes() == b"x" * 400_000


def test_out_path_checked_up_front(cli, tmp_path):
    (tmp_path / "afile").write_text("")
    for out, why in (("", "empty"), (str(tmp_path), "directory"),
                     (str(tmp_path / "afile" / "r.jsonl"), "not a directory")):
        r = cli("--strategy", "ddp", "--out", out)
        assert r.exit_code == 2 and why in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1 and "distplan validate:" not in r.output


def test_complete_last_record_without_newline_is_kept(tmp_path):
    out = tmp_path / "r.jsonl"

    def rec(i):
        return json.dumps({"schema": SCHEMA, "id": i, "status": "ok"})
    out.write_text(rec("a") + "\n" + rec("b"))
    rf = ResultsFile(str(out))
    assert rf.repaired_bytes == 0
    rf.append({"id": "c", "status": "ok"})
    assert [r["id"] for r in read_records(str(out))] == ["a", "b", "c"]
    # a record cut mid-write (ours: it starts with the schema key) is cut; a stranger's tail is not
    out.write_text(rec("a") + "\n" + rec("b")[:30])
    assert ResultsFile(str(out)).repaired_bytes == 30
    out.write_text(rec("a") + "\nsomething else")
    with pytest.raises(ValueError, match="line 2"):
        check_results_path(str(out))
    assert out.read_text().endswith("something else")


# -- 6. user code --------------------------------------------------------------------------------------

USER = textwrap.dedent("""
    import sys
    import torch.nn as nn

    def exits():
        sys.exit(0)

    def exits3():
        sys.exit(3)

    def raises():
        raise RuntimeError("factory broke")

    def noparams():
        return nn.Sequential(nn.ReLU(), nn.Flatten())

    class ExitForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 2)

        def forward(self, x):
            sys.exit(0)

    def exit_forward():
        return ExitForward()

    def ok():
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
""")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    name = f"usermods_{os.getpid()}_{abs(hash(str(tmp_path))) % 10**6}"
    (tmp_path / f"{name}.py").write_text(USER)
    (tmp_path / f"{name}_exit.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for m in (name, f"{name}_exit"):
        sys.modules.pop(m, None)


@pytest.mark.parametrize("factory, words", [
    ("exits", "the factory called sys.exit(0)"),
    ("exits3", "the factory called sys.exit(3)"),
    ("raises", "the factory raised RuntimeError: factory broke"),
    ("noparams", "has no parameters"),
    ("exit_forward", "called sys.exit(0)"),
])
def test_user_code_that_exits_or_raises_is_one_line_exit_2(cli, user_module, factory, words):
    pytest.importorskip("torch")
    from distplan.planner.cli import main

    r = cli("--module", f"{user_module}:{factory}", "--input-shape", "2,4", "--strategy", "ddp")
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines() == [r.output.strip()] and words in r.output, r.output
    assert "distplan validate:" not in r.output  # before any probe
    r = CliRunner().invoke(main, ["estimate", "--module", f"{user_module}:{factory}", "--input-shape", "2,4"])
    assert r.exit_code == 2, r.output
    assert r.output.startswith("Error: ") and words in r.output and "Traceback" not in r.output


def test_module_that_exits_on_import_is_one_line(cli, user_module):
    pytest.importorskip("torch")
    from distplan.planner.cli import main

    r = CliRunner().invoke(main, ["estimate", "--module", f"{user_module}_exit:f", "--input-shape", "2,4"])
    assert r.exit_code == 2 and "called sys.exit(0)" in r.output, r.output
    r = cli("--module", f"{user_module}_exit:f", "--input-shape", "2,4")
    assert r.exit_code == 2 and "called sys.exit(0)" in r.output, r.output


def test_good_module_still_validates(cli, user_module):
    pytest.importorskip("torch")
    r = cli("--module", f"{user_module}:ok", "--input-shape", "2,4", "--strategy", "ddp", "--json")
    assert r.exit_code == 0, r.output
    assert _probes(r)[0]["inputs"]["module"]["factory"] == f"{user_module}:ok"


# -- 3. NumPy warning ----------------------------------------------------------------------------------

@pytest.mark.slow  # launches a real probe process (seconds)
def test_numpy_warning_silenced_and_nothing_else(tmp_path):
    """A NumPy that fails to import makes `import torch` warn; the validate path filters exactly that."""
    pytest.importorskip("torch")
    fake = tmp_path / "numpy"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ModuleNotFoundError('no numpy here')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    plain = subprocess.run([sys.executable, "-c", "import torch; torch.zeros(1)"], capture_output=True,
                           text=True, env=env)
    assert "Failed to initialize NumPy" in plain.stderr  # the warning this test is about exists
    for first in ("distplan.validate.probe", "distplan.planner.workload.traced_model"):  # a probe; the trace
        ours = subprocess.run([sys.executable, "-c", f"import {first}, torch, warnings; "
                               "torch.zeros(1); warnings.warn('another warning')"],
                              capture_output=True, text=True, env=env)
        assert ours.returncode == 0, ours.stderr
        assert "Failed to initialize NumPy" not in ours.stderr, first
        assert "UserWarning: another warning" in ours.stderr, first


# -- 7. small input checks -----------------------------------------------------------------------------

@pytest.mark.parametrize("args, words", [
    (["--strategy", ""], ["--strategy", "accepted: all", "fsdp"]),
    (["--strategy", ","], ["--strategy", "accepted: all"]),
    (["--simulate-world-size", "1000000000"], ["--simulate-world-size", "4096"]),
    (["--nnodes", "2"], ["--rdzv-endpoint"]),
    (["--matrix", "--layers", "4"], ["--layers"]),
    (["--input-shape", "2,4"], ["--module"]),
])
def test_user_errors_are_one_line(cli, args, words):
    r = cli(*args)
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.output
    for w in words:
        assert w in lines[0], r.output


# -- the hardware record without importing torch where no GPU can be seen ---------------------------------

def _fake_torch(tmp_path, monkeypatch, cuda: str | None, hip: str | None = None):
    """An installed torch as `runner.gpu_free_hardware` sees it: its version.py."""
    (tmp_path / "version.py").write_text(textwrap.dedent(f"""\
        from typing import Optional
        __version__ = '2.99.0+test'
        debug = False
        cuda: Optional[str] = {cuda!r}
        hip: Optional[str] = {hip!r}
        """))
    monkeypatch.setattr(runner, "_torch_version_file", lambda: str(tmp_path / "version.py"))
    for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)


def test_gpu_free_hardware_cpu_build(tmp_path, monkeypatch):
    _fake_torch(tmp_path, monkeypatch, cuda=None)
    hw = runner.gpu_free_hardware()
    assert hw == {"torch_version": "2.99.0+test", "gpus": 0, "gpu_names": [], "gpu_memory_bytes": [],
                  "bf16": True, "cpu_count": os.cpu_count()}


@pytest.mark.parametrize("visible, hidden", [("", True), (" ", True), ("-1", True), ("-1,0", True),
                                             ("0", False), ("0,1", False), ("GPU-1234", False)])
def test_gpu_free_hardware_cuda_build_follows_visible_devices(tmp_path, monkeypatch, visible, hidden):
    _fake_torch(tmp_path, monkeypatch, cuda="13.0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(runner.os.path, "exists", lambda p: True)  # a driver is there
    hw = runner.gpu_free_hardware()
    assert (hw is not None) == hidden
    if hidden:
        assert hw["gpus"] == 0 and hw["torch_version"] == "2.99.0+test"


def test_gpu_free_hardware_cuda_build_without_driver(tmp_path, monkeypatch):
    _fake_torch(tmp_path, monkeypatch, cuda="13.0")
    real_exists = os.path.exists
    monkeypatch.setattr(runner.os.path, "exists", lambda p: False if p == "/dev/nvidiactl" else real_exists(p))
    assert (runner.gpu_free_hardware() is not None) == sys.platform.startswith("linux")
    monkeypatch.setattr(runner.os.path, "exists", lambda p: True if p == "/dev/nvidiactl" else real_exists(p))
    assert runner.gpu_free_hardware() is None  # torch must be asked


def test_gpu_free_hardware_rocm_build(tmp_path, monkeypatch):
    _fake_torch(tmp_path, monkeypatch, cuda=None, hip="6.2")
    assert runner.gpu_free_hardware() is None
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "")
    assert runner.gpu_free_hardware()["gpus"] == 0


def test_gpu_free_hardware_no_torch(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "_torch_version_file", lambda: None)
    assert runner.gpu_free_hardware() is None  # the subprocess says why torch cannot be imported
    monkeypatch.setattr(runner, "_torch_version_file", lambda: str(tmp_path / "missing.py"))
    assert runner.gpu_free_hardware() is None


def test_gpu_free_hardware_agrees_with_torch_here():
    """Where the shortcut applies on this machine, it says what torch itself says (the subprocess)."""
    pytest.importorskip("torch")
    fast = runner.gpu_free_hardware()
    if fast is None:
        pytest.skip("torch may see a GPU here: the subprocess answers")
    proc = subprocess.run([sys.executable, "-c", runner._HW_SCRIPT], capture_output=True, text=True, timeout=120)
    assert json.loads(proc.stdout.splitlines()[-1]) == fast
