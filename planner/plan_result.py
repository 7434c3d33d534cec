"""A plan (`Plan`): every evaluated strategy for one model, training setup and cluster, and the
recommendation (recommend.py), with its JSON contract and its charts (report.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config import Cluster, TrainConfig
from .accuracy import band_key, error_band
from .pp import bubble_fraction
from .ranking import HEADROOM_FRACTION
from .recommend import recommend
from .report import plan_html, plan_svg, plot_matplotlib
from .strategy_result import StrategyResult, evaluate
from .units import short_repr


@dataclass
class Plan:
    """Every evaluated strategy for one model, training setup and cluster, and the recommendation."""

    train: TrainConfig
    cluster: Cluster
    results: list[StrategyResult]
    notes: list[str] = field(default_factory=list)
    tokens: float | None = None
    checkpoint: str | None = None
    storage_bytes_per_s: float | None = None
    search: Any = None
    """The layout search (`layout.LayoutSearch`) when `recommend` searched the mesh: this plan's train
    config is then the picked layout's (or the one given, when nothing fits anywhere)."""
    headroom: float = HEADROOM_FRACTION
    """The fraction of GPU memory the recommendation must leave free (--headroom; ranking._headroom_ok)."""
    _recommendation: Any = field(default=None, repr=False, compare=False)
    device: str = "cuda"
    """The target planned (front_end.DEVICES): whose kernels, autocast lists and allocator the memory follows."""

    def __getitem__(self, name: str) -> StrategyResult:
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(f"{short_repr(name)} was not evaluated; evaluated: {', '.join(r.name for r in self.results)}")

    def evaluate_on(self, cluster: Cluster, name: str) -> StrategyResult:
        """This plan's training run under strategy `name` on another cluster (the remedies `recommend`
        weighs: more NICs, RDMA, fewer nodes), by the same front end as the plan's own results."""
        return evaluate(self.train, cluster, name, catalog_dirs=cluster.catalog_dirs)

    def changed(self, train: TrainConfig, cluster: Cluster, checkpoint: str | None,
                storage_bytes_per_s: float | None) -> "Plan":
        """This plan's strategies evaluated again on `train` and `cluster`, with its notes (the plan under
        recommend's smallest change); a Plan whatever this plan's class."""
        return Plan(train, cluster, [evaluate(train, cluster, r.strategy, checkpoint=checkpoint,
                                              storage_bytes_per_s=storage_bytes_per_s) for r in self.results],
                    list(self.notes), checkpoint=checkpoint, storage_bytes_per_s=storage_bytes_per_s,
                    headroom=self.headroom)

    @property
    def recommendation(self):
        if self.search is None:
            return recommend(self)
        if self._recommendation is None:  # a searched plan does not change: its answer is kept
            self._recommendation = recommend(self)
        return self._recommendation

    @property
    def error_front_end(self) -> str:
        """Which measured error band applies to this plan (accuracy.band_key: the front end and the target)."""
        return band_key("analytic", self.device)

    @property
    def best(self) -> StrategyResult | None:
        rec = self.recommendation
        return self[rec.strategy] if rec.strategy else None

    def to_dict(self) -> dict:
        rec = self.recommendation
        inputs = {"model": self.train.model.to_dict(), "model_params": self.train.model.param_count(),
                  "train": {k: v for k, v in self.train.to_dict().items() if k != "model"},
                  "cluster": self.cluster.to_dict(), "device": self.device, "notes": list(self.notes)}
        t, p, c = self.train.tp, self.train.pp, self.train.cp
        inputs["mesh"] = {"pp": p, "dp": self.cluster.gpus // (t * p * c), "cp": c, "tp": t,
                          "sequence_parallel": self.train.sequence_parallel}
        if p > 1:
            inputs["mesh"].update(pp_schedule=self.train.pp_schedule,
                                  pp_microbatches=self.train.pp_microbatches,
                                  pp_bubble_fraction=bubble_fraction(self.train.pp_schedule, p,
                                                                     self.train.pp_microbatches))
        if self.tokens:
            inputs["tokens"] = self.tokens
        if self.checkpoint:
            inputs["checkpoint"] = {"mode": self.checkpoint, "storage_bytes_per_s": self.storage_bytes_per_s}
        out = {"inputs": inputs, "strategies": []}
        for r in self.results:
            d = r.to_dict()
            if self.tokens and r.time is not None and r.time.tokens_per_s:
                d["time_to_train_s"] = self.tokens / r.time.tokens_per_s
            out["strategies"].append(d)
        out["recommendation"] = rec.to_dict()
        out["error_band"] = error_band(self.error_front_end)
        return out

    def _repr_html_(self) -> str:
        return plan_html(self)

    def plot(self, path: str | None = None):
        return plot_matplotlib(self, path)

    def svg(self) -> str:
        return plan_svg(self)
