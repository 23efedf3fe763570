"""The CPU block cache (runtime/block_cache): freed large blocks come back to allocations of about
their size, within a bound, unmapped on release; numerics unchanged; off where it cannot be built."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from cookbook_lib.runtime import block_cache
from cookbook_lib.runtime.block_cache import (
    SLACK_BYTES,
    block_cache_active,
    block_cache_stats,
    block_cache_suspended,
    install_block_cache,
    release_block_cache,
    set_block_cache_limit,
)

MB = 1024 * 1024
needs_compiler = pytest.mark.skipif(
    not sys.platform.startswith("linux") or block_cache._compiler() is None,
    reason="the block cache builds with a C++ compiler on Linux",
)


@pytest.fixture
def cache():
    """The installed cache, emptied before and after, with its limit restored."""
    if os.environ.get(block_cache.SWITCH) == "0":
        pytest.skip("COOKBOOK_BLOCK_CACHE=0 in this environment")
    assert install_block_cache(), "a Linux machine with a C++ compiler builds and installs the cache"
    release_block_cache()
    limit = block_cache_stats().limit_bytes
    with block_cache_active():  # as within a training step
        yield
    set_block_cache_limit(limit)
    release_block_cache()


@needs_compiler
def test_a_freed_block_comes_back_to_the_next_allocation_of_about_its_size(cache):
    first = torch.empty(4 * MB, dtype=torch.uint8)
    address = first.data_ptr()
    del first
    assert block_cache_stats().cached_bytes == 4 * MB
    before = block_cache_stats().hits
    # An eighth smaller still fits the cached block; its pages are already there.
    second = torch.empty(4 * MB - MB // 4, dtype=torch.uint8)
    assert second.data_ptr() == address
    assert block_cache_stats().hits == before + 1
    assert block_cache_stats().cached_bytes == 0
    del second
    # Half the size, with room under the peak (plus slack) for a block of its own: a new block,
    # and the 4 MB one waits for a request of its size.
    third = torch.empty(2 * MB, dtype=torch.uint8)
    assert third.data_ptr() != address
    assert block_cache_stats().cached_bytes == 4 * MB and block_cache_stats().hits == before + 1


@needs_compiler
def test_without_room_under_the_peak_a_larger_cached_block_is_cut_to_size(cache):
    big = 2 * SLACK_BYTES
    first = torch.empty(big, dtype=torch.uint8)  # the live peak: 2 slacks
    address = first.data_ptr()
    del first
    # A new block of 1.5 slacks beside the cached 2 would pass the peak by more than the slack:
    # the cached block is cut to size instead, its first pages kept, the rest unmapped.
    second = torch.empty(big * 3 // 4, dtype=torch.uint8)
    assert second.data_ptr() == address
    assert block_cache_stats().cached_bytes == 0
    del second
    assert block_cache_stats().cached_bytes == big * 3 // 4


@needs_compiler
def test_a_miss_unmaps_cached_blocks_until_the_peak_plus_slack_holds(cache):
    piece = SLACK_BYTES // 2
    small = [torch.empty(piece, dtype=torch.uint8) for _ in range(4)]  # live peak: 2 slacks
    del small
    assert block_cache_stats().cached_bytes == 4 * piece
    misses = block_cache_stats().misses
    large = torch.empty(5 * piece // 2, dtype=torch.uint8)  # no cached block fits it
    stats = block_cache_stats()
    assert stats.misses == misses + 1
    # 4 cached + 2.5 new = 6.5 halves of a slack, over the peak's 4 + the slack's 2: one cached
    # block goes, and live + cached stays within the peak plus the slack.
    assert stats.cached_bytes == 3 * piece
    assert stats.live_bytes + stats.cached_bytes <= 4 * piece + SLACK_BYTES
    del large


@needs_compiler
def test_blocks_of_a_few_repeating_sizes_stop_missing(cache):
    """A decode step's sampling: 3 MB and 6 MB blocks, allocated and freed in the same order each step."""

    def step() -> None:
        logits = torch.empty(3 * MB, dtype=torch.uint8)
        scaled = torch.empty(3 * MB, dtype=torch.uint8)
        del logits
        probabilities = torch.empty(6 * MB, dtype=torch.uint8)
        cumulative = torch.empty(6 * MB, dtype=torch.uint8)
        del scaled, probabilities
        chosen = torch.empty(3 * MB, dtype=torch.uint8)
        del cumulative, chosen

    step()
    misses = block_cache_stats().misses
    for _ in range(5):
        step()
    assert block_cache_stats().misses == misses


