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
