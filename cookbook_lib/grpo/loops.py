"""``make_loop``: the run's training loop, lockstep or async by its config (``max_steps_off_policy``),
behind the one interface of :class:`~cookbook_lib.grpo.step.TrainingLoop`."""

from __future__ import annotations

from cookbook_lib.grpo.async_loop import AsyncLoop
from cookbook_lib.grpo.lockstep import LockstepLoop
from cookbook_lib.grpo.step import RunContext, StepOutcome, TrainingLoop


def make_loop(context: RunContext, first_group_index: int = 0) -> TrainingLoop:
    """Async GRPO when ``max_steps_off_policy`` is set (its stream of groups resuming at
    ``first_group_index``), else lockstep."""
    if context.config.is_async:
        return AsyncLoop(context, first_group_index)
    return LockstepLoop(context)


__all__ = ["RunContext", "StepOutcome", "TrainingLoop", "make_loop"]
