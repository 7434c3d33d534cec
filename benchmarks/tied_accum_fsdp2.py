"""The torch 2.15 mechanism behind config.fsdp2_first_microstep_grads_in_reduce_dtype, on a 3-module model
(embedding, Linear, head; tied with `tied`) under FSDP2 with bf16 mixed precision, rank 0 of 8 on the fake
process group, 2 optimizer steps of 2 micro-steps without sync: prints the ops the second step's backwards run
on embedding-sized tensors. On torch 2.15 the first micro-step casts the head's and the embedding's gradients
to fp32 (`_to_copy`) and sums them in fp32 (`add`): FSDP2 left the unsharded parameter's `grad_dtype` at fp32
after the previous reduce. On 2.13 (and in a step's later micro-steps) the sum is bf16, added into the kept
fp32 gradient in place.

    python benchmarks/tied_accum_fsdp2.py tied      (or: untied)
"""
import torch, torch.nn as nn, torch.distributed as dist, sys
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
from torch.utils._python_dispatch import TorchDispatchMode
tied = sys.argv[1] == "tied"
V, H = 512, 64
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.emb = nn.Embedding(V, H); s.lin = nn.Linear(H, H); s.head = nn.Linear(H, V, bias=False)
        if tied: s.head.weight = s.emb.weight
    def forward(s, x): return s.head(s.lin(s.emb(x))).float().sum()
m = M()
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
fully_shard(m.lin, mp_policy=mp); fully_shard(m, mp_policy=mp)
x = torch.randint(0, V, (4, 16))
class Log(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.numel() >= V*H:
            print("  ", func, out.dtype, tuple(out.shape))
        return out
opt = torch.optim.AdamW(m.parameters())
for step in range(2):
    for mb in range(2):
        m.set_requires_gradient_sync(mb == 1)
        loss = m(x)
        if step == 1:
            print(torch.__version__, "tied" if tied else "untied", "step", step, "micro-step", mb)
            with Log():
                loss.backward()
        else:
            loss.backward()
    opt.step(); opt.zero_grad(set_to_none=True)
