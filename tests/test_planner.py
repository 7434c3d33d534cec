"""Planner invariants (hypothesis) and exact figures."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distplan.planner.config import Cluster, TrainConfig
from distplan.planner.memory import COMPONENTS, estimate_memory
from distplan.planner.model import ModelSpec
from distplan.planner.strategies import NAMES, get_strategy
from distplan.planner.units import GiB, parse_count, parse_memory


@pytest.mark.parametrize("text, value", [("7B", 7 * 10**9), ("7b", 7 * 10**9), ("1.3e9", 1_300_000_000),
                                         ("125M", 125 * 10**6), ("1.5T", 1_500_000_000_000),
                                         ("350_000_000", 350_000_000), ("7000000000", 7 * 10**9)])
def test_parse_count(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize("text, value", [("80", 80 * GiB), ("80GiB", 80 * GiB), ("80GB", 80 * GiB), ("8e10B", 8 * 10**10),
                                         ("81920MiB", 80 * GiB), (24, 24 * GiB)])
def test_parse_memory_gib_vs_gb(text, value):
    assert parse_memory(text) == value


@pytest.mark.parametrize("bad", ["7X", "", "-1", "0", "B7"])
def test_parse_count_rejects(bad):
    with pytest.raises(ValueError, match="--params"):
        parse_count(bad)


def test_unknown_strategy_lists_valid():
    with pytest.raises(ValueError, match="accepted: single, ddp"):
        get_strategy("nope")


def test_llama2_7b_param_count_exact():
    m = ModelSpec("l", layers=32, hidden=4096, heads=32, kv_heads=32, ffn_hidden=11008, vocab=32000)
    assert m.param_count() == 6_738_415_616
    assert sum(u.numel for u in m.param_inventory()) == m.param_count()


models = st.builds(
    lambda layers, hd, heads, group, ffn_mult, vocab, mlp, tie: ModelSpec(
        "h", layers=layers, hidden=hd * heads, heads=heads, kv_heads=max(1, heads // group),
        ffn_hidden=hd * heads * ffn_mult // 2, vocab=vocab, mlp=mlp, tie_embeddings=tie),
    st.integers(1, 96), st.sampled_from([32, 64, 128]), st.sampled_from([4, 8, 16, 32, 64]),
    st.sampled_from([1, 2, 4]), st.integers(4, 8), st.integers(1000, 200_000),
    st.sampled_from(["swiglu", "gelu"]), st.booleans())
trains = st.builds(
    lambda m, s, b, prec, ck, opt: TrainConfig(m, seq_len=s, micro_batch=b, precision=prec, checkpointing=ck,
                                               optimizer=opt),
    models, st.sampled_from([128, 1024, 4096]), st.integers(1, 8),
    st.sampled_from(["fp32", "bf16-mixed", "bf16"]), st.sampled_from(["none", "selective", "full"]),
    st.sampled_from(["adamw", "sgd", "sgd-momentum", "adafactor"]))


@settings(max_examples=150, deadline=None)
@given(trains, st.sampled_from([n for n in NAMES if n != "single"]), st.sampled_from([2, 4, 8, 16]))
def test_components_nonnegative_and_peak_is_their_sum(train, strategy, gpus):
    est = estimate_memory(train, Cluster(gpus=gpus * 2), strategy)
    assert all(est.components[k] >= 0 for k in COMPONENTS)
    assert est.peak_allocated == sum(est.components.values()) + est.workspace
    assert est.workspace >= 2 * 32 * 2**20  # two cuBLAS workspaces on the default H100
    assert estimate_memory(train, Cluster(gpus=gpus * 2), strategy, device="cpu").workspace == 0
    assert est.peak_phase in ("forward", "backward", "optimizer")


def test_cublas_workspace_by_gpu():
    """PyTorch's default workspace (CublasHandlePool.cpp): 32 MiB on Hopper/Blackwell, :4096:2:16:8
    elsewhere, rocBLAS 32 MiB or 128 MiB on gfx942; two threads (forward, backward) hold one each."""
    from distplan.planner.memory import cublas_workspace_bytes, library_workspace_bytes

    assert cublas_workspace_bytes("NVIDIA H100 80GB HBM3") == cublas_workspace_bytes("h200") == 32 * 2**20
    assert cublas_workspace_bytes("b200") == cublas_workspace_bytes("NVIDIA GeForce RTX 5090") == 32 * 2**20
    assert cublas_workspace_bytes("NVIDIA RTX 5000 Ada Generation") == 8519680  # Ada, compute capability 8.9
    assert cublas_workspace_bytes("a100-80gb") == cublas_workspace_bytes("NVIDIA L4") == 8519680
    assert cublas_workspace_bytes("mi300x") == 128 * 2**20 and cublas_workspace_bytes("mi250x") == 32 * 2**20
    llama = TrainConfig(ModelSpec("l", layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=100))
    gpt = TrainConfig(ModelSpec("g", layers=2, hidden=64, heads=4, kv_heads=4, ffn_hidden=128, vocab=100,
                                mlp="gelu", norm="layernorm", position="learned", linear_bias=True),
                      checkpointing="full")
    assert library_workspace_bytes(llama, "h100") == 64 * 2**20
    assert library_workspace_bytes(gpt, "h100") == 66 * 2**20  # + cuBLASLt's 1 MiB, forward and recompute


@settings(max_examples=150, deadline=None)
@given(trains, st.sampled_from(["zero1", "zero2", "zero3", "fsdp", "fsdp-grad-op", "hsdp"]),
       st.sampled_from([1, 2, 4, 8, 16]))
def test_sharded_bytes_never_rise_with_more_ranks(train, strategy, gpus):
    def model_states(n):
        c = Cluster(gpus=n, gpus_per_node=min(8, n))
        e = estimate_memory(train, c, strategy)
        from distplan.planner.memory import layout
        return e
    small, big = model_states(gpus), model_states(gpus * 2)
    assert big.components["optimizer"] <= small.components["optimizer"]
    assert big.components["params"] <= small.components["params"]


@settings(max_examples=150, deadline=None)
@given(trains, st.sampled_from([2, 4, 8, 64]))
def test_zero_stages_order_model_states(train, gpus):
    c = Cluster(gpus=gpus)

    def states(name):
        # Model states at rest: parameters, gradients after backward, optimizer state.
        from distplan.planner import memory as mem
        st_ = get_strategy(name)
        shard = gpus
        lay = mem.layout(train.model, st_.family, shard, st_.shards_params, st_.shards_optimizer)
        pb, gb = train.prec.param_bytes, train.prec.grad_bytes
        opt = estimate_memory(train, c, name).components["optimizer"]
        params = lay.shard_total * pb
        grads = (lay.shard_total if st_.shards_grads else lay.total) * gb
        return params + grads + opt

    assert states("zero3") <= states("zero2") <= states("zero1") <= states("ddp")


def _partition_one_at_a_time(model: ModelSpec, ranks: int):
    """ZeroRedundancyOptimizer._partition_parameters, transcribed: largest first (stable), each to
    `sizes.index(min(sizes))`."""
    params = sorted((s for u in model.param_inventory() for _, s in u.params),
                    key=lambda s: math.prod(s), reverse=True)
    sizes = [0] * ranks
    owned = [[] for _ in range(ranks)]
    for s in params:
        r = sizes.index(min(sizes))
        owned[r].append(s)
        sizes[r] += math.prod(s)
    return sizes, owned


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 40), st.sampled_from([64, 96, 128, 320]), st.sampled_from([1, 2, 4, 8]),
       st.sampled_from(["swiglu", "gelu"]), st.sampled_from(["rmsnorm", "layernorm"]), st.booleans(),
       st.booleans(), st.integers(1, 70), st.sampled_from([50, 512, 1000]))
def test_zero1_partition_matches_one_at_a_time(layers, hidden, heads, mlp, norm, tie, bias, ranks, vocab):
    from distplan.planner.memory import _size_runs, zero1_partition
    kv = max(1, heads // 2)
    m = ModelSpec("p", layers=layers, hidden=hidden, heads=heads, kv_heads=kv, ffn_hidden=hidden * 3,
                  vocab=vocab, mlp=mlp, norm=norm, tie_embeddings=tie, linear_bias=bias)
    assert zero1_partition(_size_runs(m), ranks) == _partition_one_at_a_time(m, ranks)


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor", "sgd-momentum", "adamw-8bit"])
def test_zero1_optimizer_state_is_the_most_loaded_ranks(optimizer):
    """ZeRO-1's optimizer state is optimizer_state_elems over the shapes the most loaded rank owns."""
    from distplan.planner.memory import _opt_state
    from distplan.planner.precision import optimizer_state_elems
    m = ModelSpec("z", layers=5, hidden=256, heads=4, kv_heads=2, ffn_hidden=688, vocab=1000)
    sizes, owned = _partition_one_at_a_time(m, 6)
    assert _opt_state(m, optimizer, "zero1", 6) == optimizer_state_elems(optimizer, owned[sizes.index(max(sizes))])


