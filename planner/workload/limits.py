"""The limits of user code (`--timeout`, the memory cap) for the commands that run it: `user_code_limits`
sets them around a command, `isolated.run_isolated` applies them. Kept apart from `isolated.py` (pipes,
processes, pickling) so that a command that runs no user code imports none of that: the cold start of
`distplan estimate` (benchmarks/bench_planner.py)."""

from __future__ import annotations

import contextlib

DEFAULT_TIMEOUT_S = 300.0
"""The time limit where none is given: `distplan validate`'s default --timeout per probe."""
MEMORY_FRACTION = 0.5
"""The memory cap's share of the memory available when the call starts (`MemAvailable`)."""
MIN_MEMORY_CAP = 1 << 30
LIMITS: dict = {"timeout_s": None, "memory_bytes": None, "failed": None, "in_child": False, "server": None}
"""The limits in force (None: the defaults), what failed inside them ({(flag, label): line}; None outside any),
whether this process is a worker, and the outermost limits' warm worker (`isolated._Server`)."""


@contextlib.contextmanager
def user_code_limits(timeout_s: float | None = None, memory_bytes: int | None = None):
    """The time limit and memory cap of every `run_isolated` call inside (None: the enclosing one's, else
    DEFAULT_TIMEOUT_S and `memory_cap()`). The outermost one keeps one child for all the calls inside (a
    plan traces one model in several regimes: warm after the first, as in one process), ended with it; a
    workload that failed as a process is not run again inside."""
    saved = {k: LIMITS[k] for k in ("timeout_s", "memory_bytes")}
    outermost = LIMITS["failed"] is None
    if timeout_s is not None:
        LIMITS["timeout_s"] = float(timeout_s)
    if memory_bytes is not None:
        LIMITS["memory_bytes"] = int(memory_bytes)
    if outermost:
        LIMITS["failed"] = {}
    try:
        yield
    finally:
        LIMITS.update(saved)  # (the child and what failed stay the outermost one's)
        if outermost:
            server, LIMITS["server"], LIMITS["failed"] = LIMITS["server"], None, None
            if server is not None:
                server.stop()


def memory_cap() -> int | None:
    """The bytes the worker may map beyond what it had mapped when ready: `user_code_limits`' or MEMORY_FRACTION
    of MemAvailable (at least MIN_MEMORY_CAP); None where /proc/meminfo cannot be read."""
    if LIMITS["memory_bytes"]:
        return LIMITS["memory_bytes"]
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return max(MIN_MEMORY_CAP, int(MEMORY_FRACTION * avail))
