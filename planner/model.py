"""Model architecture: the decoder the planner describes, and its exact parameter inventory.

Owns `ModelSpec` (a Llama-style or GPT-2-style decoder) and the list of parameter tensors in the
order PyTorch registers them in the reference model (`distplan.validate.model.Decoder`). The planner's
parameter count, its DDP bucket assignment and its FSDP unit sizes all come from `param_inventory`,
and a test asserts the same count and shapes as the torch module, so the two cannot drift.

Known limitations: dense decoders only (no MoE, no cross-attention); rotary embeddings have no
parameters; the MLP is either SwiGLU (gate, up, down) or GELU (fc, proj).

Whose forward pass the activation formulas follow: the reference decoder (`hf_model_type` empty, the
default, as every catalog entry) or transformers' modeling code of one model type (`hf_model_type`,
with the config's activation variant, dropout probabilities and sliding window; set by
`read_hf_config(path, implementation=True)`). These fields change saved activations only, never the
parameter inventory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache
from math import prod
from operator import attrgetter
from typing import Literal

def cached_hash(self) -> int:
    """`__hash__` for a frozen dataclass that keys caches: the fields' hash, computed once. Hashing a
    spec's 16 fields on every cache lookup was a measurable share of a 10,000-config sweep."""
    h = self.__dict__.get("_hash")
    if h is None:
        h = hash(astuple_shallow(self))
        object.__setattr__(self, "_hash", h)
    return h


def state_without_hash(self) -> dict:
    """`__getstate__` to go with `cached_hash`: str hashes differ between processes, so a pickled
    object recomputes its hash where it is loaded."""
    state = dict(self.__dict__)
    state.pop("_hash", None)
    return state


