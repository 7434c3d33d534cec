"""The allocations of a training run, as the analytic model sees them, replayed through the caching allocator.

`estimate_memory` (memory.py) gives the peak of *allocated* bytes in closed form. What decides an OOM is
the *reserved* peak (`torch.cuda.max_memory_reserved`): the segments the caching allocator holds, which
depend on the sizes, order, lifetimes and streams of every allocation. `allocation_events` writes those
events for the reference decoder (or a Hugging Face model read into a `ModelSpec`) under one strategy,
tensor by tensor, from model construction through the warm-up and measured steps the probes run
(validate/probe.py), and `reserved_peak` replays them through `allocator.CachingAllocator`.

The sizes are the planner's own (memory.layout, activations.activations_in, memory._block_backward_peak),
so this is one model, not a second one: it adds the order and the streams. What it follows, per phase:

- Construction: the model is built on the host and moved with `.to(device)`, each parameter its own
  allocation in registration order. FSDP2 (`fully_shard`, `_fsdp_param.py` `FSDPParam._init_sharded_param`)
  then allocates each parameter's padded dim-0 shard and drops the full tensor; FSDP1
  (`_flat_param.py` `FlatParamHandle.flatten_tensors_into_flat_param`, `shard`) concatenates each unit's
  parameters into one flat tensor, keeps one padded chunk of it, then drops the flat tensor and the
  originals. DDP's `Reducer` allocates one flat gradient buffer per bucket (`initialize_buckets`,
  `bucket.gradients`) and its rebuild in the second iteration allocates new ones before dropping the old
  (`_rebuild_buckets`). A tied transformers model also makes and drops its LM head's own weight
  (`_tied_head_transient`).
- Forward, per block: the tensors the block's backward keeps (activations_in: the same bytes, split in the
  shapes the ops save: norm statistics and outputs, q/k/v, the attention output, the MLP's n*f tensors),
  autocast's 16-bit weight casts (single/DDP/ZeRO-1 under *-mixed), and under checkpointing only the
  block's input. FSDP2: the block's all-gather output on the all-gather stream (`foreach_all_gather`,
  one flat buffer), copied out into per-parameter unsharded tensors on the compute stream
  (`foreach_all_gather_copy_out`), freed at `post_forward` when resharding. FSDP1: the low-precision
  shard (`_use_low_precision_shard`) and the padded unsharded flat parameter on the unshard stream.
- Backward: the root's pre-backward hook on the loss prefetches the last block (FSDP2 `_backward_prefetch`,
  FSDP1 `_prefetch_handle`) before the loss's and the head's backward. Per block in reverse: the prefetch of
  the next block's all-gather, the recomputation of a checkpointed block beside its kept input, then two
  phases: to the block backward's peak (memory._block_backward_peak) the saved tensors its last ops consumed
  freed, the MLP's transients and the weight gradients made by then (the output projection's), after it the
  other weight gradients (per parameter; FSDP1 concatenates them into the flat gradient) and the frees of
  the block's saved tensors (under tensor parallelism one burst); FSDP2's `post_backward`: reshard, the
  reduce-scatter input on the compute
  stream (kept until the next reduce-scatter, `reduce_scatter_state`), the output shard that becomes
  `.grad`; FSDP1's `_post_backward_hook` the same on its post-backward stream. A tied weight that is the
  parameter itself, FSDP2's unsharded parameter or FSDP1's view of its flat parameter: the head's gradient
  held to the embedding's backward, then the embedding's and their sum, a new tensor.
- Optimizer: AdamW's states are made lazily in the first step (`_init_group`: `zeros_like` per parameter,
  exp_avg then exp_avg_sq), `_multi_tensor_adam`'s `exp_avg_sq_sqrt` temporaries (foreach), and
  `zero_grad(set_to_none=True)` drops the gradients.
- Gradient accumulation: every micro-step is written. The first makes the gradients that later ones add
  into in place (AccumulateGrad, one weight gradient at a time); without sync (grad_sync 'last') FSDP2
  keeps the unsharded gradients (upcast to reduce_dtype under mixed precision:
  `to_accumulated_grad_if_needed`) and FSDP1 the unsharded flat gradient (SHARD_GRAD_OP also the unsharded
  parameters); synced every micro-step, the new shards are added to the kept ones.
- Tensor parallelism: one TP rank's parameter shapes (tp.tp_view), the probes' whole-model construction
  before `parallelize_module`, each rowwise output's reduction (partial sum, then the all-reduced or
  reduce-scattered tensor), loss parallel's vocabulary shard and three backward buffers, the embedding's
  full-vocabulary Replicate gradient.
- Pipeline stages (`stage_allocation_events`: a plain stage, DDP, FSDP2 zero2/zero3) and checkpoint saves
  (`checkpoint_events`): see there.

Checked against allocation traces the CPU probes recorded (tests/test_alloc_trace.py): one micro-step at
16 layers (benchmarks/alloc_depth.py), accumulation and TP (benchmarks/alloc_accum.py), pipeline stages
(benchmarks/alloc_pp.py), checkpoint saves (benchmarks/alloc_ckpt.py), a tied model under mixed precision
(benchmarks/alloc_tied.py).

Streams: 0 compute, 1 all-gather (FSDP2 `all_gather_copy_in_stream`: the flat buffer and the
mixed-precision cast of the shards; FSDP1 `_unshard_stream`: the unsharded flat parameter and the flat
gradient, made by its views' backward), 2 reduce-scatter (FSDP2 `reduce_scatter_stream`: its output;
FSDP1 `_post_backward_stream`), 3 FSDP1's `_pre_unshard_stream` (the low-precision shard); checked against
the streams the CPU probes record (validate.measure.StreamTags, allocator.comm_streams). What is
approximate: the exact transients of each forward op (only the block MLP's backward transients, the TP
reductions and the loss's are written), and the host order inside a block. Not written
(memory.RESERVED_MARGIN instead): the `--hf-config` trace front end where module_plan cannot pair it with
this writer's run (a `--module` trace: `logged_step_events`, `logged_fsdp2_events`, `logged_fsdp1_events`;
not under checkpointing, pure 16-bit or FSDP2 on one rank), DeepSpeed, ZeRO-1 pipeline stages
(and FSDP2 stages on one data-parallel rank), interleaved and zero-bubble schedules, autocast under
pipelining, more than MAX_MICROBATCHES micro-batches, `full-offload`, NO_SHARD, HSDP and tensor-parallel
saves, models over MAX_LAYERS.
"""

from __future__ import annotations

from functools import lru_cache, wraps
from math import prod

from .activations import (_hf_attention_parts, _hf_mask, _hf_sdpa_backend, _mlp_parts, _norm_parts, activations_in,
                          block_saved, hf_eager, hf_output_copied, regime_for, sdpa_math, sp_tokens)
from .allocator import alloc_rounding, collector_paused, replay_fit, replay_peaks
from .block_backward import _block_backward_peak
from .comm import DDP_BUCKET_CAP_MB, bucket_sizes, ready_order_sizes
from .config import TrainConfig, fsdp2_reduce_keeps_last_grad, pp_recv_buffers_per_receive
from .model import ModelSpec, unit_sizes
from .pp_schedule import stage_actions, virtual_stages
from .pp_stage import releases_sent_outputs, stage_train
from .state_layout import _all_state_elems, _opt_state, layout, zero1_owned_shapes
from .strategies import DDP, FSDP1, FSDP2, REGISTRY, SINGLE, ZERO1, get_strategy

MAX_MICROBATCHES = 64
"""Pipeline stages with more micro-batches per step are not replayed (GPipe writes every micro-batch's
forward before the first backward: the work grows with them); the margin instead, and the output says so."""
MAX_LAYERS = 160
"""Deeper models are not replayed (the work grows with the layers): 160 covers the deepest published
dense models (Llama-3.1-405B 126 layers, PaLM 540B 118, GPT-3 96); beyond it the reserved peak is the
margin (memory.RESERVED_MARGIN) and the output says so."""
WARMUP_STEPS = 2  # validate/probe.py: optimizer state, FSDP lazy init, DDP's bucket rebuild
MEASURED_STEPS = 1
"""Later steps repeat the second one's allocations, but the caching allocator settles only by the third step's
end (the second is the first with optimizer state): after it a long run reserves no more, with the default
allocator and with expandable segments; under max_split_size_mb up to 1% more by the fifth
(tests/test_alloc_trace.py test_three_steps_reach_a_long_runs_reserved_peak)."""


def _collector_paused(write):
    """`write` (an event writer) under allocator.collector_paused, as allocator.replay runs: a trace is
    thousands of new tuples, which would trigger a collection every 700 of them and now and then a full one
    over every object of the process (14 ms of a cold 7B estimate's 230 on the 2-core VM); they hold no
    cycles, so nothing is left to collect. The collector looks at them once, after."""

    @wraps(write)
    def paused(*args, **kwargs):
        with collector_paused():
            return write(*args, **kwargs)
    return paused


class _Events:
    """An event list with handles: `a(size, stream)` returns a key, `f(key)` frees it."""

    __slots__ = ("ev", "n")

    def __init__(self) -> None:
        self.ev: list = []
        self.n = 0

    def a(self, size: int, stream: int = 0) -> int:
        self.n += 1
        self.ev.append(("alloc", self.n, int(size), stream))
        return self.n

    def f(self, *keys) -> None:
        for k in keys:
            if k is not None:
                self.ev.append(("free", k))

    def put(self, template: tuple, count: int, x: int) -> int:
        """`_compiled` events, the input's key `x`: returns the base its keys count from."""
        base = self.n
        self.ev.extend([("alloc", base + i, size, 0) if size is not None else ("free", base + i if i else x)
                        for size, i in template])
        self.n = base + count
        return base


BROADCAST_BUCKET = 250 << 20
"""DistributedDataParallel's `broadcast_bucket_size` (torch/nn/parallel/distributed.py: int(250 * 1024 * 1024))."""


def _broadcast_coalesced(E: _Events, sizes) -> None:
    """DistributedDataParallel.__init__'s `_sync_module_states`: the module's states (its parameters, then
    its buffers: `sizes`, the bytes of each) broadcast from rank 0 by `_broadcast_coalesced`
    (torch/csrc/distributed/c10d/comm.cpp `broadcast_coalesced`). `compute_bucket_assignment_by_size`
    (reducer.cpp) fills a bucket in order until it holds at least BROADCAST_BUCKET bytes; each bucket's
    BroadcastWork flattens its tensors into one new tensor (`flatten_dense_tensors`: `at::cat`, or a view of a
    bucket's only tensor, which allocates nothing), at most 2 in flight: the third waits for the first's
    `finish()`, which copies it back and frees it; the last two are freed in order at the end."""
    buckets, cur, n = [], 0, 0
    for b in sizes:
        cur, n = cur + b, n + 1
        if cur >= BROADCAST_BUCKET:
            buckets.append((cur, n))
            cur, n = 0, 0
    if n:
        buckets.append((cur, n))
    flight: list = []
    for nbytes, count in buckets:
        if len(flight) >= 2:
            E.f(flight.pop(0))
        flight.append(E.a(nbytes) if count > 1 else None)
    E.f(*flight)


def _adam_temporaries(E: _Events, sizes, optimizer: str, impl: str) -> None:
    """Adam(W)'s step temporaries over parameters of `sizes` bytes: `_multi_tensor_adam`'s exp_avg_sq_sqrt,
    one per parameter at once (foreach), or `_single_tensor_adam`'s two at a time per parameter (for-loop);
    the fused kernel and the other optimizers make none."""
    if optimizer in ("adam", "adamw"):
        if impl == "foreach":
            E.f(*[E.a(n) for n in sizes])
        elif impl == "for-loop":
            for n in sizes:
                E.f(E.a(n), E.a(n))


def _logged_optimizer_step(E: _Events, states: list, owned, optimizer: str, impl: str) -> None:
    """A traced module's optimizer step (torch/optim/adam.py, sgd.py) over parameters of `owned` bytes: in the
    first step `_init_group` makes each one's state into `states` -- Adam(W) `exp_avg` and `exp_avg_sq`
    (fused: a 4-byte `step` on the device before them), SGD with momentum the `momentum_buffer` -- then
    Adam's step temporaries (`_adam_temporaries`)."""
    if not states:
        for n in owned:
            if optimizer in ("adam", "adamw"):
                if impl == "fused":
                    states.append(E.a(4))
                states.extend((E.a(n), E.a(n)))
            elif optimizer == "sgd-momentum":
                states.append(E.a(n))
    _adam_temporaries(E, owned, optimizer, impl)


