"""The workload: what one training step of the user's model runs on one rank.

`traced_model` says how a model the user brings is built (a `--module` factory, a Hugging Face
`config.json`), `trace` runs it on fake tensors (torch, imported inside the functions that need it) under
`trace_modes`' contexts, counting its kernels (`census`) and what each segment holds (`segment_tracker`);
`layer_expansion` makes a deep model's profile from a shallow trace; and `kernel_workspace` measures the
cuDNN workspaces of its convolutions on a GPU. Nothing here imports torch at import time.

Importing it installs one warnings filter, as `distplan.validate` does for the probes: torch's "UserWarning:
Failed to initialize NumPy" (printed at `import torch` where NumPy is missing or does not match torch's
build) is silenced, and nothing else: a trace uses no NumPy.
"""

import warnings as _warnings

_warnings.filterwarnings("ignore", message=r"Failed to initialize NumPy", category=UserWarning)
