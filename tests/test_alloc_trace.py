"""The planner's reserved peak (planner/alloc_trace.py): the run's allocations written from the planner's
own sizes and replayed through the caching-allocator model, against `torch.cuda.max_memory_reserved`
measured on an H100 (benchmarks/results/h100-torch2.11-2026-11-23.jsonl, 78 probes: single on the GPU,
DDP/ZeRO/FSDP as rank 0 of 2, 8 and 64 ranks on the fake process group), with no torch and no trace
recorded: what `distplan estimate` prints as `reserved`."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics

import pytest

from distplan.planner.alloc_trace import allocation_events, reserved_peak
from distplan.planner.allocator import replay
from distplan.planner.accuracy import PEAK_RESERVED
from distplan.planner.api import predict_probe, resolve_model
from distplan.validate.results import record_spec
from distplan.planner.config import TrainConfig
from distplan.planner.strategies import get_strategy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _records():
    with open(os.path.join(ROOT, "benchmarks", "results", "h100-torch2.11-2026-11-23.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["measurement"].get("status") == "ok"]


@pytest.fixture(scope="module")
def errors():
    out = {}
    for r in _records():
        p = predict_probe(record_spec(r))["memory"]
        m = r["measurement"]["memory"]
        fam = get_strategy(r["inputs"]["strategy"]).family
        out[r["id"]] = (fam, p["peak_reserved"] / m["peak_reserved"] - 1,
                        1.1 * p["peak_allocated"] / m["peak_reserved"] - 1)
    return out


def _stats(errors, fsdp: bool):
    rows = {k: v for k, v in errors.items() if (v[0] in ("fsdp1", "fsdp2")) == fsdp}
    new = [abs(v[1]) for v in rows.values()]
    old = [abs(v[2]) for v in rows.values()]
    return rows, statistics.median(new), max(new), statistics.median(old)


def test_reserved_single_stream_probes(errors):
    rows, med, mx, old = _stats(errors, fsdp=False)
    table = {k: round(100 * v[1], 1) for k, v in rows.items()}
    assert len(rows) >= 20
    # measured 2026-11-23: median 2.3%, max 5.7% (the 10% margin: 3.4% / 9.7%); 2026-12-01, with a tied weight's
    # gradients written (the H100's recorded events show the same three at the embedding's backward): median
    # 2.8%, max 5.7% (qwen-small zero1 fp32 at 8 and 64 ranks -2.4% -> +5.7%); 2026-12-04, the forward written op
    # by op (alloc_trace.block_program): median 1.0%, max 6.4% (llama-small zero1 fp32 with full checkpointing,
    # -6.4%: its own recorded CPU re-run replays -5.4% against the H100 too); 2026-12-06, the residual stream's
    # gradient carried through the blocks' backward and the embedding output counted once: median 0.7%, max 6.4%;
    # then the final norm's backward written op by op: median 0.65% (5 records -0.4 to -0.75% -> exact)
    assert med <= 0.04 and mx <= 0.08, table
    assert med < old


def test_the_printed_reserved_band_is_these_probes(errors):
    """accuracy.PEAK_RESERVED["analytic"], printed under every analytic memory table and in the JSON's
    error_band, is the |error| of these 78 probes' reserved peaks (median and max, to 0.01%)."""
    e = [abs(v[1]) for v in errors.values()]
    assert len(e) == 78
    band = PEAK_RESERVED["analytic"]
    assert round(statistics.median(e), 4) == band["median"] and round(max(e), 4) == band["max"]


def test_reserved_fsdp_probes_meet_the_issue_bar(errors):
    rows, med, mx, old = _stats(errors, fsdp=True)
    table = {k: round(100 * v[1], 1) for k, v in rows.items()}
    assert len(rows) >= 40
    # issue 15: 10% median, 20% max (measured 2026-11-23: 5.5% / 12.3%; the 10% margin: 20.3% / 47.5%;
    # 2026-12-01: 5.6% / 12.3%; then, with FSDP2's reduce-scatter input written on the compute stream where
    # `foreach_reduce` allocates it and FSDP1's low-precision shard on the pre-unshard stream: 2.3% / 10.5%,
    # FSDP2 alone 8.2% -> 2.1% median, 12.3% -> 7.9% max; then FSDP1's flat gradient on the unshard stream
    # (the views' backward), NO_SHARD's unsharded parameter its low-precision copy, FSDP2's mixed-precision
    # copy-in cast: 2.05% / 8.1%, as the recorded streams of the CPU re-runs show them; 2026-12-04, with the
    # root's pre-backward prefetch of the last block and a block's backward written in two phases, to its peak
    # and after (alloc_trace.allocation_events): 1.98% / 5.8%; then the forward written op by op, a checkpointed
    # block recomputed op by op (alloc_trace.block_program): 1.37% / 4.35%; 2026-12-06, the residual stream's
    # gradient carried from the head's backward to the embedding's and the embedding output counted once
    # (train_step_trace): 1.28% / 4.35%)
    assert med <= 0.10 and mx <= 0.20, table
    assert med <= 0.02 and mx <= 0.05, table
    assert med < old / 2


def test_trace_allocates_what_the_walk_predicts():
    """The trace is written from the walk's sizes: its allocated peak is the walk's within a few percent
    (the walk, not the trace, is what the probes judge byte by byte)."""
    errs = []
    for r in _records()[::3]:
        s = r["inputs"]
        p = predict_probe(dict(s))["memory"]
        t = s["train"]
        from distplan.planner.model import ModelSpec
        train = TrainConfig(ModelSpec(**s["model"]), seq_len=t["seq_len"], micro_batch=t["micro_batch"],
                            precision=t["precision"], checkpointing=t["checkpointing"])
        st = get_strategy(s["strategy"])
        world = s["world_size"]
        shard = 1 if st.name in ("single", "fsdp-no-shard") else (
            world if st.shard_group == "world" else min(world, s.get("gpus_per_node") or world))
        _, alloc = reserved_peak(train, st.name, world, shard, "cuda", "fake", p["workspace"])
        errs.append(alloc / p["peak_allocated"] - 1)
    assert statistics.median(abs(e) for e in errs) <= 0.03, errs
    assert max(abs(e) for e in errs) <= 0.10, errs


def _train(name="llama-3-8b", **kw):
    spec = resolve_model(name)[0]
    return TrainConfig(spec, seq_len=kw.pop("seq_len", 4096), micro_batch=1, precision="bf16-mixed", **kw)


def test_reserved_at_depth_is_at_least_allocated_and_fsdp_streams_cost_more():
    train = _train(checkpointing="full")
    ddp_r, ddp_a = reserved_peak(train, "ddp", 8, 1, init="meta")
    z3_r, z3_a = reserved_peak(train, "zero3", 64, 64, init="meta")
    assert ddp_r >= ddp_a and z3_r >= z3_a
    # FSDP2 keeps all-gather and reduce-scatter buffers in their streams' pools, which the compute
    # stream cannot reuse: a larger share of its peak is cached-but-free (measured on the H100 at 32
    # layers: 1.25-2.3 for FSDP, 1.0-1.2 single/DDP)
    assert z3_r / z3_a > ddp_r / ddp_a


