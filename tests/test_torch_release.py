"""The PyTorch release a plan follows (planner/config.py `torch_release`, `fsdp2_reduce_keeps_last_grad`):
read from the installed torch without importing it, overridable per plan and per probe record."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from distplan.planner.api import plan
from distplan.planner.config import NEWEST_TORCH, TrainConfig, fsdp2_reduce_keeps_last_grad, torch_release
from distplan.planner.model import ModelSpec
from distplan.validate.results import record_spec

TINY = ModelSpec("t", layers=2, hidden=256, heads=4, kv_heads=4, ffn_hidden=512, vocab=4096)


@pytest.mark.parametrize("text, release", [("2.15", (2, 15)), ("2.13.0+cpu", (2, 13)), ("2.15.0+cu132", (2, 15)),
                                            ("2.16.0.dev20261101", (2, 16)), ("2.16.0a0+git1234abc", (2, 16)),
                                            ("3.0", (3, 0))])
def test_release_numbers(text, release):
    assert torch_release(text) == release


@pytest.mark.parametrize("text", ["latest", "2", "v2.15", "2.15 ", "two.fifteen"])
def test_anything_else_is_one_line_naming_the_flag(text):
    with pytest.raises(ValueError) as e:
        torch_release(text, "--torch-version")
    assert str(e.value).startswith("--torch-version=") and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="torch_version="):
        TrainConfig(TINY, torch_version=text)


def test_installed_release_is_read_without_importing_torch():
    code = ("import sys; from distplan.planner.config import installed_torch, torch_release; "
            "v = installed_torch(); print(v, torch_release(), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    try:
        import torch
    except ImportError:
        assert out[:1] == ["(2,"] or out[0] == "", out  # no torch: NEWEST_TORCH is assumed
        return
    assert out[0] == torch.__version__ and out[-1] == "False"


def test_fsdp2_rule_changes_at_2_15():
    assert fsdp2_reduce_keeps_last_grad(TrainConfig(TINY, torch_version="2.14"))
    assert fsdp2_reduce_keeps_last_grad(TrainConfig(TINY, torch_version="2.11.0+cu130"))
    assert not fsdp2_reduce_keeps_last_grad(TrainConfig(TINY, torch_version="2.15"))
    assert NEWEST_TORCH >= (2, 15)


def test_plan_says_which_release_it_followed_and_only_fsdp2_moves():
    kw = dict(gpus=8, gpu="h100-sxm", seq_len=1024, micro_batch=1, activation_checkpointing="full")
    old, new = (plan("llama-3-8b", torch_version=v, **kw) for v in ("2.14", "2.15"))
    assert old.to_dict()["inputs"]["train"]["torch_version"] == "2.14"
    auto = plan("llama-3-8b", **kw).to_dict()["inputs"]["train"]["torch_version"]
    assert torch_release(auto) == torch_release()  # "" is written out as the release followed
    by_name = {r.name: r for r in old.results}, {r.name: r for r in new.results}
    for name in ("ddp", "zero1", "fsdp", "fsdp-grad-op"):  # not FSDP2: identical
        assert by_name[0][name].memory.peak_allocated == by_name[1][name].memory.peak_allocated, name
    # FSDP2 under 2.15 frees the last unsharded gradient with the others: never more memory than 2.14
    assert by_name[1]["zero3"].memory.peak_allocated <= by_name[0]["zero3"].memory.peak_allocated


def test_record_spec_carries_the_records_torch():
    rec = {"inputs": {"id": "x", "strategy": "zero3"}, "torch_version": "2.15.0+cu132",
           "measurement": {"torch_version": "2.15.0+cu132"}}
    assert record_spec(rec)["torch_version"] == "2.15.0+cu132"
    assert "torch_version" not in rec["inputs"]  # a copy
    rec["inputs"]["torch_version"] = "2.13.0+cpu"  # a spec that names one keeps it
    assert record_spec(rec)["torch_version"] == "2.13.0+cpu"
    assert json.dumps(record_spec({"inputs": {"id": "y"}})) == '{"id": "y"}'
