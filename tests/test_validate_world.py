"""The world a validation run picks by itself: a --tp/--cp mesh with a data-parallel dimension, and the RAM
the fit check measures against."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from distplan.validate import runner
from distplan.validate.command import validate_command

CPU = {"torch_version": "2.13.0", "gpus": 0, "gpu_names": [], "gpu_memory_bytes": [], "cpu_count": 2,
       "ram_bytes": 24 * 2**30}


@pytest.fixture
def cpu_machine(monkeypatch):
    monkeypatch.setattr(runner, "detect_hardware", lambda: dict(CPU))


def dry_run(*args):
    return CliRunner().invoke(validate_command, ["--dry-run", *args])


@pytest.mark.parametrize("tp, world", [(2, 4), (4, 8)])
def test_tp_with_a_sharded_strategy_picks_the_world_its_mesh_needs(cpu_machine, tp, world):
    r = dry_run("--strategy", "zero3", "--tp", str(tp), "--kv-heads", "4")
    assert r.exit_code == 0, r.output
    assert f"needs {world} ranks: running {world} processes (as --nproc {world})" in r.output
    assert f"/w{world}/tp{tp}/" in r.output
    assert f"CPU, gloo, {world} processes" in r.output


def test_an_explicit_world_is_kept_and_checked(cpu_machine):
    r = dry_run("--strategy", "zero3", "--tp", "2", "--nproc", "2")
    assert r.exit_code == 2 and "needs a world of 2 x 2 ranks" in r.output, r.output
    r = dry_run("--strategy", "zero3", "--tp", "2", "--simulate-world-size", "8")
    assert r.exit_code == 0 and "zero3/llama-tiny/w8-fake/tp2/" in r.output, r.output


def test_tp_alone_keeps_its_default_strategies_on_the_default_world(cpu_machine):
    r = dry_run("--tp", "2")
    assert r.exit_code == 0, r.output
    assert "needs 4 ranks" not in r.output and "CPU, gloo, 4 processes" not in r.output


def test_two_gpus_run_a_tp_4_mesh_on_the_fake_process_group(monkeypatch):
    two = dict(CPU, gpus=2, gpu_names=["NVIDIA H100 80GB HBM3"] * 2, gpu_memory_bytes=[80 * 10**9] * 2, bf16=True)
    monkeypatch.setattr(runner, "detect_hardware", lambda: two)
    r = dry_run("--strategy", "zero2", "--tp", "2")
    assert r.exit_code == 0, r.output
    assert "this machine has 2 GPU(s): probing rank 0 of 4 on the fake process group" in r.output
    assert "/w4-fake/tp2/" in r.output


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="Linux's /proc/meminfo")
def test_free_ram_is_what_linux_calls_available():
    with open("/proc/meminfo") as f:
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    got = runner.available_ram_bytes()
    # read at another instant than the test's: within 1% of MemAvailable, and above MemFree where the page
    # cache holds anything
    assert abs(got - fields["MemAvailable"]) <= 0.01 * fields["MemTotal"]
    if fields["MemAvailable"] - fields["MemFree"] > 0.02 * fields["MemTotal"]:
        assert got > fields["MemFree"] + 0.01 * fields["MemTotal"]


# -- an --hf-config probe scaled to the machine ---------------------------------------------------------------

LLAMA3 = os.path.join(os.path.dirname(__file__), "data", "hf", "llama-3-8b.json")


def _header(output: str) -> str:
    return output.splitlines()[0]


@pytest.mark.slow
def test_a_7b_config_is_scaled_to_a_24_gib_machine(cpu_machine):
    pytest.importorskip("transformers")
    r = dry_run("--hf-config", LLAMA3)
    assert r.exit_code == 0, r.output
    # 2 gloo ranks of ddp within half of 24 GiB: one layer and a 2,048-token vocabulary (SCALE_LADDER)
    assert "1 of 32 layers, vocabulary 2,048 of 128,256, scaled to this machine's memory" in _header(r.output)


@pytest.mark.slow
def test_a_machine_with_room_runs_the_model_as_configured(monkeypatch):
    pytest.importorskip("transformers")
    big = dict(CPU, ram_bytes=2**42)
    monkeypatch.setattr(runner, "detect_hardware", lambda: big)
    r = dry_run("--hf-config", LLAMA3, "--strategy", "zero3")
    assert r.exit_code == 0, r.output
    assert "(transformers, all layers)" in _header(r.output)


def test_given_layers_are_kept_and_the_error_names_the_flags(cpu_machine):
    pytest.importorskip("transformers")
    r = dry_run("--hf-config", LLAMA3, "--layers", "4", "--strategy", "single")
    assert r.exit_code == 2, r.output
    line = r.output.strip().splitlines()[-1]
    assert "more than half the free RAM (12.00 GiB)" in line and "--vocab" in line, line


def test_vocab_applies_under_the_trace(cpu_machine):
    pytest.importorskip("transformers")
    r = dry_run("--hf-config", LLAMA3, "--layers", "1", "--vocab", "4096", "--strategy", "single")
    assert r.exit_code == 0, r.output
    assert "(transformers, 1 layers, vocabulary 4,096)" in _header(r.output)


def test_a_workload_with_its_vocabulary_replaced():
    pytest.importorskip("transformers")
    from distplan.planner.workload.traced_model import HFWorkload, from_spec
    phi3 = os.path.join(os.path.dirname(__file__), "data", "hf", "phi-3-mini.json")  # pad_token_id 32000
    w = HFWorkload(phi3, 2, 64, layers=1, vocab=1024)
    cfg = w.config()
    assert cfg.vocab_size == 1024 and cfg.pad_token_id is None  # padding_idx must lie in the table
    assert from_spec(w.to_spec()).vocab_size == 1024 and "vocab 1024" in w.label
    assert "vocab" not in HFWorkload(phi3, 2, 64).to_spec()
    assert HFWorkload(phi3, 2, 64).config().pad_token_id == 32000
