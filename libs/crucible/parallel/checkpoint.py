"""Sharded checkpoints of a parallelized model and its optimizer (torch.distributed.checkpoint, DCP).

Every rank writes its own shards into one directory (a `.distcp` file per rank, plus the coordinator's
`.metadata`) and reads back exactly the shards it holds: a save gathers nothing, and its size per rank
shrinks as the group grows.

Expert weights need one thing DCP cannot see: expert parallelism slices the experts by hand, so the
ranks of an expert group hold different tensors under the same name, which DCP would take for replicas
of one tensor and write once. They are saved under a name per expert rank (`<name>@ep<rank>`), so a
checkpoint resumes on the expert-parallel size it was saved with (a run's config fixes it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from crucible.parallel.expert import expert_weight_owners


def _names(model: nn.Module) -> dict[str, str]:
    """Saved name of every expert-sliced weight (the others keep theirs)."""
    return {name: f"{name}@ep{owner.ep_rank}" for name, owner in expert_weight_owners(model).items()}


def _rename(state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    model = {names.get(k, k): v for k, v in state["model"].items()}
    optim = state["optim"]
    optim = {
        "state": {names.get(k, k): v for k, v in optim["state"].items()},
        "param_groups": [
            {**group, "params": [names.get(p, p) for p in group["params"]]} for group in optim["param_groups"]
        ],
    }
    return {"model": model, "optim": optim}


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path) -> None:
    """Every rank writes its shards of the weights and the optimizer state into `directory` (shared by
    the ranks: one machine's disk, or a volume every node mounts at the same path)."""
    dcp_save(_rename(_state(model, optimizer), _names(model)), checkpoint_id=str(directory))


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path) -> None:
    """Read back what `save_sharded` wrote, each rank its own shards, into the model and the optimizer."""
    names = _names(model)
    state = _rename(_state(model, optimizer), names)
    dcp_load(state, checkpoint_id=str(directory))
    back = {saved: name for name, saved in names.items()}
    state = _rename(state, back)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
