"""Graded trajectories to padded training tensors.

The loss sees one row per trajectory; the model sees one row per context (a trajectory whose episode
summarised and went on in a new context has several, each attending only to itself): `Batch.to_rows`
and `Batch.from_rows` move per-token values between the two layouts."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from crucible.contracts.messages import Trajectory
from crucible.contracts.trajectories import arrays


@dataclass
class Batch:
    tokens_BT: torch.Tensor  # long
    behaviour_logprobs_BT: torch.Tensor  # f32, at the position of the sampled token
    mask_BT: torch.Tensor  # f32, 1 where the policy sampled the token
    valid_BT: torch.Tensor  # f32, 1 at every real token (prompt, environment or sampled), 0 at padding
    constraints_BT: torch.Tensor  # long
    advantages_BT: torch.Tensor  # f32, the trajectory's advantage on every token
    routes_BTLk: torch.Tensor | None  # long, recorded expert choices for router replay
    versions_BT: torch.Tensor  # long
    row_BT: torch.Tensor  # long: the model row (one per context) each token is fed in; padding: row 0
    column_BT: torch.Tensor  # long: its position in that row; padding: past every row's end
    rows: int  # contexts in the batch: B when every trajectory is one context

    def to(self, device: torch.device) -> Batch:
        """The same batch with every tensor on `device` (itself when they already are)."""
        if self.tokens_BT.device == device:
            return self
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)

    @property
    def one_context_each(self) -> bool:
        return self.rows == self.row_BT.shape[0]

    def to_rows(self, x_BT: torch.Tensor, fill: float | torch.Tensor = 0) -> torch.Tensor:
        """[B, T, ...] in the trajectories' layout to [R, T_row, ...], a context per row from position 0,
        padded with `fill` (a scalar, or a tensor of the trailing shape). The identity when every
        trajectory is one context."""
        if self.one_context_each:
            return x_BT
        valid = self.valid_BT > 0
        width = int(self.column_BT[valid].max()) + 1
        out = torch.empty((self.rows, width, *x_BT.shape[2:]), dtype=x_BT.dtype, device=x_BT.device)
        out[...] = fill
        out[self.row_BT[valid], self.column_BT[valid]] = x_BT[valid]
        return out

    def select(self, indices: list[int]) -> Batch:
        """The trajectories at `indices` as a batch of their own, trimmed to the longest of them."""
        if not indices:
            raise ValueError("select needs at least one trajectory")
        take = torch.tensor(indices, device=self.tokens_BT.device)
        valid = self.valid_BT[take] > 0
        width = max(int(valid.sum(-1).max()), 1)
        cut = {
            f.name: getattr(self, f.name)[take, :width]
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        # Renumber the chosen trajectories' contexts 0.. in order; padding: row 0, past every row's end.
        valid = valid[:, :width]
        old_rows, new_rows = torch.unique(cut["row_BT"][valid], return_inverse=True)
        row = torch.zeros_like(cut["row_BT"])
        row[valid] = new_rows
        column = torch.where(valid, cut["column_BT"], torch.full_like(cut["column_BT"], width))
        return replace(self, **{**cut, "row_BT": row, "column_BT": column}, rows=len(old_rows))

    def split(self, max_tokens: int) -> list[Batch]:
        """Micro-batches of whole trajectories, each at most `max_tokens` once padded to its longest (a
        longer trajectory alone), longest first so that similar lengths share one."""
        lengths = (self.valid_BT > 0).sum(-1).tolist()
        order = sorted(range(len(lengths)), key=lambda b: -lengths[b])
        groups: list[list[int]] = []
        for b in order:
            if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
                groups[-1].append(b)
            else:
                groups.append([b])
        return [self.select(sorted(group)) for group in groups]

    def filler(self) -> Batch:
        """The first trajectory with nothing sampled and nothing valid: a forward and backward that count
        nowhere, for a rank that must join its peers' collectives without work of its own."""
        one = self.select([0])
        return replace(one, mask_BT=torch.zeros_like(one.mask_BT), valid_BT=torch.zeros_like(one.valid_BT))

    def from_rows(self, x_RT: torch.Tensor) -> torch.Tensor:
        """[R, T_row] back to the trajectories' layout [B, T] (0 at padding)."""
        if self.one_context_each:
            return x_RT
        valid = self.valid_BT > 0
        out = torch.zeros(self.row_BT.shape, dtype=x_RT.dtype, device=x_RT.device)
        out[valid] = x_RT[self.row_BT[valid], self.column_BT[valid]]
        return out


def collate(trajectories: list[Trajectory], advantages: list[float]) -> Batch:
    """Pad the trajectories into one batch; `advantages` has one value per trajectory (zeros for the
    warm start, whose loss ignores them)."""
    if len(trajectories) != len(advantages) or not trajectories:
        raise ValueError("need one advantage per trajectory and at least one trajectory")
    views = [arrays(t) for t in trajectories]  # lengths checked: ContractError if they differ
    B, T = len(trajectories), max(v.num_tokens for v in views)

    def pad(column: str, dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros(B, T, dtype=dtype)
        numpy_dtype = np.int64 if dtype == torch.long else np.float32
        for b, v in enumerate(views):
            values = getattr(v, column)
            out[b, : len(values)] = torch.from_numpy(values.astype(numpy_dtype))
        return out

    routes = None
    routed = [v.routes for v in views if v.routes is not None]
    if len(routed) == len(views):
        L, k = routed[0].shape[1:]
        # Padding positions get distinct experts 0..k-1: a valid route whose output is masked out anyway
        # and which valid_BT keeps out of the routers' load.
        routes = torch.arange(k, dtype=torch.long).expand(B, T, L, k).clone()
        for b, (v, r) in enumerate(zip(views, routed, strict=True)):
            routes[b, : v.num_tokens] = torch.from_numpy(r.astype(np.int64))
    # Each context is a model row of its own: row r = (trajectory, context), positions from 0.
    row = torch.zeros(B, T, dtype=torch.long)
    column = torch.full((B, T), T, dtype=torch.long)
    rows = 0
    for b, t in enumerate(trajectories):
        bounds = [*(t.context_starts or [0]), views[b].num_tokens]
        for start, end in itertools.pairwise(bounds):
            row[b, start:end] = rows
            column[b, start:end] = torch.arange(end - start)
            rows += 1
    adv = torch.tensor(advantages, dtype=torch.float32)[:, None].expand(B, T).contiguous()
    # Every real token was routed in the rollout and counts in the routers' load; padding does not.
    lengths = torch.tensor([v.num_tokens for v in views])
    valid = (torch.arange(T)[None, :] < lengths[:, None]).float()
    return Batch(
        tokens_BT=pad("tokens", torch.long),
        behaviour_logprobs_BT=pad("logprobs", torch.float32),
        mask_BT=pad("sampled", torch.float32),
        valid_BT=valid,
        constraints_BT=pad("constraints", torch.long),
        advantages_BT=adv,
        routes_BTLk=routes,
        versions_BT=pad("versions", torch.long),
        row_BT=row,
        column_BT=column,
        rows=rows,
    )
