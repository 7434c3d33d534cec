"""Pipeline schedules as torch.distributed.pipelining runs them: the stages each rank holds
(`rank_stage_ids`, `virtual_stages`), the order of its forward and backward actions (`stage_actions`,
`interleaved_actions`, `zero_bubble_actions`, `lowered_actions`), the micro-batches in flight, the bubble,
and `check_pp`'s refusals. Pure arithmetic on (schedule, pp, M, rank): below TrainConfig (config.py
checks a configuration with `check_pp`) and the stage walks (pp_stage.py, pp.py, alloc_trace.py)."""

from __future__ import annotations

from functools import lru_cache

from .strategies import DDP, FSDP2, REGISTRY, SINGLE, ZERO1
from .units import short_repr


PP_STRATEGIES = tuple(n for n, s in REGISTRY.items() if s.family in (SINGLE, DDP, ZERO1, FSDP2))
"""The data-parallel strategies `PipelineStage` works with: a plain module, DDP (`no_sync` until the
last micro-batch, `backward_maybe_with_nosync`) with or without ZeroRedundancyOptimizer, and FSDP2
(`FSDPModule`: `perform_reduce_grad` reduces once). FSDP1 modules get no such handling (stage.py)."""


PP_VIRTUAL_STAGES = 2
"""Stages per rank for interleaved-1f1b (torchtitan's default: 2 per rank for the looped schedules)."""


ZERO_BUBBLE = ("interleaved-zb", "zbv")
"""The zero-bubble schedules (Qi et al. 2024, arXiv:2401.10241): `ScheduleInterleavedZeroBubble` (the
paper's ZB1P, looped over 2 stages per rank) and `ScheduleZBVZeroBubble` (ZB-V: 2 stages per rank in a V,
rank r holding stages r and 2p - 1 - r). Each backward is split into an input-gradient pass (I) and a
weight-gradient pass (W) run later (`zero_bubble_actions`)."""


def virtual_stages(schedule: str) -> int:
    return PP_VIRTUAL_STAGES if schedule in ("interleaved-1f1b", *ZERO_BUBBLE) else 1


def rank_stage_ids(schedule: str, pp: int, rank: int) -> list[int]:
    """The global ids of pipeline rank `rank`'s stages: rank + k pp for the looped schedules, rank and
    2 pp - 1 - rank for zbv (`generate_stage_to_rank_mapping(style="v")`)."""
    if schedule == "zbv":
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(virtual_stages(schedule))]


