"""Pipeline parallelism (PP) as `torch.distributed.pipelining` runs it, on torchtitan's mesh (pp, dp, tp).

`TrainConfig.pp` = p stages, one per rank of the "pp" mesh dimension, `pp_schedule` one of
`PP_SCHEDULES`, `pp_microbatches` = M micro-batches of `micro_batch` sequences per optimizer step
(`schedule.step` splits the batch; `grad_accum` must stay 1). The data-parallel strategies run over
dp = gpus / (tp * p) ranks on one stage's parameters; tensor parallelism splits each stage as before.

Stages (`stage_layers`): the decoder layers split evenly, the first `L mod p` stages one more; the
first stage also holds the token embedding, the last the final norm, the LM head and the loss (the
stages `validate/pp_probe.py` builds, deleting the other stages' modules as torchtitan's manual split
does). Tied embeddings are refused (the two ends would hold two copies). Not modelled: a split that
counts the embedding and the head as layers (torchtitan's `generate_llm_fqn_per_model_part` has
`input_weight` / `output_weight` for that).

Memory per stage (`stage_memory`, the per-GPU figure is the largest stage), for one step after a
warm-up step, walking the stage's actions in the order the schedule issues them
(`torch/distributed/pipelining/schedules.py`): `ScheduleGPipe._step_microbatches` runs every forward,
then every backward; `Schedule1F1B._step_microbatches` runs `min(M, p - stage)` warm-up forwards, then
one backward and one forward alternately, then the remaining backwards. Before each backward the stage
holds the activations of every micro-batch forwarded and not yet backwarded (GPipe: up to M; 1F1B:
`min(M, p - stage)`). What `PipelineStage` (`stage.py`) adds:
- `_setup_forward_recv_info` allocates one receive buffer per micro-batch (non-first stages) and
  `_setup_backward_recv_info` one gradient buffer per micro-batch (non-last stages), kept between
  steps: 2 M boundary tensors (b*s*h) for a middle stage. A stage's input is that buffer, so its
  first block's saved input is not a new activation.
- `forward_one_chunk` keeps each micro-batch's output in `fwd_cache` until its backward (the last
  stage: its logits, b*s*V); the schedule's pending send handles keep outputs alive too: GPipe's
  `fwd_sends_to_wait` all M until the step ends, 1F1B's `send_work` the one fired last in warm-up.
- `stage_backward` (`_backward.py`) sets the input's `.grad = None` after reading it: the input
  gradient lives only in the pending send (1F1B's `bwd_sends`: one; GPipe's `bwd_sends_to_wait`: all
  sent so far).
- After the first micro-batch the gradients exist and later ones accumulate into them
  (AccumulateGrad), so a block's weight gradient is a transient beside the full `.grad`.
- The whole batch (token ids on the first stage, targets on the last) lives through the step.

torch 2.15 changed the buffers (`config.pp_recv_buffers_per_receive`): `_RecvInfo.allocate_buffer`
(`_recv_buffers.py`) makes each receive buffer right before its receive and `take_buffer` hands it to
the computation, so a received activation is the micro-batch's input until its backward (on the last
stage the losses the schedule returns keep their graphs, and so every input, to the step's end) and a
gradient buffer lives through its backward only; `release_fwd_send_outputs` drops each output once its
send completes (1F1B before the next backward, GPipe before its backward loop), except a DDP-wrapped
stage's, which `_output_slot_is_releasable` keeps until its backward. Measured exact on gloo (the
transformers Llama, 2 and 4 stages). The schedules `_PipelineScheduleRuntime` runs (interleaved 1F1B and
the zero-bubble ones) are lowered in 2.15 with receives and send waits placed by a simulation over the
ranks (`lowered_actions`, a port): each receive buffer is made at its RECV, a forward send waits right
after its backward, a backward send at the step's end (`runtime_boundary_tensors`).

Sharded strategies under PP: `PipelineStage.backward_maybe_with_nosync`
runs FSDP with `set_requires_gradient_sync(False)` and `set_reshard_after_backward(False)` until the
last micro-batch, and torchtitan turns off `reshard_after_forward` with PP, so the stage's parameters
stay unsharded and its gradients accumulate unsharded (in `reduce_dtype`) through the step; DDP runs
`no_sync` until the last micro-batch. Each is counted at that size, and FSDP2's all-gathers run once per
step, at the first micro-batch's forward (`fsdp2_gathers_once`).

Point-to-point traffic (`pp_raw_schedule`): per micro-batch a stage sends its output forward and its
input's gradient backward (b*s*h elements of the boundary dtype, / tp with sequence parallelism), as
`c10d` `send` / `recv`; group "pp", across nodes when the pp dimension spans them.

Time: the pipeline bubble. A stage computes M micro-batches, and fill and drain leave it idle for
(p - 1) micro-batch slots: bubble / compute = (p - 1) / M for GPipe (Huang et al. 2019, GPipe,
arXiv:1811.06965 §2.2, O((K-1)/(M+K-1)) of the step) and 1F1B (Narayanan et al. 2021,
arXiv:2104.04473 §2.2.1: "bubble time fraction = (p - 1)/m"); with v virtual stages per rank
(interleaved 1F1B, §2.2.2) (1/v)(p - 1)/m. The slowest stage sets the pace: the time model uses a
stage of ceil(L/p) layers with the LM head and the loss.

Interleaved 1F1B (`ScheduleInterleaved1F1B`, v = 2 stages per rank) is walked in its own action order
(`interleaved_actions`, a port of `_calculate_single_rank_operations`): each chunk (local stage,
micro-batch) holds its layers' activations, and (through torch 2.14) every tensor the rank has sent
stays alive until the step ends (`_PipelineScheduleRuntime` waits for its sends only then); measured on
gloo probes within -1.3% / +3.6% per rank (tests/test_pp_probe.py).

The zero-bubble schedules (`ZERO_BUBBLE`: `ScheduleInterleavedZeroBubble`, `ScheduleZBVZeroBubble`) are
walked in their own order (`zero_bubble_actions`) with the backward split into an input pass that keeps
the chunk's graph and the gradients at its weight ops until the weight pass (`_zero_bubble_walk`); probed
within -3.4% / +4.8% per rank; refused with activation checkpointing (`check_pp`).

Known limitations: interleaved 1F1B's instants are the 1F1B ones at chunk granularity (the last
layer's MLP backward, at w_down and at the product's backward), with no separate first-layer or loss
instant; the zero-bubble walk has one instant per pass (the end of I, the start of W); the p2p time is
added for the fill and drain only (steady-state sends overlap compute); DDP and ZeRO-1 run under 1F1B
only (torch's reducer stops under the others); FSDP2 follows torchtitan's PP setting
(reshard_after_forward off): a user's FSDP2 that reshards after forward all-gathers every micro-batch,
not modelled.
"""

