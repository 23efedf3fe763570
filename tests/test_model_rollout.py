"""Episodes played by a model: every end cause, token-exact sequences, close() on every path.

Two kinds of generator drive the real ModelPolicy, codec and env code: the tiny random model
behind the real batching HFGenerator, and a scripted generator that "samples" chosen replies
(encoded by the real codec), for outcomes a random model cannot be relied on to produce.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest
import torch

from cookbook_lib.codecs import make_codec
from cookbook_lib.envs import Env, StepResult, Task
from cookbook_lib.generators import Generator, GeneratorClosedError, HFGenerator, SampleResult, SamplingParams
from cookbook_lib.rollout.episode import EndCause, Episode, EpisodeError
from cookbook_lib.rollout.evaluate import evaluate_async
from cookbook_lib.rollout.model_policy import ModelPolicy
from cookbook_lib.rollout.play import run_episode, run_group
from cookbook_lib.rollout.records import read_episodes
from cookbook_lib.types import Message, ToolSpec, make_tool_call
from envs.tool_use_game import ToolUseGameEnv, load_tool_use_game_tasks, make_tool_use_game_expert

TASK = load_tool_use_game_tasks("val")[0]


class ScriptedGenerator(Generator):
    """Returns pre-chosen token lists in order, honouring ``max_tokens`` like a real backend."""

    def __init__(self, replies: list[list[int]]) -> None:
        self.replies = list(replies)
        self.prompts: list[list[int]] = []

    async def sample(self, prompt_tokens: list[int], params: SamplingParams) -> SampleResult:
        self.prompts.append(list(prompt_tokens))
        tokens = self.replies.pop(0)[: params.max_tokens]
        stopped = bool(tokens) and tokens[-1] in params.stop_token_ids
        return SampleResult(tokens, [-0.5] * len(tokens), "stop" if stopped else "length", [0] * len(tokens))

    async def update_weights(
        self, state_dict: Mapping[str, torch.Tensor], version: int, *, between_requests: bool = False
    ) -> None:
        raise NotImplementedError

    @property
    def policy_version(self) -> int:
        return 0

    async def close(self) -> None:
        pass


class CountingGameEnv(ToolUseGameEnv):
    """The tool-use game, counting close() calls."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = 0

    async def close(self) -> None:
        self.closed += 1


class EndlessEnv(Env):
    """Never terminates: every reply gets a user nudge back. For MAX_TURNS and ENV."""

    def __init__(self, truncate_after: int | None = None) -> None:
        self.truncate_after = truncate_after
        self.closed = 0
        self._messages: list[Message] = []

    async def reset(self, task: Task) -> list[Message]:
        self._messages = [Message(role="user", content=task.prompt)]
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        self._messages += [message, Message(role="user", content="Go on.")]
        turns = sum(m["role"] == "assistant" for m in self._messages)
        truncated = self.truncate_after is not None and turns >= self.truncate_after
        return StepResult(terminated=False, truncated=truncated, messages=list(self._messages), reward=0.1)

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return []

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)

    async def close(self) -> None:
        self.closed += 1


@pytest.fixture(scope="module")
def codec(tokenizer):
    return make_codec(tokenizer)


def play(env, generator, codec, *, max_model_length=2048, max_turns=6, max_tokens=32, seed=0) -> Episode:
    sampling = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed)
    policy = ModelPolicy(generator, codec, sampling, max_model_length)
    return asyncio.run(run_episode(env, TASK, policy, max_turns=max_turns, failed_parse_reward=-1.0))


def expert_replies(codec) -> list[list[int]]:
    """The expert's whole episode, as the tokens a model would sample for each of its messages."""
    expert = make_tool_use_game_expert(TASK)

    async def collect() -> list[Message]:
        episode = await run_episode(ToolUseGameEnv(), TASK, expert, max_turns=8)
        return [m for m in episode.messages if m["role"] == "assistant"]

    return [codec.render_assistant(message) for message in asyncio.run(collect())]


def test_a_scripted_model_solves_the_game_token_exactly(codec):
    replies = expert_replies(codec)
    env = CountingGameEnv()
    episode = play(env, ScriptedGenerator(replies), codec, max_tokens=256)
    assert episode.end_cause is EndCause.TERMINATED and episode.reward == 1.0
    assert episode.num_turns == len(replies) == len(episode.turns)
    assert env.closed == 1
    (sequence,) = episode.token_sequences()
    # The one sequence is exactly the full render of the final conversation, up to the last
    # sampled token: nothing was decoded and re-encoded on the way.
    full = codec.render_prompt(episode.messages, env.tool_specs)
    assert sequence.tokens_T == full[: len(sequence)]
    sampled = [t for turn in episode.turns for t in turn.sampled_tokens]
    assert [t for t, m in zip(sequence.tokens_T, sequence.assistant_mask_T, strict=True) if m] == sampled
    assert sum(sequence.assistant_mask_T) == len(sampled)
    for earlier, later in zip(episode.turns, episode.turns[1:], strict=False):
        assert later.prompt_tokens[: len(earlier.prompt_tokens)] == earlier.prompt_tokens
        grown = earlier.prompt_tokens + earlier.sampled_tokens
        assert later.prompt_tokens[: len(grown)] == grown


