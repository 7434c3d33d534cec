"""What a probe will import, imported before its workers are forked (validate/launch.py, validate/warm.py).

The launcher and the warm process import the probe's modules once, so that each worker forked from them
starts with torch, FSDP and DTensor already imported. This module itself imports no torch: `distplan
validate` imports it (through warm.py) in the process that runs the command.
"""

from __future__ import annotations

import importlib
import json

from distplan.planner.workload.traced_model import _preload_hf, from_spec, frozen_imports


PRELOAD_MODULES = (
    "torch", "torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
    "torch.distributed.optim", "torch.nn.parallel", "torch.distributed.device_mesh",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "torch.utils.checkpoint",
    # nn.Embedding's reset_parameters and the other nn.init calls made while building the model run through
    # `torch._disable_dynamo` (torch/_compile.py), whose first call imports torch._dynamo: about 1 s alone,
    # half of a 2-rank gloo probe's worker time when each worker imported it after the fork
    "torch._dynamo",
    "distplan.validate.measure", "distplan.validate.model", "distplan.validate.wrap", "distplan.validate.probe",
    "distplan.planner.workload.traced_model", "distplan.planner.config", "distplan.planner.model",
)
"""What a probe's run imports (the probe modules themselves and what `wrap.py` imports inside its functions):
`preload` imports it before the launcher forks the workers (`validate/launch.py`)."""


def preload_module(module: str, args: list[str]) -> None:
    """Import probe module `module` (it imports torch at its top) and what its run with `args` will import
    (`module.preload(args)`, where it has one), frozen (`workload.frozen_imports`): the launcher and the warm
    process, before they fork."""
    with frozen_imports():
        mod = importlib.import_module(module)
    if hasattr(mod, "preload"):
        mod.preload(list(args))


def preload(argv: list[str]) -> None:
    """Import what the probe of `argv` (`--spec PATH ...`) will import, so that workers forked from this
    process (validate/launch.py) start with it; transformers too when the spec is a Hugging Face model.
    Importing only: no tensor is made, no thread or CUDA context started. The imports run with the garbage
    collector paused and are frozen after (`workload.frozen_imports`): a worker's collections, and its
    copy-on-write pages, leave torch's ~10^5 module objects alone."""
    try:
        spec_path = argv[argv.index("--spec") + 1]
        with open(spec_path) as f:
            module = (json.load(f) or {}).get("module") or {}
        hf = from_spec(module) if module.get("hf_config") else None
    except (ValueError, IndexError, OSError, AttributeError, TypeError, KeyError):
        hf = None  # the worker reports it
    with frozen_imports():
        for name in PRELOAD_MODULES:
            importlib.import_module(name)
        if hf is not None:  # transformers and the model type's modeling module (never raises: the worker
            _preload_hf(hf)  # imports them again and reports what fails)