from __future__ import annotations

from .activations import _selective_block_saved, activations_in, block_linears, regime_for, sp_tokens
from .alloc_trace import MAX_LAYERS, MAX_MICROBATCHES
from .allocator import parse_alloc_conf
from .block_backward import _block_backward_peak
from .comm import DDP_BUCKET_CAP_MB, FSDP2_ROOT_RESHARD_EXPLICIT, _fsdp2_numel, _schedule_key, _timed_schedule
from .config import Cluster, PP_SCHEDULES, TrainConfig, pp_recv_buffers_per_receive
from .cp import cp_raw_schedule, cp_view
from .estimate import MemoryEstimate, library_workspace_bytes
from .footprint import device_footprint, with_communicator
from .model import ModelSpec, unit_sizes
# The schedules' arithmetic and one stage's configuration live below the walks (pp_schedule.py,
# pp_stage.py); importers of pp keep finding them here.
from .pp_schedule import (PP_STRATEGIES, PP_VIRTUAL_STAGES, ZERO_BUBBLE, bubble_fraction, check_pp,  # noqa: F401
                          in_flight, interleaved_actions, lowered_actions, rank_stage_ids, runtime_boundary_tensors,
                          runtime_compute_actions, stage_actions, stage_layers, stage_rank, virtual_stages,
                          zero_bubble_actions)
from .pp_stage import (PPStageSpec, _res_dtype, boundary_bytes, p2p_counts, pp_cluster, pp_raw_schedule,  # noqa: F401
                       releases_sent_outputs, stage_spec, stage_train)
from .stage_trace import STAGE_FAMILIES
from .state_layout import _opt_state, layout
from .strategies import SINGLE, get_strategy
from .tp import tp_view


# -- memory -----------------------------------------------------------------------------------------


def pp_memory(train, cluster, strategy, device: str = "cuda", backend: str = "nccl",
              gpu_name: str | None = None):
    """The most loaded pipeline stage's `MemoryEstimate` (every stage walked, `stage_memory`); its
    notes say which stage it is."""
    best = None
    for stage in _stages_to_walk(train.pp):
        est = stage_memory(train, cluster, strategy, stage, device, backend, gpu_name)
        if best is None or est.peak_allocated > best.peak_allocated:
            best = est
    return best


def _stages_to_walk(p: int) -> list[int]:
    # the middle stages differ only in their in-flight count, which falls with the stage index
    # (1F1B) or not at all (GPipe), and in their layer count (the first L mod p have one more):
    # the first, the second, the first of the shorter ones and the last bound them
    return sorted({0, 1, p - 2, p - 1} | set(range(min(p, 4))))


