"""recommend.max_micro_batch: the largest micro-batch whose whole device footprint (the replayed reserved peak
and the process overhead) fits without the allocator releasing its cache, found from a guess and a step or
two of replays, equals a plain scan up from 1."""

from __future__ import annotations

from dataclasses import replace

import pytest

from distplan.planner.api import plan
from distplan.planner.memory import estimate_memory
from distplan.planner.recommend import max_micro_batch
from distplan.planner.strategies import NAMES


def _scan(train, cluster, name: int) -> int:
    b = 0
    while b < 64 and estimate_memory(replace(train, micro_batch=b + 1), cluster, name).fits_cleanly:
        b += 1
    return b


@pytest.mark.parametrize("model, gpus, gpu, seq, mb", [
    ("mistral-7b", 8, "h100-sxm", 4096, 1),
    ("llama-3-8b", 16, "a100-80gb", 8192, 2),
    ("gpt2-medium", 8, "l4", 1024, 4),
])
def test_max_micro_batch_equals_a_plain_scan(model, gpus, gpu, seq, mb):
    p = plan(model, gpus=gpus, gpu=gpu, seq_len=seq, micro_batch=mb, comm=False)
    got = {n: max_micro_batch(p.train, p.cluster, n) for n in NAMES[1:]}
    assert got == {n: _scan(p.train, p.cluster, n) for n in NAMES[1:]}
    assert any(0 < b < 64 for b in got.values())  # the search had something to find


def test_the_gallop_finds_the_largest_from_any_start_in_few_calls():
    """recommend._gallop over every answer, start and bound up to 32: the largest b <= bound that fits, 0 if
    none; two calls when the start is the answer or one above it, at most 2 log2(bound) + 3 otherwise."""
    import math

    from distplan.planner.recommend import _gallop
    for bound in range(1, 33):
        for answer in range(0, bound + 1):
            for start in range(1, bound + 1):
                calls = []

                def fits(b):
                    assert 1 <= b <= bound
                    calls.append(b)
                    return b <= answer
                assert _gallop(fits, start, bound) == answer, (bound, answer, start)
                if answer and start in (answer, answer + 1) and answer < bound:
                    assert len(calls) <= 2, (bound, answer, start, calls)
                assert len(calls) <= 2 * math.log2(bound) + 3, (bound, answer, start, calls)
