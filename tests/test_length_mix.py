"""The length-mix metrics (buckets, per-step shares, a run's summary), the turn counter, the figure,
and the async task stream that follows lockstep's."""

from __future__ import annotations

import asyncio

import pytest

from cookbook_lib.display.length_mix_plots import length_mix_figure
from cookbook_lib.envs import Env, StepResult, Task
from cookbook_lib.grpo.async_loop import task_for_group
from cookbook_lib.grpo.config import GRPOConfig
from cookbook_lib.grpo.length_mix import (
    TurnCounter,
    add_dropped_groups,
    length_mix_summary,
    trained_length_metrics,
    turn_bucket,
    turn_buckets,
)
from cookbook_lib.grpo.lockstep import tasks_for_step
from cookbook_lib.grpo.samples import build_samples
from cookbook_lib.rollout.episode import EndCause, Episode, Turn
from cookbook_lib.runtime.asyncio_utils import run_sync
from cookbook_lib.types import Message, ToolSpec


def test_buckets_are_powers_of_two_of_assistant_turns():
    assert [turn_bucket(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 16, 17)] == [
        "turns_1", "turns_1", "turns_2", "turns_3-4", "turns_3-4", "turns_5-8", "turns_5-8",
        "turns_9-16", "turns_9-16", "turns_17-32",
    ]  # fmt: skip
    assert turn_buckets(8) == ["turns_1", "turns_2", "turns_3-4", "turns_5-8"]
    assert turn_buckets(6) == ["turns_1", "turns_2", "turns_3-4", "turns_5-8"]
    assert turn_buckets(1) == ["turns_1"]


def episode(turns: int, reward: float, sampled_per_turn: int = 2) -> Episode:
    """An episode of ``turns`` assistant turns, each sampling ``sampled_per_turn`` tokens."""
    prompt: list[int] = [1, 2]
    records = []
    for _ in range(turns):
        sampled = [7] * sampled_per_turn
        records.append(Turn(list(prompt), sampled, [-0.5] * len(sampled), [0] * len(sampled)))
        prompt = prompt + sampled + [3]
    return Episode(
        task=Task("t"),
        messages=[],
        reward=reward,
        end_cause=EndCause.TERMINATED,
        num_turns=turns,
        turns=records,
    )


def test_trained_length_metrics_count_trained_episodes_and_tokens_by_bucket():
    groups = [
        [episode(1, 0.0), episode(1, 1.0)],  # trained: 2 episodes x 1 turn x 2 tokens
        [episode(4, 0.0, 3), episode(3, 1.0, 3)],  # trained: a 4-turn (12 tokens) and a 3-turn (9)
        [episode(8, 1.0), episode(8, 1.0)],  # no signal: not trained, but counted in length/groups
    ]
    batch = build_samples(groups, normalize_by_std=False, overlong_masking=False, max_model_length=1000)
    assert batch.trained_group_indices == [0, 1]
    metrics = trained_length_metrics(groups, batch.samples, batch.trained_group_indices, max_turns=8)
    assert metrics["length/trained_episodes_total"] == 4
    assert metrics["length/trained_episodes/turns_1"] == pytest.approx(0.5)
    assert metrics["length/trained_episodes/turns_2"] == 0
    assert metrics["length/trained_episodes/turns_3-4"] == pytest.approx(0.5)
    assert metrics["length/trained_episodes/turns_5-8"] == 0
    assert metrics["length/trained_tokens_total"] == 4 + 12 + 9
    assert metrics["length/trained_tokens/turns_1"] == pytest.approx(4 / 25)
    assert metrics["length/trained_tokens/turns_3-4"] == pytest.approx(21 / 25)
    # A group's length is its longest episode's.
    assert [metrics[f"length/groups/{b}"] for b in turn_buckets(8)] == [1, 0, 1, 1]


def test_a_step_that_trained_nothing_has_zero_shares():
    groups = [[episode(2, 1.0), episode(2, 1.0)]]
    metrics = trained_length_metrics(groups, [], [], max_turns=2)
    assert metrics["length/trained_episodes_total"] == 0
    assert metrics["length/trained_episodes/turns_2"] == 0
    assert metrics["length/groups/turns_2"] == 1


def test_dropped_groups_are_counted_by_bucket_and_among_the_groups():
    metrics = trained_length_metrics([[episode(1, 0.0), episode(1, 1.0)]], [], [0], max_turns=8)
    add_dropped_groups(metrics, [8, 7, 2], max_turns=8)
    assert [metrics[f"length/dropped_stale_groups/{b}"] for b in turn_buckets(8)] == [0, 1, 0, 2]
    assert [metrics[f"length/groups/{b}"] for b in turn_buckets(8)] == [1, 1, 0, 2]


