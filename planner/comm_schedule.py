"""The collectives of one optimizer step (`collective_schedule`): the strategy's own (comm.py's cached,
timed schedule), composed with tensor parallelism (tp.py), context parallelism (cp.py) and the
pipeline's point-to-point traffic (pp_stage.py) over their mesh dimensions. Above comm, tp, cp and pp so
that each of them imports downward only."""

from __future__ import annotations

from .comm import (DDP_BUCKET_CAP_MB, FSDP2_ROOT_RESHARD_EXPLICIT, Collective, Schedule, _schedule_key, _timed_schedule,
                   schedule_totals, timed_collectives)
from .config import Cluster, TrainConfig
from .cp import cp_raw_schedule, cp_view
from .model import TPRankSpec
from .pp import fsdp2_gathers_once
from .pp_stage import pp_cluster, pp_raw_schedule, stage_train
from .strategies import Strategy, get_strategy
from .tp import tp_raw_schedule, tp_view


def collective_schedule(train: TrainConfig, cluster: Cluster, strategy: str | Strategy, *,
                        ddp_bucket_cap_mb: int | None = DDP_BUCKET_CAP_MB,
                        fsdp2_root_reshard_explicit: bool = FSDP2_ROOT_RESHARD_EXPLICIT) -> list[Collective]:
    """The collectives of one optimizer step on the most loaded rank (all ranks issue the same ones).

    `strategy` is a registry name (or its `Strategy`). Steady state (the second and later steps). Identical calls are
    merged; `calls` counts all grad_accum micro-steps. Times use the cluster's links (catalog, cached).
    """
    s = get_strategy(strategy)
    if train.cp > 1 and not train._cp_local:
        return _cp_schedule(train, cluster, s, ddp_bucket_cap_mb, fsdp2_root_reshard_explicit)
    if train.pp > 1:
        return _pp_schedule(train, cluster, s, ddp_bucket_cap_mb, fsdp2_root_reshard_explicit)
    if train.tp > 1 and not isinstance(train.model, TPRankSpec):  # a `tp_view` has the dp part only
        return _tp_schedule(train, cluster, s, ddp_bucket_cap_mb, fsdp2_root_reshard_explicit)
    key = _schedule_key(train, s.name, cluster.gpus, cluster.local_size, cluster.nodes,
                        ddp_bucket_cap_mb, fsdp2_root_reshard_explicit)
    collectives, totals = _timed_schedule(key, cluster)
    return Schedule(collectives, totals)


def _tp_schedule(train: TrainConfig, cluster: Cluster, s: Strategy, cap, root_explicit) -> "Schedule":
    """With tensor parallelism (`tp.py`): the strategy's collectives over the data-parallel mesh
    dimension (group 'world' of the dp ranks named 'dp'; 'intra_node'/'inter_node' as they are, inside
    the dp dimension), then the TP group's ('tp', on the intra-node link)."""
    rtrain, dp = tp_view(train, cluster)
    out = []
    if s.distributed:
        key = _schedule_key(rtrain, s.name, dp.gpus, dp.local_size, dp.nodes, cap, root_explicit)
        out = [c._replace(group="dp") if c.group == "world" else c for c in _timed_schedule(key, dp)[0]]
    out += timed_collectives(tp_raw_schedule(train, s.family), cluster)
    return Schedule(out, schedule_totals(out))


def _cp_schedule(train: TrainConfig, cluster: Cluster, s: Strategy, cap, root_explicit) -> "Schedule":
    """With context parallelism (`cp.py`): one cp rank's schedule (sequences of s / cp tokens; the
    strategy's group, named 'dp_cp', is the dp x cp ranks, as torchtitan's FSDP mesh `dp_shard_cp`), then
    the cp group's ring collectives ('cp': its ranks at stride tp, so a node holds gpus_per_node / tp
    of them)."""
    view = cp_view(train)
    out = [c._replace(group="dp_cp") if c.group in ("world", "dp") else c
           for c in collective_schedule(view, cluster, s, ddp_bucket_cap_mb=cap, fsdp2_root_reshard_explicit=root_explicit)]
    cpc = cluster
    if train.tp > 1:
        cpc = tp_view(train, cluster)[1]
    out += timed_collectives(cp_raw_schedule(view, s.family), cpc)
    return Schedule(out, schedule_totals(out))


def _pp_schedule(train: TrainConfig, cluster: Cluster, s: Strategy, cap, root_explicit) -> "Schedule":
    """With pipeline parallelism (`pp.py`): the strategy's collectives over one stage's data-parallel
    ranks (group 'dp'; the stage with the most parameters, its M micro-batches accumulated as DDP's
    `no_sync` / FSDP's `set_requires_gradient_sync(False)` do), the TP group's for that stage's layers
    ('tp'), and the point-to-point sends and receives between stages ('pp')."""
    views = [stage_train(train, 0), stage_train(train, train.pp - 1)]
    view = max(views, key=lambda t: t.model.param_count())
    dpc = cluster
    if train.tp > 1:
        dpc = tp_view(train, cluster)[1]
    dpc = pp_cluster(train, dpc)
    out = []
    if s.distributed and dpc.gpus > 1:
        key = _schedule_key(view, s.name, dpc.gpus, dpc.local_size, dpc.nodes, cap, root_explicit)
        out = [c._replace(group="dp") if c.group == "world" else c for c in _timed_schedule(key, dpc)[0]]
        if s.fsdp2:
            out = fsdp2_gathers_once(out, train.pp_microbatches, train, 0 if view is views[0] else train.pp - 1,
                                     dpc.gpus)
    if train.tp > 1:  # the embedding's and the head's TP collectives only on the stages that hold them
        m = view.model
        raw = [c for c in tp_raw_schedule(view, s.family)
               if not (c[7] == "tp_embed" and not m.pp_first or c[7] == "tp_head" and not m.pp_last)]
        out += timed_collectives(raw, cluster)
    out += timed_collectives(pp_raw_schedule(train, s.family), cluster)
    return Schedule(out, schedule_totals(out))
