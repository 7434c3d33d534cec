"""FLOPs against 6*P*tokens and Narayanan Eq. 3, step time monotone in bandwidth, and the required
inter-node bandwidth landing at 5% exposure."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from distplan.planner.comm_schedule import collective_schedule
from distplan.planner.compute import (contention, exposed_comm, model_flops, required_inter_bandwidth,
                                      sm_bound_share, step_flops, step_time)
from distplan.catalog.loader import load_catalog
from distplan.planner.activations import regime_for
from distplan.planner.config import Cluster, TrainConfig
from distplan.planner.kernels import kernel_times
from distplan.planner.model import ModelSpec

# Llama-2-7B's shape (MHA, SwiGLU 11008, 32k vocab)
L7 = ModelSpec("llama-2-7b", layers=32, hidden=4096, heads=32, kv_heads=32, ffn_hidden=11008, vocab=32000)
H100 = load_catalog().gpu("h100-sxm")


def test_flops_close_to_6PT():
    tr = TrainConfig(model=L7, seq_len=512, micro_batch=1, precision="bf16-mixed")
    six = 6 * L7.param_count() * tr.tokens_per_micro_step
    # differences: the input embedding (no FLOPs, 1.9% of P) and causal attention (+1.6% at s=512)
    assert step_flops(tr) == pytest.approx(six, rel=0.03)


def test_flops_match_narayanan_eq3_for_gpt_shape():
    # Eq. 3 assumes MHA, a 4h GELU MLP, non-causal attention (eager computes the full s x s).
    m = ModelSpec("g", layers=24, hidden=2048, heads=16, kv_heads=16, ffn_hidden=8192, vocab=50304,
                  mlp="gelu", norm="layernorm")
    B, s, h, L, V = 4, 2048, 2048, 24, 50304
    tr = TrainConfig(model=m, seq_len=s, micro_batch=B, attention="eager", checkpointing="full")
    eq3 = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    assert step_flops(tr) == pytest.approx(eq3, rel=1e-9)
    eq3_no_recompute = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    assert model_flops(tr) == pytest.approx(eq3_no_recompute, rel=1e-9)


def test_causal_sdpa_halves_attention_and_accum_scales():
    base = TrainConfig(model=L7, seq_len=4096, attention="eager")
    sdpa = replace(base, attention="sdpa")
    attn_fwd = 4 * 4096 * 4096 * 4096 * 32
    assert step_flops(base) - step_flops(sdpa) == pytest.approx(3 * attn_fwd / 2)
    assert step_flops(replace(sdpa, grad_accum=4)) == pytest.approx(4 * step_flops(sdpa))
    assert step_flops(replace(sdpa, checkpointing="selective")) == step_flops(sdpa)


def _cluster(nodes, gbps=None):
    return Cluster(gpus=8 * nodes, gpus_per_node=8, inter_bytes_per_s=gbps)


def test_step_time_monotone_in_bandwidth():
    tr = TrainConfig(model=L7, seq_len=2048, micro_batch=1, precision="bf16-mixed")
    for strategy in ("ddp", "zero1", "zero3", "fsdp", "hsdp", "fsdp-grad-op"):
        prev = math.inf
        for bw in (1e9, 5e9, 25e9, 100e9, 400e9):
            st = step_time(tr, _cluster(4, bw), strategy, gpu=H100)
            assert st.step_time_s <= prev + 1e-12, (strategy, bw)
            assert st.exposed_comm_s <= st.comm_s + 1e-12
            assert 0 < st.mfu < 1
            prev = st.step_time_s


def test_step_time_parts():
    tr = TrainConfig(model=L7, seq_len=2048, micro_batch=2, precision="bf16-mixed")
    cl = _cluster(2, 400e9)
    st = step_time(tr, cl, "fsdp", gpu=H100)
    assert st.step_time_s == pytest.approx(st.compute_s + st.exposed_comm_s + st.optimizer_s + st.overhead_s)
    assert st.overhead_s > 0  # FSDP1 casts unsharded grads to fp32 before reduce-scatter
    kt = kernel_times(tr, H100, regime_for(tr, "fsdp1"))
    assert st.compute_s == pytest.approx(kt.micro_step_s(tr.model.layers) + kt.per_step_s)
    # GEMMs and attention at least the FLOPs at the achievable rates; the rest is memory-bound work
    assert st.compute_s > step_flops(tr) / (989e12 * 0.803)
    assert st.tokens_per_s == pytest.approx(2 * 2048 * 16 / st.step_time_s)
    single = step_time(tr, Cluster(gpus=1), "single", gpu=H100)
    assert single.exposed_comm_s == 0 and single.comm_s == 0


def test_nccl_holds_one_sm_per_channel():
    """sm_shares: NCCL's channels (footprint.ring_channels, one CTA each) over the GPU's SMs, per group."""
    from distplan.planner.compute import sm_shares
    from distplan.planner.footprint import ring_channels, Topology
    assert H100.sm_count == 132  # the H100 whitepaper's SXM5 figure
    one = dict(sm_shares(_cluster(1), 132, "world", ()))
    assert one["world"] == pytest.approx(12 / 132)  # 6 channels at 60 GB/s over 18 NVLink4 links, doubled
    two = dict(sm_shares(_cluster(2), 132, "world", ()))
    assert two["world"] == pytest.approx(24 / 132)  # sm90 across nodes: doubled again
    # NCCL_MAX_NCHANNELS caps them, as NCCL does
    assert dict(sm_shares(_cluster(2), 132, "world", (("NCCL_MAX_NCHANNELS", "4"),)))["world"] == pytest.approx(4 / 132)
    # HSDP: the shard group inside the node and the replica group across nodes, each its own communicator
    h = dict(sm_shares(_cluster(2), 132, "node", ()))
    assert h["intra_node"] == pytest.approx(12 / 132) and "inter_node" in h and "world" not in h
    # HSDP on one node is FULL_SHARD over one communicator: its "intra_node" collectives hold the same SMs
    assert dict(sm_shares(_cluster(1), 132, "node", ()))["intra_node"] == pytest.approx(12 / 132)
    topo = Topology(8, 8, 90, "nvlink", 18 * 20.6, True)
    assert ring_channels(topo, {}, 0)[0] == 12
    # an unknown SM count or a single GPU: no contention
    assert sm_shares(_cluster(2), None, "world", ()) == () and sm_shares(Cluster(gpus=1), 132, "world", ()) == ()
    assert contention(_cluster(2), "zero3", replace(H100, sm_count=None), 0.9) is None


def test_overlapped_communication_slows_the_compute_it_overlaps():
    """A window of compute w overlapping communication c, compute running at 1 - phi meanwhile, ends at
    max(c, w + phi c): DDP's buckets (all but the last) overlap the backward."""
    tr = TrainConfig(model=L7, seq_len=4096, micro_batch=2, precision="bf16-mixed")
    kt = kernel_times(tr, H100, regime_for(tr, "ddp"))
    g = sm_bound_share(kt)
    assert 0.5 < g < 1  # a 7B model's step is mostly GEMMs and attention (autocast: 67%)
    fast = _cluster(2, 400e9)
    sched = collective_schedule(tr, fast, "ddp")
    lost = contention(fast, "ddp", H100, g)
    phi = lost.lost("world")
    assert phi == pytest.approx(24 / 132 * g)
    rest = sum(c.time_s for c in sched if c.unit == "bucket")
    bwd = tr.model.layers * kt.block_backward_s + kt.head_backward_s
    assert 0 < rest < bwd * (1 - phi)  # hidden: the buckets only slow the backward
    assert (exposed_comm(tr, "ddp", sched, kt, lost) - exposed_comm(tr, "ddp", sched, kt)
            == pytest.approx(phi * rest))
    # a slow network: the communication outlasts the slowed compute, the window is the communication
    slow = _cluster(2, 1e9)
    sched = collective_schedule(tr, slow, "ddp")
    assert sum(c.time_s for c in sched if c.unit == "bucket") * (1 - phi) > bwd
    assert exposed_comm(tr, "ddp", sched, kt, lost) == pytest.approx(exposed_comm(tr, "ddp", sched, kt))
    # FSDP: every block's prefetch and reduce-scatter slow the block they overlap; step_time charges it
    st = step_time(tr, fast, "fsdp", gpu=H100)
    plain = step_time(tr, fast, "fsdp", gpu=replace(H100, sm_count=None))
    assert plain.compute_s == st.compute_s and plain.comm_s == st.comm_s
    extra = st.exposed_comm_s - plain.exposed_comm_s
    hidden = st.comm_s - plain.exposed_comm_s  # what overlapped
    assert 0 < extra <= 24 / 132 * hidden


