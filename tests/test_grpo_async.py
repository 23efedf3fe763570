"""Async GRPO on a tiny model: policy-age invariants per weight-sync mode, stale drops, pausing,
shutdown, resume, and the replicas' publication rules.

The environment makes episodes long-tailed on purpose (a few turns, each with a tool delay drawn
from a heavy-tailed distribution), so groups finish out of order and some go stale.
"""

from __future__ import annotations

import _thread
import asyncio
import copy
import dataclasses
import json
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from cookbook_lib.codecs import make_codec
from cookbook_lib.envs import Env, StepResult, Task
from cookbook_lib.generators import HFGenerator
from cookbook_lib.grpo.async_loop import CollectedGroup, RolloutCollector, task_for_group
from cookbook_lib.grpo.config import GRPOConfig, WeightSyncType
from cookbook_lib.grpo.length_mix import turn_bucket, turn_buckets
from cookbook_lib.grpo.lockstep import tasks_for_step
from cookbook_lib.grpo.train import TIMELINE_FILE, train_multi_turn
from cookbook_lib.grpo.weight_sync import GeneratorReplicas
from cookbook_lib.rollout.episode import EndCause, Episode
from cookbook_lib.runtime import models
from cookbook_lib.runtime.asyncio_utils import run_sync
from cookbook_lib.runtime.metrics import read_metrics
from cookbook_lib.runtime.timeline import SAMPLING, TRAINER_LANE, TRAINING, Timeline, replica_lane
from cookbook_lib.types import Message, ToolSpec

SYNCHRONOUS = WeightSyncType.WEIGHT_SYNC_TYPE_SYNCHRONOUS
BACKGROUND = WeightSyncType.WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH
PIPELINE = WeightSyncType.WEIGHT_SYNC_TYPE_PIPELINE


class EnvLog:
    """What every environment of a run did: created, closed, and when each step ran."""

    def __init__(self) -> None:
        self.created = 0
        self.closed = 0
        self.steps: list[tuple[str, float]] = []  # (task prompt, time)


class SlowEnv(Env):
    """``turns`` assistant turns, each followed by a tool delay; reward: first letter is a vowel."""

    def __init__(self, log: EnvLog, seed: int, mean_delay_s: float = 0.02, turns: int = 2) -> None:
        log.created += 1
        self.log, self.rng = log, random.Random(seed)
        self.mean_delay_s, self.turns = mean_delay_s, turns
        self._messages: list[Message] = []
        self._task: Task | None = None

    async def reset(self, task: Task) -> list[Message]:
        self._task = task
        self._messages = [Message(role="user", content=task.prompt)]
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        assert self._task is not None
        self.log.steps.append((self._task.prompt, time.time()))
        self._messages.append(message)
        # Pareto-tailed delays: most short, a few many times the mean.
        await asyncio.sleep(min(self.mean_delay_s * self.rng.paretovariate(1.5), 20 * self.mean_delay_s))
        done = sum(m["role"] == "assistant" for m in self._messages) >= self.turns
        if not done:
            self._messages.append(Message(role="user", content="Go on."))
            return StepResult(terminated=False, truncated=False, messages=list(self._messages), reward=0.0)
        letters = [c for c in message.get("content", "").lower() if c.isalpha()]
        reward = float(bool(letters) and letters[0] in "aeiou")
        return StepResult(terminated=True, truncated=False, messages=list(self._messages), reward=reward)

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return []

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)

    async def close(self) -> None:
        self.log.closed += 1


class LengthEnv(SlowEnv):
    """As many turns as the task's ``turns`` metadata says; a random reward, so every group has signal."""

    async def reset(self, task: Task) -> list[Message]:
        self.turns = task.metadata.get("turns", self.turns)
        return await super().reset(task)

    async def step(self, message: Message) -> StepResult:
        result = await super().step(message)
        return dataclasses.replace(result, reward=self.rng.random()) if result.terminated else result


