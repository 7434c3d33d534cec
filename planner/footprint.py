"""The device footprint beyond the caching allocator: the CUDA context and NCCL's communicators.

`device_total = peak_reserved + process_overhead` (memory.py) is what NVML should show for a training
process; this module owns `process_overhead`: the CUDA context (a documented constant) plus, for each NCCL
communicator the strategy creates, what NCCL allocates on the device. Pure Python, cached.

NCCL's device allocations per communicator and rank, from NVIDIA/nccl, read at v2.27.5-1 (torch 2.9's
wheels pin nvidia-nccl-cu12==2.27.5), v2.29.7-1 (torch 2.13.0's CUDA 13 wheels resolve
nvidia-nccl-cu13==2.29.7; the torch installed here is the CPU build, so this is not checked locally) and
v2.30.7-1. The figures below are the same in all three but one, by `nccl_version`: before 2.28 postset
raised the ring's channels to the NVLS channel count (see Channels).

- Protocol buffers, per connection (`src/init.cc` `computeBuffSizes`, DEFAULT_*_BUFFSIZE; constants in
  `src/include/device.h`): LL = 8 lines x 512 threads x NCCL_STEPS 8 x 16 B = 512 KiB; LL128 = 120
  elems x 640 threads x 8 steps x 8 B = 4.6875 MiB; Simple = 4 MiB (`NCCL_BUFFSIZE`; `NCCL_LL_BUFFSIZE`,
  `NCCL_LL128_BUFFSIZE` override the others). All three are allocated whatever `NCCL_PROTO` says:
  `computeBuffSizes` does not read it.
- Inside a node (P2P transport, `src/transport/p2p.cc` `p2pSendSetup`/`p2pRecvSetup`, allocated by the
  rank's own proxy on its own GPU in `p2pSendProxySetup`/`p2pRecvProxySetup`): the receiver holds
  sizeof(ncclRecvMem) (4 KiB, MEM_ALIGN, `src/include/comm.h`) + LL + LL128 + Simple; the sender
  sizeof(ncclSendMem) (4 KiB). With P2P read (`src/graph/paths.cc` `ncclTopoCheckP2p`: both GPUs of
  compute capability 8.0 on NVLink, or `NCCL_P2P_READ_ENABLE`) the Simple buffer moves to the sender.
  Each is rounded up to CUDA_IPC_MIN = 2 MiB (`ALIGN_SIZE(sendSize, CUDA_IPC_MIN)`).
- Across nodes (net transport, `src/transport/net.cc` `sendProxySetup`/`recvProxySetup`): with GPU
  Direct RDMA the sender keeps LL128 + Simple on the GPU (LL in host memory), the receiver all three;
  without GDR everything is in host memory. Rounded to CUDA_IPC_MIN / the cuMem granularity.
- Per channel, `src/channel.cc` `initChannel`: three small device arrays (the shared `devPeers`, the
  channel's `devPeers`, `devRingUserRanks`); per NVLS channel `initNvlsChannel`: `nvlsDevPeers`; per
  communicator `src/init.cc` `devCommSetup`: `devCommAndChans` and `rankToLocalRank`. With cuMem (the
  default when the driver supports it: `src/misc/cudawrap.cc` `ncclCuMemEnable`, `NCCL_CUMEM_ENABLE`)
  every `ncclCudaCalloc*` goes through `ncclCuMemAlloc` (`src/include/alloc.h`), which rounds the size
  up to the allocation granularity: each of these small arrays costs CUMEM_GRANULARITY_BYTES.
- NVLS (`src/transport/nvls.cc` `ncclNvlsBufferSetup`): nvlsChannels x 2 x (NCCL_NVLS_CHUNKSIZE 128 KiB
  x NCCL_STEPS) x nHeads of unicast memory bound to the multicast object, nHeads = the node's GPUs
  (`src/graph/search.cc` `ncclTopoCompute`: NVLS maxChannels = min(NCCL_MAX_NVLS_ARITY 32, GPUs));
  nvlsChannels = 16 on sm90, 24 (one node) / 32 on sm100 (`ncclNvlsInit`, NVLS_NCHANNELS_*,
  `NCCL_NVLS_NCHANNELS`); plus the credits (`ncclNvlsSetup`, 64 B per channel and head, one granule).
  NVLS needs an NVSwitch, compute capability >= 9.0 and more than 2 GPUs (`ncclNvlsInit`);
  `NCCL_NVLS_ENABLE=0` turns it off.
- Work FIFO (`src/init.cc` `devCommSetup`): host-pinned memory unless GDRCopy is enabled: 0 here.

Which connections exist: since NCCL 2.22 connections are made when an algorithm is first used
(`NCCL_RUNTIME_CONNECT`, default 1 when cuMem is on; `src/group.cc` `ncclCollPreconnectFunc`). Counted:
the ring on every channel (one send, one receive per rank); across nodes the tree too (the reverse
direction of the intra-node chain plus up to three cross-node peers on the ranks that hold a NIC);
NVLS's buffers whenever NVLS is available (an upper bound for a communicator whose collectives NCCL's
tuner never runs with NVLS). Without runtime connection (`NCCL_RUNTIME_CONNECT=0`, or cuMem off) the
tree is connected at init on one node too.

Channels (`src/graph/search.cc` `ncclTopoCompute`, `src/graph/connect.cc` `ncclTopoPostset`): the ring
search starts at the first speed of the architecture's speed array not above the GPU's path bandwidth
(NVLink links x SMxx_NVLINK_BW, or the PCIe link width x generation, `src/graph/topo.h`) and fits
floor(bandwidth / speed) channels; postset doubles them (at most MAXCHANNELS 64); across nodes on sm90+
with a speed above 45 GB/s and fewer than 16 channels it doubles again; `NCCL_MAX_NCHANNELS` /
`NCCL_MIN_NCHANNELS` clamp; before NCCL 2.28 (v2.27.7 has it, v2.28.3 not) with NVLS the count is
raised to nvlsChannels (`if (comm->nChannels < comm->nvlsChannels)`). Channels initialised: pow2Up(channels)
for point-to-point (`src/graph/paths.cc` `ncclTopoComputeP2pChannels`) and the NVLS channels
(`initNvlsChannel` -> `initChannel`). E.g. 8 x H100 SXM (18 links x 20.6 GB/s = 370.8): 6 channels at
60 GB/s, 12 after postset (16 with NVLS before 2.28); 8 x A100 (12 x 20 = 240): 6 at 40, 12.

Known limitations: the search is modelled by its first speed only (NCCL can settle on another
(speed, channels) pair), and across nodes by the intra-node search (the NIC-constrained search is not
modelled): those channel counts are estimates. The net transport is assumed to use GDR on NVLink
nodes. Point-to-point (send/recv) connections, CollNet, PXN and communicators that share resources
(`ncclCommSplit` with `splitShare`) are not modelled. RCCL (AMD) is given NCCL's model. CUMEM_GRANULARITY
is the figure drivers report today, not a documented constant. None of this is yet measured here: the
probes record NVML's per-process figure (validate/probe.py) so a GPU run can check it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

from distplan.catalog.loader import load_catalog

MIB = 2**20

NCCL_VERSION = (2, 29, 7)
"""The NCCL modelled by default: what torch 2.13.0's CUDA wheels install (nvidia-nccl-cu13==2.29.7). A
probe records the one it ran with (`torch.cuda.nccl.version()`, validate/probe.py)."""

CUDA_CONTEXT_BYTES = 600 * MIB
"""The CUDA context, the kernels' modules PyTorch and NCCL load into it, and what cuBLAS/cuDNN handles
allocate outside PyTorch's caching allocator. Not derivable from a primary source: CUDA documents no
context size, and it varies with the driver, the architecture and the modules loaded (lazy loading,
`CUDA_MODULE_LOADING=LAZY`, is the default since CUDA 12.2: CUDA C++ Programming Guide, "Lazy Loading",
https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#lazy-loading, so only the kernels a
process runs are loaded). A stated assumption (third parties quote 0.3-2 GiB) until the probes' NVML
figure (validate/probe.py `nvml_process_bytes`) minus `max_memory_reserved` and NCCL's model measures
it. cuBLAS workspaces are not here: PyTorch allocates them through the caching allocator
(aten/src/ATen/cuda/CublasHandlePool.cpp `getCurrentCUDABlasHandle` -> `getNewWorkspace`)."""

# NVIDIA/nccl src/include/device.h (v2.27.5 .. v2.30.7)
NCCL_STEPS = 8
LL_FIFO_LINE_BYTES = 16  # union ncclLLFifoLine: 4 x uint32
NCCL_LL_LINES_PER_THREAD = 8
NCCL_LL_MAX_NTHREADS = 512
NCCL_LL128_ELEMS_PER_THREAD = 120
NCCL_LL128_MAX_NTHREADS = 640
MAXCHANNELS = 64
NCCL_MAX_NVLS_ARITY = 32
# src/init.cc DEFAULT_LL_BUFFSIZE, DEFAULT_LL128_BUFFSIZE, DEFAULT_BUFFSIZE
DEFAULT_LL_BUFFSIZE = NCCL_LL_LINES_PER_THREAD * NCCL_LL_MAX_NTHREADS * NCCL_STEPS * LL_FIFO_LINE_BYTES
DEFAULT_LL128_BUFFSIZE = NCCL_LL128_ELEMS_PER_THREAD * NCCL_LL128_MAX_NTHREADS * NCCL_STEPS * 8
DEFAULT_BUFFSIZE = 1 << 22
# src/include/comm.h: struct ncclSendMem / ncclRecvMem are unions padded to MEM_ALIGN (4096)
SEND_MEM_BYTES = RECV_MEM_BYTES = 4096
CUDA_IPC_MIN = 2097152  # src/include/comm.h
CUMEM_GRANULARITY_BYTES = 2 * MIB
"""cuMemGetAllocationGranularity(CU_MEM_ALLOC_GRANULARITY_MINIMUM) for device memory on NVIDIA GPUs of
compute capability 7.0-10.x as drivers report it (not a documented constant; NCCL's NVLS_MEM_ALIGN_SIZE
in src/transport/nvls.cc is the same 1 << 21)."""
NVLS_CHUNKSIZE = 128 * 1024  # src/transport/nvls.cc NCCL_PARAM(NvlsChunkSize, "NVLS_CHUNKSIZE", 128*1024)
NVLS_CREDIT_BYTES = 64  # src/transport/nvls.cc ncclNvlsSetup: memSize = 64 per channel, direction, head
NVLS_NCHANNELS_SM90, NVLS_NCHANNELS_SM100, NVLS_NCHANNELS_SM100_NVL = 16, 32, 24  # nvls.cc

# src/graph/topo.h: per-link NVLink bandwidth (GB/s) by compute capability
_NVLINK_BW = ((100, 40.1), (90, 20.6), (87, 20.0), (86, 12.0), (80, 20.0), (70, 20.0), (60, 18.0))
# src/graph/search.cc speed arrays (GB/s)
_SPEEDS_INTRA = (40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0)
_SPEEDS_INTRA_SM90 = (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0)
_SPEEDS_INTRA_SM100 = (90.0, 80.0, 70.0, 60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 19.0, 18.0)
# src/graph/xml.cc kvDictPciGen x width / 80: x16 Gen3 12 GB/s (topo.h PCI_BW), Gen4 24, Gen5 48
_PCIE_BW = {"pcie3": 12.0, "pcie4": 24.0, "pcie5": 48.0}

_CC = (("gb200", 100), ("b200", 100), ("b100", 100), ("gb300", 103), ("b300", 103), ("gh200", 90),
       ("h100", 90), ("h200", 90), ("h800", 90), ("h20", 90), ("a100", 80), ("a800", 80), ("a10", 86),
       ("a40", 86), ("l40", 89), ("l4", 89), ("t4", 75), ("v100", 70))
"""Catalog GPU name (prefix) -> CUDA compute capability x 10 (NVIDIA's CUDA GPUs list,
https://developer.nvidia.com/cuda-gpus)."""

ENV_VARS = ("NCCL_BUFFSIZE", "NCCL_LL_BUFFSIZE", "NCCL_LL128_BUFFSIZE", "NCCL_NVLS_ENABLE",
            "NCCL_NVLS_NCHANNELS", "NCCL_NVLS_CHUNKSIZE", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS",
            "NCCL_P2P_READ_ENABLE", "NCCL_CUMEM_ENABLE", "NCCL_RUNTIME_CONNECT", "NCCL_NET_GDR_LEVEL",
            "NCCL_MAX_CTAS", "NCCL_MIN_CTAS")
"""The NCCL environment variables the footprint reads (NCCL's own names and meanings, src/init.cc,
src/transport/nvls.cc, src/graph/connect.cc, src/transport/p2p.cc, src/misc/cudawrap.cc). NCCL_PROTO
is not among them: it does not change what is allocated."""


def compute_capability(gpu_name: str) -> int | None:
    low = gpu_name.lower()
    for key, cc in _CC:
        if key in low:
            return cc
    return None


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def _pow2_up(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _env_int(env: dict, name: str, default: int) -> int:
    v = env.get(name)
    if v is None or str(v).strip() == "":
        return default
    try:
        return int(str(v).strip(), 0)
    except ValueError:
        raise ValueError(f"{name}={v!r}: NCCL reads an integer here (e.g. {default})") from None


def _environ_data() -> tuple:
    """(os.environ's underlying dict, its keys view, ((name, encoded name), ...), the encoded names) or None.
    CPython's `os._Environ` keeps one `_data` dict for the process and updates it in place (`putenv` /
    `unsetenv` in `__setitem__` / `__delitem__`), so the view stays current."""
    data, encode = getattr(os.environ, "_data", None), getattr(os.environ, "encodekey", None)
    if not isinstance(data, dict) or encode is None:
        return None
    encoded = tuple((k, encode(k)) for k in ENV_VARS)
    return data, data.keys(), encoded, frozenset(b for _, b in encoded)


_ENVIRON: tuple | None = None


def nccl_env(environ=None) -> tuple:
    """The NCCL variables of `environ` (default os.environ) that the footprint reads, as a hashable key.

    Every memory estimate asks, so os.environ is read through its underlying dict (CPython's
    `os._Environ._data`, encoded keys): one set test when none is set, instead of fourteen `in os.environ`."""
    global _ENVIRON
    if environ is None:
        if _ENVIRON is None:
            _ENVIRON = _environ_data() or ()
        if _ENVIRON:
            data, keys, encoded, wanted = _ENVIRON
            if keys.isdisjoint(wanted):  # iterates the smaller side; usually none is set
                return ()
            hits = keys & wanted
            decode = os.environ.decodevalue
            return tuple((k, decode(data[b])) for k, b in encoded if b in hits)
        environ = os.environ
    return tuple((k, environ[k]) for k in ENV_VARS if k in environ)


@dataclass(frozen=True)
class Topology:
    """What NCCL's allocations depend on, for one communicator seen from one rank."""

    ranks: int
    ranks_per_node: int
    """Ranks of this communicator on one node (1 for a replicate group spanning nodes)."""
    cc: int | None
    """Compute capability x 10 (None: unknown, taken as 8.0)."""
    intra_kind: str
    """'nvlink' (NVSwitch-connected), 'pcie', 'xgmi'."""
    intra_bw_gbps: float
    """NCCL's per-GPU path bandwidth inside a node, GB/s (topo.h units)."""
    nvswitch: bool

    @property
    def nodes(self) -> int:
        return -(-self.ranks // self.ranks_per_node)


@dataclass(frozen=True)
class CommFootprint:
    """One communicator's device bytes on one rank, by part (all integers, bytes)."""

    name: str
    ranks: int
    ranks_per_node: int
    channels: int
    channels_source: str
    nvls_channels: int
    p2p_read: bool
    ring: int
    tree: int
    nvls: int
    channel_structs: int
    dev_comm: int

    @property
    def total(self) -> int:
        return self.ring + self.tree + self.nvls + self.channel_structs + self.dev_comm

    def to_dict(self) -> dict:
        return {"name": self.name, "ranks": self.ranks, "ranks_per_node": self.ranks_per_node,
                "channels": self.channels, "channels_source": self.channels_source,
                "nvls_channels": self.nvls_channels, "p2p_read": self.p2p_read,
                "ring_bytes": self.ring, "tree_bytes": self.tree, "nvls_bytes": self.nvls,
                "channel_structs_bytes": self.channel_structs, "dev_comm_bytes": self.dev_comm,
                "total_bytes": self.total}


@dataclass(frozen=True)
class DeviceFootprint:
    """The process's device bytes outside PyTorch's caching allocator."""

    cuda_context: int
    nccl: tuple = field(default=())
    """CommFootprint per communicator."""

    @cached_property  # (frozen: computed once per footprint; every memory estimate asks)
    def nccl_total(self) -> int:
        return sum(c.total for c in self.nccl)

    @cached_property
    def total(self) -> int:
        return self.cuda_context + self.nccl_total

    def to_dict(self) -> dict:
        return {"cuda_context": self.cuda_context, "nccl_total": self.nccl_total,
                "nccl": [c.to_dict() for c in self.nccl], "total": self.total}


def _speeds(cc: int) -> tuple:
    return _SPEEDS_INTRA_SM100 if cc >= 100 else _SPEEDS_INTRA_SM90 if cc >= 90 else _SPEEDS_INTRA


def nvls_channels(topo: Topology, env: dict) -> int:
    """NVLS channels (0 without NVLS): src/transport/nvls.cc `ncclNvlsInit`."""
    cc = topo.cc or 80
    if (_env_int(env, "NCCL_NVLS_ENABLE", 2) == 0 or not topo.nvswitch or cc < 90
            or topo.ranks_per_node <= 2):  # `gpuCount <= 2` and search.cc: NVLS needs an NVS node, sm90+
        return 0
    n = (NVLS_NCHANNELS_SM100 if topo.nodes > 1 else NVLS_NCHANNELS_SM100_NVL) if cc >= 100 else NVLS_NCHANNELS_SM90
    n = _env_int(env, "NCCL_NVLS_NCHANNELS", n)
    return max(_env_int(env, "NCCL_MIN_CTAS", 1), min(_env_int(env, "NCCL_MAX_CTAS", MAXCHANNELS), n))


def ring_channels(topo: Topology, env: dict, nvls: int, nccl_version: tuple = NCCL_VERSION) -> tuple[int, str]:
    """(collective channels, 'derived' or 'estimate'): search.cc `ncclTopoCompute` (first speed) and
    connect.cc `ncclTopoPostset` (see the module docstring)."""
    if topo.ranks == 1:
        return 0, "derived"
    cc = topo.cc or 80
    bw = topo.intra_bw_gbps
    speeds = _speeds(cc)
    speed = next((s for s in speeds if s <= bw), speeds[-1])
    n = max(1, min(MAXCHANNELS // 2, int(bw // speed)))  # ringGraph->maxChannels = MAXCHANNELS/2
    n = min(MAXCHANNELS, 2 * n)  # ncclTopoPostset: "Duplicate channels"
    source = "derived" if topo.nodes == 1 and topo.ranks_per_node > 1 else "estimate"
    if cc >= 90 and topo.nodes > 1 and speed > 45.0 and n < 16:
        n = 2 * n  # ncclTopoPostset: sm90+, several nodes, bwIntra > 45
    n = min(_env_int(env, "NCCL_MAX_NCHANNELS", MAXCHANNELS), n)
    n = max(_env_int(env, "NCCL_MIN_NCHANNELS", 0), n)
    n = max(1, min(MAXCHANNELS, n))
    if n < nvls and tuple(nccl_version) < (2, 28):
        n = nvls  # ncclTopoPostset before 2.28: `if (comm->nChannels < comm->nvlsChannels)` copyChannels
    return n, source


@lru_cache(maxsize=4096)
def comm_footprint(name: str, topo: Topology, env_key: tuple = (), nccl_version: tuple = NCCL_VERSION) -> CommFootprint:
    """NCCL's device bytes for one communicator on its most loaded rank (module docstring)."""
    env = dict(env_key)
    if topo.ranks == 1:
        return CommFootprint(name, 1, 1, 0, "derived", 0, False, 0, 0, 0, 0, 0)
    ll = _env_int(env, "NCCL_LL_BUFFSIZE", DEFAULT_LL_BUFFSIZE)
    ll128 = _env_int(env, "NCCL_LL128_BUFFSIZE", DEFAULT_LL128_BUFFSIZE)
    simple = _env_int(env, "NCCL_BUFFSIZE", DEFAULT_BUFFSIZE)
    if min(ll, ll128, simple) < 0:
        raise ValueError(f"NCCL buffer sizes must be >= 0: LL {ll}, LL128 {ll128}, Simple {simple}")
    cumem = _env_int(env, "NCCL_CUMEM_ENABLE", 1) != 0  # -2 (default): on where the driver supports it
    gran = CUMEM_GRANULARITY_BYTES if cumem else 1
    cc = topo.cc or 80
    nvls = nvls_channels(topo, env)
    if not cumem:
        nvls = 0  # NVLS allocates with cuMem (nvlsAllocateMem); ncclNvlsInit needs it
    n, source = ring_channels(topo, env, nvls, nccl_version)
    read = cc == 80 and topo.intra_kind == "nvlink"  # paths.cc ncclTopoCheckP2p
    read = bool(_env_int(env, "NCCL_P2P_READ_ENABLE", int(read)))
    # p2p.cc p2pSendSetup / p2pRecvSetup, rounded by ALIGN_SIZE(.., CUDA_IPC_MIN) (and cuMem granularity)
    a = max(CUDA_IPC_MIN, gran)
    p2p_send = _align(SEND_MEM_BYTES + (simple if read else 0), a)
    p2p_recv = _align(RECV_MEM_BYTES + ll + ll128 + (0 if read else simple), a)
    # net.cc with GDR (assumed on NVLink nodes: NCCL_NET_GDR_LEVEL=LOC or 0 turns it off here)
    gdr = topo.intra_kind == "nvlink" and str(env.get("NCCL_NET_GDR_LEVEL", "")).upper() not in ("LOC", "0")
    net_send = _align(ll128 + simple, a) if gdr else 0
    net_recv = _align(ll + ll128 + simple, a) if gdr else 0
    g = topo.ranks_per_node
    # init.cc initTransportsRank: without runtime connection (NCCL_RUNTIME_CONNECT=0, or no cuMem) the
    # ring, the tree and NVLS are all connected at init, whichever collectives run.
    runtime = cumem and _env_int(env, "NCCL_RUNTIME_CONNECT", 1) != 0
    if topo.nodes == 1:
        ring = n * (p2p_send + p2p_recv)
        tree = 0 if runtime or g <= 2 else n * (p2p_send + p2p_recv)  # the chain's reverse direction
    else:
        # Each channel leaves and enters a node through one rank pair; spread over the node's GPUs, the
        # most loaded rank sends (and receives) over the network on ceil(n / g) channels.
        k = -(-n // g) if g > 1 else n
        if g == 1:
            ring = n * (net_send + net_recv)
        else:
            ring = (n - k) * (p2p_send + p2p_recv) + k * (net_send + net_recv)
        # Tree (runtime-connected when NCCL picks it across nodes): the intra-node chain's reverse
        # direction, and up to 3 cross-node peers (1 up, 2 down; connect.cc ncclTreeBasePostset) both ways.
        tree = (n * (p2p_send + p2p_recv) if g > 1 else 0) + k * 3 * (net_send + net_recv)
    nvls_bytes = 0
    if nvls:
        heads = min(NCCL_MAX_NVLS_ARITY, g)
        chunk = _env_int(env, "NCCL_NVLS_CHUNKSIZE", NVLS_CHUNKSIZE)
        nvls_bytes = _align(nvls * 2 * chunk * NCCL_STEPS * heads, gran)  # ncclNvlsBufferSetup
        nvls_bytes += _align(nvls * 2 * NVLS_CREDIT_BYTES * heads, gran)  # ncclNvlsSetup credits
        nvls_bytes += nvls * gran if cumem else 0  # initNvlsChannel: nvlsDevPeers
    channels_init = max(n, nvls, min(_pow2_up(n), MAXCHANNELS))  # ncclTopoComputeP2pChannels, initNvlsChannel
    structs = channels_init * 3 * gran if cumem else 0  # initChannel's three device arrays
    dev_comm = 2 * gran if cumem else 0  # devCommSetup: devCommAndChans, rankToLocalRank
    return CommFootprint(name, topo.ranks, g, n, source, nvls, read, ring, tree, nvls_bytes, structs, dev_comm)


@lru_cache(maxsize=256)
def _hardware(gpu_name: str, intra_link: str, catalog_dirs: tuple) -> tuple:
    """(cc, intra kind, per-GPU path bandwidth GB/s, NVSwitch) from the catalog (cached)."""
    # lazy: catalog.loader imports distplan.planner, whose __init__ imports this module
    cat = load_catalog(catalog_dirs)
    gpu = cat.gpu(gpu_name)
    ic = cat.interconnect(intra_link)
    cc = compute_capability(gpu.name) if gpu.vendor == "nvidia" else None
    if ic.kind == "nvlink":
        per_link = next((bw for c, bw in _NVLINK_BW if (cc or 80) >= c), 20.0)
        links = gpu.nvlink_links or 12
        return cc, "nvlink", links * per_link, ic.name != "nvlink2"  # DGX-1's V100 cube mesh: no NVSwitch
    if ic.kind == "pcie":
        return cc, "pcie", _PCIE_BW.get(ic.name, 24.0), False
    return cc, ic.kind, _PCIE_BW["pcie4"], False


def communicators(cluster, world: int, shard_group: str, tp: int = 1) -> tuple:
    """(name, ranks, ranks per node) of each NCCL communicator one rank joins: the data-parallel group
    (every rank of `world`); HSDP across nodes: a shard group inside the node and a replicate group of
    one rank per node; tensor parallelism: the TP group inside the node. `cluster` is the data-parallel
    view (tp.py `tp_view`), whose node holds local_size data-parallel ranks."""
    if world <= 1 and tp <= 1:
        return ()
    g = min(cluster.local_size, world) if world > 1 else 1
    out = []
    if world > 1:
        if shard_group == "node" and cluster.nodes > 1:
            out += [("shard", g, g), ("replicate", world // g, 1)]
        else:
            out.append(("data_parallel", world, g))
    if tp > 1:
        out.append(("tensor_parallel", tp, tp))
    return tuple(out)


@lru_cache(maxsize=4096)
def _device_footprint(comms: tuple, hw: tuple, env_key: tuple, nccl_version: tuple) -> DeviceFootprint:
    cc, kind, bw, nvswitch = hw
    parts = tuple(comm_footprint(name, Topology(r, rpn, cc, kind, bw, nvswitch), env_key, nccl_version)
                  for name, r, rpn in comms)
    return DeviceFootprint(CUDA_CONTEXT_BYTES, parts)


def device_footprint(cluster, world: int, shard_group: str, tp: int = 1, environ=None,
                     nccl_version: tuple = NCCL_VERSION) -> DeviceFootprint:
    """The CUDA context and each communicator's NCCL bytes for one rank of `cluster` (cached)."""
    return _footprint_for(cluster, world, shard_group, tp, nccl_env(environ), tuple(nccl_version))


@lru_cache(maxsize=4096)
def _footprint_for(cluster, world: int, shard_group: str, tp: int, env_key: tuple,
                   nccl_version: tuple = NCCL_VERSION) -> DeviceFootprint:
    comms = communicators(cluster, world, shard_group, tp)
    if not comms:
        return _device_footprint((), (None, "none", 0.0, False), env_key, nccl_version)
    hw = _hardware(cluster.gpu_name, cluster.intra_link, cluster.catalog_dirs)
    return _device_footprint(comms, hw, env_key, nccl_version)


def with_communicator(footprint: DeviceFootprint, cluster, name: str, ranks: int, ranks_per_node: int,
                      environ=None, nccl_version: tuple = NCCL_VERSION) -> DeviceFootprint:
    """`footprint` plus one more communicator of `ranks` ranks, `ranks_per_node` of them on a node (the
    pipeline's send/recv group: NCCL's collective model applied to it, an approximation: point-to-point
    connections are made per peer on the p2p channels, not modelled here)."""
    if ranks <= 1:
        return footprint
    hw = _hardware(cluster.gpu_name, cluster.intra_link, cluster.catalog_dirs)
    topo = Topology(ranks, max(1, min(ranks, ranks_per_node)), *hw)
    extra = comm_footprint(name, topo, nccl_env(environ), tuple(nccl_version))
    return DeviceFootprint(footprint.cuda_context, footprint.nccl + (extra,))