def test_meta_init_reserves_less_than_building_the_model_on_the_device():
    """A probe builds the whole model on the GPU, then shards it: those segments stay cached."""
    train = _train(checkpointing="full")
    meta, _ = reserved_peak(train, "zero3", 64, 64, init="meta")
    dev, _ = reserved_peak(train, "zero3", 64, 64, init="device")
    assert dev >= train.model.param_count() * 4 > meta


def test_expandable_segments_reserve_no_more():
    train = _train()
    for st, w, sh in (("single", 1, 1), ("zero3", 8, 8), ("fsdp", 8, 8)):
        plain, _ = reserved_peak(train, st, w, sh, init="meta")
        exp, _ = reserved_peak(train, st, w, sh, init="meta", expandable_segments=True)
        assert exp <= plain, st


@contextlib.contextmanager
def _measured_steps(steps: int):
    """alloc_trace writes `steps` measured steps after the warm-up inside the block (the probes run one)."""
    from distplan.planner import alloc_trace
    old = alloc_trace.MEASURED_STEPS
    alloc_trace.MEASURED_STEPS = steps
    try:
        yield
    finally:
        alloc_trace.MEASURED_STEPS = old


def test_events_are_balanced_per_step():
    """Every step frees what it allocates except the state it keeps: replaying two more steps adds no
    allocated bytes (a leak in the writer would grow it)."""
    train = _train(name="phi-3-mini", seq_len=1024)
    for st, w, sh in (("ddp", 8, 1), ("zero2", 8, 8), ("zero3", 8, 8), ("fsdp", 8, 8), ("fsdp-grad-op", 8, 8)):
        ends = []
        for steps in (1, 3):
            with _measured_steps(steps):
                ends.append(replay(allocation_events(train, st, w, sh)).allocated)
        assert ends[0] == ends[1], st


def _peaks_over(steps: int, train, st, w, sh, **replay_kw):
    with _measured_steps(steps):
        a = replay(allocation_events(train, st, w, sh, init=replay_kw.pop("init", "device")), **replay_kw)
    return a.peak_reserved, a.peak_allocated


@pytest.mark.parametrize("name,kw", [
    ("mistral-7b", {}),
    ("llama-3-8b", {"precision": "fp32"}),
    ("llama-3-8b", {"checkpointing": "full"}),
    ("llama-3-8b", {"micro_batch": 4, "seq_len": 2048}),
    ("phi-3-mini", {"grad_accum": 4, "seq_len": 2048}),
    ("qwen2.5-7b", {"checkpointing": "full", "micro_batch": 2}),
    ("llama-3-8b", {"seq_len": 8192, "checkpointing": "selective-op"}),
])
def test_three_steps_reach_a_long_runs_reserved_peak(name, kw):
    """The probes read `max_memory_reserved` after WARMUP_STEPS + MEASURED_STEPS = 3 steps; a user's run
    takes thousands. The caching allocator's state need not settle in the second step (it does not: the
    second is the first with optimizer state, and a third often reserves more, e.g. Llama-3-8B zero3 at 16
    ranks 30.3 -> 34.3 GiB), but it must have settled by the third's end, or the OOM line printed is a
    3-step run's and a long run passes it. With the default allocator, replaying 4 more steps changes neither
    peak (88 configs checked on 2026-12-04: 12 models/settings x 8 strategies, none grew after the third step).
    `max_split_size_mb` settles later: oversize blocks are never split, so a request below the limit cannot
    reuse one and a segment made in one step may first be reused two steps on (Llama-3-8B 4 x 2048 zero2 at 16
    ranks, 128 MiB: +0.1% in step 4; Phi-3-mini accumulating 4 micro-steps, zero1: +0.5% in step 4, +0.6% in
    step 5, then settled), and so may expandable segments, whose one growing segment per pool is mapped where
    its free pages do not fit a request (since the final norm's backward is written op by op, 2026-12-06:
    Llama-3-8B with full checkpointing, zero1 on 8 ranks, +0.23% in step 4, then settled): the 3-step figure,
    what the probes read, is within 1% of the long run's."""
    train = dataclasses.replace(_train(name, seq_len=kw.pop("seq_len", 4096)), **kw)
    for st, w, sh in (("ddp", 8, 1), ("zero1", 8, 8), ("zero2", 16, 16), ("zero3", 16, 16), ("fsdp", 8, 8),
                      ("fsdp-grad-op", 8, 8), ("fsdp", 16, 8)):
        for replay_kw in ({}, {"expandable_segments": True}, {"init": "meta", "max_split_size": 128 << 20}):
            three = _peaks_over(1, train, st, w, sh, **dict(replay_kw))
            seven = _peaks_over(5, train, st, w, sh, **dict(replay_kw))
            why = (st, w, sh, replay_kw, [x >> 20 for x in three], [x >> 20 for x in seven])
            if replay_kw:  # max_split_size_mb, expandable segments
                assert three[1] == seven[1] and three[0] <= seven[0] <= 1.01 * three[0], why
            else:
                assert three == seven, why


@pytest.mark.parametrize("name", ["mistral-7b", "llama-3-8b", "qwen2.5-7b", "llama-2-7b"])
def test_fsdp1_checkpointed_run_allocates_what_the_walk_predicts(name):
    """FSDP1 with full checkpointing at 16 ranks on 2 nodes, 4096 tokens: the written run (every block's backward,
    to its peak and after) allocates what the walk's closed form predicts, which takes only the blocks that bound
    the others. Before the walk took the middle blocks' MLP backward (blocks 1 and L-2: the prefetched block
    before, the gradient shards of every block after, a recomputed block) the replay read up to 8.4% over it
    (hsdp fp32; Mistral-7B's fsdp bf16-mixed +7.4%), and the trace of the transformers model 3.6% over
    (tests/test_hf_reserved.py, the real-size test); measured 2026-12-04: within 1.1%; then within 1.2% (hsdp bf16-mixed
    -1.18%, Llama-3-8B) once the written forward stopped counting the embedding's output twice (block 0's kept
    input and a tensor of its own: 32 MiB there), which had covered part of a gap at the loss's backward, where
    the writer's run is 253 MiB under the walk's closed form (-1.03% before)."""
    from distplan.planner.api import plan
    from distplan.planner.memory import estimate_memory
    errs = {}
    for precision in ("bf16-mixed", "fp32"):
        p = plan(name, gpus=16, gpus_per_node=8, gpu="h100-sxm", comm=False, activation_checkpointing="full",
                 precision=precision, seq_len=4096)
        for st in ("fsdp", "fsdp-grad-op", "hsdp"):
            mem = estimate_memory(p.train, p.cluster, st)
            a = mem.reserved_replay
            written = replay(allocation_events(*a[:7], a[8]), expandable_segments=a[7], max_split_size=a[9])
            errs[precision, st] = round(100 * (written.peak_allocated / mem.peak_allocated - 1), 2)
    assert all(abs(e) <= 1.2 for e in errs.values()), errs


