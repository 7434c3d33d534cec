"""Wrap the reference decoder for one registry strategy, with its optimizer and precision recipe.

One function per entry of `distplan.planner.strategies.REGISTRY`, each the PyTorch-native
implementation the registry names, with PyTorch's defaults unless the brief of that strategy says
otherwise (DDP: 25 MiB buckets, `gradient_as_bucket_view=False`; FSDP1: `ModuleWrapPolicy({Block})`,
`use_orig_params=False`; FSDP2: `fully_shard` per block, then the root).

Precision: fp32 (all fp32); bf16-mixed / fp16-mixed (fp32 params; autocast for single/ddp/zero1,
`MixedPrecision(param, reduce=fp32, buffer)` for FSDP1, `MixedPrecisionPolicy(param, reduce=fp32)`
for FSDP2; a GradScaler for fp16 on GPU); bf16 (the model cast to bf16, no autocast).

CPU offload (`train["cpu_offload"] == "params"`): FSDP2 `CPUOffloadPolicy()`, FSDP1
`CPUOffload(offload_params=True)`; the other strategies have none and run without it.

Known limitations: `adamw-8bit` (bitsandbytes) is not run; `fused` needs an optimizer that has a fused
kernel for the device (under offload the optimizer runs on the CPU).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from distplan.planner.strategies import FSDP1, get_strategy
from distplan.planner.tp import TP_STRATEGIES

from .measure import storage_key

_LOW = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


@dataclass
class WrapContext:
    """What the training loop needs besides the model and optimizer."""

    family: str
    device: torch.device
    autocast_dtype: torch.dtype | None = None
    """Run forward + loss under torch.autocast with this dtype (single/ddp/zero1, mixed precision)."""
    scaler: object = None
    """GradScaler (fp16-mixed on GPU) or None."""
    sync: Callable[[bool], contextlib.AbstractContextManager] = lambda last: contextlib.nullcontext()
    """sync(last_micro_step): gradient-sync context for one micro-step (no_sync when not last)."""
    params: list = field(default_factory=list)
    """The wrapped model's parameters as registered after wrapping (flat params, DTensors)."""
    optimizer_state_owner: object = None
    """The optimizer whose .state holds this rank's states (ZeRO: the local inner optimizer)."""
    fsdp2_params: list = field(default_factory=list)
    """FSDP2's FSDPParam objects: their unsharded gradients (before reduce-scatter, or accumulated
    without gradient sync) count as grads, as DDP's and FSDP1's unsharded .grad do."""

    loss_parallel: bool = False
    """Tensor parallelism: forward, loss and backward run under `loss_parallel()` (logits sharded over
    the vocabulary), as torchtitan's train context does."""

    def loss_context(self):
        if not self.loss_parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel
        return loss_parallel()

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def roles(self) -> dict:
        """Tracker storage key -> 'params' | 'grads' | 'optimizer' for the current state."""
        roles: dict = {}

        def put(t, role):
            if isinstance(t, torch.Tensor):
                t = getattr(t, "_local_tensor", t)  # DTensor -> this rank's shard
                k = storage_key(t)
                if k is not None:
                    roles.setdefault(k, role)

        for p in self.params:
            shard = getattr(p, "_local_shard", None)  # FSDP1 FlatParameter: the sharded flat param
            put(shard if shard is not None else p, "params")
        for p in self.params:
            put(p.grad, "grads")
            put(getattr(p, "_saved_grad_shard", None), "grads")
        for fp in self.fsdp2_params:
            put(getattr(fp, "unsharded_accumulated_grad", None), "grads")
            unsharded = getattr(fp, "_unsharded_param", None)
            if unsharded is not None:
                put(unsharded.grad, "grads")
        owner = self.optimizer_state_owner
        if owner is not None:
            for state in list(owner.state.values()):
                for v in state.values():
                    put(v, "optimizer")
        return roles


