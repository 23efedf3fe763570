"""Our multi-turn GRPO step against TRL's on the same work: step time and reward per step.

    python bench/bench_trl.py --install                 # TRL 1.16 and what it needs, into .bench-deps/trl
    python bench/bench_trl.py                           # 3 seeds x 5 steps, each side
    python bench/bench_trl.py --quick                   # 1 seed x 2 steps
    python bench/bench_trl.py --work=single-turn        # the single-turn work instead (below)
    python bench/bench_trl.py --only=ours --ours-config=loss_normalizer=batch_groups
                                                        # our side alone, with a setting changed
    python bench/bench_trl.py --only=ours --error-text=trl  # our side, failed calls read as TRL's
    python bench/bench_trl.py --only=ours --ours-config=warmup_steps=3  # our side, learning rate warmed up

The work: the tool-use game's tier-1 tasks (the demo's), 4 tasks x 4 episodes a step, at most 6
turns of at most 48 new tokens, the demo's learning rate 5e-5 (``--learning-rate``), no KL term,
sampled at temperature 1. Both
sides start from one warm-started model that this bench makes once (the embedded SmolLM2 with
Qwen2.5's chat template as TRL ships it, so TRL's own tool-call parser reads its calls, then the
demo's expert warm-start through our trainer) and see the same tasks in the same order: step s
plays ``lockstep.tasks_for_step(seed, s)``, TRL reads them from an unshuffled dataset.

TRL (``GRPOTrainer`` with ``environment_factory``, the game's three tools as the environment's
methods, its prompts showing our env's tool block token for token: ``show_tool_specs``) keeps its
defaults otherwise: its DAPO loss, gradient checkpointing, its generation through ``transformers``;
``bf16`` follows ``--dtype`` for both sides (float32 where the CPU has no native bf16, bf16 is
5-50x slower there: docs/benchmarks.md). Ours runs ``train_multi_turn``
with the demo's config (its 3-update learning-rate warm-up included), one sampling round a step
(``max_sampling_attempts=1``), so both sample 16 episodes a step. Each side runs in a fresh
process per seed, the two alternating; a step's time is from the start of its sampling to the end
of its optimizer step. Each side's episodes are kept
(ours in ``ours-seedN/episodes/``, TRL's completions and rewards in ``trl-seedN/completions.jsonl``):
``bench/episode_stats.py`` tables what each side's policy did, step by step.

``--work=single-turn``: GRPO's classic setting, as ``recipes/grpo/single_turn.py`` runs it: the
level-1 arithmetic tasks answered in one reply of at most 16 tokens, 4 tasks x 8 episodes a step,
learning rate 2e-5 (``--learning-rate``), from the base model (the embedded SmolLM2 with the same
chat template). The reward is shaped: how close the reply's nearest number comes to the answer (1
minus the relative error, at least 0). The recipe's (1 when the whole reply is the number) and "1
when its first number is" gave the base model no signal at all (it answers in sentences and sums
wrongly: 32 of 32 replies scored 0 on both, on both sides), and a step whose groups all score
alike trains nothing, so its time would not be a training step's. Ours is ``train_single_turn``;
TRL's the same ``GRPOTrainer`` with that reward and no environment.

TRL is not one of our dependencies: ``--install`` puts it in its own folder (``pip install
--target``, never into .venv), and only TRL's process puts that folder on its path.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRL_DIR = REPO / ".bench-deps" / "trl"
WORK_DIR = REPO / "runs" / "bench_trl"
# TRL's pin and what it needs beyond our .venv (accelerate, transformers and torch are ours).
TRL_PACKAGES = (
    "trl==1.16.0", "datasets==5.2.0", "pyarrow==24.0.0", "pandas==3.1.1", "dill==0.3.8",
    "multiprocess==0.70.16",
)  # fmt: skip
GROUPS, GROUP_SIZE, MAX_TURNS, MAX_TOKENS_PER_TURN = 4, 4, 6, 48
DEMO_LEARNING_RATE = 5e-5  # the demo's; --learning-rate changes it for both sides
# TRL budgets a whole episode's tokens after the prompt (tool results included), not a turn's.
TRL_MAX_COMPLETION_TOKENS = 384
RESULT = "BENCH_TRL_STEP"
COMPLETIONS_FILE = "completions.jsonl"  # TRL's episodes, a line a step (``recorded``)
# The single-turn work (recipes/grpo/single_turn.py's settings, one sampling round a step).
SINGLE_GROUPS, SINGLE_GROUP_SIZE, SINGLE_MAX_TOKENS = 4, 8, 16
SINGLE_LEARNING_RATE = 2e-5
WORKS = ("multi-turn", "single-turn")


def install(trl_dir: Path) -> None:
    trl_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(trl_dir)]
    subprocess.run([*command, *TRL_PACKAGES], check=True)
    print(f"installed {', '.join(TRL_PACKAGES)} into {trl_dir}")


# ---------------------------------------------------------------- the shared starting point


def prepare(work_dir: Path, dtype: str) -> None:
    """The warm-started model both sides start from, in ``work_dir/prepare/warm_start_model``."""
    from cookbook_lib.codecs.reference import reference_template_text
    from cookbook_lib.grpo.train import train_multi_turn
    from cookbook_lib.runtime.models import load_tokenizer, resolve_model
    from envs.tool_use_game import ToolUseGameEnv
    from recipes.grpo.tool_use_game import demo_config, demo_setup

    base = work_dir / "base_model"
    if base.exists():
        shutil.rmtree(base)
    shutil.copytree(resolve_model(), base)
    tokenizer = load_tokenizer(str(base))
    tokenizer.chat_template = reference_template_text("qwen2_5")
    tokenizer.save_pretrained(base)
    demo = demo_setup(val_tasks=1, warm_start_demos=64, warm_start_steps=8, seed=0)
    # One tiny GRPO step after the warm-start: train_multi_turn is the warm-start's real path.
    config = demo_config(
        model=str(base), run_name="prepare", runs_dir=str(work_dir), num_steps=1, batch_size=1,
        episodes_per_task=2, max_turns=2, max_tokens_per_turn=8, validation_interval=0,
        checkpoint_interval=0, final_checkpoint="none", keep_warm_start_model=True, dtype=dtype,
    )  # fmt: skip
    train_multi_turn(
        config, tasks=demo.train_tasks, env_factory=lambda task: ToolUseGameEnv(), warm_start=demo.warm_start
    )


def tier1_tasks():
    from envs.tool_use_game import load_tool_use_game_tasks
    from recipes.grpo.tool_use_game import DEMO_TIERS

    return [t for t in load_tool_use_game_tasks("train") if str(t.metadata["tier"]) in DEMO_TIERS.split(",")]


def our_config(
    model: Path, seed: int, steps: int, dtype: str, work_dir: Path, learning_rate: float,
    overrides: dict | None = None,
):  # fmt: skip
    from recipes.grpo.tool_use_game import demo_config

    config = demo_config(
        model=str(model), run_name=f"ours-seed{seed}", runs_dir=str(work_dir), seed=seed, num_steps=steps,
        batch_size=GROUPS, episodes_per_task=GROUP_SIZE, max_turns=MAX_TURNS,
        max_tokens_per_turn=MAX_TOKENS_PER_TURN, learning_rate=learning_rate, max_sampling_attempts=1,
        validation_interval=0, checkpoint_interval=0, final_checkpoint="none", dtype=dtype,
    )  # fmt: skip
    return with_overrides(config, overrides)


def with_overrides(config, overrides: dict | None):
    """``config`` with ``--ours-config``'s settings, in a run folder named after them."""
    if not overrides:
        return config
    tag = "-".join(f"{key}={value}" for key, value in sorted(overrides.items()))
    config = dataclasses.replace(tagged(config, tag), **overrides)
    config.validate()
    return config