def test_malformed_output_is_a_parse_failure_with_failed_parse_reward(codec, tokenizer):
    bad = tokenizer.encode('<tool_call>\n{"name": "lookup", "arguments": {"key": ', add_special_tokens=False)
    env = CountingGameEnv()
    episode = play(env, ScriptedGenerator([[*bad, codec.end_of_turn_id]]), codec)
    assert episode.end_cause is EndCause.PARSE_FAILURE and episode.reward == -1.0
    assert episode.messages[-1]["content"].startswith("<tool_call>")
    assert env.closed == 1 and len(episode.turns) == 1


def test_a_reply_cut_by_the_context_limit_is_a_context_overflow(codec):
    env = CountingGameEnv()
    prompt_length = len(codec.render_prompt(asyncio.run(CountingGameEnv().reset(TASK)), env.tool_specs))
    replies = [codec.render_assistant(Message(role="assistant", content="1 2 3 4 5 6 7 8 9 10"))]
    episode = play(env, ScriptedGenerator(replies), codec, max_model_length=prompt_length + 3)
    assert episode.end_cause is EndCause.CONTEXT_OVERFLOW and episode.reward == 0.0
    assert len(episode.turns[0].sampled_tokens) == 3 and env.closed == 1


def test_a_tool_output_that_fills_the_context_is_a_context_overflow(codec):
    env = CountingGameEnv()
    opening = asyncio.run(CountingGameEnv().reset(TASK))
    prompt_length = len(codec.render_prompt(opening, env.tool_specs))
    call = Message(role="assistant", content="", tool_calls=[make_tool_call("c", "list_fact_keys", {})])
    reply = codec.render_assistant(call)
    # Room for the call but not for the list of keys that comes back.
    episode = play(env, ScriptedGenerator([reply]), codec, max_model_length=prompt_length + len(reply) + 8)
    assert episode.end_cause is EndCause.CONTEXT_OVERFLOW
    assert episode.messages[-1]["role"] == "tool" and env.closed == 1


# Defence in depth: a failure inside ModelPolicy ends one episode, not the run.


class FailingGenerator(ScriptedGenerator):
    """Serves its replies, then raises ``error`` (standing in for any bug behind ModelPolicy)."""

    def __init__(self, replies: list[list[int]], error: Exception) -> None:
        super().__init__(replies)
        self.error = error

    async def sample(self, prompt_tokens: list[int], params: SamplingParams) -> SampleResult:
        if not self.replies:
            raise self.error
        return await super().sample(prompt_tokens, params)


def test_a_model_policy_failure_ends_its_episode_as_error_with_the_traceback(codec):
    env = CountingGameEnv()
    first = expert_replies(codec)[:1]  # a valid tool call, so a second turn is sampled
    episode = play(env, FailingGenerator(first, ValueError("sampler bug 7")), codec, max_tokens=256)
    assert episode.end_cause is EndCause.ERROR and episode.reward == 0.0
    assert episode.error.startswith("ModelPolicy raised:\nTraceback") and "sampler bug 7" in episode.error
    assert len(episode.turns) == 1 and env.closed == 1


def test_a_model_policy_failure_stops_the_run_with_on_env_error_raise(codec):
    env = CountingGameEnv()
    policy = ModelPolicy(FailingGenerator([], ValueError("sampler bug")), codec, SamplingParams(), 2048)
    with pytest.raises(EpisodeError, match="ModelPolicy failed") as info:
        asyncio.run(run_episode(env, TASK, policy, max_turns=3, on_env_error="raise"))
    assert isinstance(info.value.__cause__, ValueError) and env.closed == 1


def test_one_failing_model_policy_leaves_the_rest_of_its_group_playing(codec):
    replies = expert_replies(codec)
    generators = iter(
        [FailingGenerator([], RuntimeError("boom")), *(ScriptedGenerator(replies) for _ in range(2))]
    )
    sampling = SamplingParams(max_tokens=256)
    episodes = asyncio.run(
        run_group(
            lambda task: CountingGameEnv(),
            TASK,
            lambda: ModelPolicy(next(generators), codec, sampling, 2048),
            3,
            max_turns=8,
        )
    )
    assert [e.end_cause for e in episodes] == [EndCause.ERROR, EndCause.TERMINATED, EndCause.TERMINATED]


def test_a_closed_generator_still_propagates_from_a_model_policy(codec):
    env = CountingGameEnv()
    policy = ModelPolicy(FailingGenerator([], GeneratorClosedError("closed")), codec, SamplingParams(), 2048)
    with pytest.raises(GeneratorClosedError):
        asyncio.run(run_episode(env, TASK, policy, max_turns=3))
    assert env.closed == 1


# With the real tiny model behind the real batching generator.


