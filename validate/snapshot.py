"""What was live at the allocator's peak, from a `torch.cuda.memory._dump_snapshot()` pickle.

    DISTPLAN_MEMORY_SNAPSHOT=snap.pickle python -m distplan.validate.probe --spec S.json --out R.json
    python -m distplan.validate.snapshot snap.pickle [--top 25]

Replays the allocator's trace (`alloc` adds a block's size, `free_completed` removes it: the events that
move `allocated_bytes`, hence `torch.cuda.max_memory_allocated`), finds the highest point, and lists the
blocks live there grouped by where they were allocated: the innermost frame of our own code or of
torch's Python, and the C++ frame that names the kernel or library that asked (cuBLAS workspaces, for
instance, are allocated by no tensor operation, so a dispatch-level tracker never sees them).
Pure Python apart from unpickling; used to find what the planner's memory walk leaves out.
"""

from __future__ import annotations

import argparse
import collections
import pickle
import sys

_CPP_HINTS = ("Workspace", "workspace", "cublas", "Cublas", "cudnn", "at::native::", "at::_ops::",
              "c10d::", "Reducer", "FlatParam")


def _py(f: dict) -> str:
    return f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"


def _where(frames: list[dict]) -> tuple[str, str, str]:
    """(innermost distplan frame, innermost torch.distributed / torch.utils frame, telling C++ frame)."""
    pys = [f for f in frames if f.get("filename", "").endswith(".py")]
    ours = next((_py(f) for f in pys if "distplan" in f["filename"] or "/validate/" in f["filename"]), "?")
    lib = next((_py(f) for f in pys if "/torch/distributed/" in f["filename"]
                or "/torch/utils/checkpoint" in f["filename"] or "/torch/optim/" in f["filename"]
                or "/torch/autograd/" in f["filename"]), "")
    cpp = [f["name"] for f in frames if not f.get("filename", "").endswith(".py")
           and any(h in f.get("name", "") for h in _CPP_HINTS)]
    return ours, lib, (cpp[0][:90] if cpp else "")


def peak_blocks(snapshot: dict, device: int = 0) -> tuple[int, int, list[dict]]:
    """(peak allocated bytes over the trace, the trace index where it is reached, the blocks live
    there) for one device."""
    trace = snapshot["device_traces"][device]
    live: dict[int, dict] = {}
    cur = peak = 0
    peak_at = -1
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            cur += ev["size"]
            if cur > peak:
                peak, peak_at = cur, i
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            cur -= live.pop(ev["addr"])["size"]
    live = {}
    for ev in trace[:peak_at + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
        elif ev["action"] == "free_completed":
            live.pop(ev["addr"], None)
    return peak, peak_at, list(live.values())


def summarize(path: str, top: int = 25, out=sys.stdout, stacks: int = 0) -> None:
    """Print the live blocks at the peak grouped by origin; with `stacks` > 0 also the `stacks` largest
    blocks each with its Python stack (innermost first, torch internals included)."""
    with open(path, "rb") as f:
        snap = pickle.load(f)
    peak, at, blocks = peak_blocks(snap)
    if stacks:
        trace = snap["device_traces"][0]
        print("events around the peak (+alloc / -free, size, innermost Python frames):", file=out)
        for ev in trace[max(0, at - 12):at + 4]:
            if ev["action"] not in ("alloc", "free_completed"):
                continue
            frames = [_py(f) for f in ev.get("frames", []) if f.get("filename", "").endswith(".py")]
            sign = "+" if ev["action"] == "alloc" else "-"
            print(f"   {sign}{ev['size']:>10d}  " + " <- ".join(frames[:5]), file=out)
        for b in sorted(blocks, key=lambda b: -b["size"])[:stacks]:
            frames = [_py(f) for f in b.get("frames", []) if f.get("filename", "").endswith(".py")]
            print(f"-- {b['size']} B, stream {b.get('stream')}: " + " <- ".join(frames[:14]), file=out)
    groups: dict[tuple, list[int]] = collections.defaultdict(list)
    for b in blocks:
        groups[_where(b.get("frames", []))].append(b["size"])
    print(f"peak {peak} B ({peak / 2**20:.2f} MiB) over the trace; {len(blocks)} live blocks", file=out)
    rows = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    for (py, lib, cpp), sizes in rows[:top]:
        print(f"{sum(sizes) / 2**20:9.2f} MiB  {len(sizes):4d} x  {py}  |  {lib}  |  {cpp}", file=out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m distplan.validate.snapshot", description=__doc__.split("\n")[0])
    ap.add_argument("snapshot")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--stacks", type=int, default=0, help="also print the N largest live blocks' stacks")
    a = ap.parse_args(argv)
    summarize(a.snapshot, a.top, stacks=a.stacks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