def tagged(config, tag: str):
    """``config`` in a run folder named for a variant: ``ours-TAG-seedN``."""
    return dataclasses.replace(config, run_name=config.run_name.replace("-seed", f"-{tag}-seed"))


def parse_overrides(settings: list[str]) -> dict:
    """``KEY=VALUE`` strings as GRPOConfig settings, the values read as YAML (``1e-5``, ``false``)."""
    import yaml

    overrides = {}
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep or not key:
            raise SystemExit(f"--ours-config takes KEY=VALUE, got {setting!r}")
        parsed = yaml.safe_load(value)
        if isinstance(parsed, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
            with contextlib.suppress(ValueError):
                parsed = float(parsed)
        overrides[key.strip()] = parsed
    return overrides


def math_level1_tasks():
    from envs.math_env import load_math_tasks

    return [task for task in load_math_tasks("train") if task.metadata.get("level") == 1]


def single_turn_config(
    model: Path, seed: int, steps: int, dtype: str, work_dir: Path, learning_rate: float,
    overrides: dict | None = None,
):  # fmt: skip
    from cookbook_lib.grpo.config import GRPOConfig

    config = GRPOConfig(
        model=str(model), run_name=f"ours-single-seed{seed}", runs_dir=str(work_dir), seed=seed,
        num_steps=steps, batch_size=SINGLE_GROUPS, episodes_per_task=SINGLE_GROUP_SIZE, max_turns=1,
        max_model_length=512, max_tokens_per_turn=SINGLE_MAX_TOKENS, micro_batch_tokens=2048,
        learning_rate=learning_rate, max_sampling_attempts=1, validation_interval=0,
        checkpoint_interval=0, final_checkpoint="none", dtype=dtype, wandb_project=None,
    )  # fmt: skip
    return with_overrides(config, overrides)


def report(side: str, seed: int, step: int, seconds: float, reward: float) -> None:
    record = dict(side=side, seed=seed, step=step, seconds=round(seconds, 2), reward=round(reward, 4))
    print(RESULT, json.dumps(record), flush=True)


# ---------------------------------------------------------------- our side


def run_ours(
    model: Path, seed: int, steps: int, dtype: str, work_dir: Path, learning_rate: float,
    overrides: dict | None = None, error_text: str = "ours",
) -> None:  # fmt: skip
    from cookbook_lib.grpo.train import train_multi_turn
    from envs.tool_use_game import ToolUseGameEnv

    config = our_config(model, seed, steps, dtype, work_dir, learning_rate, overrides)
    if error_text == "trl":
        show_tool_errors_as_trl_does()
        config = tagged(config, "trl_errors")
    shutil.rmtree(work_dir / config.run_name, ignore_errors=True)
    train_multi_turn(
        config, tasks=tier1_tasks(), env_factory=lambda task: ToolUseGameEnv(),
        on_step=_step_reporter("ours", seed),
    )  # fmt: skip


def show_tool_errors_as_trl_does() -> None:
    """Our tool loop's failed calls read as TRL's do: ``{'error': 'message'}`` instead of
    ``tool_error: message`` (``--error-text=trl``: an experiment on what the model reads, not a setting)."""
    from cookbook_lib.envs import tools

    ours = tools.run_tool_call

    async def run_tool_call(tool_map, call, timeout_s=None):
        message, failed, ending = await ours(tool_map, call, timeout_s)
        content = str(message["content"])
        if failed and content.startswith(tools.TOOL_ERROR_PREFIX):
            message["content"] = str({"error": content[len(tools.TOOL_ERROR_PREFIX) :]})
        return message, failed, ending

    tools.run_tool_call = run_tool_call  # run_tool_calls looks it up at each call


def run_ours_single(
    model: Path, seed: int, steps: int, dtype: str, work_dir: Path, learning_rate: float,
    overrides: dict | None = None,
) -> None:  # fmt: skip
    from cookbook_lib.grpo.train import train_single_turn
    from recipes.grpo.single_turn import SYSTEM_PROMPT

    config = single_turn_config(model, seed, steps, dtype, work_dir, learning_rate, overrides)
    shutil.rmtree(work_dir / config.run_name, ignore_errors=True)
    train_single_turn(
        config, tasks=math_level1_tasks(), system_prompt=SYSTEM_PROMPT,
        reward_fn=lambda task, reply: closeness(reply, str(task.target)),
        on_step=_step_reporter("ours", seed),
    )  # fmt: skip


def _step_reporter(side: str, seed: int):
    """An ``on_step`` callback reporting each step's time (from the previous step's end) and reward."""
    last = [time.perf_counter()]

    def on_step(outcome) -> None:
        now = time.perf_counter()
        if outcome.step > 0:  # step 0 is the (empty) validation before training
            report(side, seed, outcome.step, now - last[0], outcome.metrics["reward_mean"])
        last[0] = now

    return on_step


# ---------------------------------------------------------------- TRL's side


class _GameTools:
    """The tool-use game as TRL's ``environment_factory`` wants it: its tools as public methods."""

    def __init__(self) -> None:
        from envs.math_env import CalculatorTool
        from envs.tool_use_game.facts import FactBook
        from envs.tool_use_game.tools import ListFactKeysTool, LookupTool

        self._book = FactBook()
        self._tools = {
            "list_fact_keys": ListFactKeysTool(self._book),
            "lookup": LookupTool(self._book),
            "calculator": CalculatorTool(),
        }

    def reset(self, **row) -> None:
        self._book.load(json.loads(row["facts"]))

    def _call(self, name: str, **arguments) -> str:
        import asyncio

        # Our tools' own code; an exception (an unknown key) is TRL's to turn into an error result.
        return asyncio.run(self._tools[name].execute(json.dumps(arguments))).content

    def list_fact_keys(self) -> str:
        return self._call("list_fact_keys")

    def lookup(self, key: str) -> str:
        return self._call("lookup", key=key)

    def calculator(self, expression: str) -> str:
        return self._call("calculator", expression=expression)


def _describe_tool_methods() -> None:
    """TRL builds each tool's schema from its method's docstring: give them our tools' descriptions."""
    from envs.math_env import CalculatorTool
    from envs.tool_use_game.tools import ListFactKeysTool, LookupTool

    def doc(tool, arguments: dict[str, str]) -> str:
        lines = [tool.description]
        if arguments:
            lines += ["", "Args:", *(f"    {name}: {text}" for name, text in arguments.items())]
        return "\n".join(lines)

    def argument_text(tool, name: str) -> str:
        return tool.parameters_schema["properties"][name].get("description", name)

    _GameTools.list_fact_keys.__doc__ = doc(ListFactKeysTool, {})
    _GameTools.lookup.__doc__ = doc(LookupTool, {"key": argument_text(LookupTool, "key")})
    _GameTools.calculator.__doc__ = doc(
        CalculatorTool, {"expression": argument_text(CalculatorTool, "expression")}
    )


_describe_tool_methods()


def game_reward(completions: list[list[dict]], target: list[str], **kwargs) -> list[float]:
    """The game's score of each TRL completion: 1.0 for a final reply (no tool call) whose number
    matches the target, as ``ToolUseGameEnv.score`` scores an episode."""
    from cookbook_lib.envs.scoring import numbers_match

    rewards = []
    for messages, wanted in zip(completions, target, strict=True):
        final = messages[-1] if messages else {}
        answered = final.get("role") == "assistant" and not final.get("tool_calls")
        rewards.append(1.0 if answered and numbers_match(final.get("content") or "", wanted) else 0.0)
    return rewards


def closeness(reply: str, target: str) -> float:
    """The single-turn reward: 1 - the relative error of ``reply``'s number nearest ``target``
    (at least 0; 0 without a number). Exactly right scores 1."""
    wanted = float(target)
    found = [float(text) for text in re.findall(r"-?\d+(?:\.\d+)?", reply)]
    if not found:
        return 0.0
    error = min(abs(number - wanted) for number in found) / max(abs(wanted), 1.0)
    return max(0.0, 1.0 - error)


def math_reward(completions: list[list[dict]], target: list[str], **kwargs) -> list[float]:
    """Each TRL completion's single-turn reward (:func:`closeness` of its reply)."""
    return [
        closeness((messages[-1].get("content") or "") if messages else "", wanted)
        for messages, wanted in zip(completions, target, strict=True)
    ]


def trl_rows(config, tasks: list, groups: int, system_prompt: str) -> tuple[list, dict[str, list]]:
    """TRL's dataset: the tasks our side samples, ``groups`` a step for ``config.num_steps`` steps
    in that order (TRL reads it unshuffled), each as a system and a user message with its target."""
    from cookbook_lib.grpo.lockstep import tasks_for_step

    ordered = [
        task
        for step in range(1, config.num_steps + 1)
        for task in tasks_for_step(tasks, config, step, 0, groups)
    ]
    prompts = [
        [{"role": "system", "content": system_prompt}, {"role": "user", "content": task.prompt}]
        for task in ordered
    ]
    return ordered, {"prompt": prompts, "target": [str(task.target) for task in ordered]}


def run_trl(model: Path, seed: int, steps: int, dtype: str, work_dir: Path, learning_rate: float) -> None:
    from envs.tool_use_game import ToolUseGameEnv
    from envs.tool_use_game.env import SYSTEM_PROMPT

    config = our_config(model, seed, steps, dtype, work_dir, learning_rate)
    ordered, rows = trl_rows(config, tier1_tasks(), GROUPS, SYSTEM_PROMPT)
    rows["facts"] = [json.dumps(task.metadata["facts"]) for task in ordered]
    _train_trl(
        model, seed, steps, dtype, work_dir / f"trl-seed{seed}", learning_rate, rows, game_reward,
        groups=GROUPS, group_size=GROUP_SIZE, max_completion_length=TRL_MAX_COMPLETION_TOKENS,
        max_tool_calling_iterations=MAX_TURNS - 1, environment_factory=_GameTools,
        tool_specs=ToolUseGameEnv().tool_specs,
    )  # fmt: skip


def run_trl_single(
    model: Path, seed: int, steps: int, dtype: str, work_dir: Path, learning_rate: float
) -> None:
    from recipes.grpo.single_turn import SYSTEM_PROMPT

    config = single_turn_config(model, seed, steps, dtype, work_dir, learning_rate)
    _, rows = trl_rows(config, math_level1_tasks(), SINGLE_GROUPS, SYSTEM_PROMPT)
    _train_trl(
        model, seed, steps, dtype, work_dir / f"trl-single-seed{seed}", learning_rate, rows, math_reward,
        groups=SINGLE_GROUPS, group_size=SINGLE_GROUP_SIZE, max_completion_length=SINGLE_MAX_TOKENS,
    )  # fmt: skip


def _train_trl(
    model: Path,
    seed: int,
    steps: int,
    dtype: str,
    output_dir: Path,
    learning_rate: float,
    rows: dict[str, list],
    reward,
    *,
    groups: int,
    group_size: int,
    max_completion_length: int,
    environment_factory: type | None = None,
    tool_specs: list[dict] | None = None,
    **trl_settings,
) -> None:
    """TRL's ``GRPOTrainer`` with its defaults on ``rows`` (one step's ``groups`` prompts after the
    other, unshuffled), reporting each step's time and reward. ``tool_specs``: the tool block its
    prompts show (the environment's methods still run the calls)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import datasets.arrow_dataset
    import datasets.fingerprint
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    # datasets 5.2 cannot hash an in-memory table here (dill fails on pyarrow's MonthDayNano type,
    # whichever pyarrow and dill we tried): a random fingerprint only turns its cache off.
    datasets.arrow_dataset.generate_fingerprint = lambda dataset: (
        datasets.fingerprint.generate_random_fingerprint()
    )

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds = time.perf_counter() - self.started

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                report("trl", seed, state.global_step, self.seconds, float(logs["reward"]))

    bf16 = dtype == "bfloat16"
    args = GRPOConfig(
        output_dir=str(output_dir), seed=seed, max_steps=steps, learning_rate=learning_rate,
        per_device_train_batch_size=group_size, gradient_accumulation_steps=groups,
        num_generations=group_size, max_completion_length=max_completion_length,
        temperature=1.0, shuffle_dataset=False, use_cpu=True, bf16=bf16, logging_steps=1,
        report_to="none", save_strategy="no", disable_tqdm=True, lr_scheduler_type="constant",
        **trl_settings,
    )  # fmt: skip
    completions_file = output_dir / COMPLETIONS_FILE
    completions_file.unlink(missing_ok=True)
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(str(model), dtype="float32"),
        reward_funcs=recorded(reward, completions_file),
        args=args,
        train_dataset=Dataset.from_dict(rows),
        processing_class=AutoTokenizer.from_pretrained(str(model), padding_side="left"),
        callbacks=[StepClock()],
        **({"environment_factory": environment_factory} if environment_factory else {}),
    )
    if tool_specs is not None:
        show_tool_specs(trainer, tool_specs)
    trainer.train()


def recorded(reward, path: Path):
    """``reward``, also appending each call's completions and rewards to ``path`` as one JSON line
    (``{"step": n, "episodes": [{"messages", "target", "reward"}]}``): TRL scores a step's whole
    generation batch in one call, so the n-th call is step n. ``bench/episode_stats.py`` reads them."""
    calls = [0]

    def score(completions: list[list[dict]], target: list[str], **kwargs) -> list[float]:
        rewards = reward(completions, target, **kwargs)
        calls[0] += 1
        episodes = [
            {"messages": messages, "target": wanted, "reward": value}
            for messages, wanted, value in zip(completions, target, rewards, strict=True)
        ]
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as handle:
            handle.write(json.dumps({"step": calls[0], "episodes": episodes}, default=str) + "\n")
        return rewards

    score.__name__ = reward.__name__  # TRL names its per-function reward metric after it
    return score


def show_tool_specs(trainer, tool_specs: list[dict]) -> None:
    """Make ``trainer`` render (and parse with) ``tool_specs`` instead of the schemas it builds from
    its environment's methods.

    TRL lists an environment's methods alphabetically and adds each one's return type to its schema,
    so its prompts showed a tool block other than the one the model was warm-started on (468 tokens
    against our 443: another order, a ``return`` field, no ``additionalProperties``). Its first steps
    then scored lower than ours on the same model and tasks (0.52 against 0.73 a step, sessions 18
    and 29), which is the prompt, not the algorithm. TRL 1.16 keeps the rendered tools in
    ``_env_tools`` (used to render prompts and to read calls); the calls still run through the
    environment's methods (``_sync_tool_dicts``).
    """
    if not isinstance(getattr(trainer, "_env_tools", None), dict) or not trainer._env_tools:
        raise SystemExit("this TRL has no environment tools in `_env_tools`: the bench pins trl==1.16.0")
    trainer._env_tools = {name: list(tool_specs) for name in trainer._env_tools}


# ---------------------------------------------------------------- the driver


def run_side(side: str, model: Path, seed: int, steps: int, args: argparse.Namespace) -> list[dict]:
    """One side's run of ``steps`` steps for ``seed`` in a fresh process; its per-step records."""
    env = dict(os.environ)
    if side == "trl":
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(args.trl_dir), str(REPO), env.get("PYTHONPATH")])
        )
    command = [sys.executable, __file__, f"--side={side}", f"--model={model}", f"--seed={seed}",
               f"--steps={steps}", f"--dtype={args.dtype}", f"--work-dir={args.work_dir}",
               f"--learning-rate={args.learning_rate}", f"--work={args.work}"]  # fmt: skip
    if side == "ours":
        command += [f"--ours-config={setting}" for setting in args.ours_config]
        command.append(f"--error-text={args.error_text}")
    started = time.perf_counter()
    process = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
    records = [
        json.loads(line[len(RESULT) :]) for line in process.stdout.splitlines() if line.startswith(RESULT)
    ]
    if process.returncode != 0 or len(records) != steps:
        sys.stderr.write(process.stdout[-4000:] + process.stderr[-4000:])
        raise SystemExit(f"{side} seed {seed}: exit {process.returncode}, {len(records)} of {steps} steps")
    print(f"  {side:<4} seed {seed}: {time.perf_counter() - started:.0f} s wall; "
          + ", ".join(f"{r['seconds']:.0f} s/{r['reward']:.2f}" for r in records), flush=True)  # fmt: skip
    return records


