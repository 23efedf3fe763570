"""run_episode: every way an episode ends, close() exactly once on each, and environment errors."""

from __future__ import annotations

import asyncio

import pytest

from cookbook_lib.envs import Env, StepResult, Task
from cookbook_lib.rollout.episode import EndCause, Episode, EpisodeError
from cookbook_lib.rollout.evaluate import evaluate_policy
from cookbook_lib.rollout.play import ContainedPolicy, PolicyStep, run_episode
from cookbook_lib.types import Message, ToolSpec

TASK = Task(prompt="count to three", target="3", metadata={"id": 7})


class ScriptedEnv(Env):
    """An env whose behaviour each test chooses: when it terminates/truncates, and where it fails."""

    def __init__(
        self,
        terminate_on: str | None = "done",
        truncate_after: int | None = None,
        fail_in: str | None = None,
        step_reward: float = 0.25,
    ) -> None:
        self.terminate_on = terminate_on
        self.truncate_after = truncate_after
        self.fail_in = fail_in
        self.step_reward = step_reward
        self.closed = 0
        self.steps = 0
        self._messages: list[Message] = []

    async def reset(self, task: Task) -> list[Message]:
        if self.fail_in == "reset":
            raise RuntimeError("reset exploded")
        self._messages = [Message(role="user", content=task.prompt)]
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        self.steps += 1
        if self.fail_in == "step":
            raise KeyError("step exploded")
        self._messages.append(message)
        self._messages.append(Message(role="user", content=f"ack {self.steps}"))
        done = message["content"] == self.terminate_on
        truncated = self.truncate_after is not None and self.steps >= self.truncate_after
        reward = 1.0 if done else self.step_reward
        return StepResult(
            terminated=done,
            truncated=truncated,
            messages=list(self._messages),
            reward=reward,
            metrics={"steps": float(self.steps)},
        )

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return []

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)

    async def close(self) -> None:
        self.closed += 1
        if self.fail_in == "close":
            raise OSError("close exploded")


def say(*contents: str):
    replies = iter(contents)

    def policy(messages: list[Message], tool_specs: list[ToolSpec]) -> Message:
        return Message(role="assistant", content=next(replies))

    return policy


def play(env: Env, policy, **kwargs) -> Episode:
    kwargs.setdefault("max_turns", 5)
    return asyncio.run(run_episode(env, TASK, policy, **kwargs))


def test_terminated_takes_the_final_step_reward_and_metrics():
    env = ScriptedEnv()
    episode = play(env, say("one", "two", "done"))
    assert episode.end_cause is EndCause.TERMINATED and episode.terminated and not episode.truncated
    assert episode.reward == 1.0
    assert episode.metrics == {"steps": 3.0}
    assert episode.num_turns == 3
    assert [m["content"] for m in episode.messages][-2:] == ["done", "ack 3"]
    assert episode.error is None and env.closed == 1


def test_max_turns_truncates_with_the_last_step_reward():
    env = ScriptedEnv(terminate_on=None)
    episode = play(env, say("a", "b"), max_turns=2)
    assert episode.end_cause is EndCause.MAX_TURNS and episode.truncated
    assert episode.reward == 0.25 and episode.num_turns == 2
    assert env.closed == 1


def test_env_truncation_is_cause_env():
    env = ScriptedEnv(terminate_on=None, truncate_after=1, step_reward=0.5)
    episode = play(env, say("a"))
    assert episode.end_cause is EndCause.ENV and episode.reward == 0.5
    assert env.closed == 1


def test_terminated_wins_over_truncated_on_the_same_step():
    env = ScriptedEnv(truncate_after=1)
    assert play(env, say("done")).end_cause is EndCause.TERMINATED


@pytest.mark.parametrize("cause", [EndCause.PARSE_FAILURE, EndCause.CONTEXT_OVERFLOW])
def test_model_side_end_causes_end_without_an_env_step(cause):
    env = ScriptedEnv()
    raw = Message(role="assistant", content="<tool_call>{oops")

    def policy(messages, tool_specs):
        return PolicyStep(message=raw if cause is EndCause.PARSE_FAILURE else None, end_cause=cause)

    episode = play(env, policy, failed_parse_reward=-0.5)
    assert episode.end_cause is cause and episode.truncated
    assert env.steps == 0 and env.closed == 1
    expected_reward = -0.5 if cause is EndCause.PARSE_FAILURE else 0.0
    assert episode.reward == expected_reward
    # The unparsable text stays visible in the record, never reaching the env.
    assert (episode.messages[-1] is raw) == (cause is EndCause.PARSE_FAILURE)


def test_async_policies_work():
    async def policy(messages, tool_specs):
        await asyncio.sleep(0)
        return Message(role="assistant", content="done")

    assert play(ScriptedEnv(), policy).end_cause is EndCause.TERMINATED


@pytest.mark.parametrize("where", ["reset", "step"])
def test_env_exceptions_end_the_episode_with_the_traceback(where):
    env = ScriptedEnv(fail_in=where)
    episode = play(env, say("done"))
    assert episode.end_cause is EndCause.ERROR and not episode.truncated
    assert episode.reward == 0.0
    assert f"Env.{where} raised" in episode.error and "Traceback" in episode.error
    assert "exploded" in episode.error
    assert env.closed == 1