def test_required_bandwidth_makes_exposure_5_percent():
    tr = TrainConfig(model=L7, seq_len=2048, micro_batch=8, precision="bf16-mixed")
    cl = _cluster(4)
    for strategy in ("zero3", "fsdp", "ddp"):
        bw = required_inter_bandwidth(tr, cl, strategy, gpu=H100)
        assert bw is not None and 1e6 < bw < math.inf, strategy
        kt = kernel_times(tr, H100, regime_for(tr, "fsdp1" if strategy != "ddp" else "ddp"))
        compute = kt.micro_step_s(tr.model.layers) + kt.per_step_s

        lost = contention(cl, strategy, H100, sm_bound_share(kt))  # NCCL's CTAs slow the compute they overlap
        assert lost

        def exp(b):
            c = replace(cl, inter_bytes_per_s=b)
            return exposed_comm(tr, strategy, collective_schedule(tr, c, strategy), kt, lost)

        assert exp(bw) <= 0.05 * compute * (1 + 1e-9)
        assert exp(bw / 1.01) > 0.05 * compute  # just below it, more than 5%
    assert required_inter_bandwidth(tr, Cluster(gpus=8), "zero3", gpu=H100) is None
    # 512 tokens per step: the exposed root/first/last collectives alone (intra-node part) exceed 5%
    small = replace(tr, micro_batch=1, seq_len=512)
    assert required_inter_bandwidth(small, cl, "zero3", gpu=H100) == math.inf


def test_no_torch_and_no_catalog_at_import():
    import subprocess
    import sys
    code = ("import sys, distplan.planner.comm, distplan.planner.compute; "
            "assert 'torch' not in sys.modules; loader = sys.modules.get('distplan.catalog.loader'); "
            "assert loader is None or not loader._CACHE; assert 'yaml' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert proc.returncode == 0, proc.stderr
