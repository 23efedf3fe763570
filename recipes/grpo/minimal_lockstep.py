"""Lockstep multi-turn GRPO on the tool-use game, the whole loop on one page.

    python -m recipes.grpo.minimal_lockstep             # 5 steps on the embedded model
    python -m recipes.grpo.minimal_lockstep --steps 2 --model ./runs/<run>/warm_start_model

``train_multi_turn`` runs this same loop, with more around it. Here only four library pieces are
used, each a stage of the data flow: the environment (``ToolUseGameEnv`` and its tasks), the codec
(``make_codec``: a conversation to tokens, sampled tokens back to a message, and the tokens after
a turn), the generator (``HFGenerator``: batched sampling for every episode at once) and the loss
(``compute_loss``). Playing an episode, group advantages, building the samples and the optimizer
step are written out below, in the order a step runs them.

What this file leaves out, and where the library has it:

- validation, checkpoints and resume, metrics files and W&B, progress bars (``grpo/train.py``);
- resampling groups without signal (``max_sampling_attempts``), the soft overlong penalty and
  overlong masking (``grpo/samples.py``), a KL penalty, LoRA, bf16 (``grpo/trainer.py``);
- packing samples into micro-batches: each sample is forwarded on its own here;
- async training, several generator replicas, vLLM and Ray (``grpo/async_loop.py``, ...).

With the same settings it trains the tokens ``train_multi_turn`` trains (tests/test_minimal_loop.py).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from cookbook_lib.codecs import Codec, make_codec
from cookbook_lib.envs.base import Task
from cookbook_lib.generators import HFGenerator, SamplingParams
from cookbook_lib.grpo.loss_settings import LossSettings
from cookbook_lib.grpo.losses import compute_loss
from cookbook_lib.runtime.models import load_model, load_tokenizer
from envs.tool_use_game import ToolUseGameEnv, load_tool_use_game_tasks


@dataclass(frozen=True)
class Settings:
    """The knobs of the loop (the names of their ``GRPOConfig`` fields)."""

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    num_steps: int = 5
    batch_size: int = 4  # tasks per step
    episodes_per_task: int = 4  # the group
    max_turns: int = 6
    max_model_length: int = 1536
    max_tokens_per_turn: int = 48
    temperature: float = 1.0
    learning_rate: float = 5e-5
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    max_grad_norm: float = 1.0
    seed: int = 0


@dataclass
class Sequence:
    """A run of tokens the model saw, with its sampled tokens marked: one training sample."""

    tokens: list[int]
    sampled: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def extend(self, tokens: list[int], sampled: bool, logprobs: list[float] | None = None) -> None:
        self.tokens += tokens
        self.sampled += [sampled] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)


@dataclass
class Rollout:
    """One episode: its reward and the token sequences it was played in (usually one)."""

    reward: float = 0.0
    sequences: list[Sequence] = field(default_factory=list)


@dataclass
class StepRecord:
    """What a step did: its episodes (task by task, each task's group in a row) and its loss."""

    step: int
    rollouts: list[Rollout]
    loss: float  # NaN when no group had signal, so nothing trained
    grad_norm: float

    @property
    def reward_mean(self) -> float:
        return sum(rollout.reward for rollout in self.rollouts) / len(self.rollouts)


# ---- 1. play an episode: render, sample, parse, step the env, render what follows ------------


async def play(
    task: Task, generator: HFGenerator, codec: Codec, sampling: SamplingParams, s: Settings
) -> Rollout:
    env = ToolUseGameEnv()
    rollout = Rollout()
    try:
        messages = await env.reset(task)
        prompt = codec.render_prompt(messages, env.tool_specs)
        rollout.sequences.append(Sequence(tokens=[], sampled=[], logprobs=[]))
        rollout.sequences[-1].extend(prompt, sampled=False)
        for _ in range(s.max_turns):
            room = s.max_model_length - len(prompt)
            if room <= 0:
                return rollout  # the context is full: CONTEXT_OVERFLOW, reward 0
            result = await generator.sample(
                prompt, replace(sampling, max_tokens=min(sampling.max_tokens, room))
            )
            sampled = list(result.tokens)
            rollout.sequences[-1].extend(sampled, sampled=True, logprobs=list(result.logprobs))
            parsed = codec.parse(sampled, env.tool_specs)
            if result.finish_reason == "length" and len(prompt) + len(sampled) >= s.max_model_length:
                return rollout  # cut by the context
            if parsed.message is None:
                return rollout  # PARSE_FAILURE: the reply is not in the model's format, reward 0
            step = await env.step(parsed.message)
            rollout.reward = float(step.reward)
            if step.terminated or step.truncated:
                return rollout
            # The conversation now holds the reply and what the env appended after it (tool results).
            history, new = step.messages[: len(messages) + 1], step.messages[len(messages) + 1 :]
            messages = step.messages
            continuation = codec.render_continuation(history, sampled, new, env.tool_specs)
            if continuation.restarted:  # the template rewrote history: a new sequence starts here
                prompt = continuation.tokens
                rollout.sequences.append(Sequence(tokens=[], sampled=[], logprobs=[]))
                rollout.sequences[-1].extend(prompt, sampled=False)
            else:  # the next prompt is exactly what the model saw, plus what follows
                after = codec.close_turn(sampled) + continuation.tokens
                prompt = prompt + sampled + after
                rollout.sequences[-1].extend(after, sampled=False)
        return rollout  # MAX_TURNS: the last step's reward
    finally:
        await env.close()


def tasks_for_step(tasks: list[Task], s: Settings, step: int) -> list[Task]:
    """A function of (seed, step) alone, as the library's: a resumed run draws the same tasks."""
    return random.Random(f"{s.seed}/{step}/0").sample(tasks, s.batch_size)


# ---- 2. group-relative advantages, and the samples they weight ------------------------------


def advantages(rewards: list[float], eps: float = 1e-6) -> list[float] | None:
    """Reward minus the group mean, over the group's std; None when all rewards are equal (no signal)."""
    if max(rewards) - min(rewards) <= 1e-6:
        return None
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + eps) for r in rewards]


