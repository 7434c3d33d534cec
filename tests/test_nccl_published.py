"""The collective time model (planner/comm.py, NCCL's algorithms as its tuner picks them) against
published nccl-tests bus bandwidths (tests/data/nccl_published.yaml, each row with its source).

Thresholds are issue 12's: predicted busbw within 15% of the published figure at messages >= 1 GiB and
within 30% at 1-16 MiB; the small-message all-reduce time on 8 GPUs within the published 38-53 us.
busbw = bus_factor(op, n) x S / t (nccl-tests doc/PERFORMANCE.md)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from distplan.planner import comm
from distplan.planner.config import Cluster

DATA = yaml.safe_load((Path(__file__).parent / "data" / "nccl_published.yaml").read_text())
GIB, MIB = 2**30, 2**20

KNOWN_MISSES = {
    "a100-1m": "the published A100 curve is flat at ~101 us per call from 1 to 4 MiB (18 -> 72 GB/s); "
               "the model's LL ring (NCCL's LL bandwidth, half the ring's) takes 59 us at 1 MiB",
    "a100-2m": "same flat ~101 us stretch of the A100 curve (model: 75 us)",
    "a100-16m": "the published A100 busbw falls from 109.9 at 8 MiB to 106.2 at 16 MiB (276.6 us, twice "
                "the 8 MiB time); the model rises monotonically (139 GB/s)",
}


def _setup(config: dict):
    g, k = config["gpus_per_node"], config.get("nodes", 1)
    cluster = Cluster(gpus=g * k, gpus_per_node=g, intra_link=config["intra"],
                      inter_link=config.get("inter", "ib-ndr"), nics_per_node=config.get("nics_per_node", 8))
    intra, inter = comm.cluster_links(cluster)
    if config.get("nvls") is False:  # the run set NCCL_NVLS_ENABLE=0
        intra = dataclasses.replace(intra, nvls_busbw_bytes_per_s=0.0)
    return g * k, g, intra, (inter if k > 1 else None)


def predicted_busbw(row: dict) -> float:
    """Predicted nccl-tests busbw of a row, GB/s."""
    n, g, intra, inter = _setup(row["config"])
    t = comm.collective_time(row["op"], row["size_bytes"], n, intra, gpus_per_node=g, inter_link=inter)
    return comm.bus_factor(row["op"], n) * row["size_bytes"] / t / 1e9


def _tolerance(size: int) -> float | None:
    if size >= GIB:
        return 0.15
    if MIB <= size <= 16 * MIB:
        return 0.30
    return None


ROWS = [r for r in DATA["rows"] if _tolerance(r["size_bytes"]) is not None]


def test_every_row_is_sourced_and_in_a_band():
    assert {r["src"] for r in DATA["rows"]} <= set(DATA["sources"])
    assert len(ROWS) == len(DATA["rows"])  # no row outside the two bands of the issue


@pytest.mark.parametrize("row", [pytest.param(r, id=r["id"], marks=pytest.mark.xfail(
    reason=KNOWN_MISSES[r["id"]], strict=True)) if r["id"] in KNOWN_MISSES else pytest.param(r, id=r["id"])
    for r in ROWS])
def test_busbw_matches_published(row):
    pred = predicted_busbw(row)
    tol = _tolerance(row["size_bytes"])
    assert abs(pred / row["busbw"] - 1) <= tol, (
        f"{row['id']}: predicted {pred:.2f} GB/s vs published {row['busbw']} ({DATA['sources'][row['src']]})")


@pytest.mark.parametrize("row", DATA["latency_floor"], ids=lambda r: r["id"])
def test_small_message_floor_on_8_gpus(row):
    intra, _ = comm.cluster_links(Cluster(gpus=8, gpus_per_node=8, intra_link=row["intra"]))
    t_us = comm.collective_time("all_reduce", row["size_bytes"], 8, intra) * 1e6
    assert 38.0 <= t_us <= 53.0
    assert abs(t_us / row["time_us"] - 1) <= 0.30


def test_algorithm_choice_follows_nccl():
    """NVLS from 2 MiB on 8 H200 and LL ring up to 1 MiB (stas00/ml-engineering: NCCL_DEBUG TUNING
    'Algo RING proto LL up to a 1MiB payload and Algo NVLS proto SIMPLE from 2MiB up'); no NVLS at 4
    GPUs; tree on 2 p4d nodes (busbw above the NICs' 50 GB/s, NVIDIA/nccl-tests#196), ring from 3."""
    n, g, h200, _ = _setup({"intra": "nvlink4", "gpus_per_node": 8})
    assert comm.nccl_algorithm("all_reduce", MIB, 8, h200) == "ring"
    assert comm.nccl_algorithm("all_reduce", 2 * MIB, 8, h200) == "nvls"
    assert comm.nccl_algorithm("all_reduce", GIB, 4, h200) == "ring"
    assert comm.nccl_algorithm("all_gather", GIB, 8, h200) == "ring"
    for k, algo in ((2, "tree"), (3, "ring"), (4, "ring")):
        n, g, a100, efa = _setup({"intra": "nvlink3", "inter": "aws-efa-100g", "gpus_per_node": 8,
                                  "nics_per_node": 4, "nodes": k})
        assert comm.nccl_algorithm("all_reduce", GIB, n, a100, gpus_per_node=g, inter_link=efa) == algo


def test_published_table(capsys):
    """Prints published vs predicted (pytest -s shows it)."""
    for r in DATA["rows"]:
        pred = predicted_busbw(r)
        print(f"{r['id']:20s} {r['busbw']:8.2f} {pred:8.2f} {100 * (pred / r['busbw'] - 1):+6.1f}%")