def _retained_grads(strain, regime: str, n: int) -> int:
    """Bytes a zero-bubble input-gradient pass (I) keeps per layer until its weight pass (W):
    `stage_backward_input` hooks the autograd nodes where each weight's path joins the input's (each
    Linear's mm, each norm) and keeps the gradient of their outputs (`param_group["grads"]`) for
    `stage_backward_weight`: n x (the Linear output widths + h per norm, + the q and k widths where
    Qwen3's q_norm / k_norm normalize the heads), in the activations' dtype (measured: Qwen3 under
    interleaved ZB on torch 2.15, -1.4% with its q/k norms left out, -0.03% with them,
    benchmarks/results/cpu-torch2.15-2026-11-29-pp-runtime-hf.jsonl)."""
    m = strain.model
    e = 4 if regime == "fp32" else 2
    widths = sum(o for _, o, _ in block_linears(m, strain.tp)) + 2 * m.hidden
    if m.qk_norm:
        widths += (m.q_dim + m.kv_dim) // strain.tp
    return n * widths * e


def _zero_bubble_walk(snap, actions, sids, nstages, lay_k, a_k, g_layer, weight_cache, persistent, nh, g_full,
                      head_g, batch_ids, b_tmp, w_tmp, logits, loss_part, runtime=None):
    """The instants of a zero-bubble rank (`stage_memory`'s v > 1 walk with the backward split, planner
    docstring): a chunk (local stage, micro-batch) keeps its activations from F until its W, since the
    input pass runs `autograd.grad(..., retain_graph=True)`; between I and W it also keeps the retained
    gradients (`_retained_grads` per layer; the last stage adds the final norm's and the logits'), except the last stage's loss part (the logits and the loss's
    saved log-probabilities: `stage_backward_input` detaches the loss, and no hooked node reaches back to
    them, `loss_part`). Stage 0
    has no input gradient to make: its I does nothing and its W is the whole backward. Every tensor sent
    stays alive to the end of the step (`_PipelineScheduleRuntime` through torch 2.14), as in interleaved
    1F1B; from 2.15 `runtime` gives the boundary tensors at each action (`runtime_boundary_tensors`). A
    neighbour on the same rank (zbv) gets its tensor without a send."""
    v = len(sids)
    g_k = [g_layer * lay_k[k] + ((nh + logits) if sids[k] == nstages - 1 else 0) for k in range(v)]
    fwd_sends = [sids[k] != nstages - 1 and sids[k] + 1 not in sids for k in range(v)]
    bwd_sends = [sids[k] != 0 and sids[k] - 1 not in sids for k in range(v)]
    f, i, w = [0] * v, [0] * v, [0] * v
    for idx, (k, kind, _mb) in enumerate(actions):
        if kind == "F":
            f[k] += 1
            continue
        acts = sum((f[j] - w[j]) * a_k[j] - ((i[j] - w[j]) * loss_part if sids[j] == nstages - 1 else 0)
                   for j in range(v)) + weight_cache
        kept = sum((i[j] - w[j]) * g_k[j] for j in range(v) if sids[j] != 0)
        sent = sum(f[j] for j in range(v) if fwd_sends[j]) + sum(i[j] for j in range(v) if bwd_sends[j])
        comm = persistent + sent * nh if runtime is None else runtime[idx] * nh
        g = g_full if sum(w) else head_g
        if kind == "I":
            if sids[k] != 0:  # at its end: this chunk's retained gradients and the input gradient made
                snap("backward", int(acts), g, comm, batch_ids + kept + g_k[k] + b_tmp)
            i[k] += 1
            continue
        # W: the weight gradients beside what is kept (stage 0: the whole backward)
        snap("backward", int(acts), g, comm, batch_ids + kept + (b_tmp if sids[k] == 0 else w_tmp))
        w[k] += 1


def _stage_state_bytes(train, st, m, lay, shard: int) -> tuple:
    """A stage's static parts and its gradients once the first micro-batch's backward made them, in bytes:
    (parameters, static communication buffers (FSDP's unsharded parameters, DDP's buckets), a weight
    gradient's bytes per element, the gradients through the step, the gradients the optimizer reads, the
    optimizer step's temporaries)."""
    prec = train.prec
    pb, gb, cb = prec.param_bytes, prec.grad_bytes, prec.compute_bytes
    sharding = st.fsdp and shard > 1 and st.shards_params
    if st.fsdp:
        ud = cb if prec.mixed else pb
        rb = 4 if prec.mixed else gb
        unsharded = (lay.unshard_root + m.layers * lay.unshard_block)
        params = lay.shard_total * pb
        static_comm = unsharded * ud if sharding else (unsharded * cb if prec.mixed else 0)
        wgrad_b = ud
        g_full = unsharded * (rb if st.fsdp2 else ud) if sharding else lay.total * gb
        g_opt = lay.shard_total * (4 if prec.mixed else gb) if sharding else lay.total * gb
        step_elems = lay.shard_total
    else:
        params = lay.total * pb
        static_comm = 0 if not st.distributed else lay.total * gb  # DDP's buckets
        wgrad_b = gb
        g_full = g_opt = lay.total * gb
        step_elems = lay.opt_owned if st.zero_optimizer and shard > 1 else lay.total
    if train.optimizer in ("adam", "adamw") and train.optimizer_impl == "foreach":
        opt_tmp = step_elems * pb  # _multi_tensor_adam's exp_avg_sq_sqrt
    elif train.optimizer in ("adam", "adamw") and train.optimizer_impl == "for-loop" or train.optimizer == "adafactor":
        opt_tmp = 2 * lay.largest_param * pb
    else:
        opt_tmp = 0
    return params, static_comm, wgrad_b, g_full, g_opt, opt_tmp


