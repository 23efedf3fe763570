"""Fixed-shape decoding (``slot_batch.py``) on the CPU: when ``HFGenerator`` picks it, what it
refuses and why, growth of slots and columns mid-flight, the eager attention mask, and the CUDA
graph bookkeeping, with a stand-in for ``torch.cuda.CUDAGraph`` that checks what a real graph
relies on (static inputs written in place, never replaced).

test_generators.py runs every generator test over this path as well; tests/gpu/test_cuda.py runs
it with real graphs.
"""

from __future__ import annotations

import asyncio
import copy
import logging

import pytest
import torch

from cookbook_lib.generators import HFGenerator, SamplingParams, slot_batch
from cookbook_lib.generators import hf as hf_module
from cookbook_lib.generators.batch import DecodeBatch, Request
from cookbook_lib.generators.hf import fixed_shape_by_default
from cookbook_lib.generators.slot_batch import (
    SlotDecodeBatch,
    SlotLayer,
    StaticInputs,
    bucket_for,
    capacity_for,
    fixed_shape_decode_supported,
)

GREEDY = SamplingParams(temperature=0, max_tokens=12)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(sharp_model):
    return sharp_model


def sample_all(model, prompts, params=GREEDY, *, stagger: bool = False, **kwargs):
    """Samples every prompt concurrently (with ``stagger``, each request a little after the last,
    so rows join a running batch). Returns the results, the generator (closed by then) and the
    batch's ``(slots, columns)`` after each forward (both 0 on the growing cache)."""
    shapes: list[tuple[int, int]] = []

    async def main():
        async with HFGenerator(model, pad_token_id=2, **kwargs) as generator:
            batch = generator._batch
            generator._step_callback = lambda step: shapes.append(
                (getattr(batch, "slots", 0), batch.columns if generator.fixed_shape_decode else 0)
            )

            async def one(i: int, prompt: list[int]):
                if stagger:
                    while generator.stats.decode_steps < 2 * i:
                        await asyncio.sleep(0.001)
                return await generator.sample(prompt, params)

            results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            return results, generator

    results, generator = asyncio.run(asyncio.wait_for(main(), 120))
    return results, generator, shapes


def test_the_cpu_keeps_the_growing_cache_and_cuda_picks_slots_where_the_model_allows(model, sliding_model):
    assert not HFGenerator(model, pad_token_id=2).fixed_shape_decode
    assert HFGenerator(model, pad_token_id=2, fixed_shape_decode=True).fixed_shape_decode
    assert fixed_shape_by_default(model, torch.device("cuda"))
    assert not fixed_shape_by_default(model, torch.device("cpu"))
    assert not fixed_shape_by_default(sliding_model, torch.device("cuda"))


def test_a_model_that_cannot_use_slots_is_refused_with_the_reason(model, sliding_model):
    reason = fixed_shape_decode_supported(sliding_model)
    assert isinstance(reason, str) and "sliding window" in reason
    with pytest.raises(ValueError, match=r"fixed_shape_decode=True.*sliding window.*fixed_shape_decode=None"):
        HFGenerator(sliding_model, pad_token_id=0, fixed_shape_decode=True)
    flash = copy.deepcopy(model)
    flash.config._attn_implementation_internal = "flash_attention_2"
    assert "attn_implementation='sdpa'" in fixed_shape_decode_supported(flash)
    with pytest.raises(ValueError, match="flash_attention_2"):
        SlotDecodeBatch(flash, pad_token_id=2, device=torch.device("cpu"))


def test_buckets_and_capacities():
    assert [bucket_for(n) for n in (1, 8, 9, 16, 17, 64, 65)] == [8, 8, 16, 16, 32, 64, 128]
    assert capacity_for(10, 4096) == slot_batch.MIN_CAPACITY
    assert capacity_for(300, 4096) == 512
    assert capacity_for(300, 400) == 400  # no more than the context when the need fits in it
    assert capacity_for(401, 400) == 512  # a row past the context still gets its column


def test_slot_layer_writes_each_row_at_its_own_position():
    shape = StaticInputs(slots=4, device=torch.device("cpu"))
    keys, values = torch.zeros(4, 2, 6, 3), torch.zeros(4, 2, 6, 3)
    layer = SlotLayer(keys, values, shape)
    shape.positions_S[:] = torch.tensor([0, 5, 2, 3])
    new_keys = torch.arange(2 * 2 * 3, dtype=torch.float32).view(2, 2, 1, 3) + 1  # a step over 2 slots
    got_keys, got_values = layer.update(new_keys, -new_keys)
    assert got_values.shape == got_keys.shape
    assert got_keys.shape == (2, 2, 6, 3)  # the bucket's slots, every column
    assert torch.equal(keys[0, :, 0], new_keys[0, :, 0]) and torch.equal(keys[1, :, 5], new_keys[1, :, 0])
    assert torch.equal(values[1, :, 5], -new_keys[1, :, 0])
    assert keys.count_nonzero() == new_keys.numel()  # nothing else written, slots 2 and 3 untouched


