"""Profile any `nn.Module` from a factory without allocating it: parameters, saved activations, FLOPs.

`profile_module("pkg.mod:factory", (128, 1, 28, 28), "float32")` imports `pkg.mod` (the working
directory is put on `sys.path` first, so `examples.mnist_cnn:make_model` works from the repository
root), calls `factory()` under `torch._subclasses.fake_tensor.FakeTensorMode` (no real allocation, no
weights touched), and runs one forward pass plus the loss on a fake input of that shape:

- parameters: every tensor of `named_parameters()` (shared weights once), with its shape, grouped by
  the top-level child that owns it. Those children are the wrapping units FSDP would get from an
  auto-wrap policy on the module's direct children; parameters owned by the root itself form `root`.
  Buffers (BatchNorm statistics) are counted apart, with their dtypes (DDP broadcasts them).
- activations: the bytes autograd saves for backward (`torch.autograd.graph.saved_tensors_hooks`),
  counted once per storage (views of one tensor share it), excluding the parameters', the buffers' and
  the input batch's own storages (the batch is `batch_bytes`, a temporary).
  Casts of parameters (autocast's weight cache, a 16-bit copy) are not parameters and are counted.
- loss: cross-entropy against class 0 when the output is 2-D (N, C) (a classifier), else the sum of
  all outputs. What the loss saves (log_softmax's output) is part of the activations; the output's
  bytes are returned apart (`output_bytes`) because the planner counts them as a temporary.
- FLOPs of the forward pass, from the census below: matmuls and convolutions by `torch.utils.flop_counter`'s
  formulas, a MoE's grouped GEMMs, fused attention (halved when causal).
- per segment, the kernels its forward and backward launch (`census`; `unit_census`: the unit's own
  forward), by FLOPs or bytes moved (`census._KernelCensus`): what the planner times a traced step by.
- per segment, what its forward and its backward hold at their peaks (`forward_bytes`;
  `backward_bytes`, `backward_grad_bytes`, `backward_saved_bytes`): the backward runs too, on the same
  fake tensors, and a dispatch mode follows every storage created (`segment_tracker._SegmentTracker`).
- per segment, its convolutions (`kernels`): the call's arguments and what is alive when it runs, for
  the cuDNN workspace measured on a GPU (`planner/workload/kernel_workspace.py`); `linear_bias`: an addmm ran.

`dtype`: "float32"; "bfloat16"/"float16" cast the module and the input (pure 16-bit training);
"autocast-bfloat16"/"autocast-float16" keep fp32 parameters and run the forward under CPU `torch.autocast`
(the DDP mixed-precision recipe); with `device="cuda"` CUDA's lists instead of the CPU's (CUDA runs pow,
softmax, log_softmax, ... in fp32: cuda_autocast.py) and CUDA's kernels where they keep other tensors
(trace_modes.py `_cuda_kernels`, cuda_fused.py). "fsdp-bfloat16"/"fsdp-float16": FSDP's mixed
precision: the parameters (and a module's buffers: FSDP1's `buffer_dtype`) cast, the batch made in fp32 and
cast to 16 bits at the root's forward, as FSDP1's `_root_pre_forward` (`cast_root_forward_inputs`) and
FSDP2's `_pre_forward` (`cast_forward_inputs`) do: the fp32 batch stays the caller's, the 16-bit copy is
what the first ops save. "fsdp1-bfloat16"/"fsdp1-float16": the same for FSDP1 with an auto-wrap policy
where the modules of `MixedPrecision._module_classes_to_ignore` (BatchNorm) keep fp32 parameters and
buffers, each its own FSDP unit (listed first in `units`, named in `fp32_units`), and run in fp32 between
casts of their input and output (`_common_utils._override_module_mixed_precision`, whose hooks the trace
registers).

Known limitations: one forward of one input tensor (models that take several inputs, dicts or integer
token ids need a small wrapper factory); data-dependent control flow sees fake values; the segment a
backward op belongs to is found by gradient hooks on the segments' inputs, so a segment whose input
needs no gradient (the first) takes the ops after the last hook.
"""

from __future__ import annotations

import contextlib
import time

from .census import CENSUS_FIELDS
from .isolated import run_isolated
from .layer_expansion import TRACE_LAYERS, _periodic_log, expand_layers, periodic_trace_layers
from .segment_tracker import _SegmentTracker
from .trace_modes import KERNEL_DEVICES, _cuda_kernels, _grouped_mm_any_dtype, _quiet_fake_tensor_log
from .traced_model import FactoryWorkload, HFWorkload, load_factory, parse_shape

_DTYPES = ("float32", "bfloat16", "float16", "autocast-bfloat16", "autocast-float16", "fsdp-bfloat16",
           "fsdp-float16", "fsdp1-bfloat16", "fsdp1-float16")

