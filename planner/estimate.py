"""A strategy's per-rank memory answer (`MemoryEstimate`: components, peak, phase, the allocator's reserved
peak replayed on demand) and the fixed per-process workspaces (cuBLAS, cuBLASLt, rocBLAS) it counts.
The walks that fill it are memory.py's `estimate_memory`, pp.py's `stage_memory` and deepspeed.py's."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from .alloc_trace import reserved_peak, reserved_peak_below, reserved_peak_within
from .allocator import alloc_rounding, parse_alloc_conf, replay_fit, replay_peaks
from .config import TrainConfig
from .footprint import DeviceFootprint
from .stage_trace import stage_reserved_peak, stage_reserved_peak_within


COMPONENTS = ("params", "grads", "optimizer", "activations", "comm_buffers", "temporaries")

# cuBLAS workspace per (handle, stream), from `parseChosenWorkspaceSize` in
# aten/src/ATen/cuda/CublasHandlePool.cpp: ":4096:8" (32 MiB) on compute capability 9.x-12.x (Hopper,
# Blackwell), ":4096:2:16:8" otherwise; on ROCm 32 MiB, 128 MiB on gfx942/gfx950 (MI300X, MI350).
CUBLAS_WORKSPACE_LARGE = 4096 * 8 * 1024
CUBLAS_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8
ROCBLAS_WORKSPACE_DEFAULT = 32 * 2**20
ROCBLAS_WORKSPACE_GFX942 = 128 * 2**20
CUBLASLT_WORKSPACE_BYTES = 1024 * 1024
"""`getCUDABlasLtWorkspace()`: CUBLASLT_WORKSPACE_SIZE default 1024 KiB, per thread that runs an addmm with
a bias through cuBLASLt (measured on torch 2.11 + H100: a separate 1 MiB block beside the cuBLAS one)."""
_LARGE_WORKSPACE_GPUS = ("h100", "h200", "h800", "h20", "gh200", "b100", "b200", "b300", "gb200", "gb300",
                         "blackwell", "rtx 5050", "rtx 5060", "rtx 5070", "rtx 5080", "rtx 5090")
"""Names of compute capability 9.x-12.x parts (Hopper, Blackwell); "RTX 5000 Ada" is 8.9 and not here."""
_GFX942_GPUS = ("mi300", "mi325", "mi350", "mi355")


@dataclass
class Snapshot:
    phase: str
    parts: dict

    @property
    def total(self) -> int:
        return sum(self.parts.values())


RESERVED_MARGIN = 0.10
"""Where no allocation trace is written (`--module` under FSDP and outside alloc_trace.logged_step_events'
runs, `--hf-config` traces the analytic front end cannot
pair, see module_plan.analytic_twins; DeepSpeed, ZeRO-1 pipeline stages and FSDP2 stages on one rank,
interleaved and zero-bubble schedules, autocast under pipelining, models over alloc_trace.MAX_LAYERS):
the reserved peak is the allocated peak plus this margin, and `reserved_source` says so."""


@dataclass(slots=True)
class MemoryEstimate:
    """Per-rank memory of one strategy: the components at the peak, and what surrounds them.

    `peak_reserved` is what `torch.cuda.max_memory_reserved` should read: the caching allocator's
    segments, from replaying the run's allocations (alloc_trace.py), computed on first use (a replay costs
    milliseconds to a tenth of a second for a 100-layer model, so sweeps only pay for configurations whose
    allocated peak fits). `device_total` adds `process_overhead`, the CUDA context and NCCL's
    communicators (footprint.py, itemised in `footprint`): what the process holds on the device, the
    number the OOM line is drawn against."""

    strategy: str
    components: dict
    peak_allocated: int
    peak_phase: str
    process_overhead: int
    gpu_memory_bytes: int
    notes: list = field(default_factory=list)
    workspace: int = 0
    """cuBLAS/cuBLASLt workspaces (CUDA only), included in `peak_allocated`, in no component."""
    reserved_replay: tuple | None = None
    """Arguments of alloc_trace.reserved_peak, or ("pp-stage", arguments of alloc_trace.stage_reserved_peak)
    for a pipeline stage, or ("events", the events, the alloc conf) for a traced module (alloc_trace.logged_step_events);
    None: `RESERVED_MARGIN` over the allocated peak."""
    footprint: DeviceFootprint | None = None
    """The parts of `process_overhead` (footprint.py); None where an estimate was built without it."""
    reserved_from: "MemoryEstimate | None" = None
    """The trace front end of a Hugging Face model (module_plan.py): the analytic front end's estimate of
    the same model and run, whose replayed cached-but-free bytes at the reserved peak (its peak_reserved -
    peak_allocated) this estimate adds to its own allocated peak; None: not used."""
    host_bytes: int = 0
    """CPU offload: the node's CPU memory that its ranks' parameters, gradients and optimizer state take."""
    host_memory_bytes: int = 0
    """The node's CPU memory (Cluster.host_memory_bytes); 0: not known, `host_bytes` not checked."""
    alloc_retries: int = 0
    """Times the replayed run releases the caching allocator's cache to fit on this GPU (what
    `torch.cuda.memory_stats()["num_alloc_retries"]` counts; each a synchronize and cudaFree/cudaMalloc):
    0 where the reserved peak fits without it (allocator.CachingAllocator.capacity)."""
    _reserved: int | None = None
    _fit: bool | None = None

    @property
    def reserved_source(self) -> str:
        if self.reserved_replay is not None:
            return "allocator replay"
        if self.reserved_from is not None:
            return "allocator replay of the analytic front end"
        return f"{RESERVED_MARGIN:.0%} margin"

    @property
    def peak_reserved(self) -> int:
        if self._reserved is None:
            if self.reserved_from is not None:
                # the caching allocator's cached-but-free bytes of the same allocations; reserved bytes are
                # whole segments, each a multiple of kSmallBuffer = 2 MiB (allocator.allocation_size)
                # (the two allocated peaks agree within module_plan.TWIN_TOLERANCE: their difference moves
                # the reserved peak by as many whole segments)
                f, seg = self.reserved_from, 2 << 20
                shift = seg * round((self.peak_allocated - f.peak_allocated) / seg)
                self._reserved = max(f.peak_reserved + shift, seg * -(-self.peak_allocated // seg))
                self.alloc_retries = f.alloc_retries  # the analytic run's, on the same GPU
            elif self.reserved_replay is None:
                self._reserved = int((1 + RESERVED_MARGIN) * self.peak_allocated)
            else:
                if self._fit is None and self.allocated_fits:
                    self._replay_on_device()  # the run on this GPU: its reserved peak where it fits
                if self._reserved is None:  # does not fit: what it would reserve on a device without a limit
                    args = self.reserved_replay
                    if args[0] == "events":
                        self._set_replayed(*replay_peaks(args[1], **_replay_options(args[2])))
                    else:
                        self._set_replayed(*(stage_reserved_peak(*args[1:]) if args[0] == "pp-stage"
                                             else reserved_peak(*args)))
        return self._reserved

    def _replay_on_device(self) -> None:
        """Replay the run with the caching allocator limited to this GPU less the process overhead
        (alloc_trace.reserved_peak_within): where it fits, possibly by releasing its cache, the reserved peak
        is that run's, as `max_memory_reserved` would read it on this GPU; else `_fit` is False."""
        args = self.reserved_replay
        limit = self.gpu_memory_bytes - self.process_overhead
        if args[0] == "events":  # a traced module's own events (alloc_trace.logged_step_events), its alloc conf
            got = replay_fit(args[1], limit, **_replay_options(args[2]))
        else:
            got = (stage_reserved_peak_within(limit, *args[1:]) if args[0] == "pp-stage"
                   else reserved_peak_within(limit, *args))
        self._fit = got is not None
        if got is not None:
            self._set_replayed(got[0], got[1])
            if self.device_total > self.gpu_memory_bytes:  # the walk's excess over the trace passes the line
                self._fit, self._reserved = False, None
                return
            self.alloc_retries = got[2]
            if got[2]:
                self.notes.append(f"{self.strategy}: fits by the caching allocator releasing its cached segments "
                                  f"{got[2]} time(s) in the replayed warm-up and measured steps (a cudaMalloc "
                                  f"that fails is retried after release_cached_blocks; "
                                  f"torch.cuda.memory_stats()['num_alloc_retries']): slower steps")

    def _set_replayed(self, replayed: int, allocated: int) -> None:
        # The trace is written from the same sizes as this walk, but not byte for byte: where it
        # allocates less than the walk's peak, the difference is still reserved.
        seg = 2 << 20
        self._reserved = replayed + seg * -(-max(0, self.peak_allocated - allocated) // seg)

    @property
    def device_total(self) -> int:
        return self.peak_reserved + self.process_overhead

    @property
    def allocated_fits(self) -> bool:
        """The allocated peak and the process overhead fit: necessary for `fits` (reserved >= allocated),
        and known without an allocator replay."""
        return (self.peak_allocated + self.process_overhead <= self.gpu_memory_bytes
                and not (self.host_memory_bytes and self.host_bytes > self.host_memory_bytes))

    @property
    def fits(self) -> bool:
        """The run fits this GPU: the allocated peak and the overhead do, and the replayed run does not run
        out of memory with the allocator limited to the GPU (a run whose reserved peak would pass the line
        may fit by releasing the allocator's cache: `alloc_retries`)."""
        if not self.allocated_fits:
            return False
        if self.reserved_replay is not None:
            if self._fit is None:
                self._replay_on_device()
            if not self._fit:
                return False
        return self.device_total <= self.gpu_memory_bytes

    @property
    def fits_cleanly(self) -> bool:
        """Fits without the allocator releasing its cache (`alloc_retries` 0): what `recommend` asks. Where
        the run has not been replayed on this GPU yet, a replay that stops at the first segment past the
        line answers a no (alloc_trace.reserved_peak_below) without finding out whether retries would save
        it."""
        if not self.allocated_fits:
            return False
        if self._fit is None and self.reserved_replay is not None and self.reserved_replay[0] not in ("pp-stage",
                                                                                                      "events"):
            got = reserved_peak_below(self.gpu_memory_bytes - self.process_overhead, *self.reserved_replay)
            if got is None:
                return False
            self._set_replayed(*got)  # the run without a limit stays below it: the run on this GPU
            self._fit = self.device_total <= self.gpu_memory_bytes
            if not self._fit:
                self._reserved = None
                return False
        return self.fits and not self.alloc_retries

    @property
    def total_required(self) -> int:
        return self.device_total

    @property
    def headroom(self) -> int:
        return self.gpu_memory_bytes - self.total_required

    def to_dict(self) -> dict:
        d = {k: int(self.components[k]) for k in COMPONENTS}
        d.update(workspace=int(self.workspace), peak_allocated=int(self.peak_allocated),
                 peak_reserved=int(self.peak_reserved), reserved_source=self.reserved_source,
                 alloc_retries=int(self.alloc_retries),
                 process_overhead=int(self.process_overhead), device_total=int(self.device_total))
        if self.footprint is not None:
            d["device_footprint"] = self.footprint.to_dict()
        return d


# -- library workspaces ------------------------------------------------------------------------------

@lru_cache(maxsize=64)
def cublas_workspace_bytes(gpu_name: str) -> int:
    """Bytes of one cuBLAS (rocBLAS) workspace on this GPU, as PyTorch sizes it by default."""
    g = (gpu_name or "").lower()
    if g.startswith("mi") or "instinct" in g or "amd" in g:
        return ROCBLAS_WORKSPACE_GFX942 if any(k in g for k in _GFX942_GPUS) else ROCBLAS_WORKSPACE_DEFAULT
    return CUBLAS_WORKSPACE_LARGE if any(k in g for k in _LARGE_WORKSPACE_GPUS) else CUBLAS_WORKSPACE_DEFAULT


def library_workspace_bytes(train: TrainConfig, gpu_name: str, linear_biases: bool | None = None) -> int:
    """cuBLAS/cuBLASLt workspaces a training step leaves allocated on a CUDA device.

    PyTorch keeps one cuBLAS workspace per (handle, stream) and one handle per thread
    (`cublas_handle_stream_to_workspace`): forward's matmuls run on the Python thread, backward's on
    autograd's device thread, so two workspaces live from the first step on (measured: 2 x 32 MiB on an
    H100, `validate/snapshot.py`). A Linear with a bias goes through cuBLASLt's `addmm`, which takes one
    more 1 MiB workspace on each thread that runs it: forward, and backward too when full activation
    checkpointing recomputes the block there. Not part of the six components: no tensor owns these
    bytes, so the probes' tracker does not see them, but `torch.cuda.max_memory_allocated` does.
    """
    if linear_biases is None:
        m = train.model
        linear_biases = bool(m.linear_bias or m.qkv_bias)
    lt = CUBLASLT_WORKSPACE_BYTES * (2 if train.checkpointing == "full" else 1) if linear_biases else 0
    return 2 * cublas_workspace_bytes(gpu_name) + lt


def _replay_options(conf: str) -> dict:
    """allocator.replay's keyword arguments for an alloc conf (`_alloc_conf`, allocator.alloc_rounding)."""
    expandable, max_split, _ = _alloc_conf(conf)
    return {"expandable_segments": expandable, "max_split_size": max_split, "rounding": alloc_rounding(conf)}


@lru_cache(maxsize=64)
def _alloc_conf(conf: str) -> tuple:
    """allocator.parse_alloc_conf of a TrainConfig's alloc_conf (validated when the config was made)."""
    return parse_alloc_conf(conf, "alloc_conf")
