"""Where the model's states live on one rank: the parameter layout per strategy family (`layout`), ZeRO-1's
partition of the parameters (`zero1_partition`, `zero1_owned_shapes`) and the optimizer state it owns
(`_opt_state`, `_all_state_elems`), in elements. Used by the memory walk (memory.py), the allocation
events (alloc_trace.py), the pipeline stages (pp.py) and DeepSpeed's estimate (deepspeed.py)."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from functools import lru_cache
from math import prod

from .model import ModelSpec, unit_sizes
from .precision import optimizer_state_elems
from .strategies import FSDP1, FSDP2, ZERO1

# -- parameter layout -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Element counts per rank for one (model, strategy, shard group) — cached."""

    total: int  # all parameters (unsharded)
    block: int  # one block, unsharded
    root: int  # embed + head (+ final norm), unsharded
    shard_total: int  # this rank's stored parameter elements (most loaded rank)
    shard_block: int  # one block's shard
    shard_root: int
    unshard_block: int  # one block as all-gathered (padded)
    unshard_root: int
    largest_param: int
    opt_owned: int  # ZeRO-1 with >1 rank: parameter elements whose optimizer state this rank holds; else 0


@lru_cache(maxsize=256)
def _size_runs(model: ModelSpec) -> tuple:
    """Every parameter as ZeroRedundancyOptimizer orders them, `sorted(params, key=numel, reverse=True)`
    (a stable sort: equal sizes keep registration order), grouped into runs of equal size:
    ((numel, (shape, shape, ...)), ...). Registration order is embed, block 0..L-1, head, and the blocks
    are identical, so a run is the embed's shapes of that size, then the block's L times, then the head's."""
    embed, block, head = ([s for _, s in u.params] for u in model.units())
    runs = []
    for n in sorted({prod(s) for s in embed + block + head}, reverse=True):
        pick = [tuple(s for s in shapes if prod(s) == n) for shapes in (embed, block, head)]
        runs.append((n, pick[0] + pick[1] * model.layers + pick[2]))
    return tuple(runs)


