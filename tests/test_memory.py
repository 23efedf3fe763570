"""What keeps a run's memory bounded: the prefix cache's default bound, activation checkpointing,
one model for lockstep's trainer and generator, memory handed back to the system, checkpoints kept."""

from __future__ import annotations

import asyncio
import copy
import os
import random
import subprocess
import sys
import weakref

import pytest
import torch

from cookbook_lib.envs import Task
from cookbook_lib.generators import HFGenerator, SamplingParams
from cookbook_lib.generators.hf import DEFAULT_PREFIX_CACHE_TOKENS
from cookbook_lib.grpo.config import ConfigError, GRPOConfig
from cookbook_lib.grpo.trainer import PolicyTrainer, enable_activation_checkpointing
from cookbook_lib.rollout.episode import TokenSequence


def _sequences(count: int, length: int, seed: int = 0) -> list[TokenSequence]:
    rng = random.Random(seed)
    return [
        TokenSequence(
            tokens_T=[rng.randrange(100, 40000) for _ in range(length)],
            assistant_mask_T=[position % 4 == 3 for position in range(length)],
            sampling_logprobs_T=[0.0] * length,
            policy_versions_T=[0] * length,
        )
        for _ in range(count)
    ]


def test_the_prefix_cache_is_bounded_in_tokens_by_default(tiny_model_and_tokenizer):
    model = tiny_model_and_tokenizer[0]
    rng = random.Random(0)
    # 20 finished samples of ~1000 tokens: within the 64 entries, over the default token bound.
    prompts = [[rng.randrange(100, 40000) for _ in range(1000)] for _ in range(20)]

    async def main():
        async with HFGenerator(model, pad_token_id=2) as generator:
            for prompt in prompts:
                await generator.sample(prompt, SamplingParams(max_tokens=2))
            return generator.num_cached_prefixes, generator._prefixes.num_tokens

    kept, tokens = asyncio.run(main())
    assert 0 < tokens <= DEFAULT_PREFIX_CACHE_TOKENS
    assert 0 < kept < len(prompts)


def _saved_bytes(model: torch.nn.Module, ids_BT: torch.Tensor) -> int:
    """Bytes the autograd graph keeps for the backward pass of one training-mode forward."""
    storages: dict[int, int] = {}
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model.model(input_ids=ids_BT, use_cache=False)
    model.eval()
    return sum(storages.values())


def test_activation_checkpointing_keeps_a_fraction_of_the_activations():
    from cookbook_lib.runtime.models import tiny_random_model

    plain = tiny_random_model(seed=0, num_layers=4)[0]
    checkpointed = copy.deepcopy(plain)
    enable_activation_checkpointing(checkpointed)
    ids_BT = torch.randint(100, 40000, (2, 256))
    assert _saved_bytes(checkpointed, ids_BT) * 4 < _saved_bytes(plain, ids_BT)


@pytest.mark.parametrize("use_lora", [False, True])
def test_activation_checkpointing_changes_no_gradient(tiny_model_and_tokenizer, use_lora):
    model = tiny_model_and_tokenizer[0]
    sequences = _sequences(3, 64)

    def trained(checkpointing: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)  # the same LoRA initialisation
        trainer = PolicyTrainer(
            copy.deepcopy(model),
            pad_token_id=2,
            learning_rate=1e-2,
            micro_batch_tokens=128,
            use_lora=use_lora,
            activation_checkpointing=checkpointing,
        )
        metrics = trainer.sft_step(sequences)
        assert metrics["grad_norm"] > 0
        return {name: tensor.clone() for name, tensor in trainer.export_weights().items()}

    plain, checkpointed = trained(False), trained(True)
    assert plain.keys() == checkpointed.keys()
    for name, tensor in plain.items():
        torch.testing.assert_close(checkpointed[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_a_model_without_checkpointing_support_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="activation_checkpointing=False"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2))


def test_lockstep_samples_from_the_trained_model_and_async_from_a_copy(
    tiny_model_and_tokenizer, tiny_model_dir, tmp_path
):
    from cookbook_lib.grpo.train import _sampling_model
    from cookbook_lib.runtime.devices import resolve_precision

    model = tiny_model_and_tokenizer[0]
    precision = resolve_precision("cpu", "float32")
    lockstep = GRPOConfig(model=tiny_model_dir, runs_dir=str(tmp_path), wandb_project=None)
    assert _sampling_model(model, precision, lockstep) is model
    for other in (
        dict(max_steps_off_policy=1),  # async: sampling goes on while the weights change
        dict(num_generator_replicas=2),
        dict(use_lora=True),
    ):
        config = GRPOConfig(model=tiny_model_dir, runs_dir=str(tmp_path), wandb_project=None, **other)
        assert _sampling_model(model, precision, config) is not model, other


def _resident_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


