"""Episode lengths by bucket: the length mix of what a step trained, and of the groups it dropped.

Async training with a bound on policy age has a *length bias*: a group that takes long to play is
the likeliest to be too old when it finishes, so if stale groups are simply dropped, training sees
mostly short episodes (measured in ``docs/benchmarks.md``). These metrics make the bias visible in
every run, lockstep (the reference: it trains every group it samples) and async alike.

Buckets are by **assistant turns**, in powers of two: ``turns_1``, ``turns_2``, ``turns_3-4``,
``turns_5-8``, ``turns_9-16`` ... Turns rather than sampled tokens because in agent tasks a turn's
cost is mostly its tool call and the prefill of the tool's answer, while the tokens sampled per
turn are capped by ``max_tokens_per_turn``; turns decide how long a group takes, hence whether it
goes stale. The token shares are logged beside, as what the loss actually sees. A group's length
is its longest episode's, since a group finishes when its last episode does.

Metrics of one step (``length_metric_names`` lists them):

- ``length/trained_episodes/<bucket>``: share of the step's trained episodes (those of the groups
  that trained) in the bucket; ``length/trained_episodes_total`` their number;
- ``length/trained_tokens/<bucket>``: share of the trained (sampled) tokens;
  ``length/trained_tokens_total`` their number;
- ``length/groups/<bucket>``: groups that came back to the trainer in the step: trained, without
  signal, or dropped as stale;
- ``length/dropped_stale_groups/<bucket>``: of those, the ones dropped as stale (always 0 in
  lockstep). A group cancelled while it was being played is bucketed by the turns it had begun, a
  lower bound of the length it would have had.

Shares are per step; :func:`length_mix_summary` weighs them by the totals to give a whole run's mix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cookbook_lib.envs.base import Env, StepResult, Task
from cookbook_lib.envs.wrappers import EnvWrapper
from cookbook_lib.grpo.samples import TrainingSample
from cookbook_lib.rollout.episode import Episode
from cookbook_lib.types import Message

PREFIX = "length/"
TRAINED_EPISODES = "trained_episodes"
TRAINED_TOKENS = "trained_tokens"
GROUPS = "groups"
DROPPED_STALE_GROUPS = "dropped_stale_groups"


def turn_bucket(turns: int) -> str:
    """``turns_1`` (0 or 1 turn), ``turns_2``, ``turns_3-4``, ``turns_5-8``, ...: powers of two."""
    if turns <= 1:
        return "turns_1"
    upper = 1 << (turns - 1).bit_length()  # the smallest power of two >= turns
    lower = upper // 2 + 1
    return f"turns_{upper}" if lower == upper else f"turns_{lower}-{upper}"


def turn_buckets(max_turns: int) -> list[str]:
    """Every bucket an episode of at most ``max_turns`` turns can fall in, shortest first."""
    return list(dict.fromkeys(turn_bucket(turns) for turns in range(1, max(max_turns, 1) + 1)))


def group_turns(episodes: Sequence[Episode]) -> int:
    """A group's length in turns: its longest episode's (the group finishes with it)."""
    return max((episode.num_turns for episode in episodes), default=0)


def _shares(counts: Mapping[str, float], buckets: Sequence[str]) -> dict[str, float]:
    total = sum(counts.values())
    return {bucket: counts.get(bucket, 0) / total if total else 0.0 for bucket in buckets}


def _count_by_bucket(turns_and_weights: Iterable[tuple[int, float]]) -> dict[str, float]:
    counts: dict[str, float] = {}
    for turns, weight in turns_and_weights:
        bucket = turn_bucket(turns)
        counts[bucket] = counts.get(bucket, 0.0) + weight
    return counts


def trained_length_metrics(
    groups: Sequence[Sequence[Episode]],
    trained_samples: Sequence[TrainingSample],
    trained_group_indices: Iterable[int],
    max_turns: int,
) -> dict[str, float]:
    """The length mix of one step's training batch.

    ``groups`` are every group the step looked at (``length/groups/*`` counts them),
    ``trained_group_indices`` those it trained on, ``trained_samples`` their samples (each token of
    a sample's loss mask is a trained token of the episode ``sample.episode_index`` of group
    ``sample.group_index``).
    """
    buckets = turn_buckets(max_turns)
    trained = sorted(set(trained_group_indices))
    episodes = [episode for index in trained for episode in groups[index]]
    episode_counts = _count_by_bucket((episode.num_turns, 1.0) for episode in episodes)
    token_counts = _count_by_bucket(
        (groups[s.group_index][s.episode_index].num_turns, s.num_loss_tokens) for s in trained_samples
    )
    group_counts = _count_by_bucket((group_turns(group), 1.0) for group in groups)
    metrics = {f"{PREFIX}{TRAINED_EPISODES}/{b}": v for b, v in _shares(episode_counts, buckets).items()}
    metrics[f"{PREFIX}{TRAINED_EPISODES}_total"] = float(len(episodes))
    metrics |= {f"{PREFIX}{TRAINED_TOKENS}/{b}": v for b, v in _shares(token_counts, buckets).items()}
    metrics[f"{PREFIX}{TRAINED_TOKENS}_total"] = float(sum(token_counts.values()))
    metrics |= {f"{PREFIX}{GROUPS}/{b}": group_counts.get(b, 0.0) for b in buckets}
    return metrics


def dropped_length_metrics(dropped_turns: Sequence[int], max_turns: int) -> dict[str, float]:
    """``length/dropped_stale_groups/*``: the groups a step dropped as stale, by their turns."""
    counts = _count_by_bucket((turns, 1.0) for turns in dropped_turns)
    return {f"{PREFIX}{DROPPED_STALE_GROUPS}/{b}": counts.get(b, 0.0) for b in turn_buckets(max_turns)}


def add_dropped_groups(metrics: dict[str, float], dropped_turns: Sequence[int], max_turns: int) -> None:
    """Log the dropped groups' length mix into a step's ``metrics``, counting them in ``length/groups/*``."""
    dropped = dropped_length_metrics(dropped_turns, max_turns)
    metrics |= dropped
    for key, count in dropped.items():
        groups_key = key.replace(f"/{DROPPED_STALE_GROUPS}/", f"/{GROUPS}/")
        metrics[groups_key] = metrics.get(groups_key, 0.0) + count


@dataclass(frozen=True)
class BucketMix:
    """A whole run's figures for one length bucket."""

    bucket: str
    trained_episodes_share: float
    trained_tokens_share: float
    groups: float  # groups that came back to the trainer (trained, without signal, dropped)
    dropped_stale_groups: float

    @property
    def dropped_share(self) -> float:
        """The share of this bucket's groups that were dropped as stale (0 with no group)."""
        return self.dropped_stale_groups / self.groups if self.groups else 0.0


def _bucket_order(bucket: str) -> int:
    return int(bucket.removeprefix("turns_").split("-")[0])


def length_mix_summary(metrics: Iterable[Mapping[str, Any]]) -> list[BucketMix]:
    """A run's length mix from its step records (``metrics.jsonl``), shortest bucket first.

    Each step's shares are weighed by its totals, so the result is the share over every episode
    (or token) the run trained. Steps without the length metrics (step 0, older runs) are skipped.
    """
    episodes: dict[str, float] = {}
    tokens: dict[str, float] = {}
    groups: dict[str, float] = {}
    dropped: dict[str, float] = {}
    for record in metrics:
        episode_total = record.get(f"{PREFIX}{TRAINED_EPISODES}_total") or 0.0
        token_total = record.get(f"{PREFIX}{TRAINED_TOKENS}_total") or 0.0
        for key, value in record.items():
            if not key.startswith(PREFIX) or not isinstance(value, int | float):
                continue
            kind, _, bucket = key.removeprefix(PREFIX).partition("/")
            if not bucket:
                continue
            target, weight = {
                TRAINED_EPISODES: (episodes, episode_total),
                TRAINED_TOKENS: (tokens, token_total),
                GROUPS: (groups, 1.0),
                DROPPED_STALE_GROUPS: (dropped, 1.0),
            }.get(kind, (None, 0.0))
            if target is not None:
                target[bucket] = target.get(bucket, 0.0) + value * weight
    buckets = sorted(set(episodes) | set(tokens) | set(groups) | set(dropped), key=_bucket_order)
    episode_shares, token_shares = _shares(episodes, buckets), _shares(tokens, buckets)
    return [
        BucketMix(
            bucket=bucket,
            trained_episodes_share=episode_shares[bucket],
            trained_tokens_share=token_shares[bucket],
            groups=groups.get(bucket, 0.0),
            dropped_stale_groups=dropped.get(bucket, 0.0),
        )
        for bucket in buckets
    ]


# --- counting the turns of a group while it plays ---------------------------------------------


class TurnCounter:
    """The turns a group has begun so far, so that a group cancelled in flight can be bucketed.

    ``env_factory(factory)`` wraps each env the group builds; every ``step`` call (one per reply
    the model finished) counts. ``turns`` is the longest episode's count plus the turn it was
    sampling or stepping when cancelled, at most ``max_turns``.
    """

    def __init__(self, max_turns: int) -> None:
        self.max_turns = max_turns
        self.steps = 0  # env steps begun by the group's longest episode

    @property
    def turns(self) -> int:
        return min(self.steps + 1, self.max_turns)

    def env_factory(self, factory: Callable[[Task], Env]) -> Callable[[Task], Env]:
        return lambda task: _CountedEnv(factory(task), self)


class _CountedEnv(EnvWrapper):
    """Passes everything through to ``inner``; counts its steps into a :class:`TurnCounter`."""

    def __init__(self, inner: Env, counter: TurnCounter) -> None:
        super().__init__(inner)
        self.counter, self.steps = counter, 0

    async def step(self, message: Message) -> StepResult:
        self.steps += 1
        self.counter.steps = max(self.counter.steps, self.steps)
        return await super().step(message)
