"""transformers generation through pagedkv vs ``DynamicCache``: prefill time and ms per generated token.

Random-init models, no weights downloaded, torch pinned to one thread. For each
model and cache, greedy ``generate`` of one prompt is timed twice: once with
``max_new_tokens=1`` (the prefill, plus one token) and once with ``1 + N``; the
difference over ``N`` is the decode cost per token. Medians of ``--repeats``
runs, every configuration interleaved in each round so drift hits all alike.

    python benchmarks/bench_transformers.py                  # tiny and medium
    python benchmarks/bench_transformers.py --models tiny --repeats 3

Needs the ``hf`` extra (torch, transformers). Prints a table; asserts nothing
about time. Ratios are against ``DynamicCache`` with the model's default
attention (sdpa) in the same round. "no read cache" is storage mode gathering
every visible key and value from the pages each call (``read_cache=False``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from pagedkv.integrations.transformers import PagedCache, use_pagedkv_attention

MODELS = {
    # name: (config kwargs, prompt length)
    "tiny": (
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        33,
    ),
    "medium": (
        dict(
            hidden_size=512,
            intermediate_size=1376,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
        ),
        1000,
    ),
}


def build(config_kwargs: dict[str, Any]) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024, max_position_embeddings=4096, initializer_range=0.2, **config_kwargs
    )
    return LlamaForCausalLM(config).eval()


def run(model: LlamaForCausalLM, prompt: torch.Tensor, num_new: int, make_cache: Callable[[], Any]) -> float:
    cache = make_cache()
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            prompt,
            cache=cache,
            max_new_tokens=num_new,
            min_new_tokens=num_new,
            do_sample=False,
            pad_token_id=0,
        )
    return time.perf_counter() - start


def bench(name: str, num_new: int, repeats: int) -> list[tuple[str, str, float, float]]:
    config_kwargs, prompt_length = MODELS[name]
    model = build(config_kwargs)
    prompt = torch.randint(3, 1024, (1, prompt_length))
    num_blocks = (prompt_length + num_new) // 16 + 4
    modes = {
        "DynamicCache (sdpa)": ("sdpa", lambda: DynamicCache(config=model.config)),
        "PagedCache storage (sdpa)": ("sdpa", lambda: PagedCache.from_model(model, num_blocks)),
        "  no read cache (sdpa)": (
            "sdpa",
            lambda: PagedCache.from_model(model, num_blocks, read_cache=False),
        ),
        "PagedCache attention": ("pagedkv", lambda: PagedCache.from_model(model, num_blocks)),
    }
    prefill: dict[str, list[float]] = {mode: [] for mode in modes}
    decode: dict[str, list[float]] = {mode: [] for mode in modes}
    for round_index in range(repeats + 1):  # round 0 warms up
        for mode, (attention, make_cache) in modes.items():
            if attention == "pagedkv":
                use_pagedkv_attention(model)
            else:
                model.set_attn_implementation(attention)
            short = run(model, prompt, 1, make_cache)
            long = run(model, prompt, 1 + num_new, make_cache)
            if round_index:
                prefill[mode].append(short)
                decode[mode].append((long - short) / num_new)
    rows = []
    for mode in modes:
        rows.append((name, mode, statistics.median(prefill[mode]), statistics.median(decode[mode])))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1):
        print(f"torch {torch.__version__}, 1 thread; {args.new_tokens} new tokens; median of {args.repeats}")
        print(f"{'model':8} {'cache':28} {'prefill ms':>11} {'x':>6} {'decode ms/token':>16} {'x':>6}")
        for name in args.models:
            rows = bench(name, args.new_tokens, args.repeats)
            base_prefill, base_decode = rows[0][2], rows[0][3]
            for model, mode, prefill, decode in rows:
                print(
                    f"{model:8} {mode:28} {prefill * 1e3:11.2f} {prefill / base_prefill:6.2f} "
                    f"{decode * 1e3:16.3f} {decode / base_decode:6.2f}"
                )


if __name__ == "__main__":
    main()
