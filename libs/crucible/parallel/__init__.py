"""Parallel training of the policy: meshes, expert parallelism, HSDP, sharded checkpoints, worker groups
(local or Ray)."""

from crucible.parallel.checkpoint import load_sharded, save_sharded
from crucible.parallel.data import apply_fsdp, full_grads, full_state_dict, load_full_state_dict
from crucible.parallel.expert import ExpertParallelMoE, apply_expert_parallel
from crucible.parallel.launch import WorkerGroup, WorkerGroupError, run_local, run_ray, start_workers
from crucible.parallel.mesh import ParallelConfig, ParallelMesh, build_mesh
from crucible.parallel.train import all_reduce_router_loads, clip_grad_norm_, parallelize

__all__ = [
    "ExpertParallelMoE",
    "ParallelConfig",
    "ParallelMesh",
    "WorkerGroup",
    "WorkerGroupError",
    "all_reduce_router_loads",
    "apply_expert_parallel",
    "apply_fsdp",
    "build_mesh",
    "clip_grad_norm_",
    "full_grads",
    "full_state_dict",
    "load_full_state_dict",
    "load_sharded",
    "parallelize",
    "run_local",
    "run_ray",
    "save_sharded",
    "start_workers",
]
