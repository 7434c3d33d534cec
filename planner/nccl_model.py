"""The time of one collective on a cluster's links: nccl-tests' bus factors and latency steps, NCCL's
algorithms (ring, tree, PAT, NVLS) and its tuner's pick, the alpha-beta `LinkModel` per link and the cached
link lookups of a cluster (`cluster_links`, the per-group times). Below comm.py, which builds the schedules
these times are summed over."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from distplan.catalog.loader import load_catalog

from .config import Cluster

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


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
