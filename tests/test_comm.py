"""Collective schedule: nccl-tests factors, ring vs hierarchical times, volume ratios, and an exact
match of op, dtype, message bytes and calls against what the installed torch issues (fake process
group, one process as rank 0 of N; run in a subprocess so the process group never leaks)."""

from __future__ import annotations

import collections
import json
import subprocess
import sys

import pytest

from distplan.planner import comm
from distplan.planner.comm import Collective, LinkModel, bus_factor, collective_time, comm_summary, ddp_buckets
from distplan.planner.comm_schedule import collective_schedule
from distplan.planner.config import Cluster, TrainConfig
from distplan.planner.model import ModelSpec

TINY = ModelSpec("tiny", layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=130, vocab=101)
GPT = ModelSpec("tiny-gpt", layers=2, hidden=48, heads=4, kv_heads=4, ffn_hidden=200, vocab=97,
                mlp="gelu", norm="layernorm", position="learned", max_positions=32,
                tie_embeddings=True, linear_bias=True)
# big enough for several 25 MiB / 1 MiB DDP buckets with boundaries inside blocks
MID = ModelSpec("mid", layers=3, hidden=512, heads=8, kv_heads=2, ffn_hidden=1376, vocab=3001,
                qkv_bias=True)

NVL = LinkModel(busbw_bytes_per_s=370e9, latency_s=3.4e-6, half_efficiency_bytes=0)
IB = LinkModel(busbw_bytes_per_s=47e9, latency_s=9.6e-6, half_efficiency_bytes=0)


# -- factors and times -----------------------------------------------------------------------------

def test_nccl_tests_factors():
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert bus_factor("reduce_scatter", 4) == pytest.approx(3 / 4)
    assert bus_factor("broadcast", 8) == 1.0
    assert bus_factor("all_reduce", 1) == 0.0
    # all_to_all is context parallelism's ring shift (`permute_tensor`): the whole input to one peer
    assert bus_factor("all_to_all", 8) == 1.0
    with pytest.raises(ValueError, match="accepted values"):
        bus_factor("alltoallv", 8)


def test_flat_ring_time_by_hand():
    # NCCL's ring (src/graph/tuning.cc): ONE latency term, LAUNCH_S + base + steps x per-step latency,
    # plus f(op, n) x S / busbw; at 1 GiB the Simple protocol wins (LL runs at half the bandwidth)
    S = 1 << 30
    t = collective_time("all_reduce", S, 8, NVL)
    hand = comm.LAUNCH_S + 8.4e-6 + 2 * 7 * 3.4e-6 + 2 * 7 / 8 * S / 370e9
    assert t == pytest.approx(hand, rel=1e-12)
    t = collective_time("all_gather", S, 8, NVL)
    assert t == pytest.approx(comm.LAUNCH_S + 8.4e-6 + 7 * 3.4e-6 + 7 / 8 * S / 370e9, rel=1e-12)
    # a small message takes the LL protocol: per-step latency 0.6/3.4 of Simple's, base 6.6 us; the
    # latency is counted once (no size-dependent efficiency on top)
    small = collective_time("all_reduce", 4096, 8, NVL)
    assert small == pytest.approx(comm.LAUNCH_S + 6.6e-6 + 14 * 0.6e-6 + 1.75 * 4096 / (0.5 * 370e9))
    assert 38e-6 <= small <= 53e-6  # published 8-GPU floors (tests/test_nccl_published.py)


