"""The largest sizes that exist, with a margin: every planner input and every catalog figure of the same
kind is bounded by them, so that no accepted value makes unbounded work. Data, as the rest of the catalog,
below the planner: `distplan.planner.units` and `catalog/loader.py` both read it."""

from __future__ import annotations

LIMITS: dict[str, tuple[int, int, str]] = {
    "gpus": (1, 2**20, "five times the largest GPU cluster built, about 200,000 GPUs"),
    "tp": (1, 1024, "the GPUs of the largest node accepted (tensor parallelism stays inside a node)"),
    "pp": (1, 4096, "one stage per layer of the deepest model accepted"),
    "cp": (1, 1 << 20, "one token per rank of the longest sequence accepted"),
    "pp_microbatches": (1, 2**20, "16 times the largest global batches published, 65,536 examples"),
    "gpus_per_node": (1, 1024, "above the largest NVLink domain announced, NVL576's 576 GPUs"),
    "nics_per_node": (1, 2048, "two per GPU of the largest node accepted; nodes carry 1 to 16"),
    "seq_len": (1, 2**24, "above the longest context trained, Llama 4 Scout's 10M tokens"),
    "micro_batch": (1, 2**20, "16 times the largest global batches published, 65,536 examples"),
    "grad_accum": (1, 2**20, "16 times the largest global batches published, 65,536 examples"),
    "layers": (1, 4096, "four times the deepest Transformer trained, DeepNet's 1,000 layers"),
    "hidden": (1, 2**17, "six times the widest published model, MT-NLG 530B's 20,480"),
    "heads": (1, 2**17, "at most one per hidden unit"),
    "kv_heads": (1, 2**17, "at most one per hidden unit"),
    "ffn_hidden": (1, 2**19, "four times the largest hidden size accepted"),
    "vocab": (1, 2**24, "64 times the largest vocabularies, Gemma 3's 262,144"),
    "max_positions": (1, 2**24, "above the longest context trained, Llama 4 Scout's 10M tokens"),
    "params": (1, 10**14, "60 times the largest published model, Switch-C's 1.6T"),
}
"""Planner inputs (argument name -> (lowest, highest, why the highest)): every size is bounded by what
exists, with a margin; the planner's work is bounded with them."""
