"""The generator's KV cache grows in place (kv_cache.SlackLayer): the same keys and values as
transformers' concatenating DynamicLayer, through decode steps and every row and column surgery."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from cookbook_lib.generators import kv_cache


def forward(model, cache, ids_BL: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=ids_BL, use_cache=True, **{kv_cache.cache_keyword(model): cache})
    return out.logits[:, -1]


def assert_same(cache: DynamicCache, reference: DynamicCache) -> None:
    for mine, theirs in zip(cache.layers, reference.layers, strict=True):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def test_decode_steps_write_into_spare_columns_and_match_concatenation(tiny_model_and_tokenizer):
    model = tiny_model_and_tokenizer[0].eval()
    cache, reference = kv_cache.new_cache(model), DynamicCache(config=model.config)
    assert all(type(layer) is kv_cache.SlackLayer for layer in cache.layers)
    ids_BL = torch.randint(0, model.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
    assert torch.equal(forward(model, cache, ids_BL), forward(model, reference, ids_BL))
    storage = cache.layers[0].keys.untyped_storage().data_ptr()
    reallocations = 0
    for step in range(kv_cache.MIN_SLACK_COLUMNS + 4):
        token_B1 = torch.full((3, 1), 5 + step)
        assert torch.equal(forward(model, cache, token_B1), forward(model, reference, token_B1))
        now = cache.layers[0].keys.untyped_storage().data_ptr()
        reallocations, storage = reallocations + (now != storage), now
    assert_same(cache, reference)
    # 40 columns get 32 spare ones: one reallocation in 36 steps, where concatenation copies every step.
    assert reallocations == 1
    assert cache.get_seq_length() == reference.get_seq_length() == 40 + kv_cache.MIN_SLACK_COLUMNS + 4


def test_surgery_on_a_growing_cache_gives_what_it_gives_on_a_concatenating_one(tiny_model_and_tokenizer):
    model = tiny_model_and_tokenizer[0].eval()
    ids = torch.randint(0, model.config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(1))
    caches = []
    for make in (lambda: kv_cache.new_cache(model), lambda: DynamicCache(config=model.config)):
        cache, other = make(), make()
        forward(model, cache, ids[:3])
        forward(model, other, ids[3:, :7])
        forward(model, cache, torch.full((3, 1), 9))  # into the spare columns
        kv_cache.merge(cache, other)  # rows appended, left-padded
        forward(model, cache, torch.full((4, 1), 7))
        kv_cache.select_rows(cache, torch.tensor([3, 0, 2]))
        forward(model, cache, torch.full((3, 1), 8))
        kv_cache.drop_leading_columns(cache, 2)
        forward(model, cache, torch.full((3, 1), 6))
        stacked = kv_cache.stack_rows(model, [kv_cache.extract_row(cache, 1, torch.arange(4, 14))])
        forward(model, stacked, torch.full((1, 1), 4))
        caches.append((cache, stacked))
    (cache, stacked), (reference, reference_stacked) = caches
    assert_same(cache, reference)
    assert_same(stacked, reference_stacked)
    assert kv_cache.supports_merging(cache) and type(reference.layers[0]) is DynamicLayer


def test_a_view_of_a_buffers_leading_rows_keeps_the_room_after_its_columns():
    buffer = torch.zeros(2, 3, 20, 4)
    assert kv_cache._spare_columns(buffer[:, :, :12]) == 8
    assert kv_cache._spare_columns(buffer[:, :, 2:12]) == 8  # leading columns dropped: the room after stays
    assert kv_cache._spare_columns(buffer[:1, :, :12]) == 8  # leading rows: room in each
    assert kv_cache._spare_columns(buffer[1:, :, :12]) == 0  # not the buffer's leading rows
    assert kv_cache._spare_columns(buffer[:, 1:, :12]) == 0
    assert kv_cache._spare_columns(buffer[:, :, :12, :2]) == 0
    assert kv_cache._spare_columns(torch.zeros(2, 3, 12, 4)) == 0


def test_removed_rows_make_room_in_place_for_decode_steps_and_merged_rows(tiny_model_and_tokenizer):
    """The surgery of continuous batching (rows finish, the padding they leave is dropped, new rows
    join) on a growing cache: the same keys and values as a concatenating cache, in one buffer."""
    model = tiny_model_and_tokenizer[0].eval()
    ids = torch.randint(0, model.config.vocab_size, (7, 12), generator=torch.Generator().manual_seed(5))
    results = []
    for make in (lambda: kv_cache.new_cache(model), lambda: DynamicCache(config=model.config)):
        cache, joining = make(), make()
        forward(model, cache, ids[:5])
        forward(model, cache, torch.full((5, 1), 9))
        buffer = cache.layers[0].keys.untyped_storage().data_ptr()
        keep = kv_cache.order_after_removing(5, [0, 3])
        assert keep == [4, 1, 2]  # the last row takes the first one's place, rows 1 and 2 stay
        kv_cache.select_rows(cache, torch.tensor(keep))
        kv_cache.drop_leading_columns(cache, 3)  # padding no kept row attends to (as if)
        forward(model, cache, torch.full((3, 1), 8))
        forward(model, joining, ids[5:, :8])  # narrower than the running rows: left-padded
        kv_cache.merge(cache, joining)
        forward(model, cache, torch.full((5, 1), 7))
        results.append((cache, buffer))
    (cache, buffer), (reference, _) = results
    assert_same(cache, reference)
    # Two rows out, two in, all in the first buffer: nothing was gathered, regrown or restacked.
    assert cache.layers[0].keys.untyped_storage().data_ptr() == buffer
    assert cache.layers[0].keys.shape[:3] == reference.layers[0].keys.shape[:3] == (5, 2, 12)


def test_a_merge_that_does_not_fit_the_buffer_stacks_both_and_repeating_rows_gather(tiny_model_and_tokenizer):
    model = tiny_model_and_tokenizer[0].eval()
    ids = torch.randint(0, model.config.vocab_size, (4, 10), generator=torch.Generator().manual_seed(6))
    cache, reference = kv_cache.new_cache(model), DynamicCache(config=model.config)
    for each in (cache, reference):
        forward(model, each, ids[:2])
        kv_cache.select_rows(each, torch.tensor([1, 1, 0]))  # repeats: a gather
        joining = DynamicCache(config=model.config)
        forward(model, joining, ids[2:3])  # as wide as the running rows, but no free row: new buffers
        kv_cache.merge(each, joining)
        forward(model, each, torch.full((4, 1), 3))
    assert_same(cache, reference)
    assert kv_cache.order_after_removing(4, [3]) == [0, 1, 2]
    assert kv_cache.order_after_removing(4, [0, 1, 2]) == [3]


def test_stacked_prefixes_take_the_next_forward_in_place_and_are_released_as_copied(tiny_model_and_tokenizer):
    model = tiny_model_and_tokenizer[0].eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(2))
    cache = kv_cache.new_cache(model)
    forward(model, cache, ids)
    rows = [
        kv_cache.extract_row(cache, 0, torch.arange(10)),
        kv_cache.extract_row(cache, 1, torch.arange(3, 10)),
    ]
    reference = kv_cache.stack_rows(model, [list(row) for row in rows])
    stacked = kv_cache.stack_rows(model, rows, room=5, release=True)
    assert rows == [[], []]  # each layer let go once copied: the rows and the stack are never both whole
    assert_same(stacked, reference)
    assert torch.equal(stacked.layers[0].keys[1, :, :3], torch.zeros_like(stacked.layers[0].keys[1, :, :3]))
    storage = [layer.keys.untyped_storage().data_ptr() for layer in stacked.layers]
    suffix_BL = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3))
    assert torch.equal(forward(model, stacked, suffix_BL), forward(model, reference, suffix_BL))
    assert_same(stacked, reference)
    # The 5 fed tokens went into the room left for them: no layer was copied to append them.
    assert [layer.keys.untyped_storage().data_ptr() for layer in stacked.layers] == storage


def test_a_merged_cache_has_spare_columns_for_the_next_decode_steps(tiny_model_and_tokenizer):
    model = tiny_model_and_tokenizer[0].eval()
    ids = torch.randint(0, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(4))
    first, second = kv_cache.new_cache(model), kv_cache.new_cache(model)
    forward(model, first, ids[:2])
    forward(model, second, ids[2:, :6])
    kv_cache.merge(first, second)
    assert all(kv_cache._spare_columns(layer.keys) >= kv_cache.MIN_SLACK_COLUMNS for layer in first.layers)
    assert torch.equal(first.layers[0].keys[2, :, :3], torch.zeros_like(first.layers[0].keys[2, :, :3]))
    assert torch.equal(first.layers[0].keys[2, :, 3:], second.layers[0].keys[0])
