"""The allocator replay's op-by-op block forward (planner/alloc_trace.py `block_program`) against the block itself:
a TorchDispatchMode records every storage a transformers decoder layer (or the reference decoder's Block,
validate/model.py) makes on the CPU and a weakref finalizer when each one goes, under no_grad (a checkpointed
block's forward) and with autograd on (what it saves stays). The program must make and drop the same bytes in
the same order: the live bytes after every allocation, one list against the other."""

from __future__ import annotations

import json
import weakref

import pytest

torch = pytest.importorskip("torch")

from distplan.planner.alloc_trace import block_program  # noqa: E402
from distplan.planner.config import TrainConfig  # noqa: E402
from distplan.planner.model import unit_sizes  # noqa: E402

N_TOKENS = 96  # 1 x 96: no size of one tensor equals another's by accident at these widths


def _recorded(run, weights) -> list[int]:
    """Live bytes after each allocation while `run()` executes: the storages the ops make (not the parameters,
    not views of the inputs), each counted until its finalizer runs."""
    from torch.utils._python_dispatch import TorchDispatchMode
    skip = {p.untyped_storage().data_ptr() for p in weights}
    live: dict = {}
    trail: list = []
    total = [0]

    def gone(key, nbytes):
        if live.pop(key, None) is not None:
            total[0] -= nbytes

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ins = {x.untyped_storage().data_ptr() for a in list(args) + list((kwargs or {}).values())
                   for x in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(x, torch.Tensor)}
            out = func(*args, **(kwargs or {}))
            for o in (out if isinstance(out, (tuple, list)) else [out]):
                if not isinstance(o, torch.Tensor):
                    continue
                st = o.untyped_storage()
                key = st.data_ptr()
                if not key or key in live or key in ins or key in skip or not st.nbytes():
                    continue
                live[key] = st.nbytes()
                total[0] += st.nbytes()
                trail.append(total[0])
                weakref.finalize(st, gone, key, st.nbytes())
            return out
    with Record():
        kept = run()
    del kept
    return trail


def _written(ops, casts: list[int]) -> list[int]:
    """The same list from a block program (the input "x" is the caller's; ("w", (i, ...)) the casts' sum)."""
    live, trail, total = {}, [], 0
    for op in ops:
        if op[0] == "a":
            live[op[1]] = op[2]
        elif op[0] == "w":
            live[f"w{op[1]}"] = sum(casts[i] for i in op[1])
        elif op[0] == "f":
            for k in op[1:]:
                total -= live.pop(k, 0)  # (the input: the caller's)
            continue
        else:
            continue
        total += live[op[1]] if op[0] == "a" else live[f"w{op[1]}"]
        trail.append(total)
    return trail


def _hf_layer(model_type: str, dtype, extra: dict):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(model_type, hidden_size=256, intermediate_size=688, num_attention_heads=8,
                                            num_key_value_heads=2, num_hidden_layers=2, vocab_size=1000,
                                            pad_token_id=0, **extra)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    return cfg, model


HF_CASES = [("llama", "fp32", {}), ("llama", "bf16", {}), ("llama", "autocast", {}), ("qwen2", "fp32", {}),
            ("mistral", "bf16", {"sliding_window": 64}), ("mistral", "autocast", {"sliding_window": 64}),
            ("phi3", "bf16", {}), ("phi3", "autocast", {})]


@pytest.mark.parametrize("model_type,regime,extra", HF_CASES, ids=[f"{t}-{r}" + ("-mask" if e else "")
                                                                  for t, r, e in HF_CASES])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_block_program_is_the_transformers_layers_forward(model_type, regime, extra, grad, tmp_path):
    from distplan.planner.api import resolve_model
    dtype = torch.bfloat16 if regime == "bf16" else torch.float32
    cfg, model = _hf_layer(model_type, dtype, extra)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    spec = resolve_model(hf_config=str(path))[0]
    precision = {"fp32": "fp32", "bf16": "bf16", "autocast": "bf16-mixed"}[regime]
    train = TrainConfig(spec, seq_len=N_TOKENS, micro_batch=1, precision=precision,
                        checkpointing="none" if grad else "full")
    ops = block_program(train, {"bf16": "lowp"}.get(regime, regime), N_TOKENS, "cpu", grad)
    assert ops is not None
    casts = [2 * a * b for a, b in (s for s in unit_sizes(spec)[1] if len(s) == 2)]
    layer = model.model.layers[0]
    ids = torch.randint(1, 1000, (1, N_TOKENS))

    def run():
        # the layer's forward alone, inside the model's (its inputs made outside the recording)
        grab = {}

        def hook(mod, args, kwargs):
            grab["args"], grab["kwargs"] = args, kwargs
            raise StopIteration
        h = layer.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            with torch.no_grad(), _autocast(regime):
                model.model(ids, use_cache=False)
        except StopIteration:
            pass
        h.remove()
        x = grab["args"][0] if grab["args"] else grab["kwargs"].pop("hidden_states")
        x = x.detach().requires_grad_(grad)
        kwargs = {k: v for k, v in grab["kwargs"].items() if k != "hidden_states"}
        return x, kwargs
    x, kwargs = run()
    weights = list(model.parameters())

    def forward():
        with torch.set_grad_enabled(grad), _autocast(regime):
            return layer(x, **kwargs)
    assert _written(ops, casts) == _recorded(forward, weights)


def _autocast(regime: str):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=regime == "autocast")


REF_CASES = [("rmsnorm", "swiglu", "rope", "fp32"), ("rmsnorm", "swiglu", "rope", "bf16"),
             ("layernorm", "gelu", "learned", "fp32"), ("layernorm", "gelu", "learned", "bf16")]


@pytest.mark.parametrize("norm,mlp,position,regime", REF_CASES, ids=["-".join(c) for c in REF_CASES])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_block_program_is_the_reference_decoders_block(norm, mlp, position, regime, grad):
    from distplan.planner.model import ModelSpec
    from distplan.validate.model import Block, rope_tables
    spec = ModelSpec(name="t", layers=2, hidden=256, heads=8, kv_heads=2 if position == "rope" else 8,
                     ffn_hidden=688, vocab=1000, max_positions=128, mlp=mlp, norm=norm, position=position,
                     linear_bias=norm == "layernorm")
    dtype = torch.bfloat16 if regime == "bf16" else torch.float32
    train = TrainConfig(spec, seq_len=N_TOKENS, micro_batch=1, precision="fp32" if regime == "fp32" else "bf16",
                        checkpointing="none" if grad else "full")
    ops = block_program(train, "fp32" if regime == "fp32" else "lowp", N_TOKENS, "cpu", grad)
    assert ops is not None
    torch.manual_seed(0)
    block = Block(spec, "sdpa").to(dtype)
    x = torch.randn(1, N_TOKENS, 256, dtype=dtype, requires_grad=grad)
    cos, sin = rope_tables(N_TOKENS, spec.head_dim) if position == "rope" else (None, None)

    def forward():
        with torch.set_grad_enabled(grad):
            return block(x, cos, sin)
    assert _written(ops, []) == _recorded(forward, list(block.parameters()))