def test_plan_json_has_reserved_and_device_total():
    from distplan.planner.api import plan
    p = plan("llama-3-8b", gpus=8, strategies=["zero3", "ddp"])
    for name in ("zero3", "ddp"):
        mem = p[name].to_dict()["memory"]
        assert mem["peak_reserved"] >= mem["peak_allocated"]
        assert mem["device_total"] == mem["peak_reserved"] + mem["process_overhead"]
        assert mem["reserved_source"] == "allocator replay"
        assert "reserved_estimate" not in mem
    fits = dataclasses.replace(p["zero3"].memory)
    assert fits.fits == (fits.device_total <= fits.gpu_memory_bytes)


def test_alloc_conf_is_parsed_like_pytorch_and_reaches_the_replay():
    from distplan.planner.allocator import parse_alloc_conf
    assert parse_alloc_conf("expandable_segments:True") == (True, None, [])
    assert parse_alloc_conf("max_split_size_mb:512, expandable_segments:False")[:2] == (False, 512 << 20)
    # garbage collection acts only under a per-process memory fraction (CUDACachingAllocator.cpp `malloc`): said so
    assert "set_per_process_memory_fraction" in parse_alloc_conf("garbage_collection_threshold:0.8")[2][0]
    # every key PyTorch's AllocatorConfig::parseArgs accepts is accepted: a user's environment may set any of them.
    # Those about the lock and pinned host memory change no device block (no note); the rounding options are
    # replayed (allocator.alloc_rounding; a roundup_power2_divisions list keeps its commas); cudaMallocAsync is
    # said not to be.
    assert parse_alloc_conf("pinned_use_cuda_host_register:True,release_lock_on_cudamalloc:True,"
                            "pinned_num_register_threads:8,expandable_segments:True") == (True, None, [])
    assert parse_alloc_conf("pinned_use_hip_host_register:True") == (False, None, [])
    notes = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,>:8],max_non_split_rounding_mb:64,"
                             "backend:cudaMallocAsync")[2]
    assert len(notes) == 1 and "cudaMallocAsync" in notes[0], notes
    for bad in ("expandable_segments:yes", "max_split_size_mb:10", "foo:1", "expandable_segments",
                "garbage_collection_threshold:1.5", "backend:jemalloc"):
        with pytest.raises(ValueError, match="--alloc-conf"):
            parse_alloc_conf(bad)
    from distplan.planner.memory import estimate_memory
    from distplan.planner.config import Cluster
    c = Cluster(gpus=8, gpu_name="h100-sxm", gpu_memory_bytes=80 << 30, intra_link="nvlink4", inter_link="ib-ndr")
    plain = estimate_memory(_train(), c, "single")
    exp = estimate_memory(dataclasses.replace(_train(), alloc_conf="expandable_segments:True"), c, "single")
    assert exp.peak_allocated == plain.peak_allocated
    assert exp.peak_reserved != plain.peak_reserved


def test_cli_alloc_conf_flag_and_environment():
    from click.testing import CliRunner
    from distplan.planner.cli import main
    args = ["estimate", "--model", "llama-3-8b", "--gpus", "8", "--strategy", "fsdp", "--json"]
    r = CliRunner().invoke(main, args + ["--alloc-conf", "max_split_size_mb:nope"])
    assert r.exit_code == 2 and "--alloc-conf" in r.output and "Traceback" not in r.output
    env = CliRunner(env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}).invoke(main, args)
    flag = CliRunner().invoke(main, args + ["--alloc-conf", "expandable_segments:True"])
    plain = CliRunner(env={"PYTORCH_CUDA_ALLOC_CONF": ""}).invoke(main, args)
    res = [json.loads(x.output)["strategies"][0]["memory"]["peak_reserved"] for x in (env, flag, plain)]
    assert res[0] == res[1] != res[2]
    # the rounding options reach the replay too: every request rounded up to a quarter between powers of two
    rounded = CliRunner(env={"PYTORCH_CUDA_ALLOC_CONF": "roundup_power2_divisions:4"}).invoke(main, args)
    assert json.loads(rounded.output)["strategies"][0]["memory"]["peak_reserved"] > res[2], rounded.output


def test_validate_alloc_conf_reaches_the_probe_spec(tmp_path):
    """`distplan validate --alloc-conf` puts the configuration in every probe's spec (the runner exports
    it as PYTORCH_CUDA_ALLOC_CONF) and its id; a bad value is a one-line error."""
    from click.testing import CliRunner
    from distplan.planner.cli import main
    bad = CliRunner().invoke(main, ["validate", "--strategy", "ddp", "--alloc-conf", "bad:1",
                                    "--out", str(tmp_path / "r.jsonl")])
    assert bad.exit_code == 2 and "--alloc-conf='bad:1'" in bad.output and "Traceback" not in bad.output
    import sys
    from distplan.validate.runner import run_probe
    # a probe stand-in that reports the variable it was started with
    cmd = [sys.executable, "-c", "import sys, os, json; a = sys.argv; json.dump({'status': 'ok', "
           "'conf': os.environ.get('PYTORCH_CUDA_ALLOC_CONF')}, open(a[a.index('--out') + 1], 'w'))"]
    spec = {"id": "x", "mode": "fake", "world_size": 1, "train": {"alloc_conf": "expandable_segments:True"}}
    assert run_probe(spec, probe_cmd=cmd, timeout_s=60)["conf"] == "expandable_segments:True"


# torchtitan's published memory is `max_memory_reserved` (torchtitan/components/metrics.py:
# DeviceMemoryMonitor.get_peak_stats -> max_reserved_gib, logged as "memory: ... GiB"). The runs and their
# verbatim rows are in tests/data/published_runs.yaml (benchmarks/llama3_h100_202412_torchtitan.md,
# Table 1 and Table 5 "Memory(GiB)" column; eager rows only: the planner models eager memory).
TORCHTITAN_MEMORY = ("tt-llama31-8b-8xh100-sac", "tt-llama31-8b-128xh100-sac")


def test_torchtitan_published_reserved_memory():
    import importlib.util
    spec = importlib.util.spec_from_file_location("published_runs", os.path.join(ROOT, "benchmarks", "published_runs.py"))
    pr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pr)
    from distplan.planner.api import plan
    runs = {r["id"]: r for r in pr.load()["runs"]}
    errs = {}
    for rid in TORCHTITAN_MEMORY:
        run = runs[rid]
        published = float(run["source"]["row"].split("|")[-1]) * 2**30  # Memory(GiB), the row's last column
        p = plan(**pr.plan_kwargs(run))
        mem = p[run["distplan_strategy"]].memory
        errs[rid] = mem.peak_reserved / published - 1
        # the old margin under-predicted both (the dangerous side): allocated + 10%
        assert 1.1 * mem.peak_allocated < published
    # measured 2026-11-23: +5.6% (8 GPUs, 82.4 GiB published) and +8.5% (128 GPUs, 67.0 GiB); 2026-12-01, with
    # FSDP2's reduce-scatter input on the compute stream (`foreach_reduce`): +0.4% (82.7 GiB) and +1.4% (67.9);
    # with its mixed-precision copy-in cast written too: +0.7% (82.9) and +1.4% (67.9)
    assert all(abs(e) <= 0.10 for e in errs.values()), errs
    assert all(abs(e) <= 0.03 for e in errs.values()), errs


