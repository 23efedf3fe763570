"""The ecosystem's environments in one line: GEM's and TextArena's text games through ``TextGameEnv``,
reasoning-gym's datasets through ``reasoning_gym_tasks`` and ``ReasoningGymEnv``; evaluated and
trained (one GRPO step) with the tiny model. Needs the extra: ``pip install -e ".[envs]"``."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from cookbook_lib.envs.reasoning_tasks import ReasoningGymEnv, reasoning_gym_tasks
from cookbook_lib.envs.text_game import TextGameEnv, text_game_tasks
from cookbook_lib.generators import SamplingParams
from cookbook_lib.grpo.config import GRPOConfig
from cookbook_lib.grpo.train import train_multi_turn
from cookbook_lib.rollout.episode import EndCause
from cookbook_lib.rollout.evaluate import evaluate
from cookbook_lib.rollout.play import run_episode
from cookbook_lib.types import Message, make_tool_call

HINT = 'pip install -e ".[envs]"'
gem = pytest.importorskip("gem", reason=HINT)
textarena = pytest.importorskip("textarena", reason=HINT)
pytest.importorskip("reasoning_gym", reason=HINT)

GAME = "game:GuessTheNumber-v0-easy"


def gem_factory():
    return TextGameEnv.from_gymnasium(lambda: gem.make(GAME))


def guesses(*moves: str):
    replies = iter(moves)
    return lambda messages, specs: Message(role="assistant", content=next(replies))


def test_a_gem_game_plays_as_an_env_and_keeps_the_global_rng():
    random.seed(11)
    np.random.seed(11)
    expected = (random.random(), np.random.random())
    random.seed(11)
    np.random.seed(11)
    task = text_game_tasks(GAME, 1, seed=3)[0]
    moves = [f"\\boxed{{{n}}}" for n in (5, 3, 8, 2, 9, 1, 10)]
    episode = asyncio.run(run_episode(gem_factory(), task, guesses(*moves), max_turns=7))
    # GEM reseeds both generators on reset; the env put them back, so the run's draws go on as before.
    assert (random.random(), np.random.random()) == expected
    assert episode.end_cause is EndCause.TERMINATED and episode.error is None
    assert episode.messages[0]["content"].startswith("You are playing Guess The Number")
    assert "Enter your next guess." in episode.messages[2]["content"]  # GEM's suffix for the next move
    assert "Enter your next guess." not in episode.messages[-1]["content"]  # not once the game is over


def test_a_gem_games_penalty_is_its_reward():
    task = text_game_tasks(GAME, 1, seed=3)[0]
    episode = asyncio.run(run_episode(gem_factory(), task, guesses("no number here"), max_turns=3))
    assert (episode.end_cause, episode.reward) == (EndCause.TERMINATED, -0.1)


def test_a_textarena_game_plays_with_each_moves_new_text_only():
    factory = TextGameEnv.from_textarena(lambda: textarena.make("GuessTheNumber-v0"))
    task = text_game_tasks("GuessTheNumber-v0", 1, seed=3)[0]
    episode = asyncio.run(run_episode(factory, task, guesses(*(["[10]", "[5]", "[15]"] * 4)), max_turns=12))
    assert episode.end_cause is EndCause.TERMINATED and episode.error is None
    assert "[GAME] You are Player 0" in episode.messages[0]["content"]
    later = episode.messages[2]["content"]
    assert "You are Player 0" not in later and ("higher" in later or "lower" in later)


def test_reasoning_gym_tasks_score_with_the_datasets_own_scorer():
    tasks = reasoning_gym_tasks("chain_sum", 3, seed=0)
    task = tasks[0]
    assert task.prompt.startswith("State the final answer") and task.metadata["dataset"] == "chain_sum"
    right = asyncio.run(
        run_episode(lambda t: ReasoningGymEnv(), task, guesses(f" {task.target} "), max_turns=1)
    )
    wrong = asyncio.run(run_episode(lambda t: ReasoningGymEnv(), task, guesses("12345678"), max_turns=1))
    assert (right.reward, wrong.reward) == (1.0, 0.0)


def test_reasoning_gym_arithmetic_with_the_calculator():
    task = reasoning_gym_tasks("chain_sum", 1, seed=1)[0]
    expression = task.metadata["entry"]["metadata"]["expression"]
    call = Message(
        role="assistant",
        content="",
        tool_calls=[make_tool_call("c", "calculator", {"expression": expression})],
    )
    replies = iter([call, Message(role="assistant", content=str(task.target))])
    env = ReasoningGymEnv(calculator=True)
    assert [spec["function"]["name"] for spec in env.tool_specs] == ["calculator"]
    episode = asyncio.run(run_episode(lambda t: env, task, lambda m, s: next(replies), max_turns=3))
    assert episode.messages[3]["content"] == str(task.target)  # the calculator's result
    assert (episode.end_cause, episode.reward) == (EndCause.TERMINATED, 1.0)


@pytest.mark.parametrize("source", ["gem", "reasoning-gym"])
def test_the_tiny_model_evaluates_and_trains_on_them(source, tiny_model_dir, tmp_path):
    if source == "gem":
        tasks, factory = text_game_tasks(GAME, 2, seed=0), gem_factory()
    else:
        tasks, factory = (
            reasoning_gym_tasks("chain_sum", 2, seed=0),
            (lambda task: ReasoningGymEnv(calculator=True)),
        )
    report = evaluate(
        tiny_model_dir,
        tasks,
        factory,
        episodes_per_task=2,
        max_turns=2,
        sampling=SamplingParams(max_tokens=16),
        runs_dir=str(tmp_path),
        run_name="eval",
    )
    assert report.num_episodes == 4 and report.end_causes.get(EndCause.ERROR, 0) == 0
    config = GRPOConfig.small(
        model=tiny_model_dir, num_steps=1, max_tokens_per_turn=16, runs_dir=str(tmp_path)
    )
    result = train_multi_turn(config, tasks=tasks, env_factory=factory)
    assert [m["step"] for m in result.metrics] == [0, 1]
    assert result.metrics[1]["error_ratio"] == 0.0
