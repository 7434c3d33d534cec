"""The workload: what one training step of the user's model runs on one rank.

`traced_model` says how a model the user brings is built (a `--module` factory, a Hugging Face
`config.json`), `trace` runs it on fake tensors (torch, imported inside the functions that need it) under
`trace_modes`' contexts, counting its kernels (`census`) and what each segment holds (`segment_tracker`);
`layer_expansion` makes a deep model's profile from a shallow trace; and `kernel_workspace` measures the cuDNN workspaces of its convolutions on a GPU. Nothing here imports torch at
import time.
"""
