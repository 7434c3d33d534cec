"""The CUDA caching allocator model (planner/allocator.py): its rules one by one, then recorded allocation
traces replayed against `torch.cuda.max_memory_reserved` measured on an H100.

The traces (tests/data/alloc_events_h100.json.gz, benchmarks/alloc_h100.py) are the storage allocations,
frees and collective touches, in host order, of CPU re-runs (the fake process group; one process for
`single`) of every probe whose H100 measurement is committed in
benchmarks/results/h100-torch2.11-2026-11-23.jsonl: recorded with `DISTPLAN_ALLOC_EVENTS`
(validate/probe.py, validate.measure.Tracker.events), each allocation with the stream a GPU would make it
on (validate.measure.StreamTags: FSDP's stream contexts, and in backward the stream of each node's forward
op, as CUDA autograd runs it), which the replay keeps (`allocator.comm_streams` infers streams only for
traces recorded without them). The cuBLAS workspace the planner adds on a GPU (one 32 MiB block on Hopper,
`CublasHandlePool.cpp`) is allocated before the first tensor of the step, as the first GEMM does."""

from __future__ import annotations

import gzip
import json
import os
import statistics

import pytest

from distplan.planner.allocator import (LARGE_BUFFER, SMALL_BUFFER, allocation_size, comm_streams, replay,
                                        round_size)
from distplan.planner.api import predict_probe
from distplan.validate.results import record_spec
from distplan.planner.strategies import get_strategy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
M = 2**20


def test_rounding_and_segment_sizes():
    assert round_size(1) == 512 and round_size(513) == 1024
    assert allocation_size(600 * 1024) == SMALL_BUFFER
    assert allocation_size(3 * M) == LARGE_BUFFER
    assert allocation_size(11 * M) == 12 * M  # >= 10 MiB: rounded to 2 MiB


def test_small_request_takes_a_2_mib_segment():
    a = replay([("alloc", 1, 600 * 1024), ("alloc", 2, 600 * 1024), ("alloc", 3, 1000 * 1024)])
    assert a.reserved == 2 * SMALL_BUFFER  # 600 + 600 KiB share one, 1000 KiB needs a second


def test_large_block_split_only_above_1_mib():
    a = replay([("alloc", 1, int(19.5 * M))])
    assert a.reserved == LARGE_BUFFER and a.allocated == LARGE_BUFFER  # 0.5 MiB left: handed out whole
    a = replay([("alloc", 1, int(1.5 * M)), ("alloc", 2, 12 * M)])
    assert a.reserved == LARGE_BUFFER  # the 18.5 MiB remainder takes the 12 MiB request


def test_expandable_segments_split_every_remainder():
    """With expandable segments `should_split` splits a large-pool block whatever its remainder (>= 512 bytes,
    CUDACachingAllocator.cpp `should_split`), where the default allocator hands out a block up to 1 MiB larger
    whole: a 19.5 MiB request keeps 19.5 MiB, the 0.5 MiB left stays free at the segment's end, so a later 20 MiB
    request fits neither that nor the freed 19.5 MiB and maps another page."""
    ev = [("alloc", 1, int(19.5 * M)), ("alloc", 2, int(19.5 * M)), ("free", 1), ("alloc", 3, 20 * M)]
    e = replay(ev, expandable_segments=True)
    assert e.reserved == 60 * M and e.peak_allocated == int(39.5 * M)
    d = replay(ev)  # two 20 MiB segments, each handed out whole; the freed one takes the 20 MiB request
    assert d.reserved == 40 * M and d.peak_allocated == 40 * M


def test_free_merges_and_best_fit_reuses():
    a = replay([("alloc", 1, 5 * M), ("alloc", 2, 5 * M), ("free", 1), ("free", 2), ("alloc", 3, 15 * M)])
    assert a.reserved == LARGE_BUFFER  # 5 + 5 + 10 merged back into one 20 MiB block
    a = replay([("alloc", 1, 30 * M), ("free", 1), ("alloc", 2, 25 * M), ("free", 2), ("alloc", 3, 40 * M)])
    assert a.reserved == 70 * M  # 30 MiB cached, 40 MiB does not fit: a new segment
    e = replay([("alloc", 1, 30 * M), ("free", 1), ("alloc", 2, 25 * M), ("free", 2), ("alloc", 3, 40 * M)],
               expandable_segments=True)
    assert e.reserved == 40 * M  # expandable: 30 MiB maps two 20 MiB pages, the 40 MiB request reuses them