WORDS = ("owls", "rain", "tea", "maps", "ice", "sun")
TASKS = [Task(prompt=f"Tell me about {w}.", target=None) for w in WORDS]
# Long-tailed lengths: 1, 1, 1, 2, 3 and 4 turns.
LENGTH_TASKS = [
    Task(prompt=f"Tell me about {w}.", target=None, metadata={"turns": n})
    for w, n in zip(WORDS, (1, 1, 1, 2, 3, 4), strict=True)
]
VAL_TASKS = [Task(prompt=f"Validate {w}.", target=None) for w in ("one", "two")]


def env_factory_for(log: EnvLog, env_class: type[SlowEnv] = SlowEnv, **kwargs):
    counter = iter(range(10**9))
    return lambda task: env_class(log, seed=next(counter), **kwargs)


def async_config(tiny_model_dir, tmp_path, **overrides) -> GRPOConfig:
    settings = dict(
        model=tiny_model_dir,
        batch_size=2,
        episodes_per_task=3,
        num_steps=4,
        validation_interval=0,
        max_turns=3,
        max_model_length=512,
        max_tokens_per_turn=10,
        overlong_buffer_tokens=0,
        micro_batch_tokens=512,
        learning_rate=1e-3,
        checkpoint_interval=0,
        runs_dir=str(tmp_path),
        run_name="async",
        max_steps_off_policy=1,
        groups_in_flight=4,
    )
    settings.update(overrides)
    return GRPOConfig(**settings)


def trained_episodes(run_dir: Path, step: int) -> list[dict]:
    path = run_dir / "episodes" / f"step_{step:06d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def token_versions(episode: dict) -> list[int]:
    return [v for turn in episode["turns"] for v in turn["policy_versions"]]


def our_threads() -> set[str]:
    ours = ("HFGenerator", "asyncio_", "cookbook")
    return {t.name for t in threading.enumerate() if t.name.startswith(ours)}


def assert_no_trained_token_is_older_than_the_bound(result, config: GRPOConfig) -> None:
    """Checked against the dumped per-token versions, not the loop's own bookkeeping."""
    max_age = config.max_steps_off_policy
    metrics = {m["step"]: m for m in result.metrics}
    version_before = 0
    for step in range(1, config.num_steps + 1):
        line = metrics[step]
        assert line["async/policy_age_max"] <= max_age
        episodes = trained_episodes(result.run_dir, step)
        assert episodes, f"step {step} trained on nothing"
        for episode in episodes:
            versions = token_versions(episode)
            # Every token was sampled by a policy at most max_age optimizer steps older than the
            # one being trained.
            assert min(versions) >= version_before - max_age, (step, versions)
            assert max(versions) <= version_before
            if max_age == 0:
                assert set(versions) == {version_before}
            if config.weight_sync_type is not PIPELINE:  # these switch weights between requests only
                assert all(len(set(turn["policy_versions"])) == 1 for turn in episode["turns"])
        version_before = int(line["policy_version"])


@pytest.mark.parametrize("sync", [SYNCHRONOUS, BACKGROUND, PIPELINE])
@pytest.mark.parametrize("max_age", [0, 1])
def test_no_trained_group_is_older_than_the_bound_and_every_env_is_closed(
    tiny_model_dir, tmp_path, sync, max_age
):
    log = EnvLog()
    threads_before = our_threads()
    config = async_config(tiny_model_dir, tmp_path, weight_sync_type=sync, max_steps_off_policy=max_age)
    assert config.stale_groups == "prevent"  # the default
    result = train_multi_turn(config, tasks=TASKS, env_factory=env_factory_for(log))
    assert_no_trained_token_is_older_than_the_bound(result, config)
    # "prevent" starts a group only when it will be trained in time: none is ever dropped.
    assert all(m["async/dropped_stale_groups"] == 0 for m in result.metrics[1:])
    assert log.created == log.closed > 0
    assert our_threads() <= threads_before


