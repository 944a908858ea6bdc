"""Policy-gradient losses, rollout corrections and regularisers, as pure functions over [B, T] tensors.

Tokens were sampled by a behaviour policy (the rollout's weights, possibly versions old); `mask_BT` is 1
where the policy sampled the token. A run chooses (`optim` in the run config):

- `ppo`: PPO's clipped surrogate on r = pi / pi_behaviour, with separate low and high clip ranges
  (DAPO's clip-higher) and a dual clip that bounds the objective of negative advantages.
- `cispo`: MiniMax's CISPO: the clipped ratio is a stop-gradient weight on log pi, so every token keeps
  a gradient (a clipped PPO token gets none).
- `decoupled`: AReaL's decoupled PPO: the clip is against a proximal policy (the trainer's current
  weights, recomputed), and the behaviour policy enters only as an importance weight pi_prox / pi_behaviour,
  shaped by the rollout correction: truncated (`tis`) or masked (`mis`) at token, sequence or geometric-
  mean level. Stale tokens outside the clip range still get a gradient, bounded by that weight.

Per-token objectives are aggregated as a token mean over the batch, a mean of per-sequence token means,
or Dr. GRPO's sum over a constant normaliser. Optional KL to a frozen reference (k1, k2, k3 estimators,
as a loss term or a reward penalty) and an entropy bonus. Log-ratios are clamped to +-LOG_RATIO_CLAMP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from crucible.contracts.runconfig import OptimSection

LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class LossStats:
    loss: torch.Tensor
    metrics: dict[str, float]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    denom = mask.sum()
    if denom == 0:
        return (x * 0).sum()
    return (x * mask).sum() / denom


@dataclass(frozen=True)
class BatchTotals:
    """Counts over a step's whole batch. A rank that holds a slice of the batch aggregates with the whole
    batch's counts, so its loss is its share of the batch's loss: the ranks' shares sum to the loss one
    process would compute on the whole batch, however the batch was cut."""

    tokens: float  # sampled tokens
    sequences: float  # sequences with at least one sampled token
    rows: int  # sequences

    @classmethod
    def of(cls, mask_BT: torch.Tensor) -> BatchTotals:
        return cls(
            tokens=float(mask_BT.sum()),
            sequences=float((mask_BT.sum(-1) > 0).sum()),
            rows=int(mask_BT.shape[0]),
        )


def aggregate(
    x_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    mode: str,
    norm_tokens: int = 1024,
    totals: BatchTotals | None = None,
) -> torch.Tensor:
    """Reduce per-token values to a scalar: `token_mean` (every sampled token of the batch weighs the
    same), `seq_mean_token_mean` (every sequence weighs the same), `seq_sum_norm` (Dr. GRPO: the sum
    over sampled tokens divided by sequences x `norm_tokens`, so no length normalisation). `totals`:
    the whole batch's counts when x_BT is a slice of it (default: x_BT is the whole batch)."""
    mask_BT = mask_BT.to(x_BT.dtype)
    totals = totals or BatchTotals.of(mask_BT)
    zero = (x_BT * 0).sum()
    if mode == "token_mean":
        return (x_BT * mask_BT).sum() / totals.tokens if totals.tokens else zero
    if mode == "seq_mean_token_mean":
        per_seq = (x_BT * mask_BT).sum(-1) / mask_BT.sum(-1).clamp(min=1)
        has = mask_BT.sum(-1) > 0
        return per_seq[has].sum() / totals.sequences if totals.sequences else zero
    if mode == "seq_sum_norm":
        return (x_BT * mask_BT).sum() / (totals.rows * norm_tokens)
    raise ValueError(f"unknown aggregation {mode!r}")


