"""Expert parallelism (SPEC §17, docs/expert_parallel.md): MoE experts split over an ep mesh."""
from hyper_parallel.core.expert_parallel.dispatch import VariableAllToAll, dispatch_combine, plan_routing
from hyper_parallel.core.expert_parallel.routing_stats import (global_routing_sums, load_balancing_loss,
                                                               token_imbalance)
from hyper_parallel.core.expert_parallel.style import ExpertParallel

__all__ = ["ExpertParallel", "VariableAllToAll", "dispatch_combine", "plan_routing", "global_routing_sums",
           "load_balancing_loss", "token_imbalance"]