def _stage_notes_and_replay(train, st, stage: int, m, world: int, shard: int, regime: str, device: str,
                            workspace: int) -> tuple[list, tuple | None]:
    """The stage's notes (which stage, what PyTorch does with its wrapper under pipelining) and the
    arguments of its allocator replay (`MemoryEstimate.replay_args`; None where the margin stands in)."""
    p, M, sched = train.pp, train.pp_microbatches, train.pp_schedule
    v = virtual_stages(sched)
    first, last = stage == 0, stage == p - 1
    family = st.family
    notes = [f"pipeline stage {stage} of {p} ({m.layers} layers"
             + (", embedding" if first else "") + (", final norm + LM head + loss" if last else "")
             + f"; {sched}, {M} micro-batches) is the most loaded"]
    if st.ddp_reducer and world > 1 and sched != "1f1b":
        notes.append(f"pipeline parallelism with DDP under {sched}: torch's DistributedDataParallel stops in its "
                     f"reducer's first bucket rebuild under ScheduleGPipe and ScheduleInterleaved1F1B (measured on "
                     f"torch 2.13, validate/pp_probe.py); Schedule1F1B runs, and so do FSDP2's zero2/zero3")
    if st.fsdp and world > 1:
        notes.append("pipeline parallelism with FSDP2: the stage's parameters stay unsharded and its gradients "
                     "accumulate unsharded through the step, all-gathered once per step (PipelineStage with "
                     "torchtitan's reshard_after_forward=False)")
    # The stage's allocations replayed through the caching allocator (alloc_trace.stage_allocation_events)
    # where they are written; else memory.RESERVED_MARGIN over the allocated peak.
    replay_args = None
    if device == "cuda":
        # (autocast's weight casts under pipelining are not written: those stages keep the margin)
        # (FSDP2 stages are written sharded over more than one rank, as the probes run them)
        if (family in STAGE_FAMILIES and v == 1 and regime != "autocast" and m.layers <= MAX_LAYERS
                and M <= MAX_MICROBATCHES and (not st.fsdp2 or shard > 1)):
            expandable, max_split, _ = parse_alloc_conf(train.alloc_conf, "alloc_conf")
            replay_args = ("pp-stage", train, st.name, stage, world, shard, device, workspace, expandable,
                           max_split)
        else:
            why = [w for w, applies in ((f"{st.name} stages", family not in STAGE_FAMILIES),
                                        (f"{st.name} stages on one data-parallel rank",
                                         st.fsdp2 and shard <= 1),
                                        (f"{sched} schedules", v > 1),
                                        ("stages under autocast", regime == "autocast"),
                                        (f"more than {MAX_MICROBATCHES} micro-batches", M > MAX_MICROBATCHES),
                                        (f"stages of more than {MAX_LAYERS} layers", m.layers > MAX_LAYERS))
                   if applies]
            notes.append("pipeline parallelism: the reserved peak is the allocated peak + 10% (no allocator "
                         "replay of " + ", nor of ".join(why) + ")")
    return notes, replay_args