_RELEASE_PROBE = """
import torch
from cookbook_lib.runtime.memory import can_release_memory, release_memory

def resident():
    with open("/proc/self/status") as status:
        return int(next(l for l in status if l.startswith("VmRSS:")).split()[1]) * 1024

assert can_release_memory()
pairs = [(torch.ones(25_000), torch.ones(256)) for _ in range(3000)]
pins = [pin for _, pin in pairs]
del pairs
held = resident()
release_memory()
print(held - resident())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
def test_release_memory_hands_freed_heap_memory_back_to_the_system():
    # In a fresh interpreter: what glibc can hand back depends on the heap's history, and a test
    # process that has run hundreds of tests (and threads with arenas of their own) has a long one.
    # 100 KB blocks come from the heap (below glibc's mmap threshold), each followed by a small
    # one that stays: freed, the large blocks are holes that glibc's own trimming (of the heap's
    # top only) cannot return. A training step frees its activations in the same way.
    done = subprocess.run([sys.executable, "-c", _RELEASE_PROBE], capture_output=True, text=True, check=True)
    assert int(done.stdout.split()[-1]) > 150 * 1024**2


_MAPPED_PROBE = """
import torch
from cookbook_lib.runtime.memory import large_blocks_mapped, release_memory

def resident():
    with open("/proc/self/status") as status:
        return int(next(l for l in status if l.startswith("VmRSS:")).split()[1]) * 1024

def returned_on_free():
    pairs = [(torch.ones(100_000), torch.ones(256)) for _ in range(1000)]  # 400 KB blocks
    pins = [pin for _, pin in pairs]
    held = resident()
    del pairs
    returned = held - resident()
    del pins
    release_memory()
    return returned

with large_blocks_mapped(), large_blocks_mapped():  # nested, as overlapping steps are
    inside = returned_on_free()
print(inside, returned_on_free())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
@pytest.mark.parametrize("huge_pages", ["0", "1"])
def test_large_blocks_mapped_returns_freed_blocks_at_once_and_only_within_the_block(huge_pages):
    # A fresh process: glibc serves a block from the free memory its arenas already hold before
    # it maps a new one, and this test process's arenas hold whatever earlier tests freed.
    # The probe imports torch first, so THP_MEM_ALLOC_ENABLE is what this test sets.
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": huge_pages}
    command = [sys.executable, "-c", _MAPPED_PROBE]
    completed = subprocess.run(command, capture_output=True, text=True, check=True, timeout=300, env=env)
    inside, outside = map(int, completed.stdout.split())
    if huge_pages == "1":
        assert inside < 100 * 1024**2  # under 32 MB: kept in the arenas (memory.step_mmap_threshold)
    else:
        assert inside > 300 * 1024**2  # 400 KB blocks: mapped within a step, returned when freed
    assert outside < 100 * 1024**2  # after the block, glibc's threshold is back at 32 MB


def test_keep_last_checkpoints_bounds_the_checkpoints_on_disk(tiny_model_dir, tmp_path):
    from cookbook_lib.grpo.train import train_single_turn

    config = GRPOConfig(
        model=tiny_model_dir,
        batch_size=2,
        episodes_per_task=2,
        num_steps=3,
        validation_interval=0,
        max_turns=1,
        max_model_length=256,
        max_tokens_per_turn=8,
        micro_batch_tokens=512,
        learning_rate=1e-3,
        overlong_buffer_tokens=16,
        checkpoint_interval=1,
        keep_last_checkpoints=1,
        runs_dir=str(tmp_path),
        run_name="keep-one",
        wandb_project=None,
    )
    tasks = [Task(prompt=f"Say a word with {n} letters.", target=None) for n in range(4)]
    train_single_turn(config, tasks=tasks, reward_fn=lambda task, reply: len(reply) % 3 / 2)
    kept = sorted(path.name for path in (tmp_path / "keep-one" / "checkpoints").iterdir())
    assert kept == ["latest", "step_000003"]
    with pytest.raises(ConfigError, match="keep_last_checkpoints must be >= 1"):
        GRPOConfig(keep_last_checkpoints=0, wandb_project=None).validate()


def test_a_step_collects_young_garbage_only(monkeypatch):
    """A full collection walks every object (~0.23 s with transformers imported): steps skip it."""
    import gc

    from cookbook_lib.runtime import memory

    generations: list[int | None] = []
    real_collect = gc.collect
    monkeypatch.setattr(
        memory.gc, "collect", lambda *g: generations.append(g[0] if g else None) or real_collect(*g)
    )
    memory.release_memory(full_collection=False)
    memory.release_memory()
    assert generations == [1, 2]

    class Node:
        pass

    cycle = Node()
    cycle.self, cycle.tensor = cycle, torch.ones(8)  # a step's garbage: young, in a reference cycle
    alive = weakref.ref(cycle)
    del cycle
    memory.release_memory(full_collection=False)
    assert alive() is None