def drive(batch, waves: dict[int, list[tuple[list[int], SamplingParams]]]) -> tuple[dict, list]:
    """Runs a batch by hand, with no thread: ``waves[k]`` are admitted before decode step ``k``.
    Returns each request's tokens (by its index in the waves) and the ``(rows, slots)`` per step."""
    loop = asyncio.new_event_loop()
    order, tokens, shapes = {}, {}, []
    alive = []  # every request stays referenced, so no two share an id()
    try:
        with torch.inference_mode():
            step = 0
            while step <= max(waves) or len(batch):
                requests = []
                for prompt, params in waves.get(step, []):
                    request = Request(prompt, params, torch.Generator(), loop.create_future(), loop)
                    order[id(request)] = len(order)
                    requests.append(request)
                    alive.append(request)
                finished = batch.admit(requests, version=0) if requests else []
                if len(batch):
                    shapes.append((len(batch), getattr(batch, "slots", 0)))
                    finished += batch.step(version=0)
                for row in finished:
                    tokens[order[id(row.request)]] = row.tokens
                step += 1
    finally:
        loop.close()
    return tokens, shapes


def waves_of(prompts, sizes: list[int], every: int = 2) -> dict:
    """Waves of ``sizes[k]`` requests every ``every`` steps, with different lengths so that rows
    finish one after another."""
    waves, n = {}, 0
    for k, size in enumerate(sizes):
        wave = []
        for i in range(n, n + size):
            prompt = prompts[i % len(prompts)] + [17] * (i % 3)
            wave.append((prompt, SamplingParams(temperature=0, max_tokens=3 + i % 11)))
        waves[every * k], n = wave, n + size
    return waves


def test_rows_joining_a_running_batch_grow_the_slots_and_sample_what_the_growing_cache_does(model, prompts):
    waves = waves_of(prompts, [5, 6, 10])  # 5 rows, then 11 (slots 8 -> 16), then ~18 (-> 32)
    growing, _ = drive(DecodeBatch(model, pad_token_id=2, device=CPU), waves)
    slot_tokens, shapes = drive(SlotDecodeBatch(model, pad_token_id=2, device=CPU), waves)
    assert slot_tokens == growing and len(growing) == 21
    assert [slots for _, slots in shapes][:1] == [8] and max(slots for _, slots in shapes) == 32
    assert all(rows <= slots for rows, slots in shapes)


def test_a_long_prompt_joining_mid_flight_grows_the_columns(model, prompts):
    long_prompt = (prompts[2] * 30)[: slot_batch.MIN_CAPACITY + 40]
    mixed = [prompts[0], long_prompt, prompts[1]]
    growing, _, _ = sample_all(model, mixed, stagger=True, fixed_shape_decode=False)
    slots, _, shapes = sample_all(model, mixed, stagger=True, fixed_shape_decode=True)
    assert [r.tokens for r in slots] == [r.tokens for r in growing]
    capacity = slot_batch.MIN_CAPACITY
    assert sorted({columns for _, columns in shapes}) == [capacity, 2 * capacity]


def test_rows_past_the_model_context_grow_the_columns_in_a_step(model, prompts):
    short_context = copy.deepcopy(model)
    short_context.config.max_position_embeddings = 24  # the rotary embedding does not read it
    params = SamplingParams(temperature=0, max_tokens=40)
    growing, _, _ = sample_all(short_context, prompts, params, fixed_shape_decode=False)
    slots, _, shapes = sample_all(short_context, prompts, params, fixed_shape_decode=True)
    assert [r.tokens for r in slots] == [r.tokens for r in growing]
    # 24 reserved at admission (the context), then a step past it grew them
    assert sorted({columns for _, columns in shapes}) == [24, slot_batch.MIN_CAPACITY]


def test_eager_attention_gets_an_additive_mask_and_samples_the_same(model, prompts):
    eager = copy.deepcopy(model)
    eager.config._attn_implementation_internal = "eager"
    assert fixed_shape_decode_supported(eager) is True
    growing, _, _ = sample_all(eager, prompts, stagger=True, fixed_shape_decode=False)
    slots, generator, _ = sample_all(eager, prompts, stagger=True, fixed_shape_decode=True)
    assert generator._batch._additive_mask
    assert [r.tokens for r in slots] == [r.tokens for r in growing]


class FakeGraph:
    """A stand-in for a captured CUDA graph on the CPU: ``replay`` reruns the step and writes its
    result into the tensor returned at capture, as a graph does. It fails if the batch replaced
    (instead of rewriting) any tensor the graph would read, or replays after a reallocation."""

    def __init__(self, batch: SlotDecodeBatch, forward):
        self.batch, self.forward = batch, forward
        self.read = self._addresses()
        self.logits = forward()
        self.replays = 0

    def _addresses(self) -> list[int]:
        shape, cache = self.batch._shape, self.batch._slots
        tensors = [shape.input_ids_S, shape.positions_S, self.batch._columns_C]
        tensors += [t for layer in cache.layers for t in (layer.keys, layer.values)]
        return [t.data_ptr() for t in tensors]

    def replay(self) -> None:
        assert self._addresses() == self.read, "a graph would read freed or stale memory"
        self.logits.copy_(self.forward())
        self.replays += 1