def _interleaved_walk(snap, train, strain, stage: int, act, regime: str, m, p: int, v: int, M: int, sched: str,
                      n: int, nh: int, vloc: int, e: int, weight_cache: int, g_full: int, head_g: int,
                      batch_ids: int, wdown_tmp: int, blk_tmp: int, freed: int, wg: int, wgrad_b: int) -> int:
    """Interleaved 1F1B and the zero-bubble schedules: the rank's v local stages walked in the order their
    schedule runs them, each backward instant taken by `snap` (bytes); returns the bytes of the receive
    buffers kept through the step."""
    # Interleaved 1F1B: the rank's v local stages (stage ids stage + k p), walked in the order
    # `ScheduleInterleaved1F1B` runs them (`interleaved_actions`). A chunk (local stage, micro-batch)
    # holds its own layers' activations, less its receive buffer's share when it is not stage 0,
    # plus the embedding's (stage 0) or the head's and logits (the last stage).
    nstages = p * v
    sids = rank_stage_ids(sched, p, stage)
    lay_k = [stage_layers(train.model.layers, nstages, sid) for sid in sids]
    per_layer = act.blocks_total / max(1, m.layers)  # this rank's layers' share (RoPE tables spread)
    a_k = []
    for k, sid in enumerate(sids):
        a = per_layer * lay_k[k] - (0 if sid == 0 else nh)
        if sid == nstages - 1:
            a += (act.outside - act.inputs) + act.loss_saved + n * vloc * e
        a_k.append(a)
    # receive buffers: activations for each non-first stage, gradients for each non-last one, but none
    # from a neighbour on this rank (zbv's stages p - 1 and p hand their tensors over directly)
    persistent = M * nh * (sum(sid != 0 and sid - 1 not in sids for sid in sids)
                           + sum(sid != nstages - 1 and sid + 1 not in sids for sid in sids))
    f_k, b_k = [0] * v, [0] * v
    runtime = None
    if pp_recv_buffers_per_receive(train):
        # torch >= 2.15 lowers these schedules with receives and send waits of their own
        # (`runtime_boundary_tensors`): the boundary tensors alive at each action replace the buffers
        # kept for the run and the sends held to the step's end
        runtime, left = runtime_boundary_tensors(sched, p, M, stage)
        persistent = left * nh
    if sched in ZERO_BUBBLE:
        # with checkpointing the input pass recomputes each block, and the retained graph keeps what it
        # rebuilt until the weight pass
        _zero_bubble_walk(snap, zero_bubble_actions(sched, p, M, stage), sids, nstages, lay_k, a_k,
                          _retained_grads(strain, regime, n), weight_cache, persistent, nh,
                          g_full, head_g, batch_ids, max(wdown_tmp, blk_tmp - nh - freed), wg * wgrad_b,
                          n * vloc * e, act.loss_saved + n * vloc * e, runtime)
    for i, (k, kind, _mb) in enumerate(() if sched in ZERO_BUBBLE else interleaved_actions(p, M, stage, v)):
        if kind == "F":
            f_k[k] += 1
            continue
        held = [f_k[j] - b_k[j] for j in range(v)]
        acts = sum(held[j] * a_k[j] for j in range(v)) + weight_cache
        # Every tensor sent so far (through torch 2.14): `_PipelineScheduleRuntime._step_microbatches`
        # keeps each send's work in `send_ops` and waits for them all at the end of the step, so the
        # outputs of the non-last chunks' forwards and the input gradients of the non-first chunks'
        # backwards stay alive until then.
        sent = (sum(f_k[j] for j in range(v) if sids[j] != nstages - 1)
                + sum(b_k[j] for j in range(v) if sids[j] != 0))
        comm = persistent + sent * nh if runtime is None else runtime[i] * nh
        g = g_full if sum(b_k) else head_g
        # the chunk's last layer, MLP backward: at w_down, then at the product's backward (the tensors
        # the MLP backward frees gone, the gate and up gradients beside the product's), as for one stage
        snap("backward", int(acts), g, comm, batch_ids + wdown_tmp)
        snap("backward", int(acts - freed), g, comm, batch_ids + blk_tmp - nh)
        b_k[k] += 1
    return persistent


def _one_stage_walk(snap, train, stage: int, act, regime: str, m, p: int, M: int, sched: str, first: bool,
                    last: bool, per_receive: bool, releasable: bool, n: int, h: int, nh: int, vloc: int,
                    persistent: int, a_mb: int, weight_cache: int, blocks_part: int, block0_part: int,
                    block_elems: int, head_keep: int, g_full: int, head_g: int, batch_ids: int, wdown_tmp: int,
                    t_in: int, freed: int, wg: int, blk_tmp: int, wgrad_b: int) -> None:
    """GPipe and 1F1B (one stage per rank): the stage's forward and backward actions in the order its
    schedule runs them, each backward instant taken by `snap` (bytes): the loss's and the LM head's on the
    last stage, the last layer's MLP backward, and the first layer's on the first micro-batch."""
    k = in_flight(sched, p, M, stage)
    f = b = 0
    for kind, mb in stage_actions(sched, p, M, stage):
        if kind == "F":
            f += 1
            continue
        inflight = f - b
        if per_receive:
            # 1F1B and GPipe wait for (and release) every forward send before the next backward; a
            # DDP stage's outputs stay in its forward state until their backward
            held_out = 0 if last or releasable else inflight
            held_grad = 0 if first else (b if sched == "gpipe" else min(b, 1))
            received = (0 if first else (f if last else inflight)) + (0 if last else 1)
            comm = (received + held_out + held_grad) * nh
        else:
            if sched == "gpipe":
                held_out, held_grad = (0 if last else f), (0 if first else b)
            else:
                held_out = 0 if last else inflight + (1 if k >= 2 and b > k - 2 else 0)
                held_grad = 0 if first else min(b, 1)
            comm = persistent + (held_out + held_grad) * nh
        others = (inflight - 1) * a_mb + weight_cache  # the other micro-batches in flight
        if last:  # the loss's backward: nll_loss_backward's dense gradient and log_softmax_backward's
            snap("backward", others + a_mb, g_full if b else 0, comm, batch_ids + 2 * n * vloc * 4)
        if last and regime == "fp32" and train.tp == 1:
            # The LM head's backward (memory.estimate_memory's head instant): log_softmax's saved output
            # gone, the logits' gradient alive beside the hidden states' gradient and the head's weight
            # gradient, which becomes .grad on the first micro-batch and is a transient until
            # AccumulateGrad adds it after. Measured (transformers Llama, GPipe over 2 stages, 4
            # micro-batches of 1024 x 1024 logits): the last stage peaks here, 128 KiB above the loss
            # instant.
            snap("backward", others + a_mb - act.loss_saved - (n * vloc * 4 if m.final_softcap else 0),
                 g_full if b else head_g, comm,
                 batch_ids + n * vloc * 4 + n * h * 4 + (vloc * h * wgrad_b if b else 0))
        # The stage's last layer, MLP backward: at w_down (its input and weight gradients: the
        # weight gradient becomes .grad on the first micro-batch, is added into it after), then at
        # the product's backward (the gate and up gradients beside the product's, `prod` freed).
        # Its incoming gradient is the receive buffer, except on the last stage (the norm's).
        acts = others + blocks_part + head_keep
        g = g_full if b else head_g
        snap("backward", acts, g, comm, batch_ids + wdown_tmp + t_in)
        snap("backward", acts - freed, g if b else g + wg * wgrad_b, comm, batch_ids + blk_tmp - nh + t_in)
        if b == 0 and m.layers > 1:
            # The stage's first layer on the first micro-batch: every gradient but most of this
            # block's, this micro-batch's other blocks freed (later micro-batches: fewer bytes than
            # the last layer's instants, the gradients being whole there).
            acts0 = others + block0_part + head_keep
            g0 = g_full - (block_elems - wg) * wgrad_b
            snap("backward", acts0, g0 - wg * wgrad_b, comm, batch_ids + wdown_tmp + nh)
            snap("backward", acts0 - freed, g0, comm, batch_ids + blk_tmp)
        b += 1