def make_optimizer(params, train: dict, zero: bool = False, group=None):
    """torch.optim optimizer from train['optimizer'] and train['optimizer_impl'] (explicit foreach); `zero`:
    wrapped in ZeroRedundancyOptimizer over `group` (default: the world)."""
    name, impl = train.get("optimizer", "adamw"), train.get("optimizer_impl", "foreach")
    table = {
        "adamw": (torch.optim.AdamW, {}), "adam": (torch.optim.Adam, {}), "sgd": (torch.optim.SGD, {}),
        "sgd-momentum": (torch.optim.SGD, {"momentum": 0.9}),
        "adafactor": (getattr(torch.optim, "Adafactor", None), {}),
    }
    if name not in table or table[name][0] is None:
        raise ValueError(f"optimizer={name!r} is not run by the probes; accepted: {', '.join(table)}")
    cls, kw = table[name]
    impls = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}
    if impl not in impls:
        raise ValueError(f"optimizer_impl={impl!r}: accepted values are {', '.join(impls)}")
    if impl == "fused" and name == "adafactor":
        raise ValueError("optimizer_impl='fused': torch.optim.Adafactor has no fused kernel; use foreach")
    kw = {"lr": 1e-4, **kw, **impls[impl]}
    params = _by_mesh(list(params))
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=group, **kw)
    return cls(params, **kw)


def _by_mesh(params: list):
    """`params`, or one param group per device mesh where they mix plain tensors and DTensors or DTensors
    of several meshes (tensor parallelism without sequence parallelism leaves the norms plain tensors):
    torch.optim's foreach and fused kernels take one group's tensors at once, and DTensor rejects mixed
    operands (`_foreach_mul_` "got mixed torch.Tensor and DTensor"); the optimizer steps group by group
    (`Optimizer.step` loops over `param_groups`)."""
    groups: dict = {}
    for p in params:
        mesh = getattr(p, "device_mesh", None)
        groups.setdefault(None if mesh is None else id(mesh), []).append(p)
    if len(groups) <= 1:
        return params
    return [{"params": g} for g in groups.values()]


def _block_class(model):
    return type(model.layers[0])


def _no_sync(model):
    return lambda last: contextlib.nullcontext() if last else model.no_sync()


def _single(model, train, world_size, gpus_per_node, device):
    ctx = WrapContext("single", device, autocast_dtype=_LOW.get(train["precision"]))
    return model, ctx


def _ddp(model, train, world_size, gpus_per_node, device):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device.index] if device.type == "cuda" else None
    # PyTorch's defaults: bucket_cap_mb=None gives a 1 MiB first bucket, then 25 MiB buckets (passing
    # 25 explicitly would make the first bucket 25 MiB too); gradient_as_bucket_view=False.
    ddp = DDP(model, device_ids=ids)
    if train.get("_fake"):
        ddp.register_comm_hook(None, _fake_allreduce_hook)
    return ddp, WrapContext("ddp", device, autocast_dtype=_LOW.get(train["precision"]), sync=_no_sync(ddp))


def _fake_allreduce_hook(state, bucket):
    """DDP's default all-reduce hook (divide, all-reduce the bucket in place) for the fake process group,
    whose Work's future completes with None, which the C++ reducer rejects."""
    import torch.distributed as dist

    buf = bucket.buffer()
    buf.div_(dist.get_world_size())
    dist.all_reduce(buf)
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


def _zero1(model, train, world_size, gpus_per_node, device):
    ddp, ctx = _ddp(model, train, world_size, gpus_per_node, device)
    ctx.family = "zero1"
    return ddp, ctx


def _fsdp2(reshard: bool):
    def wrap(model, train, world_size, gpus_per_node, device):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = train.get("_dp_mesh") or init_device_mesh(device.type, (world_size,))
        kw = {"mesh": mesh, "reshard_after_forward": reshard}
        low = _LOW.get(train["precision"])
        if low is not None:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
        if train.get("cpu_offload") == "params":
            from torch.distributed.fsdp import CPUOffloadPolicy
            kw["offload_policy"] = CPUOffloadPolicy()  # pinned host memory (its default)
        for block in (train["_units"] if train.get("_units") is not None else model.layers):
            fully_shard(block, **kw)
        # The root: for zero3 FSDP2's default (reshard_after_forward=None: the root is not resharded after
        # forward, its parameters are used at once by backward); for zero2 explicitly False.
        root_kw = dict(kw)
        if reshard:
            root_kw.pop("reshard_after_forward")
        fully_shard(model, **root_kw)
        if train.get("_meta"):  # each FSDPParam's shard made on the device (FSDPModule._apply)
            materialize(model, device)
        ctx = WrapContext("fsdp2", device, sync=lambda last: _fsdp2_sync(model, last))
        for m in model.modules():
            group = m._get_fsdp_state()._fsdp_param_group if hasattr(m, "_get_fsdp_state") else None
            if group is not None:
                ctx.fsdp2_params.extend(group.fsdp_params)
        return model, ctx
    return wrap