def test_hierarchical_time_by_hand():
    # 4 nodes x 8 GPUs; IB per GPU = 8 NICs x 47 GB/s / 8 GPUs. Across nodes NCCL's ring uses every NIC
    # of a node at once, its hops pipelined: busbw = min(NVLink busbw, the node's NIC busbw); the
    # phases are NOT summed. Latency: 56 NVLink steps + 6 network steps, x 1.4 (tuning.cc plateau)
    S = 1 << 30
    t = collective_time("all_reduce", S, 32, NVL, gpus_per_node=8, inter_link=IB)
    ring = (comm.LAUNCH_S + 1.4 * (8.4e-6 + 56 * 3.4e-6 + 6 * 9.6e-6)
            + 2 * 31 / 32 * S / min(370e9, 8 * 47e9))
    assert t == pytest.approx(ring, rel=1e-12)
    assert comm.nccl_algorithm("all_reduce", S, 32, NVL, gpus_per_node=8, inter_link=IB) == "ring"
    # slower NICs, slower collective
    slow = LinkModel(12e9 / 8, 9.6e-6, hw="net")
    assert collective_time("all_reduce", S, 32, NVL, gpus_per_node=8, inter_link=slow) > t
    # a group inside one node never touches the NICs
    assert collective_time("all_reduce", S, 8, NVL, gpus_per_node=8, inter_link=slow) == \
        collective_time("all_reduce", S, 8, NVL)
    # on 2 nodes the tree sends S (not 2S) per node over the network: 0.92 x min(NVLink / 2, node NICs)
    two = collective_time("all_reduce", S, 16, NVL, gpus_per_node=8, inter_link=slow)
    assert comm.nccl_algorithm("all_reduce", S, 16, NVL, gpus_per_node=8, inter_link=slow) == "tree"
    assert two == pytest.approx(comm.LAUNCH_S + 8.4e-6 + 2 * (7 * 3.4e-6 + 9.6e-6)
                                + S / (0.92 * min(185e9, 12e9)), rel=1e-12)


def test_nvls_on_nvswitch_nodes():
    # NVLS all-reduce: S / (8-GPU busbw / 1.75) from 5 GPUs; all-gather stays on the ring
    nvs = LinkModel(370e9, 3.4e-6, nvls_busbw_bytes_per_s=480e9, nvls_latency_s=25e-6)
    S = 1 << 30
    assert collective_time("all_reduce", S, 8, nvs) == pytest.approx(comm.LAUNCH_S + 25e-6 + S / (480e9 / 1.75))
    assert collective_time("all_reduce", S, 4, nvs) == collective_time("all_reduce", S, 4, NVL)
    assert collective_time("all_gather", S, 8, nvs) == collective_time("all_gather", S, 8, NVL)


def test_half_efficiency_no_longer_counts_latency_twice():
    # the old eff(S) = S / (S + S_half) added n x latency x busbw a second time; it is display-only now
    link = LinkModel(100e9, 0.0, half_efficiency_bytes=1e6)
    assert link.efficiency(1e6) == 0.5
    assert collective_time("all_gather", 1e6, 2, link) == collective_time("all_gather", 1e6, 2, LinkModel(100e9, 0.0))


# -- schedules -------------------------------------------------------------------------------------

def _train(model=TINY, **kw):
    kw.setdefault("seq_len", 16)
    return TrainConfig(model=model, **kw)


def test_ddp_volume_is_2P():
    tr = _train(MID, precision="bf16-mixed")
    sched = collective_schedule(tr, Cluster(gpus=8), "ddp")
    total = sum(c.message_bytes * c.calls for c in sched)
    assert total == MID.param_count() * 4  # fp32 grads under autocast
    assert comm_summary(sched)["bytes_per_gpu"] == pytest.approx(2 * 7 / 8 * total, abs=len(sched))
    assert all(c.group == "world" and c.op == "all_reduce" for c in sched)


def test_full_shard_is_1_5x_ddp_in_same_dtype():
    big = ModelSpec("b", layers=8, hidden=1024, heads=8, kv_heads=8, ffn_hidden=4096, vocab=32000)
    tr = _train(big, precision="fp32")
    cl = Cluster(gpus=8)
    ddp = comm_summary(collective_schedule(tr, cl, "ddp"))["bytes_per_gpu"]
    for name in ("fsdp", "zero3"):
        fs = comm_summary(collective_schedule(tr, cl, name))["bytes_per_gpu"]
        # 3 x (n-1)/n P vs 2 x (n-1)/n P, minus the root, which neither FSDP1 nor FSDP2 (root at its
        # default reshard_after_forward) re-gathers in backward
        root = (big.vocab * big.hidden * 2 + big.hidden) * 4 * 7 / 8
        expected = 1.5 * ddp - root
        assert fs == pytest.approx(expected, rel=1e-3), name
    # mixed precision: bf16 all-gathers + fp32 reduce-scatter = (2 + 2 + 4) / 8 = 1.0 x DDP's fp32,
    # less the root's backward all-gather (2 bytes of the root's 8)
    trm = _train(big, precision="bf16-mixed")
    ddp_m = comm_summary(collective_schedule(trm, cl, "ddp"))["bytes_per_gpu"]
    z3 = comm_summary(collective_schedule(trm, cl, "zero3"))["bytes_per_gpu"]
    root_elems = big.vocab * big.hidden * 2 + big.hidden
    assert z3 == pytest.approx(ddp_m - root_elems * 2 * 7 / 8, rel=1e-3)