def test_trace_writer_at_depth_against_recorded_traces():
    """At 16 layers (width 1024) the planner's trace, replayed, reserves what the allocations the probes
    recorded on the CPU reserve through the same allocator model (benchmarks/alloc_depth.py;
    tests/data/alloc_events_cpu_depth16.json.gz): the writer's order and sizes, checked where the GPU
    probes (4 layers) do not reach. FSDP traces put each buffer a collective touches on its stream
    (allocator.comm_streams), as the H100 comparison does."""
    import gzip
    from distplan.planner.allocator import comm_streams
    from distplan.planner.model import ModelSpec
    with gzip.open(os.path.join(ROOT, "tests", "data", "alloc_events_cpu_depth16.json.gz"), "rt") as f:
        doc = json.load(f)
    errs = {}
    for pid, events in doc["events"].items():
        spec = doc["specs"][pid]
        st = get_strategy(spec["strategy"])
        if st.family in ("fsdp1", "fsdp2"):
            events = comm_streams(events, st.family)
        t = spec["train"]
        train = TrainConfig(ModelSpec(**spec["model"]), seq_len=t["seq_len"], micro_batch=t["micro_batch"],
                            precision=t["precision"], checkpointing=t["checkpointing"])
        world = spec["world_size"]
        shard = 1 if st.name in ("single", "fsdp-no-shard") else world
        recorded = replay(events).peak_reserved
        written = replay(allocation_events(train, st.name, world, shard, "cpu", "fake", 0, "device")).peak_reserved
        errs[pid] = round(100 * (written / recorded - 1), 1)
    assert len(errs) >= 18
    # measured 2026-11-23 (18 probes): median 1.9%, max 8.2% (fsdp fp32 full: the recorded replay put FSDP1's
    # sharded flat parameters, which the all-gather reads, in the all-gather stream's pool). 2026-12-01, each
    # storage on the stream the implementation allocates it on (allocator.comm_streams): median 1.1%, max 5.8%
    # (zero3 fp32, over); the FSDP1 probes re-recorded with their streams (and fsdp-grad-op bf16 full added, 19
    # probes) and the writer's FSDP1 flat gradient on the unshard stream: 1.2% / 5.8%
    assert statistics.median(abs(e) for e in errs.values()) <= 2.0, errs
    assert max(abs(e) for e in errs.values()) <= 7.0, errs


def _recorded(name: str) -> dict:
    import gzip
    with gzip.open(os.path.join(ROOT, "tests", "data", name), "rt") as f:
        return json.load(f)


def _without_gloo_copies(events) -> list:
    """The events less what only gloo allocates: the copy of each reduce-scatter input that
    ProcessGroupGloo makes (an allocation of the input's size right after its reduce_scatter, freed at
    once; NCCL makes none, and the planner writes none). Recorded with their streams, the copies sit in the
    reduce-scatter's pool, where a GPU run has nothing."""
    copies = [j for j in range(1, len(events) - 1)
              if events[j][0] == "alloc" and events[j - 1][0] == "comm"
              and events[j - 1][2] == "reduce_scatter" and events[j + 1] == ["free", events[j][1]]]
    # one per reduce-scatter (two touches each: its output, its input)
    assert len(copies) == sum(e[0] == "comm" and e[2] == "reduce_scatter" for e in events) // 2
    skip = set(copies) | {j + 1 for j in copies}
    return [e for j, e in enumerate(events) if j not in skip]


def _recorded_reserved(events, family: str, gloo: bool = False) -> int:
    """The recorded trace replayed: FSDP's buffers on their streams (as recorded, or inferred from the
    collectives: allocator.comm_streams). What other collectives touch is allocated on the caller's stream,
    so their touches are dropped first: DTensor's functional collectives (tensor parallelism),
    `distribute_tensor`'s scatter of each parameter (`parallelize_module` at construction), a checkpoint
    save's collectives. `gloo`: a run on gloo, whose reduce-scatter copies go too."""
    from distplan.planner.allocator import comm_streams
    if gloo:
        events = _without_gloo_copies(events)
    events = [e for e in events if not (e[0] == "comm" and (e[2] == "scatter" or str(e[2]).startswith(
        ("_c10d_functional.", "checkpoint."))))]
    if family in ("fsdp1", "fsdp2"):
        events = comm_streams(events, family)
    return replay(events).peak_reserved


def _accum_tp_errors() -> dict:
    from distplan.planner.config import Cluster
    from distplan.planner.model import ModelSpec
    from distplan.planner.tp import tp_view
    doc = _recorded("alloc_events_cpu_accum_tp.json.gz")
    errs = {}
    for pid, events in doc["events"].items():
        spec = doc["specs"][pid]
        st = get_strategy(spec["strategy"])
        t = spec["train"]
        train = TrainConfig(ModelSpec(**spec["model"]), seq_len=t["seq_len"], micro_batch=t["micro_batch"],
                            precision=t["precision"], checkpointing=t["checkpointing"],
                            grad_accum=t["grad_accum"], grad_sync=t["grad_sync"], tp=spec.get("tp", 1),
                            sequence_parallel=spec.get("sequence_parallel", False))
        world = spec["world_size"]
        if train.tp > 1:  # one TP rank's model on the data-parallel ranks, as memory.estimate_memory does
            train, dp = tp_view(train, Cluster(gpus=world, gpus_per_node=world))
            world = dp.gpus
        if st.name == "single":
            world = 1
        shard = 1 if st.name in ("single", "fsdp-no-shard") else world
        recorded = _recorded_reserved(events, st.family)
        written = replay(allocation_events(train, st.name, world, shard, "cpu", "fake", 0, "device")).peak_reserved
        errs[pid] = round(100 * (written / recorded - 1), 1)
    return errs


def test_trace_writer_under_accumulation_and_tp_against_recorded_traces():
    """Gradient accumulation (grad_accum 2, grad_sync last and every) and tensor parallelism (tp 2, with and
    without sequence parallelism): the planner's trace, replayed, reserves what the allocations the probes
    recorded on the CPU reserve through the same allocator model (benchmarks/alloc_accum.py;
    tests/data/alloc_events_cpu_accum_tp.json.gz: 8 layers, width 1024, 2 x 512 tokens)."""
    errs = _accum_tp_errors()
    accum = {k: v for k, v in errs.items() if "/tp1" in k}
    tp = {k: v for k, v in errs.items() if "/tp1" not in k}
    assert len(accum) >= 21 and len(tp) >= 6, errs
    # measured 2026-11-24: accumulation (21 probes) median 1.3%, max 5.1% (zero3 fp32 synced every
    # micro-step); the previous writer (one micro-step, the walk's allocated peak as a floor) 3.2% / 9.8%,
    # the 10% margin 9.5% / 17.9%. Tensor parallelism (6 probes): median 0.6%, max 3.9% (zero3 without
    # SP); the previous writer with the floor 0.7% / 3.5%, the margin 13.9% / 19.5%.
    # 2026-12-01: FSDP2's reduce-scatter input moved to the compute stream in both the writer and the
    # recorded replay (allocator.comm_streams, as `foreach_reduce` allocates it; against the H100's
    # max_memory_reserved FSDP2 went from 8.2% to 2.1% median): accumulation median 1.1%, max 7.7% (zero3 fp32
    # synced every micro-step, over: its reduce-scatter inputs now share the compute pool, where the writer's
    # transient order differs from the recorded one), TP median 1.2%, max 5.4% (zero3 with SP). A gap stated,
    # not fixed: the writer's order within a block's backward. 2026-12-04, a block's backward written in two
    # phases (to its peak: the consumed saved tensors freed, the transients, the MLP's output projection's
    # weight gradient; then the others) where tp = 1: accumulation median 0.8%, max 3.4% (zero2 and zero3 fp32
    # synced every micro-step, 5.6% and 7.7% before); TP keeps the burst (single at tp 2: 0.2%, 2.6% phased).
    assert statistics.median(abs(e) for e in accum.values()) <= 1.5, accum
    assert max(abs(e) for e in accum.values()) <= 4.0, accum
    assert statistics.median(abs(e) for e in tp.values()) <= 1.5, tp
    assert max(abs(e) for e in tp.values()) <= 6.0, tp


