"""Progress bars on the long waits, and no transformers / huggingface_hub noise in a run's output."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
import torch

from cookbook_lib.envs import Task
from cookbook_lib.grpo.config import GRPOConfig
from cookbook_lib.grpo.sft import Demonstration
from cookbook_lib.grpo.train import WarmStart, train_single_turn
from cookbook_lib.runtime import progress
from cookbook_lib.runtime.checkpoint import save_checkpoint
from cookbook_lib.runtime.models import load_model, load_tokenizer
from cookbook_lib.runtime.progress import LiveProgress, progress_bar, progress_enabled, tokens_status
from cookbook_lib.runtime.quiet import quiet_libraries
from cookbook_lib.types import Message

# What transformers and huggingface_hub print on their own when nobody silences them.
LIBRARY_NOISE = ("Loading weights", "Writing model shards", "it/s]", "s/it]", "Warning", "warn(")


def assert_no_library_noise(text: str) -> None:
    found = [noise for noise in LIBRARY_NOISE if noise in text]
    assert not found, f"library output leaked: {found}\n{text}"


@pytest.mark.parametrize(
    ("setting", "expected"), [("1", True), ("on", True), ("0", False), ("false", False), ("auto", False)]
)
def test_the_environment_variable_turns_bars_on_and_off(monkeypatch, setting, expected):
    monkeypatch.setenv(progress.PROGRESS_ENV, setting)
    assert progress_enabled() is expected  # "auto": pytest's captured stderr is not a terminal


def test_auto_shows_bars_on_a_terminal(monkeypatch):
    class Terminal:
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv(progress.PROGRESS_ENV, raising=False)
    monkeypatch.setattr("sys.stderr", Terminal())
    assert progress_enabled()


def test_a_bad_setting_says_which_values_work(monkeypatch):
    monkeypatch.setenv(progress.PROGRESS_ENV, "sometimes")
    with pytest.raises(ValueError, match=r"COOKBOOK_PROGRESS='sometimes'.*use 1 .* 0 .* auto"):
        progress_enabled()


def test_a_bar_shows_when_on_and_is_silent_when_off(monkeypatch, capsys):
    monkeypatch.setenv(progress.PROGRESS_ENV, "1")
    with progress_bar("copying", total=3, unit="file") as bar:
        bar.update(3)
    assert "copying" in capsys.readouterr().err
    monkeypatch.setenv(progress.PROGRESS_ENV, "0")
    with progress_bar("copying", total=3) as bar:
        bar.update(3)  # the stand-in takes the same calls
        bar.set_postfix_str("done")
    assert list(progress_bar("items", iterable=[1, 2, 3])) == [1, 2, 3]
    monkeypatch.setenv(progress.PROGRESS_ENV, "1")
    with progress_bar("hidden", total=1, show=False) as bar:
        bar.update()
    assert capsys.readouterr().err == ""


def test_a_live_bar_rereads_its_status_while_waiting(monkeypatch, capsys):
    monkeypatch.setenv(progress.PROGRESS_ENV, "1")
    monkeypatch.setattr(progress, "TICK_S", 0.01)
    reads = []

    def status() -> str:
        reads.append(len(reads))
        return f"{len(reads)} reads"

    async def main() -> int:
        async with LiveProgress("episodes", 2, unit="episode", status=status) as live:
            await asyncio.sleep(0.2)  # nothing finishes: only the ticker moves the bar
            live.done()
            live.done()
            assert live.bar is not None and live.bar.n == 2
        return len(reads)

    assert asyncio.run(main()) >= 5
    assert "episodes" in capsys.readouterr().err


def test_a_live_bar_when_off_reads_no_status(monkeypatch):
    monkeypatch.setenv(progress.PROGRESS_ENV, "0")

    def status() -> str:
        raise AssertionError("a hidden bar must not poll its status")

    async def main() -> None:
        async with LiveProgress("episodes", 1, status=status) as live:
            live.done()

    asyncio.run(main())


def test_tokens_status_counts_the_tokens_sampled_since_it_was_made():
    class Stats:
        tokens_sampled = 100

    class Generator:
        stats = Stats()

    generators = [Generator(), object()]  # a generator without stats counts 0
    status = tokens_status(generators)
    Generator.stats.tokens_sampled = 1334
    assert status() == "1,234 tokens sampled"


def test_quiet_libraries_silences_and_then_restores_transformers_and_the_hub():
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging as transformers_logging

    before = (transformers_logging.get_verbosity(), transformers_logging.is_progress_bar_enabled())
    hub_before = are_progress_bars_disabled()
    with quiet_libraries():
        with quiet_libraries():  # nested: the inner exit must not restore early
            pass
        assert transformers_logging.get_verbosity() == logging.ERROR
        assert not transformers_logging.is_progress_bar_enabled()
        assert are_progress_bars_disabled()
    assert (transformers_logging.get_verbosity(), transformers_logging.is_progress_bar_enabled()) == before
    assert are_progress_bars_disabled() == hub_before


def test_quiet_libraries_shared_by_threads_restores_once_the_last_one_leaves():
    from transformers.utils import logging as transformers_logging

    before = transformers_logging.get_verbosity()
    inside, release = threading.Event(), threading.Event()

    def other_thread() -> None:
        with quiet_libraries():
            inside.set()
            release.wait(5)

    worker = threading.Thread(target=other_thread)
    worker.start()
    inside.wait(5)
    with quiet_libraries():
        pass  # this thread leaves first: the other one is still inside
    assert transformers_logging.get_verbosity() == logging.ERROR
    release.set()
    worker.join()
    assert transformers_logging.get_verbosity() == before


def test_loading_and_checkpointing_a_model_print_nothing(tiny_model_dir, tmp_path, capfd):
    model = load_model(tiny_model_dir)
    load_tokenizer(tiny_model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer, extra_state={})
    out, err = capfd.readouterr()
    assert_no_library_noise(out + err)
    assert out + err == ""


TASKS = [Task(prompt=f"Say something about {word}.", target=None) for word in ("cats", "rain")]


def test_a_run_shows_our_bars_and_no_library_output(tiny_model_dir, tmp_path, monkeypatch, capfd):
    """Warm-start (and its saved model), sampling, training, validation, checkpoint: all with bars
    on, as in a notebook or a terminal; what transformers would print never appears."""
    monkeypatch.setenv(progress.PROGRESS_ENV, "1")
    config = GRPOConfig(
        model=tiny_model_dir,
        batch_size=1,
        episodes_per_task=2,
        num_steps=1,
        max_turns=1,
        max_model_length=256,
        max_tokens_per_turn=8,
        micro_batch_tokens=512,
        overlong_buffer_tokens=16,
        checkpoint_interval=1,
        runs_dir=str(tmp_path),
        run_name="quiet",
        wandb_project=None,
    )
    demo = Demonstration([Message(role="user", content="hi"), Message(role="assistant", content="aa")], [])
    train_single_turn(
        config,
        tasks=TASKS,
        reward_fn=lambda task, reply: float(len(reply) % 2),
        val_tasks=TASKS[:1],
        warm_start=WarmStart([demo], steps=2, batch_size=1),
    )
    out, err = capfd.readouterr()
    assert_no_library_noise(out + err)
    for bar in ("warm-start", "step 1 sampling", "validation", "saving checkpoint step_000001"):
        assert bar in err, f"no {bar!r} bar in:\n{err}"
    assert "tokens sampled" in err
    # The step lines stay on stdout, one per step, after the warm-start's one line.
    lines = out.splitlines()
    assert lines[-2:] == [line for line in lines if line.startswith("step ")]
    assert any(line.startswith("warm-start: 2 SFT steps | sft loss") for line in lines)


def test_an_optimizer_step_shows_its_micro_batches(tiny_model_and_tokenizer, monkeypatch, capsys):
    import copy

    from cookbook_lib.grpo.loss_settings import LossSettings
    from cookbook_lib.grpo.samples import TrainingSample
    from cookbook_lib.grpo.trainer import PolicyTrainer
    from cookbook_lib.rollout.episode import EndCause

    model, tokenizer = tiny_model_and_tokenizer
    trainer = PolicyTrainer(copy.deepcopy(model), pad_token_id=tokenizer.pad_token_id, learning_rate=1e-3)
    samples = [
        TrainingSample(
            tokens_T=[1, 2, 3, 4 + index, 5, 6],  # different replies: no prefix tree holds both in 6
            loss_mask_T=[False, False, False, True, True, True],
            sampling_logprobs_T=[0.0, 0.0, 0.0, -1.0, -1.0, -1.0],
            policy_versions_T=[0] * 6,
            advantage=advantage,
            group_index=0,
            episode_index=index,
            end_cause=EndCause.TERMINATED,
            reward=advantage,
        )
        for index, advantage in enumerate((1.0, -1.0))
    ]
    trainer.micro_batch_tokens = 6  # one sample per micro-batch: two updates of the bar
    monkeypatch.setenv(progress.PROGRESS_ENV, "1")
    trainer.grpo_step(samples, LossSettings())
    err = capsys.readouterr().err
    # The bar counts micro-batches ("0/2" first); whether "2/2" is drawn depends on tqdm's refresh
    # interval, which a fast machine finishes two micro-batches inside.
    assert "training" in err and "/2 " in err and "micro-batch" in err


def test_quiet_libraries_drops_the_libraries_python_warnings_and_only_those():
    import warnings

    def warn_from(module: str) -> None:
        warnings.warn_explicit(f"from {module}", FutureWarning, "x.py", 1, module=module, registry={})

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filters_before = list(warnings.filters)
        with quiet_libraries():
            warn_from("transformers.modeling_utils")
            warn_from("peft.peft_model")
            warn_from("my_env")  # the user's own warnings still show
        assert list(warnings.filters) == filters_before
        warn_from("transformers.modeling_utils")
    assert [str(w.message) for w in caught] == ["from my_env", "from transformers.modeling_utils"]