def test_grad_accum_counts():
    cl = Cluster(gpus=8)
    one = {(c.op, c.phase, c.unit): c.calls for c in collective_schedule(_train(grad_accum=1), cl, "zero3")}
    four = {(c.op, c.phase, c.unit): c.calls for c in collective_schedule(_train(grad_accum=4), cl, "zero3")}
    for k, v in one.items():
        assert four[k] == (v if k[0] == "reduce_scatter" else 4 * v), k
    ddp4 = collective_schedule(_train(grad_accum=4), cl, "ddp")
    assert sum(c.calls for c in ddp4) == len(ddp_buckets(TINY, 4))


def test_hsdp_groups():
    cl = Cluster(gpus=16, gpus_per_node=8)
    sched = collective_schedule(_train(precision="bf16-mixed"), cl, "hsdp")
    groups = {(c.op, c.group, c.group_size) for c in sched}
    assert ("all_gather", "intra_node", 8) in groups
    assert ("all_reduce", "inter_node", 2) in groups
    assert "world" not in {c.group for c in sched}


def test_single_has_no_collectives():
    assert collective_schedule(_train(), Cluster(gpus=1), "single") == []


def test_deepspeed_schedules_exist():
    cl = Cluster(gpus=8)
    for name in ("zero1", "zero2", "zero3"):
        sched = collective_schedule(_train(MID, framework="deepspeed"), cl, name)
        assert sched and all(isinstance(c, Collective) for c in sched)
        assert all(c.bytes_per_gpu >= 0 and c.time_s >= 0 for c in sched)


def test_schedule_is_cached_per_model_and_cluster():
    """Schedules are built once per (model, precision, accumulation, strategy, cluster) and shared by
    every sequence length and micro-batch (the 10,000-config figure is benchmarks/bench_planner.py's)."""
    from distplan.planner.comm import _timed_schedule
    cl = Cluster(gpus=64, gpus_per_node=8)
    trains = [_train(MID, micro_batch=b, seq_len=s) for b in (1, 2, 4, 8) for s in (512, 1024)]
    _timed_schedule.cache_clear()
    for name in ("ddp", "zero1", "zero3", "fsdp", "hsdp"):
        first = collective_schedule(trains[0], cl, name)
        for tr in trains[1:]:
            assert collective_schedule(tr, cl, name) == first
    info = _timed_schedule.cache_info()
    assert info.misses == 5 and info.hits == 5 * (len(trains) - 1)


# -- empirical: what installed torch issues --------------------------------------------------------

def _expected(model, precision, strategy, world, gpn, A):
    tr = TrainConfig(model=model, seq_len=16, micro_batch=2, grad_accum=A, precision=precision)
    cl = Cluster(gpus=world, gpus_per_node=gpn)
    out = collections.Counter()
    for c in collective_schedule(tr, cl, strategy):
        out[(c.op, c.dtype, c.message_bytes)] += c.calls
    return out


