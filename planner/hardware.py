"""Local GPUs through NVML (nvidia-ml-py): count, name, memory, NVLink between them.

Each NVML call is wrapped on its own and degrades to "unknown" (as gpustat does); no driver, no GPU or
any NVML error gives `None` and a one-line notice, never an exception. pynvml is imported here only.
"""

from __future__ import annotations

from dataclasses import dataclass

_NAME_TO_CATALOG = (
    ("h200", "h200"), ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"), ("b200", "b200"),
    ("a100-sxm4-80gb", "a100-80gb"), ("a100 80gb pcie", "a100-80gb-pcie"), ("a100-pcie-40gb", "a100-40gb-pcie"),
    ("a100-sxm4-40gb", "a100-40gb"), ("a100", "a100-80gb"), ("l40s", "l40s"), ("l4", "l4"), ("t4", "t4"),
    ("a10", "a10"), ("v100-sxm2-16gb", "v100-16gb"), ("v100", "v100-32gb"),
)


@dataclass(frozen=True)
class LocalGPUs:
    count: int
    name: str
    memory_bytes: int
    catalog_gpu: str | None
    nvlink_links: int
    intra_link: str | None


def catalog_name(device_name: str) -> str | None:
    low = device_name.lower()
    for key, name in _NAME_TO_CATALOG:
        if key in low:
            return name
    return None


def detect_local_gpus() -> tuple[LocalGPUs | None, str]:
    """(local GPUs or None, a one-line notice saying what was used)."""
    try:
        import pynvml
    except Exception:  # noqa: BLE001 - any import problem means "no NVML"
        return None, "no nvidia-ml-py: using the catalog default GPU (pass --gpu/--gpu-mem/--gpus)"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return None, (f"no NVIDIA driver/GPU found ({type(exc).__name__}): using the catalog default "
                      f"(pass --gpu/--gpu-mem/--gpus to choose)")
    try:
        try:
            count = pynvml.nvmlDeviceGetCount()
        except Exception as exc:  # noqa: BLE001
            return None, f"NVML could not count GPUs ({type(exc).__name__}): using the catalog default"
        if count < 1:
            return None, "NVML found no GPU: using the catalog default"
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        try:
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else str(name)
        except Exception:  # noqa: BLE001
            name = "unknown GPU"
        try:
            memory = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        except Exception:  # noqa: BLE001
            memory = 0
        links = 0
        for link in range(18):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(handle, link):
                    links += 1
            except Exception:  # noqa: BLE001 - not supported / no such link
                break
        cat = catalog_name(name)
        intra = None
        if count > 1:
            if links:
                intra = {"h100-sxm": "nvlink4", "h200": "nvlink4", "b200": "nvlink5",
                         "a100-80gb": "nvlink3", "a100-40gb": "nvlink3", "v100-32gb": "nvlink2",
                         "v100-16gb": "nvlink2"}.get(cat or "", None)
            else:
                intra = "pcie4"
        if memory <= 0:
            return None, f"NVML gave no memory size for {name}: using the catalog default"
        local = LocalGPUs(count, name, memory, cat, links, intra)
        return local, (f"using the local GPUs: {count} x {name}, {memory / 2**30:.1f} GiB, "
                       f"{links} NVLink links" + ("" if cat else " (not in the catalog: H100 figures for time)"))
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


# -- what a flag implies about the rest of the hardware ------------------------------------------

GPU_MEMORY_MATCH = 0.08
"""`--gpu-mem X` names a catalog GPU when X is within 8% of its memory: the marketed size against
what the device reports (an "80GB" H100 shows 79.6 GiB, a "24GB" L4 22.5 GiB, a "48GB" L40S 45 GiB)."""

_GPU_PREFERENCE = ("h100-sxm", "h200", "b200", "a100-80gb", "a100-40gb", "l40s", "l4", "a10", "t4",
                   "v100-32gb", "v100-16gb", "mi300x", "mi250x")
"""The parts a memory size alone names, most common first. Variants (the PCIe cards, whose SXM twins have the
same memory; torchtitan's 96 GB HBM2e H100 at 500 W) are planned only when `--gpu` names them."""


def memory_matches(gpu_memory_bytes: int, memory_bytes: int) -> bool:
    """A size names a GPU of `gpu_memory_bytes` when within GPU_MEMORY_MATCH of it."""
    return abs(gpu_memory_bytes - memory_bytes) / memory_bytes <= GPU_MEMORY_MATCH


def gpu_for_memory(cat, memory_bytes: int, default: str) -> tuple[str, bool]:
    """(catalog GPU, matched) for `--gpu-mem` given without `--gpu`: the default GPU when its memory
    matches, else the closest of `_GPU_PREFERENCE` within GPU_MEMORY_MATCH (ties: the more common part), else
    (default, False): the default's FLOP/s and links with the given memory."""
    def off(e) -> float:
        return abs(e.memory_bytes - memory_bytes) / memory_bytes
    if memory_matches(cat.gpu(default).memory_bytes, memory_bytes):
        return cat.gpu(default).name, True
    rank = {n: i for i, n in enumerate(_GPU_PREFERENCE)}
    near = [e for e in cat.entries("gpus") if off(e) <= GPU_MEMORY_MATCH and e.name in rank]
    if not near:
        return cat.gpu(default).name, False
    best = min(near, key=lambda e: (round(off(e), 2), rank.get(e.name, len(rank)), e.name))
    return best.name, True


def default_nics(cat, inter_link: str, gpu_name: str, gpus_per_node: int) -> tuple[int, str]:
    """(NICs per node, why) when `--inter` is given without `--node`/`--nics-per-node`: what clusters
    built on that link have. A catalog node on the same link (and GPU, when one matches) gives its NIC
    count; otherwise RDMA fabrics (InfiniBand, RoCE, EFA) get one NIC per GPU, the rail-optimised
    design GPUDirect RDMA clusters use (NVIDIA DGX H100/A100 reference architectures: one ConnectX HCA
    per GPU), and TCP sockets one NIC per node (a commodity server's single uplink)."""
    nodes = [n for n in cat.entries("nodes") if n.inter_link == inter_link]
    if nodes:
        node = next((n for n in nodes if n.gpu == gpu_name), nodes[0])
        nics = max(1, round(node.nics_per_node * gpus_per_node / node.gpus_per_node))
        return nics, f"as catalog node {node.name}"
    link = cat.interconnect(inter_link)
    if link.kind == "tcp":
        return 1, "TCP clusters: one uplink per node"
    return gpus_per_node, "RDMA clusters: one NIC per GPU"