@pytest.mark.parametrize("name", ["alloc_events_cpu_pp.json.gz", "alloc_events_cpu_pp_torch215.json.gz"])
def test_pipeline_stage_trace_against_recorded_traces(name):
    """Pipeline-parallel stages (GPipe and 1F1B, 2 and 4 stages, checkpointing, DDP replicas): each stage's
    trace from the planner (alloc_trace.stage_allocation_events), replayed, reserves what the stage's
    recorded allocations reserve (benchmarks/alloc_pp.py; tests/data/alloc_events_cpu_pp.json.gz on torch
    2.13, alloc_events_cpu_pp_torch215.json.gz on 2.15, whose PipelineStage makes each receive buffer at its
    receive: config.pp_recv_buffers_per_receive). Each spec names the torch it ran on, and the planner
    writes the trace of that release."""
    from distplan.validate.pp_probe import train_config
    from distplan.planner.alloc_trace import stage_allocation_events
    doc = _recorded(name)
    errs = {}
    for key, events in doc["events"].items():
        pid, stage = key.rsplit("/stage", 1)
        spec = doc["specs"][pid]
        dp = spec["dp"]
        written = stage_allocation_events(train_config(spec), spec["strategy"], int(stage), dp,
                                          dp if spec["strategy"] == "zero1" else 1, "cpu", 0)
        errs[key] = round(100 * (replay(written).peak_reserved / replay(events).peak_reserved - 1), 1)
    assert len(errs) >= 14, errs
    # measured 2026-11-24 (18 stage traces of 7 probes, torch 2.13): median 0.8%, max 2.6% (DDP 1F1B, the last
    # stage). Torch 2.15 (2026-11-29, the same 18): median 0.65%, max 3.9% (GPipe with full checkpointing, the
    # last stage: in the second step the planner's trace opens a 32 MiB segment, the LM head's size, that
    # the recorded run finds room for; 3.7% DDP 1F1B, 3.1% 1F1B, the last stage too). Written as 2.13 runs
    # (buffers kept for the run) the 2.15 traces are off by median 1.05%, max 3.4%. 2026-12-01: the last
    # stage's log_softmax output freed with its backward node, before the head's weight gradient (as
    # allocation_events has it; it was kept to the head's end): 2.15 median 0.57%, 1F1B's last stage 3.1% ->
    # 1.0%; the two gaps unchanged (at the head's weight gradient both traces now hold the same bytes,
    # 895 MB: where the 32 MiB block fits is the free lists' history, not the live bytes); 2.13 unchanged.
    gaps = {"pp2/gpipe/single-dp1/full/m4/stage1", "pp2/1f1b/ddp-dp2/none/m4/stage1"} if "215" in name else set()
    rest = {k: e for k, e in errs.items() if k not in gaps}
    assert statistics.median(abs(e) for e in errs.values()) <= 1.5, errs
    assert max(abs(e) for e in rest.values()) <= 3.5, errs
    assert all(3.5 < abs(errs[k]) <= 4.0 for k in gaps), errs  # known gaps, stated above: still open


@pytest.mark.parametrize("name", ["alloc_events_cpu_pp_fsdp.json.gz", "alloc_events_cpu_pp_fsdp_torch215.json.gz"])
def test_pipeline_stage_fsdp2_trace_against_recorded_traces(name):
    """FSDP2 pipeline stages (zero2/zero3 over 2 replicas per stage; GPipe and 1F1B on 2 stages,
    checkpointing, 1F1B on 4): each stage's trace from the planner (alloc_trace.stage_allocation_events), replayed,
    reserves what the stage's recorded allocations reserve (benchmarks/alloc_pp.py;
    tests/data/alloc_events_cpu_pp_fsdp.json.gz on torch 2.13, alloc_events_cpu_pp_fsdp_torch215.json.gz on
    2.15, each written for the release it ran on). The recorded trace is replayed with FSDP's buffers on
    their collectives' streams (allocator.comm_streams; the pipeline's send/recv touches dropped first: the
    stage allocates those tensors on its compute stream), and without what only gloo allocates: the copy
    of each reduce-scatter input that gloo makes (an allocation of the input's size right after its
    reduce_scatter, freed at once; NCCL makes none, and the planner writes none, as allocation_events)."""
    from distplan.planner.allocator import comm_streams
    from distplan.planner.alloc_trace import stage_allocation_events
    from distplan.validate.pp_probe import train_config
    doc = _recorded(name)
    errs, alloc_errs = {}, {}
    for key, events in doc["events"].items():
        pid, stage = key.rsplit("/stage", 1)
        spec = doc["specs"][pid]
        dp = spec["dp"]
        recorded = replay(comm_streams([e for e in _without_gloo_copies(events)
                                        if not (e[0] == "comm" and e[2] in ("send", "recv"))], "fsdp2"))
        written = replay(stage_allocation_events(train_config(spec), spec["strategy"], int(stage), dp, dp, "cpu", 0))
        errs[key] = round(100 * (written.peak_reserved / recorded.peak_reserved - 1), 1)
        alloc_errs[key] = round(100 * (written.peak_allocated / recorded.peak_allocated - 1), 1)
    assert len(errs) >= 14, errs
    # measured 2026-11-24 (14 stage traces of 6 probes): reserved median 1.1%, max 2.1% (GPipe zero2 with
    # checkpointing, the last stage), the single/DDP stages' bounds; allocated median 1.6%, max 3.2% (the
    # planner's bytes a little above: over on every stage; 2.0% / 3.3% before the first stage's embedding
    # output became block 0's input instead of a tensor of its own). With gloo's copies left in the recorded trace
    # the reserved errors are median 2.3%, max 6.3% (pp 4, stage 1): the copies the planner does not write.
    # Torch 2.15 (2026-11-29, the same 14 stages): reserved median 0.4%, max 3.1%, allocated median 1.65%, max
    # 3.0%; written as 2.13 runs (buffers kept for the run) 1.2% / 3.6% and 2.2% / 5.0%.
    # 2026-12-01, the reduce-scatter inputs on the compute stream in both (allocator.comm_streams): 2.13
    # median 0.95%, max 3.6% (GPipe zero3 stage 0, over); 2.15 median 0.45%, max 4.6% (GPipe zero3 stage 1).
    assert statistics.median(abs(e) for e in errs.values()) <= 1.5, errs
    assert max(abs(e) for e in errs.values()) <= 5.0, errs
    assert statistics.median(abs(e) for e in alloc_errs.values()) <= 2.5, alloc_errs
    assert max(abs(e) for e in alloc_errs.values()) <= 3.5, alloc_errs


