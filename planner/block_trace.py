"""One transformer block's allocations, forward and backward, as the analytic model sees them
(`block_program`: the tensors its ops make, keep and free, in order), and the shapes its backward keeps
(`_block_saved_shapes`). Written once per configuration and replayed per block by the writers above
(alloc_trace.py's `allocation_events`, stage_trace.py)."""

from __future__ import annotations

from functools import lru_cache
from math import prod

from .activations import _mlp_parts, _norm_parts, block_saved
from .activations_attention import _hf_attention_parts, _hf_mask, _hf_sdpa_backend, hf_eager, hf_output_copied, sdpa_math
from .config import TrainConfig
from .kernel_rules import gelu_new_elem_bytes


def _block_unwritten(train: TrainConfig) -> bool:
    """Whether `block_program` leaves the block unwritten (before the attention backend is known): tensor or
    context parallelism, a transformers model's LayerNorm, sandwich or q/k norms, dropout, GELU-new, eager
    attention, a final softcap, partial rotary embeddings, an MLP other than SwiGLU or the reference GELU."""
    m = train.model
    hf = bool(m.hf_model_type)
    return (train.tp > 1 or train.cp > 1 or train.sequence_parallel or (hf and m.norm != "rmsnorm")
            or m.sandwich_norms or m.qk_norm or m.attn_dropout > 0 or m.resid_dropout > 0
            or m.activation == "gelu_new" or train.attention != "sdpa" or (hf and hf_eager(train))
            or m.final_softcap or (m.rotary_dim and m.rotary_dim != m.head_dim) or m.mlp not in ("swiglu", "gelu")
            or (m.mlp == "gelu" and hf))


def _block_sdpa_backend(train: TrainConfig, regime: str, device: str) -> str:
    """The SDPA backend the block's attention runs on: "flash", "efficient" or "math"."""
    if train.model.hf_model_type:
        return _hf_sdpa_backend(train, regime, device)
    if sdpa_math(train, regime, device):
        return "math"
    # the reference decoder: no fp32 flash on CUDA (activations.sdpa_math)
    return "efficient" if device == "cuda" and regime == "fp32" else "flash"


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
    if _block_unwritten(train):
        return None
    backend = _block_sdpa_backend(train, regime, device)
    if backend == "math":
        return None
    return _BlockForward(train, regime, n, device, grad, backend).program()


