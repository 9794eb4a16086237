"""transformers models generate through pagedkv, token for token what ``DynamicCache`` gives.

The oracle is transformers itself: ``DynamicCache`` with the model's own
attention (sdpa), which shares no code with pagedkv. Models are random-init
(no download), with a large ``initializer_range`` so greedy output does not
collapse into one repeated token (each test asserts it does not).

Skipped without the ``hf`` extra (torch, transformers).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedkv import (  # noqa: E402
    ConfigError,
    HybridKVCacheManager,
    InputTypeError,
    PoolExhaustedError,
    SequenceStateError,
    ShapeError,
)
from pagedkv.integrations.transformers import (  # noqa: E402
    ModelSpec,
    PagedCache,
    attention_refusals,
    read_spec,
    use_pagedkv_attention,
)

torch.set_num_threads(1)

NUM_NEW = 40
#: Largest |logit difference| seen against DynamicCache, per (model, dtype, mode); reported at the end.
MAX_LOGIT_DIFF: dict[tuple[str, str, str], float] = {}
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-9}
HALF_DTYPES = [torch.bfloat16, torch.float16]
#: Attention mode on a 16-bit model: pagedkv computes in float32 from the stored pages and rounds
#: its output once; sdpa computes in the model's dtype. The two round differently, so on these
#: random models (logits within about +-6, many near ties) greedy tokens are compared over the
#: first HALF_NUM_IDENTICAL new tokens (measured: identical for 15 to 40), and the logits of
#: those steps within HALF_ATTENTION_TOLERANCE (measured at most 0.11 for bfloat16, 0.014 for
#: float16; see test_report_max_logit_difference, run with -s).
HALF_NUM_IDENTICAL = 12
HALF_ATTENTION_TOLERANCE = {torch.bfloat16: 0.15, torch.float16: 0.02}


def build_model(kind: str, dtype: Any = torch.float32) -> Any:
    torch.manual_seed(0)
    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
        max_position_embeddings=256,
    )
    if kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=8, **common))
    elif kind == "hybrid":  # Qwen2 with two sliding layers (window 8) to one full: KV-cache groups
        # (a tiny random Gemma 3 repeats one token; the real one is in tests/integrations/test_real_models.py)
        types = (["sliding_attention"] * 2 + ["full_attention"]) * 2
        config = transformers.Qwen2Config(
            **{**common, "num_hidden_layers": 6}, use_sliding_window=True, sliding_window=8, layer_types=types
        )
        model = transformers.Qwen2ForCausalLM(config)
    elif kind == "chunked":  # Llama 4: three chunked layers (chunks of 8) to one full layer
        config = transformers.Llama4TextConfig(
            **{**common, "num_hidden_layers": 4}, head_dim=16, intermediate_size_mlp=128,
            attention_chunk_size=8, num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2,
            no_rope_layers=None,
        )
        model = transformers.Llama4ForCausalLM(config)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return model.eval().to(dtype)


def prompts() -> list[tuple[Any, Any]]:
    """(input_ids, attention_mask): prompts of 5, 17 and 33 tokens, and 33 + 17 left-padded."""
    generator = torch.Generator().manual_seed(1)
    cases = []
    for length in (5, 17, 33):
        ids = torch.randint(3, 96, (1, length), generator=generator)
        cases.append((ids, torch.ones_like(ids)))
    ids = torch.randint(3, 96, (2, 33), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :16] = 0  # row 1: 17 real tokens after 16 pads
    ids[1, :16] = 0
    cases.append((ids, mask))
    return cases


def generate(model: Any, ids: Any, mask: Any, cache: Any, **options: Any) -> Any:
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            cache=cache,
            max_new_tokens=NUM_NEW,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
            **options,
        )


def set_mode(model: Any, mode: str) -> None:
    if mode == "attention":
        use_pagedkv_attention(model)
    else:
        model.set_attn_implementation("sdpa")


def assert_same_as_dynamic(
    model: Any,
    mode: str,
    key: tuple[str, str, str],
    tolerance: float | None = None,
    num_identical: int = NUM_NEW,
    **options: Any,
) -> None:
    """The first ``num_identical`` greedy tokens identical to DynamicCache's, their logits within
    ``tolerance`` (default: by dtype)."""
    tolerance = TOLERANCE[model.dtype] if tolerance is None else tolerance
    for ids, mask in prompts():
        model.set_attn_implementation("sdpa")
        expected = generate(model, ids, mask, transformers.DynamicCache(config=model.config), **options)
        set_mode(model, mode)
        cache = PagedCache.from_model(model, num_blocks=128, block_size=4)
        got = generate(model, ids, mask, cache, **options)
        cache.check_invariants()
        assert cache.mode == mode
        new_tokens = expected.sequences[:, ids.shape[1] :]
        assert all(len(set(row.tolist())) >= 8 for row in new_tokens), "greedy output collapsed"
        end = ids.shape[1] + num_identical
        if num_identical == NUM_NEW:
            assert torch.equal(got.sequences, expected.sequences)
        else:
            assert torch.equal(got.sequences[:, :end], expected.sequences[:, :end])
        pairs = list(zip(got.logits, expected.logits))[:num_identical]
        diff = max(float((a - b).abs().max()) for a, b in pairs)
        MAX_LOGIT_DIFF[key] = max(MAX_LOGIT_DIFF.get(key, 0.0), diff)
        assert diff <= tolerance


@pytest.mark.parametrize("mode", ["storage", "attention"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("kind", ["llama", "mistral", "hybrid"])
def test_greedy_generate_matches_dynamic_cache(kind: str, dtype: Any, mode: str) -> None:
    model = build_model(kind, dtype)
    assert_same_as_dynamic(model, mode, (kind, str(dtype), mode))


@pytest.mark.parametrize("mode", ["storage", "attention"])
def test_a_hybrid_model_gets_kv_cache_groups_and_holds_about_what_dynamic_cache_holds(mode: str) -> None:
    """The sliding layers' group frees what their window left: bytes within 5% of DynamicCache's."""
    model = build_model("hybrid")
    ids = torch.randint(3, 96, (1, 33), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    dynamic = transformers.DynamicCache(config=model.config)
    expected = generate(model, ids, mask, dynamic)
    set_mode(model, mode)
    cache = PagedCache.from_model(model, num_blocks=128, block_size=4)
    got = generate(model, ids, mask, cache)
    cache.check_invariants()
    assert isinstance(cache.manager, HybridKVCacheManager)
    assert torch.equal(got.sequences, expected.sequences)
    dynamic_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in dynamic.layers)
    assert cache.num_held_bytes <= 1.05 * dynamic_bytes


@pytest.mark.parametrize("mode", ["storage", "attention"])
def test_llama4_chunked_layers_get_a_chunked_group_and_match_dynamic_cache(mode: str) -> None:
    """Llama 4's chunked layers (chunks of 8) see their own chunk only: tokens identical to DynamicCache's."""
    model = build_model("chunked")
    for length in (5, 17, 33):  # within the first chunk, across two, across four
        ids = torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        model.set_attn_implementation("sdpa")
        expected = generate(model, ids, mask, transformers.DynamicCache(config=model.config))
        set_mode(model, mode)
        cache = PagedCache.from_model(model, num_blocks=128, block_size=4)
        got = generate(model, ids, mask, cache)
        cache.check_invariants()
        kinds = [group.kind for group in cache.manager.layout.groups]
        assert kinds == ["full", "chunked", "chunked", "chunked"]
        assert len(set(expected.sequences[0, length:].tolist())) >= 8, "greedy output collapsed"
        assert torch.equal(got.sequences, expected.sequences)
        diff = max(float((a - b).abs().max()) for a, b in zip(got.logits, expected.logits))
        assert diff <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["bfloat16", "float16"])
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_half_model_in_storage_mode_matches_dynamic_cache_bit_for_bit(kind: str, dtype: Any) -> None:
    model = build_model(kind, dtype)
    assert_same_as_dynamic(model, "storage", (kind, str(dtype), "storage"), tolerance=0.0)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["bfloat16", "float16"])
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_half_model_in_attention_mode_matches_tokens_within_tolerance(kind: str, dtype: Any) -> None:
    model = build_model(kind, dtype)
    key = (kind, str(dtype), "attention")
    assert_same_as_dynamic(model, "attention", key, HALF_ATTENTION_TOLERANCE[dtype], HALF_NUM_IDENTICAL)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["bfloat16", "float16"])
def test_half_model_pages_are_stored_in_its_dtype(dtype: Any) -> None:
    model = build_model("llama", dtype)
    name = str(dtype).removeprefix("torch.")
    cache = PagedCache.from_model(model, num_blocks=8, block_size=4)
    pool = cache.manager.pool
    assert (pool.dtype, pool.key_dtype, pool.value_dtype) == (np.float32, name, name)
    wide = PagedCache.from_model(build_model("llama"), num_blocks=8, block_size=4).manager.pool
    assert 2 * pool.bytes_per_block == wide.bytes_per_block  # 16 bits a value, no scales
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7]]), cache=cache).logits
    assert logits.dtype == dtype and cache.num_held_bytes == pool.bytes_per_block  # 3 tokens: 1 block


@pytest.mark.parametrize("mode", ["storage", "attention"])
@pytest.mark.parametrize("kind", ["llama", "mistral", "hybrid", "chunked"])
def test_chunked_prefill_matches_dynamic_cache(kind: str, mode: str) -> None:
    model = build_model(kind)
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 96, (1, 33), generator=generator)
    model.set_attn_implementation("sdpa")
    expected = generate(model, ids, torch.ones_like(ids), transformers.DynamicCache(config=model.config))
    set_mode(model, mode)
    cache = PagedCache.from_model(model, num_blocks=64, block_size=4)
    got = generate(model, ids, torch.ones_like(ids), cache, prefill_chunk_size=8)
    assert torch.equal(got.sequences, expected.sequences)


@pytest.mark.parametrize("mode", ["storage", "attention"])
@pytest.mark.parametrize("kind", ["llama", "mistral", "hybrid"])
def test_beam_search_matches_dynamic_cache_and_beams_share_pages(kind: str, mode: str) -> None:
    model = build_model(kind)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 96, (1, 17), generator=generator)
    options = dict(num_beams=3, num_return_sequences=3, max_new_tokens=12)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        expected = model.generate(
            ids,
            cache=transformers.DynamicCache(config=model.config),
            do_sample=False,
            pad_token_id=0,
            **options,
        )
        set_mode(model, mode)
        cache = PagedCache.from_model(model, num_blocks=64, block_size=4)
        got = model.generate(ids, cache=cache, do_sample=False, pad_token_id=0, **options)
    assert torch.equal(got, expected)
    cache.check_invariants()
    tables = [cache.block_ids(row) for row in range(cache.num_rows)]
    # Every beam descends from row 0 after the first reorder: they share its first blocks.
    assert cache.num_rows == 3 and tables[0][0] == tables[1][0] == tables[2][0]
    assert cache.manager.pool.num_used_blocks < sum(len(table) for table in tables)


def test_reset_lets_one_cache_serve_generate_again() -> None:
    model = build_model("llama")
    ids, mask = prompts()[1]
    cache = PagedCache.from_model(model, num_blocks=32, block_size=4)
    first = generate(model, ids, mask, cache)
    cache.reset()
    assert cache.num_rows == 0 and cache.manager.pool.num_used_blocks == 0
    again = generate(model, ids, mask, cache)
    assert torch.equal(first.sequences, again.sequences)


@pytest.mark.parametrize("mode", ["storage", "attention"])
def test_crop_rolls_back_like_dynamic_cache(mode: str) -> None:
    model = build_model("llama")
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(4))
    dynamic = transformers.DynamicCache(config=model.config)
    set_mode(model, mode)
    cache = PagedCache.from_model(model, num_blocks=32, block_size=4)
    with torch.no_grad():
        model(ids, cache=cache)
        cache.crop(-5)
        cache.check_invariants()
        assert cache.get_seq_length() == 7 and cache.manager.num_tokens(cache.seq_ids[0]) == 7
        got = model(ids[:, 7:9], cache=cache).logits
        model.set_attn_implementation("sdpa")
        model(ids, cache=dynamic)
        dynamic.crop(-5)
        expected = model(ids[:, 7:9], cache=dynamic).logits
    assert float((got - expected).abs().max()) < 1e-4


def test_crop_into_an_evicted_window_is_refused_and_changes_nothing() -> None:
    model = build_model("mistral")  # sliding_window 8
    ids = torch.randint(3, 96, (1, 33), generator=torch.Generator().manual_seed(5))
    cache = PagedCache.from_model(model, num_blocks=32, block_size=4)
    with torch.no_grad():
        model(ids, cache=cache)
        model(ids[:, :1], cache=cache)  # token 33's reservation frees blocks wholly before 26: 0 .. 23
    before = (cache.get_seq_length(), cache.block_ids(0), cache.manager.pool.num_free_blocks)
    with pytest.raises(SequenceStateError, match="window already evicted"):
        cache.crop(-10)  # the next token, 24, would need 17 .. 23
    assert (cache.get_seq_length(), cache.block_ids(0), cache.manager.pool.num_free_blocks) == before
    cache.crop(-1)  # the next token, 33, needs 26 .. 32: still held
    assert cache.get_seq_length() == 33


def test_crop_refuses_bad_counts_and_changes_nothing() -> None:
    model = build_model("llama")
    cache = PagedCache.from_model(model, num_blocks=32, block_size=4)
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7]]), cache=cache)
    for bad, error, fragment in (
        (3, ConfigError, "negative"),
        (-4, ConfigError, "holds 3"),
        (1.5, InputTypeError, "int"),
    ):
        with pytest.raises(error, match=fragment):
            cache.crop(bad)
        assert cache.get_seq_length() == 3 and cache.manager.num_tokens(cache.seq_ids[0]) == 3


# ------------------------------------------------------------ storage, by hand


def hand_cache(
    layer_types: tuple[str, ...],
    num_blocks: int = 16,
    windows: Any = None,
    read_cache: bool = True,
    page_dtype: str | None = None,
) -> PagedCache:
    """A storage-mode cache for 2 kv heads of 3 values, built without a model.

    ``page_dtype`` None: a float64 model; else a 16-bit model of that dtype, pages stored in it.
    """
    from pagedkv import KVCacheManager, KVPool

    windows = windows or (None,) * len(layer_types)
    storing = tuple(i for i, kind in enumerate(layer_types) if kind != "dummy")
    dtype = np.dtype(np.float32 if page_dtype else np.float64)
    spec = ModelSpec(len(layer_types), storing, layer_types, windows, 2, 2, 3, 1.0, dtype, page_dtype)
    pool = KVPool(num_blocks, block_size=2, num_layers=len(storing), num_kv_heads=2, head_dim=3,
                  dtype=dtype, key_dtype=page_dtype, value_dtype=page_dtype)
    manager = KVCacheManager(pool, layer_max_sizes=spec.pool_windows, num_q_heads=2)
    return PagedCache(manager, spec, read_cache=read_cache)


def states(num_rows: int, num_new: int, seed: int, dtype: Any = torch.float64) -> Any:
    return torch.from_numpy(np.random.default_rng(seed).normal(size=(num_rows, 2, num_new, 3))).to(dtype)


def test_a_layer_that_stores_nothing_does_not_wedge_the_next_step() -> None:
    cache = hand_cache(("full_attention", "dummy", "full_attention"))
    seen = {0: [], 2: []}  # the oracle: every state fed, concatenated
    for step, num_new in enumerate((3, 1, 1, 2)):
        for layer in (0, 2):
            k, v = states(2, num_new, 10 * step + layer), states(2, num_new, 100 + 10 * step + layer)
            seen[layer].append((k, v))
            keys, values = cache.update(k, v, layer)
            assert torch.equal(keys, torch.cat([pair[0] for pair in seen[layer]], dim=2))
            assert torch.equal(values, torch.cat([pair[1] for pair in seen[layer]], dim=2))
        cache.check_invariants()
    assert cache.get_seq_length(1) == cache.get_seq_length(0) == 7
    with pytest.raises(ConfigError, match="model layer 1"):
        cache.update(states(2, 1, 0), states(2, 1, 0), 1)


def test_a_storing_layer_that_skips_a_step_is_named_and_reset_recovers() -> None:
    cache = hand_cache(("full_attention", "full_attention"))
    cache.update(states(1, 2, 0), states(1, 2, 1), 0)  # layer 1 never writes this step
    free = cache.manager.pool.num_free_blocks
    with pytest.raises(SequenceStateError, match=r"model layers \[1\] stored nothing"):
        cache.update(states(1, 1, 2), states(1, 1, 3), 0)
    assert cache.get_seq_length(0) == 2 and cache.manager.pool.num_free_blocks == free
    cache.reset()
    keys, _ = cache.update(states(1, 1, 2), states(1, 1, 3), 0)
    assert keys.shape == (1, 2, 1, 3)


def test_sliding_layers_return_the_window_like_dynamic_sliding_layers() -> None:
    cache = hand_cache(("sliding_attention",), windows=(3,))
    fed = []
    for step in range(6):
        k = states(1, 1 if step else 4, step)
        fed.append(k)
        past = sum(t.shape[2] for t in fed[:-1])
        keys, _ = cache.update(k, k, 0)
        offset = max(0, past - 3 + 1)
        assert cache.get_mask_sizes(1, 0) == (
            min(past + k.shape[2], 3 - 1) + 1,
            max(0, past + k.shape[2] - 2),
        )
        assert torch.equal(keys, torch.cat(fed, dim=2)[:, :, offset:])


def test_reorder_select_and_repeat_follow_their_rows() -> None:
    cache = hand_cache(("full_attention",))
    rows = [states(1, 3, seed) for seed in range(3)]
    cache.update(torch.cat(rows), torch.cat(rows), 0)
    used = cache.manager.pool.num_used_blocks
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    assert cache.manager.pool.num_used_blocks < used  # row 1 freed; rows 0 and 1 share row 2's blocks
    assert cache.block_ids(0) == cache.block_ids(1)
    cache.batch_select_indices(torch.tensor([2]))
    cache.batch_repeat_interleave(2)
    new = states(2, 1, 9)
    keys, _ = cache.update(new, new, 0)
    assert torch.equal(keys, torch.cat([torch.cat([rows[0]] * 2), new], dim=2))
    cache.check_invariants()
    with pytest.raises(ConfigError, match="row 5 does not exist"):
        cache.reorder_cache(torch.tensor([5, 0]))
    assert cache.num_rows == 2


@pytest.mark.parametrize("read_cache", [True, False], ids=["read_cache", "pool_reads"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("seed", range(4))
def test_returned_keys_match_concatenation_and_never_change_afterwards(
    monkeypatch: Any, seed: int, window: Any, read_cache: bool
) -> None:
    """Drive a cache with updates, reorders and crops beside a plain ``torch.cat`` oracle.

    Every tensor ``update`` returned is kept with a copy taken then; after each
    later operation each must still equal its copy (the rule: a returned tensor
    is never written again). Capacity starts at 2 so the buffers grow often.
    """
    from pagedkv.integrations.hf import read_cache as read_cache_module

    monkeypatch.setattr(read_cache_module, "MIN_CAPACITY", 2)
    kind = "full_attention" if window is None else "sliding_attention"
    cache = hand_cache((kind,), num_blocks=400, windows=(window,), read_cache=read_cache)
    rng = np.random.default_rng(seed)
    num_rows = 3
    oracle = [torch.zeros(num_rows, 2, 0, 3), torch.zeros(num_rows, 2, 0, 3)]  # (rows, heads, columns, d)
    handed: list[tuple[Any, Any]] = []  # (tensor returned, its copy at the time)
    for step in range(30):
        action = rng.choice(["update", "update", "update", "reorder", "crop"])
        columns = oracle[0].shape[2]
        if action == "reorder" and columns:
            beams = torch.from_numpy(rng.integers(0, num_rows, num_rows))
            cache.reorder_cache(beams)
            oracle = [side.index_select(0, beams) for side in oracle]
        elif action == "crop" and window is None and columns > 1:
            num_removed = int(rng.integers(1, columns))
            cache.crop(-num_removed)
            oracle = [side[:, :, : columns - num_removed] for side in oracle]
        else:
            num_new = 4 if not columns else int(rng.integers(1, 4))
            keys_new, values_new = states(num_rows, num_new, 1000 * seed + 2 * step), states(
                num_rows, num_new, 1000 * seed + 2 * step + 1
            )
            past = columns
            keys, values = cache.update(keys_new, values_new, 0)
            oracle = [torch.cat([oracle[0], keys_new], dim=2), torch.cat([oracle[1], values_new], dim=2)]
            offset = 0 if window is None else max(0, past - window + 1)
            assert torch.equal(keys, oracle[0][:, :, offset:])
            assert torch.equal(values, oracle[1][:, :, offset:])
            handed += [(keys, keys.clone()), (values, values.clone())]
        cache.check_invariants()
        changed = [i for i, (tensor, copy) in enumerate(handed) if not torch.equal(tensor, copy)]
        assert not changed, f"returned tensors {changed} changed by step {step}"
    assert len(handed) >= 20


@pytest.mark.parametrize("read_cache", [True, False], ids=["read_cache", "pool_reads"])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["bfloat16", "float16"])
def test_half_states_come_back_exactly_as_given(dtype: Any, read_cache: bool) -> None:
    """16-bit pages hold a 16-bit model's values exactly: the buffer and the pages return them unchanged."""
    name = str(dtype).removeprefix("torch.")
    cache = hand_cache(("full_attention", "sliding_attention"), windows=(None, 3), read_cache=read_cache,
                       page_dtype=name)
    fed: dict[int, list[Any]] = {0: [], 1: []}
    for step, num_new in enumerate((4, 1, 2, 1)):
        for layer in (0, 1):
            k, v = states(2, num_new, 10 * step + layer, dtype), states(2, num_new, 99 - step - layer, dtype)
            past = sum(t.shape[2] for t, _ in fed[layer])
            fed[layer].append((k, v))
            keys, values = cache.update(k, v, layer)
            offset = 0 if layer == 0 else max(0, past - 3 + 1)
            assert keys.dtype == values.dtype == dtype
            assert torch.equal(keys, torch.cat([pair[0] for pair in fed[layer]], dim=2)[:, :, offset:])
            assert torch.equal(values, torch.cat([pair[1] for pair in fed[layer]], dim=2)[:, :, offset:])
        cache.check_invariants()
    cache.reorder_cache(torch.tensor([1, 1]))
    keys, _ = cache.update(states(2, 1, 7, dtype), states(2, 1, 8, dtype), 0)
    row_1 = torch.cat([pair[0][1:] for pair in fed[0]], dim=2)
    assert torch.equal(keys[:, :, :-1], torch.cat([row_1, row_1]))