def test_pipeline_stage_reserved_source():
    """A pipeline stage is replayed where its trace is written (single/DDP/FSDP2, GPipe and 1F1B, no
    autocast); ZeRO-1 stages, FSDP2 on one data-parallel rank, interleaved schedules and autocast keep the
    margin and say so."""
    from distplan.planner.api import plan
    p = plan("llama-3-8b", gpus=8, strategies=["ddp", "zero1", "zero2", "zero3"], pp=2, precision="bf16")
    for s in ("ddp", "zero2", "zero3"):
        assert p[s].memory.reserved_source == "allocator replay", s
        assert p[s].memory.peak_reserved >= p[s].memory.peak_allocated, s
    assert p["zero1"].memory.reserved_source == "10% margin"
    assert any("no allocator replay of zero1 stages" in n for n in p["zero1"].memory.notes)
    mixed3 = plan("llama-3-8b", gpus=8, strategies=["zero3"], pp=2, precision="bf16-mixed")
    assert mixed3["zero3"].memory.reserved_source == "allocator replay"  # FSDP2's mixed precision: no autocast
    one = plan("llama-3-8b", gpus=2, strategies=["zero3"], pp=2, precision="bf16")
    assert one["zero3"].memory.reserved_source == "10% margin"
    assert any("no allocator replay of zero3 stages on one data-parallel rank" in n for n in one["zero3"].memory.notes)
    mixed = plan("llama-3-8b", gpus=8, strategies=["ddp"], pp=2, precision="bf16-mixed")
    assert mixed["ddp"].memory.reserved_source == "10% margin"
    inter = plan("llama-3-8b", gpus=8, strategies=["ddp"], pp=2, precision="bf16", pp_schedule="interleaved-1f1b")
    assert inter["ddp"].memory.reserved_source == "10% margin"


def test_accumulation_events_are_balanced():
    """Every micro-step frees what it makes but the gradients it keeps, and the step frees those: with
    grad_accum > 1 and either grad_sync, replaying more steps adds no allocated bytes."""
    for sync in ("last", "every"):
        train = dataclasses.replace(_train(name="phi-3-mini", seq_len=1024), grad_accum=3, grad_sync=sync)
        for st, w, sh in (("ddp", 8, 1), ("zero2", 8, 8), ("zero3", 8, 8), ("fsdp", 8, 8), ("fsdp-grad-op", 8, 8)):
            ends = []
            for steps in (1, 3):
                with _measured_steps(steps):
                    ends.append(replay(allocation_events(train, st, w, sh)).allocated)
            assert ends[0] == ends[1], (st, sync)


def test_checkpoint_save_trace_against_recorded_traces():
    """Checkpoint saves after the measured step (full state dicts as rank 0 of 8 on the fake process group,
    DCP sharded saves on 2 gloo ranks; DDP, FSDP2, FSDP1): the planner's run and save
    (alloc_trace.allocation_events + checkpoint_events), replayed, reserve what rank 0's recorded
    allocations reserve (benchmarks/alloc_ckpt.py; tests/data/alloc_events_cpu_ckpt.json.gz)."""
    from distplan.planner.alloc_trace import checkpoint_events
    from distplan.planner.model import ModelSpec
    doc = _recorded("alloc_events_cpu_ckpt.json.gz")
    errs = {}
    for pid, events in doc["events"].items():
        spec = doc["specs"][pid]
        st = get_strategy(spec["strategy"])
        t = spec["train"]
        train = TrainConfig(ModelSpec(**spec["model"]), seq_len=t["seq_len"], micro_batch=t["micro_batch"],
                            precision=t["precision"], checkpointing=t["checkpointing"])
        world = spec["world_size"]
        shard = 1 if st.name in ("single", "fsdp-no-shard") else world
        backend = "fake" if spec["mode"] == "fake" else "gloo"
        written = allocation_events(train, st.name, world, shard, "cpu", backend, 0, "device")
        written += checkpoint_events(train, st.name, shard, spec["checkpoint"]["mode"],
                                     max(e[1] for e in written if e[0] == "alloc"))
        recorded = _recorded_reserved(events, st.family, gloo=backend == "gloo" and world > 1)
        errs[pid] = round(100 * (replay(written).peak_reserved / recorded - 1), 1)
    assert len(errs) >= 8, errs
    # measured 2026-11-24 (8 probes): median 1.2%, max 2.9% (zero3 sharded on gloo); 2026-12-01, the FSDP1 saves
    # re-recorded with their streams and gloo's reduce-scatter copies left out of the gloo runs: 1.95% / 2.4%
    assert statistics.median(abs(e) for e in errs.values()) <= 2.0, errs
    assert max(abs(e) for e in errs.values()) <= 4.0, errs


def test_accumulation_and_microbatch_work_is_bounded():
    """The micro-steps between the second and the last repeat the second's allocations: a grad_accum of
    2**20 writes as many events as 3 (and reserves the same); a pipeline with more micro-batches than
    alloc_trace.MAX_MICROBATCHES keeps the margin."""
    from distplan.planner.alloc_trace import MAX_MICROBATCHES
    from distplan.planner.api import plan
    base = _train(name="phi-3-mini", seq_len=1024)
    for sync in ("last", "every"):
        three, huge = (allocation_events(dataclasses.replace(base, grad_accum=a, grad_sync=sync), "zero3", 8, 8)
                       for a in (3, 2**20))
        assert len(three) == len(huge) and replay(three).peak_reserved == replay(huge).peak_reserved
    p = plan("llama-3-8b", gpus=8, strategies=["ddp"], pp=2, precision="bf16", pp_microbatches=MAX_MICROBATCHES + 1)
    assert p["ddp"].memory.reserved_source == "10% margin"


def test_strategies_keyed_alike_write_the_same_events():
    """The replay caches key a strategy by `_TRACE_NAMES` (hsdp's replay is fsdp's for the same world and
    shard group): every strategy so keyed writes the events of the one it is keyed by, over precisions,
    accumulation, checkpointing, meta init and shard groups of one node and of several."""
    from distplan.planner.alloc_trace import _TRACE_NAMES
    merged = [(s, t) for s, t in _TRACE_NAMES.items() if s != t]
    assert ("hsdp", "fsdp") in merged
    for kw in ({}, {"precision": "fp32"}, {"grad_accum": 3}, {"checkpointing": "full"}):
        train = dataclasses.replace(_train(name="phi-3-mini", seq_len=512), **kw)
        for s, t in merged:
            for world, shard, init in ((8, 8, "device"), (16, 8, "device"), (16, 16, "meta")):
                assert (allocation_events(train, s, world, shard, init=init)
                        == allocation_events(train, t, world, shard, init=init)), (s, t, kw, world, shard)