@pytest.mark.parametrize("sync", [SYNCHRONOUS, BACKGROUND, PIPELINE])
def test_requeued_groups_respect_the_bound_in_every_sync_mode(tiny_model_dir, tmp_path, sync):
    log = EnvLog()
    config = async_config(
        tiny_model_dir,
        tmp_path,
        weight_sync_type=sync,
        stale_groups="requeue",
        max_steps_off_policy=0,
        batch_size=1,
        groups_in_flight=3,
        num_steps=4,
    )
    result = train_multi_turn(
        config, tasks=LENGTH_TASKS, env_factory=env_factory_for(log, LengthEnv, mean_delay_s=0.03)
    )
    assert_no_trained_token_is_older_than_the_bound(result, config)
    steps = result.metrics[1:]
    # Every group dropped was requeued (its task replayed), none lost.
    dropped = sum(m["async/dropped_stale_groups"] for m in steps)
    assert sum(m["async/requeued_groups"] for m in steps) == dropped
    assert log.created == log.closed > 0


def test_prevent_trains_lockstep_tasks_in_lockstep_order_and_drops_nothing(tiny_model_dir, tmp_path):
    """Long-tailed lengths and tool delays, so groups finish out of order; the trainer still takes
    them in the order they started, and each step trains what a lockstep step would have."""
    log = EnvLog()
    config = async_config(
        tiny_model_dir,
        tmp_path,
        batch_size=2,
        groups_in_flight=4,
        max_steps_off_policy=1,
        num_steps=4,
        max_turns=4,  # every task ends on its own: random rewards, so every group has signal
    )
    result = train_multi_turn(
        config, tasks=LENGTH_TASKS, env_factory=env_factory_for(log, LengthEnv, mean_delay_s=0.03)
    )
    for line in result.metrics[1:]:
        assert line["async/dropped_stale_groups"] == 0
        step_tasks = tasks_for_step(LENGTH_TASKS, config, line["step"], 0, config.batch_size)
        expected = [task.prompt for task in step_tasks for _ in range(config.episodes_per_task)]
        assert [e["task"]["prompt"] for e in trained_episodes(result.run_dir, line["step"])] == expected
    assert log.created == log.closed


class FlatRewardEnv(SlowEnv):
    """Every episode scores 0: no group has signal, so no step changes the weights."""

    async def step(self, message: Message) -> StepResult:
        return dataclasses.replace(await super().step(message), reward=0.0)


def test_prevent_keeps_collecting_through_steps_that_train_nothing(tiny_model_dir, tmp_path):
    # With a bound of 0 a step that trained nothing leaves the trainer on the same version, and
    # the next step must let workers start again (it once waited forever for a group).
    log = EnvLog()
    config = async_config(
        tiny_model_dir, tmp_path, max_steps_off_policy=0, batch_size=1, groups_in_flight=2, num_steps=3
    )
    finished: list[object] = []

    def train() -> None:
        finished.append(
            train_multi_turn(config, tasks=TASKS, env_factory=env_factory_for(log, FlatRewardEnv))
        )

    runner = threading.Thread(target=train, daemon=True)
    runner.start()
    runner.join(timeout=600)
    assert finished, "the run did not finish: the workers never started the next step's group"
    metrics = finished[0].metrics[1:]
    assert [m["trained_groups"] for m in metrics] == [0, 0, 0]
    assert all(m["policy_version"] == 0 for m in metrics)
    assert log.created == log.closed


def test_a_requeued_task_is_replayed_before_any_new_one(tiny_model_and_tokenizer, tmp_path):
    model, tokenizer = tiny_model_and_tokenizer
    config = async_config("unused", tmp_path, stale_groups="requeue", groups_in_flight=1, max_turns=1)
    log = EnvLog()

    async def main() -> list[tuple[int, str]]:
        generator = HFGenerator(copy.deepcopy(model).eval(), pad_token_id=tokenizer.pad_token_id)
        replicas = GeneratorReplicas([generator])
        collector = RolloutCollector(config, TASKS, env_factory_for(log), replicas, make_codec(tokenizer))
        # Group 3 came back too old (the trainer took it and dropped it): its task goes first.
        episodes = [
            Episode(task=TASKS[0], messages=[], reward=0.0, end_cause=EndCause.TERMINATED, num_turns=2)
        ]
        collector.drop_stale(
            CollectedGroup(episodes, index=3, replica=0, start_version=0, started_at=0, finished_at=0)
        )
        try:
            taken = [await collector.take() for _ in range(2)]
        finally:
            await collector.stop()
            await replicas.close()
        assert collector.pop_dropped_turns() == [2]
        assert (collector.dropped_stale, collector.requeued) == (1, 1)
        return [(group.index, group.episodes[0].task.prompt) for group in taken]

    played = run_sync(main())
    assert played == [
        (3, task_for_group(TASKS, config, 3).prompt),
        (0, task_for_group(TASKS, config, 0).prompt),
    ]
    assert log.created == log.closed