def zero1_partition(runs, ranks: int, shapes: bool = True) -> tuple[list[int], list[list[tuple]] | None]:
    """(elements per rank, shapes per rank or None when not `shapes`) of
    `ZeroRedundancyOptimizer._partition_parameters`.

    There each parameter, largest first, goes to the rank with the smallest total so far (the lowest
    rank among equal totals: `sizes.index(min(sizes))`). For a run of equal-size parameters that is
    the run's first m "slots" (total_r + j * numel, r), j = 0, 1, ..., in increasing order. The ranks
    whose totals lie within one parameter of the smallest (the band) take their slots in rounds of one
    parameter each, always in the same (total, rank) order, until the band reaches the next rank's
    total; so whole rounds are assigned at once with a slice, and a partition costs O(runs x ranks)
    rather than O(parameters x log ranks) (tests compare it with the one-at-a-time loop).
    """
    # Each rank as one int, total * ranks + rank: ascending order is the (total, rank) order slots are
    # taken in, and ints sort and compare much faster than (total, rank) tuples.
    R = ranks
    order = list(range(R))
    owned: list[list[tuple]] | None = [[] for _ in range(R)] if shapes else None
    for n, run in runs:
        m, pos, step = len(run), 0, n * R
        while pos < m:
            k = bisect_left(order, (order[0] // R + n) * R)  # the band: totals below the smallest + n
            band, rest = order[:k], order[k:]
            left = m - pos
            if left < k:  # one each to the first `left` of the band: their first slots come first
                if owned is not None:
                    for j, key in enumerate(band[:left]):
                        owned[key % R].append(run[pos + j])
                order = sorted([key + step for key in band[:left]] + band[left:] + rest)
                break
            rounds = left // k
            if rest:  # a round stays ahead of the next rank while the band's top slot is below its total
                rounds = min(rounds, -(-(rest[0] // R - band[-1] // R) // n))
            if owned is not None:
                for p, key in enumerate(band):
                    owned[key % R].extend(run[pos + p: pos + rounds * k: k])
            add = rounds * step
            order = sorted([key + add for key in band] + rest)  # two sorted runs: a linear merge
            pos += rounds * k
    totals = [0] * R
    for key in order:
        totals[key % R] = key // R
    return totals, owned


@lru_cache(maxsize=4096)
def layout(model: ModelSpec, family: str, shard: int, shards_params: bool, shards_optimizer: bool) -> Layout:
    root_shapes, block_shapes, root, block, largest = unit_sizes(model)
    total = model.param_count()

    if family == FSDP2:
        def fsdp2_shard(shapes):  # per-parameter dim-0 sharding, padded (FSDPParam._init_sharded_param)
            return sum(-(-s[0] // shard) * prod(s[1:]) for s in shapes)
        sb, sr = fsdp2_shard(block_shapes), fsdp2_shard(root_shapes)
        shard_total = sr + model.layers * sb
        ub, ur = sb * shard, sr * shard
        owned = 0
    elif family == FSDP1:
        def fsdp1_shard(n):  # one FlatParameter, padded to a multiple of the group (_flat_param.py)
            return -(-n // shard) if shards_params or shards_optimizer else n
        sb, sr = fsdp1_shard(block), fsdp1_shard(root)
        shard_total = sr + model.layers * sb
        ub = sb * shard if shards_params or shards_optimizer else sb
        ur = sr * shard if shards_params or shards_optimizer else sr
        owned = 0
    else:
        sb, sr, ub, ur = block, root, block, root
        shard_total = total
        owned = 0
        if family == ZERO1 and shard > 1:
            # ZeroRedundancyOptimizer._partition_parameters (zero1_partition): the most loaded rank.
            runs = _size_runs(model)
            if shard >= sum(len(run) for _, run in runs):
                # as many ranks as parameters: each parameter lands on an empty rank (independent of
                # the rank count, which may be 2**20)
                owned = max(n for n, _ in runs)
            else:
                owned = max(zero1_partition(runs, shard, shapes=False)[0])
    return Layout(total, block, root, shard_total, sb, sr, ub, ur, largest, owned)


@lru_cache(maxsize=256)
def zero1_owned_shapes(model: ModelSpec, ranks: int) -> tuple:
    """Shapes of the parameters whose optimizer state ZeroRedundancyOptimizer gives the most loaded
    rank (the first of equally loaded ones)."""
    totals, owned = zero1_partition(_size_runs(model), ranks)
    return tuple(owned[totals.index(max(totals))])


@lru_cache(maxsize=1024)
def _all_state_elems(model: ModelSpec, optimizer: str) -> tuple[int, float]:
    """optimizer_state_elems over every parameter: a sum over tensors, so the root's plus `layers` times
    one block's (the blocks are identical)."""
    embed, block, head = model.units()
    root = [s for u in (embed, head) for _, s in u.params]
    er, xr = optimizer_state_elems(optimizer, root)
    eb, xb = optimizer_state_elems(optimizer, [s for _, s in block.params])
    return er + model.layers * eb, xr + model.layers * xb


@lru_cache(maxsize=4096)
def _opt_state(model: ModelSpec, optimizer: str, family: str, shard: int) -> tuple[int, float]:
    """(state elements, extra bytes) held by the most loaded rank."""
    if family == ZERO1 and shard > 1:
        if optimizer == "adafactor":  # factored state: each tensor's shape matters
            return optimizer_state_elems(optimizer, list(zero1_owned_shapes(model, shard)))
        # Elementwise state (Adam's moments, momentum, 8-bit blocks): only the element count matters.
        return optimizer_state_elems(optimizer, [(layout(model, family, shard, False, True).opt_owned,)])
    if optimizer == "adafactor" and family == FSDP1:
        # FSDP1 (use_orig_params=False) steps one 1-D FlatParameter per unit, so Adafactor factors nothing: a
        # full `variance` per flat parameter (torch/optim/_adafactor.py `_init_group`: a tensor of fewer than
        # two dims). Measured: Qwen2.5-0.5B fsdp fp32 on 8 fake ranks, -5.1% when factored by the real shapes.
        lay = layout(model, family, shard, shard > 1, shard > 1)
        return (lay.shard_total if shard > 1 else lay.total), 0.0
    elems, extra = _all_state_elems(model, optimizer)
    if family in (FSDP2, FSDP1) and shard > 1:
        # Sharded flat/dim-0 shards: states are elementwise (Adam, momentum): shard elements.
        return -(-elems // shard), extra / shard
    return elems, extra