def test_tied_model_trace_against_recorded_traces(tmp_path):
    """Tied-embedding transformers models under mixed precision, their vocabulary outweighing a block
    (benchmarks/alloc_tied.py; tests/data/alloc_events_cpu_tied_bf16.json.gz: a Qwen2 of vocabulary 32,768,
    width 512, 4 layers, and Qwen2.5-0.5B itself, its published config at full size; bf16-mixed, 2 x 128
    tokens, rank 0 of 8 on the fake process group, torch 2.13): the planner's trace of the
    analytic front end, replayed, against the allocations the probes recorded, replayed through the same
    allocator model. What the trace writes of the embedding-sized tensors moves these peaks: the LM head's own
    weight that transformers makes and drops when it ties it (`_tied_head_transient`), and, where the tied
    weight is the parameter itself (DDP), its gradients at the embedding's backward."""
    from distplan.planner.allocator import comm_streams
    doc = _recorded("alloc_events_cpu_tied_bf16.json.gz")
    errs = {}
    for pid, events in doc["events"].items():
        spec = doc["specs"][pid]
        cfg = tmp_path / (pid.split("/")[0] + ".json")
        cfg.write_text(json.dumps(spec["config"]))
        model, _ = resolve_model(hf_config=str(cfg))
        t = spec["train"]
        st = get_strategy(spec["strategy"])
        train = TrainConfig(model, seq_len=t["seq_len"], micro_batch=t["micro_batch"], precision=t["precision"],
                            torch_version=spec["torch_version"])
        shard = 1 if st.family in ("ddp", "single") else spec["world_size"]
        written = replay(allocation_events(train, st.name, spec["world_size"], shard, "cpu", "fake", 0,
                                           "device")).peak_reserved
        recorded = replay(comm_streams(events, st.family) if st.family in ("fsdp1", "fsdp2")
                          else events).peak_reserved
        errs[pid] = round(100 * (written / recorded - 1), 1)
    assert len(errs) == 8, errs
    # measured 2026-12-01: the small Qwen2 ddp +0.5%, zero2 0.0%, zero3 0.0%, fsdp -0.5%; Qwen2.5-0.5B ddp -0.7%,
    # zero2 -0.1%, zero3 -0.1%, fsdp -0.1%. The writer of that morning: the small ddp -7.1%, fsdp -13.0%;
    # Qwen2.5-0.5B ddp -0.5%, zero2 -12.1%, zero3 -12.1%, fsdp -10.8%, the side that runs out of memory. What it
    # lacked: the LM head weight transformers makes and drops when it ties it (a segment later buffers reuse),
    # the tied gradients at the embedding's backward (the head's, held in autograd's input buffer through the
    # blocks' backward, the embedding's and their sum: three vocab x hidden tensors), and FSDP1's construction
    # order (the flat parameter sharded before the originals go)
    assert max(abs(e) for e in errs.values()) <= 2.0, errs


def test_module_trace_against_recorded_traces():
    """The `--module` front end's reserved peak (module_plan.logged_module_events: the traced step's own
    allocations, in the order the fake-tensor run made and dropped them, written into the probe's run by
    alloc_trace.logged_step_events) against the allocations the probes recorded (benchmarks/alloc_modules.py;
    tests/data/alloc_events_cpu_modules.json.gz: the MNIST CNN fp32 and bf16-mixed with Adam (single: AdamW's
    fused and for-loop kernels too), the CIFAR ResNet
    fp32 with SGD-momentum and with AdamW over two accumulated micro-steps, batch 32, single / ddp / zero1
    on 8 fake ranks, torch 2.13), both replayed through the same allocator model. Measured 2026-12-02: the
    reserved peak equal to the byte in all 14, the allocated peak within 0.06%; before, the plan was the
    allocated peak + 10%."""
    errs = _errors(_module_replays("alloc_events_cpu_modules.json.gz"))
    assert len(errs) == 14, errs
    assert all(r == 0 for r, _ in errs.values()), errs
    assert max(abs(a) for _, a in errs.values()) <= 0.1, errs


def _module_replays(name: str) -> dict:
    """Per recorded `--module` probe of tests/data/`name` (benchmarks/alloc_modules.py): (the planner's written
    events, the recorded ones as the replay takes them: FSDP's on their streams, the collectives' touches
    dropped), from the trace in the probe's regime and checkpointing (module_plan.predict_module_probe's)."""
    from distplan.planner.allocator import comm_streams
    from distplan.planner.config import checkpoint_every
    from distplan.planner.module_plan import ModuleModel, ModuleTrain, _regime, _traced, logged_module_events
    from distplan.planner.workload.traced_model import from_spec
    doc = _recorded(name)
    out = {}
    for pid, events in doc["events"].items():
        spec = doc["specs"][pid]
        t, st = spec["train"], get_strategy(spec["strategy"])
        every = checkpoint_every(t["checkpointing"])
        work = from_spec(dict(spec["module"], path=ROOT))
        desc = _traced(work, _regime(t["precision"], st.family), "cpu", every)
        if desc.batchnorm:  # FSDP1's BatchNorm units
            desc = _traced(work, _regime(t["precision"], st.family, True), "cpu", every)
        desc = desc.for_precision(t["precision"])
        assert desc.alloc_log_every == every, pid
        train = ModuleTrain(ModuleModel(desc.name, work.label, desc.param_count(), desc.units),
                            precision=t["precision"], optimizer=t["optimizer"], optimizer_impl=t["optimizer_impl"],
                            grad_accum=t["grad_accum"], input_shape=tuple(spec["module"]["input_shape"]),
                            torch_version=spec["torch_version"], checkpointing=t["checkpointing"])
        world = spec["world_size"]
        shard = world if st.family in ("zero1", "fsdp2") or st.name in ("fsdp", "fsdp-grad-op", "hsdp") else 1
        written = logged_module_events(desc, train, st.family, world, shard, strategy=st.name)
        assert written is not None, pid
        recorded = [e for e in events if e[0] != "comm"]
        if st.family in ("fsdp1", "fsdp2"):
            recorded = comm_streams(events, st.family)
        out[pid] = (written, recorded)
    return out


def _errors(pairs: dict) -> dict:
    """pid -> (reserved peak error %, allocated peak error %) of the written events' replay."""
    errs = {}
    for pid, (written, recorded) in pairs.items():
        w, r = replay(written), replay(recorded)
        errs[pid] = (round(100 * (w.peak_reserved / r.peak_reserved - 1), 2),
                     round(100 * (w.peak_allocated / r.peak_allocated - 1), 2))
    return errs


