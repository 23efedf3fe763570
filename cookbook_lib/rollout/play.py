"""Playing episodes: one environment against one policy, until an end cause.

A *policy* is any callable ``policy(messages, tool_specs)`` returning the next assistant
``Message`` (or a :class:`PolicyStep`), directly or as an awaitable. Scripted policies return
messages; model policies return a ``PolicyStep`` carrying the sampled tokens, or an end cause
when no message could be produced (the context is full, or the output did not parse).

Who pays for an exception: one raised by the environment ends its episode (``ERROR``, traceback
kept); so does one raised inside the library's own policies (:class:`ContainedPolicy`, e.g.
``ModelPolicy``), as defence in depth against model output nobody foresaw. One raised by a policy
the user wrote is a bug in the caller's code and propagates, as does cancellation.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import ClassVar, Literal, Union

from cookbook_lib.envs.base import Env, StepResult, Task
from cookbook_lib.envs.contract import EnvContractError, reset_problem, step_problem
from cookbook_lib.rollout.episode import EndCause, Episode, EpisodeError, Turn
from cookbook_lib.types import Message, ToolSpec

logger = logging.getLogger(__name__)

OnEnvError = Literal["end_episode", "raise"]
EnvFactory = Callable[[Task], Env]


@dataclass
class PolicyStep:
    """A policy's move. ``end_cause`` set means no valid message: the loop ends the episode.

    ``message`` may still be set with an ``end_cause`` (the raw text of an unparsable reply),
    so the episode record shows what the model wrote; it is never sent to the environment.
    """

    message: Message | None
    end_cause: EndCause | None = None
    turn: Turn | None = None


class ContainedPolicy:
    """Base of the library's own policies: an exception raised inside one ends only its episode.

    ``run_episode`` records it like an environment's failure (``EndCause.ERROR``, the traceback in
    ``Episode.error``; ``on_env_error="raise"`` stops the run instead), so one reply that trips an
    unforeseen bug cannot end a long run. Exceptions in ``propagating_errors`` (the backend shutting
    down, which means the run is ending) and those that are not ``Exception`` (cancellation,
    ``KeyboardInterrupt``) always propagate. User-written policies do not subclass this.
    """

    propagating_errors: ClassVar[tuple[type[Exception], ...]] = ()

    def finish(self) -> None:
        """The episode has ended (``run_episode`` calls this however it ended): let go of what only
        a next turn would have used. Must not raise."""


PolicyOutput = Union[Message, PolicyStep]  # noqa: UP007 - used at runtime in isinstance-free code
Policy = Callable[[list[Message], list[ToolSpec]], Union[PolicyOutput, Awaitable[PolicyOutput]]]  # noqa: UP007


async def _next_step(policy: Policy, messages: list[Message], tool_specs: list[ToolSpec]) -> PolicyStep:
    output = policy(messages, tool_specs)
    if inspect.isawaitable(output):
        output = await output
    if isinstance(output, PolicyStep):
        return output
    if not isinstance(output, dict) or output.get("role") != "assistant":
        raise TypeError(f"a policy must return an assistant Message or a PolicyStep, got {output!r}")
    return PolicyStep(message=output)


async def run_episode(
    env: Env | EnvFactory,
    task: Task,
    policy: Policy,
    *,
    max_turns: int,
    on_env_error: OnEnvError = "end_episode",
    failed_parse_reward: float = 0.0,
) -> Episode:
    """Play one episode of ``env`` (or of ``env(task)`` for a factory) and return its record.

    ``close()`` is called exactly once on every way out. An exception escaping the env's
    ``reset``/``step``/``close`` (or the factory), or a :class:`ContainedPolicy` such as
    ``ModelPolicy``, ends this episode with ``EndCause.ERROR`` and the traceback kept, or, with
    ``on_env_error="raise"``, stops the run as :class:`EpisodeError`. Exceptions from any other
    policy are bugs of the caller's and propagate (after ``close``).
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be at least 1, got {max_turns}")
    if on_env_error not in ("end_episode", "raise"):
        raise ValueError(f"on_env_error must be 'end_episode' or 'raise', got {on_env_error!r}")
    started = time.perf_counter()
    record = Episode(task=task, messages=[], reward=0.0, end_cause=EndCause.ERROR)
    env_instance: Env | None = None
    try:
        try:
            env_instance = env if isinstance(env, Env) else env(task)
            opening = await env_instance.reset(task)
        except Exception as exc:
            _record_error(record, exc, "Env.reset", "the environment failed in reset()", on_env_error)
            return record
        problem = reset_problem(env_instance, opening)
        if problem is not None:
            _record_breach(record, problem, on_env_error)
            return record
        record.messages = list(opening)
        await _play(env_instance, record, policy, max_turns, on_env_error, failed_parse_reward)
        return record
    finally:
        if isinstance(policy, ContainedPolicy):
            policy.finish()
        if env_instance is not None:
            await _close(env_instance, record, on_env_error)
        record.wall_time_s = time.perf_counter() - started