@pytest.fixture
def generator(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    hf = HFGenerator(model, pad_token_id=tokenizer.pad_token_id)
    yield hf
    asyncio.run(hf.close())


def test_tiny_model_prompt_too_long_is_a_context_overflow(generator, codec):
    env = CountingGameEnv()
    episode = play(env, generator, codec, max_model_length=16)
    assert episode.end_cause is EndCause.CONTEXT_OVERFLOW and episode.turns == []
    assert env.closed == 1


def test_tiny_model_runs_out_of_turns(generator, codec):
    env = EndlessEnv()
    episode = play(env, generator, codec, max_turns=2, max_tokens=8)
    # A random model's reply is text (it parses) unless it happens to write a stray tag.
    assert episode.end_cause in (EndCause.MAX_TURNS, EndCause.PARSE_FAILURE)
    if episode.end_cause is EndCause.MAX_TURNS:
        assert episode.num_turns == 2 and episode.reward == 0.1
    assert env.closed == 1


def test_tiny_model_env_truncation(generator, codec):
    env = EndlessEnv(truncate_after=1)
    episode = play(env, generator, codec, max_tokens=8)
    assert episode.end_cause in (EndCause.ENV, EndCause.PARSE_FAILURE)
    assert env.closed == 1


def test_tiny_model_terminates_the_game_and_records_its_tokens(generator, codec):
    env = CountingGameEnv()
    episode = play(env, generator, codec, max_tokens=12)
    assert episode.end_cause in (EndCause.TERMINATED, EndCause.PARSE_FAILURE)
    (turn,) = episode.turns
    assert len(turn.sampled_tokens) == len(turn.logprobs) == len(turn.policy_versions) <= 12
    assert all(lp <= 0.0 for lp in turn.logprobs)
    assert env.closed == 1


def test_a_group_shares_the_batching_generator(generator, codec):
    envs: list[CountingGameEnv] = []

    def factory(task: Task) -> Env:
        envs.append(CountingGameEnv())
        return envs[-1]

    sampling = SamplingParams(max_tokens=8)
    episodes = asyncio.run(
        run_group(factory, TASK, lambda: ModelPolicy(generator, codec, sampling, 2048), 6, max_turns=2)
    )
    assert len(episodes) == 6 and [env.closed for env in envs] == [1] * 6
    assert generator.stats.max_rows > 1


def test_an_ended_episode_leaves_no_kept_prefix_behind(generator, codec):
    """Each turn's KV cache is kept for the episode's next turn; the last one is dropped when the
    episode ends, not left to sit beside the next phase's caches."""
    seen: list[int] = []

    class Watching(ModelPolicy):
        async def __call__(self, messages, tool_specs):
            step = await super().__call__(messages, tool_specs)
            seen.append(generator.num_cached_prefixes)  # this turn's cache, kept for the next
            return step

    async def main() -> int:
        policy = Watching(generator, codec, SamplingParams(max_tokens=8, stop_token_ids=[]), 2048)
        await run_episode(EndlessEnv(), TASK, policy, max_turns=3)
        return await generator.run_on_worker(lambda: generator.num_cached_prefixes)

    left = asyncio.run(main())
    assert seen == [1, 1, 1]  # each turn took the previous turn's entry and left its own
    assert left == 0


def test_evaluate_writes_episodes_that_load_back(tiny_model_and_tokenizer, tmp_path):
    model, tokenizer = tiny_model_and_tokenizer
    tasks = load_tool_use_game_tasks("val")[:2]
    report = asyncio.run(
        evaluate_async(
            model,
            tasks,
            lambda task: ToolUseGameEnv(),
            tokenizer=tokenizer,
            episodes_per_task=3,
            max_turns=2,
            sampling=SamplingParams(max_tokens=8),
            run_name="tiny",
            runs_dir=tmp_path,
        )
    )
    assert report.num_episodes == 6 and set(report.pass_at_k) == {1, 3}
    assert sum(report.end_causes.values()) == 6
    assert report.episodes_path == tmp_path / "tiny" / "episodes.jsonl"
    assert read_episodes(report.episodes_path) == report.episodes


def test_evaluate_refuses_a_loaded_model_without_its_tokenizer(tiny_model_and_tokenizer, tmp_path):
    model, _ = tiny_model_and_tokenizer
    with pytest.raises(ValueError, match="tokenizer"):
        asyncio.run(evaluate_async(model, [TASK], lambda task: ToolUseGameEnv(), runs_dir=tmp_path))


def test_evaluate_refuses_a_fixed_seed_for_a_group(tiny_model_and_tokenizer, tmp_path):
    model, tokenizer = tiny_model_and_tokenizer
    with pytest.raises(ValueError, match=r"torch\.manual_seed"):
        asyncio.run(
            evaluate_async(
                model,
                [TASK],
                lambda task: ToolUseGameEnv(),
                tokenizer=tokenizer,
                sampling=SamplingParams(seed=1),
                runs_dir=tmp_path,
            )
        )
