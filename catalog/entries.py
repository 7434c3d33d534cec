"""The catalog's entry types (GPU, Interconnect, Node, ModelEntry), as `load_catalog` builds them from the
YAML files, and the one error every catalog problem raises (`CatalogError`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


class CatalogError(ValueError):
    """A catalog file or lookup is invalid; the message is one line naming the file and key."""


def _short(value, limit: int = 60) -> str:
    """repr(value) cut to `limit` characters: an error never prints a whole (hostile) value."""
    if isinstance(value, str) and len(value) > 4 * limit:
        value = value[: 4 * limit]
    if isinstance(value, (list, tuple, dict, set)) and len(value) > limit:
        return f"<a {type(value).__name__} of {len(value):,} items>"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4 * limit:
        return f"<an integer of about {int(value.bit_length() * 0.30103):,} digits>"
    try:
        r = repr(value)
    except Exception:  # a nested value too deep or too large to print
        r = f"<a {type(value).__name__}>"
    return r if len(r) <= limit else r[: limit - 3] + "..."


# -- entry types ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class GPU:
    """One accelerator as PyTorch sees it (one device = one rank)."""

    name: str
    """Catalog name (the file stem), e.g. 'h100-sxm'."""
    aliases: tuple[str, ...]
    """Other names accepted by lookups (case-insensitive)."""
    vendor: str
    """'nvidia' or 'amd'."""
    memory_bytes: int
    """Device memory as the vendor states it, in bytes (a 'GB' figure is 1e9, a 'GiB' one 2^30)."""
    hbm_bytes_per_s: float
    """Peak device-memory bandwidth, bytes/s."""
    flops: dict[str, float]
    """Dense (no sparsity) peak throughput per dtype ('fp32', 'tf32', 'fp16', 'bf16'), FLOP/s."""
    matmul_efficiency: float
    """Achievable dense matmul FLOP/s divided by the peak (ml-engineering MAMF table or a stated assumption)."""
    scale_up_link: str
    """Interconnect name of the GPU-to-GPU link inside a node (e.g. 'nvlink4', 'pcie4')."""
    nvlink_links: int | None
    """NVLink links per GPU, where the GPU has NVLink."""
    source: tuple[str, ...]
    """Where the figures come from."""
    notes: str = ""
    """Assumptions and caveats."""
    path: str = ""
    """The file this entry was read from."""
    # -- the per-kernel time model (planner/kernels.py); `distplan calibrate` measures each on a device --
    matmul_half_efficiency_flop: float = 20e9
    """GEMM size 2*m*n*k (FLOP) at which a GEMM runs at half the large-GEMM rate: rate(F) =
    peak x matmul_efficiency x F / (F + this). Small GEMMs lose to tile and wave quantization."""
    hbm_efficiency: float = 0.85
    """Achievable bandwidth of a large memory-bound kernel (copy, elementwise) / hbm_bytes_per_s."""
    attention_efficiency: float = 0.35
    """Flash-attention forward FLOP/s (causal FLOPs counted) / dense peak of the compute dtype."""
    attention_backward_efficiency: float = 0.30
    """Flash-attention backward FLOP/s / dense peak (the backward does 2.5x the forward's matmuls)."""
    kernel_overhead_s: float = 4e-6
    """GPU time a kernel costs beyond its work (launch gap, ramp-up and tail), seconds."""
    host_op_s: float = 16.7e-6
    """Host time per ATen op of an eager training step (Python, dispatch, launch; `kernels.host_ops`
    counts the ops): the step cannot run faster than its ops can be issued. A property of the host and
    the PyTorch build more than of the GPU. Default: measured on the H100 machine of
    benchmarks/results/h100-torch2.11-2026-11-23.jsonl (torch 2.11, CUDA 13): its six host-bound
    single-GPU probes (the reference decoder, 4 layers, 512 tokens) took 15.2-23.1 ms per step for
    the 950-1,270 ops kernels.host_ops counts for them, 14.2-19.0 us per op, geometric mean 16.7 us.
    `distplan calibrate` measures it the same way on the user's machine."""
    sm_count: int | None = None
    """Streaming multiprocessors (NVIDIA) or compute units (AMD) of one device, as
    `torch.cuda.get_device_properties(i).multi_processor_count` reads it: the SMs an NCCL kernel's CTAs
    (one per channel) take from the GEMMs it overlaps (planner/compute.py `sm_shares`). None: unknown, no
    contention modelled."""

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for `dtype`; CatalogError naming the dtypes this GPU has."""
        try:
            return self.flops[dtype]
        except KeyError:
            raise CatalogError(
                f"gpu '{self.name}' has no {_short(dtype)} throughput; known: {', '.join(sorted(self.flops))}"
            ) from None

    def achievable_flops(self, dtype: str) -> float:
        """peak_flops(dtype) x matmul_efficiency."""
        return self.peak_flops(dtype) * self.matmul_efficiency

    def to_dict(self) -> dict:
        return _to_dict(self)


@dataclass(frozen=True)
class Interconnect:
    """One link technology: per GPU (intra-node) or per NIC (inter-node), one direction."""

    name: str
    """Catalog name, e.g. 'nvlink4', 'ib-ndr'."""
    aliases: tuple[str, ...]
    """Other names accepted by lookups."""
    kind: str
    """One of nvlink, pcie, infiniband, roce, tcp, xgmi."""
    tier: str
    """'intra_node' or 'inter_node'."""
    line_rate_bytes_per_s: float
    """Line rate, one direction, bytes/s (per GPU intra-node, per NIC inter-node)."""
    busbw_efficiency: float
    """Achievable NCCL bus bandwidth for large messages / line rate (nccl-tests `busbw`)."""
    latency_s: float
    """Per-step latency (alpha) of a collective, seconds."""
    half_efficiency_bytes: float
    """Message size at which achieved bandwidth is half the large-message one: eff(S) = S / (S + this)."""
    source: tuple[str, ...]
    """Where the figures come from."""
    notes: str = ""
    """Assumptions and caveats."""
    path: str = ""
    """The file this entry was read from."""
    nvls_busbw_bytes_per_s: float = 0.0
    """8-GPU all-reduce bus bandwidth with NVLS (NVLink SHARP, in-switch reduction), nccl-tests `busbw`,
    bytes/s; 0: the switch has no NVLS (NCCL's NVLS algorithm needs NVLink4+ NVSwitch multicast)."""
    nvls_latency_s: float = 0.0
    """Fixed latency of an NVLS all-reduce beyond the launch overhead, seconds (NCCL src/graph/tuning.cc
    hwLatencies NVLINK NVLS Simple: 25 us)."""
    simple_protocol_only: bool = False
    """NCCL runs only its Simple protocol over this link, no LL/LL128 (EFA: no in-order byte delivery)."""
    ring_only: bool = False
    """The platform's tuner plugin keeps inter-node collectives on NCCL's ring (AWS's ofi tuner on EFA)."""
    scale_out_loss: float = 0.0
    """Relative loss of inter-node bus bandwidth per doubling of the node count beyond 2 (congestion,
    adaptive routing): efficiency(k) = busbw_efficiency x (1 - this) ** log2(k / 2)."""

    @property
    def busbw_bytes_per_s(self) -> float:
        """Large-message NCCL bus bandwidth: line rate x busbw_efficiency, bytes/s."""
        return self.line_rate_bytes_per_s * self.busbw_efficiency

    def efficiency_at(self, message_bytes: float) -> float:
        """Size-dependent fraction of the large-message bus bandwidth: S / (S + S_half)."""
        if message_bytes <= 0:
            return 0.0
        return message_bytes / (message_bytes + self.half_efficiency_bytes)

    def to_dict(self) -> dict:
        d = _to_dict(self)
        d["busbw_bytes_per_s"] = self.busbw_bytes_per_s
        return d


@dataclass(frozen=True)
class Node:
    """A node type: N GPUs of one kind, an intra-node link and NICs to the other nodes."""

    name: str
    """Catalog name, e.g. 'dgx-h100'."""
    aliases: tuple[str, ...]
    """Other names accepted by lookups."""
    gpu: str
    """GPU catalog name."""
    gpus_per_node: int
    """GPUs (ranks) per node."""
    intra_link: str
    """Interconnect name inside the node (tier intra_node)."""
    inter_link: str
    """Interconnect name of one NIC between nodes (tier inter_node)."""
    nics_per_node: int
    """Compute NICs per node (storage NICs not counted)."""
    source: tuple[str, ...]
    """Where the figures come from."""
    notes: str = ""
    """Assumptions and caveats."""
    path: str = ""
    """The file this entry was read from."""
    host_memory_bytes: int = 0
    """The node's CPU memory (what CPU offload holds parameters, gradients and optimizer state in);
    0 where the catalog does not say."""

    def to_dict(self) -> dict:
        return _to_dict(self)


@dataclass(frozen=True)
class ModelEntry:
    """A published model architecture; `arch` holds ModelSpec keyword arguments."""

    name: str
    """Catalog name, e.g. 'llama-2-7b'."""
    aliases: tuple[str, ...]
    """Other names accepted by lookups (e.g. the Hugging Face repo id)."""
    arch: dict[str, Any]
    """ModelSpec field name -> value: layers, hidden, heads, kv_heads, ffn_hidden, vocab,
    max_positions, mlp, norm, position, tie_embeddings, linear_bias, qkv_bias."""
    params_published: int | None
    """Parameter count as published / as computed by Hugging Face for this config."""
    source: tuple[str, ...]
    """Where the figures come from (the official config.json)."""
    notes: str = ""
    """Assumptions and caveats."""
    path: str = ""
    """The file this entry was read from."""

    def spec_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `distplan.planner.model.ModelSpec` (arch + name + source)."""
        return {"name": self.name, **self.arch, "source": "; ".join(self.source)}

    def to_dict(self) -> dict:
        return _to_dict(self)


def _to_dict(entry) -> dict:
    d = asdict(entry)
    for k, v in d.items():
        if isinstance(v, tuple):
            d[k] = list(v)
    return d