CASES = [
    # (model, precision, strategy, world, gpus_per_node, grad_accum)
    ("TINY", "bf16-mixed", "ddp", 4, 4, 2),
    ("MID", "bf16-mixed", "ddp", 4, 4, 1),
    ("MID", "bf16", "ddp", 4, 4, 1),
    ("GPT", "fp32", "ddp", 4, 4, 1),
    ("TINY", "bf16-mixed", "zero1", 4, 4, 1),
    ("GPT", "fp32", "zero1", 4, 4, 2),
    ("TINY", "bf16-mixed", "zero2", 4, 4, 2),
    ("TINY", "bf16-mixed", "zero3", 4, 4, 2),
    ("GPT", "fp32", "zero3", 8, 8, 1),
    ("GPT", "bf16", "zero2", 8, 8, 1),
    ("TINY", "bf16-mixed", "fsdp", 8, 8, 2),
    ("GPT", "fp32", "fsdp", 3, 3, 1),
    ("TINY", "bf16-mixed", "fsdp-grad-op", 8, 8, 2),
    ("GPT", "bf16-mixed", "fsdp-no-shard", 8, 8, 2),
    ("TINY", "bf16-mixed", "hsdp", 8, 4, 2),
    ("GPT", "fp32", "hsdp", 6, 3, 1),
]


def test_ddp_bucket_cap_default_vs_explicit():
    """PyTorch's default argument gives a 1 MiB first bucket; an explicit 25 does not."""
    head = MID.vocab * MID.hidden * 4 + MID.hidden * 4  # output.weight then norm.weight, ready first
    assert ddp_buckets(MID, 4, None)[0] == MID.vocab * MID.hidden * 4 < 2**20 * 25
    assert ddp_buckets(MID, 4, 25)[0] > 25 * 2**20 > head


