"""The H100 runs of tests/data/gpu/ (Hugging Face configs, the protocol of tests/data/gpu/README.md)
re-predicted by the trace front end, one row per run: measured vs predicted peak allocated, reserved peak
and step time.

    python benchmarks/h100_hf_repredict.py [--device cuda|cpu] [--json]

`--device` is the trace's target (`profile`'s kernels): cuda, as the runs ran, or cpu, the CPU's kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from distplan.planner.api import predict_probe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data", "gpu")
RUNS = os.path.join(DATA, "h100-hf-2026-11-23.jsonl")


def runs() -> list[dict]:
    """The measured runs, in file order."""
    with open(RUNS) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_spec(run: dict, device: str = "cuda") -> dict:
    """The probe spec (api.predict_probe's input) of one run as the protocol made it: rank 0 of `world` on
    the fake process group, the model built on the GPU (also under FSDP), AdamW with torch's defaults."""
    return {
        "module": {"hf_config": os.path.join("tests", "data", "gpu", "configs", run["model"] + ".json"),
                   "micro_batch": run["mb"], "seq_len": run["seq"], "layers": None},
        "train": {"precision": run["precision"], "optimizer": "adamw", "optimizer_impl": "foreach",
                  "checkpointing": run["ac"], "grad_accum": 1},
        "strategy": run["strategy"], "world_size": run["world"], "gpus_per_node": run["world"],
        "mode": "fake", "device_type": device, "gpu_name": run["gpu"], "init": "device",
        "torch_version": run["torch"].split("+")[0],
    }


def repredict(device: str = "cuda") -> list[dict]:
    """Each run with its prediction: {"run", "peak_allocated", "peak_reserved", "step_s"} (predicted)."""
    out = []
    for run in runs():
        pred = predict_probe(run_spec(run, device))
        mem = pred["memory"]
        out.append({"run": run, "peak_allocated": mem["peak_allocated"], "peak_reserved": mem.get("peak_reserved"),
                    "step_s": pred.get("step_time_s")})
    return out


def _err(pred, meas):
    return None if pred is None else pred / meas - 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    os.chdir(ROOT)
    rows = repredict(a.device)
    if a.json:
        json.dump([{k: v for k, v in r.items() if k != "run"} | {"id": _id(r["run"])} for r in rows], sys.stdout)
        return 0
    print(f"{'run':52s} {'alloc':>8s} {'reserved':>8s} {'step':>8s}")
    for r in rows:
        m = r["run"]
        e = [_err(r["peak_allocated"], m["peak_allocated"]), _err(r["peak_reserved"], m["peak_reserved"]),
             _err(r["step_s"], m["step_s"]) if m["world"] == 1 else None]
        print(f"{_id(m):52s} " + " ".join(f"{x:+8.2%}" if x is not None else f"{'-':>8s}" for x in e))
    return 0


def _id(run: dict) -> str:
    return (f"{run['model']} {run['strategy']} w{run['world']} {run['precision']} s{run['seq']} mb{run['mb']} "
            f"ac={run['ac']}" + (f" steps={run['steps']}" if run.get("steps") else ""))


if __name__ == "__main__":
    sys.exit(main())
