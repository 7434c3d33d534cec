"""Pipeline-parallel probe: the reference decoder split into stages, run by `torch.distributed.pipelining`.

    torchrun --nproc-per-node=PP -m distplan.validate.pp_probe --spec SPEC.json --out RESULT.json

Spec: {"model": ModelSpec fields, "train": {"seq_len", "micro_batch", "optimizer", "optimizer_impl",
"checkpointing" (none, or full: non-reentrant `torch.utils.checkpoint` per block)},
"pp": stages, "dp": replicas (default 1), "cp": context-parallel ranks (default 1), "strategy": "single"
(dp x cp = 1) | "ddp" | "zero1" | "zero2" | "zero3", "schedule": "gpipe" | "1f1b" | "interleaved-1f1b" |
"interleaved-zb" | "zbv" (the zero-bubble schedules are measured here but not modelled by the planner yet),
"microbatches": M, "steps",
"warmup_steps"}. fp32 on the CPU (gloo), pp x dp x cp processes on the mesh (pp, dp, cp), pp outermost
as torchtitan lays it out (rank = stage x dp x cp + replica x cp + cp index); with ddp each stage is
wrapped in `DistributedDataParallel` over its dp x cp ranks (torchtitan's `dp_cp`), and `PipelineStage`
(over the pp group) runs it under `no_sync` until the last micro-batch. With cp > 1 every rank keeps the
head-tail positions of each sequence (`validate.cp.head_tail_indices`: tokens, targets and RoPE tables)
and the stage's attentions are ring attention over its cp group (`validate.cp.RingAttention`), so the
tensors crossing a stage boundary are (b, s/cp, h).

Each rank builds only its stage (torchtitan's manual split deletes the other stages' modules from a copy
of the model: the embedding off all but the first, norm and output off all but the last): the decoder
layers split evenly (the first `L mod pp` stages one more), the token
embedding on the first stage, the final norm and the LM head on the last; every stage computes its
RoPE tables in its own forward (the reference decoder's `rope_tables`). The loss is the reference
decoder's (cross-entropy over fp32 logits) as the schedule's `loss_fn`; `step(...,
return_outputs=False)` (the last stage's outputs are not merged for the caller). `PipelineStage` without example inputs (shapes inferred
from the first micro-batch, in the warm-up step).

Measured per rank, with `validate.measure.Tracker` (live storage bytes; the phase is set around each
`forward_one_chunk` / `backward_one_chunk` the schedule runs, so the interleaving of 1F1B is followed):
the peak of the measured steps and its components, and the point-to-point sends and receives
(c10d `send` / `recv_`) per step. Rank 0 gathers every rank's figures and writes the result. With
DISTPLAN_ALLOC_EVENTS=PATH every rank writes its allocation trace (validate.measure.Tracker.events) to
PATH.<rank> (benchmarks/alloc_pp.py).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import sys

from distplan.planner.model import ModelSpec
from distplan.planner.pp import predict_probe_ranks, probe_train
from distplan.planner.strategies import NAMES, get_strategy
from distplan.planner.workload.traced_model import from_spec

from .cp import head_tail_indices
from .matrix import HF_PP_TYPES
from .measure import Tracker, storage_key
from .model import Block, Norm, rope_tables
from .preload import preload as probe_preload
from .probe import ALLOC_EVENTS_ENV, _one_line, write_json
from .probe_run import launcher, local_rendezvous, run_probe
from .wrap import make_optimizer


DDP_SCHEDULE_ERROR = ("DistributedDataParallel stops in its reducer's first bucket rebuild under ScheduleGPipe and "
                      "ScheduleInterleaved1F1B (\"rebuilt parameter indices size is not same as original model "
                      "parameters size\", torch 2.13, with or without checkpointing); Schedule1F1B runs")


def stage_layers(layers: int, pp: int, stage: int) -> range:
    """The decoder layers of `stage`: an even split, the first `layers % pp` stages one layer more."""
    base, extra = divmod(layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def build_stage(spec, stage: int, pp: int, attention: str = "sdpa", checkpointing: str = "none",
                cp_group=None, positions=None):
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class Stage(nn.Module):
        """One pipeline stage of the reference decoder (`validate.model.Decoder`), same names."""

        def __init__(self):
            super().__init__()
            self.first, self.last = stage == 0, stage == pp - 1
            if self.first:
                self.tok_embeddings = nn.Embedding(spec.vocab, spec.hidden)
                if spec.position == "learned":
                    self.pos_embeddings = nn.Embedding(spec.max_positions, spec.hidden)
            self.layers = nn.ModuleDict({str(i): Block(spec, attention) for i in stage_layers(spec.layers, pp, stage)})
            for block in self.layers.values():  # context parallelism: ring attention over the cp group
                block.attn.cp_group = cp_group
            if self.last:
                self.norm = Norm(spec.hidden, spec.norm)
                self.output = nn.Linear(spec.hidden, spec.vocab, bias=False)

        def forward(self, x):
            if self.first:
                S = x.shape[1]
                x = self.tok_embeddings(x)  # (B, S, h)
                if spec.position == "learned":
                    x = x + self.pos_embeddings(torch.arange(S, device=x.device))
            S = x.shape[1]
            cos = sin = None
            if spec.position == "rope":
                cos, sin = rope_tables(S, spec.head_dim, device=x.device, positions=positions)
            for block in self.layers.values():
                if checkpointing == "full":  # the reference decoder's: non-reentrant, per block
                    x = checkpoint(block, x, cos, sin, use_reentrant=False)
                else:
                    x = block(x, cos, sin)
            if self.last:
                x = self.output(self.norm(x))  # (B, S, V) logits
            return x

    return Stage()




def build_hf_stage(module: dict, stage: int, pp: int, checkpointing: str = "none"):
    """One pipeline stage of a transformers causal LM (`module`: the probe spec's "module" object,
    planner/workload/traced_model.HFWorkload), split as torchtitan splits transformers models
    (`torchtitan/experiments/transformers_modeling_backend/infra/pipeline.py`: the modules of the other stages
    dropped from the whole model): the token embedding on the first stage, the decoder layers of
    `stage_layers`, the final norm and the LM head on the last. Every stage makes the rotary tables in its own
    forward (`<Type>RotaryEmbedding`, as the model's forward does once) and calls each layer with them and no
    mask: SDPA then runs causal (`integrations/sdpa_attention.py`: `is_causal` when the mask is None), as the
    whole model's SDPA path does for a batch without padding. Full checkpointing is transformers' own
    (`activation_checkpointing_enable`, non-reentrant, per decoder layer) and applies to the layers called
    here (`GradientCheckpointingLayer`)."""

    work = from_spec(module)
    model = work.build()
    kind = getattr(model.config, "model_type", None)
    if kind not in HF_PP_TYPES:
        raise ValueError(f"pp={pp}: the pipeline probe splits transformers models of type {', '.join(HF_PP_TYPES)}, "
                         f"not {kind!r}")
    if work.attention != "sdpa" or model.config._attn_implementation != "sdpa":
        raise ValueError(f"pp={pp}: the pipeline probe runs SDPA (its layers are called without a mask)")
    if checkpointing == "full":
        work.enable_checkpointing(model, work.units(model))
    base = model.model
    out = _HFStage(base.embed_tokens if stage == 0 else None, base.rotary_emb,
                   {str(i): base.layers[i] for i in stage_layers(len(base.layers), pp, stage)},
                   (base.norm, model.lm_head) if stage == pp - 1 else None)
    # the loss as transformers computes it, held apart from the module (a wrapper hides module attributes)
    out.hf_loss = (model.loss_function, int(model.config.vocab_size))
    return out  # the other stages' modules go with `model`


@functools.lru_cache(maxsize=1)
def _hf_stage_class():
    """The stage's class, made on first use."""
    import torch
    from torch import nn

    class HFStage(nn.Module):
        """A pipeline stage of a transformers causal LM (`build_hf_stage`)."""

        def __init__(self, embed, rotary, layers: dict, head):
            super().__init__()
            self.first, self.last = embed is not None, head is not None
            if self.first:
                self.embed_tokens = embed
            self.rotary_emb = rotary
            self.layers = nn.ModuleDict(layers)
            if self.last:
                self.norm, self.lm_head = head

        def forward(self, x):
            if self.first:
                x = self.embed_tokens(x)
            positions = torch.arange(x.shape[1], device=x.device)[None]
            tables = self.rotary_emb(x, positions)
            for layer in self.layers.values():
                x = layer(x, attention_mask=None, position_ids=positions, position_embeddings=tables)
                x = x[0] if isinstance(x, tuple) else x
            if self.last:
                x = self.lm_head(self.norm(x))
            return x

    return HFStage


def _HFStage(*args):
    return _hf_stage_class()(*args)


def loss_fn(logits, targets):
    """The reference decoder's loss (cross-entropy over fp32 logits)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def run(spec: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage


    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pp, dp, cp = int(spec["pp"]), int(spec.get("dp", 1)), int(spec.get("cp", 1))
    strategy = spec.get("strategy", "single")
    st = _checked_strategy(strategy, world, pp, dp, cp)
    stage_idx, replica, cp_idx, pp_group, dp_group, cp_group = _pp_groups(dist, rank, pp, dp, cp)
    mspec = ModelSpec(**spec["model"])
    train = spec["train"]
    M = int(spec["microbatches"])
    b, s = int(train["micro_batch"]), int(train["seq_len"])
    device = torch.device("cpu")
    tracker = Tracker(settle_waits=True)
    events_path = os.environ.get(ALLOC_EVENTS_ENV)
    if events_path:  # every rank its own: PATH.<rank> (planner/allocator.py replays one stage's events)
        tracker.events = []
    with tracker:
        torch.manual_seed(int(spec.get("seed", 0)) + stage_idx)
        sched_name = spec["schedule"]
        interleaved = sched_name in ("interleaved-1f1b", "interleaved-zb", "zbv")
        v = 2 if interleaved else 1  # torchtitan's stages per rank for the looped schedules
        # interleaved: rank r holds stages r and r + pp of pp * v (the looped schedules' order); zbv: r and
        # 2 pp - 1 - r (ScheduleZBVZeroBubble's "v" mapping, `generate_stage_to_rank_mapping`)
        stage_ids = ([stage_idx, 2 * pp - 1 - stage_idx] if sched_name == "zbv"
                     else [stage_idx + k * pp for k in range(v)])
        models, positions, hf_loss = _stage_models(spec, mspec, st, stage_ids, pp * v, cp, cp_idx, cp_group, dp_group)
        model = models[0] if v == 1 else torch.nn.ModuleList(models)
        # zero1: DDP and ZeroRedundancyOptimizer over the stage's dp x cp ranks
        opt = make_optimizer(model.parameters(), train, zero=st.zero_optimizer, group=dp_group)
        stages = [PipelineStage(mod, j, pp * v, device, group=pp_group) for j, mod in zip(stage_ids, models)]
        schedule = _pp_schedule(sched_name, stages, M, hf_loss)
        _phase_stages(stages, tracker)
        tracker.roles = _roles(model, models, opt)
        step = _pp_step(spec, mspec, schedule, opt, tracker, M, b, s, replica, cp, positions,
                        0 in stage_ids, pp * v - 1 in stage_ids)
        for _ in range(int(spec.get("warmup_steps", 1))):
            step()
        steps = int(spec.get("steps", 1))
        tracker.reset_peak()
        tracker.counting = True
        for _ in range(steps):
            step()
        tracker.counting = False
    if events_path:
        with open(f"{events_path}.{rank}", "w") as f:
            json.dump(tracker.events, f)
    if os.environ.get("DISTPLAN_PP_DEBUG"):  # what is live at the peak, unclassified storages by op
        tracker.components()
        spec["_debug_" + str(rank)] = sorted([(n, ph, op) for _, n, ph, op in tracker._snapshot[1]], reverse=True)[:40]
    mine = {"rank": rank, "stage": stage_idx, "replica": replica, "peak_bytes": tracker.peak_bytes, "peak_phase": tracker.peak_phase,
            "components": tracker.components(), "collectives": tracker.collective_list(steps),
            "params": sum(p.numel() for p in model.parameters()), "debug": spec.get("_debug_" + str(rank))}
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    dist.destroy_process_group()
    return _probe_result(spec, gathered, world, pp, dp, cp, strategy, M, torch.__version__)


def _checked_strategy(strategy: str, world: int, pp: int, dp: int, cp: int):
    """The spec's Strategy: single with dp x cp = 1, else one the probe wraps a stage by (not FSDP1)."""
    if world != pp * dp * cp:
        raise ValueError(f"world size {world} != pp {pp} x dp {dp} x cp {cp}")
    st = get_strategy(strategy) if strategy in NAMES else None
    if st is None or st.fsdp1 or st.distributed == (dp * cp == 1):
        raise ValueError(f"strategy={strategy!r} with dp={dp}, cp={cp}: the probe runs single (dp x cp = 1), or "
                         f"ddp, zero1, zero2 or zero3 (dp x cp > 1)")
    return st


def _pp_groups(dist, rank: int, pp: int, dp: int, cp: int) -> tuple:
    """(stage index, replica, cp index, pp group, dp group, cp group) of this rank."""
    # the mesh (pp, dp, cp), pp outermost as torchtitan lays it out: rank = stage * dp * cp + replica * cp +
    # cp index; DDP runs over a stage's dp x cp ranks (torchtitan's dp_cp), the ring over its cp ranks
    stage_idx, within = divmod(rank, dp * cp)
    replica, cp_idx = divmod(within, cp)
    pp_group = dp_group = cp_group = None
    for w in range(dp * cp):
        g = dist.new_group([s * dp * cp + w for s in range(pp)])
        if w == within:
            pp_group = g
    for s_ in range(pp):
        g = dist.new_group([s_ * dp * cp + w for w in range(dp * cp)])
        if s_ == stage_idx:
            dp_group = g
        for d in range(dp):
            g = dist.new_group([s_ * dp * cp + d * cp + c for c in range(cp)]) if cp > 1 else None
            if s_ == stage_idx and d == replica:
                cp_group = g
    return stage_idx, replica, cp_idx, pp_group, dp_group, cp_group


def _stage_models(spec: dict, mspec, st, stage_ids: list, n_stages: int, cp: int, cp_idx: int, cp_group,
                  dp_group) -> tuple:
    """(this rank's stage modules, wrapped by the strategy; this rank's positions under cp or None;
    transformers' loss (function, vocab) or None)."""
    train = spec["train"]
    s = int(train["seq_len"])
    positions = hf_loss = None
    if cp > 1:  # this rank's head-tail positions of each sequence (validate/cp.py)
        if mspec.position != "rope":
            raise ValueError("cp > 1: context parallelism runs the RoPE decoder (learned positions are not sharded)")
        positions = head_tail_indices(s, cp, cp_idx)
    module = spec.get("module")
    if module:  # a transformers model (validate --hf-config --pp)
        if cp > 1:
            raise ValueError("cp > 1: the pipeline probe's context parallelism runs the reference decoder")
        models = [build_hf_stage(module, j, n_stages, train.get("checkpointing", "none")) for j in stage_ids]
        hf_loss = models[0].hf_loss
    else:
        models = [build_stage(mspec, j, n_stages, train.get("attention", "sdpa"),
                              train.get("checkpointing", "none"), cp_group, positions) for j in stage_ids]
    if st.ddp_reducer and spec["schedule"] != "1f1b":
        raise ValueError(f"{st.name} with schedule={spec['schedule']!r}: {DDP_SCHEDULE_ERROR}")
    if st.ddp_reducer:  # each stage of the rank; PipelineStage runs it under no_sync until the last micro-batch
        from torch.nn.parallel import DistributedDataParallel
        models = [DistributedDataParallel(mod, process_group=dp_group) for mod in models]
    elif st.fsdp2:
        # FSDP2 as torchtitan applies it with pipeline stages (`apply_fsdp`: `fully_shard` per block,
        # then the stage, over the dp x cp mesh dimension, reshard_after_forward off with PP);
        # PipelineStage turns gradient sync and resharding after backward off until the last micro-batch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        pp, dp = int(spec["pp"]), int(spec.get("dp", 1))
        mesh = init_device_mesh("cpu", (pp, dp * cp), mesh_dim_names=("pp", "dp_cp"))["dp_cp"]
        for mod in models:
            for block in mod.layers.values():
                fully_shard(block, mesh=mesh, reshard_after_forward=False)
            fully_shard(mod, mesh=mesh, reshard_after_forward=False)
    return models, positions, hf_loss


def _pp_schedule(sched_name: str, stages: list, M: int, hf_loss):
    """The pipeline schedule of `stages` over M micro-batches, with the reference loss or transformers' own."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    lf = loss_fn
    if hf_loss is not None:  # transformers' own loss (`loss_utils.ForCausalLMLoss`: shifted labels, fp32 logits)
        def lf(logits, labels, _f=hf_loss[0], _v=hf_loss[1]):
            return _f(logits=logits, labels=labels, vocab_size=_v)
    if sched_name in ("interleaved-1f1b", "interleaved-zb", "zbv"):
        from torch.distributed.pipelining import ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble
        cls = {"interleaved-1f1b": ScheduleInterleaved1F1B, "interleaved-zb": ScheduleInterleavedZeroBubble,
               "zbv": ScheduleZBVZeroBubble}[sched_name]
        return cls(stages, n_microbatches=M, loss_fn=lf)
    sched_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[sched_name]
    return sched_cls(stages[0], n_microbatches=M, loss_fn=lf)


def _phase_stages(stages: list, tracker) -> None:
    """Each stage's forward and backward chunks set the tracker's phase."""
    def phased(fn, phase):
        def call(*a, **k):
            tracker.phase = phase
            return fn(*a, **k)
        return call

    for st_ in stages:
        st_.forward_one_chunk = phased(st_.forward_one_chunk, "forward")
        st_.backward_one_chunk = phased(st_.backward_one_chunk, "backward")
        st_.backward_weight_one_chunk = phased(st_.backward_weight_one_chunk, "backward")


def _roles(model, models: list, opt):
    """The tracker's `roles`: {storage key: "params" | "grads" | "optimizer"} when asked."""
    import torch
    params = list(model.parameters())  # as wrapped (FSDP2: the sharded DTensors, not the unsharded views)
    fsdp_params = [fp for mod in models for m in mod.modules() if hasattr(m, "_get_fsdp_state")
                   for fp in getattr(m._get_fsdp_state()._fsdp_param_group, "fsdp_params", ())]

    def roles() -> dict:
        out = {}

        def put(t, role):
            if isinstance(t, torch.Tensor):
                k = storage_key(getattr(t, "_local_tensor", t))  # DTensor (FSDP2): this rank's shard
                if k is not None:
                    out.setdefault(k, role)

        for p in params:
            put(p, "params")
            put(p.grad, "grads")
        for fp in fsdp_params:  # FSDP2 without gradient sync: gradients accumulate unsharded
            put(getattr(fp, "unsharded_accumulated_grad", None), "grads")
            unsharded = getattr(fp, "_unsharded_param", None)
            if unsharded is not None:
                put(unsharded.grad, "grads")
        for st in getattr(opt, "optim", opt).state.values():  # ZeroRedundancyOptimizer: its local optimizer
            for v in st.values():
                put(v, "optimizer")
        return out
    return roles


def _pp_step(spec: dict, mspec, schedule, opt, tracker, M: int, b: int, s: int, replica: int, cp: int, positions,
             first: bool, last: bool):
    """One optimizer step of the schedule over this replica's M x b sequences (the first stage's tokens, the
    last stage's targets)."""
    import torch

    gen = torch.Generator().manual_seed(int(spec.get("seed", 0)) + 1000 + replica)
    tokens = torch.randint(0, mspec.vocab, (M * b, s), generator=gen)
    targets = torch.randint(0, mspec.vocab, (M * b, s), generator=gen)
    if spec.get("module"):  # labels = input ids, as `HFWorkload.loss` gives transformers
        targets = tokens
    if cp > 1:
        tokens, targets = tokens[:, positions], targets[:, positions]
    if not first:
        tokens = None
    if not last:
        targets = None

    def step():
        tracker.phase = "forward"
        args = (tokens,) if first else ()
        kw = {"target": targets, "losses": []} if last else {}
        schedule.step(*args, return_outputs=False, **kw)
        tracker.phase = "optimizer"
        opt.step()
        opt.zero_grad(set_to_none=True)
        tracker.phase = "idle"
    return step


def _probe_result(spec: dict, gathered: list, world: int, pp: int, dp: int, cp: int, strategy: str, M: int,
                  torch_version: str) -> dict:
    """The standard probe's shape too (validate/probe.py), so that `distplan validate` judges it: the most
    loaded rank's memory and collectives."""
    worst = max(gathered, key=lambda r: r["peak_bytes"])
    memory = {"peak_allocated": worst["peak_bytes"], "tracker_peak_allocated": worst["peak_bytes"],
              "peak_reserved": None, "baseline": 0, "peak_phase": worst["peak_phase"],
              "components": worst["components"], "source": "storage tracker",
              "per_rank_peak_allocated": [r["peak_bytes"] for r in gathered], "peak_rank": worst["rank"]}
    return {"id": spec.get("id"), "status": "ok", "mode": "cpu", "world_size": world, "pp": pp, "dp": dp, "cp": cp,
            "strategy": strategy,
            "schedule": spec["schedule"], "microbatches": M, "ranks": gathered,
            "backend": "gloo", "device": "cpu", "measured_ranks": list(range(world)),
            "torch_version": torch_version, "memory": memory, "collectives": worst["collectives"],
            "step_time_s": None,
            "unmeasured": ["step time (the pipeline probe does not time its steps)",
                           "allocator peak (CPU: live tensor storages from the storage tracker, no caching allocator)"]}


def preload(argv: list[str]) -> None:
    """What a stage's run imports, before the launcher forks the stages (validate/launch.py)."""
    probe_preload(argv)
    importlib.import_module("torch.distributed.pipelining")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m distplan.validate.pp_probe")
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    with open(a.spec) as f:
        spec = json.load(f)
    try:
        result = run(spec)
    except Exception as e:  # one line in the result, as the other probes
        write_json(a.out, {"id": spec.get("id"), "status": "error", "error": _one_line(e)}, clobber=False)
        raise
    if int(os.environ.get("RANK", "0")) == 0:
        write_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())


# -- launching and predicting (the caller's side) -----------------------------------------------------

def probe_cmd(pp: int) -> list[str]:
    """torchrun with one process per stage on this machine (`runner.local_rendezvous`)."""
    return [sys.executable, "-m", launcher("cpu"), *local_rendezvous(), f"--nproc-per-node={pp}",
            "-m", "distplan.validate.pp_probe"]


def run_pp_probe(spec: dict, timeout_s: float = 300.0) -> dict:
    """Run `spec` under the probe guard (`probe_run.run_probe`): gloo, `spec["pp"]` processes."""
    world = int(spec["pp"]) * int(spec.get("dp", 1)) * int(spec.get("cp", 1))
    spec = dict(spec, mode="cpu", world_size=world)
    return run_probe(spec, probe_cmd(world), timeout_s=timeout_s)


def train_config(spec: dict):
    """The planner's TrainConfig for a probe spec (`planner.pp.probe_train`)."""
    return probe_train(spec)


def predict(spec: dict) -> list[dict]:
    """Per rank, the planner's prediction (`planner.pp.predict_probe_ranks`)."""
    return predict_probe_ranks(spec)