@lru_cache(maxsize=256)
def block_program(train: TrainConfig, regime: str, n: int, device: str = "cuda", grad: bool = False) -> tuple | None:
    """One block's forward op by op: ("a", name, bytes) allocates, ("f", *names) frees, ("w", (i, ...)) makes
    the 16-bit cast under autocast of the Linear made of the block's i-th, ... 2-D weights (one for a fused
    projection; autocast_mode.cpp `cached_cast`: kept in its cache).
    "x" is the block's input (never allocated here), "out" its output (the next block's input). Every
    intermediate goes as soon as nothing refers to it: Python drops a temporary after the op that reads it and
    a local when the function returns or rebinds it; the caller holds the input until the block returns.

    `grad=False`: a checkpointed block's forward, which runs without saving (`torch.utils.checkpoint`,
    non-reentrant: the forward under no_grad). `grad=True`: what autograd saves is not freed, and the last op
    is ("s", *names): the saved tensors in the order `_block_saved_shapes` lists them (the input itself first
    where the first norm's `x.float()` is it: fp32 hidden states), whose bytes add up to
    activations.block_saved's. ("stop",) comes where the last tensor is saved (the MLP's output projection's
    input, which the mm's autograd saves before the mm runs): a checkpointed block's recomputation ends there
    (non-reentrant checkpoint's early stop, `torch.utils.checkpoint` `_StopRecomputationError`, on by default),
    its temporaries dropped.

    None where the block is not written so (the writer then puts down its saved tensors as one burst): tensor
    or context parallelism, a transformers model's LayerNorm (GPT-2), sandwich norms, q/k norms, dropout, eager
    attention or SDPA's math backend, GELU-new, partial rotary embeddings.

    Followed from transformers' modeling code (modeling_llama.py `LlamaRMSNorm.forward`, `LlamaAttention.
    forward`, `apply_rotary_pos_emb`/`rotate_half`, `LlamaMLP.forward`, `LlamaDecoderLayer.forward`;
    integrations/sdpa_attention.py `sdpa_attention_forward` with `repeat_kv`; modeling_phi3.py's fused
    projections and its `torch.cat([..., q_pass])`) and from validate/model.py for the reference decoder; the
    order and sizes are those a TorchDispatchMode sees under no_grad on the CPU (Llama fp32, bf16, autocast;
    Mistral with a materialized mask; Phi-3). What autograd saves: each op's derivatives.yaml formula (mul
    saves the other factor only where it requires grad, so RoPE's `q * cos` saves the table, not q; rsqrt
    its result; silu its input; mm its input). Autocast casts a Linear's weight (cached) and then its fp32
    input; SDPA's bool mask becomes a float one inside the call (attention.cpp `convert_boolean_attn_mask`);
    the flash kernels return a logsumexp (saved for backward, else dropped by the Python call), the
    memory-efficient one computes none without grad (`compute_log_sumexp`). Left out: autocast's cached casts of
    the biases (Qwen2's q/k/v, the reference decoder's GPT-2 style), 1-D and small-pool sized."""
    m = train.model
    hf = bool(m.hf_model_type)
    if (train.tp > 1 or train.cp > 1 or train.sequence_parallel or (hf and m.norm != "rmsnorm") or m.sandwich_norms
            or m.qk_norm or m.attn_dropout > 0 or m.resid_dropout > 0 or m.activation == "gelu_new"
            or train.attention != "sdpa" or (hf and hf_eager(train)) or m.final_softcap
            or (m.rotary_dim and m.rotary_dim != m.head_dim) or m.mlp not in ("swiglu", "gelu")
            or (m.mlp == "gelu" and hf)):
        return None
    if hf:
        backend = _hf_sdpa_backend(train, regime, device)
    elif sdpa_math(train, regime, device):
        backend = "math"
    else:  # the reference decoder: no fp32 flash on CUDA (activations.sdpa_math)
        backend = "efficient" if device == "cuda" and regime == "fp32" else "flash"
    if backend == "math":
        return None
    h, q, kv, f, a, hd = m.hidden, m.q_dim, m.kv_dim, m.ffn_hidden, m.heads, m.head_dim
    b, s = train.micro_batch, train.seq_len
    auto = regime == "autocast"
    r = 4 if regime in ("fp32", "autocast") else 2  # the residual stream (the embedding's dtype)
    e = 4 if regime == "fp32" else 2  # a Linear's output
    ops: list = []
    names = iter(range(1 << 30))
    saved: list = []  # in `_block_saved_shapes` order
    keep: set = set()
    sizes = {"x": n * h * r}

    def new(nbytes: int, save: bool = False) -> str:
        k = f"t{next(names)}"
        ops.append(("a", k, nbytes))
        sizes[k] = nbytes
        if save and grad:
            saved.append(k)
            keep.add(k)
        return k

    def free(*keys) -> None:
        gone = tuple(k for k in keys if k is not None and k not in keep)
        if gone:
            ops.append(("f",) + gone)

    def save(k: str) -> None:
        if grad:
            saved.append(k)
            keep.add(k)

    def norm(x: str, x_bytes: int) -> str:
        if m.norm == "layernorm":
            # F.layer_norm -> native_layer_norm: its output, then mean and rstd (fp32 on CUDA, the input's dtype
            # on the CPU: activations._norm_parts), which it saves with its input; the output in the input's
            # dtype (autocast runs it in fp32: the residual stream is fp32 there)
            save(x)
            stat = 4 if device == "cuda" else x_bytes
            out = new(n * h * x_bytes)
            mean, rstd = new(n * stat, True), new(n * stat, True)
            free(mean, rstd)
            if not auto:
                save(out)
            return out
        # x.float() (a copy of a 16-bit input; pow and mul save it), pow(2), mean, + eps, rsqrt (saved),
        # x * rstd (saved by `weight *`; in 16 bits its cast is), .to(input dtype), * weight
        xf = new(n * h * 4, True) if x_bytes != 4 else None
        if xf is None:
            save(x)
        pw = new(n * h * 4)
        var = new(n * 4)
        free(pw)
        ve = new(n * 4)
        if not hf:  # validate/model.py: the mean is a temporary of the `+ eps`
            free(var)
        rs = new(n * 4, True)
        free(ve)
        xn = new(n * h * 4, x_bytes == 4)
        free(rs)
        if xf:
            free(xf)
        if x_bytes != 4:
            xc = new(n * h * 2, True)
            out = new(n * h * 2, True)
            free(xc, xn)
        else:
            out = new(n * h * 4, not auto)  # under autocast each Linear saves its own 16-bit cast instead
            free(xn)
        if hf:  # LlamaRMSNorm's `variance`, a local to the return
            free(var)
        return out

    def linear(out_elems: int, weights: tuple, fp32_input: bool, save_out: bool, last: bool = False) -> str:
        # `last`: the mm's autograd saves its input before it runs (VariableType), the block's last save
        c = None
        if auto:
            ops.append(("w", weights))
            c = new(n * h * 2, True) if fp32_input else None  # saved by the mm
        if last:
            ops.append(("stop",))
        y = new(n * out_elems * (2 if auto else e), save_out)
        free(c)
        return y

    # attention
    n1 = norm("x", r)
    fused = m.fused_qkv
    rope = m.position == "rope"
    if fused:
        qkv = linear(q + 2 * kv, (0, 1, 2), True, True)  # v is a view of it: SDPA keeps the whole buffer
        qk, kk, vk = None, None, qkv
    else:
        qk = linear(q, (0,), True, False)
        kk = linear(kv, (1,), True, False)
        vk = None
    cos_sin = []
    rr = r if hf else e  # q * cos: HF's tables are in the embedding's dtype (fp32 under autocast), ours in q's
    q_bytes = k_bytes = e
    embedded = []
    mask = hf and _hf_mask(train)
    repeated = mask and kv < q  # `repeat_kv`: SDPA saves the repeated K/V instead
    if not fused:
        vk = linear(kv, (2,), True, False)
    if rope and not hf and e != 4:  # validate/model.py `cos.to(q.dtype)`: a per-block copy of each table,
        cos_sin = [new(s * hd * e, True), new(s * hd * e, True)]  # which `q * cos` saves
    for width, src in ((q, qk), (kv, kk)):
        if not rope:
            break
        c1 = new(n * width * rr)
        ng = new(n * width // 2 * e)
        ct = new(n * width * e)
        free(ng)
        c2 = new(n * width * rr)
        free(ct)
        emb = new(n * width * rr)
        free(c1, c2)
        if m.hf_model_type == "phi3":  # torch.cat([rotated, q_pass], dim=-1)
            cat = new(n * width * rr)
            free(emb)
            emb = cat
        if not hf and src is not None:  # `q = q * cos + rotate_half(q) * sin` rebinds q
            free(src)
        embedded.append(emb)
    if rope:
        if hf and not fused:  # `query_states, key_states = apply_rotary_pos_emb(...)` rebinds both
            free(qk, kk)
        q_bytes = k_bytes = rr
        qe, ke = embedded
    else:
        qe, ke = qk, kk
    # sdpa_attention_forward: K/V repeated to every head where a mask is passed (`repeat_kv`), then SDPA
    temps = []
    q_in, k_in, v_in = qe, ke, vk
    if repeated:
        k_in, v_in = new(n * q * k_bytes), new(n * q * e)
        temps += [k_in, v_in]
    if auto:  # SDPA is on autocast's lower-precision list: fp32 q (and k) cast, k first
        if k_bytes == 4:
            k_in = new(sizes[k_in] // 2)
            temps.append(k_in)
        if q_bytes == 4:
            q_in = new(n * q * 2)
            temps.append(q_in)
    for k in (q_in, k_in) + (() if fused and not repeated else (v_in,)):  # what SDPA saves (v: a view of qkv)
        save(k)
    if mask:  # `where(mask, 0, -inf)`: the two scalars, then the float mask
        me = 2 if auto else e
        sc = (new(me), new(me))
        mc = new(b * s * s * me)
        free(*sc)
        temps.append(mc)
    es = 2 if auto else e
    y = new(n * q * es, True)
    if backend == "flash" or grad:
        free(new(n * a * 4, True))  # logsumexp
    if mask:
        save(mc)
    free(*temps)
    if hf_output_copied(train, device, backend):
        yc = new(n * q * es, True)  # `.transpose(1, 2).contiguous()` of a (B, nh, S, hd) output
        free(y)
        y = yc
    o = linear(h, (3,), False, False)
    free(y, *(x for x in (qe, ke) if rope), *([qkv] if fused else [vk] if rope else [qk, kk, vk]), *cos_sin)
    free(n1)
    x1 = new(n * h * r)
    free(o)
    # MLP
    n2 = norm(x1, r)
    if m.mlp == "gelu":  # the reference decoder's F.gelu(fc(x), approximate="tanh")
        fc = linear(f, (4,), True, True)
        g = new(n * f * e, True)
        free(fc)
        d = linear(h, (5,), False, False, last=True)
        free(g)
    elif m.fused_gate_up:
        gu = linear(2 * f, (4, 5), True, True)
        sl = new(n * f * e, True)
        p = new(n * f * e, True)
        free(sl)
        d = linear(h, (6,), False, False, last=True)
        free(p, gu)
    else:
        g = linear(f, (4,), True, True)
        sl = new(n * f * e)
        free(g)
        u = linear(f, (5,), True, True)
        save(sl)  # listed gate, up, silu(gate), product
        p = new(n * f * e, True)
        free(sl, u)
        d = linear(h, (6,), False, False, last=True)
        free(p)
    free(n2)
    ops.append(("a", "out", n * h * r))
    free(d, x1)
    if grad:
        free("x")
        ops.append(("s",) + tuple(saved))
        if sum(sizes[k] for k in saved) != block_saved(train, regime, device):
            return None
    return tuple(ops)


@lru_cache(maxsize=256)
def _compiled(ops: tuple, cast_sizes: tuple, x_size: int, recompute: bool = False) -> tuple:
    """`block_program` ops as the events `_Events.put` writes in one go (what writing them one by one would:
    keys in allocation order): (template, count, out, saved, saved bytes, casts, unwind), where a template entry
    (bytes, i) allocates the block's i-th key (1-based) and (None, i) frees it, 0 being the input; `out` the
    output's key, `saved` / `casts` those of the saved tensors and of the weight casts. `recompute`: to the early
    stop, `unwind` then the keys of what is not saved (the temporaries it drops)."""
    idx: dict = {"x": 0}
    sizes = {"x": x_size}
    template: list = []
    casts: list = []
    count = 0
    for op in ops:
        kind = op[0]
        if kind in ("a", "w"):
            count += 1
            name = op[1] if kind == "a" else ("w", count)
            idx[name] = count
            sizes[name] = op[2] if kind == "a" else sum(cast_sizes[i] for i in op[1])
            template.append((sizes[name], count))
            if kind == "w":
                casts.append(count)
        elif kind == "f":
            template.extend((None, idx.pop(k)) for k in op[1:])
        elif kind == "stop" and recompute:
            break
    names = ops[-1][1:] if ops[-1][0] == "s" else ()
    unwind = tuple(i for k, i in idx.items() if recompute and k != "x" and k not in names and i not in casts)
    return (tuple(template), count, idx.get("out"), tuple(idx[k] for k in names), tuple(sizes[k] for k in names),
            tuple(casts), unwind)


def _split(total: int, parts: list[int]) -> list[int]:
    """`parts` (the shapes' bytes) scaled so they add up to `total` (the planner's bytes): the largest
    part absorbs the difference when it is small, else every part is scaled."""
    if total <= 0:
        return []
    s = sum(parts)
    if s <= 0:
        return [total]
    if s <= total:
        return parts + ([total - s] if total - s >= 512 else [])
    k = total / s
    return [max(1, int(p * k)) for p in parts]


def _consumed(sizes: list[int], freed: int, rest: int = 0) -> int:
    """Index of the first of `sizes`' last entries that add up to at most `freed` bytes (the saved tensors a
    block's backward has consumed by its peak, backward running from the block's end); `rest` trailing entries
    (`_split`'s remainder) are not counted."""
    cut, got = len(sizes) - rest, 0
    while cut > 0 and got + sizes[cut - 1] <= freed:
        cut -= 1
        got += sizes[cut]
    return cut


def _grads_by_peak(shapes, elems: int) -> list[int]:
    """Indices into a block's parameter `shapes` (registration order) of the weight gradients made by the block
    backward's peak: its last Linears' (the MLP's output projection first) while they add up to at most
    `elems` (memory._block_backward_peak's weight-gradient elements)."""
    out, got = [], 0
    for i in reversed(range(len(shapes))):
        if len(shapes[i]) != 2:
            continue
        if got + prod(shapes[i]) > elems:
            break
        out.append(i)
        got += prod(shapes[i])
    return sorted(out)


def _block_saved_shapes(train: TrainConfig, regime: str, n: int, device: str = "cuda") -> list[int]:
    """The tensors one block keeps for backward, in the order forward makes them (bytes of each); what is not
    listed is the last entry (`_split`: dropout masks, Qwen3's q/k norms, per-block RoPE tables, the math
    and eager attention's scores).

    A transformers model: the tensors activations.py counts, read from it one by one: each norm's saved
    input, rsqrt and x*rstd and its output as each Linear after it saves it (under autocast, one 16-bit cast
    per Linear; `activations._norm_parts`); SDPA's q, k, v (repeated to every head where transformers passes
    a mask), output, logsumexp and mask (`_hf_attention_parts`); the MLP's (`_mlp_parts`). Eager attention,
    SDPA's math backend and a fused q/k/v projection keep the coarse list. Against the trace's own
    run at real size (16 ranks, 4096 tokens; Mistral, Llama-3, Qwen2.5, Qwen3, Phi-3; 72 strategy x model
    rows) the analytic reserved peak moved from median |1.0|% (ZeRO-1 and DDP 3-7% under, where the
    remainder was one tensor of up to 304 MiB) to 0.3%, 66 of 72 within 5% (64 before); zero3 with full
    checkpointing moved further over (+0.5 to +8 points: tests/test_hf_reserved.py REAL_SIZE). The CPU
    recordings read by this writer: median |0.65|% -> 0.3%. The reference decoder keeps the coarser list (its
    recorded pipeline stages agree better with it: tests/test_alloc_trace.py)."""
    m = train.model
    e = 4 if regime == "fp32" else 2
    h, q, kv, f, a = m.hidden, m.q_dim, m.kv_dim, m.ffn_hidden, m.heads
    # SwiGLU: gate, up, silu(gate), their product; GELU: fc's output and the activation's; transformers'
    # NewGELUActivation (gelu_new) also its tanh's output, 0.5 x and 1 + tanh (activations._mlp_saved)
    mlp = [n * f * e] * (4 if m.mlp == "swiglu" else 5 if m.activation == "gelu_new" else 2)
    attn = [n * q * e, n * kv * e, n * kv * e, n * q * e, n * a * 4]
    if not m.hf_model_type:
        norm = [n * h * 4, n * 4, n * h * e] if regime != "fp32" else [n * h * 4, n * 4]
        return norm + attn + norm + mlp
    if (train.attention == "sdpa" and not hf_eager(train) and not m.fused_qkv
            and _hf_sdpa_backend(train, regime, device) != "math"):
        # (a fused projection's and the math backend's tensors one by one read further from the trace's own
        # run: Phi-3-mini at real size, 16 ranks, full checkpointing: zero2 +5.3% -> +7.2%, ddp +1.2 -> +2.2%)
        attn = _hf_attention_parts(train, regime, n, device)
    attn_consumers = 1 if m.fused_qkv else 3
    mlp_consumers = 2 if m.mlp == "swiglu" and not m.fused_gate_up else 1
    return (_norm_parts(train, regime, n, attn_consumers, device) + attn
            + _norm_parts(train, regime, n, mlp_consumers, device) + _mlp_parts(train, regime, n))


def _fsdp2_construct(E: _Events, units: list, full: list, shard: int, pb: int, meta: bool = False) -> list[int]:
    """FSDP2 construction (`fully_shard` per block, then the root: units[0] and units[-1], the embedding and
    the head): each parameter's padded dim-0 shard (`FSDPParam._init_sharded_param`, kept for the run),
    then its full tensor (`full`'s key) goes. Built on the meta device (`meta`), `fully_shard` allocates
    nothing and `to_empty` materializes the shards in module order instead (`nn.Module._apply`: children
    first, depth first: the embedding, the blocks, the final norm and the head), as the recorded CPU traces
    show. Returns the shards' elements in parameter order."""
    def shard_of(s):
        return -(-s[0] // shard) * prod(s[1:])
    L = len(units) - 2
    for u in (range(L + 2) if meta else list(range(1, L + 1)) + [0, L + 1]):
        for i, s in enumerate(units[u]):
            E.a(shard_of(s) * pb)
            E.f(full[u][i])
    return [shard_of(s) for u in units for s in u]


def _fsdp2_gather(E: _Events, shapes, shard: int, ud: int, mixed: bool = False) -> int:
    """FSDP2 `foreach_all_gather`: one flat output (padded shards of every rank) on the copy-in stream.
    Under mixed precision `_get_param_all_gather_inputs` first casts the unit's shards into one
    `flat_foreach_copy_input` there (param_dtype), gone once the copy-in has read it."""
    elems = sum(-(-s[0] // shard) * prod(s[1:]) for s in shapes)
    cast = E.a(elems * ud, 1) if mixed else None
    out = E.a(elems * shard * ud, 1)
    E.f(cast)
    return out


def _fsdp2_unshard(E: _Events, shapes, shard: int, ud: int, mixed: bool = False) -> tuple[int, list[int]]:
    """All-gather + `foreach_all_gather_copy_out`: (flat output, per-parameter unsharded tensors)."""
    flat = _fsdp2_gather(E, shapes, shard, ud, mixed)
    return flat, _fsdp2_copy_out(E, shapes, shard, ud)


def _fsdp2_copy_out(E: _Events, shapes, shard: int, ud: int) -> list[int]:
    """The unsharded parameters `foreach_all_gather_copy_out` copies into: `FSDPParam.init_all_gather_outputs`
    makes each one of its padded shard's numel x the shard group's ranks (_fsdp_param.py), the parameter
    being an `as_strided` view of it, so a parameter whose dim 0 does not divide by the ranks (a MoE's
    experts: 4 rows over 8 ranks) holds its padding too."""
    return [E.a(-(-s[0] // shard) * prod(s[1:]) * shard * ud if s else ud) for s in shapes]


def _fsdp2_post_backward(E: _Events, u, g: list, params: list, rs_kept, unsharded: int, sharded: int, shapes,
                         *, sync: bool, reshard: bool, mixed: bool, rb: int, acc: dict, saved: dict,
                         grads: list, last_grad_late: bool = False):
    """FSDP2 `post_backward` (_fsdp_param_group.py) of unit `u`: `accumulate_unsharded_grad_if_needed`
    adds a new 16-bit gradient `g` to the kept reduce_dtype one (`acc`); without sync, reshard (unless
    `reshard` is off: set_reshard_after_backward(False)) and keep the gradients
    (`to_accumulated_grad_if_needed` upcasts them under mixed precision: the copy of each of `shapes`,
    then the 16-bit one goes); else collect, reshard, drop the previous reduce-scatter input, then
    `foreach_reduce`: its input, the new shard (added to `sharded_param.grad` if one is kept, `saved`:
    `to_accumulate_grad`; else appended to `grads`). `last_grad_late`: the unit's last
    gradient outlives the copy-in's `unsharded_grads.clear()` until `foreach_reduce` returns (its loop over
    `zip(fsdp_params, unsharded_grads)` leaves it in `unsharded_grad` when the shard group has more than one
    rank). Returns the reduce-scatter input now kept."""
    if u in acc:
        E.f(*g)
        g = []
    if not sync:
        if reshard:
            E.f(*params)
        if u not in acc:
            if mixed:
                up = []
                for x, s in zip(g, shapes):
                    up.append(E.a(prod(s) * rb))
                    E.f(x)
                g = up
            acc[u] = g
        return rs_kept
    collected = acc.pop(u, g)
    E.f(*params, rs_kept)
    rs_in = E.a(unsharded * rb)  # on the compute stream: foreach_reduce allocates it before entering the RS stream
    late = collected[-1:] if last_grad_late else []
    E.f(*collected[:len(collected) - len(late)])
    out = E.a(sharded * rb, 2)
    E.f(*late)
    if u in saved:
        E.f(out)
    else:
        saved[u] = out
        grads.append(out)
    return rs_in


@_collector_paused
def allocation_events(train: TrainConfig, strategy, world: int, shard: int, device: str = "cuda",
                      backend: str = "nccl", workspace: int = 0, init: str = "device") -> list:
    """The events of a run (construction, WARMUP_STEPS + MEASURED_STEPS steps) on the most loaded rank; see
    the module docstring. `world`/`shard`: the data-parallel ranks and the shard group size. `init`:
    'device' builds the whole model on the device and then wraps it (what the probes do); 'meta' builds
    it on the meta device and materializes only this rank's parameters after wrapping (`to_empty` +
    `init_weights`, torchtitan's way for FSDP), so no full-model copy ever exists on the device.
    `backend` does not change the events: what only gloo allocates (reduce_scatter's split copy) is on the
    CPU, where nothing is reserved."""
    st = get_strategy(strategy)
    family = st.family
    m = train.model
    prec = train.prec
    regime = regime_for(train, family)
    act = activations_in(train, regime, device)
    lay = layout(m, family, shard, st.shards_params, st.shards_optimizer)
    L = m.layers
    n = train.micro_batch * train.seq_len
    t = train.tp
    v = -(-m.vocab // t)  # one tensor-parallel rank's vocabulary (loss parallel: logits sharded over it)
    pb, gb, cb = prec.param_bytes, prec.grad_bytes, prec.compute_bytes
    r = 4 if regime in ("fp32", "autocast") else 2
    e = 4 if regime == "fp32" else 2
    root_shapes, block_shapes, _, _, _ = unit_sizes(m)
    n_embed = 1 + (m.position == "learned")
    embed_shapes, head_shapes = root_shapes[:n_embed], root_shapes[n_embed:]
    sharding = shard > 1 and st.shards_params
    fsdp = st.fsdp
    ud = (cb if prec.mixed else pb) if fsdp else pb  # unsharded parameter / gradient dtype
    rb = 4 if prec.mixed else gb  # FSDP reduce dtype
    ckpt = train.checkpointing != "none"
    A, every = train.grad_accum, train.sync_every
    E = _Events()

    # -- construction -------------------------------------------------------------------------------
    units = [list(embed_shapes)] + [list(block_shapes)] * L + [list(head_shapes)]
    meta = init == "meta" and fsdp
    # Pure 16-bit training, built on the device: the model is made in fp32 (the factory's and transformers'
    # default dtype) and then cast (`model.to(torch.bfloat16)`, as the probes do before wrapping:
    # validate/wrap.py, probe.py). `nn.Module._apply` casts children first, each parameter into a new
    # tensor before the fp32 one goes (`param.data = fn(param)`), so its fp32 segments stay reserved.
    built = 4 if pb == 2 and not prec.mixed and not meta else pb

    def cast_built(units_of: list, keys_of: list) -> list:
        """`model.to(16-bit)` over the units' fp32 parameters (in module order): each one's 16-bit copy,
        the fp32 one freed."""
        if built == pb:
            return keys_of
        out = []
        for u, keys in zip(units_of, keys_of):
            out.append([])
            for s, k in zip(u, keys):
                out[-1].append(E.a(prod(s) * pb))
                E.f(k)
        return out
    if t > 1 and not meta:
        # Tensor parallelism on a model built on the device (the probes): the whole model first, then
        # `parallelize_module` (`distribute_tensor`: each sharded parameter's local chunk scattered into
        # a new tensor, the whole one dropped; replicated ones kept as they are)
        from dataclasses import fields
        whole_spec = ModelSpec(**{f.name: getattr(m, f.name) for f in fields(ModelSpec)})
        w_root, w_block, _, _, _ = unit_sizes(whole_spec)
        w_units = [list(w_root[:n_embed])] + [list(w_block)] * L + [list(w_root[n_embed:])]
        whole = [[E.a(prod(s) * built) for s in u] for u in w_units]
        _tied_head_transient(E, m, built)
        whole = cast_built(w_units, whole)
        full = []
        for u, wu, keys in zip(units, w_units, whole):
            full.append([])
            for s, ws, k in zip(u, wu, keys):
                if tuple(s) == tuple(ws):
                    full[-1].append(k)
                else:
                    full[-1].append(E.a(prod(s) * pb))
                    E.f(k)
    else:
        full = [[None if meta else E.a(prod(s) * built) for s in u] for u in units]
        if not meta:
            _tied_head_transient(E, m, built)
            full = cast_built(units, full)
    if st.fsdp2:
        param_shards = _fsdp2_construct(E, units, full, shard if sharding else 1, pb, meta)
    elif st.fsdp1:
        # FlatParameter per block (ModuleWrapPolicy), the root's last; flatten, then keep a padded chunk
        order = list(range(1, L + 1)) + [0]
        for u in order:
            keys = full[u] + (full[L + 1] if u == 0 else [])
            elems = sum(prod(s) for s in units[u]) + (sum(prod(s) for s in units[L + 1]) if u == 0 else 0)
            if meta:  # FSDP1 materializes a meta unit before flattening it (_init_utils.py
                # `_materialize_meta_module`: to_empty + reset_parameters), one unit at a time
                keys = [E.a(prod(s) * pb) for s in units[u] + (units[L + 1] if u == 0 else [])]
            # `FlatParamHandle`: flatten_tensors_into_flat_param, then shard() keeps a chunk and frees the flat
            # tensor; the originals go after, once the module holds views of the flat parameter (the order the
            # recorded CPU traces show: flat, shard, flat freed, the originals freed)
            flat = E.a(elems * pb)
            if st.shards_params or st.shards_optimizer:
                E.a(-(-elems // shard) * pb)
                E.f(flat)
            E.f(*keys)
        param_shards = [lay.shard_root] + [lay.shard_block] * L
    else:
        param_shards = [prod(s) for u in units for s in u]
    buckets: list = []
    if st.ddp_reducer and world > 1:
        # DistributedDataParallel.__init__: `_sync_module_states` broadcasts the parameters from rank 0
        # through `_broadcast_coalesced` (buckets of at least 250 MiB, two in flight), then the Reducer's
        # first-iteration bucket holds every gradient (one bucket: limits [sys.maxsize]); rebuilt in
        # gradient-ready order in the second forward (`_rebuild_buckets`: old buckets freed first).
        _broadcast_coalesced(E, [prod(x) * pb for u in units for x in u])
        buckets = [E.a(lay.total * gb)]
    # optimizer: states owned by this rank (ZeRO-1: its partition; FSDP: the shards)
    if st.zero_optimizer and shard > 1:
        owned = [prod(s) for s in zero1_owned_shapes(m, shard)]
    else:
        owned = list(param_shards)
    # The walk's optimizer-state bytes (memory._opt_state: AdamW 2 states, SGD-momentum 1, 8-bit AdamW
    # uint8 states plus block statistics, Adafactor factored rows/columns), two tensors per parameter
    # (one for SGD-momentum), in proportion to its elements.
    st_elems, st_extra = _opt_state(m, train.optimizer, family, shard)
    st_total = st_elems * pb + int(st_extra)
    per_param = 1 if train.optimizer == "sgd-momentum" else 2
    if (train.cpu_offload == "params" and fsdp) or not owned or not st_total:
        st_total, owned = 0, []
    owned_sum = sum(owned) or 1
    state_sizes = [st_total * s // owned_sum // per_param for s in owned for _ in range(per_param)]
    E.a(train.micro_batch * train.seq_len * 8), E.a(train.micro_batch * train.seq_len * 8)  # ids, targets

    # -- one step -------------------------------------------------------------------------------------
    listed = _block_saved_shapes(train, regime, n, device)
    blk_saved = _split(act.per_block, listed)
    rest = 1 if len(blk_saved) > len(listed) else 0  # `_split`'s last entry: what the list leaves out
    kept = act.kept_each  # per block through forward (checkpointing: its input)
    kept_saved = blk_saved if not ckpt else _split(kept, [n * m.hidden * r])
    if act.every:  # every-K: blocks 0, K, 2K, ... keep their input, the others all they save
        kept_saved = _split(act.ckpt_kept, [n * m.hidden * r])

    def ck(j: int) -> bool:
        return j % act.every == 0 if act.every else ckpt

    def kept_by(j: int) -> list:
        return kept_saved if ck(j) else blk_saved
    blk_peak = _block_backward_peak(train, regime, n, device)
    blk_tmp = blk_peak[1]
    tmp_shapes = _split(blk_tmp, [n * m.hidden * r] + [n * m.ffn_hidden * e] * 3)
    early = _grads_by_peak(block_shapes, blk_peak[2])
    # A checkpointed block's recomputation saves what its forward saved, but its first norm's saved input is the
    # kept block input itself, not a new tensor (activations_in's `recompute_block`)
    rec_saved = blk_saved[1:] if m.hf_model_type and (m.norm == "layernorm" or regime != "lowp") else blk_saved
    weight_casts = [prod(s) * 2 for s in block_shapes if len(s) == 2] if regime == "autocast" else []
    cast_sizes = tuple(weight_casts)
    head_cast = [prod(s) * 2 for s in head_shapes if len(s) == 2] if regime == "autocast" else []
    outside = act.outside - act.inputs
    final_norm = (_norm_parts(train, regime, n, 1, device) if not m.sandwich_norms and t == 1
                  and not train.sequence_parallel and (m.norm == "rmsnorm" or not m.hf_model_type) else [])
    if sum(final_norm) > outside or len(final_norm) < 4:
        final_norm = []
    # The forward op by op (block_program) where every block and the final norm are written so: each block reads
    # the one before's output (the embedding's for block 0), which its first norm saves (fp32 hidden states) or
    # a checkpointed block keeps, and recomputes the same way in backward; else a block's saved tensors as one
    # burst (selective checkpointing among them: its forward saves some of them)
    no_grad = train.checkpointing == "full" or bool(act.every)
    fwd_ops = block_program(train, regime, n, device) if no_grad else None
    grad_ops = block_program(train, regime, n, device, True)
    carry = (bool(final_norm) and grad_ops is not None and (fwd_ops is not None if ckpt else True)
             and kept_saved[0] == n * m.hidden * r)
    if not carry:
        fwd_ops = grad_ops = None
    # nll_loss_backward's dense gradient + log_softmax_backward's output; loss parallel's fused backward
    # holds three (memory.estimate_memory's `loss_bwd_tmp`)
    loss_tmp = [n * v * 4] * (3 if t > 1 else 2)
    # Tensor parallelism (tp.py): each rowwise Linear's output (attention, MLP) is a partial sum that
    # DTensor's redistribution reduces into a new tensor (functional all_reduce; reduce_scatter to the
    # rank's tokens with sequence parallelism), the partial freed after it; backward does the same for
    # the gradient of the colwise Linears' input (the two norms' outputs). Allocated on the caller's
    # stream. (The all-gathered inputs that the colwise Linears save are in the block's saved bytes.)
    nt = sp_tokens(train, n)
    # (the vocabulary-sharded embedding's gradient is a Replicate DTensor of the whole vocabulary,
    # memory.estimate_memory's `emb_full`)
    emb_shapes = ([(m.vocab,) + tuple(embed_shapes[0][1:])] + list(embed_shapes[1:])) if t > 1 else list(embed_shapes)
    tp_pairs = [(n * m.hidden * e, nt * m.hidden * e)] * 2 if t > 1 else []
    states: list = []
    grads: list = []
    bucket_rebuilt = [False]

    def unshard_flat(u_shapes):
        return _fsdp2_gather(E, u_shapes, shard, ud, prec.mixed)

    def unshard(u_shapes):
        return _fsdp2_unshard(E, u_shapes, shard, ud, prec.mixed)

    def tp_reduce():
        for partial, out in tp_pairs:
            a = E.a(partial)
            b = E.a(out)
            E.f(a, b)

    def fsdp1_unshard(elems_shard):
        """`_unshard`: the low-precision shard (`_use_low_precision_shard`, on the pre-unshard stream) under
        mixed precision; sharded, the padded unsharded flat parameter on the unshard stream, the shard freed
        (`post_unshard`); NO_SHARD does not unshard (`needs_unshard`): the low-precision copy is the
        unsharded parameter until the reshard frees it."""
        mp = E.a(elems_shard * cb, 3) if prec.mixed else None
        if not sharding:
            return mp
        flat = E.a(elems_shard * shard * ud, 1)
        E.f(mp)
        return flat

    def fsdp1_reduce(u, view_grads, unsharded, elems, elems_shard, sync, keep):
        """A unit's backward end: the views' gradients concatenated into the flat gradient, then
        `_post_backward_hook` (on the post-backward stream): reshard, the cast to reduce_dtype under
        mixed precision, `_reduce_grad`'s output shard (reduce-scatter), or the all-reduced flat gradient
        (NO_SHARD). The tensor a collective reads goes to that stream's pool (allocator.comm_streams).
        Accumulation: a later micro-step's flat gradient is added in place to the kept one (AccumulateGrad)
        and freed; without sync (`_post_backward_hook` returns early) the unsharded flat gradient is kept
        in param_dtype, and SHARD_GRAD_OP keeps the unit unsharded (`_should_free_in_backward`); synced
        every micro-step, the new shard is added to `_saved_grad_shard` (`_accumulate_sharded_grad`)."""
        comm = world > 1
        # The flat gradient (the reduction reads it, or the one kept since the first micro-step): made by the
        # backward of the views `_use_unsharded_views` takes inside `_unshard`'s unshard-stream context, and
        # CUDA autograd runs a backward op on its forward op's stream: the unshard stream's pool
        flat_g = E.a(elems * ud, 1)
        E.f(*view_grads)
        if u in acc:  # added to the unsharded gradient kept by earlier micro-steps (without sync)
            E.f(flat_g)
            flat_g = acc.pop(u)
        if not sync:
            acc[u] = flat_g
            if not keep:
                E.f(unsharded)
            return unsharded if keep else None
        E.f(unsharded)
        src = flat_g
        if prec.mixed:
            src = E.a(elems * rb, 2 if comm else 0)
            E.f(flat_g)
        if sharding:
            out = E.a(elems_shard * rb, 2)
            E.f(src)
            if u in saved:  # `_saved_grad_shard += sharded_grad`
                E.f(out)
            else:
                saved[u] = out
                grads.append(out)
        elif u in saved:  # NO_SHARD synced every micro-step: added to the kept gradient
            E.f(src)
        else:
            saved[u] = src
            grads.append(src)
        return None

    acc: dict = {}  # unit -> gradient kept unsharded between micro-steps without sync
    saved: dict = {}  # unit -> gradient kept (sharded when synced) for this step's later micro-steps
    kept_unsharded: dict = {}  # FSDP1 SHARD_GRAD_OP without sync: units left unsharded between micro-steps

    def micro_step(k: int):
        """Micro-step k of grad_accum: gradients made on the first are kept (or reduced and kept as
        shards); later ones add theirs into those (memory.estimate_memory's `carry`)."""
        sync = every or k == A - 1
        first = k == 0
        held: dict = dict(kept_unsharded)
        kept_unsharded.clear()
        keep = family == FSDP1 and not st.reshard_after_forward and not sync
        in_place = not fsdp or (family == FSDP2 and not prec.mixed)  # AccumulateGrad adds into .grad
        # the tied weight's gradients at the root's backward: of the parameter itself (single, DDP, ZeRO-1),
        # FSDP2's unsharded parameter or FSDP1's view of its flat parameter
        tied = m.tie_embeddings and t == 1
        tied_b = (ud if fsdp else gb)  # their dtype: FSDP's unsharded gradients are in param_dtype

        def new_grads(u, shapes):
            """The unit's new gradients; where a kept .grad takes them in place (AccumulateGrad:
            `variable_grad += new_grad`), each is freed as soon as it is added."""
            if not first and in_place and (u in acc or not fsdp):
                for s in shapes:  # each weight gradient is added as its Linear's backward makes it
                    E.f(E.a(prod(s) * (ud if fsdp else gb)))
                return []
            return [E.a(prod(s) * (ud if fsdp else gb)) for s in shapes]

        def keep_grads(u, g):
            if first:
                grads.extend(g)
            else:  # (FSDP2 on one rank: added into the kept .grad)
                E.f(*g)

        def fsdp2_post(u, g, params, rs_kept, unsharded, sharded):
            return _fsdp2_post_backward(E, u, g, params, rs_kept, unsharded, sharded,
                                        block_shapes if u != "root" else list(head_shapes) + emb_shapes,
                                        sync=sync, reshard=True, mixed=prec.mixed, rb=rb, acc=acc, saved=saved,
                                        grads=grads)
        # forward
        if buckets and not bucket_rebuilt[0] and states:
            E.f(*buckets)
            buckets[:] = [E.a(b) for b in bucket_sizes(ready_order_sizes(m, regime == "autocast"), gb,
                                                        DDP_BUCKET_CAP_MB)]
            bucket_rebuilt[0] = True
        if family == FSDP2 and sharding:
            held["root"] = unshard(root_shapes)
            prev_flat = held["root"][0]
        elif family == FSDP1 and (sharding or prec.mixed) and "root" not in held:
            held["root"] = fsdp1_unshard(lay.shard_root)
        out_emb = E.a(n * m.hidden * r)
        cur = out_emb  # the hidden states (written op by op: `carry`)
        saved_sizes: dict = {}  # block -> the bytes of what it saved (written op by op)
        # what the blocks share (RoPE tables; eager attention's masks that checkpointed blocks keep), to the
        # end of block 0's backward
        shared = E.a(act.shared) if act.shared and L else None
        blocks: list = []
        # autocast's cache (aten/src/ATen/autocast_mode.cpp `cached_cast`: the 16-bit cast of a leaf that
        # requires grad is kept for the whole autocast region): a checkpointed block saves none of its
        # weights' casts, yet they stay alive until the region exits after the loss (`clear_cache` when
        # torch.autocast's __exit__ takes the nesting to 0; memory.py counts them as `weight_cache_forward`)
        cached: list = []
        for j in range(L):
            if family == FSDP2 and sharding:
                flat, params = unshard(block_shapes)
                E.f(prev_flat)
                prev_flat = flat
                held[j] = params
            elif family == FSDP1 and (sharding or prec.mixed) and j not in held:
                held[j] = fsdp1_unshard(lay.shard_block)
            if carry:  # op by op; a checkpointed block runs without saving and keeps its input
                template, count, out_i, saved_i, saved_b, cast_i, _ = _compiled(
                    fwd_ops if ck(j) else grad_ops, cast_sizes, n * m.hidden * r)
                base = E.put(template, count, cur)
                casts_kept = [base + i for i in cast_i]
                if ck(j):
                    cached.extend(casts_kept)
                    blocks.append(([cur] + [E.a(s) for s in kept_saved[1:]], []))
                else:
                    blocks.append(([base + i if i else cur for i in saved_i], casts_kept))
                    saved_sizes[j] = list(saved_b)
                cur = base + out_i
            else:
                casts = [E.a(c) for c in weight_casts]
                if ck(j):  # the block runs without saving (one burst), then keeps its input
                    tr = [E.a(s) for s in blk_saved]
                    E.f(*tr)
                    casts_kept = []
                    cached.extend(casts)
                else:
                    casts_kept = casts
                blocks.append(([E.a(s) for s in kept_by(j)], casts_kept))
            tp_reduce()
            # resharded after forward: FULL_SHARD / zero3; NO_SHARD under mixed precision frees its 16-bit
            # copy (`_runtime_utils._post_forward` -> `_reshard` -> `handle.post_reshard`)
            no_shard_mp = family == FSDP1 and not sharding and prec.mixed
            if ((st.reshard_after_forward and sharding) or no_shard_mp) and j in held:
                E.f(*(held.pop(j) if family == FSDP2 else [held.pop(j)]))
        # the final norm and the LM head's input (activations.ActivationBreakdown.outside): an RMSNorm's saved
        # tensors one by one in the order its forward makes them (`pow`'s output and, in lowp, the fp32 x * rstd
        # are transients), then under autocast the head's cached weight cast and its cast of the input
        if final_norm and m.norm == "layernorm":  # its input (the last block's output), its output, mean, rstd
            head_saved = [cur if carry else E.a(final_norm[0])]
            out_n = E.a(final_norm[3]) if regime != "autocast" else E.a(n * m.hidden * 4)
            head_saved += [E.a(final_norm[1]), E.a(final_norm[2])]
            hc = [E.a(c) for c in head_cast]
            if regime == "autocast":  # the head saves its 16-bit cast of the fp32 output
                head_saved += [E.a(x) for x in final_norm[3:]]
                E.f(out_n)
            else:
                head_saved.append(out_n)
            if outside > sum(final_norm):
                head_saved.append(E.a(outside - sum(final_norm)))
        elif final_norm:
            # (written op by op, its fp32 input is the last block's output, which `x.float()` returns)
            head_saved = [cur if carry and r == 4 else E.a(final_norm[0])]
            E.f(E.a(n * m.hidden * 4))  # pow(2), read by mean
            head_saved.append(E.a(final_norm[1]))
            xr = E.a(n * m.hidden * 4) if regime == "lowp" else None  # x * rstd, cast to 16 bits and dropped
            head_saved.append(E.a(final_norm[2]))
            if regime != "autocast":  # the norm's output, which the head saves
                head_saved += [E.a(x) for x in final_norm[3:]]
            if carry and r != 4:
                E.f(cur)  # the 16-bit hidden states (the recorded CPU traces drop them here)
            E.f(xr)  # a local to the norm's return
            hc = [E.a(c) for c in head_cast]
            if regime == "autocast":  # the head's 16-bit cast of its input, after its weight's
                head_saved += [E.a(x) for x in final_norm[3:]]
            if outside > sum(final_norm):
                head_saved.append(E.a(outside - sum(final_norm)))
        else:
            hc = [E.a(c) for c in head_cast]
            head_saved = [E.a(outside)]
        # The loss as transformers' ForCausalLMLoss (loss/loss_utils.py) and the reference decoder compute it:
        # 16-bit logits are upcast (`logits.float()`, a new n x V fp32 tensor alive beside log_softmax's
        # output, then dropped); in backward the logits' fp32 gradient is cast back (ToCopyBackward, n x V in
        # the logits' dtype) before the head's matmul backward reads it (the recorded CPU traces' order).
        # The walk counts both (activations `logits_transient`, memory `loss_bwd_tmp`).
        upcast = cb != 4 and t == 1
        logits = E.a(n * v * cb)
        up = E.a(n * v * 4) if upcast else None
        logp = E.a(act.loss_saved)
        E.f(up)  # the loss function's upcast, a local of ForCausalLMLoss
        if family == FSDP2 and sharding:
            # the last block's all-gather output is kept for the copy-out's overlap with a next all-gather
            # (`comm_ctx.all_gather_state`) until the root's `_post_forward` frees it, the loss computed inside
            # the model's forward (transformers' and the reference decoder's); the logits are the output's,
            # dropped after (the recorded CPU traces' order)
            E.f(prev_flat)
        E.f(logits)
        E.f(*cached)  # the autocast region exits with the loss computed
        pending: dict = {}  # FSDP2: prefetched all-gather outputs not yet copied out
        if family == FSDP2 and sharding and L and L - 1 not in held:
            # backward begins at the root's pre-backward hook on the loss (`FSDPState._pre_backward`), whose
            # `_backward_prefetch` all-gathers the unit before it in post-forward order, the last block, before
            # the loss's and the head's backward run (their n x V tensors beside it)
            pending[L - 1] = unshard_flat(block_shapes)
        elif family == FSDP1 and (sharding or prec.mixed) and L and L - 1 not in held:
            # FSDP1 the same: the root handle's `_pre_backward_hook` on the loss, then `_prefetch_handle`
            # (BACKWARD_PRE) unshards the handle before it in post-forward order, the last block's
            # (`_exec_order_utils.py` get_handle_to_backward_prefetch)
            held[L - 1] = fsdp1_unshard(lay.shard_block)
        # backward: the loss and the head
        lt = [E.a(x) for x in loss_tmp]
        E.f(*lt[:-1], logp)
        grad_logits = lt[-1]
        if upcast:
            grad_logits = E.a(n * v * cb)
            E.f(lt[-1])
        done = [grad_logits, *hc, *head_saved]  # freed when the head's matmul backward node has run
        if regime == "autocast" and t == 1:
            # fp32 parameters under autocast: the head's matmul backward makes its weight's gradient in 16 bits
            # (the matmul ran on the weight's cast), its node then drops what it saved and the logits'
            # gradient, and the cast's backward (ToCopyBackward) makes the fp32 gradient, the 16-bit one freed
            # after (the H100's recorded events; memory.py's `w_head` instant)
            w16 = [E.a(prod(s) * 2) for s in head_shapes if len(s) == 2]
            E.f(*done)
            done = w16
        head_g = new_grads("root", head_shapes)
        # A tied weight (the parameter, FSDP2's unsharded parameter, FSDP1's view): the head's matmul backward
        # makes its gradient beside the logits' gradient it reads (the recorded traces' order), and autograd holds
        # it in the weight's input buffer through every block's backward, until the embedding's arrives (below)
        tied_g = E.a(v * m.hidden * tied_b) if tied and carry else None
        E.f(*done)
        if tied and not carry:
            tied_g = E.a(v * m.hidden * tied_b)
        rs_kept = None

        def fsdp2_ready(j):
            """`wait_for_unshard` in pre_backward: copy out the (prefetched) all-gather output."""
            if j in held or j < 0:
                return
            flat = pending.pop(j, None)
            if flat is None:
                flat = unshard_flat(block_shapes)
            held[j] = _fsdp2_copy_out(E, block_shapes, shard, ud)
            E.f(flat)

        for j in reversed(range(L)):
            # pre_backward: this block unsharded (or still so from forward), then `_backward_prefetch`
            # issues the next one's all-gather (BACKWARD_PRE for FSDP1)
            if family == FSDP2 and sharding:
                fsdp2_ready(j)
                if j > 0 and j - 1 not in held and j - 1 not in pending:
                    pending[j - 1] = unshard_flat(block_shapes)
            elif family == FSDP1 and (sharding or prec.mixed):
                for k in (j, j - 1):
                    if k >= 0 and k not in held:
                        held[k] = fsdp1_unshard(lay.shard_block)
            keys, casts = blocks[j]
            if t > 1:
                # tensor parallelism: the block's backward as one burst (its recorded CPU runs agree better so:
                # single at tp 2, 0.2% against 2.6% written in phases as below)
                if ck(j):
                    casts = [E.a(c) for c in weight_casts]
                    E.f(*keys)
                    keys = [E.a(s) for s in blk_saved]
                tp_reduce()
                tmp = [E.a(s) for s in tmp_shapes]
                g = new_grads(j, block_shapes)
                E.f(*keys, *casts, *tmp)
            else:
                sizes = saved_sizes.get(j) or kept_by(j)
                rest_j = 0 if j in saved_sizes else rest
                if ck(j) and carry:  # recomputed op by op beside its kept input, to the early stop
                    template, count, _, saved_i, saved_b, cast_i, unwind = _compiled(
                        grad_ops, cast_sizes, n * m.hidden * r, True)
                    base = E.put(template, count, keys[0])
                    E.f(*(base + i for i in unwind))
                    casts = [base + i for i in cast_i]
                    keys = keys + [base + i for i in saved_i if i]
                    sizes = sizes + [b for i, b in zip(saved_i, saved_b) if i]
                elif ck(j):  # recomputed next to its kept input, which the checkpoint holds to the block's end
                    rest_j = rest
                    casts = [E.a(c) for c in weight_casts]
                    keys = keys + [E.a(s) for s in rec_saved]
                    sizes = sizes + rec_saved
                # The block's backward runs from its end: by its peak (memory._block_backward_peak) the ops there
                # have consumed their saved tensors (the last ones forward made: the MLP's product) and made their
                # transients and those Linears' weight gradients; then the rest of its gradients, and the saved
                # tensors go
                cut = _consumed(sizes, blk_peak[0], rest_j)
                E.f(*keys[cut:len(keys) - rest_j])
                tmp = [E.a(s) for s in tmp_shapes]
                g_early = new_grads(j, [block_shapes[i] for i in early])
                E.f(*tmp)
                late = [i for i in range(len(block_shapes)) if i not in early]
                g_late = new_grads(j, [block_shapes[i] for i in late])
                order = dict(zip(early + late, g_early + g_late))
                g = [order[i] for i in sorted(order)]
                E.f(*keys[:cut], *keys[len(keys) - rest_j:], *casts)
            if family == FSDP2 and sharding:
                rs_kept = fsdp2_post(j, g, held.pop(j), rs_kept, lay.unshard_block, lay.shard_block)
            elif family == FSDP1:
                u = fsdp1_reduce(j, g, held.pop(j, None), lay.unshard_block, lay.shard_block, sync, keep)
                if u is not None:
                    kept_unsharded[j] = u
            else:
                keep_grads(j, g)
        if shared is not None:
            E.f(shared)
        # the embedding's gradient and the root
        if tied:
            # embedding_dense_backward's gradient and its sum with the head's (input_buffer.cpp `accumulate`:
            # `old_var + var`, a new tensor, as the recorded traces show), both addends then freed: three
            # vocab x hidden gradients at once; the sum is the weight's gradient (or, in a later micro-step,
            # added into .grad and freed)
            addend = E.a(prod(emb_shapes[0]) * tied_b)
            total = E.a(prod(emb_shapes[0]) * tied_b)
            E.f(tied_g, addend)
            emb_g = [total] + new_grads("root", emb_shapes[1:])
            if not first and in_place and ("root" in acc or not fsdp):  # as new_grads
                E.f(*emb_g)
                emb_g = []
        else:
            emb_g = new_grads("root", emb_shapes)
        if not carry:  # (else block 0's input, freed with it)
            E.f(out_emb)
        if family == FSDP2 and sharding:
            E.f(fsdp2_post("root", head_g + emb_g, held.pop("root")[1], rs_kept, lay.unshard_root,
                           lay.shard_root))
        elif family == FSDP1:
            u = fsdp1_reduce("root", head_g + emb_g, held.pop("root", None), lay.unshard_root, lay.shard_root,
                             sync, keep)
            if u is not None:
                kept_unsharded["root"] = u
        else:
            keep_grads("root", head_g + emb_g)
        for k in list(held):
            E.f(*(held.pop(k) if isinstance(held[k], list) else [held.pop(k)]))

    def step():
        # grad_accum micro-steps, then the optimizer. The micro-steps between the second and the last repeat
        # the second's allocations (each frees what it makes but the kept gradients), so the caching
        # allocator is back in the same state after each: the first, the second and the last bound the run
        # (and keep a grad_accum of 2**20 as cheap as 3)
        for k in sorted({0, min(1, A - 1), A - 1}):
            micro_step(k)
        if state_sizes and not states:  # made lazily in the first step (`_init_group`)
            states.extend(E.a(z) for z in state_sizes)
        _adam_temporaries(E, [s * pb for s in owned], train.optimizer, train.optimizer_impl)
        E.f(*grads)
        grads.clear()
        saved.clear()
        assert not acc, "unsynced gradients at the optimizer step"

    first = True
    for _ in range(WARMUP_STEPS + MEASURED_STEPS):
        if first and workspace:
            E.a(workspace)  # the first GEMM's cuBLAS workspace (CublasHandlePool.cpp), kept
        first = False
        step()
    return E.ev


def _tied_head_transient(E: _Events, m, pb: int) -> None:
    """A transformers model with tied embeddings, built on the device: its `*ForCausalLM.__init__` makes the
    LM head as an `nn.Linear` of its own (`self.lm_head = nn.Linear(hidden, vocab)`: a vocab x hidden weight,
    initialised) after the decoder, and `post_init` -> `tie_weights` points it at the embedding's weight,
    dropping its own: one embedding-sized allocation and free at the end of construction, whose segment the
    allocator keeps (seen in the CPU probes' recorded traces: transformers 5.24 Qwen2 at vocabulary 32,768,
    a 64 MiB alloc and free after the last block's parameters). The reference decoder (`hf_model_type` "")
    makes no head when tied."""
    if m.tie_embeddings and m.hf_model_type:
        E.f(E.a(m.vocab * m.hidden * pb))


def _trace_fields(st) -> tuple:
    """What `allocation_events` reads of a strategy: two with the same write the same events."""
    return st.family, st.shards_params, st.shards_optimizer, st.reshard_after_forward


_TRACE_NAMES = {s.name: next(t.name for t in REGISTRY.values() if _trace_fields(t) == _trace_fields(s))
                for s in REGISTRY.values()}
"""Registry name -> the first registry strategy that writes the same events (`_trace_fields`): hsdp -> fsdp
(FSDP1 HYBRID_SHARD allocates as FULL_SHARD over its shard group, which the callers pass), the others
themselves. The replay caches below are keyed by it, so that hsdp inside one node (the same world and
shard as fsdp) is neither written nor replayed again (tests/test_alloc_trace.py checks the events)."""


def _trace_name(strategy) -> str:
    st = get_strategy(strategy)
    return _TRACE_NAMES[st.name] if REGISTRY.get(st.name) is st else st.name


def reserved_peak(train: TrainConfig, strategy, world: int, shard: int, device: str = "cuda",
                  backend: str = "nccl", workspace: int = 0, expandable_segments: bool = False,
                  init: str = "device", max_split_size: int | None = None) -> tuple[int, int]:
    """(reserved peak, allocated peak) of the replayed run: what `max_memory_reserved` and
    `max_memory_allocated` would read."""
    args = (train, _trace_name(strategy), world, shard, device, backend, workspace, expandable_segments,
            init, max_split_size)
    got = _REPLAYED.get(args)
    return got if got is not None else _reserved_peak(*args)


def reserved_peak_within(limit: int, train: TrainConfig, strategy, world: int, shard: int, device: str = "cuda",
                         backend: str = "nccl", workspace: int = 0, expandable_segments: bool = False,
                         init: str = "device", max_split_size: int | None = None) -> tuple[int, int, int] | None:
    """The run on a device where the caching allocator can reserve `limit` bytes: (reserved peak, allocated
    peak, retries), or None when it runs out of memory there. The allocator releases its cached segments and
    retries a cudaMalloc that fails before it gives up (allocator.CachingAllocator.capacity), so a run
    whose reserved peak without a limit (`reserved_peak`) is above `limit` may still fit, at `retries`
    releases of the cache."""
    args = (train, _trace_name(strategy), world, shard, device, backend, workspace, expandable_segments,
            init, max_split_size)
    got = _REPLAYED.get(args)
    if got is not None and got[0] <= limit:  # fits without reaching the limit
        return got + (0,)
    key = args + (limit,)
    fit = _FIT.get(key, _FIT)
    if fit is _FIT:
        fit = replay_fit(allocation_events(train, args[1], world, shard, device, backend, workspace, init), limit,
                         expandable_segments=expandable_segments, max_split_size=max_split_size,
                         rounding=alloc_rounding(train.alloc_conf))
        _remember(key, fit, _FIT)
        if fit is not None and not fit[2]:  # never reached the limit: the run without one
            _remember(args, fit[:2])
    return fit


def reserved_peak_below(limit: int, train: TrainConfig, strategy, world: int, shard: int, device: str = "cuda",
                        backend: str = "nccl", workspace: int = 0, expandable_segments: bool = False,
                        init: str = "device", max_split_size: int | None = None) -> tuple[int, int] | None:
    """`reserved_peak` where it is at most `limit` bytes, else None: a replay not made yet stops at the
    first segment that passes the limit (allocator.replay's `stop_above`; the reserved bytes only grow
    without one), so the question "fits without the allocator releasing its cache" answered no costs part
    of a replay (the micro-batch and layout searches ask it most)."""
    args = (train, _trace_name(strategy), world, shard, device, backend, workspace, expandable_segments,
            init, max_split_size)
    got = _REPLAYED.get(args)
    if got is None:
        if _ABOVE.get(args, -1) >= limit:  # an earlier replay stopped above this limit or a higher one
            return None
        got = replay_peaks(allocation_events(train, args[1], world, shard, device, backend, workspace, init),
                           expandable_segments=expandable_segments, max_split_size=max_split_size, stop_above=limit,
                           rounding=alloc_rounding(train.alloc_conf))
        if got is None:
            _remember(args, limit, _ABOVE)
            return None
        _remember(args, got)
    return None if got[0] > limit else got


_REPLAYED: dict = {}  # reserved_peak's arguments -> its result, from any function above
_FIT: dict = {}  # reserved_peak_within's arguments (the limit last) -> its result
_ABOVE: dict = {}  # reserved_peak's arguments -> a limit its reserved peak is known to be above


def _remember(args, got, into: dict = _REPLAYED) -> None:
    if len(into) >= 4096:  # bounded: cleared when full
        into.clear()
    into[args] = got


def _forget() -> None:
    _REPLAYED.clear()
    _FIT.clear()
    _ABOVE.clear()


_remember.cache_clear = _forget  # api.clear_caches finds it


@lru_cache(maxsize=1024)
def _reserved_peak(train, name, world, shard, device, backend, workspace, expandable_segments, init,
                   max_split_size):
    got = replay_peaks(allocation_events(train, name, world, shard, device, backend, workspace, init),
                       expandable_segments=expandable_segments, max_split_size=max_split_size,
                       rounding=alloc_rounding(train.alloc_conf))
    _remember((train, name, world, shard, device, backend, workspace, expandable_segments, init, max_split_size),
              got)
    return got


LOGGED_FAMILIES = (SINGLE, DDP, ZERO1)
"""The families `logged_step_events` writes: the parameters stay whole, so the traced step's own allocations
are the run's, plus DDP's buckets and ZeRO-1's partition of the optimizer state. FSDP's unit all-gathers
and reduce-scatters between a module's ops are not written for a traced module (the margin instead)."""
LOGGED_OPTIMIZERS = ("adam", "adamw", "sgd", "sgd-momentum")
"""The optimizers whose state and temporaries `logged_step_events` writes (torch.optim's `_init_group`
and foreach, for-loop and fused kernels); the others keep the margin."""


@_collector_paused
def logged_step_events(construct: tuple, log: tuple, kept: tuple, batches: tuple, family: str, world: int,
                       owned: tuple, optimizer: str, optimizer_impl: str, grad_accum: int = 1,
                       buckets: tuple = (), rebuilt: tuple = (), buffers: tuple = (), workspace: int = 0,
                       conv_workspaces: dict | None = None, built: tuple = ()) -> list:
    """The events of a traced module's run (the `--module` front end) on one rank of `family` in
    LOGGED_FAMILIES, over WARMUP_STEPS + MEASURED_STEPS steps, as validate/probe.py runs it:

    - `construct`: the bytes of each parameter and buffer in the order `model.to(device)` copies them
      (planner.workload.trace's `construct_bytes`); DDP (world > 1) then broadcasts them from rank 0
      (`_sync_module_states`: buckets of 250 MiB or more, two in flight; `_broadcast_coalesced`) and makes its
      Reducer's first bucket of
      every gradient; `batches`: the input tensors' bytes, made before the first step;
    - each micro-step replays the traced step's `log` ([1, id, bytes] made, [0, id] gone, [2, conv key]: a
      cuDNN workspace taken and given back, of `conv_workspaces[key]` bytes where measured), `kept` being
      the ids that outlive it (the parameters' gradients); from the second micro-step of an accumulating
      step each new gradient is added into .grad and freed (AccumulateGrad). DDP: in the second step's
      forward the rebuilt `rebuilt` buckets replace the first (`_rebuild_buckets`), and every forward
      broadcasts the module's `buffers` (bytes per dtype: one flat tensor each, `_sync_buffers`);
    - the optimizer (torch/optim/adam.py, sgd.py): in the first step `_init_group` makes each owned
      parameter's state (`owned`: their bytes, ZeRO-1's partition for zero1) -- Adam(W) `exp_avg` and
      `exp_avg_sq` (fused: a 4-byte `step` on the device before them), SGD with momentum the
      `momentum_buffer` (a clone of the gradient); `_multi_tensor_adam`'s `exp_avg_sq_sqrt` (one per
      parameter, foreach) or `_single_tensor_adam`'s two per parameter (for-loop); then
      `zero_grad(set_to_none=True)` drops the gradients.
    `workspace`: the cuBLAS workspaces, taken at the first GEMM and kept. `built`: the tensors' bytes as the
    factory built them, where a pure 16-bit run then casts the module (`model.to(dtype)`, validate/wrap.py:
    each tensor cast anew in `Module._apply`'s order, the old one freed) to `construct`'s."""
    E = _Events()
    keys = [E.a(n) for n in (built or construct)]
    for i, n in enumerate(construct if built else ()):
        if n != built[i]:
            k = E.a(n)
            E.f(keys[i])
            keys[i] = k
    bucket_keys: list = []
    if family in (DDP, ZERO1) and world > 1:
        _broadcast_coalesced(E, construct)  # (in construction order: a buffer made among the parameters moves
        # a bucket's boundary by its bytes)
        bucket_keys = [E.a(b) for b in buckets]
    for n in batches:
        E.a(n)
    ws = conv_workspaces or {}
    kept_ids = set(kept)
    states: list = []
    for step in range(WARMUP_STEPS + MEASURED_STEPS):
        if step == 0 and workspace:
            E.a(workspace)
        grads: list = []
        for k in sorted({0, min(1, grad_accum - 1), grad_accum - 1}):
            if bucket_keys and step == 1 and k == 0 and rebuilt:
                E.f(*bucket_keys)
                bucket_keys = [E.a(b) for b in rebuilt]
            if family in (DDP, ZERO1) and world > 1:
                for n in buffers:
                    E.f(E.a(n))
            keys: dict = {}
            for ev in log:
                if ev[0] == 1:
                    if k and ev[1] in kept_ids:  # added into the kept .grad, then freed
                        E.f(E.a(ev[2]))
                    else:
                        keys[ev[1]] = E.a(ev[2])
                elif ev[0] == 0:
                    key = keys.pop(ev[1], None)
                    if key is not None:
                        E.f(key)
                elif ws.get(ev[1]):
                    E.f(E.a(ws[ev[1]]))
            if not k:
                grads = [keys.pop(i) for i in kept if i in keys]
            E.f(*keys.values())  # (nothing else outlives a micro-step)
        _logged_optimizer_step(E, states, owned, optimizer, optimizer_impl)
        E.f(*grads)
    return E.ev


def _meta_built(E: _Events, construct: tuple, names: tuple, shape_of: dict) -> dict:
    """A traced module built on the meta device and wrapped there (torchtitan's way for FSDP): only its
    buffers are made whole on the device; the parameters are made by the wrapper, this rank's shards
    (FSDP2) or one unit at a time (FSDP1's `_materialize_meta_module`). Returns {} (no whole parameter)."""
    for n, name in zip(construct, names):
        if name not in shape_of:
            E.a(n)
    return {}


def _built_and_cast(E: _Events, construct: tuple, names: tuple, built: tuple, shape_of: dict,
                    param_bytes: int) -> dict:
    """`model.to(device)` of a traced module: each tensor as the factory built it (`built`, else a parameter
    in fp32 from its shape, a buffer as traced), in `Module._apply`'s order; for pure 16-bit training
    (`param_bytes` 2) then `model.to(dtype)` (validate/wrap.py): each one cast anew, the old one freed.
    Returns {parameter name: key of its tensor}."""
    full: dict = {}
    keys = []
    for i, (n, name) in enumerate(zip(construct, names)):
        keys.append(E.a(built[i] if built else prod(shape_of[name]) * 4 if name in shape_of else n))
    if param_bytes == 2:
        for i, (n, name) in enumerate(zip(construct, names)):
            size = prod(shape_of[name]) * 2 if name in shape_of else n
            if size != (built[i] if built else n):
                k = E.a(size)
                E.f(keys[i])
                keys[i] = k
    for k, name in zip(keys, names):
        if name in shape_of:
            full[name] = k
    return full


LOGGED_FSDP2 = tuple(n for n, s in REGISTRY.items() if s.fsdp2)
"""The FSDP2 strategies `logged_fsdp2_events` writes for a traced module (`fully_shard` per unit, then the
root, sharded over the data-parallel ranks)."""


@_collector_paused
def logged_fsdp2_events(construct: tuple, construct_names: tuple, log: tuple, grads: tuple, units: tuple,
                        batches: tuple, shard: int, reshard: bool, mixed: bool, optimizer: str, optimizer_impl: str,
                        grad_accum: int = 1, sync_every: bool = False, last_grad_late: bool = True,
                        workspace: int = 0, conv_workspaces: dict | None = None, built: tuple = (),
                        param_bytes: int = 4, meta: bool = False) -> list:
    """The events of a traced module's run under FSDP2 (zero2: `reshard`=False, zero3: True) on rank 0 of
    `shard`, over WARMUP_STEPS + MEASURED_STEPS steps, as validate/probe.py runs it: the traced step's own
    allocations (`log`, as logged_step_events replays them) with FSDP2's between them where the trace marked
    its hooks (workload.trace._SegmentTracker.log: [3, unit] pre-forward, [4, unit] post-forward, [5, unit]
    pre-backward, [6, unit] post-backward; torch/distributed/fsdp/_fully_shard/_fsdp_state.py and
    _fsdp_param_group.py):

    - construction: `construct` (bytes per tensor in `Module._apply`'s order; `construct_names` its parameter's
      name, "" for a buffer; `built`: their bytes as the factory built them, else a parameter in fp32 from
      `units`' shapes; pure 16-bit (`param_bytes` 2): the module cast after, `_built_and_cast`), then
      `fully_shard` per unit and the root last (`units`: (name, ((parameter, shape),
      ...)), "root" for the parameters no unit owns): each parameter's padded dim-0 shard
      (`FSDPParam._init_sharded_param`), then the unit's full tensors go; then the input `batches`;
    - pre-forward: `unshard` (foreach_all_gather's flat output on the all-gather stream, under mixed
      precision after the cast of the shards into `flat_foreach_copy_input`) and `wait_for_unshard`'s copy-out
      (each unsharded parameter in param_dtype), the previous unit's all-gather output freed after it; the
      root's last one goes at the root's post-forward; post-forward: `reshard` (zero3; the root is never
      resharded after forward: reshard_after_forward=None);
    - pre-backward: the unit copied out (all-gathered first unless prefetched), then `_backward_prefetch`
      all-gathers the unit before it in post-forward order (the root, last in that order, prefetches the
      last unit); post-backward: `_fsdp2_post_backward` over the unit's gradients (`grads`: [log id,
      parameter name] of the traced step's parameter gradients) in parameter order; units whose inputs need
      no gradient (the first, taking the batch; the root) at `_root_post_backward_final_callback`, the root
      first, which then frees the last reduce-scatter input. Accumulation without sync keeps the unsharded
      gradients (fp32: later micro-steps add into .grad in place; mixed: upcast, later ones added and freed);
    - the optimizer over the shards (logged_step_events' states and temporaries), then `zero_grad`.
    `workspace`, `conv_workspaces`: as logged_step_events. `meta`: the module built on the meta device and
    wrapped there, then `to_empty` (`_meta_built`): no whole parameter is ever made, each shard as
    `fully_shard` makes it."""
    E = _Events()
    shape_of = {n: s for _, ps in units for n, s in ps}
    unit_of = {n: u for u, ps in units for n, _ in ps}
    pb = param_bytes
    ud, rb = (2, 4) if mixed else (pb, pb)

    def shard_of(s) -> int:
        return -(-s[0] // shard) * prod(s[1:]) if s else 1
    full = _meta_built(E, construct, construct_names, shape_of) if meta else \
        _built_and_cast(E, construct, construct_names, built, shape_of, pb)
    order = [u for u, ps in units if u != "root" and ps] + [u for u, ps in units if u == "root" and ps]
    shapes = {u: [s for _, s in ps] for u, ps in units}
    for u in order:
        for s in shapes[u]:
            E.a(shard_of(s) * pb)
        E.f(*[full.pop(n) for n, _ in dict(units)[u] if n in full])
    for n in batches:
        E.a(n)
    grad_unit = {i: unit_of[n] for i, n in grads if n in unit_of}
    grad_pos = {i: [n for n, _ in dict(units)[unit_of[n]]].index(n) for i, n in grads if n in unit_of}
    owned = [shard_of(s) * pb for u in order for s in shapes[u]]
    elems = {u: sum(shard_of(s) for s in shapes[u]) for u in order}
    ws = conv_workspaces or {}
    states: list = []
    A = grad_accum
    for step in range(WARMUP_STEPS + MEASURED_STEPS):
        if step == 0 and workspace:
            E.a(workspace)
        kept: list = []  # the sharded gradients, to zero_grad
        acc: dict = {}  # unit -> its unsharded gradients kept between micro-steps without sync
        saved: dict = {}  # unit -> its sharded gradient, reduced every micro-step
        for k in sorted({0, min(1, A - 1), A - 1}):
            sync = sync_every or k == A - 1
            keys: dict = {}
            held: dict = {}  # unit -> its unsharded parameters
            pending: dict = {}  # unit -> its prefetched all-gather output, not yet copied out
            fwd_order: list = []
            done: set = set()
            made: dict = {}  # unit -> {position: key} of its new gradients
            flat = [None]
            rs = [None]

            def unshard(u) -> None:
                f, held[u] = _fsdp2_unshard(E, shapes[u], shard, ud, mixed)
                E.f(flat[0])
                flat[0] = f

            def ready(u) -> None:
                if u in held or u not in elems:
                    return
                f = pending.pop(u, None)
                if f is None:
                    f = _fsdp2_gather(E, shapes[u], shard, ud, mixed)
                held[u] = _fsdp2_copy_out(E, shapes[u], shard, ud)
                E.f(f)

            def post(u) -> None:
                if u in done or u not in elems:
                    return
                done.add(u)
                g = [v for _, v in sorted(made.pop(u, {}).items())]
                rs[0] = _fsdp2_post_backward(E, u, g, held.pop(u, []), rs[0], elems[u] * shard, elems[u],
                                             shapes[u], sync=sync, reshard=True, mixed=mixed, rb=rb, acc=acc,
                                             saved=saved, grads=kept, last_grad_late=last_grad_late)
            for ev in log:
                kind = ev[0]
                if kind == 1:
                    u = grad_unit.get(ev[1])
                    if u is not None and u in acc and not mixed:  # AccumulateGrad into the kept .grad
                        E.f(E.a(ev[2]))
                    elif u is not None:
                        made.setdefault(u, {})[grad_pos[ev[1]]] = E.a(ev[2])
                    else:
                        keys[ev[1]] = E.a(ev[2])
                elif kind == 0:
                    E.f(keys.pop(ev[1], None))
                elif kind == 2:
                    if ws.get(ev[1]):
                        E.f(E.a(ws[ev[1]]))
                elif ev[1] in elems or ev[1] == "root":
                    u = ev[1]
                    if kind == 3 and u in elems and u not in held:
                        unshard(u)
                    elif kind == 4:
                        if u == "root":
                            E.f(flat[0])
                            flat[0] = None
                        elif reshard and u in held:
                            E.f(*held.pop(u))
                        if u in elems:
                            fwd_order.append(u)
                    elif kind == 5:
                        ready(u)
                        i = fwd_order.index(u) if u in fwd_order else 0
                        if i > 0:
                            t = fwd_order[i - 1]
                            if t not in held and t not in pending:
                                pending[t] = _fsdp2_gather(E, shapes[t], shard, ud, mixed)
                    elif kind == 6:
                        post(u)
            # _root_post_backward_final_callback: the root's state first, then the units' (module order)
            for u in ["root"] + [u for u in order if u != "root"]:
                post(u)
            E.f(rs[0], flat[0], *pending.values())
            for u in list(held):
                E.f(*held.pop(u))
            E.f(*keys.values())
        _logged_optimizer_step(E, states, owned, optimizer, optimizer_impl)
        E.f(*kept)
    return E.ev


LOGGED_FSDP1 = tuple(n for n, s in REGISTRY.items() if s.fsdp1)
"""The FSDP1 strategies `logged_fsdp1_events` writes for a traced module (FULL_SHARD, SHARD_GRAD_OP,
HYBRID_SHARD within the node, NO_SHARD; `use_orig_params=False`, BACKWARD_PRE prefetch)."""


def _fsdp1_wrap_order(units: tuple) -> list:
    """FSDP1's auto-wrap order (`_recursive_wrap`, post-order): a unit's nested units (FSDP1's own units of
    its BatchNorm modules) before it, the root last."""
    names = [u for u, ps in units if u != "root" and ps]
    tops = [u for u in names if not any(u.startswith(o + ".") for o in names if o != u)]
    order = []
    for t in tops:
        order += [u for u in names if u.startswith(t + ".")] + [t]
    return order + [u for u, ps in units if u == "root" and ps]


@_collector_paused
def logged_fsdp1_events(construct: tuple, construct_names: tuple, log: tuple, grads: tuple, units: tuple,
                        batches: tuple, shard: int, strategy: str, mixed: bool, fp32_units: tuple,
                        optimizer: str, optimizer_impl: str, grad_accum: int = 1, sync_every: bool = False,
                        workspace: int = 0, conv_workspaces: dict | None = None, built: tuple = (),
                        param_bytes: int = 4, meta: bool = False) -> list:
    """The events of a traced module's run under FSDP1 (`strategy` in LOGGED_FSDP1) on rank 0 of `shard`,
    over WARMUP_STEPS + MEASURED_STEPS steps, as validate/probe.py runs it: the traced step's own allocations
    (`log`) with FSDP1's between them where the trace marked its hooks ([3]/[4] a unit's forward starts /
    ends, [5] its outputs' gradient is ready, [7] every gradient of its parameters is accumulated: the flat
    parameter's AccumulateGrad; torch/distributed/fsdp/_runtime_utils.py, _flat_param.py):

    - construction: `construct` as logged_fsdp2_events writes it, then per unit in auto-wrap order
      (`_fsdp1_wrap_order`) `FlatParamHandle`: the flat parameter, the rank's padded chunk kept and the flat
      freed (sharded; NO_SHARD keeps the flat one), the originals freed; then the input `batches`. The first
      forward's `_lazy_init` allocates and frees each handle's buffers (`init_flat_param_attributes`: under
      mixed precision `_mp_shard`, `_full_param_padded` and `_full_prec_full_param_padded`);
    - `_unshard` at a unit's pre-forward (and pre-backward, then the BACKWARD_PRE prefetch of the unit before
      it in post-forward order; the root's prefetches the last unit): the low-precision shard on the
      pre-unshard stream under mixed precision, the padded unsharded flat parameter on the unshard stream,
      the shard freed; NO_SHARD only makes the low-precision copy. `_reshard` at post-forward under
      FULL_SHARD / HYBRID_SHARD (never the root), and of NO_SHARD's low-precision copy;
    - at [7]: the views' gradients concatenated into the flat gradient (on the unshard stream), then
      `_post_backward_hook`: reshard, the cast to reduce_dtype, `_get_reduce_scatter_tensors` (`F.pad` where
      the flat gradient does not divide by the ranks, and the new shard), on the post-backward stream;
      `autograd_computed_grad` is freed as the hook returns. NO_SHARD all-reduces the flat gradient in place
      and keeps it. Accumulation without sync keeps the unsharded flat gradient (later micro-steps add into it
      and free theirs), SHARD_GRAD_OP keeps the unit unsharded;
    - the optimizer over the flat parameters (the root's first), then `zero_grad`.
    `fp32_units`: FSDP1's own units of BatchNorm modules, without mixed precision. `workspace`,
    `conv_workspaces`: as logged_step_events. `meta`: built on the meta device, each unit materialized just
    before it is flattened (`_init_utils.py` `_materialize_meta_module`: `to_empty` + `reset_parameters`)."""
    E = _Events()
    shape_of = {n: s for _, ps in units for n, s in ps}
    params_of = {u: [n for n, _ in ps] for u, ps in units}
    unit_of = {n: u for u, ps in units for n, _ in ps}
    st = get_strategy(strategy)
    sharded = st.shards_params and shard > 1  # all but NO_SHARD
    reshard_fwd = st.reshard_after_forward  # FULL_SHARD, HYBRID_SHARD
    pb = param_bytes  # the parameters' (and, without mixed precision, the gradients' and reductions') bytes
    full = _meta_built(E, construct, construct_names, shape_of) if meta else \
        _built_and_cast(E, construct, construct_names, built, shape_of, pb)
    order = _fsdp1_wrap_order(units)
    elems = {u: sum(prod(shape_of[n]) for n in params_of[u]) for u in order}
    chunk = {u: -(-elems[u] // shard) if sharded else elems[u] for u in order}
    low = {u: mixed and u not in fp32_units for u in order}
    flats: dict = {}
    for u in order:
        if meta:
            full.update((n, E.a(prod(shape_of[n]) * pb)) for n in params_of[u])
        flat = E.a(elems[u] * pb)
        if sharded:
            E.a(chunk[u] * pb)
            E.f(flat)
        else:
            flats[u] = flat
        E.f(*[full.pop(n) for n in reversed(params_of[u]) if n in full])
    for n in batches:
        E.a(n)
    grad_unit = {i: unit_of[n] for i, n in grads if n in unit_of}
    grad_pos = {i: params_of[unit_of[n]].index(n) for i, n in grads if n in unit_of}
    opt_order = [u for u in order if u == "root"] + [u for u in order if u != "root"]
    owned = [chunk[u] * pb for u in opt_order]
    ws = conv_workspaces or {}
    states: list = []
    A = grad_accum
    kept_unsharded: dict = {}  # SHARD_GRAD_OP without sync: units left unsharded between micro-steps

    def unshard(u):
        mp = E.a(chunk[u] * 2, 3) if low[u] else None
        if not sharded:
            return mp
        flat = E.a(chunk[u] * shard * (2 if low[u] else pb), 1)
        E.f(mp)
        return flat
    for step in range(WARMUP_STEPS + MEASURED_STEPS):
        if step == 0 and workspace:
            E.a(workspace)
        kept: list = []
        acc: dict = {}  # unit -> its unsharded flat gradient kept between micro-steps without sync
        saved: dict = {}  # unit -> its gradient (sharded when synced) kept for later micro-steps
        for k in sorted({0, min(1, A - 1), A - 1}):
            sync = sync_every or k == A - 1
            keys: dict = {}
            held: dict = dict(kept_unsharded)
            kept_unsharded.clear()
            fwd_order: list = []
            made: dict = {}
            for ev in log:
                kind = ev[0]
                if kind == 1:
                    u = grad_unit.get(ev[1])
                    if u is not None:
                        made.setdefault(u, {})[grad_pos[ev[1]]] = E.a(ev[2])
                    else:
                        keys[ev[1]] = E.a(ev[2])
                elif kind == 0:
                    E.f(keys.pop(ev[1], None))
                elif kind == 2:
                    if ws.get(ev[1]):
                        E.f(E.a(ws[ev[1]]))
                elif ev[1] in elems or (ev[1] == "root" and kind == 3):
                    u = ev[1]
                    if kind == 3:
                        if u == "root" and step == 0 and k == 0:  # _lazy_init
                            for v in order:
                                if sharded or low[v]:
                                    pad = chunk[v] * shard if sharded else elems[v]
                                    parts = ([chunk[v] * 2] if low[v] else []) + \
                                        ([pad * (2 if low[v] else pb)] if sharded else []) + \
                                        ([pad * pb] if low[v] and sharded else [])
                                    for n in parts:
                                        E.f(E.a(n))
                        if u in elems and u not in held and (sharded or low[u]):
                            held[u] = unshard(u)
                    elif kind == 4:
                        if u not in fwd_order:  # (a recomputation's post-forward is not recorded again)
                            fwd_order.append(u)
                        if u != "root" and u in held and (reshard_fwd or not sharded):
                            E.f(held.pop(u))
                    elif kind == 5:
                        i = fwd_order.index(u) if u in fwd_order else 0
                        for v in ([u] + ([fwd_order[i - 1]] if i > 0 else [])):
                            if v not in held and (sharded or low[v]):
                                held[v] = unshard(v)
                    elif kind == 7:
                        g = [x for _, x in sorted(made.pop(u, {}).items())]
                        flat_g = E.a(elems[u] * (2 if low[u] else pb), 1)
                        E.f(*g)
                        if u in acc:  # AccumulateGrad: added into the kept flat gradient
                            E.f(flat_g)
                            flat_g = acc.pop(u)
                        unsh = held.pop(u, None)
                        if not sync:
                            acc[u] = flat_g
                            if st.fsdp1_shard_grad_op and unsh is not None:
                                kept_unsharded[u] = unsh
                            else:
                                E.f(unsh)
                            continue
                        E.f(unsh)
                        cast = E.a(elems[u] * 4, 2) if low[u] else None
                        src = cast if cast is not None else flat_g
                        rb = 4 if low[u] else pb
                        if sharded:
                            pad = E.a(chunk[u] * shard * rb, 2) if chunk[u] * shard != elems[u] else None
                            out = E.a(chunk[u] * rb, 2)
                            E.f(cast, pad, flat_g)
                            if u in saved:  # `_saved_grad_shard += sharded_grad`
                                E.f(out)
                            else:
                                saved[u] = out
                                kept.append(out)
                        else:
                            if cast is not None:  # cast back to the parameter's dtype (fp32)
                                E.f(flat_g)
                            if u in saved:
                                E.f(src)
                            else:
                                saved[u] = src
                                kept.append(src)
            for u in list(held):
                E.f(held.pop(u))
            E.f(*keys.values())
        _logged_optimizer_step(E, states, owned, optimizer, optimizer_impl)
        E.f(*kept)
    return E.ev


STAGE_FAMILIES = (SINGLE, DDP, FSDP2)
"""The strategy families whose pipeline stages `stage_allocation_events` writes, those the PP probe runs and
the recorded traces check: a plain stage module, DDP with no_sync until the last micro-batch, FSDP2
(zero2/zero3: `fully_shard` per block and the stage, reshard_after_forward off as torchtitan applies it
with PP, sharded over more than one rank). ZeRO-1 stages keep the margin (pp.PP_STRATEGIES: no FSDP1)."""


@_collector_paused
def stage_allocation_events(train: TrainConfig, strategy, stage: int, world: int, shard: int,
                            device: str = "cuda", workspace: int = 0, steps: int = 2) -> list:
    """The events of pipeline stage `stage` (planner/pp.py) over `steps` steps (validate/pp_probe.py: one
    warm-up step and one measured), for the families in STAGE_FAMILIES and one stage per rank
    (GPipe, 1F1B). `world`/`shard`: the stage's data-parallel ranks (DDP, FSDP2) and its shard group (1;
    FSDP2: the ranks its parameters are sharded over, more than one).

    What `torch.distributed.pipelining` allocates (`stage.py`, `schedules.py`), in the order of
    `pp.stage_actions`: in the first step `_prepare_forward_infra` makes one receive buffer per
    micro-batch (not on the first stage) and `_prepare_backward_infra` one gradient buffer per micro-batch
    (not on the last), kept for the run; a forward keeps the micro-batch's saved activations (a
    non-first stage's first block saves the receive buffer, not a new tensor) and its output in
    `fwd_cache` (the last stage: the logits, and the loss's log-probabilities); a backward frees them,
    makes the block transients and the weight gradients (kept from the first micro-batch on, later ones
    added in place: AccumulateGrad) and the input's gradient, which the pending send keeps (GPipe:
    `bwd_sends_to_wait` to the step's end; 1F1B: `bwd_sends`, until the next backward's send). GPipe's
    `fwd_sends_to_wait` keep every output to the step's end.

    FSDP2 (`_fsdp_param_group.py`, `_fsdp_collectives.py`, `_fsdp_param.py`), as the probe and torchtitan
    apply it (`fully_shard` per block, then the stage module: the root, the embedding and/or the final
    norm and head; reshard_after_forward=False): construction as `allocation_events` (each parameter's
    shard, then the full one goes). The first step's `_prepare_forward_infra`/`_prepare_backward_infra`
    infer the shapes with a real forward (and, but on the first stage, a backward to the stage's input) of
    one micro-batch (`_forward_metadata_inference`, `_backward_metadata_inference`): every unit is
    unsharded for it, the backward reshards each block after its own (FSDP's defaults), and
    `_post_metadata_inference_cleanup` reshards the rest. In each step the first micro-batch's forward
    all-gathers the root, then each block before its forward (`foreach_all_gather` on the all-gather
    stream, `foreach_all_gather_copy_out` into the unsharded parameters, the flat output freed after the
    next unit's copy-out); they stay unsharded through the step. Each backward runs under
    `backward_maybe_with_nosync` (set_requires_gradient_sync(False), set_reshard_after_backward(False)):
    the unsharded gradients are kept (`unsharded_accumulated_grad` in reduce_dtype under mixed precision,
    each later micro-batch's 16-bit one added and freed; else `.grad`, added in place). After the last
    backward (and the pending sends) `perform_reduce_grad` runs `post_backward` on the root and then each
    block: reshard, the previous reduce-scatter input dropped, the new one on the reduce-scatter stream,
    the unsharded gradients freed (the unit's last one when `foreach_reduce` returns), the gradient shard;
    the last input goes with `_root_post_backward_final_callback`. The optimizer's states are the shards'.
    zero2 and zero3 are written alike (both reshard_after_forward=False under PP). The recorded traces
    are fp32; mixed precision's upcast accumulation is `allocation_events`' (checked there, without PP)."""
    st = get_strategy(strategy)
    family = st.family
    fsdp2 = st.fsdp2
    if family not in STAGE_FAMILIES or virtual_stages(train.pp_schedule) != 1 or (fsdp2 and shard <= 1):
        raise ValueError(f"stage_allocation_events: {st.name} / {train.pp_schedule} / shard {shard}: accepted: "
                         f"{', '.join(STAGE_FAMILIES)} with one stage per rank (fsdp2 sharded over > 1 rank)")
    p, M = train.pp, train.pp_microbatches
    first, last = stage == 0, stage == p - 1
    strain = stage_train(train, stage)
    m = strain.model
    prec = train.prec
    regime = regime_for(strain, family)
    act = activations_in(strain, regime, device)
    lay = layout(m, family, shard, st.shards_params, st.shards_optimizer)
    L = m.layers
    n = train.micro_batch * train.seq_len
    t = train.tp
    v = -(-m.vocab // t)
    pb, gb, cb = prec.param_bytes, prec.grad_bytes, prec.compute_bytes
    ud = cb if prec.mixed else pb  # FSDP2's unsharded parameter / gradient dtype
    rb = 4 if prec.mixed else gb  # its reduce dtype
    r = 4 if regime in ("fp32", "autocast") else 2
    e = 4 if regime == "fp32" else 2
    nh = sp_tokens(strain, n) * m.hidden * r  # the boundary tensor
    root_shapes, block_shapes, _, _, _ = unit_sizes(m)
    n_embed = (1 + (m.position == "learned")) if first else 0
    embed_shapes, head_shapes = root_shapes[:n_embed], root_shapes[n_embed:]
    ckpt = train.checkpointing != "none"
    per_receive = pp_recv_buffers_per_receive(train)  # torch >= 2.15: buffers made per receive
    releasable = per_receive and releases_sent_outputs(family, last)  # outputs dropped once sent
    E = _Events()

    # -- construction: the stage's parameters; DDP's broadcast and first bucket, FSDP2's shards (as
    # allocation_events)
    units = [list(embed_shapes)] + [list(block_shapes)] * L + [list(head_shapes)]
    full = [[E.a(prod(s) * pb) for s in u] for u in units]
    if fsdp2:
        owned = _fsdp2_construct(E, units, full, shard, pb)
    else:
        owned = [prod(s) for u in units for s in u]
    buckets: list = []
    if family == DDP and world > 1:
        _broadcast_coalesced(E, [prod(x) * pb for u in units for x in u])
        buckets = [E.a(lay.total * gb)]
    st_elems, st_extra = _opt_state(m, train.optimizer, family, shard)
    st_total = st_elems * pb + int(st_extra)
    per_param = 1 if train.optimizer == "sgd-momentum" else 2
    owned_sum = sum(owned) or 1
    state_sizes = [st_total * s // owned_sum // per_param for s in owned for _ in range(per_param)] if st_total else []
    if first:
        E.a(M * n * 8)  # the batch's token ids
    if last:
        E.a(M * n * 8)  # its targets

    blk_saved = _split(act.per_block, _block_saved_shapes(strain, regime, n, device))
    kept = act.blocks_total // L if L else 0
    kept_saved = blk_saved if not ckpt else _split(kept, [n * m.hidden * r])
    _, blk_tmp, _ = _block_backward_peak(strain, regime, n, device)
    tmp_shapes = _split(blk_tmp, [n * m.hidden * r] + [n * m.ffn_hidden // t * e] * 3)
    states: list = []
    grads: list = []
    recv: list = []
    held: dict = {}  # FSDP2: unit ("root" or block j) -> its unsharded parameters
    acc: dict = {}  # FSDP2: unit -> its unsharded gradients, kept through the step's micro-batches

    def accumulate(shapes, i: int):
        """Weight gradients: kept from the first micro-batch on; later ones added in place (AccumulateGrad),
        each freed as its Linear's backward makes it."""
        for s in shapes:
            g = E.a(prod(s) * gb)
            if i == 0:
                grads.append(g)
            else:
                E.f(g)

    def new_grads(u, shapes) -> list:
        """FSDP2: unit u's new unsharded gradients; where the kept .grad takes them in place (fp32 / pure
        16-bit: AccumulateGrad), each is freed as its Linear's backward makes it."""
        if u in acc and not prec.mixed:
            for s in shapes:
                E.f(E.a(prod(s) * ud))
            return []
        return [E.a(prod(s) * ud) for s in shapes]

    def post_backward(u, g, sync: bool, rs_kept=None):
        unsharded, sharded, shapes = ((lay.unshard_root, lay.shard_root, root_shapes) if u == "root"
                                      else (lay.unshard_block, lay.shard_block, block_shapes))
        return _fsdp2_post_backward(E, u, g, held.pop(u, []) if sync else held.get(u, []), rs_kept, unsharded,
                                    sharded, shapes, sync=sync, reshard=sync, mixed=prec.mixed, rb=rb, acc=acc,
                                    saved={}, grads=grads,
                                    last_grad_late=fsdp2_reduce_keeps_last_grad(train))

    def gather(u, shapes, prev):
        """FSDP2 pre_forward: unit u all-gathered and copied out unless it is unsharded; the previous
        unit's all-gather output goes after the copy-out. Returns the all-gather output now held."""
        if not fsdp2 or u in held or not shapes:
            return prev
        flat, held[u] = _fsdp2_unshard(E, shapes, shard, ud, prec.mixed)
        E.f(prev)
        return flat

    def forward():
        """One micro-batch's forward: (embedding output, each block's saved tensors, the head's), and the
        stage output (not on the last stage)."""
        ag = gather("root", root_shapes, None)
        # The embedding's output (sequence-sharded with SP: torchtitan's RowwiseParallel(output_layouts=
        # Shard(1)) on the embedding) is block 0's input, as the receive buffer is on a later stage: what
        # checkpointing keeps of block 0, and in fp32/autocast the tensor the first norm's x.float() saves.
        # In 16-bit the norm saves a new fp32 copy and the output is dropped after block 0.
        emb = E.a(nh) if first else None
        blocks = []
        for j in range(L):
            ag = gather(j, block_shapes, ag)
            if ckpt:  # run without saving, keep the block's input (the receive buffer or the embedding's output)
                E.f(*[E.a(s) for s in blk_saved])
                shapes = kept_saved if j else []
            else:
                shapes = blk_saved if (j or (first and r == 2)) else blk_saved[1:]
            blocks.append([E.a(s) for s in shapes])
            if j == 0 and first and r == 2 and not ckpt:
                E.f(emb)
                emb = None
        E.f(ag)
        head = []
        if last:
            head.append(E.a(act.outside - act.inputs))  # final norm, the head's input
            head.append(E.a(n * v * e))  # the logits, kept in fwd_cache
            head.append(E.a(act.loss_saved))  # log_softmax's output
        return (emb, blocks, head), (None if last else E.a(nh))  # the stage output, in fwd_cache and the send

    def block_backward(j, blocks, grads_of):
        rec = []
        if ckpt:  # recomputed: everything but its kept input
            rec = [E.a(s) for s in blk_saved[1:]]
        tmp = [E.a(s) for s in tmp_shapes]
        g = grads_of(j)
        E.f(*tmp, *rec, *blocks[j])
        return g

    def metadata_inference():
        """FSDP2, first step: the shape inference's real forward of one micro-batch (every unit unsharded),
        the backward to the input on a non-first stage (each block resharded after its backward, then the
        root), the receive buffers, then `_post_metadata_inference_cleanup`'s reshard."""
        x = None if first else E.a(nh)  # the inferred input (an empty tensor)
        (emb, blocks, head), out = forward()
        if not first and not per_receive:
            recv.extend(E.a(nh) for _ in range(M))
        if not first:
            lt = [E.a(n * v * 4) for _ in range(3 if t > 1 else 2)] if last else []
            E.f(*lt[:-1])
            E.f(*lt[-1:], *head[::2])  # (the logits stay in the inference's outputs until the cleanup)
            for j in reversed(range(L)):
                block_backward(j, blocks, lambda j: [])
                E.f(*held.pop(j))
            E.f(*held.pop("root", []))
            gi = E.a(nh)  # the input's gradient
            E.f(gi)
        else:
            for j in reversed(range(L)):
                E.f(*blocks[j])
        E.f(emb, out, x, *head[1:2])
        if not last and not per_receive:
            recv.extend(E.a(nh) for _ in range(M))
        for u in list(held):
            E.f(*held.pop(u))

    def step(k_step: int):
        if fsdp2 and k_step == 0:
            metadata_inference()
        elif k_step == 0 and not per_receive:  # _prepare_forward_infra / _prepare_backward_infra, in the first step
            recv.extend(E.a(nh) for _ in range(M * ((not first) + (not last))))
        if buckets and k_step == 1:  # DDP's rebuild in the second step's first forward
            E.f(*buckets)
            buckets[:] = [E.a(b) for b in bucket_sizes(ready_order_sizes(m, regime == "autocast"), gb,
                                                        DDP_BUCKET_CAP_MB)]
        saved: dict = {}
        outs: dict = {}
        sends: list = []
        inputs: dict = {}  # torch >= 2.15: micro-batch -> its received activation
        grad_in = None
        for kind, i in stage_actions(train.pp_schedule, p, M, stage):
            if kind == "F":
                if per_receive and not first:
                    inputs[i] = E.a(nh)
                saved[i], out = forward()
                if out is not None:
                    outs[i] = out
                if releasable and train.pp_schedule != "gpipe":  # 1F1B's warm-up: the previous forward's
                    # send waited for and released
                    E.f(*[outs.pop(j) for j in list(outs) if j < i])
                continue
            if releasable:  # every forward send waited for and released before a backward (GPipe: before
                # its backward loop; 1F1B: fused with this backward's receive, its buffer made first)
                if train.pp_schedule != "gpipe":
                    grad_in = E.a(nh)
                E.f(*outs.values())
                outs.clear()
            if per_receive and not last and grad_in is None:
                grad_in = E.a(nh)
            emb, blocks, head = saved.pop(i)
            head_g: list = []
            if last:
                lt = [E.a(n * v * 4) for _ in range(3 if t > 1 else 2)]
                # log_softmax's saved output goes with its backward node, before the head's matmul backward
                # makes the weight gradient (as in allocation_events); the logits' gradient lives through it
                E.f(*lt[:-1], head[2])
                if fsdp2:
                    head_g = new_grads("root", head_shapes)
                else:
                    accumulate(head_shapes, i)
                E.f(lt[-1], *head[:2])
            if train.pp_schedule != "gpipe":
                E.f(outs.pop(i, None))
            for j in reversed(range(L)):
                if fsdp2:
                    g = block_backward(j, blocks, lambda j: new_grads(j, block_shapes))
                    post_backward(j, g, sync=False)
                else:
                    block_backward(j, blocks, lambda j: accumulate(block_shapes, i))
            E.f(emb)
            emb_g: list = []
            if first:
                if fsdp2:
                    emb_g = new_grads("root", embed_shapes)
                else:
                    accumulate(embed_shapes, i)
            else:
                gi = E.a(nh)  # the input's gradient, kept by its send
                if train.pp_schedule != "gpipe":
                    E.f(*sends)
                    sends.clear()
                sends.append(gi)
            if per_receive:  # the gradient buffer goes with its backward, and so does a middle stage's input
                E.f(grad_in, None if last else inputs.pop(i, None))
                grad_in = None
            if fsdp2 and root_shapes:  # (its gradients in parameter order: the embedding's, the head's)
                post_backward("root", emb_g + head_g, sync=False)
        if fsdp2:  # perform_reduce_grad: the root's post_backward, then the blocks'
            rs = None
            for u in (["root"] if root_shapes else []) + list(range(L)):
                rs = post_backward(u, [], sync=True, rs_kept=rs)
            E.f(rs)  # _root_post_backward_final_callback
        E.f(*sends, *outs.values())
        if state_sizes and not states:
            states.extend(E.a(z) for z in state_sizes)
        _adam_temporaries(E, [s * pb for s in owned], train.optimizer, train.optimizer_impl)
        E.f(*grads)
        grads.clear()
        E.f(*inputs.values())  # the last stage's: the returned losses' graphs kept them to the step's end
        assert not acc and not held, "FSDP2: gradients or parameters left unsharded at the optimizer step"

    for k in range(steps):
        if k == 0 and workspace:
            E.a(workspace)
        step(k)
    return E.ev


def stage_reserved_peak(train: TrainConfig, strategy, stage: int, world: int, shard: int, device: str = "cuda",
                        workspace: int = 0, expandable_segments: bool = False,
                        max_split_size: int | None = None) -> tuple[int, int]:
    """(reserved peak, allocated peak) of pipeline stage `stage`'s replayed run."""
    return _stage_reserved_peak(train, get_strategy(strategy).name, stage, world, shard, device, workspace,
                                expandable_segments, max_split_size)


@lru_cache(maxsize=256)
def _stage_reserved_peak(train, name, stage, world, shard, device, workspace, expandable_segments,
                         max_split_size):
    return replay_peaks(stage_allocation_events(train, name, stage, world, shard, device, workspace),
                        expandable_segments=expandable_segments, max_split_size=max_split_size,
                        rounding=alloc_rounding(train.alloc_conf))


def stage_reserved_peak_within(limit: int, train: TrainConfig, strategy, stage: int, world: int, shard: int,
                               device: str = "cuda", workspace: int = 0, expandable_segments: bool = False,
                               max_split_size: int | None = None) -> tuple[int, int, int] | None:
    """`reserved_peak_within` for pipeline stage `stage` (`stage_reserved_peak`'s run)."""
    return _stage_reserved_peak_within(limit, train, get_strategy(strategy).name, stage, world, shard, device,
                                       workspace, expandable_segments, max_split_size)


@lru_cache(maxsize=256)
def _stage_reserved_peak_within(limit, train, name, stage, world, shard, device, workspace, expandable_segments,
                                max_split_size):
    return replay_fit(stage_allocation_events(train, name, stage, world, shard, device, workspace), limit,
                      expandable_segments=expandable_segments, max_split_size=max_split_size,
                      rounding=alloc_rounding(train.alloc_conf))


CHECKPOINT_REPLAY_STRATEGIES = tuple(n for n, s in REGISTRY.items()
                                     if s.family in (SINGLE, DDP, FSDP2) or s.fsdp1 and s.shards_params and not s.hybrid)
"""Strategies whose saves `checkpoint_events` writes and the recorded saves check (single's path is DDP's:
the live tensors); NO_SHARD, HSDP and tensor-parallel saves keep the margin."""
CHECKPOINT_REPLAY_MODES = ("full", "sharded")
"""Checkpoint saves whose allocations `checkpoint_events` writes; `full-offload` keeps the margin (its
device transients differ between a GPU and the CPU probes, so the recorded traces cannot check them)."""


def checkpoint_events(train: TrainConfig, strategy, shard: int, mode: str, first_key: int) -> list:
    """Rank 0's allocations while it saves model and optimizer state after the measured step
    (planner/checkpoint.py, validate/checkpoint.py), to append to `allocation_events` (keys from
    `first_key` on). Only what is made on the device; what stays until the save ends is not freed.

    - single / DDP: the state dicts are the live tensors (`full`), DCP writes them as they are
      (`sharded`): nothing.
    - FSDP2 `full`: each parameter, then each of its optimizer states, `redistribute`d to Replicate
      (`_state_dict_utils._gather_state_dict`): an all-gather into a new tensor of the padded unsharded
      size, kept (the narrowed parameter is a view of it). `sharded`: the DTensors as they are: nothing
      (rank 0's shards fill their storage, so DCP's CPU loader clones none).
    - FSDP1 `full`: the root unit unsharded (`_full_pre_state_dict_hook`) while each block is unsharded
      in turn, its parameters cloned (kept) and resharded, then the root's cloned; the optimizer
      (`_optim_utils._allgather_orig_param_states`) all-gathers each state of a FlatParameter (the root's
      first) into a new padded flat buffer, kept. `sharded`: the same unsharding with this rank's chunk of
      each parameter cloned (`_ext_chunk_tensor`), and each FlatParameter's states gathered, their chunks
      cloned, the gathered buffers freed."""
    st = get_strategy(strategy)
    if mode not in CHECKPOINT_REPLAY_MODES:
        raise ValueError(f"checkpoint_events: mode={mode!r}: accepted: {', '.join(CHECKPOINT_REPLAY_MODES)}")
    E = _Events()
    E.n = first_key
    m = train.model
    pb = train.prec.param_bytes
    sharding = shard > 1 and st.shards_params and st.fsdp
    if not sharding:
        return E.ev
    states, _ = _all_state_elems(m, train.optimizer)
    per_state = round(states / (m.param_count() or 1))  # elementwise states per parameter (AdamW: 2)
    root_shapes, block_shapes, *_ = unit_sizes(m)
    embed, _, head = m.units()
    order = [s for _, s in embed.params] + list(block_shapes) * m.layers + [s for _, s in head.params]

    def chunk(s) -> int:  # rank 0's rows (torch.chunk): ceil(d0 / shard)
        return -(-s[0] // shard) * prod(s[1:])

    if st.fsdp2:
        if mode == "full":
            for s in order:
                E.a(chunk(s) * shard * pb)
            for s in order:
                for _ in range(per_state):
                    E.a(chunk(s) * shard * pb)
        return E.ev
    # FSDP1: units of flat parameters, padded to a multiple of the shard group
    def padded(elems: int) -> int:
        return -(-elems // shard) * shard
    root_elems = sum(prod(s) for s in root_shapes)
    block_elems = sum(prod(s) for s in block_shapes)
    kept = (lambda s: prod(s)) if mode == "full" else chunk
    root_flat = E.a(padded(root_elems) * pb)
    for _ in range(m.layers):
        flat = E.a(padded(block_elems) * pb)
        for s in block_shapes:
            E.a(kept(s) * pb)
        E.f(flat)
    for s in root_shapes:
        E.a(kept(s) * pb)
    E.f(root_flat)
    for elems, shapes in [(root_elems, root_shapes)] + [(block_elems, block_shapes)] * m.layers:
        for _ in range(per_state):
            buf = E.a(padded(elems) * pb)
            if mode == "sharded":
                for s in shapes:
                    E.a(chunk(s) * pb)
                E.f(buf)
    return E.ev
