"""The activation table against what autograd actually saves (`saved_tensors_hooks`) in the reference
decoder: exact bytes, for each architecture family, attention implementation and numeric regime."""

import contextlib

import pytest

torch = pytest.importorskip("torch")

from distplan.planner.activations import activations, regime_for  # noqa: E402
from distplan.planner.config import TrainConfig  # noqa: E402
from distplan.planner.model import ModelSpec  # noqa: E402
from distplan.validate.model import Decoder  # noqa: E402

SHAPES = {
    "llama-gqa": ModelSpec("llama-gqa", layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=96, vocab=100),
    "gpt2-mha": ModelSpec("gpt2-mha", layers=2, hidden=48, heads=4, kv_heads=4, ffn_hidden=192, vocab=120,
                          max_positions=64, mlp="gelu", norm="layernorm", position="learned",
                          tie_embeddings=True, linear_bias=True),
    "qwen-bias": ModelSpec("qwen-bias", layers=3, hidden=32, heads=2, kv_heads=1, ffn_hidden=80, vocab=90,
                           qkv_bias=True),
}
FAMILY = {"fp32": ("fp32", "ddp"), "lowp": ("bf16", "ddp"), "autocast": ("bf16-mixed", "ddp"),
          "fsdp-mixed": ("bf16-mixed", "fsdp2")}


def saved_bytes(spec, train, regime):
    torch.manual_seed(0)
    model = Decoder(spec, train.attention)
    if regime == "lowp":
        model = model.to(torch.bfloat16)
    b, s = train.micro_batch, train.seq_len
    tokens = torch.randint(0, spec.vocab, (b, s))
    targets = torch.randint(0, spec.vocab, (b, s))
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept, seen = [], set()

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in param_storages and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            kept.append(st.nbytes())
        return t

    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if regime == "autocast" else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        loss = model(tokens, targets)
    del loss
    return sum(kept)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("case", sorted(FAMILY))
def test_saved_tensors_match_formula(shape, attention, case):
    precision, family = FAMILY[case]
    spec = SHAPES[shape]
    train = TrainConfig(spec, seq_len=16, micro_batch=2, precision=precision, attention=attention)
    regime = regime_for(train, family)
    if case == "fsdp-mixed":
        assert regime == "lowp"  # FSDP's param_dtype casts the module: same saved set as pure bf16
    measured = saved_bytes(spec, train, regime)
    act = activations(train, family, device="cpu")
    predicted = act.total + 4  # + cross_entropy's scalar total_weight
    print(f"{shape}/{attention}/{case}: predicted {predicted}, measured {measured}")
    assert predicted == measured


def _forward_live_bytes(spec, train, regime):
    """Bytes that stay alive from the start of forward to its end (loss kept), params excluded."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    class Live(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    if st.data_ptr() in param_ptrs:
                        continue
                    k = id(st)
                    if k not in self.live:
                        self.live[k] = (st.nbytes(), weakref.ref(st, lambda _r, k=k: self.live.pop(k, None)))
            return out

    torch.manual_seed(0)
    model = Decoder(spec, train.attention, train.checkpointing)
    if regime == "lowp":
        model = model.to(torch.bfloat16)
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    tokens = torch.randint(0, spec.vocab, (train.micro_batch, train.seq_len))
    targets = torch.randint(0, spec.vocab, (train.micro_batch, train.seq_len))
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if regime == "autocast" else contextlib.nullcontext()
    mode = Live()
    with mode, ctx:
        loss = model(tokens, targets)
    total = sum(n for n, _ in mode.live.values())
    del loss
    return total


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("ckpt", ["none", "full", "selective"])
@pytest.mark.parametrize("case", ["fp32", "autocast", "lowp"])
def test_checkpointing_live_bytes_after_forward(shape, ckpt, case):
    """What stays alive after forward (saved tensors, checkpoint inputs, SAC's saved matmul outputs)."""
    precision, family = FAMILY[case]
    spec = SHAPES[shape]
    train = TrainConfig(spec, seq_len=16, micro_batch=2, precision=precision, checkpointing=ckpt)
    regime = regime_for(train, family)
    measured = _forward_live_bytes(spec, train, regime)
    act = activations(train, family, device="cpu")
    # + total_weight and the loss scalar; - the token ids, made before forward and never a view output
    predicted = act.total + 4 + 4 - train.micro_batch * train.seq_len * 8
    print(f"{shape}/{ckpt}/{case}: predicted {predicted}, measured {measured}")
    assert predicted == measured