def test_states_of_another_dtype_than_the_models_are_refused_and_change_nothing() -> None:
    cache = hand_cache(("full_attention",), page_dtype="bfloat16")
    cache.update(states(1, 2, 0, torch.bfloat16), states(1, 2, 1, torch.bfloat16), 0)
    before = (cache.block_ids(0), cache.get_seq_length(), cache.manager.pool.num_used_blocks)
    wrong = states(1, 1, 2, torch.float32)
    with pytest.raises(ShapeError, match="computes in bfloat16"):
        cache.update(wrong, wrong, 0)
    assert (cache.block_ids(0), cache.get_seq_length(), cache.manager.pool.num_used_blocks) == before


def test_a_quantized_pool_is_read_from_its_pages() -> None:
    from pagedkv import KVCacheManager, KVPool

    spec = ModelSpec(1, (0,), ("full_attention",), (None,), 2, 2, 4, 1.0, np.dtype(np.float32))
    pool = KVPool(8, block_size=2, num_kv_heads=2, head_dim=4, dtype=np.float32, key_dtype="int8")
    cache = PagedCache(KVCacheManager(pool, num_q_heads=2), spec)
    new = torch.from_numpy(np.random.default_rng(0).normal(size=(1, 2, 3, 4)).astype(np.float32))
    keys, _ = cache.update(new, new, 0)
    assert not torch.equal(keys, new)  # the int8 pages, dequantized: not the exact keys given
    assert float((keys - new).abs().max()) < 0.05