def test_graphs_are_captured_per_bucket_replayed_and_dropped_when_the_slots_grow(model, prompts, monkeypatch):
    captured: list[tuple[int, FakeGraph]] = []

    def capture(self, bucket, forward):
        graph = FakeGraph(self, forward)
        captured.append((bucket, graph))
        return graph, graph.logits

    monkeypatch.setattr(SlotDecodeBatch, "_capture", capture)
    waves = waves_of(prompts, [5, 6])
    eager, _ = drive(SlotDecodeBatch(model, pad_token_id=2, device=CPU), waves)
    batch = SlotDecodeBatch(model, pad_token_id=2, device=CPU, use_cuda_graphs=True)
    replayed, shapes = drive(batch, waves)
    assert replayed == eager
    # Bucket 8 first; 16 once the slots grew (which dropped the first); 8 again as rows finish.
    expected = [bucket_for(rows) for rows, _ in shapes]
    firsts = [b for i, b in enumerate(expected) if i == 0 or b != expected[i - 1]]
    assert [bucket for bucket, _ in captured] == firsts == [8, 16, 8]
    # Every step was a replay (a capture records the step without running it).
    assert sum(graph.replays for _, graph in captured) == len(shapes)
    assert batch.use_cuda_graphs and batch.num_graphs == 2  # 8 and 16 (the first 8 was dropped)


def _with_graphs(init):
    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.use_cuda_graphs = True

    return patched


def test_a_failed_capture_warns_once_and_decodes_eagerly(model, prompts, monkeypatch, caplog):
    def broken(self, bucket, forward):
        raise RuntimeError("operation not permitted when stream is capturing")

    eager, _, _ = sample_all(model, prompts, stagger=True, fixed_shape_decode=True)
    monkeypatch.setattr(SlotDecodeBatch, "_capture", broken)
    monkeypatch.setattr(SlotDecodeBatch, "__init__", _with_graphs(SlotDecodeBatch.__init__))
    with caplog.at_level(logging.WARNING, logger="cookbook_lib.generators.slot_batch"):
        fallback, generator, _ = sample_all(model, prompts, stagger=True, fixed_shape_decode=True)
    assert [r.tokens for r in fallback] == [r.tokens for r in eager]
    warnings = [r for r in caplog.records if "capture" in r.getMessage()]
    assert len(warnings) == 1 and "not permitted" in warnings[0].getMessage()
    assert not generator._batch.use_cuda_graphs and generator._batch.num_graphs == 0


@pytest.mark.parametrize(
    ("cuda_graphs", "max_steps_off_policy"),
    [(True, None), (True, 1), (False, None)],
    ids=["lockstep on slots", "async on slots", "cuda_graphs=False"],
)
def test_grpo_runs_decode_on_slots_as_on_cuda_unless_the_config_says_not(
    tiny_model_dir, tmp_path, monkeypatch, cuda_graphs, max_steps_off_policy
):
    """Whole runs on the slot path (picked as on CUDA): lockstep, whose generator samples the
    trained model itself as the optimizer changes it in place, and async, whose weights are
    copied in while rows are in flight; ``GRPOConfig.cuda_graphs=False`` keeps the growing cache."""
    from cookbook_lib.envs import Task
    from cookbook_lib.grpo import train as train_module
    from cookbook_lib.grpo.config import GRPOConfig

    monkeypatch.setattr(hf_module, "fixed_shape_by_default", lambda model, device: True)
    built: list[bool] = []
    make_generator = train_module.make_generator

    def recording(*args, **kwargs):
        generator = make_generator(*args, **kwargs)
        built.append(generator.fixed_shape_decode)
        return generator

    monkeypatch.setattr(train_module, "make_generator", recording)
    config = GRPOConfig(
        model=tiny_model_dir,
        batch_size=2,
        episodes_per_task=3,
        num_steps=3,
        max_turns=1,
        max_model_length=256,
        max_tokens_per_turn=10,
        micro_batch_tokens=512,
        learning_rate=1e-3,
        overlong_buffer_tokens=0,
        checkpoint_interval=0,
        runs_dir=str(tmp_path),
        run_name="slots",
        max_steps_off_policy=max_steps_off_policy,
        cuda_graphs=cuda_graphs,
    )
    tasks = [Task(prompt=f"Say a word about {word}.", target=None) for word in ("cats", "rain", "tea")]
    result = train_module.train_single_turn(config, tasks=tasks, reward_fn=lambda task, reply: len(reply) % 3)
    assert built == [cuda_graphs]
    assert max(m["step"] for m in result.metrics) == 3
    assert any(m.get("trained_groups", 0) > 0 for m in result.metrics)