@pytest.mark.parametrize("where", ["reset", "step"])
def test_env_exceptions_stop_the_run_when_asked(where):
    env = ScriptedEnv(fail_in=where)
    with pytest.raises(EpisodeError, match=where) as info:
        play(env, say("done"), on_env_error="raise")
    assert "exploded" in str(info.value.__cause__)
    assert env.closed == 1


def test_a_failing_close_keeps_the_result_and_records_the_error():
    env = ScriptedEnv(fail_in="close")
    episode = play(env, say("done"))
    assert episode.end_cause is EndCause.TERMINATED and episode.reward == 1.0
    assert "Env.close raised" in episode.error and env.closed == 1


def test_a_failing_factory_ends_the_episode():
    def factory(task: Task) -> Env:
        raise ValueError("no env for you")

    episode = play(factory, say("done"))
    assert episode.end_cause is EndCause.ERROR and "no env for you" in episode.error


def test_a_factory_gets_the_task():
    seen: list[Task] = []
    env = ScriptedEnv()

    def factory(task: Task) -> Env:
        seen.append(task)
        return env

    play(factory, say("done"))
    assert seen == [TASK] and env.closed == 1


def test_policy_errors_propagate_after_close():
    env = ScriptedEnv()

    def policy(messages, tool_specs):
        raise ZeroDivisionError("policy bug")

    with pytest.raises(ZeroDivisionError):
        play(env, policy)
    assert env.closed == 1


class LibraryPolicy(ContainedPolicy):
    """A library-side policy that fails: ValueError ends the episode, KeyError stops the run."""

    propagating_errors = (KeyError,)

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __call__(self, messages, tool_specs):
        raise self.error


def test_a_library_policy_failure_ends_only_its_episode():
    env = ScriptedEnv()
    episode = play(env, LibraryPolicy(ValueError("library bug")))
    assert episode.end_cause is EndCause.ERROR and episode.reward == 0.0
    assert episode.error.startswith("LibraryPolicy raised:\n") and "library bug" in episode.error
    assert env.closed == 1
    with pytest.raises(EpisodeError, match="LibraryPolicy failed"):
        play(ScriptedEnv(), LibraryPolicy(ValueError("library bug")), on_env_error="raise")
    with pytest.raises(KeyError):
        play(ScriptedEnv(), LibraryPolicy(KeyError("shutting down")))


def test_a_policy_returning_garbage_is_a_clear_type_error():
    env = ScriptedEnv()
    with pytest.raises(TypeError, match="assistant Message or a PolicyStep"):
        play(env, lambda messages, specs: "just a string")
    assert env.closed == 1


def test_cancellation_closes_the_env_once():
    env = ScriptedEnv()
    started = asyncio.Event()

    async def slow_policy(messages, tool_specs):
        started.set()
        await asyncio.sleep(30)
        return Message(role="assistant", content="done")

    async def main() -> None:
        task = asyncio.create_task(run_episode(env, TASK, slow_policy, max_turns=3))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert env.closed == 1


def test_bad_settings_are_refused_before_anything_runs():
    env = ScriptedEnv()
    with pytest.raises(ValueError, match="max_turns"):
        play(env, say("done"), max_turns=0)
    with pytest.raises(ValueError, match="on_env_error"):
        play(env, say("done"), on_env_error="ignore")
    assert env.closed == 0


def test_episode_round_trips_through_a_dict():
    episode = play(ScriptedEnv(), say("x", "done"))
    record = episode.to_dict()
    assert record["end_cause"] == "TERMINATED"
    assert Episode.from_dict(record) == episode
    assert "tokens_T" not in episode.to_dict(include_tokens=False)


@pytest.mark.parametrize("bound", [None, 1, 3, 100])
def test_evaluation_bounds_the_episodes_alive_at_once_and_starts_the_rest_in_task_order(bound):
    tasks = [Task(prompt=f"task {i}", target=None, metadata={"id": i}) for i in range(5)]
    alive, most, made = set(), 0, []

    class CountedEnv(ScriptedEnv):
        async def reset(self, task: Task) -> list[Message]:
            nonlocal most
            alive.add(id(self))
            most = max(most, len(alive))
            made.append(task.metadata["id"])
            return await super().reset(task)

        async def close(self) -> None:
            alive.discard(id(self))

    async def slow_then_done(messages, tool_specs):
        await asyncio.sleep(0)  # every live episode gets to start before any ends
        return Message(role="assistant", content="x" if len(messages) < 3 else "done")

    report = evaluate_policy(
        lambda: slow_then_done, tasks, lambda task: CountedEnv(), episodes_per_task=2, max_turns=3,
        max_episodes_in_flight=bound,
    )  # fmt: skip
    assert report.num_episodes == 10 and report.mean_reward == 1.0 and not alive
    assert most == min(bound or 10, 10)
    assert made == sorted(made)  # queued episodes start in task order


def test_an_evaluation_bound_below_one_is_refused_before_any_episode():
    made = []
    with pytest.raises(ValueError, match="max_episodes_in_flight must be at least 1"):
        evaluate_policy(
            lambda: say("done"), [TASK], lambda task: made.append(task) or ScriptedEnv(), max_turns=2,
            max_episodes_in_flight=0,
        )  # fmt: skip
    assert made == []