def test_bad_states_are_refused_and_change_nothing() -> None:
    cache = hand_cache(("full_attention",), num_blocks=2)
    cache.update(states(1, 2, 0), states(1, 2, 1), 0)
    before = (cache.block_ids(0), cache.get_seq_length())
    wrong_heads = torch.zeros((1, 3, 1, 3), dtype=torch.float64)
    for k, error, fragment in (
        (wrong_heads, ShapeError, "3 heads"),
        (torch.zeros((1, 2, 1, 3), dtype=torch.float32), ShapeError, "float32"),
        (states(2, 1, 0), ShapeError, "2 rows"),
        (states(1, 9, 0), PoolExhaustedError, "need"),
    ):
        with pytest.raises(error, match=fragment):
            cache.update(k, k, 0)
        assert (cache.block_ids(0), cache.get_seq_length()) == before


def test_pool_exhausted_on_the_first_step_leaves_no_rows() -> None:
    cache = hand_cache(("full_attention",), num_blocks=1)
    with pytest.raises(PoolExhaustedError):
        cache.update(states(2, 3, 0), states(2, 3, 1), 0)
    assert cache.num_rows == 0 and cache.manager.pool.num_used_blocks == 0


# -------------------------------------------------------------- attention mode


def test_right_padding_is_refused_in_attention_mode_and_changes_nothing() -> None:
    model = use_pagedkv_attention(build_model("llama"))
    cache = PagedCache.from_model(model, num_blocks=16, block_size=4)
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with torch.no_grad(), pytest.raises(ShapeError, match="left padding only"):
        model(ids, attention_mask=mask, cache=cache)
    assert cache.manager.pool.num_used_blocks == 0