def _fsdp2_sync(model, last: bool):
    model.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


def _fsdp1(strategy: str):
    def wrap(model, train, world_size, gpus_per_node, device):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        kw = {}
        if strategy == "HYBRID_SHARD":
            from torch.distributed.device_mesh import init_device_mesh

            if world_size % gpus_per_node:
                raise ValueError(f"hsdp: world_size={world_size} is not a multiple of "
                                 f"gpus_per_node={gpus_per_node}")
            replicate, shard = max(1, world_size // gpus_per_node), min(world_size, gpus_per_node)
            kw["device_mesh"] = init_device_mesh(device.type, (replicate, shard),
                                                 mesh_dim_names=("replicate", "shard"))
        low = _LOW.get(train["precision"])
        if low is not None:
            kw["mixed_precision"] = MixedPrecision(param_dtype=low, reduce_dtype=torch.float32,
                                                   buffer_dtype=low)
        kw["device_id"] = device  # explicit, so that FSDP1 accepts CPU (gloo) as the compute device
        if train.get("cpu_offload") == "params":
            from torch.distributed.fsdp import CPUOffload
            kw["cpu_offload"] = CPUOffload(offload_params=True)
        if train.get("_units") is not None:  # an arbitrary module: wrap exactly its units
            chosen = set(map(id, train["_units"]))
            policy = lambda module, recurse, nonwrapped_numel: recurse or id(module) in chosen  # noqa: E731
        else:
            policy = ModuleWrapPolicy({_block_class(model)})
        if train.get("_meta"):
            # FSDP1 calls it on each module of a unit, the unit's own first (BFS, _init_utils.py
            # `_materialize_with_param_init_fn`), just before it flattens the unit; its default,
            # `_materialize_meta_module`, calls `reset_parameters`, which transformers' norms lack
            kw["param_init_fn"] = unit_materializer(device)
        fsdp = FSDP(model, sharding_strategy=getattr(ShardingStrategy, strategy),
                    auto_wrap_policy=policy, use_orig_params=False, **kw)
        return fsdp, WrapContext("fsdp1", device, sync=_no_sync(fsdp))
    return wrap


def materialize(module, device, recurse: bool = True) -> None:
    """A module built on the meta device, made on `device` (`Module.to_empty`: each parameter and buffer
    allocated anew, children first; for FSDP2 this rank's shards only) and filled in place, as torchtitan's
    `model.to_empty(device=...)` then `init_weights()` does: no tensor beyond the parameters' own storage.
    The values are N(0, 0.02) for every floating tensor, buffers included (rotary frequencies): a memory probe
    needs finite numbers, not the model's initialization."""
    mods = list(module.modules()) if recurse else [module]
    # a plain attribute that is one of its module's buffers (transformers' rotary embeddings keep
    # `original_inv_freq = inv_freq` for their dynamic RoPE update) follows the buffer to the device
    aliases = [(m, a, b) for m in mods for a, t in vars(m).items() if isinstance(t, torch.Tensor)
               for b, buf in m._buffers.items() if buf is t]
    module.to_empty(device=device, recurse=recurse)
    for m, a, b in aliases:
        setattr(m, a, m._buffers[b])
    with torch.no_grad():
        for t in [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]:
            local = getattr(t, "_local_tensor", t)  # FSDP2: the DTensor's shard
            if local.is_floating_point():
                local.normal_(0.0, 0.02)


def unit_materializer(device):
    """FSDP1's `param_init_fn`: one module's own parameters and buffers made on `device` (`materialize`,
    recurse=False), a parameter two modules share (tied embeddings: the LM head's weight is the embedding's)
    made once and set on both, as the tie stands before wrapping. `Module.to_empty` per module would make
    the second module its own copy (a new Parameter per module), an untied model one embedding larger."""
    import weakref
    # id(meta parameter) -> (it, a weak reference to the parameter made for it): the meta one kept, so its id
    # stays; the made one not, so that FSDP1 frees it once it has flattened the unit (tied modules share a unit)
    made: dict = {}

    def init(module) -> None:
        shared = {}
        for name, p in module.named_parameters(recurse=False):
            if id(p) in made and made[id(p)][1]() is not None:
                shared[name] = made[id(p)][1]()
        for name, p in shared.items():
            del module._parameters[name]  # not made again by to_empty
        metas = dict(module.named_parameters(recurse=False))
        materialize(module, device, recurse=False)
        for name, p in module.named_parameters(recurse=False):
            made[id(metas[name])] = (metas[name], weakref.ref(p))
        for name, p in shared.items():
            module._parameters[name] = p
    return init


WRAPPERS = {
    "single": _single,
    "ddp": _ddp,
    "zero1": _zero1,
    "zero2": _fsdp2(reshard=False),
    "zero3": _fsdp2(reshard=True),
    "fsdp": _fsdp1("FULL_SHARD"),
    "fsdp-grad-op": _fsdp1("SHARD_GRAD_OP"),
    "hsdp": _fsdp1("HYBRID_SHARD"),
    "fsdp-no-shard": _fsdp1("NO_SHARD"),
}


def wrap(model, strategy_name: str, train: dict, world_size: int, gpus_per_node: int, device, *,
         fake: bool = False, units: list | None = None, dp_mesh=None, meta: bool = False):
    """(wrapped_model, optimizer, ctx) for one registry strategy; the model must already be on `device`.

    fake=True: the process group is the fake one (DDP gets an equivalent Python all-reduce hook; no
    GradScaler, since gradients are garbage). `units`: the submodules FSDP wraps (default: the
    reference decoder's blocks). `dp_mesh`: tensor parallelism (the model already split over the tp
    dimension): the dp dimension of the (dp, tp) mesh, `world_size` its size. `meta`: the model is on the
    meta device (FSDP only): wrapped there, then each rank's parameters made on `device` (`materialize`).
    """

    strategy = get_strategy(strategy_name)
    if strategy.name not in WRAPPERS:
        raise ValueError(f"strategy {strategy.name!r} has no probe wrapper; accepted: {', '.join(WRAPPERS)}")
    device = torch.device(device)
    precision = train.get("precision", "fp32")
    if precision not in ("fp32", "bf16-mixed", "fp16-mixed", "bf16"):
        raise ValueError(f"precision={precision!r}: accepted values are fp32, bf16-mixed, fp16-mixed, bf16")
    if meta and not strategy.fsdp:
        raise ValueError(f"strategy {strategy.name!r} on the meta device: only FSDP materializes a meta model")
    if meta and train.get("cpu_offload") not in (None, "none"):
        raise ValueError("a model on the meta device with CPU offload: the probes materialize it on the device")
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    if not strategy.distributed and world_size != 1:
        raise ValueError(f"strategy 'single' runs on one rank, not world_size={world_size}")
    if dp_mesh is not None and strategy.name not in TP_STRATEGIES:
        raise ValueError(f"strategy {strategy.name!r} with tensor parallelism: the probes compose tp with "
                         f"{', '.join(TP_STRATEGIES)} (FSDP2 on the dp mesh dimension, torchtitan's layout)")
    wrapped, ctx = WRAPPERS[strategy.name](model, {**train, "precision": precision, "_fake": fake, "_units": units,
                                                   "_dp_mesh": dp_mesh, "_meta": meta},
                                           world_size, gpus_per_node, device)
    ctx.loss_parallel = bool(getattr(model, "loss_parallel", False))
    ctx.params = list(wrapped.parameters())
    optimizer = make_optimizer(ctx.params, train, zero=strategy.zero_optimizer)
    ctx.optimizer_state_owner = getattr(optimizer, "optim", optimizer)
    if precision == "fp16-mixed" and device.type == "cuda" and not fake:
        if ctx.family == FSDP1:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            ctx.scaler = ShardedGradScaler()
        else:
            ctx.scaler = torch.amp.GradScaler("cuda")
    return wrapped, optimizer, ctx