class _BlockForward:
    """`block_program`'s writer: one block's forward op by op, one method per part of the block. Holds the ops
    written so far, the tensors' names and bytes (`sizes`), and what autograd saves (`saved`, in
    `_block_saved_shapes` order; `keep`: never freed)."""

    def __init__(self, train: TrainConfig, regime: str, n: int, device: str, grad: bool, backend: str):
        self.train, self.regime, self.device, self.grad, self.backend = train, regime, device, grad, backend
        self.m = m = train.model
        self.hf = bool(m.hf_model_type)
        self.n = n  # tokens in the micro-batch
        self.auto = regime == "autocast"
        self.resid_bytes = 4 if regime in ("fp32", "autocast") else 2  # the residual stream (the embedding's dtype)
        self.out_bytes = 4 if regime == "fp32" else 2  # bytes of a Linear's output element
        self.ops: list = []
        self.names = iter(range(1 << 30))
        self.saved: list = []  # in `_block_saved_shapes` order
        self.keep: set = set()
        self.sizes = {"x": n * m.hidden * self.resid_bytes}  # tensor name -> bytes

    def new(self, nbytes: int, save: bool = False) -> str:
        k = f"t{next(self.names)}"
        self.ops.append(("a", k, nbytes))
        self.sizes[k] = nbytes
        if save and self.grad:
            self.saved.append(k)
            self.keep.add(k)
        return k

    def free(self, *keys) -> None:
        gone = tuple(k for k in keys if k is not None and k not in self.keep)
        if gone:
            self.ops.append(("f",) + gone)

    def save(self, k: str) -> None:
        if self.grad:
            self.saved.append(k)
            self.keep.add(k)

    def program(self) -> tuple | None:
        """The whole block: attention, then the MLP; its output; with grad, the saved tensors' list."""
        m, n, free = self.m, self.n, self.free
        x1 = self.attention()
        # MLP
        n2 = self.norm(x1, self.resid_bytes)
        d = self.mlp(n2)
        free(n2)
        self.ops.append(("a", "out", n * m.hidden * self.resid_bytes))
        free(d, x1)
        if self.grad:
            free("x")
            self.ops.append(("s",) + tuple(self.saved))
            if sum(self.sizes[k] for k in self.saved) != block_saved(self.train, self.regime, self.device):
                return None
        return tuple(self.ops)

    def norm(self, x: str, x_bytes: int) -> str:
        """A norm of `x` (elements of `x_bytes` bytes): its output's name."""
        if self.m.norm == "layernorm":
            return self.layer_norm(x, x_bytes)
        return self.rms_norm(x, x_bytes)

    def layer_norm(self, x: str, x_bytes: int) -> str:
        n, new, free, save = self.n, self.new, self.free, self.save
        # F.layer_norm -> native_layer_norm: its output, then mean and rstd (fp32 on CUDA, the input's dtype
        # on the CPU: activations._norm_parts), which it saves with its input; the output in the input's
        # dtype (autocast runs it in fp32: the residual stream is fp32 there)
        save(x)
        stat = 4 if self.device == "cuda" else x_bytes
        out = new(n * self.m.hidden * x_bytes)
        mean, rstd = new(n * stat, True), new(n * stat, True)
        free(mean, rstd)
        if not self.auto:
            save(out)
        return out

    def rms_norm(self, x: str, x_bytes: int) -> str:
        n, h, hf, new, free, save = self.n, self.m.hidden, self.hf, self.new, self.free, self.save
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
            out = new(n * h * 4, not self.auto)  # under autocast each Linear saves its own 16-bit cast instead
            free(xn)
        if hf:  # LlamaRMSNorm's `variance`, a local to the return
            free(var)
        return out

    def linear(self, out_elems: int, weights: tuple, fp32_input: bool, save_out: bool, last: bool = False) -> str:
        """A Linear of the block's `weights` (indices of its 2-D weights) with `out_elems` output elements per
        token: its output's name."""
        # `last`: the mm's autograd saves its input before it runs (VariableType), the block's last save
        c = None
        if self.auto:
            self.ops.append(("w", weights))
            c = self.new(self.n * self.m.hidden * 2, True) if fp32_input else None  # saved by the mm
        if last:
            self.ops.append(("stop",))
        y = self.new(self.n * out_elems * (2 if self.auto else self.out_bytes), save_out)
        self.free(c)
        return y

    def attention(self) -> str:
        """The attention half: norm, q/k/v projections, RoPE, SDPA, output projection, residual add. Returns
        the residual stream's name after it."""
        m, n, free = self.m, self.n, self.free
        fused = m.fused_qkv
        rope = m.position == "rope"
        n1 = self.norm("x", self.resid_bytes)
        qkv, qk, kk, vk = self.qkv_projections()
        qe, ke, qk_bytes, cos_sin = self.rope(qk, kk)
        y = self.sdpa(qe, ke, vk, qk_bytes)
        o = self.linear(m.hidden, (3,), False, False)
        free(y, *(x for x in (qe, ke) if rope), *([qkv] if fused else [vk] if rope else [qk, kk, vk]), *cos_sin)
        free(n1)
        x1 = self.new(n * m.hidden * self.resid_bytes)
        free(o)
        return x1

    def qkv_projections(self) -> tuple:
        """q, k and v's projections: (the fused buffer or None, q, k, v); v is a view of a fused buffer."""
        m, linear = self.m, self.linear
        if m.fused_qkv:
            # v is a view of it: SDPA keeps the whole buffer
            qkv = linear(m.q_dim + 2 * m.kv_dim, (0, 1, 2), True, True)
            return qkv, None, None, qkv
        qk = linear(m.q_dim, (0,), True, False)
        kk = linear(m.kv_dim, (1,), True, False)
        vk = linear(m.kv_dim, (2,), True, False)
        return None, qk, kk, vk

    def rope(self, qk, kk) -> tuple:
        """The rotary embedding of q and k: (embedded q, embedded k, the bytes of their elements, the per-block
        copies of the cos/sin tables)."""
        m, n, hf, e, new, free = self.m, self.n, self.hf, self.out_bytes, self.new, self.free
        if m.position != "rope":
            return qk, kk, e, []
        rr = self.resid_bytes if hf else e  # q * cos: HF's tables are in the embedding's dtype (fp32 under
        # autocast), ours in q's
        cos_sin = []
        if not hf and e != 4:  # validate/model.py `cos.to(q.dtype)`: a per-block copy of each table,
            s, hd = self.train.seq_len, m.head_dim
            cos_sin = [new(s * hd * e, True), new(s * hd * e, True)]  # which `q * cos` saves
        embedded = []
        for width, src in ((m.q_dim, qk), (m.kv_dim, kk)):
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
        if hf and not m.fused_qkv:  # `query_states, key_states = apply_rotary_pos_emb(...)` rebinds both
            free(qk, kk)
        qe, ke = embedded
        return qe, ke, rr, cos_sin

    def sdpa(self, qe, ke, vk, qk_bytes: int) -> str:
        """sdpa_attention_forward on q, k, v (q and k's elements of `qk_bytes` bytes): its output's name."""
        m, n, e, new, free, save = self.m, self.n, self.out_bytes, self.new, self.free, self.save
        q, kv = m.q_dim, m.kv_dim
        mask = self.hf and _hf_mask(self.train)
        repeated = mask and kv < q  # `repeat_kv`: SDPA saves the repeated K/V instead
        # sdpa_attention_forward: K/V repeated to every head where a mask is passed (`repeat_kv`), then SDPA
        temps = []
        q_in, k_in, v_in = qe, ke, vk
        if repeated:
            k_in, v_in = new(n * q * qk_bytes), new(n * q * e)
            temps += [k_in, v_in]
        if self.auto:  # SDPA is on autocast's lower-precision list: fp32 q (and k) cast, k first
            if qk_bytes == 4:
                k_in = new(self.sizes[k_in] // 2)
                q_in = new(n * q * 2)
                temps += [k_in, q_in]
        # what SDPA saves (v: a view of qkv)
        for k in (q_in, k_in) + (() if m.fused_qkv and not repeated else (v_in,)):
            save(k)
        if mask:  # `where(mask, 0, -inf)`: the two scalars, then the float mask
            me = 2 if self.auto else e
            sc = (new(me), new(me))
            mc = new(self.train.micro_batch * self.train.seq_len ** 2 * me)
            free(*sc)
            temps.append(mc)
        es = 2 if self.auto else e
        y = new(n * q * es, True)
        if self.backend == "flash" or self.grad:
            free(new(n * m.heads * 4, True))  # logsumexp
        if mask:
            save(mc)
        free(*temps)
        if hf_output_copied(self.train, self.device, self.backend):
            yc = new(n * q * es, True)  # `.transpose(1, 2).contiguous()` of a (B, nh, S, hd) output
            free(y)
            y = yc
        return y

    def mlp(self, n2: str) -> str:
        """The MLP on the norm's output `n2`: its output's name."""
        n, e, new, free, save, linear = self.n, self.out_bytes, self.new, self.free, self.save, self.linear
        h, f = self.m.hidden, self.m.ffn_hidden
        if self.m.mlp == "gelu":  # the reference decoder's F.gelu(fc(x), approximate="tanh")
            fc = linear(f, (4,), True, True)
            g = new(n * f * e, True)
            free(fc)
            d = linear(h, (5,), False, False, last=True)
            free(g)
        elif self.m.fused_gate_up:
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
        return d


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


def _split_to_peak(total: int, parts: list[int], freed: int) -> tuple[list[int], int]:
    """`_split(total, parts)` for a block's saved tensors, whose backward has consumed `freed` bytes of them by
    its peak (`_block_backward_peak`), and whether its last entry is the remainder (what `parts` leave out).
    Where the listed tensors consumed by the peak (`_consumed`) fall short of `freed`, the shortfall is taken out
    of the remainder and placed among them: the unlisted tensors include ones the peak has consumed (an RMSNorm's
    normalized input and output, which the list leaves out), so the events free what the walk counts freed."""
    sizes = _split(total, parts)
    if len(sizes) <= len(parts):
        return sizes, 0
    body, rest = sizes[:-1], sizes[-1]
    cut = _consumed(body, freed)
    short = freed - sum(body[cut:])
    if short <= 0 or short > rest:
        return sizes, 1
    return body[:cut] + [short] + body[cut:] + ([rest - short] if rest > short else []), int(rest > short)


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
    # NewGELUActivation (gelu_new) also its tanh's output, 0.5 x and 1 + tanh (activations._mlp_parts)
    mlp = ([n * f * b for b in gelu_new_elem_bytes(device, regime)] if m.activation == "gelu_new"
           else [n * f * e] * (4 if m.mlp == "swiglu" else 2))
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
            + _norm_parts(train, regime, n, mlp_consumers, device) + _mlp_parts(train, regime, n, device))