def test_pagedkv_attention_without_a_paged_cache_is_refused() -> None:
    model = use_pagedkv_attention(build_model("llama"))
    with torch.no_grad(), pytest.raises(SequenceStateError, match=r"PagedCache\.from_model"):
        model(torch.tensor([[5, 6, 7]]), cache=transformers.DynamicCache(config=model.config))


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda model: setattr(model.config, "attn_logit_softcapping", 30.0), "logit softcapping"),
        (lambda model: setattr(model.config, "alibi", True), "attention bias"),
        (lambda model: setattr(model.config, "is_causal", False), "non-causal"),
        (lambda model: (setattr(model.config, "attention_dropout", 0.1), model.train()), "dropout"),
        (
            lambda model: setattr(
                model.model.layers[1].self_attn, "sinks", torch.nn.Parameter(torch.zeros(4))
            ),
            "learned sink logits",
        ),
    ],
    ids=["softcap", "alibi", "non-causal", "dropout", "sinks"],
)
def test_attention_refuses_what_pagedkv_cannot_compute(change: Any, fragment: str) -> None:
    model = build_model("llama")
    assert attention_refusals(model) == []
    change(model)
    with pytest.raises(ConfigError, match=fragment):
        use_pagedkv_attention(model)
    assert model.config._attn_implementation == "sdpa"


def test_read_spec_reads_the_config_and_refuses_other_dtypes() -> None:
    spec = read_spec(build_model("mistral"))
    assert (spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.windows) == (4, 2, 16, (8, 8))
    assert spec.scale == 16**-0.5 and spec.dtype == np.float32 and spec.page_dtype is None
    half = read_spec(build_model("llama", torch.bfloat16))
    assert (half.dtype, half.page_dtype, half.model_dtype) == (np.float32, "bfloat16", "bfloat16")
    model = build_model("llama")
    integer = type("IntegerModel", (), {"config": model.config, "dtype": torch.int8})()
    with pytest.raises(ConfigError, match="computes in int8"):
        read_spec(integer)


def test_report_max_logit_difference() -> None:
    """Print what the greedy tests recorded (run with -s to see it); fails if they did not run."""
    if not MAX_LOGIT_DIFF:
        pytest.skip("run with the greedy tests to see the max logit differences")
    for key, diff in sorted(MAX_LOGIT_DIFF.items()):
        print("max |logit difference|", *key, f"{diff:.3g}")