def stage_memory(train, cluster, strategy, stage: int, device: str = "cuda", backend: str = "nccl",
                 gpu_name: str | None = None):
    """`memory.MemoryEstimate` of pipeline stage `stage` under `strategy` on the stage's dp ranks (see
    the module docstring for what is walked)."""

    st = get_strategy(strategy)
    family = st.family
    p, M, sched = train.pp, train.pp_microbatches, train.pp_schedule
    v = virtual_stages(sched)
    first, last = stage == 0, stage == p - 1
    strain = stage_train(train, stage)
    dpc = cluster
    if train.tp > 1:
        _, dpc = tp_view(train, cluster)
    dpc = pp_cluster(train, dpc)
    world = dpc.gpus if st.distributed else 1
    group = st.shard_group
    shard = world if group == "world" else (min(world, dpc.local_size) if group == "node" else 1)
    if st.fsdp_no_shard:
        shard = 1
    m = strain.model
    prec = train.prec
    pb = prec.param_bytes
    lay = layout(m, family, shard, st.shards_params, st.shards_optimizer)
    opt_elems, opt_extra = _opt_state(m, train.optimizer, family, shard)
    opt = opt_elems * pb + int(opt_extra)
    regime = regime_for(strain, family)
    act = activations_in(strain, regime, device)
    n = train.micro_batch * train.seq_len
    h, vloc = m.hidden, -(-m.vocab // train.tp)
    r = 4 if regime in ("fp32", "autocast") else 2
    e = 4 if regime == "fp32" else 2
    nh = sp_tokens(strain, n) * h * r  # the boundary tensor (one micro-batch)

    # Static parts and the gradients once the first micro-batch's backward made them.
    params, static_comm, wgrad_b, g_full, g_opt, opt_tmp = _stage_state_bytes(train, st, m, lay, shard)

    # One micro-batch's saved activations on this stage.
    a_mb = act.blocks_total
    if not first:
        a_mb -= nh  # the first block's input is the receive buffer
    if last:
        a_mb += (act.outside - act.inputs) + act.loss_saved + n * vloc * e  # final norm, head input, logits kept
    weight_cache = act.weight_cache  # autocast's casts: one copy, not per micro-batch
    head_keep = n * vloc * e if last else 0  # the logits, kept in fwd_cache through their backward
    blocks_part = act.blocks_total - (0 if first else nh)
    # the first layer's saved tensors with the tables every layer shares (RoPE's), freed with it; its
    # input is the receive buffer on a non-first stage
    if train.checkpointing == "none":
        kept_block = act.per_block
    elif train.checkpointing == "full":
        kept_block = nh  # a checkpointed block keeps its input
    else:
        kept_block = _selective_block_saved(strain, regime) + nh
    block0_part = max(0, act.blocks_total - (m.layers - 1) * kept_block - (0 if first else nh))
    block_elems = m.units()[1].numel
    head_g = m.units()[2].numel * wgrad_b if last else 0
    t_in = nh if last else 0  # the last layer's incoming gradient, when it is a new tensor
    batch_ids = (M * n * 8 if first else 0) + (M * n * 8 if last else 0)  # token ids / targets, whole batch
    persistent = (0 if first else M * v * nh) + (0 if last else M * v * nh)  # receive buffers
    freed, blk_tmp, wg = _block_backward_peak(strain, regime, n, device)
    f_cols = m.ffn_hidden // train.tp
    wdown_tmp = n * f_cols * e + wg * wgrad_b  # w_down's input gradient and weight gradient
    if train.checkpointing != "none":
        # the block is recomputed inside its backward (as memory.estimate_memory): what it rebuilds is
        # a temporary, and the tensor the MLP backward frees is one of those
        # (its input is the saved one, already counted: not rebuilt)
        rebuilt = act.recompute_block - nh
        blk_tmp += rebuilt - freed
        wdown_tmp += rebuilt
        freed = 0

    best = [-1, "", None]

    def snap(phase, activations=0, grads=0, comm=0, temps=0):
        total = activations + grads + comm + temps
        if total > best[0]:
            best[:] = total, phase, (activations, grads, comm, temps)

    per_receive = v == 1 and pp_recv_buffers_per_receive(train)
    if per_receive:
        # torch >= 2.15: no buffer lives between steps. A received activation is the stage's input (a leaf
        # in the micro-batch's graph) until its backward; on the last stage the losses the schedule
        # returns keep their graphs, and with them every input, until the step's end. Each gradient
        # buffer lives through its backward only.
        persistent = M * nh if last and not first else 0
    releasable = releases_sent_outputs(family, last)
    if v == 1:
        _one_stage_walk(snap, train, stage, act, regime, m, p, M, sched, first, last, per_receive, releasable, n, h,
                        nh, vloc, persistent, a_mb, weight_cache, blocks_part, block0_part, block_elems, head_keep,
                        g_full, head_g, batch_ids, wdown_tmp, t_in, freed, wg, blk_tmp, wgrad_b)
    else:
        persistent = _interleaved_walk(snap, train, strain, stage, act, regime, m, p, v, M, sched, n, nh, vloc, e,
                                       weight_cache, g_full, head_g, batch_ids, wdown_tmp, blk_tmp, freed, wg,
                                       wgrad_b)
    snap("optimizer", 0, g_opt, persistent, batch_ids + opt_tmp)

    _, phase, (a, g, c, t) = best
    comps = {"params": int(params), "grads": int(g), "optimizer": int(opt), "activations": int(a),
             "comm_buffers": int(static_comm + c), "temporaries": int(t)}
    workspace = library_workspace_bytes(train, gpu_name or cluster.gpu_name) if device == "cuda" else 0
    peak = sum(comps.values()) + workspace
    # The CUDA context and NCCL's communicators (footprint.py): dp and tp as without pipelining, and the
    # pp group (stages strided by gpus / pp ranks, so on one node only when that stride fits in it).
    nccl = backend == "nccl"
    fp = device_footprint(dpc, world if nccl else 1, st.shard_group, train.tp if nccl else 1)
    if nccl:
        g, stride = cluster.local_size, cluster.gpus // p
        fp = with_communicator(fp, cluster, "pipeline", p, g // stride if stride < g else 1)
    overhead = fp.total
    notes, replay_args = _stage_notes_and_replay(train, st, stage, m, world, shard, regime, device, workspace)
    return MemoryEstimate(st.name, comps, peak, phase, overhead, cluster.gpu_memory_bytes, notes, workspace,
                          replay_args, footprint=fp)


def stage_dp_schedule(train, cluster, strategy, stage: int) -> list:
    """The data-parallel collectives of pipeline stage `stage` per optimizer step (`Collective`s, group
    'dp'): the strategy's schedule over the stage's dp ranks for the stage's parameters, its M
    micro-batches accumulated (DDP's `no_sync`, FSDP2's `set_requires_gradient_sync(False)` until the
    last one, as `PipelineStage.backward_maybe_with_nosync` runs them)."""
    s = get_strategy(strategy)
    dpc = cluster
    if train.tp > 1:
        dpc = tp_view(train, cluster)[1]
    dpc = pp_cluster(train, dpc)
    if not s.distributed or dpc.gpus == 1:
        return []
    view = stage_train(train, stage)
    key = _schedule_key(view, s.name, dpc.gpus, dpc.local_size, dpc.nodes, DDP_BUCKET_CAP_MB,
                        FSDP2_ROOT_RESHARD_EXPLICIT)
    # DDP's buffer broadcast (a transformers stage's rotary `inv_freq`): none under PipelineStage, which runs
    # every forward inside `no_sync()` (`_PipelineStageBase.forward_maybe_with_nosync`), so DDP's `_post_forward`
    # never sets `require_forward_param_sync` and no later forward broadcasts (measured: the probes of
    # transformers stages under DDP, 1F1B over 2 replicas, count none)
    out = [c._replace(group="dp") if c.group == "world" else c for c in _timed_schedule(key, dpc)[0]
           if c.unit != "buffers"]
    return fsdp2_gathers_once(out, train.pp_microbatches, train, stage, dpc.gpus) if s.fsdp2 else out


def fsdp2_gathers_once(collectives, M: int, train=None, stage: int = 0, world: int = 1) -> list:
    """FSDP2 under pipeline stages: the parameters, all-gathered at the first micro-batch's forward, stay
    unsharded through the step (torchtitan's `apply_fsdp` turns `reshard_after_forward` off with PP, and
    `PipelineStage.backward_maybe_with_nosync` calls `set_reshard_after_backward(False)` on every
    backward; the schedule reshards after the last one). So the forward all-gathers run once per step,
    not once per micro-batch, and backward gathers nothing. The reduce-scatters are unchanged (last
    micro-batch only).

    A rank holding both the first and the last stage as two modules (zbv's rank 0) has two FSDP roots, the
    embedding's and the final norm's + LM head's, each all-gathered and reduce-scattered on its own."""
    split = None
    if train is not None and train.pp_schedule == "zbv" and stage == 0:
        parts = [_fsdp2_numel(unit_sizes(stage_spec(train.model, train.tp, 1, a, b))[0], world)
                 for a, b in ((True, False), (False, True))]
        split = [x / sum(parts) for x in parts if x]
    out = []
    for c in collectives:
        if c.op == "all_gather" and c.phase == "backward":
            continue
        if c.op == "all_gather" and c.calls >= M:
            k = c.calls // M
            c = c._replace(calls=k, bytes_per_gpu=c.bytes_per_gpu * k // c.calls, time_s=c.time_s * k / c.calls)
        if split and c.unit == "root":
            out += [c._replace(message_bytes=round(c.message_bytes * x), bytes_per_gpu=round(c.bytes_per_gpu * x),
                               time_s=c.time_s * x) for x in split]
            continue
        out.append(c)
    return out


# -- the pipeline probe's prediction (validate/pp_probe.py runs it) ----------------------------------

def probe_train(spec: dict):
    """The TrainConfig of a pipeline probe spec (fp32 on gloo, the probe's optimizer and schedule)."""
    t = spec["train"]
    return TrainConfig(ModelSpec(**spec["model"]), seq_len=int(t["seq_len"]), micro_batch=int(t["micro_batch"]),
                       precision="fp32", optimizer=t.get("optimizer", "adamw"),
                       optimizer_impl=t.get("optimizer_impl", "foreach"), attention=t.get("attention", "sdpa"),
                       checkpointing=t.get("checkpointing", "none"),
                       pp=int(spec["pp"]), pp_schedule=spec["schedule"],
                       pp_microbatches=int(spec["microbatches"]), cp=int(spec.get("cp", 1)),
                       torch_version=spec.get("torch_version") or "")


def predict_probe_ranks(spec: dict) -> list[dict]:
    """Per rank of a pipeline probe (stage-major, as the probe numbers them: rank = stage x dp x cp +
    replica x cp + cp index): the stage walk (`stage_memory`, the spec's strategy on its dp x cp ranks,
    CPU, gloo) and that stage's collectives (`stage_dp_schedule`, `p2p_counts`, `boundary_bytes`, and
    with cp > 1 the ring's, `cp.cp_raw_schedule` of the stage)."""
    train = cp_view(probe_train(spec))
    dp = int(spec.get("dp", 1)) * train.cp
    strategy = spec.get("strategy", SINGLE)
    family = get_strategy(strategy).family
    world = train.pp * dp
    cluster = Cluster(gpus=world, gpus_per_node=world)
    out = []
    for rank in range(world):
        stage = rank // dp
        est = stage_memory(train, cluster, strategy, stage, device="cpu", backend="gloo")
        af, gb, ar, gr = p2p_counts(train, stage)
        msg = boundary_bytes(train, strategy)
        colls = [{"op": op, "group_size": train.pp, "dtype": "float32", "message_bytes": msg, "calls": n}
                 for op, n in (("recv", ar + gr), ("send", af + gb)) if n]
        merged: dict = {}
        for c in stage_dp_schedule(train, cluster, strategy, stage):
            key = (c.op, c.group_size, c.dtype, c.message_bytes)
            merged[key] = merged.get(key, 0) + c.calls
        for c in cp_raw_schedule(stage_train(train, stage), family):
            key = (c[0], c[2], c[3], c[4])
            merged[key] = merged.get(key, 0) + c[5]
        colls += [{"op": op, "group_size": g, "dtype": dt, "message_bytes": b, "calls": n}
                  for (op, g, dt, b), n in merged.items()]
        out.append({"rank": rank, "peak_bytes": est.peak_allocated, "components": est.components,
                    "collectives": colls, "peak_phase": est.peak_phase})
    return out


def predict_pp_probe(spec: dict) -> dict:
    """`api.predict_probe` for a pipeline probe: the most loaded rank's predicted memory and collectives
    (the probe reports its most loaded rank's, validate/pp_probe.py)."""
    ranks = predict_probe_ranks(spec)
    worst = max(ranks, key=lambda r: r["peak_bytes"])
    mem = dict(worst["components"], workspace=0, peak_allocated=int(worst["peak_bytes"]),
               peak_phase=worst["peak_phase"], peak_rank=worst["rank"])
    return {"memory": mem, "collectives": worst["collectives"], "step_time_s": None, "step_time_bound": None}