def test_adafactor_under_fsdp1_keeps_a_full_variance_per_flat_parameter():
    """FSDP1 steps one 1-D FlatParameter per unit, so torch.optim.Adafactor factors nothing there: its state is
    as large as the rank's flat shards (NO_SHARD: the whole flat parameters), where DDP's is factored rows and
    columns of the real shapes (measured: Qwen2.5-0.5B fsdp fp32, 8 fake ranks, -5.1% when factored)."""
    from distplan.planner.memory import _opt_state, layout
    m = ModelSpec("a", layers=4, hidden=256, heads=4, kv_heads=2, ffn_hidden=688, vocab=1000)
    assert _opt_state(m, "adafactor", "fsdp1", 8) == (layout(m, "fsdp1", 8, True, True).shard_total, 0.0)
    assert _opt_state(m, "adafactor", "fsdp1", 1)[0] == m.param_count()
    assert _opt_state(m, "adafactor", "ddp", 1)[0] < m.param_count() // 50  # factored


def test_adafactor_leaves_fsdp2_out_of_a_plan_and_says_why():
    """torch.optim.Adafactor fails on FSDP2's DTensor parameters (measured, torch 2.13): a plan leaves zero2 and
    zero3 out with a note, so no recommendation names them; asked for by name they are planned, noted."""
    from distplan.planner import plan
    p = plan("llama-3-8b", gpus=8, gpu="h100-sxm", optimizer="adafactor", comm=False)
    assert {r.name for r in p.results} == {"ddp", "zero1", "fsdp", "fsdp-grad-op", "hsdp", "fsdp-no-shard"}
    assert any(n.startswith("zero2, zero3 not planned with --optimizer adafactor") for n in p.notes), p.notes
    asked = plan("llama-3-8b", gpus=8, gpu="h100-sxm", optimizer="adafactor", strategies=["zero3", "fsdp"],
                 comm=False)
    assert [r.name for r in asked.results] == ["zero3", "fsdp"]
    assert any(n.startswith("zero3 with --optimizer adafactor: planned as asked") for n in asked.notes)
    assert not any("adafactor" in n for n in plan("llama-3-8b", gpus=8, gpu="h100-sxm", comm=False).notes)
    # DeepSpeed's ZeRO stages are its own implementation, not FSDP2's DTensors
    ds = plan("llama-3-8b", gpus=8, gpu="h100-sxm", optimizer="adafactor", framework="deepspeed", comm=False)
    assert {"zero2", "zero3"} <= {r.name for r in ds.results}


