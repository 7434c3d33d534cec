"""Probe specs: one spec per probe, and the standard validation matrix.

`make_spec()` builds the JSON spec a probe reads (`distplan.validate.probe --spec`). `standard_matrix()`
crosses every strategy of `distplan.planner.strategies.NAMES` (`single` only at world 1) with three small
model shapes and two world sizes, and rotates activation checkpointing (none/full) x two precisions
through them so that each strategy meets all four (checkpointing, precision) pairs and each shape and
world size meets all four too, in 54 probes instead of the 204 of the full product (`full=True` gives
the full product). Where the probes run:

| machine      | world sizes                              | precisions                  |
|--------------|------------------------------------------|-----------------------------|
| no GPU       | gloo 2 ranks (torchrun), fake 8 ranks    | fp32, bf16-mixed            |
| 1 GPU        | fake 2 ranks, fake 8 ranks (on the GPU)  | bf16-mixed (or fp16), fp32  |
| n >= 2 GPUs  | NCCL n ranks, fake max(8, 2n) ranks      | bf16-mixed (or fp16), fp32  |

Shapes (tiny on CPU, 4x wider on GPU): a Llama-style GQA + SwiGLU + RMSNorm + RoPE decoder, a GPT-2-style
MHA + GELU + LayerNorm + learned positions + tied embeddings + biases, and a Qwen2-style GQA with q/k/v
biases, tied embeddings and a width that is not a power of two (uneven FSDP shards).

Timing, measured (2-core CPU, torch 2.13, probe = 2 warm-up + 3 measured + 3 timed steps): a gloo 2-rank
probe 9.0 s median (11.4 s max; ~4 s of it is torchrun and imports), a 1-process `single` probe 7.6 s, a
fake-pg 8-rank probe 4.3 s (two at a time). The standard CPU matrix (54 probes) took 4 min 55 s end to
end; the full product (204 probes) would take about 18 minutes, hence the rotation.

Known limitations: `hsdp` uses gpus_per_node = world // 2 (two replicas) from 4 ranks on; at world 2 it is
one shard group of 2 (a 1 x 2 mesh: the replica all-reduce runs in a group of one).
"""

from __future__ import annotations

from dataclasses import asdict, is_dataclass

from distplan.planner.strategies import NAMES, get_strategy

HF_TP_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""transformers model types the tensor-parallel probe splits: separate q/k/v and gate/up projections
(Phi-3's fused qkv_proj and GPT-2's Conv1D c_attn would put q, k and v on different ranks under a
column split), pre-norms only (Gemma-2's sandwich norms are not in torchtitan's plan)."""

HF_PP_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
"""transformers model types the pipeline probe splits: `model.embed_tokens`, `model.layers`, `model.rotary_emb`,
`model.norm`, `lm_head`, decoder layers called with the rotary tables and no mask."""

CHECKPOINTING = ("none", "full")

SHAPES_CPU: dict[str, dict] = {
    "llama-tiny": dict(layers=2, hidden=128, heads=4, kv_heads=2, ffn_hidden=352, vocab=512,
                       max_positions=128, mlp="swiglu", norm="rmsnorm", position="rope",
                       tie_embeddings=False, linear_bias=False, qkv_bias=False,
                       source="distplan matrix: Llama-style (GQA, SwiGLU, RMSNorm, RoPE), tiny"),
    "gpt2-tiny": dict(layers=2, hidden=128, heads=4, kv_heads=4, ffn_hidden=512, vocab=512,
                      max_positions=128, mlp="gelu", norm="layernorm", position="learned",
                      tie_embeddings=True, linear_bias=True, qkv_bias=False,
                      source="distplan matrix: GPT-2-style (MHA, GELU, LayerNorm, learned positions, "
                             "tied embeddings, biases), tiny"),
    "qwen-tiny": dict(layers=2, hidden=96, heads=6, kv_heads=2, ffn_hidden=264, vocab=384,
                      max_positions=128, mlp="swiglu", norm="rmsnorm", position="rope",
                      tie_embeddings=True, linear_bias=False, qkv_bias=True,
                      source="distplan matrix: Qwen2-style (GQA, q/k/v bias, tied embeddings), tiny"),
}
TRAIN_CPU = dict(seq_len=64, micro_batch=2, grad_accum=1)
TRAIN_GPU = dict(seq_len=256, micro_batch=2, grad_accum=1)


def shapes_for(device: str) -> dict[str, dict]:
    """The matrix's model shapes; on GPU 4x wider, 2x deeper and 8x the vocabulary."""
    if device != "gpu":
        return {k: dict(v) for k, v in SHAPES_CPU.items()}
    out = {}
    for name, s in SHAPES_CPU.items():
        g = dict(s, layers=4, hidden=4 * s["hidden"], ffn_hidden=4 * s["ffn_hidden"], vocab=8 * s["vocab"],
                 max_positions=256)
        out[name.replace("-tiny", "-small")] = g
    return out


