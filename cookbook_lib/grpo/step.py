"""What the two training loops share: the run they step (``RunContext``), what one step returns
(``StepOutcome``), the interface both implement (``TrainingLoop``), and the one timing tail of a
step (``StepTimes``).

``train_multi_turn`` builds a loop with :func:`cookbook_lib.grpo.loops.make_loop` and drives it the
same way whichever it is: ``await loop.step(n)`` for each step, ``await loop.close()`` at the end.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from cookbook_lib.envs.base import Task
from cookbook_lib.grpo.config import GRPOConfig
from cookbook_lib.rollout.episode import Episode
from cookbook_lib.rollout.play import EnvFactory
from cookbook_lib.runtime.timeline import TRAINER_LANE, TRAINING, WAITING, WEIGHT_SYNC, Timeline

if TYPE_CHECKING:
    from cookbook_lib.codecs import Codec
    from cookbook_lib.grpo.trainer import PolicyTrainer
    from cookbook_lib.grpo.weight_sync import GeneratorReplicas


@dataclass
class RunContext:
    """Everything a loop needs from the run: the config, the tasks and their envs, the trainer, the
    generator replicas it samples from, the codec, and the timeline it records on."""

    config: GRPOConfig
    tasks: Sequence[Task]
    env_factory: EnvFactory
    trainer: PolicyTrainer
    replicas: GeneratorReplicas
    codec: Codec
    timeline: Timeline


@dataclass
class StepOutcome:
    """One optimizer step: its metrics (the step log line) and the episodes it sampled."""

    step: int
    metrics: dict[str, float]
    episodes: list[Episode] = field(repr=False)


class TrainingLoop(Protocol):
    """Lockstep or async GRPO, one optimizer step at a time."""

    async def step(self, step: int) -> StepOutcome:
        """Sample (or take) groups, train on them, publish the weights; the step's outcome."""
        ...

    async def close(self) -> None:
        """Stop what is in flight (each episode closes its environment); the replicas stay."""
        ...

    @property
    def groups_started(self) -> int:
        """Where the stream of groups resumes after a checkpoint (0 for lockstep)."""
        ...

    def validation_pause(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Validation runs inside this: async pauses collection with ``sequential_validation``."""
        ...


@contextlib.asynccontextmanager
async def no_pause() -> AsyncIterator[None]:
    """A validation pause that pauses nothing (lockstep samples nothing between steps)."""
    yield


@dataclass
class StepTimes:
    """When a step's phases ended, and the one tail both loops finish a step with."""

    started: float
    sampled_at: float = 0.0
    trained_at: float = 0.0
    synced_at: float = 0.0

    def metrics(self, *, trainer_idle_s: float) -> dict[str, float]:
        """``time/*``: each phase's seconds, and the share of the step the trainer sat idle."""
        step_s = self.synced_at - self.started
        return {
            "time/sampling_s": self.sampled_at - self.started,
            "time/training_s": self.trained_at - self.sampled_at,
            "time/weight_sync_s": self.synced_at - self.trained_at,
            "time/step_s": step_s,
            "time/trainer_idle_fraction": trainer_idle_s / step_s if step_s else 0.0,
        }

    def record(self, timeline: Timeline | None, *, waited: bool) -> None:
        """The trainer's spans: training and weight sync, and the wait for groups when ``waited``
        (an async loop records each of its waits as it goes instead)."""
        if timeline is None:
            return
        if waited:
            timeline.add(TRAINER_LANE, WAITING, self.started, self.sampled_at)
        timeline.add(TRAINER_LANE, TRAINING, self.sampled_at, self.trained_at)
        timeline.add(TRAINER_LANE, WEIGHT_SYNC, self.trained_at, self.synced_at)
