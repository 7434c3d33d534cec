"""Collective schedule of one optimizer step, as the installed PyTorch issues it, and its time.

Owns `collective_schedule` (op, group, dtype, message bytes, calls per optimizer step, phase, bytes
sent per GPU, time), the alpha-beta time of one collective (`collective_time`) and `comm_summary`.

Each schedule was read from the torch 2.13 source and checked call by call with the fake process
group on the reference decoder (tests/test_comm.py, `test_schedule_matches_torch`):

- DDP (`torch/nn/parallel/distributed.py`): the first iteration runs ONE bucket (bucket limits
  `[sys.maxsize]` when `find_unused_parameters=False`); from the second iteration the C++ Reducer has
  rebuilt its buckets in gradient-ready order (modules in reverse order, each module's params in
  registration order: weight then bias), first bucket capped at `first_bucket_bytes_cap`, the others
  at `bucket_cap_mb` MiB, a bucket closed when its size reaches the cap (so it may exceed it). An
  explicit `bucket_cap_mb=25` (what `validate/wrap.py` passes) makes the first cap 25 MiB too; only
  `bucket_cap_mb=None` gives the 1 MiB `dist._DEFAULT_FIRST_BUCKET_BYTES` first bucket. We model the
  steady state (iteration >= 2). One all-reduce per bucket per optimizer step (`no_sync` before), or
  per micro-step with grad_sync='every'.
- ZeroRedundancyOptimizer (`torch/distributed/optim/zero_redundancy_optimizer.py`), defaults
  (`parameters_as_bucket_view=False`): after the local step `_sync_params` broadcasts EVERY parameter
  tensor from its owner rank, one `broadcast` per parameter (not one all-gather), in the param dtype.
- FSDP2 (`torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`): one all-gather per group of the
  concatenated shards, each param padded on dim 0 to a multiple of the world size
  (`_get_dim0_padded_size`); reduce-scatter of the same padded size in reduce_dtype. The root group
  (embed + final norm + head) is NOT resharded after forward only when `fully_shard(root)` is called
  without `reshard_after_forward` (`_fsdp_state.py` `_lazy_init`); `validate/wrap.py` passes it
  explicitly, so under zero3 the root is all-gathered in backward too (`fsdp2_root_reshard`).
  With `set_requires_gradient_sync(False)`: no reduce-scatter, unsharded grads accumulate
  (`accumulate_unsharded_grad_if_needed`); params are still resharded after backward, so every
  micro-step all-gathers again.
- FSDP1 (`torch/distributed/fsdp/_flat_param.py`, `_runtime_utils.py`): one FlatParameter per unit;
  `use_orig_params=False` adds no alignment padding, only padding of the flat numel to a multiple of the
  shard-group size. FULL_SHARD / HYBRID_SHARD: the root is never resharded after forward, blocks are
  all-gathered in forward and backward. SHARD_GRAD_OP under `no_sync` keeps params unsharded across
  micro-steps (`_should_free_in_backward`), so it all-gathers ONCE per optimizer step, not per
  micro-step. NO_SHARD: one all-reduce of the unpadded flat grad per unit. HYBRID_SHARD: plus an
  all-reduce of the reduced shard over the replica group, issued even when that group has one rank.
- Gradient accumulation (grad_accum = A > 1): with grad_sync='last' (the default) the reductions run on
  the last micro-step only, the others under `no_sync()` / `set_requires_gradient_sync(False)`; with
  'every' each micro-step issues them (A times the calls, same message sizes). The all-gathers do not
  change, except SHARD_GRAD_OP's, which all-gathers every micro-step when each one syncs.
- DeepSpeed (`--framework deepspeed`): modelled from DeepSpeed's source, NOT validated (no DeepSpeed
  here); see `_deepspeed`.

A collective's time follows NCCL's own tuner (NVIDIA/nccl src/graph/tuning.cc `ncclTopoTuneModel`,
src/enqueue.cc): ring (LL or Simple protocol), tree and NVLSTree across nodes, NVLS on NVSwitch nodes,
PAT at one GPU per node, the fastest one picked; bandwidths are the catalog's nccl-tests bus
bandwidths (doc/PERFORMANCE.md), judged against published nccl-tests figures in
tests/test_nccl_published.py.

Known limitations: CollNet (network SHARP), NVLS for all-gather/reduce-scatter (measured slower than
the ring on one node), NCCL's per-size tree correction table, channel counts, contention between
concurrent collectives and vendor tuner plugins (AWS's ofi tuner) are not modelled. Tensor/pipeline
parallel groups are absent.
"""

from __future__ import annotations

from math import prod

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from .config import Cluster, TrainConfig
from .model import ModelSpec, unit_sizes
from .strategies import get_strategy

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")

DDP_BUCKET_CAP_MB: int | None = None
"""DDP's bucket_cap_mb as `validate/wrap.py` passes it: None, PyTorch's default (25 MiB buckets after a
1 MiB first bucket). An explicit 25 would make every bucket, the first included, 25 MiB."""
DDP_DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024
"""`torch.distributed._DEFAULT_FIRST_BUCKET_BYTES` (1 MiB), used only when bucket_cap_mb is None."""
FSDP2_ROOT_RESHARD_EXPLICIT = False
"""`validate/wrap.py` leaves the root's reshard_after_forward at FSDP2's default for zero3 (the root is
not resharded after forward) and passes False for zero2."""

