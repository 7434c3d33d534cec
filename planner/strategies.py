"""The strategy registry: one name, one implementation that `distplan validate` launches.

Each entry says what it shards, over which group, and which PyTorch-native implementation the planner
predicts (and the probes run). An unknown name raises `ValueError` listing the valid ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from .units import short_repr

# The code paths (`Strategy.family`) the memory, event and communication models follow. Code outside this
# module compares a family with these names, or better asks a Strategy for a capability (below), and never
# spells a strategy's name.
SINGLE = "single"
"""The plain module on one device: no wrapper, no collectives."""
DDP = "ddp"
"""`DistributedDataParallel`: a full replica, gradients all-reduced in buckets by DDP's Reducer."""
ZERO1 = "zero1"
"""DDP plus `ZeroRedundancyOptimizer`: DDP's buckets, the optimizer state sharded, parameters broadcast."""
FSDP1 = "fsdp1"
"""`FullyShardedDataParallel` (FSDP1): one FlatParameter per wrapped unit, sharded per its strategy."""
FSDP2 = "fsdp2"
"""`fully_shard` (FSDP2): per-parameter DTensor shards, all-gathered per unit."""
FAMILIES = (SINGLE, DDP, ZERO1, FSDP1, FSDP2)


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

    @property
    def distributed(self) -> bool:
        """Wrapped for more than one rank (everything but `single`)."""
        return self.family != SINGLE

    @property
    def ddp_reducer(self) -> bool:
        """Gradients all-reduced by DDP's Reducer in buckets (DDP and ZeRO-1)."""
        return self.family in (DDP, ZERO1)

    @property
    def fsdp(self) -> bool:
        """Wrapped by FSDP, either version (FSDP1 or FSDP2)."""
        return self.family in (FSDP1, FSDP2)

    @property
    def fsdp1(self) -> bool:
        """FSDP1's FlatParameter per wrapped unit."""
        return self.family == FSDP1

    @property
    def fsdp2(self) -> bool:
        """FSDP2's `fully_shard`, per-parameter shards."""
        return self.family == FSDP2

    @property
    def zero_optimizer(self) -> bool:
        """The optimizer state sharded by `ZeroRedundancyOptimizer` over DDP (ZeRO-1)."""
        return self.family == ZERO1

    @property
    def hybrid(self) -> bool:
        """Sharded inside a node and replicated across nodes (HYBRID_SHARD)."""
        return self.shard_group == "node"

    @property
    def fsdp_no_shard(self) -> bool:
        """FSDP wrapping without sharding anything (FSDP1 NO_SHARD): all-reduce per unit."""
        return self.fsdp and self.shard_group == "none"

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage whose sharding this matches (DeepSpeed's `zero_optimization.stage`): 1 the optimizer
        state (ZeRO-1 over DDP), 2 also the gradients (FSDP2 kept unsharded to backward), 3 also the parameters
        (FSDP2 resharded after forward); 0 for the others."""
        if self.zero_optimizer:
            return 1
        if self.fsdp2:
            return 3 if self.reshard_after_forward else 2
        return 0

    @property
    def fsdp1_shard_grad_op(self) -> bool:
        """FSDP1 SHARD_GRAD_OP: sharded, but a unit's parameters kept unsharded from forward to backward."""
        return self.fsdp1 and self.shards_params and not self.reshard_after_forward

    @property
    def deepspeed_zero(self) -> bool:
        """A ZeRO stage DeepSpeed runs under framework='deepspeed' (ZeRO-1, and the FSDP2 pair ZeRO-2/3)."""
        return self.zero_stage > 0


REGISTRY: dict[str, Strategy] = {s.name: s for s in (
    Strategy("single", False, False, False, False, "none", "plain nn.Module on one GPU", SINGLE,
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
        raise ValueError(f"unknown strategy {short_repr(name)}; accepted: {', '.join(NAMES)}")
    return REGISTRY[key]