# What a user module's trace imports before user code runs, imported before the child's memory cap so the
# cap bounds user code alone: `FakeTensorMode.__init__` imports torch._dynamo.config and
# torch._functorch.config (torch/_subclasses/fake_tensor.py), and torch._dynamo's package pulls in
# torch._inductor: 73 MiB more address space with torch 2.13 (CPU build), 268 MiB with 2.15 (CUDA build).
TRACE_PRELOAD = ("torch", "torch._dynamo.config", "torch._functorch.config")


def _storage_key(t):
    try:
        return t.untyped_storage()._cdata
    except Exception:  # pragma: no cover - tensors without storage (sparse, nested)
        return id(t)


def _storage_nbytes(t) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:  # pragma: no cover
        return int(t.numel() * t.element_size())


def _fsdp1_full_precision_classes(torch) -> tuple:
    """`MixedPrecision._module_classes_to_ignore` of the installed torch (default `(_BatchNorm,)`)."""
    from torch.distributed.fsdp import MixedPrecision

    return tuple(MixedPrecision(param_dtype=torch.bfloat16)._module_classes_to_ignore)


def _fsdp1_full_precision_modules(torch, model) -> list:
    """(qualified name, module) of the modules FSDP1's mixed precision leaves in full precision, each its own
    unit: instances of `MixedPrecision._module_classes_to_ignore` (default `(_BatchNorm,)`) that own
    parameters, as `_auto_wrap` wraps them (`_wrap_utils.py`; the probes pass an auto-wrap policy)."""
    classes = _fsdp1_full_precision_classes(torch)
    return [(name, m) for name, m in model.named_modules()
            if name and isinstance(m, classes) and any(True for _ in m.parameters(recurse=False))]


def profile_module(factory_path: str, input_shape, dtype: str = "float32") -> dict:
    """`profile_workload` of `factory_path` (PKG.MOD:FACTORY) on one input of `input_shape`."""

    load_factory(factory_path)  # a bad path is a ValueError naming --module
    return profile_workload(FactoryWorkload(factory_path, parse_shape(input_shape)), dtype)


def profile_hf(hf_config: str, micro_batch: int, seq_len: int, dtype: str = "float32",
               layers: int | None = None, device: str = "cpu", attention: str = "sdpa",
               checkpoint_every: int = 0, vocab: int | None = None) -> dict:
    """`profile_workload` of a Hugging Face causal LM's config.json at micro_batch x seq_len tokens
    (`attention`: the attn_implementation, workload.HFWorkload; `checkpoint_every`: transformers' own
    checkpointing of every k-th layer, for the step's allocation log; `vocab`: its vocab_size replaced)."""

    work = HFWorkload(hf_config, micro_batch, seq_len, layers, attention, vocab)
    depth = work.depth()
    if depth <= TRACE_LAYERS:
        return profile_workload(work, dtype, device=device, checkpoint_every=checkpoint_every)
    if checkpoint_every >= 2:  # two kinds of layer: a deeper trace whose log repeats a period of them
        traced = periodic_trace_layers(depth, checkpoint_every)
        if traced >= depth:
            return profile_workload(work, dtype, device=device, checkpoint_every=checkpoint_every)
        shallow = HFWorkload(hf_config, micro_batch, seq_len, traced, attention, vocab)
        return _periodic_log(profile_workload(shallow, dtype, device=device, checkpoint_every=checkpoint_every),
                             depth, checkpoint_every, traced)
    shallow = HFWorkload(hf_config, micro_batch, seq_len, TRACE_LAYERS, attention, vocab)
    return expand_layers(profile_workload(shallow, dtype, device=device, checkpoint_every=checkpoint_every),
                         depth, work, checkpoint_every)


def profile(work, dtype: str = "float32", device: str = "cpu", checkpoint_every: int = 0) -> dict:
    """The profile of a workload: a Hugging Face model through `profile_hf` (traced at TRACE_LAYERS
    layers and expanded), anything else through `profile_workload`; keeping the bytes `device`'s kernels
    keep (KERNEL_DEVICES). `checkpoint_every`: a module's units checkpointed as the probes do
    (workload.FactoryWorkload.enable_checkpointing), for the step's allocation log; its names as without."""
    if work.kind == "hf":  # transformers' own code from a config.json: run here (no user code)
        return profile_hf(work.hf_config, work.micro_batch, work.seq_len, dtype, work.layers, device,
                          work.attention, checkpoint_every, work.vocab_size)
    # user code: in a child, bounded (isolated.run_isolated: --timeout, a memory cap, one-line verdicts)
    return run_isolated("--module", work.label, _module_profile, work, dtype, device, checkpoint_every,
                        preload=TRACE_PRELOAD)


def _module_profile(work, dtype: str, device: str, checkpoint_every: int) -> dict:
    prof = profile_workload(work, dtype, device=device, checkpoint_every=checkpoint_every)
    return _without_wrapper_names(prof) if checkpoint_every else prof