def model_dict(model) -> dict:
    """A ModelSpec (or a dict of its fields) as the spec's "model" object."""
    if is_dataclass(model):
        return asdict(model)
    return dict(model)


def spec_id(strategy: str, model_name: str, world_size: int, mode: str, checkpointing: str,
            precision: str, tp: int = 1, sequence_parallel: bool = False, cp: int = 1) -> str:
    w = f"w{world_size}" + ("-fake" if mode == "fake" else "")
    t = (f"/cp{cp}" if cp > 1 else "") + (f"/tp{tp}" + ("-sp" if sequence_parallel else "") if tp > 1 else "")
    return f"{strategy}/{model_name}/{w}{t}/{checkpointing}/{precision}"


def _known(name: str):
    """The registry's Strategy of `name`, or None for a name it does not spell (the probe refuses that one)."""
    return get_strategy(name) if name in NAMES else None


def default_gpus_per_node(strategy: str, world_size: int, mode: str) -> int:
    # hsdp needs >= 2 ranks per shard group: with one, PyTorch's HYBRID_SHARD falls back to NO_SHARD and
    # all-reduces inside a group of one (nothing crosses replicas). Two replicas where there are 4+ ranks.
    st = _known(strategy)
    hybrid = st is not None and st.hybrid
    if hybrid and world_size >= 4:
        return max(2, world_size // 2)
    if hybrid:
        return max(1, world_size)
    return max(1, min(world_size, 8)) if mode == "fake" else max(1, world_size)


def optimizer_suffix(optimizer: str, optimizer_impl: str) -> str:
    """The probe id's part naming the optimizer, empty for the default (AdamW, foreach): probes that differ
    only there must not share an id (`--resume` skips an id already recorded; summaries keep one record per
    id)."""
    if (optimizer, optimizer_impl) == ("adamw", "foreach"):
        return ""
    return f"/{optimizer}" + ("" if optimizer_impl == "foreach" else f"-{optimizer_impl}")


def make_spec(strategy: str, model, world_size: int, mode: str, *, gpus_per_node: int | None = None,
              seq_len: int = 64, micro_batch: int = 2, grad_accum: int = 1, grad_sync: str = "last",
              precision: str = "fp32",
              optimizer: str = "adamw", optimizer_impl: str = "foreach", checkpointing: str = "none",
              attention: str = "sdpa", steps: int = 3, seed: int = 0, model_name: str | None = None,
              tp: int = 1, sequence_parallel: bool = False, cp: int = 1) -> dict:
    """One probe spec, in the JSON shape `distplan.validate.probe --spec` reads. With `tp` > 1 the world
    is a (world_size / tp, tp) mesh (`single`: tp ranks, one data-parallel rank); with `cp` > 1 a
    (world_size / (cp * tp), cp, tp) mesh, the strategy over the dp x cp ranks."""
    m = model_dict(model)
    if model_name:
        m["name"] = model_name
    st = _known(strategy)
    if st is not None and not st.distributed:
        world_size = tp
    tp_keys = {"tp": int(tp), "sequence_parallel": bool(sequence_parallel)} if tp > 1 else {}
    if cp > 1:
        tp_keys["cp"] = int(cp)
    return {
        **tp_keys,
        "id": spec_id(strategy, m["name"], world_size, mode, checkpointing, precision, tp, sequence_parallel, cp)
        + (f"/accum{grad_accum}-{grad_sync}" if grad_accum > 1 else "") + optimizer_suffix(optimizer, optimizer_impl)
        + ("" if attention == "sdpa" else f"/{attention}"),
        "strategy": strategy, "world_size": int(world_size),
        "gpus_per_node": int(gpus_per_node or default_gpus_per_node(strategy, world_size, mode)),
        "mode": mode, "model": m,
        "train": {"seq_len": seq_len, "micro_batch": micro_batch, "grad_accum": grad_accum, "grad_sync": grad_sync,
                  "precision": precision, "optimizer": optimizer, "optimizer_impl": optimizer_impl,
                  "checkpointing": checkpointing, "attention": attention},
        "steps": int(steps), "seed": int(seed),
    }


def matrix_worlds(hw: dict, fake_world: int | None = None) -> list[tuple[str, int]]:
    """[(mode, world_size), ...] the matrix runs on this machine (see the module table)."""
    gpus = int(hw.get("gpus") or 0)
    if gpus >= 2:
        return [("gpu", gpus), ("fake", fake_world or max(8, 2 * gpus))]
    if gpus == 1:
        return [("fake", 2), ("fake", fake_world or 8)]
    return [("cpu", 2), ("fake", fake_world or 8)]


def matrix_precisions(hw: dict) -> tuple[str, str]:
    if int(hw.get("gpus") or 0):
        return ("bf16-mixed" if hw.get("bf16", True) else "fp16-mixed", "fp32")
    return ("fp32", "bf16-mixed")


def standard_matrix(hw: dict, strategies=None, fake_world: int | None = None, full: bool = False,
                    steps: int = 3, seed: int = 0) -> list[dict]:
    """The standard matrix for this machine (`hw` from `runner.detect_hardware()`), optionally only
    some strategies. Real-rank probes first, then fake-pg probes (which can run two at a time)."""

    names = list(NAMES) if not strategies else [get_strategy(s).name for s in strategies]
    device = "gpu" if int(hw.get("gpus") or 0) else "cpu"
    shapes = shapes_for(device)
    train = TRAIN_GPU if device == "gpu" else TRAIN_CPU
    p0, p1 = matrix_precisions(hw)
    combos = [("none", p0), ("full", p1), ("none", p1), ("full", p0)]
    worlds = matrix_worlds(hw, fake_world)
    specs = []

    def add(strategy, shape_name, mode, world, ckpt, prec):
        specs.append(make_spec(strategy, dict(shapes[shape_name], name=shape_name), world, mode,
                               precision=prec, checkpointing=ckpt, steps=steps, seed=seed, **train))

    if any(not get_strategy(n).distributed for n in names):
        single_mode = "gpu" if device == "gpu" else "cpu"
        for mi, shape_name in enumerate(shapes):
            picks = combos if full else [combos[mi % 4], combos[(mi + 2) % 4]]
            for ckpt, prec in picks:
                add("single", shape_name, single_mode, 1, ckpt, prec)
    multi = [n for n in names if get_strategy(n).distributed]
    for wi, (mode, world) in enumerate(worlds):
        for si, strategy in enumerate(multi):
            for mi, shape_name in enumerate(shapes):
                picks = combos if full else [combos[(si + mi + 3 * wi) % 4]]
                for ckpt, prec in picks:
                    add(strategy, shape_name, mode, world, ckpt, prec)
    return (specs + tp_matrix(hw, names, fake_world, steps, seed) + cp_matrix(hw, names, fake_world, steps, seed)
            + pp_matrix(hw, names, seed))


TP_LAYERS = 8
"""Depth of the tensor-parallel probes' Llama-style model (issue 13: 8+ layers)."""


def tp_matrix(hw: dict, strategies=None, fake_world: int | None = None, steps: int = 3, seed: int = 0) -> list[dict]:
    """Tensor-parallel probes (tp = 2, torchtitan's Llama plan): the Llama-style shape at `TP_LAYERS` layers.
    `single` (dp = 1) on real ranks (gloo 2 processes on CPU, 2 GPUs with NCCL, else the fake group of 2)
    with and without sequence parallelism in both precisions; FSDP2 (zero3 with SP, zero2 without) on the
    dp dimension of the fake process group's (world / 2, 2) mesh. Only the strategies in `strategies`."""

    names = list(NAMES) if not strategies else [get_strategy(s).name for s in strategies]
    device = "gpu" if int(hw.get("gpus") or 0) else "cpu"
    shape_name = next(n for n in shapes_for(device) if n.startswith("llama"))
    model = dict(shapes_for(device)[shape_name], layers=TP_LAYERS, name=f"{shape_name}-{TP_LAYERS}l")
    train = TRAIN_GPU if device == "gpu" else TRAIN_CPU
    p0, p1 = matrix_precisions(hw)
    gpus = int(hw.get("gpus") or 0)
    real = ("gpu" if gpus >= 2 else "fake" if gpus == 1 else "cpu")
    fake = [w for m, w in matrix_worlds(hw, fake_world) if m == "fake"][-1]
    picks = [("single", real, 2, False, p0), ("single", real, 2, True, p1),
             ("zero3", "fake", fake, True, p0), ("zero2", "fake", fake, False, p1)]
    return [make_spec(st, model, world, mode, precision=prec, steps=steps, seed=seed, tp=2,
                      sequence_parallel=sp, **train)
            for st, mode, world, sp, prec in picks if st in names and world % 2 == 0]


def cp_matrix(hw: dict, strategies=None, fake_world: int | None = None, steps: int = 3, seed: int = 0) -> list[dict]:
    """Context-parallel probes (ring attention, validate/cp.py; CPU only: the GPU probe is not wired): the
    Llama-style shape at `TP_LAYERS` layers, sequences of 64 tokens. zero3, and ddp with full checkpointing,
    with cp = 2 on gloo's 2 real ranks; on the fake process group's ranks zero2 with cp = 4 (dp 2), zero3
    with cp = 8 and full checkpointing, and zero3 with cp = 2 x tp = 2 (sequence parallel). Only the
    strategies in `strategies`."""

    if int(hw.get("gpus") or 0):
        return []
    names = list(NAMES) if not strategies else [get_strategy(s).name for s in strategies]
    shape_name = next(n for n in shapes_for("cpu") if n.startswith("llama"))
    model = dict(shapes_for("cpu")[shape_name], layers=TP_LAYERS, name=f"{shape_name}-{TP_LAYERS}l")
    p0, p1 = matrix_precisions(hw)
    fake = [w for m, w in matrix_worlds(hw, fake_world) if m == "fake"][-1]
    picks = [("zero3", "cpu", 2, 2, 1, "none", p0), ("ddp", "cpu", 2, 2, 1, "full", p1),
             ("zero2", "fake", fake, 4, 1, "none", p1), ("zero3", "fake", fake, 8, 1, "full", p0),
             ("zero3", "fake", fake, 2, 2, "none", p1)]
    return [make_spec(st, model, world, mode, precision=prec, checkpointing=ck, steps=steps, seed=seed,
                      cp=cp, tp=tp, sequence_parallel=tp > 1, **dict(TRAIN_CPU, seq_len=64))
            for st, mode, world, cp, tp, ck, prec in picks if st in names and world % (cp * tp) == 0]


def pp_spec(strategy: str, model, pp: int, schedule: str, microbatches: int, *, dp: int = 1, cp: int = 1,
            checkpointing: str = "none", seq_len: int = 80, micro_batch: int = 2, seed: int = 0) -> dict:
    """A pipeline probe spec (validate/pp_probe.py: fp32 on gloo, pp x dp x cp processes, `strategy` single
    (dp x cp = 1), or ddp, zero2 or zero3 on each stage's dp x cp ranks; cp > 1: ring attention over each
    stage's cp ranks).
    80-token sequences: the tokens per micro-batch (160) differ from the small shapes' widths, so no two
    components can be mistaken for each other."""
    m = model_dict(model)
    world = pp * dp * cp
    mesh = f"pp{pp}" + (f"-cp{cp}" if cp > 1 else "")
    return {"id": f"{strategy}/{m['name']}/w{world}/{mesh}-{schedule}-m{microbatches}/{checkpointing}/fp32",
            "strategy": strategy, "world_size": world, "gpus_per_node": world, "mode": "cpu", "model": m,
            "train": {"seq_len": seq_len, "micro_batch": micro_batch, "checkpointing": checkpointing,
                      "precision": "fp32", "optimizer": "adamw", "optimizer_impl": "foreach", "attention": "sdpa"},
            "pp": pp, "dp": dp, "cp": cp, "schedule": schedule, "microbatches": microbatches,
            "steps": 1, "warmup_steps": 2 if dp * cp > 1 else 1, "seed": seed}


def pp_matrix(hw: dict, strategies=None, seed: int = 0) -> list[dict]:
    """Pipeline-parallel probes (`torch.distributed.pipelining`, CPU only: validate/pp_probe.py runs gloo):
    the Llama-style shape at `TP_LAYERS` layers in 2 stages, 4 micro-batches: 1F1B and GPipe with full
    checkpointing alone (`single`), 1F1B with DDP and with FSDP2 (zero3, torchtitan's PP setting:
    reshard_after_forward off) over a dp of 2 on each stage (4 processes), and 1F1B with full
    checkpointing and context parallelism over 2 ranks per stage (ring attention; DDP over the cp ranks;
    4 processes)."""

    if int(hw.get("gpus") or 0):
        return []
    names = list(NAMES) if not strategies else [get_strategy(s).name for s in strategies]
    shape_name = next(n for n in shapes_for("cpu") if n.startswith("llama"))
    model = dict(shapes_for("cpu")[shape_name], layers=TP_LAYERS, name=f"{shape_name}-{TP_LAYERS}l")
    picks = [("single", "1f1b", 1, 1, "none"), ("single", "gpipe", 1, 1, "full"), ("ddp", "1f1b", 2, 1, "none"),
             ("zero3", "1f1b", 2, 1, "none"), ("ddp", "1f1b", 1, 2, "full")]
    return [pp_spec(st, model, 2, sched, 4, dp=dp, cp=cp, checkpointing=ck, seed=seed)
            for st, sched, dp, cp, ck in picks if st in names]
