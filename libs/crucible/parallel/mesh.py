"""Device meshes for the policy: data parallelism (replicate x shard) and expert parallelism.

Every rank is a data-parallel rank with its own slice of the batch; `replicate * shard` is the world.
Dense parameters are sharded over `shard` and replicated over `replicate` (HSDP). Expert parallelism
borrows ranks from data parallelism: the world is cut into groups of `expert` consecutive ranks, each
group holds all experts once (rank i of a group owns experts [i*E/ep, (i+1)*E/ep)), and tokens move
inside a group with all-to-all. Ranks with the same position in their groups hold the same experts;
they form the experts' own data-parallel mesh (`expert_replicate` x `expert_shard`), which FSDP shards
like the dense mesh when the expert group fits inside a shard group and replicates otherwise.

Both meshes are row-major over the same ranks: rank = replicate_index * shard + shard_index, and
rank = (expert_replicate_index * expert_shard + expert_shard_index) * expert + expert_index. So an
expert group lies inside one shard group whenever `expert` divides `shard`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DENSE_DIMS = ("replicate", "shard")
EXPERT_DIMS = ("expert_replicate", "expert_shard", "expert")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Sizes of the mesh dimensions; `replicate * shard` must equal the world size and `expert` divide it."""

    replicate: int = 1
    shard: int = 1
    expert: int = 1

    def __post_init__(self) -> None:
        for name in ("replicate", "shard", "expert"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelConfig.{name} must be a positive int, got {value!r}")
        if self.world_size % self.expert:
            raise ValueError(
                f"expert={self.expert} must divide the world size replicate*shard={self.world_size}: "
                "expert groups are cut out of the data-parallel ranks"
            )

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard

    @property
    def expert_shard(self) -> int:
        """FSDP shard size of the experts: what is left of a shard group once the expert group is cut out."""
        return self.shard // self.expert if self.shard % self.expert == 0 else 1

    @property
    def expert_replicate(self) -> int:
        return self.world_size // self.expert // self.expert_shard

    def check_experts(self, num_experts: int) -> None:
        if num_experts % self.expert:
            raise ValueError(f"num_experts={num_experts} is not divisible by expert={self.expert}")


@dataclass(frozen=True)
class ParallelMesh:
    """The meshes one training job uses; build it with `build_mesh` on every rank."""

    config: ParallelConfig
    dense: DeviceMesh  # (replicate, shard): FSDP2 HSDP of dense parameters
    experts: DeviceMesh  # (expert_replicate, expert_shard, expert)

    @property
    def expert_data(self) -> DeviceMesh:
        """(expert_replicate, expert_shard): HSDP of this rank's experts among the ranks holding the same
        ones."""
        return self.experts["expert_replicate", "expert_shard"]

    @property
    def expert_group(self) -> dist.ProcessGroup:
        """The ranks that exchange tokens in all-to-all; together they hold every expert once."""
        return self.experts.get_group("expert")

    @property
    def expert_rank(self) -> int:
        return self.experts.get_local_rank("expert")

    @property
    def device_type(self) -> str:
        return self.dense.device_type


def build_mesh(config: ParallelConfig, *, device_type: str = "cpu") -> ParallelMesh:
    """Create the dense and expert meshes (their process groups) inside an initialized process group."""
    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs an initialized process group (see crucible.parallel.launch)")
    world = dist.get_world_size()
    if world != config.world_size:
        raise ValueError(
            f"replicate*shard = {config.replicate}*{config.shard} = {config.world_size}, "
            f"but the process group has {world} ranks"
        )
    dense = init_device_mesh(device_type, (config.replicate, config.shard), mesh_dim_names=DENSE_DIMS)
    experts = init_device_mesh(
        device_type, (config.expert_replicate, config.expert_shard, config.expert), mesh_dim_names=EXPERT_DIMS
    )
    return ParallelMesh(config=config, dense=dense, experts=experts)
