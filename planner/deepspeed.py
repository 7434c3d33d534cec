"""DeepSpeed ZeRO-1/2/3 memory (`--framework deepspeed`), from DeepSpeed's own estimators and defaults.

Not validated here (no DeepSpeed, no GPU in CI); the probes validate the PyTorch-native registry.
Terms, per rank, P parameters, N ranks, 16-bit training with fp32 master weights and Adam:
- ZeRO-1/2 (`deepspeed/runtime/zero/stage_1_and_2.py`, `estimate_zero2_model_states_mem_needs`):
  16-bit params 2P; ZeRO-2 "2P + 18P/N" = fp16 grads 2P/N + fp32 grads 4P/N + fp32 master 4P/N +
  Adam 8P/N. ZeRO-1 keeps full 16-bit gradients (2P) and partitions fp32 master + Adam + fp32 grad
  partition (16P/N).
- ZeRO-3 (`stage3.py`, `estimate_zero3_model_states_mem_needs`): "4·largest_layer + 18P/N".
- Buffers (`deepspeed/runtime/zero/config.py` defaults): `reduce_bucket_size` 5e8 elements,
  `allgather_bucket_size` 5e8 elements (stage 1/2), `stage3_prefetch_bucket_size` 5e7 elements, each
  16-bit and capped at the model size.
Activations are those of the 16-bit module (`lowp` regime in activations.py).
"""

from __future__ import annotations

from .activations import activations
from .config import Cluster, TrainConfig
from .footprint import device_footprint
from .estimate import COMPONENTS, MemoryEstimate
from .state_layout import layout
from .strategies import DDP, FSDP2, Strategy

REDUCE_BUCKET_ELEMS = 500_000_000
ALLGATHER_BUCKET_ELEMS = 500_000_000
PREFETCH_BUCKET_ELEMS = 50_000_000


def estimate_deepspeed(train: TrainConfig, cluster: Cluster, st: Strategy) -> MemoryEstimate:
    n = cluster.gpus
    m = train.model
    lay = layout(m, DDP, 1, False, False)
    p = lay.total
    act = activations(train, FSDP2, "cuda")  # a 16-bit module: the lowp regime
    tok = train.micro_batch * train.seq_len
    adam = 8 if train.optimizer in ("adam", "adamw") else (4 if train.optimizer == "sgd-momentum" else 0)
    comps = {k: 0 for k in COMPONENTS}
    if st.zero_stage == 1:
        comps.update(params=2 * p + 4 * p // n, grads=2 * p + 4 * p // n, optimizer=adam * p // n,
                     comm_buffers=2 * min(p, REDUCE_BUCKET_ELEMS) + 2 * min(p, ALLGATHER_BUCKET_ELEMS))
    elif st.zero_stage == 2:
        comps.update(params=2 * p + 4 * p // n, grads=6 * p // n, optimizer=adam * p // n,
                     comm_buffers=2 * min(p, REDUCE_BUCKET_ELEMS) + 2 * min(p, ALLGATHER_BUCKET_ELEMS))
    else:
        comps.update(params=6 * p // n, grads=6 * p // n, optimizer=adam * p // n,
                     comm_buffers=4 * lay.largest_param + 2 * min(p, PREFETCH_BUCKET_ELEMS))
    comps["activations"] = act.total
    comps["temporaries"] = 2 * tok * m.vocab * 4
    peak = sum(comps.values())
    fp = device_footprint(cluster, n, "world")  # DeepSpeed's ZeRO: one data-parallel group
    return MemoryEstimate(st.name, comps, peak, "backward", fp.total, cluster.gpu_memory_bytes,
                          ["DeepSpeed figures follow DeepSpeed's estimators; not validated by probes"], footprint=fp)