MLP = Literal["swiglu", "gelu"]
NORM = Literal["rmsnorm", "layernorm"]
HF_MODEL_TYPES = ("", "gemma2", "gpt2", "llama", "mistral", "phi3", "qwen2", "qwen3")
"""`hf_model_type` values: "" is the reference decoder (`distplan.validate.model.Decoder`)."""
ACTIVATIONS = ("", "gelu_new")
"""`activation` values: "" the MLP's one native op (SiLU, or GELU: erf or tanh, `F.gelu` saves only its
input); "gelu_new" transformers' `NewGELUActivation`, the tanh formula written out in Python ops."""
POSITION = Literal["rope", "learned"]


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, enough to count parameters, activations and FLOPs exactly."""

    name: str
    """Display name (catalog name, `hf:<path>`, or `~7B (llama-2-7b scaled)`)."""
    layers: int
    """Number of decoder blocks (L)."""
    hidden: int
    """Model width (h)."""
    heads: int
    """Query heads (a); head dim is hidden // heads unless `head_dim_override` says otherwise."""
    kv_heads: int
    """Key/value heads (GQA when < heads, MHA when == heads)."""
    ffn_hidden: int
    """Inner width of the MLP (f)."""
    vocab: int
    """Vocabulary size (V)."""
    max_positions: int = 2048
    """Learned position table size (only for position='learned')."""
    mlp: MLP = "swiglu"
    """'swiglu' (gate, up, down; Llama) or 'gelu' (fc, proj; GPT-2)."""
    norm: NORM = "rmsnorm"
    """'rmsnorm' (weight only) or 'layernorm' (weight and bias)."""
    position: POSITION = "rope"
    """'rope' (no parameters) or 'learned' (a max_positions x hidden table)."""
    tie_embeddings: bool = False
    """The LM head reuses the token embedding weight."""
    linear_bias: bool = False
    """Every Linear in the blocks has a bias (GPT-2)."""
    qkv_bias: bool = False
    """Only q, k, v projections have a bias (Qwen2)."""
    source: str = ""
    """Where the figures come from."""
    hf_model_type: str = ""
    """"" (the reference decoder) or the transformers model_type whose modeling code the activation
    formulas follow (llama, mistral, qwen2, qwen3, phi3, gpt2, gemma2)."""
    activation: str = ""
    """"" (one native op) or "gelu_new" (GPT-2's `NewGELUActivation`, five n x f tensors saved)."""
    attn_dropout: float = 0.0
    """Dropout on the attention probabilities in training (GPT-2 attn_pdrop; attention_dropout)."""
    resid_dropout: float = 0.0
    """Dropout on each block's attention and MLP outputs (GPT-2/Phi-3 resid_pdrop)."""
    embed_dropout: float = 0.0
    """Dropout on the embedding output (GPT-2 embd_pdrop)."""
    sliding_window: int = 0
    """Sliding-window attention span, 0 for none (Mistral's sliding_window): from seq_len >= window on,
    transformers materializes the attention mask."""
    rotary_dim: int = 0
    """Rotated dimensions per head, 0 for all of head_dim (Phi-3's partial_rotary_factor < 1)."""
    head_dim_override: int = 0
    """Width of one attention head when it is not hidden // heads (Gemma-2's `head_dim`: 256 for the 9B
    at hidden 3584 and 16 heads); 0: hidden // heads. q and o then project to and from heads x head_dim."""
    attn_softcap: float = 0.0
    """Gemma-2's `attn_logit_softcapping`: scores = cap * tanh(scores / cap) before the softmax (eager
    attention only: transformers' Gemma2 has no SDPA path); 0 for none."""
    final_softcap: float = 0.0
    """Gemma-2's `final_logit_softcapping`: logits = cap * tanh(logits / cap) before the loss; 0 for none."""
    sandwich_norms: bool = False
    """Four norms per block (Gemma-2's `Gemma2DecoderLayer`): input_layernorm, post_attention_layernorm on
    the attention's output before the residual add, pre_feedforward_layernorm, post_feedforward_layernorm
    on the MLP's output; each `Gemma2RMSNorm` multiplies by (1 + weight) in fp32 before casting back
    (`modeling_gemma2.py`)."""
    qk_norm: bool = False
    """An RMSNorm over each head's head_dim on q and on k, after their projections and before RoPE
    (transformers' `Qwen3Attention.q_norm`/`k_norm`, a `Qwen3RMSNorm(head_dim)` each, `modeling_qwen3.py`):
    two head_dim weights per block."""

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "max_positions"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{field}={value!r}: must be a positive integer")
        if self.hidden % self.heads and not self.head_dim_override:
            raise ValueError(
                f"heads={self.heads} does not divide hidden={self.hidden}: "
                f"choose heads so that hidden/heads is a whole head dimension")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"kv_heads={self.kv_heads} does not divide heads={self.heads}: "
                f"grouped-query attention needs heads to be a multiple of kv_heads")
        if self.mlp not in ("swiglu", "gelu"):
            raise ValueError(f"mlp={self.mlp!r}: accepted values are 'swiglu', 'gelu'")
        if self.norm not in ("rmsnorm", "layernorm"):
            raise ValueError(f"norm={self.norm!r}: accepted values are 'rmsnorm', 'layernorm'")
        if self.position not in ("rope", "learned"):
            raise ValueError(f"position={self.position!r}: accepted values are 'rope', 'learned'")
        if self.hf_model_type not in HF_MODEL_TYPES:
            raise ValueError(f"hf_model_type={self.hf_model_type!r}: accepted values are "
                             f"{', '.join(map(repr, HF_MODEL_TYPES))}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r}: accepted values are "
                             f"{', '.join(map(repr, ACTIVATIONS))}")
        if self.activation == "gelu_new" and self.mlp != "gelu":
            raise ValueError("activation='gelu_new' needs mlp='gelu'")
        for field in ("attn_dropout", "resid_dropout", "embed_dropout"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"{field}={value!r}: must be a probability in [0, 1)")
        for field in ("sliding_window", "rotary_dim", "head_dim_override"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{field}={value!r}: must be a non-negative integer (0: none)")
        for field in ("attn_softcap", "final_softcap"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"{field}={value!r}: must be a non-negative number (0: none)")
        if self.rotary_dim > self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim={self.rotary_dim}: must be even and at most head_dim "
                             f"{self.head_dim}")

    __hash__ = cached_hash  # keys the planner's caches
    __getstate__ = state_without_hash

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        """Width of q and of o_proj's input: heads x head_dim (hidden unless `head_dim_override`)."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def fused_qkv(self) -> bool:
        """One projection makes q, k and v (transformers' Phi-3 `qkv_proj`, GPT-2 `c_attn`): one Linear
        reads the norm's output, and q, k, v are views of its output."""
        return self.hf_model_type in ("phi3", "gpt2")

    @property
    def fused_gate_up(self) -> bool:
        """One projection makes gate and up (transformers' Phi-3 `gate_up_proj`)."""
        return self.hf_model_type == "phi3"

    def with_overrides(self, **changes) -> "ModelSpec":
        changes = {k: v for k, v in changes.items() if v is not None}
        return replace(self, **changes) if changes else self

    def to_dict(self) -> dict:
        return asdict(self)

    # -- parameters ---------------------------------------------------------------------------

    def param_inventory(self) -> list["ParamGroup"]:
        """Parameter tensors grouped by wrapping unit, in registration order.

        Units: 'embed' (token + learned positions), 'block{i}' for each layer, 'head' (final norm
        and, when untied, the LM head). This is the order of `Decoder.named_parameters()`.
        Cached per spec (a spec is immutable); each call returns a new list of the same groups.
        """
        return list(_inventory(self))

    def units(self) -> tuple["ParamGroup", "ParamGroup", "ParamGroup"]:
        """(embed, block0, head): the inventory's distinct units (every block is block0 renamed), which
        is all the planner's formulas need; cheaper than the whole inventory for a deep model."""
        return _units(self)

    def _build_units(self) -> tuple["ParamGroup", "ParamGroup", "ParamGroup"]:
        h, f, v, kv = self.hidden, self.ffn_hidden, self.vocab, self.kv_dim
        embed = [("tok_embeddings.weight", (v, h))]
        if self.position == "learned":
            embed.append(("pos_embeddings.weight", (self.max_positions, h)))

        def norm(prefix: str) -> list:
            out = [(f"{prefix}.weight", (h,))]
            if self.norm == "layernorm":
                out.append((f"{prefix}.bias", (h,)))
            return out

        def linear(prefix: str, out_f: int, in_f: int, bias: bool) -> list:
            out = [(f"{prefix}.weight", (out_f, in_f))]
            if bias:
                out.append((f"{prefix}.bias", (out_f,)))
            return out

        qkvb = self.linear_bias or self.qkv_bias
        q = self.q_dim
        p = "layers.0"
        params = norm(f"{p}.attn_norm")
        params += linear(f"{p}.attn.wq", q, h, qkvb)
        params += linear(f"{p}.attn.wk", kv, h, qkvb)
        params += linear(f"{p}.attn.wv", kv, h, qkvb)
        params += linear(f"{p}.attn.wo", h, q, self.linear_bias)
        if self.qk_norm:  # Qwen3Attention registers q_norm and k_norm after o_proj
            params += [(f"{p}.attn.q_norm.weight", (self.head_dim,)), (f"{p}.attn.k_norm.weight", (self.head_dim,))]
        if self.sandwich_norms:
            params += norm(f"{p}.post_attn_norm")
        params += norm(f"{p}.mlp_norm")
        if self.mlp == "swiglu":
            params += linear(f"{p}.mlp.w_gate", f, h, self.linear_bias)
            params += linear(f"{p}.mlp.w_up", f, h, self.linear_bias)
            params += linear(f"{p}.mlp.w_down", h, f, self.linear_bias)
        else:
            params += linear(f"{p}.mlp.fc", f, h, self.linear_bias)
            params += linear(f"{p}.mlp.proj", h, f, self.linear_bias)
        if self.sandwich_norms:
            params += norm(f"{p}.post_mlp_norm")

        head = norm("norm")
        if not self.tie_embeddings:
            head.append(("output.weight", (v, h)))
        return ParamGroup("embed", tuple(embed)), ParamGroup("block0", tuple(params)), ParamGroup("head", tuple(head))

    def _build_inventory(self) -> tuple["ParamGroup", ...]:
        embed, block, head = self.units()
        suffixes = [(name[len("layers.0."):], shape) for name, shape in block.params]
        blocks = [ParamGroup(f"block{i}", tuple((f"layers.{i}.{sfx}", shape) for sfx, shape in suffixes))
                  for i in range(self.layers)]
        return (embed, *blocks, head)

    def linear_weights(self) -> tuple[int, int]:
        """(Linear weight elements of one block, of the LM head): the weights that enter matmuls (and
        that autocast casts). The head is vocab x hidden whether it is its own or the tied embedding."""
        return _linear_weights(self)

    def block_param_count(self) -> int:
        return self.units()[1].numel

    def param_count(self) -> int:
        """Exact parameter count (tied weights counted once), as `sum(p.numel())` in torch."""
        n = self.__dict__.get("_param_count")
        if n is None:
            n = self._count_params()
            object.__setattr__(self, "_param_count", n)
        return n

    def _count_params(self) -> int:
        h, f, v, kv = self.hidden, self.ffn_hidden, self.vocab, self.kv_dim
        n_norm = h * (2 if self.norm == "layernorm" else 1)
        qkvb = self.linear_bias or self.qkv_bias
        q = self.q_dim
        attn = q * h + 2 * kv * h + h * q + (q + 2 * kv if qkvb else 0) + (h if self.linear_bias else 0)
        if self.mlp == "swiglu":
            mlp = 3 * h * f + ((2 * f + h) if self.linear_bias else 0)
        else:
            mlp = 2 * h * f + ((f + h) if self.linear_bias else 0)
        block = (4 if self.sandwich_norms else 2) * n_norm + attn + mlp + (2 * self.head_dim if self.qk_norm else 0)
        embed = v * h + (self.max_positions * h if self.position == "learned" else 0)
        head = n_norm + (0 if self.tie_embeddings else v * h)
        return embed + self.layers * block + head


@dataclass(frozen=True)
class ParamGroup:
    """One wrapping unit's parameters: (name, shape) in registration order."""

    unit: str
    params: tuple

    @property
    def numel(self) -> int:
        return sum(prod(shape) for _, shape in self.params)

    def sizes(self) -> list[int]:
        return [prod(shape) for _, shape in self.params]


def astuple_shallow(obj) -> tuple:
    """A dataclass's field values, not recursing into them (unlike `dataclasses.astuple`)."""
    getter = _FIELD_GETTERS.get(type(obj))
    if getter is None:
        getter = _FIELD_GETTERS[type(obj)] = attrgetter(*(f.name for f in fields(obj)))
    return getter(obj)


_FIELD_GETTERS: dict = {}


@lru_cache(maxsize=256)
def _inventory(spec: ModelSpec) -> tuple:
    return spec._build_inventory()


@lru_cache(maxsize=1024)
def _units(spec: ModelSpec) -> tuple:
    return spec._build_units()


@lru_cache(maxsize=1024)
def unit_sizes(spec: ModelSpec) -> tuple[tuple, tuple, int, int, int]:
    """(root shapes, block shapes, root elements, block elements, largest parameter's elements): the
    root unit is embed + head in registration order, every block is block 0. Computed once per spec for
    the memory layouts and the collective schedules."""
    embed, blk, head = spec.units()
    root_shapes = tuple(s for _, s in embed.params + head.params)
    block_shapes = tuple(s for _, s in blk.params)
    sizes = [prod(s) for s in root_shapes + block_shapes]
    return root_shapes, block_shapes, sum(sizes[:len(root_shapes)]), sum(sizes[len(root_shapes):]), max(sizes)


@lru_cache(maxsize=1024)
def _linear_weights(spec: ModelSpec) -> tuple[int, int]:
    block = sum(prod(s) for n, s in spec.units()[1].params if n.endswith(".weight") and len(s) == 2)
    return block, spec.vocab * spec.hidden


@dataclass(frozen=True)
class TPRankSpec(ModelSpec):
    """One tensor-parallel rank's share of a `ModelSpec`'s parameters, as PyTorch's `parallelize_module`
    with torchtitan's Llama plan (`torchtitan/models/llama3/infra/parallelize.py` `apply_tp`) leaves it.

    The architecture fields are the whole model's (so the activation and FLOP formulas, which divide by
    `TrainConfig.tp` themselves, read the true widths); only the parameter shapes are one rank's:
    q/k/v and gate/up (or fc) `ColwiseParallel` (weight and bias Shard(0): out/tp rows), o and down (or
    proj) `RowwiseParallel` (weight Shard(1): in/tp columns, bias replicated), the token embedding
    `RowwiseParallel` (an embedding's weight Shard(0): vocab/tp rows) and the LM head `ColwiseParallel`
    (vocab/tp rows), norms and learned positions replicated. A DTensor dimension that tp does not divide
    is split in chunks of ceil(d/tp) (`torch.chunk`): the most loaded rank, rank 0, holds ceil(d/tp).
    """

    tp: int = 1

    def _build_units(self):
        t = self.tp
        embed, block, head = ModelSpec._build_units(self)
        if t == 1:
            return embed, block, head

        def cdiv(d: int) -> int:
            return -(-d // t)

        col = (".wq.", ".wk.", ".wv.", ".w_gate.", ".w_up.", ".mlp.fc.")
        row = (".wo.weight", ".w_down.weight", ".mlp.proj.weight")

        def shard(name: str, shape: tuple) -> tuple:
            if name in ("tok_embeddings.weight", "output.weight") or any(c in name for c in col):
                return (cdiv(shape[0]),) + tuple(shape[1:])
            if any(name.endswith(r) for r in row):
                return (shape[0], cdiv(shape[1]))
            return shape  # norms, row-parallel biases, learned positions: replicated

        def apply(u: ParamGroup) -> ParamGroup:
            return ParamGroup(u.unit, tuple((n, shard(n, s)) for n, s in u.params))
        return apply(embed), apply(block), apply(head)

    def _count_params(self) -> int:
        if self.tp == 1:
            return ModelSpec._count_params(self)
        embed, block, head = self.units()
        return embed.numel + self.layers * block.numel + head.numel

    def linear_weights(self) -> tuple[int, int]:
        block, _ = _linear_weights(self)
        return block, -(-self.vocab // self.tp) * self.hidden

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("tp")
        return d


def tp_rank_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    """`spec` as one tensor-parallel rank holds it (`TPRankSpec`); `spec` itself for tp=1. One object
    per (spec, tp), so the caches keyed by the spec (layouts, units, schedules) are shared."""
    if tp == 1:
        return spec
    return _tp_rank_spec(spec, tp)


@lru_cache(maxsize=256)
def _tp_rank_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    kw = {f.name: getattr(spec, f.name) for f in fields(ModelSpec)}
    return TPRankSpec(**kw, tp=tp)
