"""Policy-gradient losses on per-token tensors: one small function per variant, one aggregation.

Shape suffixes: ``_B`` is one entry per sequence (a row, one training sample), ``_T`` one per token
position, ``_V`` one per vocabulary entry, ``_N`` one per trained position. Per-token tensors are
``[B, T]``, aligned with :func:`cookbook_lib.grpo.samples.collate`'s ``target_ids`` (shifted there).

Every loss takes ``logprobs_BT`` (current policy, with gradient), ``sampling_logprobs_BT`` (from
the generator: the ratio corrects for the policy having moved since, and for numerics),
``advantages_BT`` and ``mask_BT`` (bool, the trained tokens), and returns ``(loss, metrics)``; an
:class:`Aggregation` makes the scalar, so every loss combines with every aggregation.

Masked positions are replaced by 0 before any arithmetic, so whatever they hold (padding, prompt
tokens, even NaN or inf) changes neither the loss nor the gradient. A NaN or inf at a *trained*
position makes the loss NaN, even where clipping would have hidden it: the trainer checks
``torch.isfinite(loss)`` and skips the step. Log-ratios are clamped to +-20 before ``exp`` (as
verl does), so finite inputs never overflow into an infinite ratio and a NaN gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import torch
from torch import Tensor

from cookbook_lib.grpo.loss_settings import (
    ImportanceRatioLevel,
    LossAggregation,
    LossSettings,
    LossType,
)

Metrics = dict[str, float]
MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: far past any clip range, far from float32 overflow


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values`` where ``mask``; ``torch.where``, not a product, so masked NaN stays out."""
    kept = torch.where(mask, values, torch.zeros_like(values))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` where ``mask`` (0 where nothing is masked in, instead of 0 / 0)."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


@dataclass(frozen=True)
class Aggregation:
    """How per-token losses become the scalar the optimizer sees; call it on ``(values_BT, mask_BT)``.

    * ``token_mean``: sum over every trained token / the number of trained tokens (DAPO). Long
      episodes weigh more, in proportion to their tokens.
    * ``sequence_mean``: mean over each sequence's tokens, then over sequences (GRPO's original).
      Every sequence weighs the same, so a token of a short answer weighs more than one of a long.
    * ``fixed_horizon``: sum over tokens / (sequences * ``horizon``) (Dr. GRPO, with e.g.
      ``max_model_length`` as the horizon): a constant normaliser, so no length bias at all.

    With gradient accumulation, give every micro-batch the *whole step's* ``num_tokens_total`` /
    ``num_sequences_total``: then the micro-batch losses sum exactly to the full batch's loss (and
    their gradients to its gradient). Left ``None``, they are counted in the batch at hand.
    """

    mode: LossAggregation = "token_mean"
    num_tokens_total: float | None = None
    num_sequences_total: float | None = None
    horizon: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in get_args(LossAggregation):
            raise ValueError(f"unknown aggregation {self.mode!r}; choose one of {get_args(LossAggregation)}")
        if self.mode == "fixed_horizon" and (self.horizon is None or self.horizon < 1):
            raise ValueError(f"fixed_horizon aggregation needs a positive horizon, got {self.horizon!r}")
        for name in ("num_tokens_total", "num_sequences_total"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(
                    f"{name} must be positive (the whole step's count), got {getattr(self, name)}"
                )

    def __call__(self, values_BT: Tensor, mask_BT: Tensor) -> Tensor:
        if self.mode == "token_mean":
            tokens = self.num_tokens_total
            return masked_sum(values_BT, mask_BT) / (mask_BT.sum().clamp(min=1) if tokens is None else tokens)
        tokens_B = mask_BT.sum(-1)
        sequences = self.num_sequences_total
        if sequences is None:
            sequences = (tokens_B > 0).sum().clamp(min=1).item()
        if self.mode == "sequence_mean":
            return (masked_sum(values_BT, mask_BT, dim=-1) / tokens_B.clamp(min=1)).sum() / sequences
        assert self.horizon is not None  # checked in __post_init__
        return masked_sum(values_BT, mask_BT) / (sequences * self.horizon)


TOKEN_MEAN = Aggregation()
SEQUENCE_MEAN = Aggregation("sequence_mean")


def log_importance_ratio(
    logprobs_BT: Tensor, sampling_logprobs_BT: Tensor, mask_BT: Tensor, level: ImportanceRatioLevel
) -> Tensor:
    """log(pi / pi_sampling) per token, or GSPO's sequence ratio in its per-token form.

    ``sequence`` (GSPO, arXiv:2507.18071): the ratio is the geometric mean of the sequence's token
    ratios, ``s = exp(mean_t log r_t)``. Written as GSPO-token, ``log s_t = logp_t - sg(logp_t) +
    sg(log s)``: its value is ``log s`` at every token and its gradient flows through ``logp_t``
    with weight ``s``; averaged per sequence (``sequence_mean``) this is exactly GSPO's gradient.
    """
    log_ratio_BT = logprobs_BT - sampling_logprobs_BT
    if level == "token":
        return log_ratio_BT.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if level != "sequence":
        raise ValueError(
            f"unknown importance ratio level {level!r}; choose one of {get_args(ImportanceRatioLevel)}"
        )
    log_seq_ratio_B = masked_mean(log_ratio_BT, mask_BT, dim=-1).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return logprobs_BT - logprobs_BT.detach() + log_seq_ratio_B.detach().unsqueeze(-1)


def ppo_clip_loss(
    logprobs_BT: Tensor,
    sampling_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    level: ImportanceRatioLevel = "token",
    aggregation: Aggregation = TOKEN_MEAN,
) -> tuple[Tensor, Metrics]:
    """PPO's clipped surrogate, ``-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)``.

    Separate bounds because raising only the upper one ("clip-higher", DAPO) lets unlikely tokens
    with positive advantage grow, which keeps entropy from collapsing. Where the clip is active
    (``r > 1 + clip_high`` with ``A > 0``, ``r < 1 - clip_low`` with ``A < 0``) the gradient is 0.
    """
    inputs_BT = (logprobs_BT, sampling_logprobs_BT, advantages_BT)
    logp_BT, old_BT, adv_BT = _zero_masked(mask_BT, *inputs_BT)
    ratio_BT = torch.exp(log_importance_ratio(logp_BT, old_BT, mask_BT, level))
    clipped_BT = ratio_BT.clamp(1 - clip_low, 1 + clip_high)
    loss_BT = -torch.minimum(ratio_BT * adv_BT, clipped_BT * adv_BT)
    low_BT = (ratio_BT < 1 - clip_low) & (adv_BT < 0)
    high_BT = (ratio_BT > 1 + clip_high) & (adv_BT > 0)
    loss = _nan_if_nonfinite(aggregation(loss_BT, mask_BT), mask_BT, *inputs_BT)
    return loss, _ratio_metrics(ratio_BT, low_BT, high_BT, mask_BT)


def gspo_loss(
    logprobs_BT: Tensor,
    sampling_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    aggregation: Aggregation = SEQUENCE_MEAN,
) -> tuple[Tensor, Metrics]:
    """GSPO: the clipped surrogate with one ratio per sequence, averaged per sequence.

    A sequence ratio is a geometric mean of token ratios, so it stays much closer to 1 than a
    token ratio: the paper clips at 3e-4 below and 4e-4 above (vs 0.2 / 0.28 per token).
    """
    inputs_BT = (logprobs_BT, sampling_logprobs_BT, advantages_BT, mask_BT)
    return ppo_clip_loss(
        *inputs_BT, clip_low=clip_low, clip_high=clip_high, level="sequence", aggregation=aggregation
    )


def cispo_loss(
    logprobs_BT: Tensor,
    sampling_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    *,
    clip_low: float = 1.0,
    clip_high: float = 0.28,
    level: ImportanceRatioLevel = "token",
    aggregation: Aggregation = TOKEN_MEAN,
) -> tuple[Tensor, Metrics]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): ``-sg(clip(r, 1 - clip_low, 1 + clip_high)) A logp``.

    REINFORCE weighted by a clipped, detached importance weight: clipping bounds the weight but,
    unlike PPO, never drops a token's gradient, so rare tokens that matter keep being learned.
    MiniMax-M1 sets no lower bound (``clip_low=1.0``: the weight is clipped below at 0). The
    loss *value* is a weighted negative log-likelihood, not comparable with PPO's.
    """
    inputs_BT = (logprobs_BT, sampling_logprobs_BT, advantages_BT)
    logp_BT, old_BT, adv_BT = _zero_masked(mask_BT, *inputs_BT)
    ratio_BT = torch.exp(log_importance_ratio(logp_BT, old_BT, mask_BT, level)).detach()
    weight_BT = ratio_BT.clamp(1 - clip_low, 1 + clip_high)
    loss_BT = -weight_BT * adv_BT * logp_BT
    low_BT, high_BT = ratio_BT < 1 - clip_low, ratio_BT > 1 + clip_high
    loss = _nan_if_nonfinite(aggregation(loss_BT, mask_BT), mask_BT, *inputs_BT)
    return loss, _ratio_metrics(ratio_BT, low_BT, high_BT, mask_BT)


def kl_penalty(
    logprobs_BT: Tensor,
    ref_logprobs_BT: Tensor,
    mask_BT: Tensor,
    *,
    kl_coef: float,
    aggregation: Aggregation = TOKEN_MEAN,
) -> tuple[Tensor, Metrics]:
    """``kl_coef`` times Schulman's k3 estimate of KL(pi || pi_ref), aggregated like the loss.

    k3 = exp(d) - d - 1 with d = logp_ref - logp: unbiased for samples from pi, never negative, and
    of low variance (http://joschu.net/blog/kl-approx.html), which is why GRPO uses it.
    """
    logp_BT, ref_BT = _zero_masked(mask_BT, logprobs_BT, ref_logprobs_BT)
    log_ratio_BT = ref_BT - logp_BT
    k3_BT = torch.exp(log_ratio_BT) - log_ratio_BT - 1
    loss = _nan_if_nonfinite(kl_coef * aggregation(k3_BT, mask_BT), mask_BT, logprobs_BT, ref_logprobs_BT)
    return loss, {"kl": masked_mean(k3_BT, mask_BT).item()}


def token_logprobs(logits_BTV: Tensor, target_ids_BT: Tensor) -> Tensor:
    """log p(target) at each position, from logits already aligned with the targets (no shift here).

    ``gather - logsumexp`` instead of ``log_softmax`` then gather: one ``[B, T, V]`` tensor fewer.
    """
    logits_BTV = logits_BTV.float()
    picked_BT = logits_BTV.gather(-1, target_ids_BT.unsqueeze(-1)).squeeze(-1)
    return picked_BT - torch.logsumexp(logits_BTV, dim=-1)


@torch.no_grad()
def row_entropies(logits_NV: Tensor) -> Tensor:
    """Entropy (nats) of each row's next-token distribution ``[N]``; a metric, never a loss term,
    so it runs under ``no_grad`` and nothing joins the graph."""
    log_probs_NV = torch.log_softmax(logits_NV.float(), dim=-1)
    return -(log_probs_NV.exp() * log_probs_NV).sum(-1)


def entropy_from_logits(logits_BTV: Tensor, mask_BT: Tensor) -> float:
    """Mean entropy (nats) of the policy's next-token distributions at trained positions.

    Only the trained positions' logits are used (``[N, V]``, not ``[B, T, V]``). The trainer
    computes the same per row, a head chunk at a time (``PolicyTrainer._head_logprobs``).
    """
    logits_NV = logits_BTV[mask_BT]
    return row_entropies(logits_NV).mean().item() if logits_NV.numel() else 0.0


def compute_loss(
    logprobs_BT: Tensor,
    sampling_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    settings: LossSettings = LossSettings(),  # noqa: B008 - frozen, so one shared default is safe
    *,
    num_tokens_total: float | None = None,
    num_sequences_total: float | None = None,
    ref_logprobs_BT: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """The loss ``settings`` name (``GRPOConfig.loss_type`` etc., as
    :meth:`LossSettings.from_config` gathers them), plus the KL penalty when ``kl_coef > 0``.

    ``num_tokens_total`` / ``num_sequences_total``: the whole step's counts, for gradient
    accumulation (see :class:`Aggregation`). GSPO is ``ppo_clip`` with
    ``importance_ratio_level="sequence"`` (use its clip ranges, see above).
    """
    if settings.loss_type not in get_args(LossType):
        raise ValueError(f"unknown loss_type {settings.loss_type!r}; choose one of {get_args(LossType)}")
    if settings.kl_coef > 0 and ref_logprobs_BT is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs_BT (the starting model's log-probs)")
    agg = Aggregation(settings.aggregation, num_tokens_total, num_sequences_total, settings.horizon)
    loss_fn = ppo_clip_loss if settings.loss_type == "ppo_clip" else cispo_loss
    inputs_BT = (logprobs_BT, sampling_logprobs_BT, advantages_BT, mask_BT)
    loss, metrics = loss_fn(
        *inputs_BT,
        clip_low=settings.clip_ratio_low,
        clip_high=settings.clip_ratio_high,
        level=settings.importance_ratio_level,
        aggregation=agg,
    )
    metrics["policy_loss"] = loss.item()
    if settings.kl_coef > 0 and ref_logprobs_BT is not None:
        kl_loss, kl_metrics = kl_penalty(
            logprobs_BT, ref_logprobs_BT, mask_BT, kl_coef=settings.kl_coef, aggregation=agg
        )
        loss, metrics = loss + kl_loss, metrics | kl_metrics
    metrics["loss"] = loss.item()
    metrics["num_tokens"] = float(mask_BT.sum().item())
    return loss, metrics


def _zero_masked(mask_BT: Tensor, *tensors_BT: Tensor) -> list[Tensor]:
    # where() routes no gradient to the masked entries, so a NaN there cannot reach the backward.
    return [torch.where(mask_BT, t, torch.zeros_like(t)) for t in tensors_BT]


def _nan_if_nonfinite(loss: Tensor, mask_BT: Tensor, *inputs_BT: Tensor) -> Tensor:
    # A clipped or clamped term can turn an inf input into a finite loss; the trainer must see it.
    bad = torch.stack([(mask_BT & ~torch.isfinite(t)).any() for t in inputs_BT]).any()
    return torch.where(bad, torch.full_like(loss, float("nan")), loss)


def _ratio_metrics(ratio_BT: Tensor, low_BT: Tensor, high_BT: Tensor, mask_BT: Tensor) -> Metrics:
    return {
        "ratio_mean": masked_mean(ratio_BT, mask_BT).item(),
        "clip_frac_low": masked_mean(low_BT.float(), mask_BT).item(),
        "clip_frac_high": masked_mean(high_BT.float(), mask_BT).item(),
        "clip_frac": masked_mean((low_BT | high_BT).float(), mask_BT).item(),
    }
