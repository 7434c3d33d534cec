"""What a traced model is: how to build it, its wrapping units, its input batch and its loss.

The trace (`trace.profile_workload`) and the probes (`probe.py`) run the same workload, so the
plan and the measurement see the same code. Two kinds, both described by a small JSON-able dict (the
"module" object of a probe spec):

- `{"factory": "pkg.mod:fn", "input_shape": [N, ...], "path": dir}`: any `nn.Module` from a factory
  (`--module`). Units: the direct children that own parameters (an FSDP auto-wrap policy on direct
  children). Input: one random float tensor of that shape. Loss: cross-entropy against class 0 for a
  2-D output, else the sum of the outputs.
- `{"hf_config": path, "micro_batch": B, "seq_len": T, "layers": L or null[, "attention": "eager"]}`: a
  Hugging Face causal LM (`--hf-config`) built from its `config.json` with
  `AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")` -- the model users train, no
  weights -- or with `attn_implementation="eager"` when asked (`--attention eager`: transformers'
  `eager_attention_forward`, which materializes the scores and probabilities, B x heads x T x T each). Units: the decoder layers (the
  `nn.ModuleList` of `num_hidden_layers` blocks: `model.layers`, `transformer.h`), as torchtitan and
  the FSDP recipes of transformers/accelerate wrap them; embeddings, final norm and head stay with the
  root. Input: B x T random token ids. Loss: what transformers computes when it is given labels
  (`model(input_ids=ids, labels=ids).loss`: `loss_utils.ForCausalLMLoss`, logits upcast to fp32, shifted
  labels); the model's output object is dropped right away, as a training loop that keeps only
  `.loss` does. Full activation checkpointing is transformers' own
  (`activation_checkpointing_enable`, non-reentrant `torch.utils.checkpoint` per decoder layer).

Torch and transformers are imported inside the functions that need them.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from distplan.planner.allocator import collector_paused
from distplan.planner.config import ATTENTION

HF_LAYER_KEYS = ("num_hidden_layers", "n_layer")
"""config.json keys of the decoder depth (Llama-family, GPT-2)."""


def load_factory(factory_path: str):
    """`pkg.mod:factory` -> the callable; ValueError naming --module and the value on any failure."""
    if not isinstance(factory_path, str) or factory_path.count(":") != 1:
        raise ValueError(f"--module={factory_path!r}: expected PKG.MOD:FACTORY, e.g. examples.mnist_cnn:make_model")
    mod_name, attr = factory_path.split(":")
    if not mod_name or not attr:
        raise ValueError(f"--module={factory_path!r}: expected PKG.MOD:FACTORY, e.g. examples.mnist_cnn:make_model")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        mod = importlib.import_module(mod_name)
    except KeyboardInterrupt:
        raise
    except SystemExit as exc:  # user code ending the process: a one-line error, not a silent exit 0
        raise ValueError(f"--module={factory_path!r}: importing {mod_name!r} called sys.exit({exc.code!r})") from None
    except BaseException as exc:  # ImportError, SyntaxError, anything the module raises on import
        raise ValueError(f"--module={factory_path!r}: cannot import {mod_name!r} "
                         f"({type(exc).__name__}: {exc}); run from the directory that contains it") from None
    factory = mod
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise ValueError(f"--module={factory_path!r}: {mod_name!r} has no attribute {attr!r}")
    if not callable(factory):
        raise ValueError(f"--module={factory_path!r}: {attr!r} is not callable")
    return factory


def parse_shape(text, flag: str = "--input-shape") -> tuple[int, ...]:
    """`128,1,28,28` (or `128x1x28x28`, or a tuple) -> (128, 1, 28, 28); the first dim is the batch."""
    if isinstance(text, (tuple, list)):
        parts = list(text)
    else:
        s = str(text or "").strip().strip("()[]").replace("x", ",").replace(" ", "")
        parts = [p for p in s.split(",") if p != ""]
    try:
        shape = tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise ValueError(f"{flag}={text!r}: expected positive integers separated by commas, batch first, "
                         f"e.g. 128,1,28,28")
    return shape


def module_loss(out):
    """(loss, kind) for a module's output: cross-entropy against class 0 when the output is 2-D (a
    classifier), else the sum of the outputs. The probe trains with the same loss."""
    import torch

    if isinstance(out, (tuple, list)):
        out = out[0]
    if out.dim() == 2:
        target = torch.zeros(out.shape[0], dtype=torch.long, device=out.device)
        return torch.nn.functional.cross_entropy(out, target), "cross_entropy"
    return out.sum(), "sum"


def _callable_children(model, prefix: str = "") -> list:
    """(qualified name, module) of the direct children, those that implement no forward (ModuleList,
    ModuleDict) replaced by their own children, recursively."""
    import torch
    out = []
    for name, child in model.named_children():
        if type(child).forward is torch.nn.Module.forward:  # `_forward_unimplemented`: only a container
            out += _callable_children(child, f"{prefix}{name}.")
        else:
            out.append((prefix + name, child))
    return out


class FactoryWorkload:
    """Any nn.Module from `pkg.mod:factory`, one float input of `input_shape`."""

    kind = "module"

    def __init__(self, factory: str, input_shape, path: str | None = None):
        self.factory, self.input_shape, self.path = factory, tuple(int(d) for d in input_shape), path

    @property
    def label(self) -> str:
        return self.factory

    @property
    def batch(self) -> int:
        return self.input_shape[0]

    def build(self):
        if self.path and self.path not in sys.path:
            sys.path.insert(0, self.path)
        return load_factory(self.factory)()

    def units(self, model) -> list:
        """The wrapping units: the direct children that own parameters, a container that is never called
        (`nn.ModuleList`, `nn.ModuleDict`: no forward of its own) replaced by its children, as one wraps a
        ViT's `blocks` list block by block (fully_shard refuses a container without forward, and FSDP1
        would never unshard one: its hooks run on forward)."""
        return [(n, c) for n, c in _callable_children(model) if any(True for _ in c.parameters())]

    def segment_modules(self, model) -> list:
        """Where the trace starts a segment: every direct child (a parameter-free child's call, a
        pooling or an activation module, is a segment of its own; a container's children, as `units`)."""
        return _callable_children(model)

    def inputs(self, torch, dtype, generator=None, device=None) -> tuple:
        if generator is None:
            return (torch.empty(self.input_shape, dtype=dtype, device=device),)
        return (torch.randn(self.input_shape, generator=generator).to(device, dtype),)

    def loss(self, model, inputs):
        """(loss, kind, output): the output is what the caller holds until the loss is computed."""
        out = model(inputs[0])
        if isinstance(out, (tuple, list)):
            out = out[0]
        loss, kind = module_loss(out)
        return loss, kind, out

    def enable_checkpointing(self, model, units: list, every: int = 1) -> list:
        """Non-reentrant `checkpoint_wrapper` around every `every`-th unit from the first; returns the
        units (the wrappers where wrapped)."""
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
        chosen = set(id(m) for _, m in units[::every])
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
            check_fn=lambda m: id(m) in chosen)
        return self.units(model)

    def trace_context(self):
        import contextlib
        return contextlib.nullcontext()

    def to_spec(self) -> dict:
        return {"factory": self.factory, "input_shape": list(self.input_shape), "path": self.path}