# DeepSpeed defaults, deepspeedai/DeepSpeed deepspeed/runtime/zero/config.py (DeepSpeedZeroConfig):
DS_REDUCE_BUCKET_SIZE = 500_000_000
"""`reduce_bucket_size: int = Field(pp_int(5e8))`, elements."""
DS_ALLGATHER_BUCKET_SIZE = 500_000_000
"""`allgather_bucket_size: int = Field(pp_int(5e8))`, elements."""
DS_PREFETCH_BUCKET_SIZE = 50_000_000
"""`stage3_prefetch_bucket_size: Field(pp_int(5e7))`, elements (prefetch only; no change to volume)."""
DS_PARAM_PERSISTENCE_THRESHOLD = 100_000
"""`stage3_param_persistence_threshold: Field(pp_int(1e5))`: smaller params are never partitioned."""

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class Collective(NamedTuple):
    """One kind of collective of an optimizer step (identical calls merged). Immutable: schedules are
    cached and shared; a named tuple because a sweep builds thousands (a frozen dataclass's __init__
    costs four times as much)."""

    op: str
    """'all_reduce' | 'all_gather' | 'reduce_scatter' | 'broadcast'."""
    group: str
    """'world' (all ranks), 'intra_node' (the node's ranks), 'inter_node' (one rank per node); with
    tensor parallelism (`tp.py`) 'dp' (the data-parallel mesh dimension's ranks) and 'tp' (the
    tensor-parallel group, inside a node)."""
    group_size: int
    dtype: str
    """'float32' | 'bfloat16' | 'float16' on the wire."""
    message_bytes: int
    """all_gather: gathered OUTPUT bytes; reduce_scatter: INPUT bytes; all_reduce/broadcast: the tensor."""
    calls: int
    """Calls per optimizer step (grad_accum micro-steps included)."""
    phase: str
    """'forward' | 'backward' | 'optimizer'."""
    bytes_per_gpu: int = 0
    """Bytes each GPU sends over all calls: nccl-tests factor x message_bytes x calls."""
    time_s: float = 0.0
    """Modelled time of all calls, seconds."""
    unit: str = ""
    """What it moves: 'block' (one per decoder block), 'root' (embed + final norm + head), 'bucket',
    'last_bucket' (the DDP bucket reduced last), 'param' (per-tensor broadcasts), 'bucket_ds'."""

    def to_dict(self) -> dict:
        return self._asdict()


# -- nccl-tests factors and NCCL's algorithms ------------------------------------------------------

