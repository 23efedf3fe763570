"""The loss of a GRPO step as one object: which loss, at which ratio level, aggregated how, clipped
where, with which KL penalty. ``GRPOConfig`` names these settings (``loss_type``, ...) and
:func:`cookbook_lib.grpo.losses.compute_loss` takes them as one :class:`LossSettings`, so a new
setting is a field here, its field in the config and its use in ``losses.py``.

No torch here: the config imports the names below, and must stay cheap to import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from cookbook_lib.grpo.config import GRPOConfig

LossType = Literal["ppo_clip", "cispo"]
ImportanceRatioLevel = Literal["token", "sequence"]
LossAggregation = Literal["token_mean", "sequence_mean", "fixed_horizon"]
LossNormalizer = Literal["trained_groups", "batch_groups"]


@dataclass(frozen=True)
class LossSettings:
    """The loss a GRPO step minimises (see :func:`cookbook_lib.grpo.losses.compute_loss`)."""

    loss_type: LossType = "ppo_clip"
    importance_ratio_level: ImportanceRatioLevel = "token"
    aggregation: LossAggregation = "token_mean"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    kl_coef: float = 0.0
    horizon: int | None = None  # the fixed horizon of Dr. GRPO's aggregation

    @classmethod
    def from_config(cls, config: GRPOConfig) -> LossSettings:
        return cls(
            loss_type=config.loss_type,
            importance_ratio_level=config.importance_ratio_level,
            aggregation=config.loss_aggregation,
            clip_ratio_low=config.clip_ratio_low,
            clip_ratio_high=config.clip_ratio_high,
            kl_coef=config.kl_coef,
            horizon=config.max_model_length,
        )
