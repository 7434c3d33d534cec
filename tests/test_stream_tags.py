"""The streams a probe records with its allocations (validate.measure.StreamTags) against the streams the
planner's trace writer (planner/alloc_trace.py) puts them on: FSDP1 and FSDP2 under mixed precision on
the fake process group, where every FSDP stream is used. The caching allocator keeps a pool per stream,
so a buffer on the wrong stream moves the reserved peak (tests/test_allocator.py: the H100 probes'
recorded traces replay to within 0.0% median with their recorded streams, 4.6% with every buffer a
collective touches put on that collective's stream)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

pytest.importorskip("torch")

from distplan.planner.alloc_trace import allocation_events  # noqa: E402
from distplan.planner.config import TrainConfig  # noqa: E402
from distplan.planner.model import ModelSpec  # noqa: E402
from distplan.validate.runner import run_probe  # noqa: E402

TINY = {"name": "tiny", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 128, "vocab": 256}
TRAIN = {"seq_len": 32, "micro_batch": 2, "grad_accum": 1, "precision": "bf16-mixed", "optimizer": "adamw",
         "optimizer_impl": "foreach", "checkpointing": "none", "attention": "sdpa"}
WORLD = 4


def _recorded(tmp_path, strategy: str) -> list:
    path = tmp_path / f"{strategy}.json"
    spec = {"id": f"{strategy}/tiny", "strategy": strategy, "world_size": WORLD, "gpus_per_node": WORLD,
            "mode": "fake", "device_type": "cpu", "model": dict(TINY), "train": dict(TRAIN), "steps": 1,
            "seed": 0}
    m = run_probe(spec, env={"DISTPLAN_ALLOC_EVENTS": str(path)}, timeout_s=300)
    assert m.get("status") == "ok", m
    return json.loads(path.read_text())


def _roles(events) -> Counter:
    """Allocations per stream role: 'gather' (the stream of the all-gather's output), 'reduce' (of the
    reduce-scatter's output), 'other' (any other non-compute stream), 'compute'."""
    tag_of = {}
    gather = reduce = None
    for e in events:
        if e[0] == "alloc":
            tag_of[e[1]] = e[3] if len(e) > 3 else 0
        elif e[0] == "comm" and e[1] in tag_of and tag_of[e[1]]:
            if e[2] == "all_gather" and gather is None:
                gather = tag_of[e[1]]
            elif e[2] == "reduce_scatter" and reduce is None:
                reduce = tag_of[e[1]]
    names = {0: "compute", gather: "gather", reduce: "reduce"}
    return Counter(names.get(e[3] if len(e) > 3 else 0, "other") for e in events if e[0] == "alloc" and e[2] > 0)


@pytest.mark.parametrize("strategy", [pytest.param("fsdp", marks=(pytest.mark.slow, pytest.mark.newest)), "zero3"])
def test_recorded_streams_are_the_writers(tmp_path, strategy):
    recorded = _recorded(tmp_path, strategy)
    train = TrainConfig(ModelSpec(**TINY), seq_len=TRAIN["seq_len"], micro_batch=TRAIN["micro_batch"],
                        precision=TRAIN["precision"])
    written = allocation_events(train, strategy, WORLD, WORLD, "cpu", "fake", 0, "device")
    rec = _roles(recorded)
    # the writer's streams by number (alloc_trace's module docstring): 1 all-gather, 2 reduce-scatter, 3 other
    names = {0: "compute", 1: "gather", 2: "reduce", 3: "other"}
    wr = Counter(names[e[3] if len(e) > 3 else 0] for e in written if e[0] == "alloc" and e[2] > 0)
    # the probe used the streams FSDP creates: FSDP1 compute, unshard, post-backward and pre-unshard;
    # FSDP2 compute, all-gather copy-in and reduce-scatter (its all-gather stream allocates nothing)
    assert set(rec) == ({"compute", "gather", "reduce", "other"} if strategy == "fsdp"
                        else {"compute", "gather", "reduce"}), rec
    # the same number of allocations on each communication stream, the warm-up and the measured steps
    # (FSDP1: each unit's padded unsharded parameter and flat gradient, made by its views' backward, on the
    # unshard stream; the reduce_dtype cast and the gradient shard on the post-backward stream; the
    # low-precision shard on the pre-unshard one. FSDP2: each unit's cast shards and all-gather buffer on
    # the copy-in stream, the reduce-scatter output on its stream, the reduce-scatter input on the compute
    # stream)
    assert {k: v for k, v in rec.items() if k != "compute"} == {k: v for k, v in wr.items() if k != "compute"}, (
        rec, wr)
