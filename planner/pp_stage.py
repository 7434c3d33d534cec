"""One pipeline stage as a training configuration of its own: its model (`PPStageSpec`: its layers, the
embedding on the first stage, the head on the last), its TrainConfig (`stage_train`: pp = 1, the
micro-batches as the accumulation), its data-parallel cluster (`pp_cluster`), and the point-to-point
traffic between stages (`boundary_bytes`, `p2p_counts`, `pp_raw_schedule`). Used by the stage walks
(pp.py, alloc_trace.py) and the collective schedule (comm_schedule.py)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import lru_cache

from .activations import regime_for
from .model import ModelSpec, ParamGroup, TPRankSpec, _linear_weights
from .pp_schedule import rank_stage_ids, stage_layers, virtual_stages
from .strategies import DDP, ZERO1


def releases_sent_outputs(family: str, last: bool) -> bool:
    """Whether torch 2.15's `PipelineStage` drops a forward output once its send completes
    (`_output_slot_is_releasable`): not the last stage's, not a DDP-wrapped stage's (DDP, ZeRO-1)."""
    return not last and family not in (DDP, ZERO1)


@dataclass(frozen=True)
class PPStageSpec(TPRankSpec):
    """One pipeline stage of a (tensor-parallel rank's) model: `layers` is the stage's, the embedding
    only on the first stage, the final norm and LM head only on the last. Widths stay the model's."""

    pp_first: bool = True
    pp_last: bool = True

    def _build_units(self):
        embed, block, head = TPRankSpec._build_units(self)
        if not self.pp_first:
            embed = ParamGroup("embed", ())
        if not self.pp_last:
            head = ParamGroup("head", ())
        return embed, block, head

    def _count_params(self) -> int:
        embed, block, head = self.units()
        return embed.numel + self.layers * block.numel + head.numel

    def linear_weights(self) -> tuple[int, int]:
        block, _ = _linear_weights(self)
        return block, (-(-self.vocab // self.tp) * self.hidden if self.pp_last else 0)

    def to_dict(self) -> dict:
        d = TPRankSpec.to_dict(self)
        d.pop("pp_first")
        d.pop("pp_last")
        return d


@lru_cache(maxsize=1024)
def stage_spec(spec: ModelSpec, tp: int, layers: int, first: bool, last: bool) -> PPStageSpec:
    kw = {f.name: getattr(spec, f.name) for f in fields(ModelSpec)}
    kw["layers"] = layers
    return PPStageSpec(**kw, tp=tp, pp_first=first, pp_last=last)


def stage_train(train, stage: int, *, time_view: bool = False):
    """The TrainConfig of one stage: its `PPStageSpec`, pp = 1, grad_accum = M (the micro-batches are
    the accumulation: DDP's `no_sync`, FSDP's `set_requires_gradient_sync(False)` until the last one).
    `time_view`: the slowest stage for the time model: ceil(L/p) layers, the head and the embedding."""
    p = train.pp
    v = virtual_stages(train.pp_schedule)
    m = train.model
    if time_view:
        spec = stage_spec(m, train.tp, -(-m.layers // p), True, True)
    else:
        sids = rank_stage_ids(train.pp_schedule, p, stage)
        layers = sum(stage_layers(m.layers, p * v, sid) for sid in sids)
        spec = stage_spec(m, train.tp, layers, 0 in sids, p * v - 1 in sids)
    # torch.distributed.pipelining's stage (`_PipelineStageBase.backward_maybe_with_nosync`) runs every
    # micro-batch but the last under DDP's `no_sync()` / FSDP's `set_requires_gradient_sync(False)`.
    return replace(train, model=spec, pp=1, pp_schedule="1f1b", pp_microbatches=1,
                   grad_accum=train.pp_microbatches, grad_sync="last")


def pp_cluster(train, cluster):
    """The cluster one pipeline stage's data-parallel x tensor-parallel ranks see: gpus / pp GPUs, the
    same nodes' links (torchtitan's mesh puts pp outermost, so a stage's dp x tp ranks are contiguous)."""
    p = train.pp
    g = cluster.local_size
    gpus = cluster.gpus // p
    return replace(cluster, gpus=gpus, gpus_per_node=min(g, gpus))


# -- communication ----------------------------------------------------------------------------------

def boundary_bytes(train, family: str = DDP) -> int:
    """Bytes of the tensor crossing a stage boundary for one micro-batch: the residual stream
    (b, s, h) in its dtype (fp32 under fp32 and autocast; 16-bit for a 16-bit model and under FSDP2's
    `MixedPrecisionPolicy(param_dtype)`), / tp with sequence parallelism (each TP rank sends its
    sequence shard)."""
    res = 4 if _res_dtype(train, family) == "float32" else 2
    s = -(-train.seq_len // train.tp) if train.sequence_parallel else train.seq_len
    return train.micro_batch * s * train.model.hidden * res


def _res_dtype(train, family: str) -> str:
    if regime_for(train, family) in ("fp32", "autocast"):
        return "float32"
    return "bfloat16" if train.precision in ("bf16", "bf16-mixed") else "float16"


def p2p_counts(train, rank: int) -> tuple[int, int, int, int]:
    """(activation sends, gradient sends, activation receives, gradient receives) of pipeline rank
    `rank` per step: each of its stages j (`rank_stage_ids`) sends its output forward unless it is
    the last stage and its input's gradient backward unless it is the first, M times each
    (`PipelineStage.get_fwd_send_ops` / `get_bwd_send_ops`; the receives mirror them)."""
    p, M = train.pp, train.pp_microbatches
    v = virtual_stages(train.pp_schedule)
    S = p * v
    stages = rank_stage_ids(train.pp_schedule, p, rank)
    # a neighbour on the same rank (zbv's stages p - 1 and p) is handed its tensor without a send
    not_last = sum(j != S - 1 and j + 1 not in stages for j in stages)
    not_first = sum(j != 0 and j - 1 not in stages for j in stages)
    return M * not_last, M * not_first, M * not_first, M * not_last


def pp_raw_schedule(train, family: str = DDP) -> tuple:
    """The pp group's point-to-point traffic of the busiest pipeline rank per optimizer step, as
    (op, group, group_size, dtype, message_bytes, calls, phase, unit) tuples (`p2p_counts`); every
    message is one micro-batch's boundary tensor (`boundary_bytes`)."""
    msg = boundary_bytes(train, family)
    dt = _res_dtype(train, family)
    counts = max((p2p_counts(train, r) for r in range(train.pp)), key=sum)
    af, gb, ar, gr = counts
    out = [("send", "pp", train.pp, dt, msg, af, "forward", "pp_activation"),
           ("recv", "pp", train.pp, dt, msg, ar, "forward", "pp_activation"),
           ("send", "pp", train.pp, dt, msg, gb, "backward", "pp_gradient"),
           ("recv", "pp", train.pp, dt, msg, gr, "backward", "pp_gradient")]
    return tuple(c for c in out if c[5])
