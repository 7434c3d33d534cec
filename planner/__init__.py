"""distplan's analytic planner: memory, communication, step time and the recommendation (no torch)."""

from .api import Plan, StrategyResult, clear_caches, evaluate, plan, resolve_cluster, resolve_model

__all__ = ["Plan", "StrategyResult", "clear_caches", "evaluate", "plan", "resolve_cluster", "resolve_model"]
