"""A stand-in for `python -m distplan.validate.probe` in the runner's tests: no torch, instant.

`python tests/fake_probe.py --spec SPEC.json --out RESULT.json`. What it does comes from the spec's
"fake" object, else from the DISTPLAN_FAKE_PROBE environment variable (JSON), else "ok":

    {"behavior": "ok" | "oom" | "error" | "crash" | "hang" | "orphan" | "exit0", "sleep": seconds,
     "pidfile": path (hang: writes "<pid> <child pid>" there;
     orphan: the pid of a process it leaves in a new session, its parent gone), "memory": {...overrides}}
"""

import argparse
import json
import os
import subprocess
import sys
import time

MEMORY = {"params": 1_000_000, "grads": 1_000_000, "optimizer": 2_000_000, "activations": 500_000,
          "comm_buffers": 0, "temporaries": 100_000}


def alive(pid: int) -> bool:
    """The process `pid` exists and is not a zombie (its /proc/PID/stat state), for the tests that check
    what a run leaves behind."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def result_for(spec: dict, status: str = "ok", error=None, memory=None) -> dict:
    comps = dict(MEMORY, **(memory or {}))
    w = int(spec.get("world_size", 1))
    return {"id": spec.get("id"), "status": status, "error": error, "mode": spec.get("mode"),
            "backend": "fake", "device": "fake-cpu", "world_size": w, "measured_ranks": [0],
            "torch_version": "0.0-fake", "date": "2025-01-01T00:00:00+00:00",
            "memory": {"peak_allocated": sum(comps.values()), "per_rank_peak_allocated": [sum(comps.values())],
                       "peak_reserved": None, "baseline": 0, "peak_phase": "optimizer",
                       "components": comps, "source": "fake"},
            "collectives": [{"op": "all_reduce", "group_size": w, "dtype": "float32",
                             "message_bytes": 4_000_000, "calls": 3}] if w > 1 else [],
            "step_time_s": None, "unmeasured": ["step_time"]}


def write_atomic(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    with open(a.spec) as f:
        spec = json.load(f)
    how = spec.get("fake") or json.loads(os.environ.get("DISTPLAN_FAKE_PROBE") or "{}")
    per_id = how.get("by_id", {}).get(spec.get("id"))
    if per_id:
        how = per_id
    behavior = how.get("behavior", "ok")
    time.sleep(float(how.get("sleep", 0)))
    if behavior == "ok":
        write_atomic(a.out, result_for(spec, memory=how.get("memory")))
    elif behavior == "oom":
        write_atomic(a.out, result_for(spec, "oom", "CUDA out of memory. Tried to allocate 2.00 GiB"))
        sys.exit(1)
    elif behavior == "error":
        write_atomic(a.out, result_for(spec, "error", "ValueError: the wrapper refused"))
        sys.exit(1)
    elif behavior == "crash":
        print("some log line", file=sys.stderr)
        raise RuntimeError("probe blew up on purpose")
    elif behavior == "orphan":  # user code leaving a process in a session of its own, its parent gone
        mid = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; p = subprocess.Popen([sys.executable, "
                                "'-c', 'import time; time.sleep(600)'], start_new_session=True, stdout=subprocess.DEVNULL); "
                                "print(p.pid)"],
                               stdout=subprocess.PIPE, text=True)
        orphan = int(mid.communicate()[0])
        if how.get("pidfile"):
            with open(how["pidfile"], "w") as f:
                f.write(str(orphan))
        write_atomic(a.out, result_for(spec, memory=how.get("memory")))
    elif behavior == "exit0":
        sys.exit(0)
    elif behavior == "hang":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        if how.get("pidfile"):
            with open(how["pidfile"], "w") as f:
                f.write(f"{os.getpid()} {child.pid}")
        time.sleep(600)


if __name__ == "__main__":
    main()
