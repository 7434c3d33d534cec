"""Record allocator snapshots of chosen matrix probes on a GPU and print what was live at each peak.

    python .ci/gpu-snapshots.py OUTDIR ID [ID ...]      # ids as in the results file, e.g. ddp/llama-small/w2-fake/none/bf16-mixed

Each probe runs as `distplan validate` would run it (fake process group on the GPU for `-fake` ids, one
process for `single`), with DISTPLAN_MEMORY_SNAPSHOT set; then `distplan.validate.snapshot` summarizes.
"""
import json
import os
import subprocess
import sys

from distplan.validate import matrix as mx
from distplan.validate.snapshot import summarize

out_dir, ids = sys.argv[1], sys.argv[2:]
shapes = mx.shapes_for("gpu")
for pid in ids:
    strategy, shape, w, ckpt, prec = pid.split("/")
    world = int(w[1:].split("-")[0])
    mode = "fake"  # one process on the GPU, also for `single` (world 1)
    spec = mx.make_spec(strategy, dict(shapes[shape], name=shape), world, mode, checkpointing=ckpt,
                        precision=prec, **mx.TRAIN_GPU)
    spec["device_type"] = "cuda"
    tag = pid.replace("/", "_")
    sp, rp, snap = (os.path.join(out_dir, f"{tag}.{x}") for x in ("spec.json", "result.json", "pickle"))
    with open(sp, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, DISTPLAN_MEMORY_SNAPSHOT=snap)
    cp = subprocess.run([sys.executable, "-m", "distplan.validate.probe", "--spec", sp, "--out", rp], env=env,
                        capture_output=True, text=True)
    r = json.load(open(rp))
    m = r.get("memory") or {}
    print(f"\n=== {pid}: {r.get('status')} max_allocated {m.get('peak_allocated')} tracker {m.get('tracker_peak_allocated')} "
          f"components {m.get('components')} {r.get('error') or ''}", flush=True)
    if os.path.exists(snap):
        summarize(snap, top=18, stacks=int(os.environ.get('STACKS', '0')))
        os.unlink(snap)
    sys.stdout.flush()