def test_out_of_memory_releases_the_cache_and_retries():
    """A cudaMalloc that fails releases every cached segment that is wholly free (in every pool and stream)
    and is retried once (CUDACachingAllocator.cpp `release_cached_blocks`; `num_alloc_retries`): a run whose
    reserved peak without a limit is above the device's memory may still fit; out of memory only when the
    retry fails too."""
    ev = [("alloc", 1, 30 * M, 2), ("free", 1), ("alloc", 2, 24 * M), ("alloc", 3, 40 * M)]
    free = replay(ev)
    assert free.reserved == 30 * M + 24 * M + 40 * M and free.retries == 0  # no limit: all three cached
    a = replay(ev, capacity=70 * M)
    assert not a.oom and a.retries == 1  # the free 30 MiB segment of stream 2 released for the 40 MiB one
    assert a.reserved == 64 * M and a.peak_reserved == 64 * M
    # a split segment is not released: 24 MiB still allocated in the 30 MiB block, no room for 40 MiB
    split = [("alloc", 1, 30 * M), ("free", 1), ("alloc", 2, 24 * M), ("alloc", 3, 40 * M)]
    b = replay(split, capacity=69 * M)
    assert b.oom and b.retries == 1
    c = replay(split, capacity=70 * M)  # 30 + 40 MiB fit without a retry
    assert not c.oom and c.retries == 0 and c.peak_reserved == 70 * M


def test_streams_do_not_share_blocks():
    a = replay([("alloc", 1, 5 * M, 0), ("free", 1), ("alloc", 2, 5 * M, 1)])
    assert a.reserved == 2 * LARGE_BUFFER


def test_max_split_size_keeps_big_blocks_whole():
    ev = [("alloc", 1, 64 * M), ("free", 1), ("alloc", 2, 8 * M)]
    assert replay(ev).reserved == 64 * M  # the 8 MiB request splits the cached 64 MiB block
    assert replay(ev, max_split_size=32 * M).reserved == 64 * M + LARGE_BUFFER


def _traces():
    with gzip.open(os.path.join(ROOT, "tests", "data", "alloc_events_h100.json.gz"), "rt") as f:
        return json.load(f)["events"]


def _h100_records():
    with open(os.path.join(ROOT, "benchmarks", "results", "h100-torch2.11-2026-11-23.jsonl")) as f:
        return {r["id"]: r for r in map(json.loads, f) if r["measurement"].get("status") == "ok"}


def _replayed(pid, events, rec):
    ws = predict_probe(record_spec(rec))["memory"]["workspace"]
    family = get_strategy(rec["inputs"]["strategy"]).family
    if family in ("fsdp1", "fsdp2"):
        events = comm_streams(events, family)
    first = next(i for i, e in enumerate(events) if e[0] == "alloc")
    return replay(list(events[:first]) + [["alloc", -1, ws]] + list(events[first:]))


def _judge(ids, traces, recs, check_allocated=True):
    errors, old = {}, {}
    for pid in ids:
        r = recs[pid]
        a = _replayed(pid, traces[pid], r)
        measured = r["measurement"]["memory"]
        errors[pid] = a.peak_reserved / measured["peak_reserved"] - 1
        old[pid] = 1.1 * measured["peak_allocated"] / measured["peak_reserved"] - 1  # the 10% margin
        # the replay's allocated peak is max_memory_allocated, rounding included (single stream: the CPU
        # trace allocates what the GPU does; FSDP's CPU runs differ in places, e.g. FSDP1 under autocast)
        if check_allocated:
            assert abs(a.peak_allocated / measured["peak_allocated"] - 1) < 0.08, pid
    return errors, old


def test_replay_reproduces_h100_reserved_for_single_stream_probes():
    traces, recs = _traces(), _h100_records()
    ids = [p for p in traces if get_strategy(recs[p]["inputs"]["strategy"]).family in ("single", "ddp", "zero1")]
    assert len(ids) >= 20
    errors, old = _judge(ids, traces, recs)
    table = {k: round(100 * v, 1) for k, v in errors.items()}
    exact = sum(1 for v in errors.values() if v == 0)
    assert exact >= len(errors) // 2, table  # to the byte (segments are whole MiB multiples)
    assert statistics.median(abs(v) for v in errors.values()) <= 0.01, table
    assert max(abs(v) for v in errors.values()) <= 0.06, table
    assert statistics.median(abs(v) for v in errors.values()) < statistics.median(abs(v) for v in old.values())