def read_hf_json(path) -> dict:
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    return json.loads(p.read_text(encoding="utf-8"))


class HFWorkload:
    """A Hugging Face causal LM from its config.json (module docstring)."""

    kind = "hf"

    def __init__(self, hf_config: str, micro_batch: int, seq_len: int, layers: int | None = None,
                 attention: str = "sdpa", vocab: int | None = None):
        if attention not in ATTENTION:
            raise ValueError(f"--attention={attention!r}: accepted values are {', '.join(ATTENTION)}")
        self.hf_config = str(hf_config)
        self.attention = attention
        self.micro_batch, self.seq_len = int(micro_batch), int(seq_len)
        self.layers = int(layers) if layers else None
        self.vocab_size = int(vocab) if vocab else None
        """The config's vocab_size replaced (a probe scaled to a small machine), or None: as configured."""
        self.input_shape = (self.micro_batch, self.seq_len)

    @property
    def label(self) -> str:
        return (f"hf:{self.hf_config}" + (f" ({self.layers} layers)" if self.layers else "")
                + (f" (vocab {self.vocab_size})" if self.vocab_size else "")
                + (" (eager attention)" if self.attention == "eager" else ""))

    @property
    def batch(self) -> int:
        return self.micro_batch

    def depth(self) -> int:
        """Decoder layers of the model as configured (with --layers applied)."""
        if self.layers:
            return self.layers
        raw = read_hf_json(self.hf_config)
        return int(next((raw[k] for k in HF_LAYER_KEYS if k in raw), 0))

    def config(self):
        from transformers import AutoConfig
        raw = read_hf_json(self.hf_config)
        if self.layers:
            for k in HF_LAYER_KEYS:
                if k in raw:
                    raw[k] = self.layers
        if self.vocab_size:
            raw["vocab_size"] = self.vocab_size
            if isinstance(raw.get("pad_token_id"), int) and raw["pad_token_id"] >= self.vocab_size:
                raw["pad_token_id"] = None  # nn.Embedding's padding_idx must lie inside the table
        model_type = raw.pop("model_type", None)
        raw.pop("architectures", None)
        raw.pop("torch_dtype", None)
        raw.pop("dtype", None)
        try:
            cfg = AutoConfig.for_model(model_type, **raw)
        except (ValueError, KeyError):
            import transformers
            raise ValueError(f"--hf-config={self.hf_config!r}: model_type {model_type!r} is not one transformers "
                             f"{transformers.__version__} knows") from None
        cfg.use_cache = False  # training: no KV cache
        return cfg

    def build(self):
        import warnings

        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # float32 parameters (the config's torch_dtype is dropped): what training keeps; mixed
            # precision casts copies, not them.
            # SDPA where the architecture has it (what users get by default), else eager (Gemma-2's
            # logit soft-capping), as transformers itself falls back; eager when asked.
            cfg = self.config()
            try:
                model = AutoModelForCausalLM.from_config(cfg, attn_implementation=self.attention)
            except ValueError as exc:
                if self.attention != "sdpa" or "scaled_dot_product_attention" not in str(exc):
                    raise
                model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
            self.attn_implementation = model.config._attn_implementation
            return model

    def units(self, model) -> list:
        return _decoder_layers(model)

    def segment_modules(self, model) -> list:
        return self.units(model)

    def vocab(self, model) -> int:
        return int(model.get_output_embeddings().weight.shape[0])

    def inputs(self, torch, dtype, generator=None, device=None, vocab: int = 2) -> tuple:
        if generator is None:
            return (torch.zeros(self.input_shape, dtype=torch.long, device=device),)
        return (torch.randint(0, vocab, self.input_shape, generator=generator).to(device),)

    def loss(self, model, inputs):
        kw = {}
        positions = getattr(getattr(model, "module", model), "cp_positions", None)  # (DDP/FSDP1: the wrapped)
        if positions is not None:  # context parallelism (validate/cp.hf_context_parallel): the global positions
            kw["position_ids"] = positions.to(inputs[0].device)[None]
        elif getattr(model, "tp_positions", False):
            # sequence parallelism (validate/tp_probe.parallelize_hf): the embedding's output holds s / tp
            # tokens, from which transformers would derive s / tp positions for the rotary tables
            import torch
            kw["position_ids"] = torch.arange(inputs[0].shape[1], device=inputs[0].device)[None]
        out = model(input_ids=inputs[0], labels=inputs[0], use_cache=False, **kw)
        loss = out.loss
        del out  # logits and the rest go now, as in a loop that keeps only .loss
        return loss, "hf-causal-lm", loss

    def enable_checkpointing(self, model, units: list, every: int = 1) -> list:
        """transformers' own: `activation_checkpointing_enable` (older: `gradient_checkpointing_enable`),
        non-reentrant, every `every`-th decoder layer from the first (`every_n_layers`)."""
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every)
        elif every == 1:  # transformers < 5
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        else:
            raise ValueError("--activation-checkpointing every-K needs transformers >= 5 (every_n_layers)")
        return units

    def trace_context(self):
        """While tracing on fake tensors: transformers treats a fake tensor as a graph being traced
        (`utils.import_utils.is_tracing`), and `masking_utils._ignore_causal_mask_sdpa` then keeps
        the materialized causal mask that a real run skips for SDPA's `is_causal` (it cannot read the
        fake `cache_position` offset). The trace must see what the real run does: inside it, that
        function answers as it does for a real batch of our kind (no padding mask, no cache: query and
        key lengths equal, offset 0) and defers to the original otherwise; likewise
        `find_packed_sequence_indices` (one sequence per row: no packing). tests/test_hf_trace.py
        compares fake and real runs."""
        import contextlib
        try:
            from transformers import masking_utils
            orig = masking_utils._ignore_causal_mask_sdpa
        except (ImportError, AttributeError):  # transformers < 4.53 builds its masks elsewhere
            return contextlib.nullcontext()

        def ignore(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None, *a, **k):
            if padding_mask is None and q_length == kv_length and (
                    local_attention_size is None or kv_length < local_attention_size):
                return True
            return orig(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size, *a, **k)

        orig_packed = getattr(masking_utils, "find_packed_sequence_indices", None)

        def packed(position_ids):  # our batches are one sequence per row: positions 0..T-1
            return None

        @contextlib.contextmanager
        def ctx():
            masking_utils._ignore_causal_mask_sdpa = ignore
            if orig_packed is not None:
                masking_utils.find_packed_sequence_indices = packed
            try:
                yield
            finally:
                masking_utils._ignore_causal_mask_sdpa = orig
                if orig_packed is not None:
                    masking_utils.find_packed_sequence_indices = orig_packed
        return ctx()

    def to_spec(self) -> dict:
        spec = {"hf_config": self.hf_config, "micro_batch": self.micro_batch, "seq_len": self.seq_len,
                "layers": self.layers}
        if self.attention != "sdpa":  # (absent for SDPA: the specs of records made before it was a choice)
            spec["attention"] = self.attention
        if self.vocab_size:  # (absent when as configured, as in the records made before it was a choice)
            spec["vocab"] = self.vocab_size
        return spec


