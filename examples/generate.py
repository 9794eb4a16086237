"""Generate from the real models of the ``models`` extra through pagedkv, beside ``DynamicCache``.

For each model (Gemma 3 270M, SmolLM2-135M-Instruct, from their GGUF files) and each
cache (transformers' ``DynamicCache``, pagedkv in storage mode, pagedkv in attention
mode), prints the text generated, the tokens per second and the KV bytes the cache
holds at the end (pagedkv: the blocks its sequences hold; ``DynamicCache``: its tensors).

    pip install -e '.[hf,models]'
    python examples/generate.py                    # both models, float32
    python examples/generate.py --model gemma3 --dtype bfloat16 --repeat 40

A model whose package is absent is skipped with a line saying what to install.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import transformers

from pagedkv.integrations.transformers import (
    PagedCache,
    kv_bytes,
    load_model,
    use_pagedkv_attention,
)

PROMPTS = {
    "smollm2": "The capital of France is",
    "gemma3": "The three primary colors of light are",
}
CACHES = ("DynamicCache", "pagedkv storage", "pagedkv attention")


def generate(
    model: Any, tokenizer: Any, prompt: str, cache_kind: str, num_new: int
) -> tuple[Any, float, int]:
    """``(new token ids, tokens per second, KV bytes held)`` of one greedy generation."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    if cache_kind == "pagedkv attention":
        use_pagedkv_attention(model)
    else:
        model.set_attn_implementation("sdpa")
    if cache_kind == "DynamicCache":
        cache: Any = transformers.DynamicCache(config=model.config)
    else:
        cache = PagedCache.from_model(model, num_blocks=(ids.shape[1] + num_new) // 16 + 2, block_size=16)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, cache=cache, max_new_tokens=num_new, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or 0)
    seconds = time.perf_counter() - start
    new = out[0, ids.shape[1] :]
    return new, len(new) / seconds, kv_bytes(cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=[*PROMPTS, "all"], default="all")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=1,
                        help="repeat the prompt this many times (a long prompt: sliding windows evict)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for name in PROMPTS if args.model == "all" else [args.model]:
        try:
            model, tokenizer = load_model(name, args.dtype)
        except ImportError as error:
            print(f"{name}: skipped: {error}")
            continue
        prompt = " ".join([PROMPTS[name]] * args.repeat)
        num_prompt = tokenizer(prompt, return_tensors="pt")["input_ids"].shape[1]
        print(f"\n{name} ({args.dtype}): {num_prompt} prompt tokens, {args.max_new_tokens} new, greedy")
        print(f"{'cache':<18} {'tokens/s':>9} {'KV bytes':>13}  text")
        results = {}
        for cache_kind in CACHES:
            new, rate, held = generate(model, tokenizer, prompt, cache_kind, args.max_new_tokens)
            results[cache_kind] = new
            print(f"{cache_kind:<18} {rate:>9.1f} {held:>13,}  {tokenizer.decode(new)!r}")
        same = all(torch.equal(results[kind], results["DynamicCache"]) for kind in CACHES)
        print("tokens identical to DynamicCache:", "yes" if same else "NO")


if __name__ == "__main__":
    main()
