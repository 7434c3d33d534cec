"""CPU offload (`--cpu-offload params`) as FSDP1 and FSDP2 implement it, from torch's source: FSDP2's
`foreach_reduce` (_fsdp_collectives.py) copies each new gradient shard to the CPU and keeps none on the
GPU; FSDP1's `_offload_grad` (fsdp/_runtime_utils.py) copies it to `_cpu_grad` and keeps the GPU shard in
`_saved_grad_shard` until `prepare_gradient_for_optim` at the end of backward. Not probed (on a CPU device
host and device memory are one): these check that the walk follows the two implementations apart."""

from __future__ import annotations

import pytest

from distplan.planner.api import resolve_model
from distplan.planner.config import Cluster, TrainConfig
from distplan.planner.memory import estimate_memory


def test_cpu_offload_gradient_shards_follow_the_implementation():
    """--cpu-offload params: FSDP2 (zero3) keeps no gradient shard on the GPU (foreach_reduce copies each to
    the CPU), FSDP1 (fsdp) keeps them in `_saved_grad_shard` to the end of backward. Llama-3-8B, 8 GPUs."""
    t = TrainConfig(resolve_model("llama-3-8b")[0], seq_len=4096, precision="bf16-mixed", checkpointing="full",
                    cpu_offload="params")
    z3 = estimate_memory(t, Cluster(gpus=8), "zero3")
    f1 = estimate_memory(t, Cluster(gpus=8), "fsdp")
    m = t.model
    head_grad = m.vocab * m.hidden * 2  # the LM head's bf16 gradient, unsharded until the root reduces
    assert z3.components["params"] == 0 and z3.components["optimizer"] == 0
    assert z3.components["grads"] <= head_grad
    shards = m.param_count() * 4 // 8  # fp32 gradient shards of one rank
    assert f1.components["grads"] >= 0.9 * shards
    assert z3.reserved_source == "10% margin" and any("CPU offload" in n for n in z3.notes)


def test_validate_wires_offload_for_gpu_probes_and_refuses_it_on_the_cpu(tmp_path, monkeypatch):
    """`distplan validate --cpu-offload params`: on a machine without a GPU a one-line refusal (exit 2);
    a probe spec carrying it is predicted with the offload (no parameter or optimizer bytes on the GPU)."""
    from click.testing import CliRunner

    from distplan.planner.api import predict_probe
    from distplan.planner.cli import main
    from distplan.validate import matrix as mx

    r = CliRunner().invoke(main, ["validate", "--strategy", "zero3", "--cpu-offload", "params",
                                  "--out", str(tmp_path / "r.jsonl")])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "--cpu-offload" in r.output and "needs a GPU" in r.output
    spec = mx.make_spec("zero3", resolve_model("llama-3-8b", overrides={"layers": 2})[0], 8, "fake")
    spec["train"]["cpu_offload"] = "params"
    got = predict_probe(spec)["memory"]
    assert got["params"] == 0 and got["optimizer"] == 0
    spec["train"]["cpu_offload"] = "none"
    assert predict_probe(spec)["memory"]["params"] > 0


def test_offload_must_fit_the_nodes_cpu_memory():
    """Offload moves parameters, gradients and optimizer state to the node's CPU memory, which is finite:
    Llama-3-405B (16 bytes per parameter: 6.5 TB) does not fit one DGX H100's 2 TB even where each GPU
    would hold its share, and fits over 4 nodes (1.6 TB each). Where the catalog has no memory for the
    node the plan says it did not check."""
    from distplan.planner.api import plan

    def zero3(gpus, node="dgx-h100"):
        p = plan("llama-3-405b", gpus=gpus, node=node, cpu_offload="params", activation_checkpointing="full",
                 strategies=["zero3"], comm=False)
        return p["zero3"].memory
    one, four = zero3(8), zero3(32)
    assert one.host_memory_bytes == 2048 * 2**30
    # fp32 parameter + fp32 gradient + AdamW's two fp32 states per parameter, over the node's 8 ranks
    assert one.host_bytes == pytest.approx(405_853_388_800 * 16, rel=0.01)
    assert one.host_bytes > one.host_memory_bytes and not one.allocated_fits and not one.fits
    assert four.host_bytes * 4 == pytest.approx(one.host_bytes, rel=0.01)
    assert four.host_bytes < four.host_memory_bytes
    assert any("does not fit" in n for n in one.notes)
    unknown = zero3(8, node="gcp-a3")
    assert unknown.host_memory_bytes == 0 and any("not checked" in n for n in unknown.notes)