def summarise(records: list[dict], steps: int, shape: str) -> None:
    def per_step(side: str) -> list[float]:
        return [statistics.mean(r["reward"] for r in records if r["side"] == side and r["step"] == s)
                for s in range(1, steps + 1)]  # fmt: skip

    def step_seconds(side: str) -> float:
        return statistics.median(r["seconds"] for r in records if r["side"] == side)

    seeds = sorted({r["seed"] for r in records})
    sides = [side for side in ("ours", "trl") if any(r["side"] == side for r in records)]
    print(f"\nreward per step, mean over {len(seeds)} seed(s) (each step: {shape}):")
    for side in sides:
        curve = per_step(side)
        print(
            f"  {side:<4} "
            + "  ".join(f"{value:.3f}" for value in curve)
            + f"   mean {statistics.mean(curve):.3f}"
        )
    seconds_by_side = {side: step_seconds(side) for side in sides}
    if len(sides) == 2:
        ours, trl = seconds_by_side["ours"], seconds_by_side["trl"]
        print(f"median step time: ours {ours:.1f} s, TRL {trl:.1f} s: ours / TRL = {ours / trl:.2f}x")
    for side, seconds in seconds_by_side.items():
        rewards = [r["reward"] for r in records if r["side"] == side]
        print(f"  {side:<4} mean reward {statistics.mean(rewards):.3f} a step, "
              f"{statistics.mean(rewards) / (seconds / 60):.3f} a wall-minute of steps")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--install", action="store_true", help="install TRL into --trl-dir and stop")
    parser.add_argument("--trl-dir", type=Path, default=DEFAULT_TRL_DIR)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="1 seed x 2 steps")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--work-dir", type=Path, default=WORK_DIR)
    parser.add_argument("--work", choices=WORKS, default="multi-turn")
    parser.add_argument(
        "--learning-rate", type=float, default=None, help="default: the demo's 5e-5; single-turn's 2e-5"
    )
    parser.add_argument(
        "--ours-config", action="append", default=[], metavar="KEY=VALUE",
        help="a GRPOConfig setting of our side (repeatable), e.g. loss_normalizer=batch_groups",
    )  # fmt: skip
    parser.add_argument(
        "--error-text", choices=("ours", "trl"), default="ours",
        help="how our side's failed tool calls read: ours (tool_error: ...) or TRL's ({'error': ...})",
    )  # fmt: skip
    parser.add_argument("--only", choices=("ours", "trl"), help="run one side only (its seeds and steps)")
    parser.add_argument("--side", choices=("prepare", "ours", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    single = args.work == "single-turn"
    if args.learning_rate is None:
        args.learning_rate = SINGLE_LEARNING_RATE if single else DEMO_LEARNING_RATE
    if args.install:
        install(args.trl_dir)
        return
    if args.side == "prepare":
        prepare(args.work_dir, args.dtype)
        return
    overrides = parse_overrides(args.ours_config)
    if args.side == "ours":
        common = (args.model, args.seed, args.steps, args.dtype, args.work_dir, args.learning_rate, overrides)
        if single:
            run_ours_single(*common)
        else:
            run_ours(*common, error_text=args.error_text)
        return
    if args.side == "trl":
        runner = run_trl_single if single else run_trl
        runner(args.model, args.seed, args.steps, args.dtype, args.work_dir, args.learning_rate)
        return
    if args.only != "ours" and not (args.trl_dir / "trl").is_dir():
        raise SystemExit(f"TRL is not in {args.trl_dir}: run `python bench/bench_trl.py --install` first")
    seeds, steps = (1, 2) if args.quick else (args.seeds, args.steps)
    warm_started = args.work_dir / "prepare" / "warm_start_model"
    # Single-turn starts from the base model (its arithmetic owes nothing to the tool warm-start).
    model = args.work_dir / "base_model" if single else warm_started
    if not (warm_started / "config.json").is_file():
        print(f"preparing the warm-started model in {model} (once)", flush=True)
        # In its own process: the driver holds no model while the sides run.
        subprocess.run([sys.executable, __file__, "--side=prepare", f"--dtype={args.dtype}",
                        f"--work-dir={args.work_dir}"], cwd=REPO, check=True)  # fmt: skip
    groups, group_size = (SINGLE_GROUPS, SINGLE_GROUP_SIZE) if single else (GROUPS, GROUP_SIZE)
    shape = f"{groups * group_size} episodes of {groups} tasks"
    print(
        f"{args.work}: {seeds} seed(s) x {steps} steps, {groups}x{group_size} episodes a step, "
        f"{args.dtype}, learning rate {args.learning_rate:g}:",
        flush=True,
    )
    records: list[dict] = []
    for seed in range(seeds):
        order = ("ours", "trl") if seed % 2 == 0 else ("trl", "ours")
        for side in order if args.only is None else (args.only,):
            records += run_side(side, model, seed, steps, args)
    summarise(records, steps, shape)


if __name__ == "__main__":
    main()