def test_module_fsdp_trace_against_recorded_traces():
    """`--module` under FSDP2 (zero2, zero3; alloc_trace.logged_fsdp2_events) and FSDP1 (fsdp, fsdp-grad-op,
    hsdp, fsdp-no-shard; alloc_trace.logged_fsdp1_events): the traced step's allocations with the units'
    unshards, reshards and reductions written where the trace marked FSDP's hooks, against the allocations
    the probes recorded on the CPU with their streams (benchmarks/alloc_modules.py --fsdp;
    tests/data/alloc_events_cpu_modules_fsdp.json.gz: the MNIST CNN fp32 and bf16-mixed with Adam, the CIFAR
    ResNet fp32 with SGD-momentum and with AdamW over two accumulated micro-steps, and (FSDP1, its BatchNorm
    units in fp32) bf16-mixed; batch 32, rank 0 of 8 on the fake process group, torch 2.13). Measured
    2026-12-02: the reserved peak equal to the byte in all 28, the allocated peak within 0.07%; before,
    the plan was the allocated peak + 10% (the recorded reserved / allocated: 1.6-6.1 at these sizes)."""
    errs = _errors(_module_replays("alloc_events_cpu_modules_fsdp.json.gz"))
    assert len(errs) == 28, errs
    assert all(r == 0 for r, _ in errs.values()), errs
    assert max(abs(a) for _, a in errs.values()) <= 0.1, errs


def _without_scalars(events) -> list:
    """The events less the allocations of 8 bytes or fewer and their frees: one-element tensors, among them
    Adam's `state["step"]`, which the CPU probes make on their device and a GPU run keeps on the host (the
    for-each and for-loop kernels; torch/optim/adam.py `_init_group`)."""
    drop, out = set(), []
    for e in events:
        if e[0] == "alloc" and e[2] <= 8:
            drop.add(e[1])
        elif not (e[0] == "free" and e[1] in drop):
            out.append(e)
        if e[0] == "free":
            drop.discard(e[1])
    return out


def test_module_checkpointed_trace_against_recorded_traces():
    """`--module` under activation checkpointing (full, every-2): the allocation log is traced with the units
    checkpointed as the probes do (`checkpoint_wrapper`, non-reentrant), so the recomputations in backward are
    in it, replayed by the same writers (single, ddp, zero1, zero2, zero3, fsdp, fsdp-grad-op, fsdp-no-shard),
    against the CPU probes' recorded allocations (benchmarks/alloc_modules.py --checkpointing;
    tests/data/alloc_events_cpu_modules_ckpt.json.gz: the MNIST CNN fp32 and bf16-mixed, the CIFAR ResNet
    fp32 full and every-2 over two micro-steps, bf16-mixed (FSDP1's BatchNorm units, all-gathered again by
    the recomputation); 36 probes, torch 2.13). Measured 2026-12-02: the allocated peak within 0.07% in all;
    the reserved peak to the byte in 34, and in the other two (single: the MNIST bf16-mixed +7.7%, the CIFAR
    every-2 -6.3%, one 2 MiB small-pool segment each) to the byte once the one-element tensors are left out
    of both, which the CPU run allocates on its device and a GPU run does not all (Adam's step counts). (At
    these sizes a reserved peak is a few segments: leaving the scalars out of the exact ones moves two of
    them by a segment too.)"""
    pairs = _module_replays("alloc_events_cpu_modules_ckpt.json.gz")
    errs = _errors(pairs)
    assert len(errs) == 36, errs
    assert max(abs(a) for _, a in errs.values()) <= 0.1, errs
    off = {pid: e for pid, e in errs.items() if e[0] != 0}
    assert len(off) <= 2, off
    for pid in off:
        written, recorded = pairs[pid]
        assert abs(replay(written).peak_reserved - replay(recorded).peak_reserved) <= 2 << 20, off  # one segment
        assert replay(_without_scalars(written)).peak_reserved == replay(_without_scalars(recorded)).peak_reserved


@pytest.mark.slow
def test_module_at_depth_trace_against_recorded_traces():
    """A model written the usual way at depth: a ViT of 16 `nn.TransformerEncoderLayer` blocks (width 384,
    28M parameters; examples/vit_tiny.py make_deep), batch 16, fp32 and bf16-mixed, without checkpointing,
    full and every-2 (two micro-steps), single / ddp / zero2 / zero3 / fsdp (rank 0 of 8), its CPU probes'
    recorded allocations (benchmarks/alloc_modules.py --deep; tests/data/alloc_events_cpu_modules_deep.json.gz;
    0.1-1.2 GB allocated, reserved / allocated 1.04-2.07) against the written run. Measured 2026-12-02 (20
    probes): the reserved peak to the byte in 18, -0.83% (zero2 bf16-mixed full) and -0.28% (zero2 fp32
    every-2) in the others; the allocated peak within 0.31%."""
    errs = _errors(_module_replays("alloc_events_cpu_modules_deep.json.gz"))
    assert len(errs) == 20, errs
    assert sum(r == 0 for r, _ in errs.values()) >= 18, errs
    assert max(abs(r) for r, _ in errs.values()) <= 1.0, errs
    assert max(abs(a) for _, a in errs.values()) <= 0.4, errs


def test_module_pure_bf16_and_fp16_trace_against_recorded_traces():
    """`--module` in pure bf16 (`--precision bf16`: the module built in fp32, moved to the device, then cast,
    validate/wrap.py `model.to(torch.bfloat16)`; `ModuleDesc.construct_built`, alloc_trace._built_and_cast):
    parameters, gradients, optimizer states and FSDP's shards and reductions in bf16, against the CPU probes'
    recorded allocations (benchmarks/alloc_modules.py --bf16; tests/data/alloc_events_cpu_modules_bf16.json.gz:
    the MNIST CNN with AdamW, the CIFAR ResNet with SGD-momentum (its BatchNorm statistics cast too, which
    FSDP2 then runs), the 6-block ViT under full checkpointing; single, ddp, zero1, zero2, zero3, fsdp,
    fsdp-no-shard; 21 probes), and fp16-mixed as the fake process group runs it (the MNIST CNN, 7 probes; no
    GradScaler there, whose few 4-byte tensors are not written). Measured 2026-12-02: the reserved peak to the
    byte in 27 of 28, +2.6% (one 2 MiB segment: the ViT under fsdp-no-shard) in the other; the allocated peak
    within 0.6%."""
    errs = _errors(_module_replays("alloc_events_cpu_modules_bf16.json.gz"))
    assert len(errs) == 28, errs
    assert sum(r == 0 for r, _ in errs.values()) >= 27, errs
    assert max(abs(r) for r, _ in errs.values()) <= 3.0, errs
    assert max(abs(a) for _, a in errs.values()) <= 0.7, errs


def test_walks_peak_parts_labels_every_live_byte():
    """benchmarks/walks_peak_parts.py names the writer of each tensor live at the event list's peak: its
    labelled events are the plain writer's, event for event, and the labelled bytes add up to that peak."""
    import importlib.util
    from collections import Counter
    spec = importlib.util.spec_from_file_location("walks_peak_parts",
                                                  os.path.join(ROOT, "benchmarks", "walks_peak_parts.py"))
    wp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wp)
    from distplan.planner.api import plan
    mem = plan("llama-3-8b", gpus=8, gpu="h100-sxm", comm=False, seq_len=1024, micro_batch=2,
               strategies=["zero2"]).results[0].memory
    args = mem.reserved_replay
    events, labels = wp.labelled_events(args)
    assert events == allocation_events(*args[:7], args[8])
    peak, at, live = wp.live_at_peak(events)
    assert peak == sum(live.values()) and events[at][0] == "alloc"
    sites = Counter(labels[k] for k in live)
    assert all(sites) and any("block_forward" in s for s in sites)