def test_the_run_summary_weighs_each_step_by_its_totals():
    steps = [
        {"step": 0, "val/reward_mean": 0.5},  # no length metrics: skipped
        {
            "step": 1,
            "length/trained_episodes/turns_1": 1.0,
            "length/trained_episodes/turns_2": 0.0,
            "length/trained_episodes_total": 6,
            "length/trained_tokens/turns_1": 1.0,
            "length/trained_tokens/turns_2": 0.0,
            "length/trained_tokens_total": 10,
            "length/groups/turns_1": 3,
            "length/groups/turns_2": 1,
            "length/dropped_stale_groups/turns_1": 0,
            "length/dropped_stale_groups/turns_2": 1,
        },
        {
            "step": 2,
            "length/trained_episodes/turns_1": 0.5,
            "length/trained_episodes/turns_2": 0.5,
            "length/trained_episodes_total": 2,
            "length/trained_tokens/turns_1": 0.25,
            "length/trained_tokens/turns_2": 0.75,
            "length/trained_tokens_total": 40,
            "length/groups/turns_1": 1,
            "length/groups/turns_2": 1,
            "length/dropped_stale_groups/turns_1": 0,
            "length/dropped_stale_groups/turns_2": 0,
        },
    ]
    one, two = length_mix_summary(steps)
    assert (one.bucket, two.bucket) == ("turns_1", "turns_2")
    assert one.trained_episodes_share == pytest.approx(7 / 8)  # (6 + 1) of 8 episodes
    assert two.trained_episodes_share == pytest.approx(1 / 8)
    assert one.trained_tokens_share == pytest.approx(20 / 50)  # (10 + 10) of 50 tokens
    assert (two.groups, two.dropped_stale_groups, two.dropped_share) == (2, 1, 0.5)
    assert one.dropped_share == 0


class CountedEnv(Env):
    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def reset(self, task: Task) -> list[Message]:
        return [Message(role="user", content=task.prompt)]

    async def step(self, message: Message) -> StepResult:
        await asyncio.sleep(0)
        return StepResult(terminated=False, truncated=False, messages=[], reward=0.0)

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return []

    @property
    def messages(self) -> list[Message]:
        return []

    async def close(self) -> None:
        self.log.append("closed")


def test_the_turn_counter_follows_the_longest_episode_and_passes_everything_through():
    log: list[str] = []
    counter = TurnCounter(max_turns=4)
    factory = counter.env_factory(lambda task: CountedEnv(log))
    assert counter.turns == 1  # a group cancelled before any reply had begun its first turn

    async def play() -> None:
        short, long = factory(Task("a")), factory(Task("a"))
        assert await long.reset(Task("a")) == [Message(role="user", content="a")]
        for _ in range(2):
            await long.step(Message(role="assistant", content="x"))
        await short.step(Message(role="assistant", content="x"))
        await short.close()
        await long.close()

    run_sync(play())
    assert counter.turns == 3  # two replies stepped, the third turn begun
    assert log == ["closed", "closed"]
    counter.steps = 10
    assert counter.turns == 4  # never more than max_turns


def test_async_groups_play_lockstep_tasks_in_lockstep_order():
    tasks = [Task(f"task {i}") for i in range(30)]
    config = GRPOConfig(batch_size=3, seed=7)
    stream = [task_for_group(tasks, config, index) for index in range(9)]
    lockstep = [task for step in (1, 2, 3) for task in tasks_for_step(tasks, config, step, 0, 3)]
    assert stream == lockstep


def test_length_mix_figure_draws_each_run_on_the_same_buckets():
    def step(shares: dict[str, float], dropped: dict[str, float]) -> dict:
        record = {"step": 1, "length/trained_episodes_total": 4, "length/trained_tokens_total": 4}
        for bucket, share in shares.items():
            record[f"length/trained_episodes/{bucket}"] = share
            record[f"length/trained_tokens/{bucket}"] = share
            record[f"length/groups/{bucket}"] = 2
            record[f"length/dropped_stale_groups/{bucket}"] = dropped.get(bucket, 0)
        return record

    lockstep = [step({"turns_1": 0.5, "turns_5-8": 0.5}, {})]
    async_run = [step({"turns_1": 1.0, "turns_2": 0.0}, {"turns_2": 1})]
    figure = length_mix_figure([("lockstep", lockstep), ("async", async_run)], title="mix")
    assert len(figure.data) == 2 * 3  # per run: episodes, tokens, dropped
    episodes_lockstep, _, _, episodes_async, _, dropped_async = figure.data
    assert list(episodes_lockstep.x) == ["1", "2", "5-8"]  # the union of buckets, shortest first
    assert list(episodes_lockstep.y) == [0.5, 0.0, 0.5]
    assert list(episodes_async.y) == [1.0, 0.0, 0.0]
    assert list(dropped_async.y) == [0.0, 0.5, 0.0]  # 1 of turns_2's 2 groups
    assert [trace.showlegend for trace in figure.data] == [True, False, False] * 2


def test_length_mix_figure_says_so_when_runs_have_no_length_metrics():
    figure = length_mix_figure([("old run", [{"step": 1, "reward_mean": 0.1}])])
    assert any("no length metrics" in annotation.text for annotation in figure.layout.annotations)