def bucket_counts(episodes: list[dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for episode in episodes:
        bucket = turn_bucket(episode["num_turns"])
        counts[bucket] = counts.get(bucket, 0) + 1
    return counts


@pytest.mark.parametrize("mode", ["lockstep", "async-drop"])
def test_length_metrics_match_the_dumped_episodes(tiny_model_dir, tmp_path, mode):
    log = EnvLog()
    overrides = (
        dict(max_steps_off_policy=None, groups_in_flight=None)
        if mode == "lockstep"
        else dict(stale_groups="drop", max_steps_off_policy=0, batch_size=1, groups_in_flight=3)
    )
    config = async_config(tiny_model_dir, tmp_path, max_turns=4, num_steps=3, **overrides)
    result = train_multi_turn(
        config, tasks=LENGTH_TASKS, env_factory=env_factory_for(log, LengthEnv, mean_delay_s=0.03)
    )
    buckets = turn_buckets(config.max_turns)
    for line in result.metrics[1:]:
        # Every group has signal (random rewards), so every dumped episode was trained.
        episodes = trained_episodes(result.run_dir, line["step"])
        counts = bucket_counts(episodes)
        assert line["length/trained_episodes_total"] == len(episodes)
        for bucket in buckets:
            share = line[f"length/trained_episodes/{bucket}"]
            assert share == pytest.approx(counts.get(bucket, 0) / len(episodes))
        assert sum(line[f"length/trained_tokens/{b}"] for b in buckets) == pytest.approx(1.0)
        assert line["length/trained_tokens_total"] == line["sampled_tokens"]
        dropped = sum(line[f"length/dropped_stale_groups/{b}"] for b in buckets)
        assert dropped == line.get("async/dropped_stale_groups", 0.0)
        assert sum(line[f"length/groups/{b}"] for b in buckets) == line["num_groups"] + dropped
    if mode == "async-drop":  # one group trained per step, three in flight: some went stale
        assert sum(line["async/dropped_stale_groups"] for line in result.metrics[1:]) >= 1
    assert log.created == log.closed


def test_stale_groups_are_dropped_counted_and_closed(tiny_model_dir, tmp_path):
    log = EnvLog()
    config = async_config(
        tiny_model_dir,
        tmp_path,
        batch_size=1,
        groups_in_flight=4,
        max_steps_off_policy=0,
        num_steps=4,
        stale_groups="drop",
    )
    result = train_multi_turn(config, tasks=TASKS, env_factory=env_factory_for(log, mean_delay_s=0.05))
    dropped = sum(m.get("async/dropped_stale_groups", 0) for m in result.metrics)
    # Four groups in flight, one trained per step: the others started under the old policy.
    assert dropped >= 1
    assert log.created == log.closed
    trained = sum(len(trained_episodes(result.run_dir, s)) for s in range(1, 5))
    assert trained == 4 * config.episodes_per_task  # stale groups are not in the batch...
    for line in result.metrics[1:]:
        # ... nor in the zero-variance count, which is over the groups the trainer kept.
        assert line["zero_variance_skip_ratio"] * line["num_groups"] <= line["num_groups"]


def test_pipeline_records_mixed_versions_within_one_sample(tiny_model_dir, tmp_path, monkeypatch):
    # A tiny model decodes a turn in a few milliseconds, so whether a publish landed mid-turn was
    # a matter of timing (CI once saw none in 8 steps). Each decode step is slowed by 10 ms, so a
    # 48-token turn takes about as long as a trainer step and the groups in flight are decoding
    # whenever weights publish (6 spanning samples in 4 steps, measured); a random reward gives
    # every group signal, so every step trains and publishes.
    decode = HFGenerator._decode

    def slow_decode(self: HFGenerator) -> None:
        time.sleep(0.01)
        decode(self)

    monkeypatch.setattr(HFGenerator, "_decode", slow_decode)
    log = EnvLog()
    config = async_config(
        tiny_model_dir,
        tmp_path,
        weight_sync_type=PIPELINE,
        max_steps_off_policy=3,
        batch_size=1,
        groups_in_flight=3,
        num_steps=4,
        max_tokens_per_turn=48,
        max_turns=2,
        # "drop" starts every group at once, so samples are in flight whenever weights publish;
        # "prevent" holds starts back by the bound and made a spanning sample a matter of timing.
        stale_groups="drop",
    )
    result = train_multi_turn(
        config, tasks=TASKS, env_factory=env_factory_for(log, LengthEnv, mean_delay_s=0.005)
    )
    assert all(line.get("zero_variance_skip_ratio", 0) == 0 for line in result.metrics[1:])
    mixed = [
        turn["policy_versions"]
        for step in range(1, config.num_steps + 1)
        for episode in trained_episodes(result.run_dir, step)
        for turn in episode["turns"]
        if len(set(turn["policy_versions"])) > 1
    ]
    assert mixed, "no sample spanned a weight update"
    assert all(versions == sorted(versions) for versions in mixed)


def test_sequential_validation_pauses_collection(tiny_model_dir, tmp_path):
    log = EnvLog()
    config = async_config(
        tiny_model_dir, tmp_path, num_steps=3, validation_interval=1, sequential_validation=True
    )
    train_multi_turn(config, tasks=TASKS, env_factory=env_factory_for(log), val_tasks=VAL_TASKS)
    timeline = Timeline.load(tmp_path / "async" / TIMELINE_FILE)
    validations = [s for s in timeline.spans() if s.lane == TRAINER_LANE and s.kind == "validation"]
    assert len(validations) == 4  # step 0 and after each step
    val_prompts = {t.prompt for t in VAL_TASKS}
    for span in validations:
        start, end = span.start + timeline.origin_unix, span.end + timeline.origin_unix
        during = [p for p, at in log.steps if start <= at <= end]
        assert during and set(during) <= val_prompts, "a training rollout stepped during validation"


def test_an_error_in_a_rollout_stops_the_run_and_leaves_nothing_running(tiny_model_dir, tmp_path):
    log = EnvLog()
    threads_before = our_threads()

    class Broken(SlowEnv):
        async def step(self, message):
            if self.rng.random() < 0.3:
                raise RuntimeError("the tool server went away")
            return await super().step(message)

    counter = iter(range(10**9))
    config = async_config(tiny_model_dir, tmp_path, on_env_error="raise", num_steps=50)
    with pytest.raises(Exception, match="environment failed"):
        train_multi_turn(config, tasks=TASKS, env_factory=lambda task: Broken(log, seed=next(counter)))
    assert log.created == log.closed > 0
    assert our_threads() <= threads_before


def test_a_keyboard_interrupt_in_a_notebook_cancels_rollouts_and_closes_envs(tiny_model_dir, tmp_path):
    log = EnvLog()
    threads_before = our_threads()
    config = async_config(tiny_model_dir, tmp_path, num_steps=300)

    def interrupt_once_training_runs() -> None:
        # Not a fixed delay: on a loaded machine the run may still be loading its model.
        deadline = time.monotonic() + 120
        while log.created < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        _thread.interrupt_main()

    timer = threading.Thread(target=interrupt_once_training_runs, daemon=True)

    async def notebook_cell():
        # A running loop, as in Jupyter: train_multi_turn runs on a helper thread.
        timer.start()
        train_multi_turn(config, tasks=TASKS, env_factory=env_factory_for(log))

    # Jupyter's loop, unlike asyncio.run's, leaves SIGINT to Python's own handler (ipykernel sets
    # it while a cell runs): KeyboardInterrupt is raised. Set here too, because other libraries
    # imported by earlier tests (W&B) may have replaced it, and interrupt_main then does nothing.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(notebook_cell())
    finally:
        loop.close()
        signal.signal(signal.SIGINT, previous)
    timer.join()
    assert log.created == log.closed > 0
    assert our_threads() <= threads_before
    steps_done = len(read_metrics(tmp_path / "async"))
    assert steps_done < 300


def test_an_async_run_resumes_from_its_checkpoint(tiny_model_dir, tmp_path):
    log = EnvLog()
    config = async_config(tiny_model_dir, tmp_path, num_steps=3, checkpoint_interval=1)

    def interrupt_after_step_2(outcome):
        if outcome.step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_multi_turn(
            config, tasks=TASKS, env_factory=env_factory_for(log), on_step=interrupt_after_step_2
        )
    assert log.created == log.closed
    result = train_multi_turn(config, tasks=TASKS, env_factory=env_factory_for(log))
    assert [m["step"] for m in result.metrics] == [0, 1, 2, 3]
    assert result.metrics[-1]["policy_version"] >= result.metrics[2]["policy_version"]
    assert log.created == log.closed


def test_timeline_and_async_metrics_are_written(tiny_model_dir, tmp_path):
    log = EnvLog()
    config = async_config(tiny_model_dir, tmp_path, num_generator_replicas=2, num_steps=3)
    result = train_multi_turn(config, tasks=TASKS, env_factory=env_factory_for(log))
    for line in result.metrics[1:]:
        for name in (
            "async/train_wait_s",
            "async/dropped_stale_groups",
            "async/policy_age_mean",
            "async/policy_age_max",
            "async/groups_in_flight",
            "async/generator_busy_fraction",
        ):
            assert name in line, name
        assert 0 <= line["async/generator_busy_fraction"] <= 1
    timeline = Timeline.load(result.run_dir / TIMELINE_FILE)
    lanes = timeline.lanes()
    assert {TRAINER_LANE, replica_lane(0), replica_lane(1)} <= set(lanes)
    assert timeline.busy_s(replica_lane(1), SAMPLING) > 0  # both replicas served rollouts
    assert timeline.busy_s(TRAINER_LANE, TRAINING) > 0


# --- the replicas' publication rules ------------------------------------------------------


def _replicas(sync: WeightSyncType, count: int = 2):
    model, _ = models.tiny_random_model(seed=1)
    generators = [HFGenerator(copy.deepcopy(model).eval(), pad_token_id=0) for _ in range(count)]
    return model, GeneratorReplicas(generators, sync)


def _new_weights(model, value: float):
    return {name: torch.full_like(t, value) for name, t in model.state_dict().items()}


def _first_weight(generator: HFGenerator) -> float:
    return float(next(iter(generator.model.state_dict().values())).flatten()[0])


def test_synchronous_publication_reaches_every_replica_before_it_returns():
    model, replicas = _replicas(SYNCHRONOUS)

    async def main():
        await replicas.publish(_new_weights(model, 0.5), 1)
        seen = [(g.policy_version, _first_weight(g)) for g in replicas.generators]
        await replicas.close()
        return seen

    assert run_sync(main()) == [(1, 0.5), (1, 0.5)]


@pytest.mark.parametrize("sync", [BACKGROUND, PIPELINE])
def test_deferred_publication_returns_at_once_and_keeps_only_the_newest(sync):
    model, replicas = _replicas(sync)

    async def main():
        await replicas.publish(_new_weights(model, 0.1), 1)
        returned_before_applied = any(g.policy_version == 0 for g in replicas.generators)
        await replicas.publish(_new_weights(model, 0.2), 2)
        await replicas.publish(_new_weights(model, 0.3), 3)
        await replicas.flush()
        seen = [(g.policy_version, round(_first_weight(g), 3)) for g in replicas.generators]
        await replicas.close()
        return returned_before_applied, seen

    returned_before_applied, seen = run_sync(main())
    assert returned_before_applied
    assert seen == [(3, 0.3), (3, 0.3)]