def _decoder_layers(model) -> list:
    """(qualified name, module) of the decoder blocks: the longest nn.ModuleList whose length is the
    config's depth (`model.layers` in Llama/Mistral/Qwen2/Phi-3/Gemma, `transformer.h` in GPT-2)."""
    import torch
    depth = getattr(model.config, "num_hidden_layers", None)
    best = None
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) and (depth is None or len(m) == depth):
            if best is None or len(m) > len(best[1]):
                best = (name, m)
    if best is None:
        raise ValueError(f"--hf-config: found no list of {depth} decoder layers in {type(model).__name__}")
    name, layers = best
    return [(f"{name}.{i}", m) for i, m in enumerate(layers)]


def from_spec(spec: dict):
    """The workload of a probe spec's "module" object."""
    if spec.get("hf_config"):
        return HFWorkload(spec["hf_config"], spec.get("micro_batch", 1), spec.get("seq_len", 64), spec.get("layers"),
                          spec.get("attention", "sdpa"), spec.get("vocab"))
    return FactoryWorkload(spec["factory"], spec["input_shape"], spec.get("path"))


def preload(work=None) -> None:
    """Import torch and, for a Hugging Face workload (`HFWorkload`), transformers with its model's own
    modules (what `HFWorkload.config` and `build` import), with the cyclic garbage collector paused; then,
    where the call imported anything, move every object alive to the collector's permanent generation
    (`gc.freeze`). What is computed is unchanged: only when collections run.

    Why: torch, transformers and what a modeling module pulls in (`transformers.modeling_utils`,
    `masking_utils` -> `torch._dynamo`, `distributed.sharding_utils` -> `torch.distributed.tensor` ->
    sympy) make about 560,000 objects the collector tracks (module dicts, classes, functions, their
    tables), alive until the process exits. While they are made, CPython collects the oldest generation
    each time the objects that survived since the last full collection exceed a quarter of the
    long-lived ones (CPython 3.11 `Modules/gcmodule.c`, `gc_collect_generations`; `Python/gc.c` from
    3.12), walking all of them again; and once more at exit (`Python/pylifecycle.c`, `finalize_modules`
    -> `_PyGC_CollectNoFail`). Importing torch and modeling_llama and exiting took 8.3 s with the
    collector, 5.5 s paused and frozen (medians of 3, 2 shared cores): most of what a cold `distplan
    estimate --hf-config ... --front-end trace` gains (11 s -> 7.3 s). Paused during the imports (the
    collector's previous state restored after them) and frozen after them, they are visited by no later
    collection: the recipe of the `gc` module's documentation (`gc.freeze`) for long-lived start-up
    state. Reference counting frees objects as before, and the traces run with the collector on, as they
    did (freezing splices the generations' lists: no walk). The cost: the cyclic garbage the imports
    themselves leave (about 11,000 objects, 7 MiB, with torch 2.13 and transformers 5.24) and cycles among
    the objects alive at the freeze that die later are not reclaimed before exit; a call that imports
    nothing freezes nothing.

    torch's ImportError propagates (the callers name the extra to install); anything transformers raises
    here is left to `HFWorkload.build`, which imports the same modules and reports it as it did."""
    import warnings

    with frozen_imports(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns at import when numpy is absent; not our user's concern
        import torch  # noqa: F401
        if getattr(work, "kind", None) == "hf":
            _preload_hf(work)


@contextmanager
def frozen_imports():
    """The body's imports with the cyclic garbage collector paused (its previous state restored after
    them), then, where the body imported anything, every object alive moved to the collector's permanent
    generation (`gc.freeze`): see `preload`. The probes' launcher and warm process (validate/preload.py) import
    this way before they fork, as the `gc.freeze` documentation advises before a fork."""
    import gc


    before = len(sys.modules)
    with collector_paused():
        yield
    if len(sys.modules) > before:
        gc.freeze()


def _preload_hf(work) -> None:
    """The transformers modules `HFWorkload.build` imports: `AutoConfig`, `AutoModelForCausalLM`, and the
    causal-LM class of the config's model_type, through the same table `AutoModelForCausalLM.from_config`
    resolves it by (`models/auto/modeling_auto.py`, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES; the top-level lazy
    module imports `models/<type>/modeling_<type>.py` on the attribute's first use,
    `utils/import_utils.py`, `_LazyModule.__getattr__`). transformers' logging is quieted before the
    model's module is imported, as `build` quiets it before `from_config` imports it."""
    try:
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(read_hf_json(work.hf_config).get("model_type"))
        if isinstance(name, str):
            getattr(transformers, name)
    except Exception:  # noqa: BLE001 - an optimisation only: build() imports, and fails, as without it
        pass


def transformers_available() -> bool:
    """True when torch and transformers import (the trace front end for --hf-config)."""
    try:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torch  # noqa: F401
            import transformers  # noqa: F401
    except Exception:  # ImportError, or a broken install
        return False
    return True


def hf_path(path) -> str:
    """An absolute path for the spec (the probes may run elsewhere)."""
    return os.path.abspath(os.path.expanduser(str(path)))
