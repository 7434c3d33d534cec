"""The optimized caching-allocator model (planner/allocator.py) against the one it replaced
(tests/reference_allocator.py, the model as of cb9c689): the same bytes, exactly, on

1. random event streams, compared after every event (reserved, allocated, their peaks, segments) under
   the default config, expandable_segments and max_split_size_mb;
2. the planner's own traces (alloc_trace.allocation_events) over every strategy and a spread of models
   (GPT-2 to Llama-3.1-405B), micro-batches, sequence lengths, checkpointing modes, precisions,
   optimizers, gradient accumulation, cluster sizes, init modes, tensor parallelism and the two modelled
   alloc confs: reserved and allocated peaks, final reserved/allocated and the segment count;
3. the recorded probe traces (tests/data/alloc_events_*.json.gz), FSDP ones on their streams;
4. what the planner reports: MemoryEstimate.peak_reserved (through its caches and the early-stopping
   replay of `fits`) equals the reference replay of the same run, for every strategy of a plan.

The comparison is live (old code next to new on the same events), so it keeps holding while the events
alloc_trace writes change. The wider matrix (405B, every variant) is marked slow.
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import random
import sys
from dataclasses import replace

import pytest

from distplan.planner import alloc_trace, allocator
from distplan.planner.api import plan
from distplan.planner.memory import estimate_memory
from distplan.planner.strategies import NAMES, get_strategy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference_allocator as reference  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
M = 2**20
CONFS = [(False, None), (True, None), (False, 128 * M)]  # default, expandable_segments, max_split_size_mb:128


def _state(a) -> tuple:
    return a.reserved, a.allocated, a.peak_reserved, a.peak_allocated, a.segments


def _peaks(a) -> tuple:
    return a.peak_reserved, a.peak_allocated, a.reserved, a.allocated, a.segments


def _random_events(rng: random.Random, n: int) -> list:
    sizes = [1, 511, 512, 513, 4096, 600 * 1024, M - 1, M, M + 1, 2 * M, 5 * M, 10 * M - 1, 10 * M, 12 * M,
             20 * M, 21 * M, 64 * M, 127 * M, 128 * M, 129 * M, 300 * M, 1 << 30]
    events, live, key = [], [], 0
    for _ in range(n):
        if live and rng.random() < 0.45:
            events.append(("free", live.pop(rng.randrange(len(live)))))
        else:
            key += 1
            size = rng.choice(sizes) if rng.random() < 0.6 else rng.randrange(1, 200 * M)
            events.append(("alloc", key, size, rng.choice((0, 0, 0, 1, 2))))
            live.append(key)
    return events


@pytest.mark.parametrize("seed", range(12))
def test_random_streams_match_event_by_event(seed):
    rng = random.Random(seed)
    events = _random_events(rng, 3000)
    for expandable, max_split in CONFS:
        old = reference.CachingAllocator(expandable_segments=expandable, max_split_size=max_split)
        new = allocator.CachingAllocator(expandable_segments=expandable, max_split_size=max_split)
        live_old, live_new = {}, {}
        for i, ev in enumerate(events):
            if ev[0] == "alloc":
                live_old[ev[1]] = old.malloc(ev[2], ev[3])
                live_new[ev[1]] = new.malloc(ev[2], ev[3])
            else:
                old.free(live_old.pop(ev[1]))
                new.free(live_new.pop(ev[1]))
            assert _state(new) == _state(old), (seed, expandable, max_split, i, ev)


@pytest.mark.parametrize("seed", range(4))
def test_stop_above_is_exact(seed):
    """replay(stop_above=X) stops only when the full replay's reserved peak is above X, else equals it."""
    events = _random_events(random.Random(100 + seed), 2000)
    for expandable, max_split in CONFS:
        full = reference.replay(events, expandable_segments=expandable, max_split_size=max_split)
        for limit in (0, full.peak_reserved // 2, full.peak_reserved - 1, full.peak_reserved, 2 * full.peak_reserved):
            a = allocator.replay(events, expandable_segments=expandable, max_split_size=max_split, stop_above=limit)
            if full.peak_reserved > limit:
                assert a.reserved > limit and a.reserved <= full.peak_reserved
                assert allocator.replay_peaks(events, expandable_segments=expandable, max_split_size=max_split,
                                              stop_above=limit) is None
            else:
                assert _peaks(a) == _peaks(full)
                assert allocator.replay_peaks(events, expandable_segments=expandable, max_split_size=max_split,
                                              stop_above=limit) == (full.peak_reserved, full.peak_allocated)


def test_replay_peaks_remembers_by_content():
    ev = _random_events(random.Random(7), 500)
    first = allocator.replay_peaks(ev)
    copy = [tuple(list(e)) for e in ev]  # equal events, other objects: one replay serves both
    assert allocator.replay_peaks(copy) == first
    assert allocator.replay_peaks(ev, expandable_segments=True) == _peaks(reference.replay(ev, expandable_segments=True))[:2]
    assert allocator.replay_peaks([list(e) for e in ev]) == first  # unhashable: replayed, same answer


def _plan(model, gpus=8, **kw):
    return plan(model, gpus=gpus, gpu="h100-sxm", comm=False, **kw)


def _events_of(train, cluster, strategy, init="meta"):
    mem = estimate_memory(train, cluster, strategy, init=init)
    args = mem.reserved_replay
    if args is None:
        return None
    train_, name, world, shard, device, backend, workspace, expandable, init_, max_split = args
    events = alloc_trace.allocation_events(train_, name, world, shard, device, backend, workspace, init_)
    return events, expandable, max_split


def _assert_same(events, expandable, max_split, label):
    old = reference.replay(events, expandable_segments=expandable, max_split_size=max_split)
    new = allocator.replay(events, expandable_segments=expandable, max_split_size=max_split)
    assert _peaks(new) == _peaks(old), label
    return old


ALLOC_CONFS = ["", "expandable_segments:True", "max_split_size_mb:128"]
# (model, gpus, plan keywords): each row runs every strategy under each alloc conf
FAST_ROWS = [
    ("gpt2", 8, {"seq_len": 1024}),
    ("mistral-7b", 8, {}),
    ("mistral-7b", 16, {"micro_batch": 4, "activation_checkpointing": "full"}),
    ("llama-3-8b", 64, {"seq_len": 8192, "precision": "fp32"}),
]
SLOW_ROWS = [
    ("llama-3-405b", 8, {}),
    ("llama-3-405b", 64, {"activation_checkpointing": "full", "seq_len": 8192}),
    ("llama-3-70b", 16, {"micro_batch": 2, "activation_checkpointing": "selective"}),
    ("llama-3-70b", 32, {"tp": 2, "sequence_parallel": True}),
    ("llama-2-13b", 8, {"grad_accum": 4}),  # (pipeline stages are not replayed: the margin)
    ("mistral-7b", 8, {"optimizer": "sgd-momentum", "precision": "fp16-mixed"}),
    ("mistral-7b", 8, {"optimizer_impl": "for-loop", "activation_checkpointing": "selective", "micro_batch": 3}),
    ("mistral-7b", 8, {"grad_accum": 8, "grad_sync": "every", "seq_len": 1024}),
    ("qwen2.5-7b", 16, {"attention": "eager", "seq_len": 4096}),
    ("gpt2-xl", 8, {"micro_batch": 16, "seq_len": 1024, "cpu_offload": "optimizer"}),
    ("phi-3-mini", 128, {"activation_checkpointing": "selective-op"}),
    ("mpt-30b", 16, {"precision": "bf16"}),
]


def _check_row(model, gpus, kw):
    n = 0
    for conf in ALLOC_CONFS:
        p = _plan(model, gpus, alloc_conf=conf, **kw)
        for name in NAMES:
            for init in ("meta", "device"):
                try:
                    got = _events_of(p.train, p.cluster, name, init)
                except ValueError:
                    continue  # e.g. a strategy that does not take this offload mode
                if got is None:
                    continue
                _assert_same(*got, (model, gpus, kw, conf, name, init))
                n += 1
    assert n >= 2 * len(ALLOC_CONFS) * 3, (model, kw, n)  # most strategies replayed under every conf


@pytest.mark.parametrize("model,gpus,kw", FAST_ROWS, ids=[f"{r[0]}-{r[1]}-{'-'.join(map(str, r[2].values())) or 'default'}"
                                                          for r in FAST_ROWS])
def test_planner_traces_match(model, gpus, kw):
    _check_row(model, gpus, kw)


@pytest.mark.slow
@pytest.mark.parametrize("model,gpus,kw", SLOW_ROWS, ids=[f"{r[0]}-{r[1]}-{'-'.join(map(str, r[2].values())) or 'default'}"
                                                          for r in SLOW_ROWS])
def test_planner_traces_match_wide(model, gpus, kw):
    _check_row(model, gpus, kw)


def test_planner_traces_match_405b_two_strategies():
    """The deepest replayed model in the fast tier: one FSDP2 and one DDP trace (50,000 events)."""
    p = _plan("llama-3-405b", 8)
    for name in ("zero3", "ddp"):
        _assert_same(*_events_of(p.train, p.cluster, name), ("llama-3-405b", name))


TRACE_FILES = ["alloc_events_h100.json.gz", "alloc_events_cpu_depth16.json.gz"]


def _check_recorded(data, variants):
    with gzip.open(os.path.join(ROOT, "tests", "data", data), "rt") as f:
        traces = json.load(f)["events"]
    assert len(traces) >= 10
    for pid, events in traces.items():
        for streams, (expandable, max_split) in variants:
            ev = allocator.comm_streams(events, "fsdp1") if streams else events  # (any stream assignment)
            _assert_same(ev, expandable, max_split, (data, pid, streams, expandable, max_split))


@pytest.mark.parametrize("data", TRACE_FILES)
def test_recorded_probe_traces_match(data):
    _check_recorded(data, [(True, CONFS[0])])


@pytest.mark.slow
@pytest.mark.parametrize("data", TRACE_FILES)
def test_recorded_probe_traces_match_every_conf(data):
    _check_recorded(data, [(s, c) for s in (False, True) for c in CONFS])


def _reference_reserved(mem) -> int:
    """MemoryEstimate.peak_reserved as cb9c689 computed it: the reference replay plus the walk's excess."""
    train, name, world, shard, device, backend, workspace, expandable, init, max_split = mem.reserved_replay
    a = reference.replay(alloc_trace.allocation_events(train, name, world, shard, device, backend, workspace, init),
                         expandable_segments=expandable, max_split_size=max_split)
    seg = 2 << 20
    return a.peak_reserved + seg * -(-max(0, mem.peak_allocated - a.peak_allocated) // seg)


@pytest.mark.parametrize("model,gpus,kw", [("mistral-7b", 8, {}), ("llama-3-8b", 16, {"micro_batch": 2}),
                                           ("gpt2", 8, {"seq_len": 1024, "alloc_conf": "expandable_segments:True"})])
def test_reported_reserved_and_fits_match_the_reference(model, gpus, kw):
    from distplan.planner.api import clear_caches
    clear_caches(catalog=False)
    p = _plan(model, gpus, **kw)
    for name in NAMES:
        for b in (1, 2, 5):
            # `fits` first (it may stop a replay early), then the value
            mem = estimate_memory(replace(p.train, micro_batch=b), p.cluster, name)
            if mem.reserved_replay is None:
                continue
            want = _reference_reserved(mem)
            want_fits = mem.allocated_fits and want + mem.process_overhead <= mem.gpu_memory_bytes
            if mem.fits and not want_fits:  # by releasing the allocator's cache (test_tight_memory_... below)
                assert mem.alloc_retries > 0 and mem.device_total <= mem.gpu_memory_bytes, (model, name, b)
                continue
            assert mem.fits == want_fits, (model, name, b)
            assert mem.peak_reserved == want, (model, name, b)
            assert mem.fits == want_fits, (model, name, b)


def test_tight_memory_fits_matches_the_reference():
    """GPU memory set around each strategy's device total: at or above it the run fits with the reference
    replay's reserved peak; below it the run either does not fit (then the reported peak is the unlimited
    run's) or fits by releasing the allocator's cache (allocator.CachingAllocator.capacity), below the line."""
    from distplan.planner.api import clear_caches
    from distplan.planner.config import Cluster
    p = _plan("mistral-7b", 8)
    stopped = 0
    for name in ("zero2", "zero3", "fsdp", "ddp"):
        full = estimate_memory(p.train, p.cluster, name)
        total = _reference_reserved(full) + full.process_overhead
        for delta in (-3 * M, -1, 0, 1, 3 * M):
            clear_caches(catalog=False)
            cluster = replace(p.cluster, gpu_memory_bytes=total + delta)
            assert isinstance(cluster, Cluster)
            mem = estimate_memory(p.train, cluster, name)
            if delta >= 0 or not mem.fits:
                assert mem.fits == (mem.allocated_fits and delta >= 0), (name, delta)
                assert mem.alloc_retries == 0
                assert mem.peak_reserved + mem.process_overhead == total, (name, delta)  # the value, after `fits`
            else:
                stopped += 1
                assert mem.alloc_retries > 0 and mem.device_total <= cluster.gpu_memory_bytes, (name, delta)


def test_the_wide_matrix_covers_every_strategy_and_conf():
    """A guard on the test's own coverage: every registry strategy and both modelled alloc confs."""
    assert set(NAMES) == {get_strategy(n).name for n in NAMES}
    kws = set(itertools.chain.from_iterable(r[2] for r in FAST_ROWS + SLOW_ROWS))
    assert {"micro_batch", "seq_len", "activation_checkpointing", "precision", "optimizer", "tp", "grad_accum"} <= kws
    assert {"expandable_segments:True", "max_split_size_mb:128"} <= set(ALLOC_CONFS)


def test_fits_cleanly_early_answer_matches_the_whole_replay():
    """`fits_cleanly` asked first (a replay that stops at the line) and after `fits` (the run replayed on the
    GPU with retries) give the same answer, on both sides of the line and where retries save the run."""
    from distplan.planner.api import clear_caches
    p = _plan("mistral-7b", 8)
    seen = set()
    for name in ("zero2", "zero3", "fsdp"):
        full = estimate_memory(p.train, p.cluster, name)
        total = _reference_reserved(full) + full.process_overhead
        for delta in (-600 * M, -100 * M, -3 * M, 0, 3 * M):
            cluster = replace(p.cluster, gpu_memory_bytes=total + delta)
            clear_caches(catalog=False)
            early = estimate_memory(p.train, cluster, name).fits_cleanly
            clear_caches(catalog=False)
            mem = estimate_memory(p.train, cluster, name)
            fits = mem.fits
            assert mem.fits_cleanly == early == (fits and not mem.alloc_retries), (name, delta)
            seen.add((fits, bool(mem.alloc_retries)))
    assert {(True, False), (True, True)} <= seen  # both kinds of fit occur in this sweep