def zero_bubble_actions(schedule: str, pp: int, M: int, rank: int) -> list[tuple[int, str, int]]:
    """(local stage k, 'F' | 'I' | 'W', micro-batch) in the order the zero-bubble schedule runs them on
    `rank` (ports of `_calculate_single_rank_operations`: interleaved-zb through `_get_warmup_ops` with
    multiply_factor 1 and `_get_1f1b_rank_ops(enable_zero_bubble=True)`, whose weight passes start
    `rank` steps into the steady state; zbv in its warm-up / stable / cool-down phases, planned for
    max(2 pp - 1, M) micro-batches and the ones past M dropped). The padding (`None` slots, the bubbles)
    does not change a rank's order."""
    out: list[tuple[int, str, int]] = []
    cnt = {kind: [0, 0] for kind in "FIW"}  # per pass kind and local stage: the next micro-batch

    def act(kind: str, k: int, times: int = 1) -> None:
        for _ in range(times):
            out.append((k, kind, cnt[kind][k]))
            cnt[kind][k] += 1

    if schedule == "interleaved-zb":
        v = PP_VIRTUAL_STAGES
        rounds = max(1, M // pp)
        per_round = M // rounds
        warm = min((v - 1) * per_round + (pp - 1 - rank), M * v)
        steady = M * v - warm
        bwd_ops: list[int] = []

        def bwd_k(step):
            return v - 1 - ((step - warm) // per_round) % v

        for op in range(warm + steady + warm):
            if op < warm + steady:
                act("F", (op // per_round) % v)
            if op < warm:
                continue
            act("I", bwd_k(op))
            bwd_ops.append(op)
            if op - warm >= rank:  # the weight passes start `rank` steps into the steady state
                act("W", bwd_k(bwd_ops[cnt["W"][0] + cnt["W"][1]]))
        for op in bwd_ops[cnt["W"][0] + cnt["W"][1]:]:
            act("W", bwd_k(op))
        return out
    if schedule != "zbv":
        raise ValueError(f"zero_bubble_actions: schedule {schedule!r}: accepted: {', '.join(ZERO_BUBBLE)}")
    n = max(2 * pp - 1, M)
    act("F", 0, 2 * (pp - rank) - 1)  # warm-up
    for _ in range(rank):
        act("F", 1)
        act("F", 0)
    for _ in range(pp - rank):
        act("F", 1)
        act("I", 1)
        act("W", 1)
    while cnt["F"][1] < cnt["F"][0] or cnt["F"][0] < n:  # stable
        if cnt["F"][0] < n:
            act("F", 0)
        for k in (0, 1):
            if k:
                act("F", 1)
            act("I", k)
            act("W", k)
    for _ in range(rank):  # cool-down
        act("I", 0)
        act("I", 1)
    for _ in range(pp - rank):
        act("I", 0)
        act("W", 0)
    act("W", 1, cnt["I"][1] - cnt["W"][1])
    act("W", 0, cnt["I"][0] - cnt["W"][0])
    return [a for a in out if a[2] < M]


def stage_rank(schedule: str, pp: int, sid: int) -> int:
    """The pipeline rank holding global stage `sid` (`rank_stage_ids` inverted)."""
    if schedule == "zbv":
        return sid if sid < pp else 2 * pp - 1 - sid
    return sid % pp


def runtime_compute_actions(schedule: str, pp: int, M: int, rank: int) -> list[tuple[str, int, int]]:
    """Rank `rank`'s compute actions of a runtime schedule as (kind, global stage, micro-batch): the order
    `interleaved_actions` / `zero_bubble_actions` give, local stages mapped by `rank_stage_ids`."""
    sids = rank_stage_ids(schedule, pp, rank)
    acts = (zero_bubble_actions(schedule, pp, M, rank) if schedule in ZERO_BUBBLE
            else interleaved_actions(pp, M, rank, virtual_stages(schedule)))
    return [(kind, sids[k], mb) for k, kind, mb in acts]


@lru_cache(maxsize=64)
def lowered_actions(schedule: str, pp: int, M: int) -> tuple:
    """Each pipeline rank's actions as torch 2.15's `_PipelineScheduleRuntime` runs the runtime schedules
    (interleaved 1F1B, interleaved ZB, ZB-V): ((kind, global stage, micro-batch), ...) per rank, kinds F, B,
    I, W, SEND_F, RECV_F, SEND_B, RECV_B, WAIT_SEND_F, WAIT_SEND_B, UNSHARD, RESHARD, REDUCE_GRAD,
    WAIT_REDUCE_GRAD. Ports of torch/distributed/pipelining/schedules.py (2.15), in the order
    `_prepare_schedule_with_comms` applies them with its defaults: `_add_unshard_reshard`
    (max_active_stages 3, unshard_lookahead "full"), `_add_reduce_grad` (the wait right after the
    reduction), `_add_send_recv` (a simulation over the ranks in lock-step: an action runs once its input
    was received or computed on the rank, and each send puts the matching receive at the receiving rank's
    current end), `_add_wait_send` (a forward send waits right after its stage's backward of the same
    micro-batch, a backward send at the end). The compute order is `interleaved_actions` /
    `zero_bubble_actions` (the `None` slots are dropped by the first pass)."""
    v = virtual_stages(schedule)
    nst = pp * v
    compute = {r: runtime_compute_actions(schedule, pp, M, r) for r in range(pp)}
    lowered = {}
    for r, acts in compute.items():
        # _add_unshard_reshard: the next max_active_stages distinct stages resident (found from each
        # stage's next use, scanned backwards: a linear pass where torch rescans the rest of the list)
        nxt: dict = {}
        upcoming = [None] * len(acts)
        for i in range(len(acts) - 1, -1, -1):
            nxt[acts[i][1]] = i
            upcoming[i] = [sid for _, sid in sorted((j, sid) for sid, j in nxt.items())[:3]]
        out, active = [], []
        for i, a in enumerate(acts):
            resident = upcoming[i]
            for sid in [x for x in active if x not in resident]:
                active.remove(sid)
                out.append(("RESHARD", sid, None))
            for sid in [x for x in resident if x not in active]:
                active.append(sid)
                out.append(("UNSHARD", sid, None))
            out.append(a)
        out += [("RESHARD", sid, None) for sid in active]
        # _add_reduce_grad: after a stage's M-th B or W
        done: dict = {}
        red = []
        for a in out:
            red.append(a)
            if a[0] in ("B", "W"):
                done[a[1]] = done.get(a[1], 0) + 1
                if done[a[1]] == M:
                    red += [("REDUCE_GRAD", a[1], None), ("WAIT_REDUCE_GRAD", a[1], None)]
        lowered[r] = red

    def has_comms(a) -> bool:
        kind, sid, _ = a
        if kind == "F":
            return sid != nst - 1 and stage_rank(schedule, pp, sid + 1) != stage_rank(schedule, pp, sid)
        if kind in ("I", "B"):
            return sid != 0 and stage_rank(schedule, pp, sid - 1) != stage_rank(schedule, pp, sid)
        return False

    def ready(a, prev) -> bool:
        kind, sid, mb = a
        if kind == "F" and sid != 0:
            return ("RECV_F", sid, mb) in prev or ("F", sid - 1, mb) in prev
        if kind in ("I", "B") and sid != nst - 1:
            return (("RECV_B", sid, mb) in prev or ("I", sid + 1, mb) in prev
                    or ("B", sid + 1, mb) in prev)
        return True

    # _add_send_recv
    comm = {r: [] for r in lowered}
    prev = {r: set() for r in lowered}
    pending = {r: list(a) for r, a in lowered.items()}
    while pending:
        progress = False
        for r in sorted(pending):
            a = pending[r][0]
            if not ready(a, prev[r]):
                continue
            comm[r].append(a)
            prev[r].add(a)
            if has_comms(a):
                kind, sid, mb = a
                fwd = kind == "F"
                send = ("SEND_F" if fwd else "SEND_B", sid, mb)
                recv = ("RECV_F" if fwd else "RECV_B", sid + 1 if fwd else sid - 1, mb)
                comm[r].append(send)
                prev[r].add(send)
                dst = stage_rank(schedule, pp, recv[1])
                comm[dst].append(recv)
                prev[dst].add(recv)
            pending[r].pop(0)
            if not pending[r]:
                del pending[r]
            progress = True
        if not progress:
            raise AssertionError(f"lowered_actions: {schedule} over {pp} ranks, {M} micro-batches: no progress")
    # _add_wait_send
    result = []
    for r in range(pp):
        sends: dict = {}
        acts = []
        for a in comm[r]:
            acts.append(a)
            if a[0] in ("SEND_F", "SEND_B"):
                sends[a] = None
            if a[0] in ("B", "I") and ("SEND_F", a[1], a[2]) in sends:
                acts.append(("WAIT_SEND_F", a[1], a[2]))
                del sends[("SEND_F", a[1], a[2])]
        acts += [("WAIT_" + kind, sid, mb) for kind, sid, mb in sends]
        result.append(tuple(acts))
    return tuple(result)


def runtime_boundary_tensors(schedule: str, pp: int, M: int, rank: int) -> tuple[list[int], int]:
    """Boundary tensors (one micro-batch's n x h each) rank `rank` holds under torch 2.15's
    `_PipelineScheduleRuntime`, walked over `lowered_actions`: (the count at each of the rank's compute
    actions, in `interleaved_actions` / `zero_bubble_actions` order, before the action's own effects; the
    count left at the step's end). A receive buffer is made at its RECV (`_RecvInfo.allocate_buffer` in
    `PipelineStage._get_recv_ops`); an activation buffer is the forward's input until the chunk's graph
    goes (its backward; W after I: the first norm saves it), on the last stage to the step's end (the
    returned losses keep their graphs) unless the backward is split (`_backward.stage_backward_input`
    detaches the loss: `stage_output.detach_()`, so the graph goes with W); a gradient buffer lives
    through its backward (I). A sent output lives until its WAIT_SEND_F (`release_fwd_send_outputs`),
    right after its backward; a sent input gradient until the step's end (WAIT_SEND_B). Measured (the
    transformers Llama on 2 gloo ranks, 4 micro-batches, interleaved 1F1B, ZB-V and interleaved ZB):
    the peak rank's boundary tensors exact (benchmarks/results/cpu-torch2.15-2026-11-29-pp-hf.jsonl)."""
    nst = pp * virtual_stages(schedule)
    acts_buf, grad_buf, outs, grads_sent = 0, 0, 0, 0
    counts = []
    for kind, sid, mb in lowered_actions(schedule, pp, M)[rank]:
        if kind == "RECV_F":
            acts_buf += 1
        elif kind == "RECV_B":
            grad_buf += 1
        elif kind == "SEND_F":
            outs += 1
        elif kind == "WAIT_SEND_F":
            outs -= 1
        elif kind in ("F", "B", "I", "W"):
            counts.append(acts_buf + grad_buf + outs + grads_sent)
            remote_prev = sid != 0 and stage_rank(schedule, pp, sid - 1) != rank
            remote_next = sid != nst - 1 and stage_rank(schedule, pp, sid + 1) != rank
            if kind in ("B", "I") and remote_next:
                grad_buf -= 1
            if kind in ("B", "I") and remote_prev:
                grads_sent += 1
            if (kind == "W" or kind == "B" and sid != nst - 1) and remote_prev:
                acts_buf -= 1
    return counts, acts_buf


def stage_layers(layers: int, stages: int, stage: int) -> int:
    """Decoder layers of `stage` of `stages`: an even split, the first `layers % stages` one more."""
    base, extra = divmod(layers, stages)
    return base + (stage < extra)


def in_flight(schedule: str, pp: int, M: int, rank: int) -> int:
    """Micro-batches (chunks, interleaved) whose activations rank `rank` holds before its first backward.

    gpipe: all M (`ScheduleGPipe._step_microbatches`); 1f1b: `warmup_chunks = min(M, p - stage)`
    (`Schedule1F1B._step_microbatches`), and each later backward is preceded by one forward, so it
    stays there; interleaved-1f1b: `_get_warmup_ops` (v - 1) * per_round + 2 (p - 1 - rank), capped at
    M v, plus the forward that each 1F1B step runs before its backward (`_get_1f1b_rank_ops`)."""
    if schedule == "gpipe":
        return M
    if schedule == "1f1b":
        return min(M, pp - rank)
    v = PP_VIRTUAL_STAGES
    rounds = max(1, M // pp)
    per_round = M // rounds
    warm = min((v - 1) * per_round + 2 * (pp - 1 - rank), M * v)
    return min(warm + 1, M * v)


def interleaved_actions(pp: int, M: int, rank: int, v: int = PP_VIRTUAL_STAGES) -> list[tuple[int, str, int]]:
    """(local stage k, 'F' | 'B', micro-batch) in the order `ScheduleInterleaved1F1B` runs them on `rank`
    (`schedules.py` `_calculate_single_rank_operations`: `_get_warmup_ops` forwards, then one forward and
    one backward per step, then the remaining backwards; a forward's local stage advances every
    `microbatches_per_round` steps, a backward's runs from the last local stage down)."""
    rounds = max(1, M // pp)
    per_round = M // rounds
    warm = min((v - 1) * per_round + 2 * (pp - 1 - rank), M * v)
    total = M * v
    steady = total - warm
    f_mb, b_mb = [0] * v, [0] * v
    out = []

    def fwd(step):
        k = (step // per_round) % v
        out.append((k, "F", f_mb[k]))
        f_mb[k] += 1

    def bwd(step):
        k = v - 1 - ((step - warm) // per_round) % v
        out.append((k, "B", b_mb[k]))
        b_mb[k] += 1

    for step in range(warm + steady + warm):
        if step < warm:
            fwd(step)
        elif step < warm + steady:
            fwd(step)
            bwd(step)
        else:
            bwd(step)
    return out


def bubble_fraction(schedule: str, pp: int, M: int) -> float:
    """Idle time over compute time of one stage: (p - 1) / M (GPipe arXiv:1811.06965 §2.2; 1F1B,
    Narayanan et al. 2021 arXiv:2104.04473 §2.2.1), divided by v for interleaved 1F1B (§2.2.2). The
    zero-bubble schedules as their authors give them for equal forward, input-gradient and weight-gradient
    times (Qi et al. 2024, arXiv:2401.10241, ZB-H1 §2.1: a third of 1F1B's bubble; ZB-V §6: none): ZB1P
    looped over v stages per rank (`interleaved-zb`) (p - 1) / (3 v M), an extrapolation of the paper's
    ZB-H1 as interleaving divides 1F1B's; `zbv` 0. Real backward passes are not split evenly (attention's
    backward is all input gradient), so these are lower bounds."""
    if schedule == "zbv":
        return 0.0
    div = 3 if schedule == "interleaved-zb" else 1
    return (pp - 1) / (div * virtual_stages(schedule) * M)


PP_MICROBATCHES_WALKED = 1024
"""The most micro-batches per step planned (`max_pp_microbatches`): `stage_memory` walks each stage's
schedule action by action, and the recommendation re-plans it a few dozen times; at 1,024 micro-batches
that takes seconds on a 2-core machine (1F1B and GPipe well under one, interleaved and zero-bubble
schedules two to five); 2^20 took 7 minutes. Published pipelines run tens to a few hundred per step."""


def max_pp_microbatches(pp: int) -> int:
    """The most micro-batches per step accepted with `pp` stages: PP_MICROBATCHES_WALKED, or 4 x pp past
    256 stages (the default is 2 x pp; 1F1B needs at least pp)."""
    return max(PP_MICROBATCHES_WALKED, 4 * pp)


def check_pp(train, flag: str = "--pp") -> None:
    """One-line ValueErrors for a pipeline configuration PyTorch would refuse or we do not model.
    `flag`: "--pp" names the CLI's flags in the messages, "pp" the API's arguments."""
    cli = flag.startswith("--")
    ga, mb, fw = ("--grad-accum", "--pp-microbatches", "--framework") if cli else (
        "grad_accum", "pp_microbatches", "framework")
    p, M, sched = train.pp, train.pp_microbatches, train.pp_schedule
    L = train.model.layers
    v = virtual_stages(sched)
    if p * v > L:
        raise ValueError(f"{flag}={p}: {p * v} stages ({sched}) need at least as many layers and the model "
                         f"has {L}; accepted: {flag} <= {L // v}")
    if train.model.tie_embeddings:
        raise ValueError(f"{flag}={p} with a tied embedding ({train.model.name}): the first and last stages "
                         f"would hold two copies; accepted: {flag}=1 for tied models")
    if train.checkpointing.startswith("every-"):
        ck = "--activation-checkpointing" if cli else "checkpointing"
        raise ValueError(f"{ck}={train.checkpointing} with {flag}={p}: a stage's walk assumes its blocks alike; "
                         f"accepted: {ck} none, selective, selective-op or full")
    if train.grad_accum != 1:
        raise ValueError(f"{ga}={train.grad_accum} with {flag}={p}: the pipeline's micro-batches are the "
                         f"accumulation; accepted: {ga} 1 and {mb} M")
    top = max_pp_microbatches(p)
    if M > top:
        raise ValueError(f"{mb}={short_repr(M)}: accepted: an integer from 1 to {top:,} (the larger of "
                         f"{PP_MICROBATCHES_WALKED:,} and 4 x {flag}: each stage's schedule is walked micro-batch "
                         f"by micro-batch, seconds at that count; pipelines run tens to hundreds per step)")
    if sched == "1f1b" and M < p:
        raise ValueError(f"{mb}={short_repr(M)}: Schedule1F1B needs at least as many micro-batches as "
                         f"stages ({p}); accepted: {mb} >= {p}")
    if sched in ("interleaved-1f1b", "interleaved-zb"):
        rounds = max(1, M // p)
        if M % rounds:
            raise ValueError(f"{mb}={M}: {'ScheduleInterleaved1F1B' if sched == 'interleaved-1f1b' else 'ScheduleInterleavedZeroBubble'} "
                             f"needs a multiple of max(1, M // pp) = {rounds}; accepted: e.g. {rounds * p}")
    if sched in ZERO_BUBBLE and train.checkpointing != "none":
        ck = "--activation-checkpointing" if cli else "checkpointing"
        raise ValueError(f"{ck}={train.checkpointing} with the zero-bubble schedule {sched}: the input-gradient "
                         f"pass keeps the recomputed blocks past the weight pass (20-37% above a per-chunk "
                         f"model on the CPU probe); not modelled; accepted: {ck} none")
    if train.framework != "pytorch":
        raise ValueError(f"{flag}={p} with {fw}={train.framework}: pipeline parallelism is modelled for "
                         f"torch.distributed.pipelining; accepted: {fw} pytorch")
    if train.cpu_offload != "none":
        off = "--cpu-offload" if cli else "cpu_offload"
        raise ValueError(f"{off}={train.cpu_offload} with {flag}={p}: offload is not modelled with pipeline "
                         f"stages; accepted: {off} none")


def stage_actions(schedule: str, pp: int, M: int, stage: int) -> list[tuple[str, int]]:
    """('F' | 'B', micro-batch) in the order `Schedule1F1B` / `ScheduleGPipe` runs them on `stage`."""
    if schedule == "gpipe":
        return [("F", i) for i in range(M)] + [("B", i) for i in range(M)]
    k = min(M, pp - stage)
    out = [("F", i) for i in range(k)]
    f = k
    for b in range(M):
        out.append(("B", b))
        if f < M:
            out.append(("F", f))
            f += 1
    return out
