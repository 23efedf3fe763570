"""The Env contract, enforced: an env that breaks it ends its episode as ERROR with a message that
names the env, the member and the fix; tasks that could not be recorded are refused before any
model loads; one bad record never loses the others; ToolEnv can end an episode as a truncation.
Each test is a friction point a user hit wrapping an outside environment."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

from cookbook_lib.envs import Env, StepResult, Task, ToolEnv, ToolResult
from cookbook_lib.generators import SamplingParams
from cookbook_lib.grpo.config import GRPOConfig
from cookbook_lib.grpo.train import train_multi_turn
from cookbook_lib.rollout.episode import EndCause, EpisodeError
from cookbook_lib.rollout.evaluate import evaluate
from cookbook_lib.rollout.play import run_episode
from cookbook_lib.rollout.records import read_episodes, write_episodes
from cookbook_lib.types import Message, ToolSpec, make_tool_call
from envs.math_env import MathEnv
from envs.tool_use_game import ToolUseGameEnv, load_tool_use_game_tasks, make_tool_use_game_expert

TASK = Task(prompt="What is 2 + 2?", target=4)
ANSWER = Message(role="assistant", content="4")


class GymStyleEnv(Env):
    """Returns only the new messages, gym-style: the first friction point."""

    def __init__(self, mode: str = "new only") -> None:
        self.mode = mode
        self._messages: list[Message] = []

    async def reset(self, task: Task) -> list[Message]:
        self._messages = [Message(role="user", content=task.prompt)]
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        reply = Message(role="user", content="Try again.")
        if self.mode == "new only":
            return StepResult(terminated=False, truncated=False, messages=[reply])
        if self.mode == "no assistant":
            return StepResult(terminated=False, truncated=False, messages=[*self._messages, reply])
        if self.mode == "rewritten":
            return StepResult(
                terminated=True, truncated=False, messages=[Message(role="user", content="other"), message]
            )
        if self.mode == "nan reward":
            return StepResult(
                terminated=True, truncated=False, messages=[*self._messages, message], reward=math.nan
            )
        if self.mode == "bad metrics":
            return StepResult(
                terminated=True, truncated=False, messages=[*self._messages, message], metrics={"x": "high"}
            )
        raise AssertionError(self.mode)

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return []

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)


def play(env: Env, policy=lambda messages, specs: ANSWER, **kwargs):
    return asyncio.run(run_episode(lambda task: env, TASK, policy, max_turns=3, **kwargs))


@pytest.mark.parametrize(
    ("mode", "complaint"),
    [
        ("new only", "GymStyleEnv.step returned 1 message, fewer than the 2 of the conversation so far"),
        (
            "no assistant",
            "GymStyleEnv.step returned messages[1] = a user message where the assistant message",
        ),
        ("rewritten", "GymStyleEnv.step changed messages[0]"),
        ("nan reward", "GymStyleEnv.step returned reward=nan; return a finite number (any range"),
        ("bad metrics", "GymStyleEnv.step returned metrics={'x': 'high'}"),
    ],
)
def test_a_step_that_breaks_the_contract_ends_the_episode_naming_the_env_and_the_fix(mode, complaint):
    episode = play(GymStyleEnv(mode))
    assert episode.end_cause is EndCause.ERROR
    assert complaint in episode.error
    # The library is not blamed: nothing about ModelPolicy or a history that ends with a user message.
    assert "ModelPolicy" not in episode.error and "history must end" not in episode.error
    if mode == "new only":
        assert "as `list(self._messages)`" in episode.error


def test_the_breach_stops_the_run_when_asked():
    with pytest.raises(EpisodeError, match=r"GymStyleEnv\.step returned 1 message"):
        play(GymStyleEnv("new only"), on_env_error="raise")


class BadResetEnv(GymStyleEnv):
    async def reset(self, task: Task):  # type: ignore[override]
        return task.prompt  # a string, not the conversation


def test_a_reset_that_breaks_the_contract_is_named_too():
    episode = play(BadResetEnv())
    assert episode.end_cause is EndCause.ERROR
    assert "BadResetEnv.reset returned str; return the opening messages as a list" in episode.error


def test_the_repositorys_envs_keep_the_contract():
    task = load_tool_use_game_tasks("val")[0]
    game = asyncio.run(
        run_episode(lambda t: ToolUseGameEnv(), task, make_tool_use_game_expert(task), max_turns=8)
    )
    assert (game.end_cause, game.reward) == (EndCause.TERMINATED, 1.0)
    calculator = make_tool_call("c0", "calculator", {"expression": "2 + 2"})
    moves = iter([Message(role="assistant", content="", tool_calls=[calculator]), ANSWER])
    math_episode = asyncio.run(run_episode(lambda t: MathEnv(), TASK, lambda m, s: next(moves), max_turns=3))
    assert (math_episode.end_cause, math_episode.reward) == (EndCause.TERMINATED, 1.0)


# --- task data: refused before a model loads, or recorded in the documented fallback form ---


def test_tasks_that_cannot_be_recorded_are_refused_before_any_model_loads(monkeypatch, tmp_path):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the tasks were checked")

    monkeypatch.setattr("cookbook_lib.rollout.evaluate.load_model", no_loading)
    monkeypatch.setattr("cookbook_lib.grpo.train.load_model", no_loading)
    bad = [TASK, Task(prompt="q", metadata={"keys": ["a"], "tool": object()})]
    with pytest.raises(ValueError, match=r"tasks\[1\]\.metadata\['tool'\] holds a object"):
        evaluate(None, bad, lambda task: MathEnv(), runs_dir=str(tmp_path))
    config = GRPOConfig(runs_dir=str(tmp_path), run_name="refused")
    with pytest.raises(ValueError, match=r"val_tasks\[1\]\.metadata\['tool'\]"):
        train_multi_turn(config, tasks=[TASK], env_factory=lambda task: MathEnv(), val_tasks=bad)


def test_sets_numpy_scalars_and_tuples_are_recorded_as_json(tmp_path):
    """What reasoning-gym and numpy-based envs put in metadata: converted, not refused."""
    task = Task(
        prompt="q", target=np.int64(7), metadata={"keys": {"b", "a"}, "size": np.float32(0.5), "span": (1, 2)}
    )
    episode = asyncio.run(run_episode(lambda t: MathEnv(), task, lambda m, s: ANSWER, max_turns=1))
    path = write_episodes([episode], tmp_path / "episodes.jsonl")
    record = json.loads(path.read_text())
    assert record["task"]["target"] == 7
    assert record["task"]["metadata"] == {"keys": ["a", "b"], "size": 0.5, "span": [1, 2]}


def test_one_record_that_cannot_be_written_loses_no_other(tmp_path, caplog):
    good = asyncio.run(run_episode(lambda t: MathEnv(), TASK, lambda m, s: ANSWER, max_turns=1))
    bad = asyncio.run(run_episode(lambda t: MathEnv(), TASK, lambda m, s: ANSWER, max_turns=1))
    bad.metrics["weird"] = object()  # type: ignore[assignment] - what an env's own object might be
    path = write_episodes([good, bad, good], tmp_path / "episodes.jsonl")
    episodes = read_episodes(path)
    assert len(episodes) == 3 and episodes[0].reward == episodes[2].reward == 1.0
    assert episodes[1].metrics["weird"].startswith("<object object")
    assert "written as its repr" in caplog.text


# --- ToolEnv: a truncation by a tool or by the env's rule; rewards in any range ---


class TurnLimitTool:
    name = "move"
    description = "Make a move."
    parameters_schema = {"type": "object", "properties": {}}

    def __init__(self, last: int) -> None:
        self.moves, self.last = 0, last

    async def execute(self, arguments: str) -> ToolResult:
        self.moves += 1
        return ToolResult(content=f"move {self.moves}", truncate=self.moves >= self.last)


class GameEnv(ToolEnv):
    def __init__(self, rule_limit: int | None = None, tool_limit: int = 99) -> None:
        super().__init__([TurnLimitTool(tool_limit)])
        self.rule_limit = rule_limit

    def score(self, task: Task, messages: list[Message]) -> float:
        return -0.5  # a game's penalty: rewards are in the env's own range

    def should_truncate(self, task: Task, messages: list[Message]) -> bool:
        moves = sum(1 for m in messages if m["role"] == "tool")
        return self.rule_limit is not None and moves >= self.rule_limit

    def truncation_reward(self, task: Task, messages: list[Message]) -> float:
        return 0.25


def moving(messages, specs):
    return Message(role="assistant", content="", tool_calls=[make_tool_call("m", "move", {})])


@pytest.mark.parametrize(
    "env", [GameEnv(tool_limit=2), GameEnv(rule_limit=2)], ids=["by a tool", "by the rule"]
)
def test_tool_env_can_end_an_episode_as_an_env_truncation(env):
    episode = asyncio.run(run_episode(lambda t: env, TASK, moving, max_turns=5))
    assert (episode.end_cause, episode.reward, episode.num_turns) == (EndCause.ENV, 0.25, 2)


def test_tool_env_rewards_are_the_envs_to_choose():
    episode = asyncio.run(run_episode(lambda t: GameEnv(), TASK, lambda m, s: ANSWER, max_turns=2))
    assert (episode.end_cause, episode.reward) == (EndCause.TERMINATED, -0.5)


# --- one budget per turn; a small configuration whose run folder is megabytes ---


def test_evaluation_and_training_sample_the_same_turn_budget():
    assert SamplingParams().max_tokens == GRPOConfig().max_tokens_per_turn


def test_a_small_run_leaves_megabytes(tiny_model_dir, tmp_path):
    config = GRPOConfig.small(model=tiny_model_dir, runs_dir=str(tmp_path), run_name="small")
    config.validate()
    result = train_multi_turn(config, tasks=[TASK], env_factory=lambda task: MathEnv())
    assert [m["step"] for m in result.metrics] == [0, 1, 2]
    size = sum(path.stat().st_size for path in result.run_dir.rglob("*") if path.is_file())
    assert size < 5_000_000, f"the run folder holds {size / 1e6:.1f} MB"
    assert not (result.run_dir / "checkpoints").exists() or not any(
        (result.run_dir / "checkpoints").iterdir()
    )
