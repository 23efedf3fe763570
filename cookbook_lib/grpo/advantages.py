"""Group-relative advantages: rewards shaped per episode, then compared within their group.

Shape suffix: ``_G`` is one entry per episode of a group (the ``episodes_per_task`` episodes of
one task).

GRPO has no value model: an episode's advantage is its reward minus the mean reward of the other
tries at the same task, optionally divided by the group's standard deviation (GRPO's original
form; Dr. GRPO, arXiv:2503.20783, argues for leaving it out because it up-weights groups that are
nearly all right or all wrong). A group whose rewards are all equal gives every episode advantage
0: it carries no signal and is skipped (and counted, as ``zero_variance_skip_ratio``).

Rewards are shaped before the comparison by the soft overlong penalty (:mod:`.overlong`). The
``failed_parse_reward`` of a ``PARSE_FAILURE`` is *not* applied here: the rollout already set it as
the episode's reward, and applying it again would count it twice.

``ERROR`` episodes (an exception escaped the environment) are left out of their group entirely:
their reward of 0 is not a judgement of the model, so it must not move the baseline the other
episodes are compared with, and they give no samples. Callers count them (see :mod:`.samples`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from cookbook_lib.grpo.overlong import overlong_penalty
from cookbook_lib.rollout.episode import EndCause, Episode


def is_usable(episode: Episode) -> bool:
    """Whether an episode takes part in its group's baseline: every end cause except ``ERROR``."""
    return episode.end_cause is not EndCause.ERROR


def shaped_rewards(
    episodes: Sequence[Episode],
    *,
    max_model_length: int,
    overlong_buffer_tokens: int = 0,
    overlong_penalty_factor: float = 0.0,
) -> list[float]:
    """Each episode's reward plus its soft overlong penalty (0 except for CONTEXT_OVERFLOW, MAX_TURNS).

    One value per episode, in order, ``ERROR`` episodes included (unchanged): leaving them out is
    the caller's decision, made with :func:`is_usable`.
    """
    return [
        float(episode.reward)
        + overlong_penalty(episode, max_model_length, overlong_buffer_tokens, overlong_penalty_factor)
        for episode in episodes
    ]


def is_zero_variance(rewards_G: Sequence[float], tol: float = 1e-6) -> bool:
    """True when the group gives no signal: all rewards equal within ``tol``, or fewer than two.

    A tolerance, not ``==``, because shaped rewards are sums of floats: 1.0 and 1.0000000001 are
    the same outcome, and their tiny difference, divided by a tiny std, would become +-1.
    """
    return len(rewards_G) < 2 or max(rewards_G) - min(rewards_G) <= tol


def group_advantages(rewards_G: Sequence[float], normalize_by_std: bool, eps: float = 1e-6) -> list[float]:
    """Reward minus the group mean, optionally divided by the group's std plus ``eps``.

    The std is the population std (divide by G, not G - 1), so normalised advantages have unit
    variance within the group. TRL and verl use ``torch.std`` (G - 1), which differs by the
    constant factor sqrt((G - 1) / G); Adam's step size is insensitive to such a constant.
    """
    if not rewards_G:
        return []
    mean = sum(rewards_G) / len(rewards_G)
    centred_G = [r - mean for r in rewards_G]
    if not normalize_by_std:
        return centred_G
    std = math.sqrt(sum(c * c for c in centred_G) / len(centred_G))
    return [c / (std + eps) for c in centred_G]


def group_has_signal(
    group: Sequence[Episode],
    *,
    max_model_length: int,
    overlong_buffer_tokens: int = 0,
    overlong_penalty_factor: float = 0.0,
    tol: float = 1e-6,
) -> bool:
    """Whether a group would train: two or more usable episodes whose shaped rewards differ.

    The same rule ``build_samples`` applies; samplers use it to decide whether to draw more groups.
    """
    usable = [episode for episode in group if is_usable(episode)]
    shaped = shaped_rewards(
        usable,
        max_model_length=max_model_length,
        overlong_buffer_tokens=overlong_buffer_tokens,
        overlong_penalty_factor=overlong_penalty_factor,
    )
    return not is_zero_variance(shaped, tol)
