"""Activation memory: the bytes autograd saves in the reference decoder, op by op.

Derived from what `torch.autograd.graph.saved_tensors_hooks` reports on `distplan.validate.model.Decoder`
(tests/test_activations.py checks every term against it), not from a paper constant. Korthikanti et al.
2022 (arXiv:2205.05198, Table 2) give `sbh(34 + 5as/h)` for Megatron's GPT block with fused kernels;
our blocks differ (SwiGLU, RMSNorm in fp32 as Hugging Face writes it, SDPA keeps O(s) statistics), so
each term below names the op whose backward keeps the tensor.

Three numeric regimes decide the dtypes of saved tensors:
- `fp32`: everything fp32.
- `lowp`: the module runs in 16 bits (pure bf16, or FSDP1/FSDP2 mixed precision casting the
  all-gathered parameters): residual stream 16-bit, norms upcast internally.
- `autocast`: fp32 parameters under `torch.autocast` (single/ddp/zero1 with *-mixed): residual stream
  fp32, every Linear saves a 16-bit cast of its input, and the autocast weight cache keeps a 16-bit
  copy of every Linear weight (and bias) alive from its forward use to its backward.

Where a device's kernels keep other tensors (dropout masks, LayerNorm statistics, SDPA's backend and
log-sum-exp, CUDA's autocast lists): planner/kernel_rules.py, the one place the formulas ask. The
attention terms: planner/activations_attention.py.

Per token, per block (n = b*s tokens; h hidden; kv = kv_heads*head_dim; f ffn; a heads; e = 2 or 4
bytes of the compute dtype; r = 4 (fp32 residual) or 2):
- RMSNorm (HF): x.float() 4h (saved by pow and mul), rsqrt 4, normalized x*rstd (fp32: 4h; lowp: the
  16-bit cast saved by `weight *`: 2h; autocast: fp32 4h), output (saved by the next Linear: fp32 4h,
  lowp 2h; autocast: not saved, each Linear saves its own 16-bit cast 2h).
- LayerNorm (`native_layer_norm`): input r*h, mean and rstd 8, output as for RMSNorm.
- attention: q e*h, k and v e*kv after RoPE (saved by SDPA), SDPA output e*h and logsumexp 4a
  (`_scaled_dot_product_flash_attention*` backward); the output's (B, S, nh, hd) layout makes the
  reshape for wo free. Eager: q e*h, K/V repeated to all heads 2*e*h, softmax output e*a*s (per
  token), the causal mask s*s bytes per block, and the contiguous copy for wo e*h. CUDA autocast runs
  softmax in fp32 (`autocast_mode.cpp` fp32 list), so there the probabilities are saved in fp32 and
  again as a 16-bit cast for the second matmul. SDPA's math fallback (CUDA, fp32, GQA: `sdpa_math`):
  scaled q, K/V repeated, the probabilities and the copy for wo, 4*e*h + e*a*s per token.
- MLP: SwiGLU gate, up, silu(gate), product: 4*e*f; GELU: fc output and gelu output: 2*e*f.
- RoPE cos/sin tables (s*head_dim each): fp32 shared by all blocks, or a 16-bit copy per block.
Outside the blocks: token ids and targets (int64), the embedding output when it feeds the first norm,
final norm, the LM head's input, and `log_softmax`'s fp32 output n*V*4 for the loss.

Transformers' models (`ModelSpec.hf_model_type` set, `read_hf_config(path, implementation=True)`):
the same ops except where the modeling code differs, each term citing the file it follows
(transformers 5.x, torch 2.1x; tests/test_analytic_vs_trace.py checks every term against the trace of
the real model, `planner.workload.trace.profile_hf`, byte for byte on CPU):
- RoPE: the cos/sin tables are made once per forward by `<Type>RotaryEmbedding` and cast to the hidden
  states' dtype there (fp32 under fp32 and autocast, 16-bit in lowp), shared by every layer.
- Fused projections (`ModelSpec.fused_qkv`, `fused_gate_up`: Phi-3 qkv_proj/gate_up_proj, GPT-2
  c_attn): one Linear reads the norm's output (under autocast one 16-bit cast, not three), and v is a
  view of the qkv output, so SDPA keeps that whole buffer alive.
- SDPA (`integrations/sdpa_attention.py`): no mask and `enable_gqa` (K/V at kv_heads) unless the mask is
  materialized (`masking_utils.sdpa_mask`: a sliding window no longer than the sequence), then K/V are
  repeated to all heads (`repeat_kv`) and SDPA keeps a float copy of the mask (b*s*s in q's dtype) per
  layer. Phi-3's `apply_rotary_pos_emb` concatenates, so q is (B, nh, S, hd)-contiguous, the kernel's
  output follows that layout and `.transpose(1, 2).contiguous()` copies it (e*h per token).
- Dropout (`at::dropout`, aten/src/ATen/native/Dropout.cpp): only where p > 0. On CUDA the fused
  `native_dropout` saves a bool mask (1 byte per element); elsewhere `_dropout_impl` saves the scaled
  noise in the input's dtype. Attention dropout on CPU sends SDPA to its math composite
  (`_scaled_dot_product_attention_math`, attention.cpp), which upcasts 16-bit inputs to fp32 there:
  scaled q, k and a copy of v (fp32), the probabilities, the dropout noise and the dropped
  probabilities (fp32), and the output's contiguous copy (input dtype). GPT-2 drops the embedding sum
  (embd_pdrop), both residual branches (resid_pdrop) and the probabilities (attn_pdrop); Phi-3 the
  residual branches (resid_pdrop); Llama, Mistral and Qwen2 only the probabilities (attention_dropout).
- GPT-2's `NewGELUActivation` (activation "gelu_new", `activations.py`):
  `0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x**3)))` saves x (pow), tanh's output, 0.5*x and 1+tanh (the
  last mul), and the proj saves the product: 5*e*f per token, where one `F.gelu` saves 2*e*f. Under CUDA's
  autocast `pow` runs in fp32 (autocast_mode.h `AT_FORALL_FP32`) and promotes the rest of the GELU: 16*f
  bytes per token (`kernel_rules.gelu_new_elem_bytes`).
- Loss (`loss/loss_utils.py` ForCausalLMLoss): logits `.float()`, labels padded and shifted into a new
  int64 tensor: the same bytes as the reference decoder's targets and fp32 log_softmax, except with one
  sequence per micro-batch, where the shifted slice is contiguous and the padded (s+1) labels are kept.
- Gemma-2 (`modeling_gemma2.py`; `ModelSpec.sandwich_norms`, `attn_softcap`, `final_softcap`,
  `head_dim_override`): four `Gemma2RMSNorm`s per block, each keeping x.float(), rsqrt, the fp32 x*rstd
  and its fp32 (1 + weight) vector (8h + 4 bytes per token and 4h per norm, in every regime); the two
  post-norms' outputs are saved by nothing (the residual add). Its eager attention keeps q, K and V
  repeated to every head, the soft-capped scores (`tanh`'s output), the fp32 softmax output, its cast to
  q's dtype (16-bit regimes) and o_proj's input copy; the head keeps the final soft-cap's `tanh` output
  (n x V) and the embedding's 0-dim scale when the weight is 16-bit. Checkpointed layers keep the
  additive masks they are given (one (B, 1, S, S) mask per layer type).
- Qwen3 (`modeling_qwen3.py`; `ModelSpec.qk_norm`): Qwen2's layer without q/k/v biases, plus a
  `Qwen3RMSNorm(head_dim)` on q and on k before RoPE, each keeping its fp32 input (the projection's output
  itself in fp32, a new copy otherwise), the normalized x*rstd as the weight's mul saves it (fp32, or
  its 16-bit cast) and rsqrt's output per head and token (`_qk_norm_saved`).
- Eager attention (`attention="eager"`, `attn_implementation="eager"`): the Llama family's
  `eager_attention_forward` (`_hf_eager_attention_saved`, Gemma-2's with its soft-cap) and GPT-2's
  (`_gpt2_eager_attention_saved`): the softmax's output in fp32 beside its 16-bit cast, no mask saved per
  layer; under checkpointing each checkpointed layer keeps the one additive (B, 1, S, S) mask the model made
  (`_eager_masks_kept`, `ActivationBreakdown.shared`: alive to block 0's backward end).
  SDPA's bool mask, materialized by a sliding window no longer than the sequence, is kept so too (s*s
  bytes, expanded over the batch).
Not followed for transformers' models: op-level selective checkpointing (its saved set is the reference
decoder's) and the philox seed and offset CUDA's fused kernels may keep as 0-dim device tensors (the
memory-efficient kernel without dropout: 16 bytes a layer, planner/workload/cuda_fused.py).

Tensor parallelism (`TrainConfig.tp` = t, `parallelize_module` with torchtitan's Llama plan): per op,
what one TP rank saves. Split by t (whole heads and MLP columns per rank): q, k, v, the attention
core (probabilities, masks, logsumexp, the output copy for o/wo) and the MLP's inner tensors (gate,
up, silu, product; fc and gelu outputs). Whole on every rank without sequence parallelism: the
residual stream, the norms (input, statistics, output, which the colwise Linears save as their
replicated input), the residual dropouts (the rowwise Linears' outputs are all-reduced, replicated),
RoPE tables and the causal mask. With sequence parallelism (`SequenceParallel` norms, rowwise outputs
Shard(1)) the norms and residual dropouts keep s/t tokens, but each colwise Linear still saves its
all-gathered (replicated) input of s tokens: DTensor's redistribute runs in forward and `mm` saves its
output, where Megatron-LM saves the shard and all-gathers it again in backward (Korthikanti et al.
2022, Sec. 4.2.2). Outside the blocks: token ids and targets whole, the loss sharded over the
vocabulary (torchtitan's loss parallel: logits and log_softmax n x V/t).

Checkpointing: `full` (`torch.utils.checkpoint`, non-reentrant, per block) keeps each block's input
and recomputes the block inside backward; `every-K` does so for blocks 0, K, 2K, ... and the others keep
all they save (`ActivationBreakdown.kept`: ceil(L/K) inputs and L - ceil(L/K) whole blocks); `selective`
is op-level selective checkpointing (`torch.utils.checkpoint.create_selective_checkpoint_contexts`) that
saves the outputs of `mm`/`addmm` and SDPA and recomputes everything else (norms, RoPE, activations, the
eager attention core).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .activations_attention import _attention_saved, _eager_masks_kept, _hf_mask, attention_widths, hf_eager
from .config import TrainConfig, checkpoint_every
from .kernel_rules import dropout_elem, gelu_new_elem_bytes, layer_norm_stat_bytes
from .strategies import FSDP1, FSDP2


def regime_for(train: TrainConfig, family: str) -> str:
    """Which numeric regime a strategy family runs the reference model in."""
    p = train.prec
    if not p.mixed:
        return "fp32" if p.compute_bytes == 4 else "lowp"
    return "lowp" if family in (FSDP1, FSDP2) else "autocast"


@dataclass(frozen=True, slots=True)
class ActivationBreakdown:
    """Bytes of saved activations for one micro-batch on one rank."""

    per_block: int
    """Saved by one block (no checkpointing), excluding RoPE tables shared across blocks."""
    blocks_total: int
    """All blocks, as kept through forward under the checkpointing mode."""
    outside: int
    """Embedding, inputs, final norm, LM head input (not the loss's log_softmax)."""
    loss_saved: int
    """log_softmax output saved for the loss backward (fp32, n*V*4)."""
    weight_cache: int
    """autocast's 16-bit copies of Linear weights that backward keeps (0 unless autocast; with
    checkpointing only the LM head's, the blocks' casts are recomputed)."""
    weight_cache_forward: int
    """autocast's weight cache at the end of forward: every Linear's cast, alive until the autocast
    region exits (`autocast_mode.cpp` cached_casts), whether or not backward keeps it."""
    recompute_block: int
    """Extra bytes alive while one checkpointed block is recomputed in backward."""
    logits_transient: int
    """Live at the loss in forward beyond loss_saved: 16-bit logits and their fp32 copy."""
    inputs: int = 0
    """Part of `outside` alive until the embedding's backward: token ids, targets, position ids."""
    block_cache: int = 0
    """Part of `weight_cache` that belongs to one block (freed with that block's backward); with every-K
    checkpointing, what one block that is not checkpointed keeps."""
    every: int = 0
    """Every-K checkpointing (K >= 2): blocks 0, K, 2K, ... are checkpointed (`config.checkpoint_every`),
    the others keep `per_block`; 0 when every block keeps the same (`blocks_total // layers` each)."""
    ckpt_kept: int = 0
    """With `every`: what a checkpointed block keeps through forward (its input)."""
    layers: int = 0
    """The model's blocks (the per-block accessors below index 0 .. layers-1)."""
    shared: int = 0
    """Part of `blocks_total` that every block shares rather than keeps its own: the RoPE tables (made once
    per forward) and, under checkpointing, the inputs every checkpointed block's closure keeps (eager
    attention's additive masks). Alive until block 0's backward is done, whatever the block."""
    held_inputs: int = 0
    """Part of `inputs` the training loop holds across the whole step, the optimizer's included: the token
    ids and the targets (int64; a Hugging Face model's labels are the ids tensor itself, `labels=ids`)."""

    @property
    def kept_each(self) -> int:
        """What each block keeps through forward besides `shared`, when every block keeps the same."""
        return (self.blocks_total - self.shared) // self.layers if self.layers else 0

    @property
    def total(self) -> int:
        return self.blocks_total + self.outside + self.loss_saved + self.weight_cache

    def checkpointed(self, j: int, mode: str) -> bool:
        """Block j is recomputed in its backward (`mode`: the training config's checkpointing)."""
        return j % self.every == 0 if self.every else mode in ("full", "selective", "selective-op")

    def kept(self, j: int) -> int:
        """What block j keeps through forward."""
        if not self.every:
            return self.kept_each
        return self.ckpt_kept if j % self.every == 0 else self.per_block

    def below(self, j: int) -> int:
        """Activations of blocks 0..j-1 (the RoPE tables the blocks share with them): the blocks' total
        less what blocks j..L-1 keep."""
        L = self.layers
        if not self.every:
            return self.blocks_total - (L - j) * self.kept_each
        n_ck = len(range(-(-j // self.every) * self.every, L, self.every))  # checkpointed among j..L-1
        return self.blocks_total - n_ck * self.ckpt_kept - (L - j - n_ck) * self.per_block

    def through(self, j: int) -> int:
        """Activations of blocks 0..j while block j's backward runs (its own kept bytes included). Uniform
        blocks: from one block's (j = 0) to every block's (j = L-1) in equal steps."""
        L = self.layers
        if not self.every:
            kb = self.shared + self.kept_each
            return kb + j * (self.blocks_total - kb) // (L - 1) if L > 1 else self.blocks_total
        return self.below(j + 1)

    def cache_below(self, j: int) -> int:
        """autocast's weight casts kept by blocks 0..j-1 (blocks that are not checkpointed)."""
        if not self.every:
            return j * self.block_cache
        return (j - len(range(0, j, self.every))) * self.block_cache


def sp_tokens(train: TrainConfig, n: int) -> int:
    """Tokens of a micro-batch (`n`) a rank keeps of a sequence-sharded tensor: n under plain tensor
    parallelism or none, ceil(s/t) per sequence with sequence parallelism (`torch.chunk` on dim 1)."""
    if not train.sequence_parallel:
        return n
    return (n // train.seq_len) * -(-train.seq_len // train.tp)


def _norm_saved(train: TrainConfig, regime: str, n: int, consumers: int, device: str) -> int:
    """Bytes a pre-norm keeps for backward, including its output as the next Linear(s) save it
    (`_norm_parts`, added up)."""
    return sum(_norm_parts(train, regime, n, consumers, device))


def _norm_parts(train: TrainConfig, regime: str, n: int, consumers: int, device: str) -> list[int]:
    """The tensors a pre-norm keeps for backward, in the order its forward makes them (bytes of each), then
    its output as each Linear after it saves it (alloc_trace writes them one by one).

    With sequence parallelism the norm itself runs on s/t tokens; the Linears after it save their
    all-gathered input (n tokens)."""
    h = train.model.hidden
    res = 4 if regime in ("fp32", "autocast") else 2
    e = 4 if regime == "fp32" else 2
    sp = sp_tokens(train, n)
    if train.model.sandwich_norms:
        per_token, const = _gemma_norm_parts(h)
        parts = [sp * x for x in per_token] + [const]
    elif train.model.norm == "rmsnorm":
        parts = [sp * 4 * h, sp * 4, sp * (2 * h if regime == "lowp" else 4 * h)]  # x.float(), rsqrt, x*rstd
    else:
        # native_layer_norm saves input, mean, rstd; mean/rstd are fp32 on CUDA (accumulate type,
        # aten/src/ATen/native/cuda/layer_norm_kernel.cu) but in the input dtype on CPU (LayerNorm.cpp).
        stat = layer_norm_stat_bytes(device, res)
        parts = [sp * res * h, sp * stat, sp * stat]
    if regime == "autocast":
        return parts + [n * 2 * h] * consumers  # each Linear saves its own 16-bit cast of the fp32 output
    return parts + [n * e * h]


def _gemma_norm_body(h: int) -> tuple[int, int]:
    """(bytes per token, bytes per norm) a `Gemma2RMSNorm` keeps (modeling_gemma2.py): x.float() (a new
    fp32 copy of a 16-bit input, the input itself in fp32; saved by pow and mul), rsqrt's output, x*rstd
    in fp32 (saved by the `* (1 + weight.float())` mul, which runs in fp32 in every regime, where Llama's
    norm multiplies the downcast), and that (1 + weight) vector: 4h bytes per norm, not per token
    (`_gemma_norm_parts`, added up)."""
    per_token, const = _gemma_norm_parts(h)
    return sum(per_token), const


def _gemma_norm_parts(h: int) -> tuple[list[int], int]:
    """([bytes per token of each tensor], bytes per norm) of `_gemma_norm_body`: x.float(), rsqrt, x*rstd."""
    return [4 * h, 4, 4 * h], 4 * h


def _qk_norm_saved(train: TrainConfig, regime: str, n: int) -> int:
    """Qwen3's per-head RMSNorms on q and k (`Qwen3Attention.q_norm`/`k_norm`, a `Qwen3RMSNorm(head_dim)`
    over the (B, S, heads, head_dim) projection outputs, `modeling_qwen3.py`): per element, `x.to(float32)`
    (saved by pow and mul: the projection's output itself in fp32, a new fp32 copy of the 16-bit output
    in lowp and under autocast, whose Linears return 16 bits) and the normalized x*rstd as `weight *`
    saves it (fp32: 4 bytes; else its cast back to the 16-bit input dtype: 2); per head and token,
    rsqrt's fp32 output. What reads their outputs (RoPE, SDPA) saves what it saves in Llama."""
    if not train.model.qk_norm:
        return 0
    q, a, kv = attention_widths(train)
    kv_heads = train.model.kv_heads // train.tp
    return n * ((q + kv) * (8 if regime == "fp32" else 6) + 4 * (a + kv_heads))


def _mlp_saved(train: TrainConfig, regime: str, n: int, device: str = "cuda") -> int:
    return sum(_mlp_parts(train, regime, n, device))


def _mlp_parts(train: TrainConfig, regime: str, n: int, device: str = "cuda") -> list[int]:
    """The tensors an MLP keeps for backward, one entry per tensor."""
    e = 4 if regime == "fp32" else 2
    m = train.model
    f = m.ffn_hidden // train.tp
    if m.mlp == "swiglu":
        return [n * e * f] * 4  # gate, up (one gate_up buffer when fused), silu(gate), product
    if m.activation == "gelu_new":  # NewGELUActivation: 0.5*x, pow's x, tanh(...), 1+tanh(...), product
        return [n * f * b for b in gelu_new_elem_bytes(device, regime)]
    return [n * e * f] * 2  # F.gelu: x and its output


def _resid_dropout_saved(train: TrainConfig, regime: str, n: int, device: str) -> int:
    """Dropout on the attention and MLP outputs (GPT-2 `resid_dropout` and `GPT2MLP.dropout`, Phi-3
    `resid_attn_dropout`/`resid_mlp_dropout`): two masks of n*h in the Linear outputs' dtype."""
    if train.model.resid_dropout <= 0:
        return 0
    e = 4 if regime == "fp32" else 2
    return 2 * sp_tokens(train, n) * train.model.hidden * dropout_elem(device, e)


def _rope_tables(train: TrainConfig, regime: str) -> tuple[int, int]:
    """(shared fp32 bytes, per-block 16-bit copy bytes) of the cos/sin tables."""
    m = train.model
    if m.position != "rope":
        return 0, 0
    table = train.seq_len * (m.rotary_dim or m.head_dim)
    if m.hf_model_type:
        # <Type>RotaryEmbedding.forward: `cos.to(dtype=x.dtype)` once per forward, x the embeddings
        return 2 * table * (2 if regime == "lowp" else 4), 0
    if regime == "fp32":
        return 2 * table * 4, 0
    return 0, 2 * table * 2


def linear_weight_elems(train: TrainConfig) -> int:
    """Elements of every Linear weight (and the tied LM head): the casts autocast's backward keeps.

    Biases are cast too but `addmm`'s backward does not save them, so they die with the autocast
    region (before backward) and are not counted here.
    """
    block, head = train.model.linear_weights()
    return train.model.layers * block + head


def block_saved(train: TrainConfig, regime: str, device: str = "cuda") -> int:
    """Bytes one block saves for backward with no checkpointing (RoPE tables excluded)."""
    n = train.micro_batch * train.seq_len
    m = train.model
    mlp_consumers = 2 if m.mlp == "swiglu" and not m.fused_gate_up else 1
    attn_consumers = 1 if m.fused_qkv else 3
    _, rope_per_block = _rope_tables(train, regime)
    post = 0
    if m.sandwich_norms:  # post_attention_layernorm, post_feedforward_layernorm: nothing saves their output
        body, const = _gemma_norm_body(m.hidden)
        post = 2 * (sp_tokens(train, n) * body + const)
    return (_norm_saved(train, regime, n, attn_consumers, device) + _attention_saved(train, regime, n, device)
            + _norm_saved(train, regime, n, mlp_consumers, device) + _mlp_saved(train, regime, n, device)
            + _resid_dropout_saved(train, regime, n, device) + _qk_norm_saved(train, regime, n)
            + rope_per_block + post)


def block_linears(model, tp: int = 1) -> list[tuple[int, int, bool]]:
    """The Linears of one block in forward order: (in, out, bias) -> `aten.mm`, or `addmm` with a bias.

    With `tp` > 1 one tensor-parallel rank's shapes: colwise q/k/v, gate/up (fc) produce out/tp
    columns, rowwise o and down (proj) read in/tp (their partial sums are h wide)."""
    h, kv, f = model.hidden, model.kv_dim, model.ffn_hidden
    hq, kv, f = model.q_dim // tp, kv // tp, f // tp
    qb = model.linear_bias or model.qkv_bias
    lin = ([(h, hq + 2 * kv, qb)] if model.fused_qkv else [(h, hq, qb), (h, kv, qb), (h, kv, qb)])
    lin.append((hq, h, model.linear_bias))
    if model.mlp == "swiglu":
        lin += [(h, 2 * f, model.linear_bias)] if model.fused_gate_up else [(h, f, model.linear_bias)] * 2
    else:
        lin.append((h, f, model.linear_bias))
    lin.append((f, h, model.linear_bias))
    return lin


def saved_linears(train: TrainConfig) -> list[bool]:
    """Which Linear outputs of a block (`block_linears` order) op-level checkpointing saves: all under
    `selective`; under `selective-op` (torchtitan) only `aten.mm` ones (no bias) at odd positions of the
    block's mm count, the 2nd, 4th, ... mm being recomputed."""
    lin = block_linears(train.model)
    if train.checkpointing != "selective-op":
        return [True] * len(lin)
    out, mm = [], 0
    for _, _, bias in lin:
        if bias:
            out.append(False)
        else:
            mm += 1
            out.append(mm % 2 == 1)
    return out


def _selective_block_saved(train: TrainConfig, regime: str) -> int:
    """Op-level SAC: the saved Linear outputs (`saved_linears`) and SDPA's (output + logsumexp)."""
    m = train.model
    n = train.micro_batch * train.seq_len
    e = 4 if regime == "fp32" else 2
    saved = n * e * sum(o for (_, o, _), keep in zip(block_linears(m, train.tp), saved_linears(train)) if keep)
    if train.attention == "sdpa":
        hq, a, _ = attention_widths(train)
        saved += n * (e * hq + 4 * a)
    return saved


def activations(train: TrainConfig, family: str, device: str = "cuda") -> ActivationBreakdown:
    """Saved activations of one micro-batch on one rank, for a strategy family on 'cuda' or 'cpu'.

    Cached per (training config, numeric regime, device): the families that share a regime share the
    figures, so a plan's eight strategies compute them twice, and a sweep over GPU counts once."""
    return activations_in(train, regime_for(train, family), device)


@lru_cache(maxsize=4096)
def activations_in(train: TrainConfig, regime: str, device: str) -> ActivationBreakdown:
    """`activations` for a numeric regime (`regime_for`) rather than a strategy family."""
    m = train.model
    n = train.micro_batch * train.seq_len
    h, v = m.hidden, -(-m.vocab // train.tp)  # the LM head's vocabulary shard (loss parallel)
    n_res = sp_tokens(train, n)  # tokens of the residual stream a rank holds
    e = 4 if regime == "fp32" else 2
    res = 4 if regime in ("fp32", "autocast") else 2
    shared_rope, _ = _rope_tables(train, regime)

    per_block = block_saved(train, regime, device)
    every = checkpoint_every(train.checkpointing)
    if train.checkpointing != "none" and m.position == "rope" and not shared_rope:
        # Checkpointed blocks keep their inputs, the fp32 cos/sin tables among them (2 * s * hd * 4).
        shared_rope = 2 * train.seq_len * m.head_dim * 4
    if train.checkpointing != "none" and m.hf_model_type:
        if hf_eager(train) or train.attention == "eager":
            shared_rope += _eager_masks_kept(train, regime, every)
        elif _hf_mask(train):
            # SDPA's materialized mask (a sliding window no longer than the sequence): one bool (1, 1, S, S)
            # expanded over the batch (`masking_utils.sdpa_mask`), kept by the checkpointed layers
            shared_rope += train.seq_len ** 2
    if train.checkpointing == "none":
        blocks_total = m.layers * per_block + shared_rope
        recompute = 0
    elif train.checkpointing == "full":
        blocks_total = m.layers * n_res * res * h + shared_rope  # each block's input
        recompute = per_block
    elif every > 1:
        # blocks 0, K, 2K, ... keep their input, the others all they save
        n_ck = len(range(0, m.layers, every))
        blocks_total = n_ck * n_res * res * h + (m.layers - n_ck) * per_block + shared_rope
        recompute = per_block
    else:
        blocks_total = m.layers * (_selective_block_saved(train, regime) + n_res * res * h) + shared_rope
        recompute = per_block - _selective_block_saved(train, regime)

    # Token ids (embedding backward) and targets (nll_loss), int64; positions for learned embeddings.
    # transformers' ForCausalLMLoss (loss/loss_utils.py) pads the labels to s+1 and takes
    # `labels[..., 1:].contiguous()`: a copy, except for one sequence, where the slice is contiguous
    # already and nll_loss keeps the padded tensor.
    targets = 8 * (train.seq_len + 1) if m.hf_model_type and train.micro_batch == 1 else 8 * n
    inputs = n * 8 + targets + (train.seq_len * 8 if m.position == "learned" else 0)
    outside = inputs
    if m.embed_dropout > 0:
        outside += n_res * h * dropout_elem(device, res)  # GPT2Model.drop on the embedding sum
    # Final norm and the LM head's input (the norm's output, or autocast's 16-bit cast of it).
    outside += _norm_saved(train, regime, n, 1, device)
    if m.sandwich_norms:
        # Gemma2TextScaledWordEmbedding: `* embed_scale.to(weight.dtype)` saves that 0-dim tensor, a new
        # one when the weight is 16-bit (the fp32 buffer itself, model state, with fp32 weights)
        outside += 2 if regime == "lowp" else 0
    if m.final_softcap:
        # Gemma2ForCausalLM: logits / cap, tanh (saves its output, n x V in the logits' dtype), * cap
        outside += n * v * e
    # `x = tok_embeddings(tokens)`: fp32 when the embedding is fp32, saved by the first RMSNorm only
    # through x.float() (regime fp32/autocast: the same tensor; lowp: a new fp32 copy counted there).
    loss_saved = n * v * 4
    if m.hf_model_type and recompute:
        # The recompute saves what the block saved, but the first norm's saved input is the kept block input
        # itself (an RMSNorm's `x.to(float32)` of fp32 hidden states, a LayerNorm's input), not a new tensor
        # (measured: the trace and CPU probes of Llama with eager attention at 2 x 1024 tokens, zero3 and fsdp
        # fp32 with full checkpointing, +0.77% with it counted twice)
        if m.norm == "layernorm":
            recompute -= n_res * res * h
        elif regime != "lowp":
            recompute -= n_res * 4 * h
    if regime == "autocast" and train.checkpointing != "none" and m.layers:
        # The recompute runs under autocast again: it re-casts the block's weights and biases, alive
        # in the cache while the block's backward runs.
        blk = m.units()[1]
        recompute += 2 * sum(n for (name, _), n in zip(blk.params, blk.sizes()) if "norm" not in name)
    cache_all = 2 * linear_weight_elems(train) if regime == "autocast" else 0
    head_cache = 2 * v * h if regime == "autocast" else 0
    weight_cache = cache_all if train.checkpointing == "none" else head_cache
    block_cache = (weight_cache - head_cache) // m.layers if m.layers else 0
    if every > 1 and m.layers:  # the blocks that are not checkpointed keep their casts to their backward
        block_cache = (cache_all - head_cache) // m.layers
        weight_cache = head_cache + (m.layers - len(range(0, m.layers, every))) * block_cache
    logits_transient = n * v * e + (0 if e == 4 else n * v * 4)
    if train.tp > 1:
        # loss parallel's `_log_softmax` (`tensor/parallel/loss.py`) keeps `shifted = x - x_max` alive
        # while `result = shifted - logsumexp` is made: one more n x V/t fp32 tensor at the loss
        logits_transient += n * v * 4
    held_inputs = n * 8 + (0 if m.hf_model_type else 8 * n)
    return ActivationBreakdown(per_block, blocks_total, outside, loss_saved, weight_cache, cache_all,
                               recompute, logits_transient, inputs, block_cache,
                               every if every > 1 else 0, n_res * res * h if every > 1 else 0, m.layers,
                               shared_rope, held_inputs)