def test_clear_caches_picks_up_an_edited_catalog(tmp_path):
    """Figures are cached per GPU name; after a user edits their catalog file in the same process,
    clear_caches() makes the next plan use the new figures."""
    from pathlib import Path

    from distplan.planner import clear_caches, plan
    src = (Path(__file__).parents[1] / "catalog" / "gpus" / "h100-sxm.yaml").read_text()
    mine = src.replace("name: h100-sxm", "name: my-gpu").replace(
        "aliases: [h100, h100-sxm5, h100-80gb, h100-sxm-80gb]", "aliases: []")
    (tmp_path / "gpus").mkdir()
    path = tmp_path / "gpus" / "my-gpu.yaml"
    path.write_text(mine)
    kw = dict(gpus=8, gpu="my-gpu", strategies=["ddp"], catalog_dirs=[str(tmp_path)])
    before = plan("llama-3-8b", **kw)["ddp"].time.compute_s
    path.write_text(mine.replace("bf16_tflops: 989", "bf16_tflops: 494.5"))
    assert plan("llama-3-8b", **kw)["ddp"].time.compute_s == before  # cached
    clear_caches()
    # GEMMs and attention (most of the step) take twice as long; memory-bound work does not
    assert 1.4 * before < plan("llama-3-8b", **kw)["ddp"].time.compute_s < 2 * before


def test_probe_ids_name_a_non_default_optimizer():
    """Probes that differ only in their optimizer get different ids (`--resume` skips a recorded id; summaries
    keep one record per id); AdamW foreach, the default, keeps the ids every committed record has."""
    from distplan.validate.matrix import make_spec
    model = {"name": "m", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 4, "ffn_hidden": 128, "vocab": 100}
    ids = [make_spec("zero3", model, 8, "fake", optimizer=o, optimizer_impl=i, grad_accum=2)["id"]
           for o, i in [("adamw", "foreach"), ("adamw", "fused"), ("adamw", "for-loop"), ("sgd-momentum", "foreach"),
                        ("adafactor", "foreach")]]
    assert ids[0] == "zero3/m/w8-fake/none/fp32/accum2-last"
    assert ids[1:] == [ids[0] + s for s in ("/adamw-fused", "/adamw-for-loop", "/sgd-momentum", "/adafactor")]
    # and so do probes that differ in their attention (SDPA, the default, keeps the committed ids)
    assert make_spec("zero3", model, 8, "fake", grad_accum=2, attention="eager")["id"] == ids[0] + "/eager"


def test_hf_workload_attention_round_trips():
    """`--attention eager` reaches the transformers model the trace and the probe build (a spec's "module"
    names it; SDPA's specs stay as every committed record has them), and nothing else is accepted."""
    from distplan.planner.workload.traced_model import HFWorkload, from_spec
    w = HFWorkload("c.json", 2, 64, 4, "eager")
    assert w.to_spec() == {"hf_config": "c.json", "micro_batch": 2, "seq_len": 64, "layers": 4, "attention": "eager"}
    assert from_spec(w.to_spec()).attention == "eager"
    assert "attention" not in HFWorkload("c.json", 2, 64).to_spec()
    assert from_spec(HFWorkload("c.json", 2, 64).to_spec()).attention == "sdpa"
    with pytest.raises(ValueError, match="--attention='flash'"):
        HFWorkload("c.json", 2, 64, attention="flash")