@needs_compiler
def test_small_blocks_stay_with_torchs_own_allocator(cache):
    live = block_cache_stats().live_bytes
    small = torch.ones(1000)  # 4 KB
    assert block_cache_stats().live_bytes == live
    large = torch.ones(256 * 1024 // 4)  # 256 KB: the threshold
    assert block_cache_stats().live_bytes == live + 256 * 1024
    assert small.sum().item() == 1000 and large.sum().item() == 256 * 1024 // 4


@needs_compiler
def test_the_cache_keeps_at_most_its_limit_and_release_unmaps_it(cache):
    set_block_cache_limit(2 * MB)
    blocks = [torch.empty(MB, dtype=torch.uint8) for _ in range(3)]
    del blocks
    assert block_cache_stats().cached_bytes == 2 * MB  # the third was unmapped when freed
    assert release_block_cache() == 2 * MB
    assert block_cache_stats().cached_bytes == 0
    set_block_cache_limit(0)
    torch.empty(MB, dtype=torch.uint8)  # freed at once
    assert block_cache_stats().cached_bytes == 0


@needs_compiler
def test_lowering_the_limit_unmaps_what_waits_beyond_it(cache):
    set_block_cache_limit(8 * MB)
    torch.empty(4 * MB, dtype=torch.uint8)  # freed at once
    assert block_cache_stats().cached_bytes == 4 * MB
    set_block_cache_limit(MB)
    assert block_cache_stats().cached_bytes == 0
    with pytest.raises(ValueError, match="0 or more bytes"):
        set_block_cache_limit(-1)


@needs_compiler
def test_reused_blocks_hold_what_each_tensor_writes(cache):
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        values = torch.randn(300_000, generator=generator)
        copy = values.clone()  # a second block, the first one's size
        assert torch.equal(values, copy)
        zeros = torch.zeros(300_000)  # a cached block, zeroed
        assert not zeros.any()
    assert block_cache_stats().hits > 0


@needs_compiler
def test_threads_allocating_and_freeing_at_once_leave_the_accounts_even(cache):
    live = block_cache_stats().live_bytes
    errors: list[BaseException] = []

    def churn(seed: int) -> None:
        try:
            generator = torch.Generator().manual_seed(seed)
            for step in range(200):
                a = torch.randn(70_000 + 4_000 * (step % 5), generator=generator)
                b = a * 2
                assert torch.allclose(b / 2, a)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=churn, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert block_cache_stats().live_bytes == live


@needs_compiler
def test_outside_an_active_block_large_tensors_go_to_torchs_allocator_and_nothing_is_kept():
    if os.environ.get(block_cache.SWITCH) == "0":
        pytest.skip("COOKBOOK_BLOCK_CACHE=0 in this environment")
    assert install_block_cache()
    release_block_cache()
    live = block_cache_stats().live_bytes
    outside = torch.empty(2 * MB, dtype=torch.uint8)  # a decode step's logits, say
    assert block_cache_stats().live_bytes == live
    with block_cache_active(), block_cache_active():  # nested, as overlapping steps are
        inside = torch.empty(2 * MB, dtype=torch.uint8)
        assert block_cache_stats().live_bytes == live + 2 * MB
    assert block_cache_stats().live_bytes == live + 2 * MB  # still alive after the step
    del inside, outside  # freed after the last step ended: unmapped, not kept
    stats = block_cache_stats()
    assert stats.live_bytes == live and stats.cached_bytes == 0


@needs_compiler
def test_suspended_the_cache_serves_nothing_even_inside_a_step(cache):
    live = block_cache_stats().live_bytes
    with block_cache_suspended(), block_cache_active():  # a training step of a bench's baseline arm
        before = torch.empty(2 * MB, dtype=torch.uint8)
        assert block_cache_stats().live_bytes == live
    after = torch.empty(2 * MB, dtype=torch.uint8)  # the fixture's step goes on, served again
    assert block_cache_stats().live_bytes == live + 2 * MB
    del before, after


@needs_compiler
def test_a_failing_build_leaves_torch_allocating_as_before(tmp_path, monkeypatch, caplog):
    fake = tmp_path / "c++"
    fake.write_text("#!/bin/sh\necho 'fatal error: no headers here' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("COOKBOOK_CACHE_DIR", str(tmp_path / "cache"))
    block_cache._library.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger=block_cache.__name__):
            assert block_cache._library() is None
        assert "CPU block cache off" in caplog.text and "no headers here" in caplog.text
    finally:
        block_cache._library.cache_clear()  # the real build again, from its cache


def test_the_limit_variable_is_checked():
    for raw, message in (("lots", "whole number"), ("-5", "0 or more")):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(block_cache.LIMIT_VARIABLE, raw)
            with pytest.raises(ValueError, match=message):
                block_cache.limit_bytes()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(block_cache.LIMIT_VARIABLE, "64")
        assert block_cache.limit_bytes() == 64 * MB
        patch.delenv(block_cache.LIMIT_VARIABLE)
        assert block_cache.limit_bytes() == block_cache.DEFAULT_LIMIT_MB * MB


_TRAIN_TWO_STEPS = """
import hashlib, json, torch
from cookbook_lib.grpo.loss_settings import LossSettings
from cookbook_lib.grpo.config import GRPOConfig
from cookbook_lib.grpo.trainer import PolicyTrainer
from cookbook_lib.runtime.block_cache import block_cache_stats
from cookbook_lib.runtime.models import tiny_random_model
from prefix_tree_samples import episodes

torch.manual_seed(0)
model, tokenizer = tiny_random_model(seed=0)
trainer = PolicyTrainer(model, pad_token_id=tokenizer.pad_token_id, learning_rate=1e-3,
                        activation_checkpointing=True)
settings = LossSettings.from_config(GRPOConfig(model="tiny"))
losses = [trainer.grpo_step(episodes(model.config.vocab_size, seed), settings)["loss"] for seed in (0, 1)]
digest = hashlib.sha256()
for parameter in trainer.model.parameters():
    digest.update(parameter.detach().numpy().tobytes())
stats = block_cache_stats()
print("RESULT " + json.dumps({"losses": losses, "weights": digest.hexdigest(),
                              "hits": stats.hits if stats else None}))
"""


def _train_two_steps(switch: str) -> dict:
    env = {**os.environ, block_cache.SWITCH: switch, "COOKBOOK_FIT_THREADS": "0"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", _TRAIN_TWO_STEPS], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@needs_compiler
def test_training_steps_give_the_same_weights_bit_for_bit_with_and_without_the_cache():
    off, on = _train_two_steps("0"), _train_two_steps("1")
    assert off["hits"] is None  # switched off: never installed
    assert on["hits"] > 0  # the steps' activations and logits reused cached blocks
    assert on["losses"] == off["losses"]
    assert on["weights"] == off["weights"]


@needs_compiler
def test_a_repeated_prefill_of_many_block_sizes_takes_every_block_from_the_cache(cache):
    # A prefill's layers each allocate blocks of several sizes (the embedded model's 16 x 419-token
    # forward: ~20 sizes from 1.3 to 41 MB) and free them before the next layer, while each layer's
    # keys and values stay. With 32 MB of slack, misses evicted the large blocks the next layer
    # wanted again, and the second identical prefill faulted 2.3 GB (docs/benchmarks.md, session 25).
    sizes_mb = (41, 20, 15, 13, 8, 4, 3)

    def prefill() -> list[torch.Tensor]:
        kept = []
        for _ in range(6):  # layers
            previous = None
            for size in sizes_mb:  # each op's output lives until the next op has read it
                output = torch.empty(size * MB, dtype=torch.uint8)
                previous = output
            kept.append(torch.empty(2 * MB, dtype=torch.uint8))  # this layer's keys and values
            del previous, output
        return kept

    prefill()  # its blocks, the kept ones too, wait in the cache afterwards
    misses = block_cache_stats().misses
    prefill()
    assert block_cache_stats().misses == misses