def _without_wrapper_names(prof: dict) -> dict:
    """A checkpointed trace's names as the module's own: `checkpoint_wrapper`'s
    `_checkpoint_wrapped_module.` taken out of its parameters', units' and log markers' names (what
    `ActivationWrapper.named_parameters` does for the wrapper's own)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    def bare(name):
        return name.replace(_CHECKPOINT_PREFIX, "") if isinstance(name, str) else name
    for u in prof["units"]:
        u["name"] = bare(u["name"])
        u["params"] = [[bare(n), s] for n, s in u["params"]]
    prof["fp32_units"] = [bare(n) for n in prof.get("fp32_units", ())]
    prof["construct_names"] = [bare(n) for n in prof.get("construct_names", ())]
    prof["construct_paths"] = [bare(n) for n in prof.get("construct_paths", ())]
    log = prof.get("alloc_log") or {}
    log["events"] = [[e[0], bare(e[1]), *e[2:]] if e[0] >= 3 else e for e in log.get("events", ())]
    log["grads"] = [[i, bare(n)] for i, n in log.get("grads", ())]
    return prof


def user_code_error(flag: str, label: str, what: str, exc: BaseException) -> ValueError:
    """The one-line error for user code (a factory, a module's forward) that raised or ended the
    process: `sys.exit()` there must not end distplan silently."""
    if isinstance(exc, SystemExit):
        return ValueError(f"{flag}={label!r}: {what} called sys.exit({exc.code!r})")
    text = str(exc).splitlines()[0] if str(exc) else ""
    return ValueError(f"{flag}={label!r}: {what} raised {type(exc).__name__}: {text}"[:400])


def check_factory(factory_path: str, input_shape, path: str | None = None) -> None:
    """Before any probe runs, what `distplan estimate --module` does: import the factory, build the
    model and run one forward and backward on fake tensors (no memory, no weights touched). ValueError
    (one line, naming --module) when the factory or the model raises or calls sys.exit(), returns no
    nn.Module, or has no parameters. Run in a child under `limits.user_code_limits` (`isolated.run_isolated`): a
    factory that hangs, ends the process or runs out of its memory cap is one line too."""

    run_isolated("--module", factory_path, _check_factory, factory_path, parse_shape(input_shape), path,
                 preload=TRACE_PRELOAD)


def _check_factory(factory_path: str, shape: tuple, path: str | None) -> None:
    load_factory(factory_path)
    profile_workload(FactoryWorkload(factory_path, shape, path), "float32")


def _check_model(torch, model, flag: str, label: str) -> None:
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"{flag}={label!r}: the factory returned {type(model).__name__}, not an nn.Module")
    if not any(True for _ in model.parameters()):
        raise ValueError(f"{flag}={label!r}: the model has no parameters: nothing to train, shard or "
                         f"synchronise")


def profile_workload(work, dtype: str = "float32", fake: bool = True, device: str = "cpu",
                     checkpoint_every: int = 0) -> dict:
    """`_profile_workload`, with user code that ends the process (`sys.exit`) or raises a
    BaseException turned into a one-line ValueError naming the flag (KeyboardInterrupt passes)."""
    try:
        return _profile_workload(work, dtype, fake, device, checkpoint_every)
    except (KeyboardInterrupt, Exception):
        raise
    except BaseException as exc:  # SystemExit, GeneratorExit, a user's BaseException subclass
        flag = "--hf-config" if work.kind == "hf" else "--module"
        raise user_code_error(flag, work.label, "the model", exc) from None


def _profile_workload(work, dtype: str = "float32", fake: bool = True, device: str = "cpu",
                      checkpoint_every: int = 0) -> dict:
    """Parameters (per wrapping unit), saved-activation bytes, output bytes and forward FLOPs of a
    workload (`planner.workload.traced_model`: a factory's module, or a Hugging Face causal LM).

    Returns a dict in base units: {"factory", "module_class", "input_shape", "dtype", "params": int,
    "param_bytes_dtype": int, "units": [{"name", "params": [[name, shape], ...], "numel"}],
    "tied": [numel of each parameter reached under more than one name], "buffers_bytes", "activation_bytes",
    "output_bytes", "output_shape", "loss",
    "segments": [{"unit", "activation_bytes", "input_bytes"}, ...] (forward order; "root" first,
    "loss" last), "forward_flops", "profile_s"}.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: accepted values are {', '.join(_DTYPES)}")
    if device not in KERNEL_DEVICES:
        raise ValueError(f"device={device!r}: accepted values are {', '.join(KERNEL_DEVICES)}")
    t0 = time.perf_counter()
    autocast = dtype.startswith("autocast-")
    fsdp_mixed = dtype.startswith(("fsdp-", "fsdp1-"))  # FSDP's mixed precision: the root casts the batch
    tdtype = getattr(torch, dtype.split("-")[-1])
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
        model, full_precision, built_bytes = _built_model(torch, work, dtype, tdtype, checkpoint_every)
        model.train()
        unit_modules = work.units(model)
        owner = {}
        for uname, um in full_precision + unit_modules:  # a BatchNorm's parameters are its own unit's
            for p in um.parameters():
                owner.setdefault(id(p), uname)
        units, param_keys, tied = _parameters_by_unit(model, owner)
        buffers, buffer_dtypes = _buffer_bytes_by_dtype(model)
        construct = _construct_order(model, built_bytes)
        n_params = sum(u["numel"] for u in units.values())
        pbytes = next(iter(model.parameters())).element_size() if n_params else 4

        inputs = work.inputs(torch, torch.float32 if autocast or fsdp_mixed else tdtype)
        rec = _ForwardRecorder(torch, model, inputs, param_keys, {name for name, _ in unit_modules})
        root_handles = rec.hook_root(model, tdtype if fsdp_mixed else None)
        handles = rec.hook_units(work.segment_modules(model), full_precision)
        loss, loss_kind, out, ready = _traced_step(torch, work, model, rec, inputs, handles + root_handles, owner,
                                                   device, autocast, tdtype, checkpoint_every)
        out_bytes = out.numel() * out.element_size()
        out_shape = list(out.shape)
        backward = _backward_peaks(rec.bwd)
        census = _kept_segment_census(rec.segments, units, rec.bwd)
        del loss, out
        alloc_log = rec.bwd.close_log()
        fwd_flops, layer_flops = _forward_flops(census, rec.segments, unit_modules)
    return {
        "factory": work.label,
        "workload": work.to_spec(),
        "module_class": type(model).__name__,
        "input_shape": list(tuple(work.input_shape)),
        "dtype": dtype,
        "kernels_of": device,
        "params": int(n_params),
        "param_bytes_dtype": int(pbytes),
        "units": list(units.values()),
        "tied": tied,
        "buffers_bytes": int(buffers),
        "buffers": [[d, sizes] for d, sizes in buffer_dtypes.items()],
        "activation_bytes": int(sum(rec.saved.values())),
        "batch_bytes": int(rec.batch_bytes),
        "output_bytes": int(out_bytes),
        "output_shape": out_shape,
        "segments": _segment_records(rec, units, backward, census),
        "loss": loss_kind,
        "grad_ready": ready,
        "linear_bias": rec.bwd.linear_bias,
        "batchnorm": any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()),
        "fp32_units": [name for name, _ in full_precision],
        "forward_flops": fwd_flops,
        "layer_flops": layer_flops,
        # the parameters' and buffers' bytes in the order `model.to(device)` allocates them
        # (`Module._apply`: the children first, then the module's own parameters, then its buffers), and the
        # step's allocations (`_SegmentTracker.log`)
        **construct, "alloc_log": alloc_log,
        "profile_s": time.perf_counter() - t0,
    }


def _built_model(torch, work, dtype: str, tdtype, checkpoint_every: int) -> tuple:
    """The workload's model as the trace runs it: built (user code: what it raises, one line naming the
    flag), checkpointed as the probes apply it, cast to the run's dtype. Returns (model, full_precision:
    [(name, module)] kept in fp32 by FSDP1's mixed precision, built_bytes: {id(tensor): bytes as built})."""
    factory_path = work.label
    autocast = dtype.startswith("autocast-")
    flag = "--hf-config" if work.kind == "hf" else "--module"
    try:
        model = work.build()
    except ValueError as exc:
        raise ValueError(str(exc).splitlines()[0][:300]) from None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - user code; SystemExit too
        raise user_code_error(flag, factory_path, "building the model" if work.kind == "hf" else "the factory",
                              exc) from None
    _check_model(torch, model, flag, factory_path)
    if checkpoint_every:
        # as the probes apply it (validate/probe.py; a transformers model: its own): only the step's log is of use from such a trace (its
        # recomputations in backward, in host order); the rest of the profile is a checkpointed run's
        work.enable_checkpointing(model, work.units(model), checkpoint_every)
    # FSDP1 under mixed precision wraps each module of these classes apart, in full precision
    # (`fsdp/wrap.py` `_wrap_module_cls_individually` with `mixed_precision=None`)
    full_precision = _fsdp1_full_precision_modules(torch, model) if dtype.startswith("fsdp1-") else []
    kept32 = {id(t) for _, m in full_precision for t in list(m.parameters()) + list(m.buffers())}
    # each parameter's and buffer's bytes as the factory built them (before the casts below): pure
    # 16-bit training builds the module so and casts it after `model.to(device)`
    built_bytes = {id(t): int(t.numel() * t.element_size())
                   for t in list(model.parameters()) + list(model.buffers())}
    if not autocast and tdtype != torch.float32:
        # Module.to() swaps tensors, which fake tensors refuse; assigning .data casts in place.
        # FSDP's mixed precision casts parameters only; a module's own `.to(dtype)` casts buffers too
        # (FSDP1's `buffer_dtype` too, the probes' MixedPrecision(buffer_dtype=param_dtype)).
        casts = list(model.parameters()) + ([] if work.kind == "hf" else list(model.buffers()))
        for t in casts:
            if t.is_floating_point() and id(t) not in kept32:
                t.data = t.data.to(tdtype)
    if full_precision:
        from torch.distributed.fsdp._common_utils import _override_module_mixed_precision
        # the forward pre- and post-hooks FSDP1 registers on them: the input cast to fp32, the output
        # back to the input's dtype
        _override_module_mixed_precision(model, _fsdp1_full_precision_classes(torch))
    return model, full_precision, built_bytes


def _parameters_by_unit(model, owner: dict) -> tuple:
    """(units: {unit: {"name", "params": [[name, shape], ...], "numel"}}, the parameters' storage keys,
    tied: [numel of each parameter reached under more than one name])."""
    # Parameters, once each (tied weights), grouped by the unit that owns them.
    seen: set = set()
    units: dict[str, dict] = {}
    param_keys = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        param_keys.add(_storage_key(p))
        unit = owner.get(id(p), "root")
        u = units.setdefault(unit, {"name": unit, "params": [], "numel": 0})
        u["params"].append([name, list(p.shape)])
        u["numel"] += p.numel()
    # Tied parameters (an embedding shared with the LM head): reached under more than one name.
    names_of: dict = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        names_of[id(p)] = names_of.get(id(p), 0) + 1
    tied = [int(p.numel()) for p in model.parameters() if p.requires_grad and names_of[id(p)] > 1]
    return units, param_keys, tied


def _buffer_bytes_by_dtype(model) -> tuple:
    """(the buffers' bytes, {dtype name: [each buffer's bytes]})."""
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    buffer_dtypes: dict = {}  # DDP broadcasts buffers per dtype (module_plan.module_collectives)
    for b in model.buffers():
        key = str(b.dtype).replace("torch.", "")
        buffer_dtypes[key] = buffer_dtypes.get(key, []) + [int(b.numel() * b.element_size())]
    return buffers, buffer_dtypes


def _construct_order(model, built_bytes: dict) -> dict:
    """The parameters' and buffers' bytes in the order `model.to(device)` allocates them: {"construct_bytes",
    "construct_names", "construct_built", "construct_paths"}, one entry per tensor in each."""
    construct: list = []
    construct_names: list = []  # each one's parameter name ("" for a buffer)
    construct_built: list = []  # each one's bytes as built
    construct_paths: list = []  # each one's qualified name, a buffer's too (expand_layers repeats a layer's)
    moved: set = set()
    param_name = {id(p): n for n, p in model.named_parameters()}
    tensor_path = {**{id(b): n for n, b in model.named_buffers()}, **param_name}

    def apply_order(mod) -> None:
        for child in mod.children():
            apply_order(child)
        for t in list(mod._parameters.values()) + list(mod._buffers.values()):
            if t is not None and id(t) not in moved:
                moved.add(id(t))
                construct.append(int(t.numel() * t.element_size()))
                construct_names.append(param_name.get(id(t), ""))
                construct_built.append(built_bytes.get(id(t), construct[-1]))
                construct_paths.append(tensor_path.get(id(t), ""))
    apply_order(model)
    return {"construct_bytes": construct, "construct_names": construct_names, "construct_built": construct_built,
            "construct_paths": construct_paths}


class _ForwardRecorder:
    """The forward's segments as the traced step runs, and what autograd saves in each (`pack`).

    Segments of the forward in execution order: each unit's call starts one; what the root
    computes between units (functional relu, flatten; a decoder's final norm and head) joins the
    segment before it. The units' hook points go to the step's log (`_SegmentTracker`, `bwd`)."""

    def __init__(self, torch, model, inputs, param_keys: set, unit_names: set):
        from torch.utils._pytree import tree_leaves

        self._torch, self._leaves = torch, tree_leaves
        self.unit_names = unit_names
        self.batch_bytes = sum(t.numel() * t.element_size() for t in inputs)
        self.saved: dict = {}
        self.segments: list[dict] = [{"unit": "root", "activation_bytes": 0, "input_bytes": int(self.batch_bytes)}]
        self.bwd = _SegmentTracker(torch)
        self.bwd.forward_segment = lambda: len(self.segments) - 1
        self.shared_ids: dict = {}
        self.in_keys: dict = {}  # the running unit's segment index -> its input's storage key (first positional tensor)
        self.fp32_started: set = set()
        # The input batch is not an activation: it exists before the forward and after it (the probes'
        # tracker and the planner count it as a temporary, `batch_bytes`); nor are buffers (BatchNorm
        # saves its running statistics for backward; the planner counts them with the parameters).
        self.batch_keys = {_storage_key(x) for x in inputs}
        self.not_activations = param_keys | self.batch_keys | {_storage_key(b) for b in model.buffers()}
        self.bwd.not_activations = self.not_activations

    def hook_root(self, model, cast_to=None) -> list:
        """The root's FSDP hooks in the log (after FSDP's cast of the batch, before the units'), their
        handles; `cast_to` (FSDP's mixed precision): the root casts its floating inputs to that dtype."""
        bwd = self.bwd
        root_handles = [model.register_forward_pre_hook(lambda *_: bwd.log_marker(3, "root"), prepend=True),
                        model.register_forward_hook(lambda *_: bwd.log_marker(4, "root"))]
        if cast_to is not None:
            torch = self._torch

            def cast_root_inputs(_mod, args, kwargs):
                cast = lambda t: t.to(cast_to) if t.is_floating_point() and t.dtype != cast_to else t  # noqa: E731
                return (tuple(cast(a) if isinstance(a, torch.Tensor) else a for a in args),
                        {k: cast(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
            # first of the root's pre-hooks (FSDP's own runs before the module's forward)
            model.register_forward_pre_hook(cast_root_inputs, prepend=True, with_kwargs=True)
        return root_handles

    def hook_units(self, seg_modules: list, full_precision: list) -> list:
        """Each segment module's pre- and post-forward hooks (and FSDP1's fp32 units'), their handles."""
        handles = [m.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True) for name, m in seg_modules]
        for name, mod in full_precision:
            handles += self._fp32_unit_hooks(name, mod)
        handles += [m.register_forward_hook(self._post_hook(name)) for name, m in seg_modules]
        return handles

    def _pre_hook(self, name):
        torch, tree_leaves, segments, bwd = self._torch, self._leaves, self.segments, self.bwd

        def hook(_mod, args, kwargs):
            # The unit's input: its first positional tensor (a decoder layer's hidden states).
            inp = sum(a.numel() * a.element_size() for a in args[:1] if isinstance(a, torch.Tensor))
            # The unit's other tensor inputs (a decoder layer's attention mask, RoPE cos/sin and
            # position ids, passed by keyword, or GPT-2's mask by position): shared by the units, and what
            # a checkpointed unit's recompute closure keeps alive (`torch.utils.checkpoint`, non-reentrant)
            # until its backward; counted once, however many units are given them (a positional one was
            # counted in every unit's input as well: GPT-2 with eager attention's (B, 1, S, S) mask,
            # one per layer, where the run keeps one).
            first = {_storage_key(a) for a in args[:1] if isinstance(a, torch.Tensor)}
            self.in_keys.clear()  # while the unit runs (its input is alive, so its storage key is its own)
            self.in_keys[len(segments)] = first
            shared = []
            for t in tree_leaves((args[1:], kwargs)):
                if isinstance(t, torch.Tensor):
                    k = _storage_key(t)
                    if k not in self.not_activations and k not in first:
                        idx = self.shared_ids.setdefault(k, len(self.shared_ids))
                        if all(i != idx for i, _ in shared):
                            shared.append([idx, int(_storage_nbytes(t))])
            segments.append({"unit": name, "activation_bytes": 0, "input_bytes": int(inp),
                             "shared_inputs": shared,
                             # the batch itself (a temporary, not what a checkpointed unit keeps anew)
                             "input_is_batch": bool(first & self.batch_keys),
                             # saved already by the ops before (a ReLU's output): an activation, not
                             # a checkpointed forward's transient output
                             "input_already_saved": any(k_ in self.saved for k_ in first)})
            unit = name if name in self.unit_names else None
            bwd.log_marker(3, unit)
            bwd.mark_input(args, len(segments) - 1, unit)
        return hook

    def _post_hook(self, name):
        return lambda mod, args, out: self._after_unit(name if name in self.unit_names else None, out)

    def _after_unit(self, unit, out):
        torch, tree_leaves, segments, bwd = self._torch, self._leaves, self.segments, self.bwd
        self.in_keys.clear()  # the root's ops after the unit: a freed input's key may be another storage's
        bwd.log_marker(4, unit)
        bwd.mark_output(tree_leaves(out), len(segments) - 1, unit)
        # what the unit's own call saved; the rest of the segment's saved bytes are the root's ops
        # after it (kept under a unit's activation checkpointing)
        segments[-1]["unit_bytes"] = segments[-1]["activation_bytes"]
        # the unit's own kernels (what a checkpointed unit runs again in backward), before the root's ops
        # after it join its segment
        segments[-1]["unit_census"] = bwd.census.of(len(segments) - 1, "forward")
        # what a checkpointed unit's recomputation holds at its peak: the unit's own forward peak (less
        # the earlier segments' saved tensors, as `forward_bytes`) and its output
        idx = len(segments) - 1
        segments[-1]["unit_forward_bytes"] = int(max(0, bwd.fwd_peak.get(idx, 0)
                                                     - sum(x["activation_bytes"] for x in segments[:idx])))
        segments[-1]["unit_output_bytes"] = int(sum(_storage_nbytes(t) for t in tree_leaves(out)
                                                    if isinstance(t, torch.Tensor)))

    def _fp32_unit_hooks(self, name, mod) -> list:
        """FSDP1's own units of the BatchNorm modules (inside a unit): their hooks in the log too."""
        torch, tree_leaves, bwd, fp32_started = self._torch, self._leaves, self.bwd, self.fp32_started

        def after(_m, _a, out):
            bwd.log_marker(4, name)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda _g: bwd.log_marker(5, name) if name not in fp32_started
                                    else None)
                    t.register_hook(lambda _g: fp32_started.add(name))
        return [mod.register_forward_pre_hook(lambda *_: bwd.log_marker(3, name), prepend=True),
                mod.register_forward_hook(after)]

    def pack(self, t):
        """`saved_tensors_hooks`' pack: each storage autograd saves, counted once, in the running segment."""
        segments, saved = self.segments, self.saved
        k = _storage_key(t)
        if k not in self.not_activations and k not in saved:
            saved[k] = _storage_nbytes(t)
            segments[-1]["activation_bytes"] += saved[k]
            if k in self.in_keys.get(len(segments) - 1, ()):
                # the unit saves its own input (an RMSNorm's `x.to(float32)` of fp32 hidden states, a
                # LayerNorm's input): under checkpointing the recompute saves the kept input again,
                # not a copy of it
                segments[-1]["input_saved_bytes"] = segments[-1].get("input_saved_bytes", 0) + saved[k]
            self.bwd.mark_saved(t.untyped_storage(), saved[k], len(segments) - 1)
        return t


def _traced_step(torch, work, model, rec: _ForwardRecorder, inputs, handles: list, owner: dict, device: str,
                 autocast: bool, tdtype, checkpoint_every: int) -> tuple:
    """One forward, the loss and the backward on the trace's tensors, recorded by `rec`: (loss, loss kind,
    output, grad_ready: [[parameter name, numel], ...] in the order their gradients are accumulated)."""
    factory_path, shape = work.label, tuple(work.input_shape)
    segments, bwd = rec.segments, rec.bwd
    # over the forward and the backward (the grouped GEMMs' gradients)
    with _grouped_mm_any_dtype(torch):
        try:
            with work.trace_context(), _cuda_kernels(torch, autocast) if device == "cuda" else contextlib.nullcontext(), \
                    _quiet_fake_tensor_log(), bwd.forward_mode, \
                    torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t), \
                    torch.autocast("cpu", dtype=tdtype, enabled=autocast):
                loss, loss_kind, out = work.loss(model, inputs)
                if not isinstance(out, torch.Tensor):
                    raise TypeError(f"the forward returned {type(out).__name__}; profile needs a tensor output")
                for h in handles:
                    h.remove()
                if out.requires_grad:  # the root's pre-backward (FSDP's hook on the root's outputs)
                    out.register_hook(lambda _g: bwd.log_marker(5, "root"))
                segments.append({"unit": "loss", "activation_bytes": 0,
                                 "input_already_saved": _storage_key(out) in rec.saved,
                                 "input_bytes": out.numel() * out.element_size()})
                bwd.mark_input((out,), len(segments) - 1)
            # The backward on the same fake tensors: the peak of the bytes it creates and frees within
            # each segment (activation gradients; parameters' gradients, which outlive it, excluded).
            # The order the parameters' gradients become ready in is recorded too: DDP rebuilds its
            # buckets in that order after the first iteration (`Reducer::rebuild_buckets`).
            ready, hooks = _record_grad_ready(model, owner, bwd)
            # (a checkpointed unit's recomputation runs the forward's kernels again: CUDA's, as traced)
            with _cuda_kernels(torch, autocast) if device == "cuda" and checkpoint_every else contextlib.nullcontext():
                if loss.requires_grad:
                    bwd.run(loss, len(segments))
            for h in hooks:
                h.remove()
        except ValueError:
            raise
        except Exception as exc:
            what = "--input-shape=" + ",".join(map(str, shape)) if work.kind != "hf" else f"--hf-config={factory_path!r}"
            raise ValueError(f"{what}: the forward of {factory_path} "
                             f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    return loss, loss_kind, out, ready


def _record_grad_ready(model, owner: dict, bwd) -> tuple:
    """(ready: [[name, numel], ...] filled as the backward accumulates each parameter's gradient, the hooks'
    handles). Each accumulation is marked in `bwd`; a unit's last one logs FSDP1's post-backward [7, unit]."""
    ready: list = []
    hooks = []
    seen_ready: set = set()
    # per unit, its parameters whose gradient is not accumulated yet: when none is left, FSDP1's
    # flat parameter's AccumulateGrad runs its post-backward hook ([7, unit] in the log)
    pending: dict = {}
    for _, p in model.named_parameters():
        if p.requires_grad:
            pending.setdefault(owner.get(id(p), "root"), set()).add(id(p))
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen_ready:
            seen_ready.add(id(p))
            def on_ready(t, name=name) -> None:
                ready.append([name, int(t.numel())])
                bwd.mark_accumulated(t, name)
                left = pending.get(owner.get(id(t), "root"))
                if left is not None and id(t) in left:
                    left.discard(id(t))
                    if not left:
                        bwd.log_marker(7, owner.get(id(t), "root"))
            hooks.append(p.register_post_accumulate_grad_hook(on_ready))
    return ready, hooks


def _backward_peaks(bwd) -> tuple:
    """The backward's figures per segment, read before the step's log is closed: (peaks, split (not started,
    started), split accumulating (not started, started), ends, grads made), each {segment index: ...}."""
    peaks = bwd.segment_peaks()
    split = (bwd.segment_peaks(started=False), bwd.segment_peaks(started=True))
    split_acc = (bwd.segment_peaks_accumulating(started=False), bwd.segment_peaks_accumulating(started=True))
    ends = bwd.segment_ends()
    made = bwd.segment_grads()
    return peaks, split, split_acc, ends, made


def _kept(i: int, seg: dict, units: dict) -> bool:
    """Whether segment i is one the profile keeps: the first, one that saved bytes, a unit's, the loss."""
    return i == 0 or seg["activation_bytes"] or seg["unit"] in units or seg["unit"] == "loss"


def _kept_segment_census(segments: list, units: dict, bwd) -> dict:
    """{kept segment index: [forward census, backward census]} (`CENSUS_FIELDS`)."""
    # each kept segment's kernels, with those of the segments dropped below (a parameter-free child that
    # saved nothing: a ReLU module) folded into the kept one before it
    census: dict = {}
    kept = 0
    for i, seg in enumerate(segments):
        if _kept(i, seg, units):
            kept = i
        both = census.setdefault(kept, [[0] * len(CENSUS_FIELDS), [0] * len(CENSUS_FIELDS)])
        for mine, theirs in zip(both, (bwd.census.of(i, "forward"), bwd.census.of(i, "backward"))):
            mine[:] = [a + b for a, b in zip(mine, theirs)]
    return census


def _forward_flops(census: dict, segments: list, unit_modules: list) -> tuple:
    """(the forward's FLOPs, one layer's forward FLOPs (0 without a middle unit))."""
    # The forward's FLOPs (MFU's numerator: x 3, no recompute) from the census: the GEMMs and convolutions
    # by torch.utils.flop_counter's formulas, a MoE's grouped GEMMs, and fused attention halved when causal,
    # as the analytic front end counts it (compute.model_flops; Narayanan et al. 2021, Eq. 3). Not
    # FlopCounterMode's total: it has no grouped GEMM, and counts the CPU's SDPA in torch 2.15 (unhalved)
    # but not in 2.13, so the same model's MFU moved with the installed torch.
    fwd = {i: both[0] for i, both in census.items()}
    fwd_flops = int(sum(f[0] + f[2] for f in fwd.values()))
    layer = next((i for i, seg in enumerate(segments) if seg["unit"] == unit_modules[1][0]), None) \
        if len(unit_modules) > 2 else None
    layer_flops = int(fwd[layer][0] + fwd[layer][2]) if layer in fwd else 0
    return fwd_flops, layer_flops


def _segment_records(rec: _ForwardRecorder, units: dict, backward: tuple, census: dict) -> list:
    """The kept segments, each with its backward's figures (`_backward_peaks`), census and convolutions."""
    peaks, split, split_acc, ends, made = backward
    segments, bwd = rec.segments, rec.bwd
    return [dict(seg, **dict(zip(("backward_bytes", "backward_grad_bytes", "backward_saved_bytes"),
                                 peaks.get(i, (0, 0, 0)))),
                 backward_split=[list(p.get(i, (0, 0, 0))) for p in split],
                 backward_split_accumulating=[list(p.get(i, (0, 0, 0))) for p in split_acc],
                 backward_end=int(ends.get(i, 0)), grads_made=int(made.get(i, 0)),
                 census=census.get(i, [[0] * len(CENSUS_FIELDS)] * 2),
                 kernels=bwd.segment_kernels(i, sum(x["activation_bytes"] for x in segments[:i])),
                 forward_bytes=max(0, bwd.fwd_peak.get(i, 0)
                                   - sum(x["activation_bytes"] for x in segments[:i])))
            for i, seg in enumerate(segments) if _kept(i, seg, units)]
