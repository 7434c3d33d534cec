"""The strategy registry: one name, one implementation that `distplan validate` launches.

Each entry says what it shards, over which group, and which PyTorch-native implementation the planner
predicts (and the probes run). An unknown name raises `ValueError` listing the valid ones.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Strategy:
    name: str
    """Registry name, as typed on the command line."""
    shards_optimizer: bool
    """Optimizer state is split across the shard group."""
    shards_grads: bool
    """Gradients are reduce-scattered and kept only as a shard."""
    shards_params: bool
    """Parameters are kept only as a shard between uses (all-gathered per unit)."""
    reshard_after_forward: bool
    """Unsharded parameters are freed after each unit's forward (False keeps them to backward)."""
    shard_group: str
    """'world' (all ranks), 'node' (GPUs of one node; replicated across nodes) or 'none'."""
    implementation: str
    """What `distplan validate` launches."""
    family: str
    """'single', 'ddp', 'zero1', 'fsdp2' or 'fsdp1': which code path the memory/comm model follows."""
    offload: tuple = ()
    """CPU offload modes the implementation supports ('optimizer', 'params')."""
    description: str = ""


REGISTRY: dict[str, Strategy] = {s.name: s for s in (
    Strategy("single", False, False, False, False, "none", "plain nn.Module on one GPU", "single",
             description="No parallelism; every state on one GPU."),
    Strategy("ddp", False, False, False, False, "none", "torch.nn.parallel.DistributedDataParallel",
             "ddp", description="Full replica per GPU; gradients all-reduced in 25 MiB buckets."),
    Strategy("zero1", True, False, False, False, "world",
             "DDP + torch.distributed.optim.ZeroRedundancyOptimizer", "zero1",
             description="Optimizer state sharded; gradients all-reduced by DDP, updated params broadcast."),
    Strategy("zero2", True, True, True, False, "world",
             "FSDP2 fully_shard(reshard_after_forward=False) per block", "fsdp2", ("optimizer", "params"),
             description="Optimizer state and gradients sharded; parameters sharded at rest but kept unsharded "
                         "from forward to backward (ZeRO-2's traffic and peak)."),
    Strategy("zero3", True, True, True, True, "world", "FSDP2 fully_shard() per block", "fsdp2",
             ("optimizer", "params"),
             description="Parameters, gradients and optimizer state sharded; each block all-gathered when used."),
    Strategy("fsdp", True, True, True, True, "world",
             "FSDP1 FullyShardedDataParallel(FULL_SHARD), wrapped per block", "fsdp1", ("params",),
             description="FSDP1 flat parameters, sharded everywhere; resharded after forward and backward."),
    Strategy("fsdp-grad-op", True, True, True, False, "world", "FSDP1 SHARD_GRAD_OP, wrapped per block",
             "fsdp1", ("params",),
             description="FSDP1: gradients and optimizer sharded; parameters unsharded from forward to backward."),
    Strategy("hsdp", True, True, True, True, "node", "FSDP1 HYBRID_SHARD, wrapped per block", "fsdp1",
             ("params",),
             description="FULL_SHARD inside a node, replicated across nodes; gradients all-reduced across replicas."),
    Strategy("fsdp-no-shard", False, False, False, False, "none", "FSDP1 NO_SHARD, wrapped per block", "fsdp1",
             ("params",),
             description="FSDP1 without sharding: DDP-like all-reduce per wrapped unit."),
)}

NAMES = tuple(REGISTRY)


def get_strategy(name: str | Strategy) -> Strategy:
    """The registry's strategy by name (a Strategy is returned as it is)."""
    if name.__class__ is Strategy:
        return name
    st = REGISTRY.get(name) if isinstance(name, str) else None  # the common case: an exact registry name
    if st is not None:
        return st
    if isinstance(name, Strategy):
        return name
    key = name.strip().lower() if isinstance(name, str) else None
    if key not in REGISTRY:
        from .units import short_repr
        raise ValueError(f"unknown strategy {short_repr(name)}; accepted: {', '.join(NAMES)}")
    return REGISTRY[key]