@pytest.mark.parametrize("model", ["GPT", "MID", "TINY"])
@pytest.mark.parametrize("autocast", [False, True])
def test_ready_order_matches_autograd(model, autocast):
    """The order DDP's rebuilt buckets follow, against the order AccumulateGrad actually runs in
    (post-accumulate-grad hooks) on the reference decoder, in fp32 and under autocast (bf16)."""
    torch = pytest.importorskip("torch")
    from distplan.validate.model import Decoder

    spec = globals()[model]
    torch.manual_seed(0)
    m = Decoder(spec)
    names = {p: n for n, p in m.named_parameters()}
    order: list[str] = []
    for p in m.parameters():
        p.register_post_accumulate_grad_hook(lambda p: order.append(names[p]))
    tok = torch.randint(0, spec.vocab, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = m(tok, tok)
    loss.backward()
    measured = tuple(m.get_parameter(n).numel() for n in order)
    assert measured == comm.ready_order_sizes(spec, autocast), order


@pytest.mark.newest
@pytest.mark.slow  # a subprocess running every case's collectives through torch (about a minute on 2 cores)
def test_schedule_matches_torch():
    pytest.importorskip("torch")
    cases = [c for c in CASES]
    proc = subprocess.run([sys.executable, __file__, json.dumps(cases)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    bad = []
    for case, got in zip(cases, measured):
        model = globals()[case[0]]
        want = _expected(model, *case[1:])
        got = collections.Counter({(o, d, b): n for o, d, b, n in got})
        if want != got:
            bad.append(f"{case}: planner {sorted(want.items())} != torch {sorted(got.items())}")
    assert not bad, "\n".join(bad)


# -- the probe, run as a script in a subprocess ----------------------------------------------------

def _probe(cases):  # pragma: no cover - runs in the subprocess
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode

    from distplan.validate.model import Block, Decoder

    names = collections.defaultdict(str, {torch.float32: "float32", torch.bfloat16: "bfloat16",
                                          torch.float16: "float16"})
    low = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}

    class Count(TorchDispatchMode):
        """Counts c10d ops issued on this thread (all-gather, reduce-scatter, broadcast, all-reduce)."""

        def __init__(self, log):
            super().__init__()
            self.log = log

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__
            if func.namespace == "c10d":
                if name.startswith("_allgather_base"):
                    t = args[0]
                    self.log[("all_gather", names[t.dtype], t.numel() * t.element_size())] += 1
                elif name.startswith("allgather_"):
                    outs = args[0][0]
                    self.log[("all_gather", names[outs[0].dtype],
                              sum(t.numel() * t.element_size() for t in outs))] += 1
                elif name.startswith("_reduce_scatter_base"):
                    t = args[1]
                    self.log[("reduce_scatter", names[t.dtype], t.numel() * t.element_size())] += 1
                elif name.startswith("broadcast"):
                    for t in args[0]:
                        self.log[("broadcast", names[t.dtype], t.numel() * t.element_size())] += 1
                elif name.startswith("allreduce"):
                    for t in args[0]:
                        self.log[("all_reduce", names[t.dtype], t.numel() * t.element_size())] += 1
                else:
                    self.log[(name, "", 0)] += 1
            return func(*args, **(kwargs or {}))

    results = []
    for model_name, precision, strategy, world, gpn, A in cases:
        spec = globals()[model_name]
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        torch.manual_seed(0)
        m = Decoder(spec)
        if precision == "bf16":
            m = m.to(torch.bfloat16)
        log = collections.Counter()
        autocast = contextlib.nullcontext
        if strategy in ("ddp", "zero1"):
            from torch.nn.parallel import DistributedDataParallel as DDP
            # as validate/wrap.py launches it
            m = DDP(m, bucket_cap_mb=comm.DDP_BUCKET_CAP_MB, gradient_as_bucket_view=False)

            def hook(state, bucket):  # records each bucket all-reduce DDP issues
                b = bucket.buffer()
                log[("all_reduce", names[b.dtype], b.numel() * b.element_size())] += 1
                fut = torch.futures.Future()
                fut.set_result(b)
                return fut

            m.register_comm_hook(None, hook)
            if precision in low:
                autocast = lambda: torch.autocast("cpu", dtype=low[precision])  # noqa: E731
            if strategy == "zero1":
                from torch.distributed.optim import ZeroRedundancyOptimizer
                opt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
            else:
                opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
            sync = lambda last: contextlib.nullcontext() if last else m.no_sync()  # noqa: E731
        elif strategy in ("zero2", "zero3"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            kw = {"mesh": init_device_mesh("cpu", (world,)), "reshard_after_forward": strategy == "zero3"}
            if precision in low:
                kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=low[precision], reduce_dtype=torch.float32)
            for b in m.layers:
                fully_shard(b, **kw)
            if not comm.FSDP2_ROOT_RESHARD_EXPLICIT:
                kw.pop("reshard_after_forward")
            fully_shard(m, **kw)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

            def sync(last, m=m):
                m.set_requires_gradient_sync(last)
                return contextlib.nullcontext()
        else:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy
            st = {"fsdp": "FULL_SHARD", "fsdp-grad-op": "SHARD_GRAD_OP", "fsdp-no-shard": "NO_SHARD",
                  "hsdp": "HYBRID_SHARD"}[strategy]
            kw = {}
            if st == "HYBRID_SHARD":
                from torch.distributed.device_mesh import init_device_mesh
                kw["device_mesh"] = init_device_mesh("cpu", (world // gpn, gpn),
                                                     mesh_dim_names=("replicate", "shard"))
            if precision in low:
                kw["mixed_precision"] = MixedPrecision(param_dtype=low[precision], reduce_dtype=torch.float32)
            # device_id: FSDP1 refuses CPU modules without it ("FSDP needs a non-CPU accelerator")
            m = FSDP(m, sharding_strategy=getattr(ShardingStrategy, st), auto_wrap_policy=ModuleWrapPolicy({Block}),
                     use_orig_params=False, device_id=torch.device("cpu"), **kw)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
            sync = lambda last: contextlib.nullcontext() if last else m.no_sync()  # noqa: E731
        tok = torch.randint(0, spec.vocab, (2, 16))
        # step 1: DDP reduces one bucket; step 2: it rebuilds its buckets (broadcasting the int32
        # bucket indices); step 3 is the steady state the planner describes.
        for step in range(3):
            log.clear()
            with Count(log):
                for a in range(A):
                    with sync(a == A - 1):
                        with autocast():
                            loss = m(tok, tok)
                        loss.backward()
                opt.step()
                opt.zero_grad()
        results.append([[k[0], k[1], k[2], v] for k, v in log.items()])
    print(json.dumps(results))


if __name__ == "__main__":  # pragma: no cover
    import warnings
    warnings.filterwarnings("ignore")
    _probe([tuple(c) for c in json.loads(sys.argv[1])])
