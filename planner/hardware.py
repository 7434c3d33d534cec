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
