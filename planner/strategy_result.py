"""One strategy's prediction (`StrategyResult`): its memory at the peak, collectives, step time and
checkpoint save, as `evaluate` makes it; `drop_conflicts` leaves out the strategies an optimizer cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from .checkpoint import DEFAULT_STORAGE_GBPS, estimate_checkpoint
from .comm_schedule import collective_schedule
from .compute import _gpu, required_inter_bandwidth, step_time
from .config import Cluster, TrainConfig
from .memory import MemoryEstimate, estimate_memory
from .precision import optimizer_conflict
from .strategies import Strategy, get_strategy


@dataclass
class StrategyResult:
    """One strategy's prediction: memory at the peak, collectives, step time."""

    strategy: Strategy
    memory: MemoryEstimate
    collectives: list = field(default_factory=list)
    time: Any = None
    checkpoint: Any = None
    """The checkpoint save (`checkpoint.CheckpointEstimate`) when the plan was asked for one."""
    _required: Any = field(default=None, repr=False)
    """A zero-argument function giving the required inter-node bandwidth (a bisection over the
    communication model, the costliest answer here), evaluated on first use and kept."""

    @property
    def required_inter_bytes_per_s(self) -> float | None:
        """Per-node inter-node bandwidth (bytes/s) at which this strategy's communication would hide: what it
        exposes, and the compute it slows while it overlaps, at most 5% of compute."""
        if callable(self._required):
            self._required = (self._required(),)
        return self._required[0] if isinstance(self._required, tuple) else self._required

    @property
    def name(self) -> str:
        return self.strategy.name

    @property
    def fits(self) -> bool:
        """The training step fits, and so does the checkpoint save when one was planned."""
        return self.memory.fits and (self.checkpoint is None or self.checkpoint.fits)

    @property
    def fits_cleanly(self) -> bool:
        """`fits`, without the caching allocator releasing its cache (memory.MemoryEstimate.alloc_retries):
        what the recommendation asks of a pick."""
        return self.fits and not self.memory.alloc_retries

    @property
    def comm_bytes_per_gpu(self) -> int:
        return sum(c.bytes_per_gpu for c in self.collectives)

    @property
    def comm_time_s(self) -> float:
        return sum(c.time_s for c in self.collectives)

    @property
    def step_time_s(self) -> float | None:
        return self.time.step_time_s if self.time is not None else None

    def to_dict(self) -> dict:
        t = self.time
        return {
            "name": self.name,
            "implementation": self.strategy.implementation,
            "fits": self.fits,
            "peak_phase": self.memory.peak_phase,
            "memory": self.memory.to_dict(),
            "headroom_bytes": int(self.memory.headroom),
            "comm": {
                "collectives": [c.to_dict() for c in self.collectives],
                "bytes_per_gpu": int(self.comm_bytes_per_gpu),
                "time_s": self.comm_time_s,
                "exposed_s": t.exposed_comm_s if t is not None else None,
            },
            "compute_s": t.compute_s if t is not None else None,
            # step_time_s = compute_s + comm.exposed_s + optimizer_s + overhead_s
            "optimizer_s": t.optimizer_s if t is not None else None,
            "overhead_s": t.overhead_s if t is not None else None,
            "step_time_s": t.step_time_s if t is not None else None,
            "tokens_per_s": t.tokens_per_s if t is not None else None,
            "mfu": t.mfu if t is not None else None,
            # inf (no inter-node bandwidth hides it: the intra-node part alone is exposed) -> null + flag
            "required_inter_bytes_per_s": (None if self.required_inter_bytes_per_s == float("inf")
                                           else self.required_inter_bytes_per_s),
            "comm_hideable": self.required_inter_bytes_per_s != float("inf"),
            "notes": list(self.memory.notes),
            **({"checkpoint": self.checkpoint.to_dict()} if self.checkpoint is not None else {}),
        }


def drop_conflicts(names: list, optimizer: str, asked: bool, framework: str = "pytorch") -> tuple[list, list]:
    """(the strategies to plan, notes): those whose implementation cannot run `optimizer`
    (precision.optimizer_conflict) leave the default list with a note; asked for by name, they are planned
    and the note says they fail. DeepSpeed's ZeRO stages are its own implementation, not FSDP2: not judged."""
    if framework != "pytorch":
        return names, []
    why = {n: optimizer_conflict(optimizer, get_strategy(n).family) for n in names}
    bad = [n for n in names if why[n]]
    if not bad:
        return names, []
    reason = why[bad[0]]
    if asked:
        return names, [f"{', '.join(bad)} with --optimizer {optimizer}: planned as asked, but {reason}"]
    kept = [n for n in names if not why[n]]
    return kept, [f"{', '.join(bad)} not planned with --optimizer {optimizer}: {reason}"]


def evaluate(train: TrainConfig, cluster: Cluster, strategy: str | Strategy, *, comm: bool = True,
             device: str = "cuda", catalog_dirs: Sequence[str] = (), checkpoint: str | None = None,
             storage_bytes_per_s: float | None = None, mem: MemoryEstimate | None = None) -> StrategyResult:
    """One strategy's prediction; `mem`: its memory estimate when the caller already has it (the
    layout search judges memory first)."""
    st = get_strategy(strategy)
    if mem is None:
        mem = estimate_memory(train, cluster, st, device=device)
    result = StrategyResult(st, mem)
    if checkpoint is not None:
        result.checkpoint = estimate_checkpoint(train, cluster, st, checkpoint,
                                                storage_bytes_per_s or DEFAULT_STORAGE_GBPS * 1e9,
                                                device=device, mem=mem)
    if comm:
        result.collectives = collective_schedule(train, cluster, st)
        gpu = _gpu(cluster.gpu_name, tuple(catalog_dirs) if catalog_dirs else ())
        result.time = step_time(train, cluster, st, result.collectives, gpu)
        result._required = lambda: required_inter_bandwidth(train, cluster, st.name, gpu=gpu)
    return result
