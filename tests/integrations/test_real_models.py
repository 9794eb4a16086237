"""Real pretrained models generate through pagedkv token for token what ``DynamicCache`` gives.

Gemma 3 270M (five sliding-window layers of 512 to one full layer) on a 2,000-token
prompt, and SmolLM2-135M-Instruct (Llama-style GQA), both from the GGUF files of the
``models`` extra. The oracle is transformers' ``DynamicCache`` with sdpa. Each
generation runs once (``run``) and the tests compare its results.

Skipped without torch, transformers, gguf, accelerate or the model packages
(``pip install -e '.[hf,models]'``); CI runs this file in a step of its own.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from pagedkv.integrations.transformers import (  # noqa: E402
    MODELS_EXTRA_HINT,
    PagedCache,
    kv_bytes,
    load_model,
    use_pagedkv_attention,
)

#: Gemma's prompt length: nearly four times its sliding window (512), so window layers evict.
GEMMA_PROMPT_TOKENS = 2000
GEMMA_NEW_TOKENS = 8
#: pagedkv's bytes held may be at most this times DynamicCache's (issue 29's target).
KV_BYTES_RATIO = 1.05
#: (model, dtype, case) generations compared. bfloat16 is how both models were trained. Gemma's
#: 2,000-token prefill takes about 16 s on one CPU core in float32, so its bfloat16 run is greedy
#: batch 1 only (the file's runtime is in the note of this test suite's CI step).
CASES = [
    *[("gemma3", "float32", case) for case in ("greedy", "padded", "beam")],
    ("gemma3", "bfloat16", "greedy"),
    *[("smollm2", dtype, case) for dtype in ("float32", "bfloat16") for case in ("greedy", "padded", "beam")],
]
MODES = ["storage", "attention"]
#: The SmolLM2 check the issue states: greedy, plain text, no chat template.
SMOLLM2_PROMPT, SMOLLM2_ANSWER = "The capital of France is", " Paris."


@functools.cache
def model_and_tokenizer(name: str, dtype: str) -> tuple[Any, Any]:
    """Each model loaded once per dtype; skips the test when its package is absent."""
    try:
        model, tokenizer = load_model(name, dtype)
    except ImportError as error:
        pytest.skip(f"{error} ({MODELS_EXTRA_HINT})")
    torch.manual_seed(0)
    return model, tokenizer


def gemma_texts() -> tuple[str, str]:
    """Two long, varied texts (a numbered list of facts), the second shorter."""
    facts = [
        f"Fact {i}: the {color} {thing} number {i * 7 % 97} weighs {i * 13 % 89} grams and was found in "
        f"{place}."
        for i, (color, thing, place) in enumerate(
            (c, t, p)
            for c in ("red", "green", "blue", "yellow", "white")
            for t in ("stone", "coin", "shell", "key", "ring", "button")
            for p in ("Paris", "Lisbon", "Oslo", "Cairo", "Lima", "Kyoto", "Quito")
        )
    ]
    return "\n".join(facts), "\n".join(facts[::2])


@functools.cache
def inputs(name: str, case: str) -> tuple[Any, Any]:
    """``(input_ids, attention_mask)`` of a case: batch 1, or two prompts left-padded to one length."""
    _, tokenizer = model_and_tokenizer(name, "float32")
    if name == "smollm2":
        texts = [SMOLLM2_PROMPT, "The largest planet in the solar system is"]
    else:
        long_text, short_text = gemma_texts()
        texts = [long_text, short_text]
    if case != "padded":
        texts = texts[:1]
    tokenizer.padding_side = "left"
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    if name == "gemma3":  # exactly GEMMA_PROMPT_TOKENS columns: the long row's first tokens, BOS kept
        ids, mask = ids[:, :GEMMA_PROMPT_TOKENS], mask[:, :GEMMA_PROMPT_TOKENS]
        if case == "padded":  # the short row: its last 1,500 real tokens, left-padded
            short = encoded["input_ids"][1][encoded["attention_mask"][1].bool()][-1500:]
            ids[1] = tokenizer.pad_token_id
            ids[1, -1500:] = short
            mask[1] = 0
            mask[1, -1500:] = 1
        assert ids.shape[1] == GEMMA_PROMPT_TOKENS
    return ids, mask


@dataclass(frozen=True)
class Run:
    """One generation: its sequences and the KV bytes its cache held at the end."""

    sequences: Any
    kv_bytes: int


@functools.cache
def run(name: str, dtype: str, case: str, cache_kind: str) -> Run:
    """Generate once: ``cache_kind`` is ``"dynamic"``, ``"storage"`` or ``"attention"``."""
    model, tokenizer = model_and_tokenizer(name, dtype)
    ids, mask = inputs(name, case)
    if cache_kind == "attention":
        use_pagedkv_attention(model)
    else:
        model.set_attn_implementation("sdpa")
    num_new = GEMMA_NEW_TOKENS if name == "gemma3" else 2
    options: dict[str, Any] = dict(num_beams=2, num_return_sequences=2) if case == "beam" else {}
    num_rows = ids.shape[0] * options.get("num_beams", 1)
    if cache_kind == "dynamic":
        cache = transformers.DynamicCache(config=model.config)
    else:
        num_blocks = num_rows * (ids.shape[1] + num_new) // 16 + 8 * num_rows
        cache = PagedCache.from_model(model, num_blocks=num_blocks, block_size=16)
    with torch.no_grad():
        sequences = model.generate(
            input_ids=ids,
            attention_mask=mask,
            cache=cache,
            max_new_tokens=num_new,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id or 0,
            **options,
        )
    if cache_kind != "dynamic":
        cache.check_invariants()
        assert cache.mode == cache_kind
    return Run(sequences, kv_bytes(cache))


def kv_bytes_held(name: str, dtype: str, mode: str) -> tuple[int, int]:
    """``(pagedkv, DynamicCache)``: KV bytes each cache holds after the greedy batch-1 generation.

    pagedkv counts the blocks its rows hold (``PagedCache.num_held_bytes``; the
    storage mode's read cache is not counted); DynamicCache the ``nbytes`` of its tensors.
    """
    return run(name, dtype, "greedy", mode).kv_bytes, run(name, dtype, "greedy", "dynamic").kv_bytes


# ------------------------------------------------------------------------------- tokens


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("name", "dtype", "case"), CASES)
def test_real_model_generates_the_tokens_dynamic_cache_does(
    name: str, dtype: str, case: str, mode: str
) -> None:
    expected = run(name, dtype, case, "dynamic").sequences
    got = run(name, dtype, case, mode).sequences
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_says_paris(dtype: str) -> None:
    _, tokenizer = model_and_tokenizer("smollm2", dtype)
    ids, _ = inputs("smollm2", "greedy")
    for cache_kind in ("dynamic", *MODES):
        sequences = run("smollm2", dtype, "greedy", cache_kind).sequences
        assert tokenizer.decode(sequences[0, ids.shape[1] :]) == SMOLLM2_ANSWER


def test_gemma_prompt_outruns_its_sliding_window_three_times() -> None:
    model, _ = model_and_tokenizer("gemma3", "float32")
    assert inputs("gemma3", "greedy")[0].shape == (1, GEMMA_PROMPT_TOKENS)
    assert model.config.sliding_window == 512 and GEMMA_PROMPT_TOKENS > 3 * 512


# --------------------------------------------------------------------------- KV bytes


@pytest.mark.parametrize("mode", MODES)
def test_smollm2_holds_about_the_kv_bytes_of_dynamic_cache(mode: str) -> None:
    """Full attention everywhere: the blocks hold what DynamicCache holds, plus the last block's slack."""
    paged, dynamic = kv_bytes_held("smollm2", "float32", mode)
    model, _ = model_and_tokenizer("smollm2", "float32")
    block_bytes = PagedCache.from_model(model, num_blocks=1, block_size=16).manager.pool.bytes_per_block
    assert dynamic <= paged < dynamic + block_bytes


@pytest.mark.parametrize("mode", MODES)
def test_gemma_holds_at_most_dynamic_cache_kv_bytes(mode: str) -> None:
    paged, dynamic = kv_bytes_held("gemma3", "float32", mode)
    assert paged <= KV_BYTES_RATIO * dynamic, f"pagedkv holds {paged:,} bytes, DynamicCache {dynamic:,}"


def test_report_kv_bytes_held() -> None:
    """Print pagedkv's and DynamicCache's KV bytes for each model and mode (run with -s to see them)."""
    for name in ("smollm2", "gemma3"):
        for mode in MODES:
            paged, dynamic = kv_bytes_held(name, "float32", mode)
            ratio = paged / dynamic
            print(f"KV bytes {name} {mode}: pagedkv {paged:,}, DynamicCache {dynamic:,}, {ratio:.2f}x")