async def _play(
    env: Env,
    record: Episode,
    policy: Policy,
    max_turns: int,
    on_env_error: OnEnvError,
    failed_parse_reward: float,
) -> None:
    while True:
        if record.num_turns >= max_turns:
            record.end_cause = EndCause.MAX_TURNS
            return
        tool_specs = env.tool_specs
        try:
            move = await _next_step(policy, list(record.messages), tool_specs)
        except Exception as exc:
            if not isinstance(policy, ContainedPolicy) or isinstance(exc, policy.propagating_errors):
                raise
            source = type(policy).__name__
            _record_error(record, exc, source, f"the library's {source} failed", on_env_error)
            return
        record.num_turns += 1
        if move.turn is not None:
            record.turns.append(move.turn)
        if move.end_cause is not None:
            if move.message is not None:
                record.messages.append(move.message)
            record.end_cause = move.end_cause
            # The episode ended outside the env: no final step, so no env reward.
            record.reward = failed_parse_reward if move.end_cause is EndCause.PARSE_FAILURE else 0.0
            return
        assert move.message is not None, "a PolicyStep without end_cause must carry a message"
        shown = list(record.messages)
        try:
            result: StepResult = await env.step(move.message)
        except Exception as exc:
            record.messages.append(move.message)
            _record_error(record, exc, "Env.step", "the environment failed in step()", on_env_error)
            return
        problem = step_problem(env, shown, move.message, result)
        if problem is not None:
            record.messages.append(move.message)
            _record_breach(record, problem, on_env_error)
            return
        record.messages = list(result.messages)
        record.metrics = dict(result.metrics)
        if result.terminated or result.truncated:
            record.reward = float(result.reward)
            record.end_cause = EndCause.TERMINATED if result.terminated else EndCause.ENV
            return
        # Only a step that ends the episode sets its reward; an intermediate one is kept in case
        # the loop ends the episode next (MAX_TURNS), as the seed's "last step" rule says.
        record.reward = float(result.reward)


def _record_error(
    record: Episode, exc: BaseException, source: str, failure: str, on_env_error: OnEnvError
) -> None:
    """End the episode as ERROR with ``source``'s traceback, or stop the run with ``failure``."""
    record.end_cause = EndCause.ERROR
    record.reward = 0.0
    record.error = f"{source} raised:\n" + "".join(traceback.format_exception(exc))
    if on_env_error == "raise":
        raise EpisodeError(f"{failure} on task {record.task.prompt!r}") from exc
    logger.warning("episode ended by an error in %s: %r", source, exc)


def _record_breach(record: Episode, problem: str, on_env_error: OnEnvError) -> None:
    """End the episode as ERROR because the env broke its contract (``problem`` says how to fix
    it), or stop the run with it."""
    record.end_cause = EndCause.ERROR
    record.reward = 0.0
    record.error = f"the environment broke the Env contract (cookbook_lib/envs/contract.py): {problem}"
    if on_env_error == "raise":
        raise EpisodeError(problem) from EnvContractError(problem)
    logger.warning("episode ended: %s", problem)


async def _close(env: Env, record: Episode, on_env_error: OnEnvError) -> None:
    try:
        await env.close()
    except Exception as exc:
        note = "Env.close raised:\n" + "".join(traceback.format_exception(exc))
        record.error = f"{record.error}\n{note}" if record.error else note
        logger.warning("Env.close() raised %r; the episode keeps its result", exc)
        if on_env_error == "raise":
            raise EpisodeError("the environment failed in close()") from exc


async def run_group(
    env_factory: EnvFactory,
    task: Task,
    policy_factory: Callable[[], Policy],
    group_size: int,
    *,
    max_turns: int,
    on_env_error: OnEnvError = "end_episode",
    failed_parse_reward: float = 0.0,
    on_episode: Callable[[Episode], None] | None = None,
    episode_slots: asyncio.Semaphore | None = None,
) -> list[Episode]:
    """Play ``group_size`` episodes of one task concurrently, each with a fresh env and policy.

    The episodes share whatever the policies share (a batching generator serves their requests
    together). If one episode raises, the others are cancelled, and so closed, before it propagates.
    ``on_episode`` is called with each episode as it finishes (progress bars count them).
    ``episode_slots``, shared by several groups, bounds how many of their episodes play at once:
    each episode holds a slot from before its env is made until it is closed.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")

    async def play(policy: Policy) -> Episode:
        async with episode_slots or contextlib.nullcontext():
            episode = await run_episode(
                env_factory,
                task,
                policy,
                max_turns=max_turns,
                on_env_error=on_env_error,
                failed_parse_reward=failed_parse_reward,
            )
        if on_episode is not None:
            on_episode(episode)
        return episode

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(play(policy_factory())) for _ in range(group_size)]
    except BaseExceptionGroup as errors:
        # Callers see the episode's own error (an EpisodeError, a policy bug), not a wrapper; the
        # others, if any, are chained under it.
        raise errors.exceptions[0] from errors
    return [t.result() for t in tasks]