def test_replay_with_fsdp_streams_against_h100_reserved():
    """FSDP's buffers on their streams (one stream for everything: median 16%, max 35% under)."""
    traces, recs = _traces(), _h100_records()
    ids = [p for p in traces if get_strategy(recs[p]["inputs"]["strategy"]).family in ("fsdp1", "fsdp2")]
    assert len(ids) >= 30
    errors, old = _judge(ids, traces, recs, check_allocated=False)
    table = {k: round(100 * v, 1) for k, v in errors.items()}
    # issue 15's bar for reserved: 10% median, 20% max. Measured 2026-12-01 with the recorded streams: median
    # 0.0% (30 of 54 to the byte), max 11.9% (fsdp-grad-op qwen-small fp32, under: the CPU re-run allocates 7.8%
    # less than the H100 did, so the trace, not the allocator, is off). Streams inferred from the collectives
    # (comm_streams): 0.95% / 13.5%; every storage a collective touches on that collective's stream (the
    # earlier inference): 4.6% / 13.5%
    assert statistics.median(abs(v) for v in errors.values()) <= 0.10, table
    assert max(abs(v) for v in errors.values()) <= 0.20, table
    assert statistics.median(abs(v) for v in errors.values()) <= 0.01, table
    assert sum(1 for v in errors.values() if v == 0) >= len(errors) // 2 + 3, table
    assert statistics.median(abs(v) for v in errors.values()) < statistics.median(abs(v) for v in old.values())


def test_roundup_power2_divisions_rounds_as_pytorch():
    """`roundup_power2_divisions` (c10/core/AllocatorConfig.cpp, CUDACachingAllocator.cpp `round_size` and
    `roundup_power2_next_division`): sizes above 512 x the interval's divisions go up to the next of that many
    equal steps between two powers of two (the source's own example: 1200 in 4 divisions is 1280, here in MiB);
    the list form fills below its first interval and, with `>`, from its last named interval on (that one
    included, as the parser does)."""
    from distplan.planner.allocator import alloc_rounding, round_size
    four = alloc_rounding("roundup_power2_divisions:4")[0]
    assert round_size(1200 * M, four) == 1280 * M and round_size(1200 * M) == 1200 * M
    assert round_size(5 * M + 1, four) == 6 * M and round_size(4 * M, four) == 4 * M  # a power of two stays
    assert round_size(1200, four) == 1536 and round_size(3000, four) == 3072  # at most 512 x 4: 512-byte rounding
    assert alloc_rounding("roundup_power2_divisions:[256:1,512:2,>:8]")[0] == (1,) * 9 + (8,) * 7
    assert alloc_rounding("max_non_split_rounding_mb:64") == (None, 64 * M)
    assert alloc_rounding("expandable_segments:True") is None
    for bad in ("roundup_power2_divisions:3", "roundup_power2_divisions:[300:2]", "roundup_power2_divisions:[256:1",
                "max_non_split_rounding_mb:5"):
        with pytest.raises(ValueError, match="--alloc-conf"):
            alloc_rounding(bad)


def test_rounding_options_change_the_replay():
    """Rounded requests take more of the pool (and count as allocated, as `max_memory_allocated` reads the
    blocks); `max_non_split_rounding_mb` lets a request of max_split_size or more take a cached oversize block
    up to that much larger instead of kLargeBuffer (20 MiB: CUDACachingAllocator.cpp `get_free_block`)."""
    from distplan.planner.allocator import alloc_rounding
    ev = [("alloc", 1, 1100 * M), ("alloc", 2, 1100 * M)]
    a = replay(ev, rounding=alloc_rounding("roundup_power2_divisions:4"))
    assert a.peak_allocated == 2 * 1280 * M and a.reserved == 2 * 1280 * M
    assert replay(ev).reserved == 2 * 1100 * M
    ev = [("alloc", 1, 300 * M), ("free", 1), ("alloc", 2, 270 * M)]
    assert replay(ev, max_split_size=256 * M).reserved == 570 * M  # 300 >= 270 + 20: not taken, a new segment
    got = replay(ev, max_split_size=256 * M, rounding=alloc_rounding("max_non_split_rounding_mb:64"))
    assert got.reserved == 300 * M and got.peak_allocated == 300 * M  # taken whole (oversize: never split)