def ppo_objective(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> torch.Tensor:
    """min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), and for A < 0 at least dual_clip * A."""
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    objective = torch.minimum(ratio * advantages, clipped)
    if dual_clip is not None:
        objective = torch.where(advantages < 0, torch.maximum(objective, dual_clip * advantages), objective)
    return objective


def cispo_objective(
    logprobs: torch.Tensor,
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> torch.Tensor:
    """sg(clip(r, 1 - clip_low, 1 + clip_high)) A log pi: the gradient is the clipped weight times A."""
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high).detach()
    return weight * advantages * logprobs


def correction_weights(
    log_ratio_BT: torch.Tensor, mask_BT: torch.Tensor, *, mode: str, level: str, cap: float
) -> torch.Tensor:
    """Importance weights pi_prox / pi_behaviour (detached) from per-token log-ratios.

    level: `token` (each token its own ratio), `sequence` (the product over the sequence's sampled
    tokens), `geometric` (their geometric mean). mode: `none` (the raw weight), `tis` (truncated at
    `cap`), `mis` (kept where it lies in [1 / cap, cap], else 0: the token or sequence is masked)."""
    log_ratio_BT = (log_ratio_BT * mask_BT).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if level == "token":
        level_log = log_ratio_BT
    elif level in ("sequence", "geometric"):
        per_seq = log_ratio_BT.sum(-1, keepdim=True)
        if level == "geometric":
            per_seq = per_seq / mask_BT.sum(-1, keepdim=True).clamp(min=1)
        level_log = per_seq.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).expand_as(log_ratio_BT)
    else:
        raise ValueError(f"unknown correction level {level!r}")
    weight = torch.exp(level_log)
    if mode == "none":
        return weight
    if mode == "tis":
        return weight.clamp(max=cap)
    if mode == "mis":
        return torch.where((weight <= cap) & (weight >= 1.0 / cap), weight, torch.zeros_like(weight))
    raise ValueError(f"unknown correction {mode!r}")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, *, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled by pi (Schulman's k1, k2, k3), with
    log r = log pi_ref - log pi: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r."""
    log_r = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return torch.exp(log_r) - 1.0 - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}")


def policy_loss(
    *,
    logprobs_BT: torch.Tensor,
    behaviour_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    optim: OptimSection,
    proximal_logprobs_BT: torch.Tensor | None = None,
    ref_logprobs_BT: torch.Tensor | None = None,
    entropy_BT: torch.Tensor | None = None,
    totals: BatchTotals | None = None,
) -> LossStats:
    """The run's loss and its metrics. logprobs_BT carries the gradient; the proximal policy defaults to
    the current weights (logprobs_BT detached); ref_logprobs_BT is needed when optim.kl_coef > 0 and
    entropy_BT when optim.entropy_coef > 0. With `totals` (the whole batch's counts) the tensors are a
    slice of the batch and the loss is the slice's share; the metrics are the slice's."""
    shapes = {t.shape for t in (logprobs_BT, behaviour_logprobs_BT, advantages_BT, mask_BT)}
    if len(shapes) != 1 or logprobs_BT.ndim != 2:
        raise ValueError(
            f"logprobs, behaviour logprobs, advantages and mask must share one [B, T] shape: {shapes}"
        )
    mask = mask_BT.to(logprobs_BT.dtype)
    behaviour = behaviour_logprobs_BT.detach()
    kl_ref = None
    if optim.kl_coef > 0:
        if ref_logprobs_BT is None:
            raise ValueError("kl_coef > 0 needs the reference policy's logprobs")
        kl_ref = kl_estimate(logprobs_BT, ref_logprobs_BT.detach(), estimator=optim.kl_estimator)
        if optim.kl_mode == "reward":
            advantages_BT = advantages_BT - optim.kl_coef * kl_ref.detach()
    advantages_BT = advantages_BT.detach()
    weight = torch.ones_like(mask)
    if optim.loss == "decoupled":
        proximal = (logprobs_BT if proximal_logprobs_BT is None else proximal_logprobs_BT).detach()
        base = proximal
        weight = correction_weights(
            proximal - behaviour,
            mask,
            mode=optim.correction,
            level=optim.correction_level,
            cap=optim.correction_cap,
        )
    else:
        base = behaviour
    log_ratio = (logprobs_BT - base).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    clip = {"clip_low": optim.clip_low, "clip_high": optim.clip_high}
    if optim.loss == "cispo":
        objective = cispo_objective(logprobs_BT, ratio, advantages_BT, **clip)
    else:
        objective = weight * ppo_objective(ratio, advantages_BT, **clip, dual_clip=optim.dual_clip)
    reduce = {"mode": optim.aggregation, "norm_tokens": optim.norm_tokens, "totals": totals}
    loss = -aggregate(objective, mask, **reduce)
    if kl_ref is not None and optim.kl_mode == "loss":
        loss = loss + optim.kl_coef * aggregate(kl_ref, mask, **reduce)
    if optim.entropy_coef > 0:
        if entropy_BT is None:
            raise ValueError("entropy_coef > 0 needs the policy's entropy per token")
        loss = loss - optim.entropy_coef * aggregate(entropy_BT, mask, **reduce)
    return LossStats(
        loss=loss,
        metrics=_metrics(
            ratio=ratio, log_ratio=(logprobs_BT - behaviour), advantages=advantages_BT, mask=mask,
            weight=weight, optim=optim, kl_ref=kl_ref, entropy=entropy_BT,
        ),
    )  # fmt: skip


@torch.no_grad()
def _metrics(
    *,
    ratio: torch.Tensor,
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weight: torch.Tensor,
    optim: OptimSection,
    kl_ref: torch.Tensor | None,
    entropy: torch.Tensor | None,
) -> dict[str, float]:
    selected = mask > 0
    n = int(selected.sum())
    out = {"tokens": float(n)}
    if n == 0:
        return out | {"clip_low_fraction": 0.0, "clip_high_fraction": 0.0, "ratio_max": 1.0}
    r = ratio[selected]
    a = advantages[selected]
    behaviour_ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))[selected]
    q = torch.quantile(r.float(), torch.tensor([0.05, 0.5, 0.95]))
    out |= {
        "clip_low_fraction": float(((r < 1.0 - optim.clip_low) & (a < 0)).sum()) / n,
        "clip_high_fraction": float(((r > 1.0 + optim.clip_high) & (a > 0)).sum()) / n,
        "ratio_p05": float(q[0]),
        "ratio_p50": float(q[1]),
        "ratio_p95": float(q[2]),
        "ratio_max": float(r.max()),
        # k3 estimate of KL(pi_behaviour || pi) from the behaviour's own samples
        "kl_behaviour": float(((behaviour_ratio - 1) - log_ratio[selected]).mean()),
    }
    if optim.loss == "decoupled":
        w = weight[selected]
        out |= {
            "correction_weight_mean": float(w.mean()),
            "correction_masked_fraction": float((w == 0).sum()) / n,
        }
    if kl_ref is not None:
        out["kl_reference"] = float(kl_ref[selected].mean())
    if entropy is not None:
        out["entropy"] = float(entropy[selected].mean())
    return out