def samples_of(groups: list[list[Rollout]]) -> list[tuple[Sequence, float]]:
    """Every sequence with sampled tokens, paired with its episode's advantage."""
    out = []
    for group in groups:
        weights = advantages([rollout.reward for rollout in group])
        if weights is None:
            continue
        for rollout, advantage in zip(group, weights, strict=True):
            out += [(sequence, advantage) for sequence in rollout.sequences if any(sequence.sampled)]
    return out


# ---- 3. one optimizer step on the clipped importance-weighted loss --------------------------


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: list[tuple[Sequence, float]],
    s: Settings,
) -> float:
    settings = LossSettings(clip_ratio_low=s.clip_ratio_low, clip_ratio_high=s.clip_ratio_high)
    total_tokens = float(sum(sum(sequence.sampled[1:]) for sequence, _ in samples))
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for sequence, advantage in samples:
        # Shift once: the output at position t scores token t + 1.
        inputs = torch.tensor([sequence.tokens[:-1]])
        targets = torch.tensor([sequence.tokens[1:]])
        mask = torch.tensor([sequence.sampled[1:]])
        logits = model(input_ids=inputs).logits.float() / s.temperature
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None])[..., 0]
        loss, _ = compute_loss(
            logprobs,
            torch.tensor([sequence.logprobs[1:]]),
            torch.where(mask, advantage, 0.0),
            mask,
            settings,
            num_tokens_total=total_tokens,  # each sample's part of the whole step's token mean
            num_sequences_total=float(len(samples)),
        )
        loss.backward()  # gradients add up over the samples of the step
        loss_sum += loss.item()
    grad_norm = torch.nn.utils.clip_grad_norm_(
        [p for p in model.parameters() if p.grad is not None], s.max_grad_norm
    )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    return loss_sum, float(grad_norm)


# ---- 4. the loop ----------------------------------------------------------------------------


async def run(s: Settings, tasks: list[Task] | None = None) -> list[StepRecord]:
    """Train for ``s.num_steps`` steps on ``tasks`` (default: the game's training split)."""
    random.seed(s.seed)
    np.random.seed(s.seed)
    torch.manual_seed(s.seed)  # the generator draws each request's sampling seed from here
    tokenizer = load_tokenizer(s.model)
    codec = make_codec(tokenizer)  # checks the chat template before the model loads
    model = load_model(s.model, device="cpu")
    # Lockstep samples only between optimizer steps, so the generator can sample the trained model
    # itself; the weights it holds change when the optimizer steps them.
    generator = HFGenerator(model, pad_token_id=tokenizer.pad_token_id, fixed_shape_decode=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.learning_rate, weight_decay=0.0)
    sampling = SamplingParams(
        temperature=s.temperature, max_tokens=s.max_tokens_per_turn, stop_token_ids=list(codec.stop_token_ids)
    )
    tasks = tasks if tasks is not None else load_tool_use_game_tasks("train")
    history = []
    try:
        for step in range(1, s.num_steps + 1):
            step_tasks = tasks_for_step(tasks, s, step)
            # Every episode of every group at once: the generator batches their requests.
            flat = await asyncio.gather(
                *(
                    play(task, generator, codec, sampling, s)
                    for task in step_tasks
                    for _ in range(s.episodes_per_task)
                )
            )
            groups = [
                list(flat[i : i + s.episodes_per_task]) for i in range(0, len(flat), s.episodes_per_task)
            ]
            samples = samples_of(groups)
            # What the generator holds only for sampling goes before the training step (on CPUs
            # where it packs the weights it samples with: a model's worth of memory).
            await generator.sleep()
            loss, grad_norm = train_step(model, optimizer, samples, s) if samples else (math.nan, math.nan)
            if samples:  # new weights for the generator (here the same tensors: only its version moves)
                await generator.update_weights(model.state_dict(), step)
            history.append(StepRecord(step, list(flat), loss, grad_norm))
            print(
                f"step {step}/{s.num_steps} | reward {history[-1].reward_mean:.3f} | loss {loss:.4f} "
                f"| grad norm {grad_norm:.4f}"
            )
    finally:
        await generator.close()
    return history


def main(argv: list[str] | None = None) -> list[StepRecord]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model name or folder (default: the embedded model)")
    parser.add_argument("--steps", type=int, default=Settings.num_steps)
    parser.add_argument("--seed", type=int, default=Settings.seed)
    args = parser.parse_args(argv)
    return asyncio.run(run(Settings(model=args.model, num_steps=args.steps, seed=args.seed)))


if __name__ == "__main__":
    main()
