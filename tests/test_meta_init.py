"""FSDP probes of a transformers model built on the meta device (`distplan validate --hf-config ... --init meta`,
the default for FSDP with --hf-config): the model is built under `torch.device("meta")`, wrapped there, and only
then made on the device (validate/wrap.py `materialize`: FSDP2 `to_empty` of this rank's shards, FSDP1 one unit
at a time through `param_init_fn`), as torchtitan builds it and as `distplan estimate --hf-config` plans it.
The recorded probes at a real vocabulary's proportions, built both ways, are judged in tests/test_hf_reserved.py.
"""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from distplan.planner.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF = os.path.join(ROOT, "examples", "hf")


def _specs(tmp_path, *args) -> list[dict]:
    """The probe specs `validate ARGS` would run (captured at the runner, nothing runs)."""
    from distplan.validate import runner
    specs: list = []
    mp = pytest.MonkeyPatch()
    mp.setattr(runner, "run_validation", lambda s, *a, **k: specs.extend(s) or [])
    try:
        r = CliRunner().invoke(main, ["validate", *args, "--out", str(tmp_path / "x.jsonl")])
        assert r.exit_code == 0, r.output
    finally:
        mp.undo()
    return specs


def test_hf_fsdp_probes_build_on_meta_by_default_and_say_so(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    cfg = os.path.join(HF, "llama-8l.json")
    common = ["--hf-config", cfg, "--strategy", "ddp,zero3,fsdp", "--seq-len", "64", "--simulate-world-size", "8"]
    specs = {s["strategy"]: s for s in _specs(tmp_path, *common)}
    assert "init" not in specs["ddp"] and not specs["ddp"]["id"].endswith("/init=meta")
    for s in ("zero3", "fsdp"):
        assert specs[s]["init"] == "meta" and specs[s]["id"].endswith("/init=meta"), specs[s]
    device = {s["strategy"]: s for s in _specs(tmp_path, *common, "--init", "device")}
    assert all("init" not in s and "init=meta" not in s["id"] for s in device.values())


@pytest.mark.parametrize("args", [
    ["--params", "10M", "--init", "meta"],  # the reference decoder is built on the device
    ["--hf-config", os.path.join(HF, "llama-8l.json"), "--tp", "2", "--init", "meta", "--simulate-world-size", "4"],
])
def test_init_refused_where_the_probe_builds_on_the_device(args, tmp_path):
    r = CliRunner().invoke(main, ["validate", *args, "--dry-run", "--out", str(tmp_path / "r.jsonl")])
    assert r.exit_code == 2, r.output
    assert "--init" in r.output and "'meta'" in r.output and r.output.strip().count("\n") == 0, r.output


def _construction(strategy: str, init: str, tmp_path, tied: bool = False) -> tuple[dict, int]:
    """(measurement, bytes live before the first collective) of a 4-layer Llama probe, rank 0 of 8."""
    from distplan.validate.runner import run_probe
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
                               "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 512,
                               "rms_norm_eps": 1e-05, "hidden_act": "silu", "tie_word_embeddings": tied}))
    spec = {"id": f"{strategy}/{init}", "strategy": strategy, "world_size": 8, "gpus_per_node": 8, "mode": "fake",
            "device_type": "cpu", "steps": 1, "seed": 0, "init": init, "model": {"name": "hf:tiny"},
            "train": {"seq_len": 64, "micro_batch": 1, "precision": "fp32", "optimizer": "adamw",
                      "optimizer_impl": "foreach", "checkpointing": "none"},
            "module": {"hf_config": str(cfg), "micro_batch": 1, "seq_len": 64, "layers": None}}
    path = tmp_path / f"{strategy}-{init}-{tied}.json"
    m = run_probe(spec, env={"DISTPLAN_ALLOC_EVENTS": str(path)}, timeout_s=300)
    events = json.loads(path.read_text())
    live, peak = {}, 0
    for e in events:
        if e[0] == "comm":
            break
        if e[0] == "alloc":
            live[e[1]] = e[2]
            peak = max(peak, sum(live.values()))
        elif e[0] == "free":
            live.pop(e[1], None)
    return m, peak


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_a_meta_built_probe_never_holds_the_whole_model(strategy, tmp_path):
    """Built on the device, the whole model (11.5 MB in fp32) is live before FSDP shards it; built on the meta
    device, FSDP2 makes only this rank's eighth, and FSDP1 one unit at a time (at most the root's 4.2 MB embedding
    and head, and its flat parameter while the originals live), beside the shards made so far. Up to the first
    collective (the first all-gather's output included): measured 3.5 MB (zero3) and 5.9 MB (fsdp). Both train to
    the same peak (the step's)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    dev, whole = _construction(strategy, "device", tmp_path)
    meta, built = _construction(strategy, "meta", tmp_path)
    assert dev["status"] == meta["status"] == "ok", (dev.get("error"), meta.get("error"))
    params = 4 * (2 * 1024 * 256 + 4 * (256 * 256 * 2 + 2 * 256 * 128 + 3 * 256 * 512 + 2 * 256) + 256)
    assert whole >= params
    assert built < params / 1.9, (built, params)
    assert meta["memory"]["peak_allocated"] == dev["memory"]["peak_allocated"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_a_meta_built_probe_keeps_tied_embeddings_tied(strategy, tmp_path):
    """The LM head's weight is the embedding's: made once on the device (FSDP1: wrap.unit_materializer; FSDP2
    re-ties the shared parameter itself), so the meta-built run holds what the device-built one does. Before
    the unit materializer, FSDP1 held one embedding more (transformers' Qwen2 8 layers: params +13.1%)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    dev, _ = _construction(strategy, "device", tmp_path, tied=True)
    meta, _ = _construction(strategy, "meta", tmp_path, tied=True)
    assert dev["status"] == meta["status"] == "ok", (dev.get("error"), meta.get("error"))
    assert meta["memory"]["peak_allocated"] == dev["memory"]["peak_allocated"]
    assert meta["memory"]["components"]["params"] == dev["memory"]["components"]["params"]
