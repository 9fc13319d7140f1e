"""snake's planner: profile the machine, then choose micro-batches, alpha and placement.

    profile = measure_profile(GPTConfig(...), micro_batch_size=4, seq_len=128,
                              device="cpu", dtype="float32", offload_dir="/ssd/snake")
    plan = search(profile)            # Plan | Infeasible, never raises for lack of memory

GreedySnake section 4.5 and Algorithm 1; the time model is in `planner/model.py`.
"""

from planner.integrate import apply_plan, plan_for_batch, plan_for_config, plan_for_trainer
from planner.profile import MachineProfile, measure_profile, shape_of
from planner.roofline import roofline
from planner.search import search
from planner.solve import Infeasible, Plan, predict, predict_horizontal, solve

__all__ = [
    "Infeasible",
    "MachineProfile",
    "Plan",
    "apply_plan",
    "measure_profile",
    "plan_for_batch",
    "plan_for_config",
    "plan_for_trainer",
    "predict",
    "predict_horizontal",
    "roofline",
    "search",
    "shape_of",
    "solve",
]