def bus_factor(op: str, n: int) -> float:
    """nccl-tests doc/PERFORMANCE.md: busbw = algbw x factor; bytes each rank sends per byte of S."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op in ("broadcast", "send"):
        return 1.0
    if op == "all_to_all":
        # issued by the planner only as `_functional_collectives.permute_tensor` (context parallelism's
        # ring shift, cp.py): each rank's whole input goes to one peer
        return 1.0
    if op == "recv":  # point-to-point: the receiver sends nothing
        return 0.0
    raise ValueError(f"op={str(op)[:40]!r}: accepted values are {', '.join(OPS)}")


def latency_steps(op: str, n: int) -> int:
    """Ring steps, as NCCL's `ncclTopoTuneModel` (src/graph/tuning.cc) counts them: 2(n-1) for
    all-reduce, n-1 for all-gather/reduce-scatter, n for broadcast (Thakur, Rabenseifner, Gropp 2005)."""
    if n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1)
    return n if op == "broadcast" else n - 1


LAUNCH_S = 28e-6
"""Per-call overhead above NCCL's own latency model (kernel launch, host-side enqueue and the nccl-tests
/ torch.distributed timing loop), seconds. Fitted so that the 8-GPU ring/LL all-reduce floor
(6.6 + 14 x 0.6 us in NCCL's model) meets the published 8-GPU small-message times: 43.8 us on A100
(nccl-tests, 32 KiB) and 39.8 / 47.8 us on H200 / B200 (torch all_reduce_bench, 32 KiB), both in
stas00/ml-engineering network/README.md."""

# NCCL src/graph/tuning.cc, ncclTunerConstantsDefaults (NCCL 2.2x): base latencies (us) and the
# per-step hardware latency of LL relative to Simple for each hardware class (NVLink 0.6 / 3.4,
# PCI 1.0 / 5.7, NET 2.7 / 14). The catalog's latency_us is the Simple per-step figure.
_BASE_S = {"ring_ll": 6.6e-6, "ring_simple": 8.4e-6, "tree_ll": 6.8e-6, "tree_simple": 8.4e-6, "pat": 8.0e-6}
_LL_STEP_RATIO = {"nvlink": 0.6 / 3.4, "pci": 1.0 / 5.7, "net": 2.7 / 14.0}
_LL_MAX_NET = {2: 39.0e9, 3: 20.4e9}
"""tuning.cc llMaxBws, multi-node rows (x86 Intel, 2 nodes / more): the LL protocol's bus-bandwidth cap."""
RING_PLATEAU = 1.4
"""tuning.cc `ncclTopoGetAlgoTime`: a multi-node Simple ring all-reduce's latency x 1.4 (sm80+)."""
TREE_BW = 0.92
"""tuning.cc: tree all-reduce bus bandwidth = ring's x 0.92."""
TREE_LL_BW = 1.0 / 3.8
"""tuning.cc: tree LL bandwidth = Simple's / 3.8."""
PAT_BW = 0.75
"""tuning.cc: PAT (all-gather / reduce-scatter at one GPU per node) bandwidth = ring's x 0.75."""
PAT_STEP_S = 2.8e-6
"""tuning.cc: PAT latency log2(nodes) x net latency / 3.5 + nRanks x 2.8 us."""
NVLS_MIN_RANKS = 5
"""NVLS runs from 5 GPUs of an 8-GPU NVSwitch node: NVIDIA GB200 NVL Partition User Guide ("partitions
that have less than or equal to four GPUs will not benefit from multicast"); measured on 8x H200, NCCL
picks NVLS from 5 GPUs (stas00/ml-engineering network/README.md, SHARP)."""
NVLS_TUNER_LATENCY_S = 25e-6
"""tuning.cc hwLatencies NVLINK, NVLS Simple: the latency NCCL's tuner assumes for NVLS when it picks an
algorithm (the catalog's nvls_latency_us is what the call then takes)."""
NVLS_TREE_EFFICIENCY = 0.84
"""NVLSTree (NVLS inside nodes, a tree across them) reaches 0.84 of min(NVLS, network) bandwidth:
430 GB/s busbw on 2 x 8 H100 with 8 x 400G RoCE (NVIDIA/nccl#1221) against min(274, 320) x 1.875.
An ASSUMPTION beyond that one measurement."""


@dataclass(frozen=True)
class LinkModel:
    """What the NCCL model needs of one link tier, per GPU, one direction."""

    busbw_bytes_per_s: float
    """Large-message ring bus bandwidth available to one GPU (bytes/s); inter-node: the node's NICs /
    GPUs per node."""
    latency_s: float
    """Per ring step latency of NCCL's Simple protocol (tuning.cc hwLatencies), seconds."""
    half_efficiency_bytes: float = 0.0
    """The catalog's S_half; not used by the time model (NCCL's latency terms already give the ramp)."""
    hw: str = "nvlink"
    """NCCL's hardware class for latencies: 'nvlink', 'pci' or 'net'."""
    nvls_busbw_bytes_per_s: float = 0.0
    """8-GPU NVLS all-reduce busbw (0: no NVLS)."""
    nvls_latency_s: float = 0.0
    """NVLS all-reduce latency beyond LAUNCH_S."""
    simple_only: bool = False
    """No LL/LL128 protocols over this link."""
    ring_only: bool = False
    """The platform's tuner keeps collectives that cross this link on the ring."""
    scale_out_loss: float = 0.0
    """Relative bandwidth loss per doubling of the node count beyond 2."""

    def efficiency(self, message_bytes: float) -> float:
        """S / (S + S_half): the catalog's half-efficiency curve (kept for display; not in the time)."""
        if self.half_efficiency_bytes <= 0:
            return 1.0
        return message_bytes / (message_bytes + self.half_efficiency_bytes) if message_bytes > 0 else 0.0

    @property
    def nvls_algbw_bytes_per_s(self) -> float:
        """NVLS all-reduce algorithm bandwidth S / T: the 8-GPU busbw / (2 x 7 / 8). Constant in the
        number of GPUs (each GPU sends and receives S once through the switch): measured 259-270 GB/s
        on 5-8 H200 (stas00/ml-engineering network/README.md, SHARP)."""
        return self.nvls_busbw_bytes_per_s / 1.75


def _ring(op: str, S: float, n: int, k: int, bw: float, intra: LinkModel | None, inter: LinkModel | None,
          ll_cap: float) -> tuple[float, str]:
    """NCCL's ring, the faster of its Simple and LL protocols: latency base + steps x per-step latency
    (inter-node steps at the network's), bytes f(op, n) x S over the ring's bus bandwidth `bw`
    (tuning.cc `ncclTopoTuneModel`: LL at half the bandwidth, capped multi-node)."""
    if op == "broadcast":  # tuning.cc: a pipelined chain, base + ONE step (sameChannels)
        intra_steps, inter_steps = (0, 1) if k > 1 else (1, 0)
    else:
        inter_steps = 0 if k <= 1 else (2 * (k - 1) if op == "all_reduce" else k - 1)
        intra_steps = latency_steps(op, n) - inter_steps
    lat_i = intra.latency_s if intra is not None else 0.0
    lat_n = inter.latency_s if inter is not None else 0.0
    lat = _BASE_S["ring_simple"] + intra_steps * lat_i + inter_steps * lat_n
    if k > 1 and op == "all_reduce":
        lat *= RING_PLATEAU
    f = bus_factor(op, n)
    best, proto = LAUNCH_S + lat + f * S / bw, "simple"
    if not ((intra is not None and intra.simple_only) or (inter is not None and k > 1 and inter.simple_only)):
        ll_lat = (_BASE_S["ring_ll"]
                  + intra_steps * lat_i * (_LL_STEP_RATIO[intra.hw] if intra is not None else 0.0)
                  + inter_steps * lat_n * (_LL_STEP_RATIO[inter.hw] if inter is not None else 0.0))
        t = LAUNCH_S + ll_lat + f * S / min(0.5 * bw, ll_cap)
        if t < best:
            best, proto = t, "ll"
    return best, proto


def nccl_algorithms(op: str, message_bytes: float, group_size: int, link: LinkModel | None, *,
                    gpus_per_node: int | None = None, inter_link: LinkModel | None = None) -> dict:
    """{algorithm: seconds} of every algorithm NCCL would consider for one call of `op`, as
    `ncclTopoTuneModel` enables them (NVIDIA/nccl src/graph/tuning.cc):

    - ring (all ops): Simple or LL protocol, see `_ring`; across nodes every NIC of a node carries its
      share, so the ring's bus bandwidth is min(intra-node busbw, node NIC busbw) (a ring's hops are
      pipelined: the slowest link bounds it, nothing is summed).
    - nvls (all-reduce, one node of >= NVLS_MIN_RANKS GPUs on an NVLS switch): S / NVLS algbw.
    - tree (all-reduce across nodes): intra-node chains and a double binary tree across nodes; each
      node sends S over its NICs on 2 nodes, 2S on more, and each GPU 2S over NVLink (reduce + broadcast
      chains), so algbw = 0.92 x min(intra / 2, node NICs x (1 on 2 nodes, 1/2 on more)); latency
      2((g-1) intra + log2(k) net) steps.
    - nvls_tree (all-reduce across nodes of NVLS nodes): NVLS inside, a tree across: algbw =
      NVLS_TREE_EFFICIENCY x min(NVLS algbw, node NICs x (1 on 2 nodes, 1/2 on more)).
    - pat (all-gather / reduce-scatter at one GPU per node): ring bytes at 0.75 of its bandwidth,
      latency log2(k) x net / 3.5 + 2.8 us x ranks.
    A link marked ring_only (a vendor tuner plugin) leaves only the ring across nodes.

    `link` is the intra-node tier (None for a group of one GPU per node), `inter_link` the per-GPU
    share of the node's NICs; the group spans nodes when inter_link is given and group_size >
    gpus_per_node (k = ceil(group_size / g) nodes of g GPUs)."""
    n, S = group_size, float(message_bytes)
    if n <= 1 or S <= 0:
        return {"none": 0.0}
    g = gpus_per_node or n
    out: dict[str, float] = {}
    if inter_link is None or n <= g:  # one node (or one flat tier)
        out["ring"] = _ring(op, S, n, 1, link.busbw_bytes_per_s, link, None, float("inf"))[0]
        if op == "all_reduce" and link.nvls_busbw_bytes_per_s > 0 and n >= NVLS_MIN_RANKS:
            out["nvls"] = LAUNCH_S + link.nvls_latency_s + S / link.nvls_algbw_bytes_per_s
        return out
    k = math.ceil(n / g)
    g = min(g, n)
    loss = (1.0 - inter_link.scale_out_loss) ** math.log2(k / 2) if k > 2 else 1.0
    node_bw = g * inter_link.busbw_bytes_per_s * loss
    intra = link if g > 1 else None
    intra_bw = link.busbw_bytes_per_s if intra is not None else float("inf")
    ll_cap = _LL_MAX_NET[min(k, 3)]
    out["ring"] = _ring(op, S, n, k, min(intra_bw, node_bw), intra, inter_link, ll_cap)[0]
    lat_i = intra.latency_s if intra is not None else 0.0
    depth = math.log2(k)
    if op == "all_reduce":
        net_share = 1.0 if k == 2 else 0.5
        tree_bw = TREE_BW * min(intra_bw / 2, node_bw * net_share)
        tree_lat = 2 * ((g - 1) * lat_i + depth * inter_link.latency_s)
        out["tree"] = LAUNCH_S + _BASE_S["tree_simple"] + tree_lat + S / tree_bw
        if not (inter_link.simple_only or (intra is not None and intra.simple_only)):
            ll_lat = 2 * ((g - 1) * lat_i * (_LL_STEP_RATIO[intra.hw] if intra is not None else 0.0)
                          + depth * inter_link.latency_s * _LL_STEP_RATIO[inter_link.hw])
            ll_bw = min(tree_bw * TREE_LL_BW, ll_cap / 2)
            out["tree_ll"] = LAUNCH_S + _BASE_S["tree_ll"] + ll_lat + S / ll_bw
        if intra is not None and intra.nvls_busbw_bytes_per_s > 0 and g >= NVLS_MIN_RANKS:
            bw = NVLS_TREE_EFFICIENCY * min(intra.nvls_algbw_bytes_per_s, node_bw * net_share)
            out["nvls_tree"] = (LAUNCH_S + intra.nvls_latency_s + 2 * depth * inter_link.latency_s
                                + S / bw)
    if inter_link.ring_only:
        return {"ring": out["ring"]}
    elif op in ("all_gather", "reduce_scatter") and g == 1:
        pat_lat = _BASE_S["pat"] + depth * inter_link.latency_s / 3.5 + PAT_STEP_S * n
        out["pat"] = LAUNCH_S + pat_lat + bus_factor(op, n) * S / (PAT_BW * node_bw)
    return out


def _tuner_pick(algos: dict, link: LinkModel | None) -> str:
    """The algorithm NCCL's tuner picks: least time by its own estimate, which differs from the modelled
    time only in the NVLS latency (it assumes NVLS_TUNER_LATENCY_S; the catalog holds what the call
    takes); LAUNCH_S is common to all and changes no choice."""
    shift = (link.nvls_latency_s - NVLS_TUNER_LATENCY_S) if link is not None else 0.0
    return min(algos, key=lambda a: algos[a] - shift if a.startswith("nvls") else algos[a])


def collective_time(op: str, message_bytes: float, group_size: int, link: LinkModel | None, *,
                    gpus_per_node: int | None = None, inter_link: LinkModel | None = None) -> float:
    """Seconds for ONE call of `op` on `message_bytes` over `group_size` ranks: the fastest of the
    algorithms NCCL considers (`nccl_algorithms`) that its tuner picks, the least time by its own
    estimate (NVIDIA/nccl src/enqueue.cc `topoGetAlgoInfo` over tuning.cc `ncclTopoGetAlgoTime`;
    `_tuner_pick`).

    Each algorithm's time is ONE latency term (LAUNCH_S + NCCL's base + per-step latencies) plus its
    bytes over its bottleneck bandwidth; the intra- and inter-node parts of a multi-node algorithm
    are pipelined (min of the bandwidths), never summed. Flat (one tier) unless `inter_link` is given
    and the group spans nodes (group_size > gpus_per_node)."""
    algos = nccl_algorithms(op, message_bytes, group_size, link, gpus_per_node=gpus_per_node,
                            inter_link=inter_link)
    if "nvls" not in algos and "nvls_tree" not in algos:  # the tuner's estimates are the times
        return min(algos.values())
    return algos[_tuner_pick(algos, link)]


def nccl_algorithm(op: str, message_bytes: float, group_size: int, link: LinkModel | None, *,
                   gpus_per_node: int | None = None, inter_link: LinkModel | None = None) -> str:
    """The algorithm `collective_time` picks ('ring', 'nvls', 'tree', 'tree_ll', 'nvls_tree', 'pat')."""
    algos = nccl_algorithms(op, message_bytes, group_size, link, gpus_per_node=gpus_per_node,
                            inter_link=inter_link)
    return _tuner_pick(algos, link)


def _flat_time(op: str, message_bytes: float, n: int, link: LinkModel) -> float:
    """One collective on one tier (all ranks inside a node, or one rank per node on `link`)."""
    return collective_time(op, message_bytes, n, link)


# -- link lookups (cached) -------------------------------------------------------------------------

_HW_CLASS = {"nvlink": "nvlink", "xgmi": "nvlink", "pcie": "pci", "infiniband": "net", "roce": "net",
             "tcp": "net"}
"""Catalog interconnect kind -> NCCL's hardware class of latencies (tuning.cc NCCL_HW_*)."""


@lru_cache(maxsize=256)
def _interconnect(name: str, catalog_dirs: tuple = ()):
    from distplan.catalog.loader import load_catalog  # lazy: the catalog is never loaded at import

    return load_catalog(catalog_dirs).interconnect(name)


def _link_model(ic, busbw: float) -> LinkModel:
    return LinkModel(busbw, ic.latency_s, ic.half_efficiency_bytes, _HW_CLASS.get(ic.kind, "net"),
                     getattr(ic, "nvls_busbw_bytes_per_s", 0.0), getattr(ic, "nvls_latency_s", 0.0),
                     getattr(ic, "simple_protocol_only", False), getattr(ic, "ring_only", False),
                     getattr(ic, "scale_out_loss", 0.0))


@lru_cache(maxsize=1024)
def cluster_links(cluster: Cluster) -> tuple[LinkModel, LinkModel]:
    """(intra-node per-GPU link, inter-node per-GPU link) of a cluster, catalog lookups cached.

    Inter-node per GPU = NIC busbw x nics_per_node / gpus_per_node, or `cluster.inter_bytes_per_s`
    (per node, already an achievable figure) / gpus_per_node when given.
    """
    intra = _interconnect(cluster.intra_link, cluster.catalog_dirs)
    inter = _interconnect(cluster.inter_link, cluster.catalog_dirs)
    g = cluster.local_size
    node_bw = (cluster.inter_bytes_per_s if cluster.inter_bytes_per_s
               else inter.busbw_bytes_per_s * cluster.nics_per_node)
    return _link_model(intra, intra.busbw_bytes_per_s), _link_model(inter, node_bw / g)


@lru_cache(maxsize=1024)
def _group_times(cluster: Cluster) -> dict:
    """{(op, group, group_size, message_bytes): seconds} of `cluster`, filled by `timed_collectives`:
    strategies of one model on one cluster send many of the same messages (DDP and ZeRO-1 the same
    buckets, ZeRO-2 and ZeRO-3 the same units). One cache per cluster, so a lookup hashes no cluster."""
    return {}


def _group_time(c_op: str, group: str, n: int, message_bytes: float, cluster: Cluster) -> float:
    """Seconds for one call on `group` of `cluster`: 'inter_node' is one GPU per node (each GPU of a
    node runs its own such group at the same time, over its share of the NICs)."""
    intra, inter = cluster_links(cluster)
    if group == "tp":  # tensor parallelism: inside a node (tp.py)
        return collective_time(c_op, message_bytes, n, intra)
    if group == "cp" and c_op == "all_to_all":
        # context parallelism's ring shift (cp.py): every rank sends its buffer to the next at once; a
        # group wider than a node (its ranks `cluster.local_size` per node) has hops across nodes
        link = inter if n > cluster.local_size and cluster.nodes > 1 else intra
        return LAUNCH_S + link.latency_s + message_bytes / link.busbw_bytes_per_s
    if group == "pp":  # point-to-point between neighbouring stages (pp.py): one message, one link
        link = inter if cluster.gpus // n >= cluster.local_size and cluster.nodes > 1 else intra
        return LAUNCH_S + link.latency_s + message_bytes / link.busbw_bytes_per_s
    if group == "inter_node":
        return collective_time(c_op, message_bytes, n, None, gpus_per_node=1, inter_link=inter)
    if group == "intra_node":
        return collective_time(c_op, message_bytes, n, intra)
    return collective_time(c_op, message_bytes, n, intra, gpus_per_node=cluster.local_size,
                           inter_link=inter if n > cluster.local_size else None)


# -- unit sizes (cached per model) -----------------------------------------------------------------


@lru_cache(maxsize=2048)
def _fsdp2_numel(shapes: tuple, ws: int) -> int:
    """FSDP2 all-gather output / reduce-scatter input elements: each param padded on dim 0 to ws."""
    return sum(-(-s[0] // ws) * ws * prod(s[1:]) for s in shapes)


def _fsdp1_numel(n: int, ws: int) -> int:
    """FSDP1 FlatParameter (use_orig_params=False): the unit's `n` elements padded to a multiple of ws."""
    return -(-n // ws) * ws


def _autocast(precision: str) -> bool:
    """Whether DDP/ZeRO-1 run this precision under `torch.autocast` (fp32 parameters, 16-bit compute)."""
    return precision in ("bf16-mixed", "fp16-mixed")


def grad_ready_order(named_shapes, autocast: bool = False) -> list[int]:
    """Parameter numels in autograd's gradient-ready order (what DDP's rebuilt buckets follow), from
    (name, shape) pairs in registration order.

    Measured with `register_post_accumulate_grad_hook` (tests/test_comm.py on the reference decoder,
    the MNIST CNN for `--module`): modules in reverse registration order; inside a module, registration
    order (a norm's weight before its bias: native_layer_norm's outputs; a convolution's weight before
    its bias), except that a Linear's bias (its module's weight is 2-D) is ready before its weight in
    full precision (addmm(bias, input, weight.t()) lists the bias edge first); under autocast each
    reaches its AccumulateGrad through its own cast node (ToCopyBackward), the weight's first.
    """
    modules: list[list[tuple[str, tuple]]] = []
    prev = None
    for name, shape in named_shapes:
        mod = name.rsplit(".", 1)[0] if "." in name else ""
        if mod != prev:
            modules.append([])
            prev = mod
        modules[-1].append((name, tuple(shape)))
    out: list[int] = []
    for params in reversed(modules):
        weight = next((sh for n, sh in params if n.endswith("weight")), None)
        if weight is not None and len(weight) == 2 and not autocast:
            params = ([p for p in params if p[0].endswith(".bias")]
                      + [p for p in params if not p[0].endswith(".bias")])
        out += [prod(sh) for _, sh in params]
    return out


def bucket_sizes(ready_sizes, elem_bytes: int, bucket_cap_mb: int | None = DDP_BUCKET_CAP_MB) -> tuple[int, ...]:
    """Bucket sizes in bytes, in reduction order, of DDP's rebuilt buckets (iteration >= 2).

    `compute_bucket_assignment_by_size` (torch/csrc/distributed/c10d/reducer.cpp) with limits
    [first_bucket_bytes_cap, bucket_bytes_cap]: a tensor is appended, then the bucket closes when its
    size >= the current limit. One dtype (the model has one), so one key.
    """
    cap = (bucket_cap_mb if bucket_cap_mb is not None else 25) * 1024 * 1024
    first = DDP_DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
    out, size = [], 0
    for n in ready_sizes:
        size += n * elem_bytes
        if size >= (first if not out else cap):
            out.append(size)
            size = 0
    if size:
        out.append(size)
    return tuple(out)


@lru_cache(maxsize=512)
def ready_order_sizes(model: ModelSpec, autocast: bool = False) -> tuple[int, ...]:
    """`grad_ready_order` of the reference decoder (tied embeddings count once).

    No module spans two units, so the order is the units' own orders, last unit first; the blocks are
    identical, so one block's order is computed once and repeated."""
    embed_u, block_u, head_u = model.units()
    head = grad_ready_order(head_u.params, autocast)
    block = grad_ready_order(block_u.params, autocast)
    embed = grad_ready_order(embed_u.params, autocast)
    return tuple(head + block * model.layers + embed)


@lru_cache(maxsize=512)
def _param_size_counts(model: ModelSpec) -> tuple[tuple[int, int], ...]:
    """(numel, how many parameters have it), largest first."""
    counts: dict[int, int] = {}
    embed, block, head = model.units()
    for unit, times in ((embed, 1), (head, 1), (block, model.layers)):
        for _, shape in unit.params:
            n = prod(shape)
            counts[n] = counts.get(n, 0) + times
    return tuple(sorted(counts.items(), reverse=True))


@lru_cache(maxsize=1024)
def ddp_buckets(model: ModelSpec, elem_bytes: int, bucket_cap_mb: int | None = DDP_BUCKET_CAP_MB,
                autocast: bool = False) -> tuple[int, ...]:
    """`bucket_sizes` of the reference decoder's ready order."""
    return bucket_sizes(ready_order_sizes(model, autocast), elem_bytes, bucket_cap_mb)


@lru_cache(maxsize=1024)
def _ddp_bucket_counts(model: ModelSpec, elem_bytes: int, bucket_cap_mb: int | None,
                       autocast: bool) -> tuple[tuple[tuple[int, int], ...], int]:
    """(((bytes, how many buckets), ...) for all but the last bucket, the last bucket's bytes): a large
    model has tens of thousands of buckets, so the schedule counts them once per model."""
    buckets = ddp_buckets(model, elem_bytes, bucket_cap_mb, autocast)
    counts: dict[int, int] = {}
    for b in buckets[:-1]:
        counts[b] = counts.get(b, 0) + 1
    return tuple(counts.items()), buckets[-1]


# -- dtypes ----------------------------------------------------------------------------------------

_PARAM_DTYPES = {"fp32": "float32", "bf16-mixed": "bfloat16", "fp16-mixed": "float16", "bf16": "bfloat16"}


def _param_dtype(precision: str) -> str:
    """Dtype of all-gathered params: param_dtype of the MixedPrecision policy, else the param dtype."""
    return _PARAM_DTYPES[precision]


def _grad_dtype(precision: str) -> str:
    """Dtype of reduced gradients: fp32 (autocast keeps fp32 params; reduce_dtype=fp32), bf16 if pure."""
    return "bfloat16" if precision == "bf16" else "float32"


def _stored_dtype(precision: str) -> str:
    return "bfloat16" if precision == "bf16" else "float32"


# -- schedules -------------------------------------------------------------------------------------


class Schedule(list):
    """A list of `Collective`s as `collective_schedule` returns it, with `totals` (see `schedule_totals`)
    computed once per cached schedule rather than once per evaluated configuration. The totals describe
    the list as returned: to edit a schedule, copy it into a plain list first."""

    __slots__ = ("totals",)  # one is made per evaluated configuration: no instance dict

    def __init__(self, collectives=(), totals: "ScheduleTotals | None" = None):
        super().__init__(collectives)
        self.totals = totals


@dataclass(frozen=True)
class ScheduleTotals:
    """Sums over a schedule's entries, computed once per cached schedule (`schedule_totals`)."""

    time_s: float
    """Serial sum of the collectives' times."""
    calls: int
    per_call: dict
    """(op, phase, unit) -> (seconds of one call, calls); the per-call time averaged over merged entries."""
    time_by_phase: dict
    """phase -> seconds."""
    time_by_unit: dict
    """unit -> seconds."""
    bytes_by_op_dtype: dict
    """(op, dtype) -> message_bytes x calls, summed."""


def schedule_totals(schedule: list[Collective]) -> ScheduleTotals:
    """Totals of a schedule: those `collective_schedule` attached, else computed from the list."""
    totals = getattr(schedule, "totals", None)
    if totals is not None:
        return totals
    by_kind: dict[tuple, list] = {}
    by_phase: dict[str, float] = {}
    by_unit: dict[str, float] = {}
    by_bytes: dict[tuple, int] = {}
    time_s, n_calls = 0.0, 0
    for op, _, _, dtype, msg, calls, phase, _, t, unit in schedule:  # Collective fields, in order
        acc = by_kind.get((op, phase, unit))
        if acc is None:
            by_kind[op, phase, unit] = [t, calls]
        else:
            acc[0] += t
            acc[1] += calls
        by_phase[phase] = by_phase.get(phase, 0.0) + t
        by_unit[unit] = by_unit.get(unit, 0.0) + t
        by_bytes[op, dtype] = by_bytes.get((op, dtype), 0) + msg * calls
        time_s += t
        n_calls += calls
    per_call = {k: (t / n if n else 0.0, n) for k, (t, n) in by_kind.items()}
    return ScheduleTotals(time_s, n_calls, per_call, by_phase, by_unit, by_bytes)


@lru_cache(maxsize=8192)
def _timed_schedule(key: tuple, cluster: Cluster) -> tuple[tuple, ScheduleTotals]:
    """The schedule with times and its totals; depends on (model, precision, accum, framework,
    strategy, cluster) only, so a sweep over sequence length and micro-batch reuses it."""
    out = timed_collectives(_raw_schedule(*key), cluster)
    return tuple(out), schedule_totals(out)


def timed_collectives(raw, cluster: Cluster) -> list[Collective]:
    """`Collective`s, with bytes sent per GPU and time, from (op, group, group_size, dtype, message_bytes,
    calls, phase, unit) tuples."""
    out = []
    times = _group_times(cluster)
    for (op, group, n, dtype, msg, calls, phase, unit) in raw:
        t = times.get((op, group, n, msg))
        if t is None:
            t = times[op, group, n, msg] = _group_time(op, group, n, msg, cluster)
        out.append(Collective(op, group, n, dtype, msg, calls, phase,
                              round(bus_factor(op, n) * msg * calls), t * calls, unit))
    return out


def _schedule_key(train: TrainConfig, name: str, world: int, g: int, nodes: int, cap, root_explicit):
    return (train.model, train.precision, train.grad_accum, train.sync_every, train.framework, name, world, g,
            nodes, cap, root_explicit)


@lru_cache(maxsize=4096)
def _raw_schedule(model: ModelSpec, precision: str, A: int, every: bool, framework: str, name: str, world: int,
                  g: int, nodes: int, cap, root_explicit) -> tuple:
    """Tuples (op, group, group_size, dtype, message_bytes, calls, phase, unit), cached.

    `every`: gradients are reduced on each of the A micro-steps (grad_sync='every'), else on the last
    one only. DeepSpeed keeps its own schedule either way."""
    s = get_strategy(name)
    if not s.distributed:
        return ()
    if framework == "deepspeed" and s.zero_stage:
        return tuple(_deepspeed(model, precision, A, s.zero_stage, world))
    L = model.layers
    root, block, root_n, block_n, _ = unit_sizes(model)
    pdt, gdt = _param_dtype(precision), _grad_dtype(precision)
    pb, gb = _DTYPE_BYTES[pdt], _DTYPE_BYTES[gdt]
    out: list[tuple] = []

    def add(op, group, n, dtype, msg, calls, phase, unit):
        if calls > 0 and msg > 0:  # (a pipeline stage between the first and the last has no root)
            out.append((op, group, n, dtype, int(msg), int(calls), phase, unit))

    # Micro-steps that reduce gradients: all A unless the others run without sync (DDP's and FSDP1's
    # `no_sync()`: `require_backward_grad_sync` / `_sync_gradients` False, FSDP2's
    # `set_requires_gradient_sync(False)`: `FSDPParamGroup.reduce_grads` False).
    R = A if every else 1
    if s.ddp_reducer:
        counts, last = _ddp_bucket_counts(model, gb, cap, _autocast(precision))
        for b, c in counts:
            add("all_reduce", "world", world, gdt, b, c * R, "backward", "bucket")
        add("all_reduce", "world", world, gdt, last, R, "backward", "last_bucket")
        if model.hf_model_type and model.position == "rope":
            # DDP broadcasts the module's buffers before each synchronised forward (`_check_sync_bufs_pre_fwd`,
            # `_broadcast_coalesced`: one message per dtype): a transformers model's rotary embedding keeps
            # `inv_freq` and `original_inv_freq` (head_dim / 2 each, fp32; the model's dtype once cast to bf16)
            # as buffers (`<Type>RotaryEmbedding.__init__`), once per optimizer step, or per micro-step when
            # each one syncs (the trace's `module_plan.module_collectives` counts the same from the module)
            bdt = _stored_dtype(precision)
            add("broadcast", "world", world, bdt, model.head_dim * _DTYPE_BYTES[bdt], R, "forward", "buffers")
        if s.zero_optimizer:
            sdt = _stored_dtype(precision)
            for n, c in _param_size_counts(model):
                add("broadcast", "world", world, sdt, n * _DTYPE_BYTES[sdt], c, "optimizer", "param")
        return tuple(out)

    if s.fsdp2:
        blk, rt = _fsdp2_numel(block, world), _fsdp2_numel(root, world)
        reshard = s.reshard_after_forward
        root_bwd = reshard and root_explicit
        add("all_gather", "world", world, pdt, blk * pb, L * A, "forward", "block")
        add("all_gather", "world", world, pdt, rt * pb, A, "forward", "root")
        if reshard:
            add("all_gather", "world", world, pdt, blk * pb, L * A, "backward", "block")
        if root_bwd:
            add("all_gather", "world", world, pdt, rt * pb, A, "backward", "root")
        add("reduce_scatter", "world", world, gdt, blk * gb, L * R, "backward", "block")
        add("reduce_scatter", "world", world, gdt, rt * gb, R, "backward", "root")
        return tuple(out)

    if s.fsdp1:
        if s.fsdp_no_shard:
            add("all_reduce", "world", world, gdt, block_n * gb, L * R, "backward", "block")
            add("all_reduce", "world", world, gdt, root_n * gb, R, "backward", "root")
            return tuple(out)
        if s.hybrid:
            shard_n, group = min(world, g), "intra_node"
        else:
            shard_n, group = world, "world"
        blk, rt = _fsdp1_numel(block_n, shard_n), _fsdp1_numel(root_n, shard_n)
        # SHARD_GRAD_OP keeps params unsharded under no_sync (`_should_free_in_backward`), so only the first
        # micro-step all-gathers; a synced micro-step frees them, so with every one synced all A do.
        fwd_calls = 1 if s.fsdp1_shard_grad_op and not every else A
        add("all_gather", group, shard_n, pdt, blk * pb, L * fwd_calls, "forward", "block")
        add("all_gather", group, shard_n, pdt, rt * pb, fwd_calls, "forward", "root")
        if s.reshard_after_forward:
            add("all_gather", group, shard_n, pdt, blk * pb, L * A, "backward", "block")
        add("reduce_scatter", group, shard_n, gdt, blk * gb, L * R, "backward", "block")
        add("reduce_scatter", group, shard_n, gdt, rt * gb, R, "backward", "root")
        if s.hybrid:
            replicas = max(1, world // shard_n)
            add("all_reduce", "inter_node", replicas, gdt, blk // shard_n * gb, L * R, "backward", "block")
            add("all_reduce", "inter_node", replicas, gdt, rt // shard_n * gb, R, "backward", "root")
        return tuple(out)
    raise AssertionError(f"no schedule for family {s.family!r}")


def _deepspeed(model: ModelSpec, precision: str, A: int, stage: int, world: int) -> list[tuple]:
    """DeepSpeed ZeRO-1/2/3 with its default config. NOT validated: DeepSpeed is not installed here.

    Read from deepspeedai/DeepSpeed `deepspeed/runtime/zero/stage_1_and_2.py` and `stage3.py`:
    - stage 1/2: gradients go into IPG buckets of `reduce_bucket_size` (5e8) elements; with the default
      `reduce_scatter=True` and `use_multi_rank_bucket_allreduce=True`, `average_tensor` ->
      `allreduce_and_scatter` ALL-REDUCES each bucket (in chunks of <= reduce_bucket_size elements) and
      each rank keeps its partition. Stage 2 reduces in backward on every micro-step; stage 1 only at
      the accumulation boundary. After the step, updated 16-bit partitions are all-gathered
      (`all_gather_dp_groups`, runtime/utils.py) in `num_shards = max(1, P_partition * dp // allgather_bucket_size)`
      calls. Communication dtype: the 16-bit param/grad dtype (fp32 for fp32 training).
    - stage 3: every leaf module's partitioned params (each padded to a multiple of world size) are
      all-gathered before its forward and again before its backward, per micro-step; params with fewer
      than `param_persistence_threshold` (1e5) elements stay unpartitioned (no all-gather). Gradients
      are reduce-scattered every micro-step in `reduce_bucket_size` buckets. No post-step all-gather.
    The single IPG buffer / module order is approximated by contiguous chunks of the total.
    """
    ws = world
    dt = "float32" if precision == "fp32" else ("float16" if precision == "fp16-mixed" else "bfloat16")
    eb = _DTYPE_BYTES[dt]
    P = model.param_count()
    out: list[tuple] = []
    if stage in (1, 2):
        nb = max(1, -(-P // DS_REDUCE_BUCKET_SIZE))
        rounds = A if stage == 2 else 1
        base, rem = divmod(P, nb)  # rem buckets of base + 1 elements, then nb - rem of base
        sizes = {sz: c for sz, c in ((base + 1, rem), (base, nb - rem)) if c}
        for sz, c in sizes.items():
            out.append(("all_reduce", "world", ws, dt, sz * eb, c * rounds, "backward", "bucket_ds"))
        part = -(-P // ws)
        shards = max(1, part * ws // DS_ALLGATHER_BUCKET_SIZE)
        out.append(("all_gather", "world", ws, dt, (part // shards) * ws * eb, shards, "optimizer", "bucket_ds"))
        return out
    # stage 3: leaf modules with partitioned params
    mods: dict[str, list] = {}
    for unit in model.param_inventory():
        for name, shape in unit.params:
            mods.setdefault(name.rsplit(".", 1)[0], []).append(shape)
    ag: dict[int, int] = {}
    for shapes in mods.values():
        part = [s for s in shapes if prod(s) >= DS_PARAM_PERSISTENCE_THRESHOLD]
        if part:
            n = sum(-(-prod(s) // ws) * ws for s in part)
            ag[n] = ag.get(n, 0) + 1
    for n, c in ag.items():
        out.append(("all_gather", "world", ws, dt, n * eb, c * A, "forward", "module"))
        out.append(("all_gather", "world", ws, dt, n * eb, c * A, "backward", "module"))
    nb = max(1, -(-P // DS_REDUCE_BUCKET_SIZE))
    out.append(("reduce_scatter", "world", ws, dt, (-(-P // nb)) * eb, nb * A, "backward", "bucket_ds"))
    return out


def comm_summary(schedule: list[Collective]) -> dict:
    """Totals of a schedule: {'bytes_per_gpu': int, 'time_s': float} (serial sum, no overlap)."""
    return {"bytes_per_gpu": sum(c.bytes_per_gpu for c in schedule),
            "time_s": sum(c.time_s for c in schedule)}
