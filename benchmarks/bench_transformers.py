"""transformers generation through pagedkv vs ``DynamicCache``: prefill time and ms per generated token.

Random-init models, no weights downloaded, torch pinned to one thread. For each
model and cache, greedy ``generate`` of one prompt and ``1 + N`` new tokens is
timed where each step's logits come out: prefill is the time to the first
logits (median of ``--repeats`` runs), decode the median time between two
later ones (over every step of every run). Every configuration is interleaved
in each round so drift hits all alike.

    python benchmarks/bench_transformers.py                  # tiny and medium
    python benchmarks/bench_transformers.py --models tiny --repeats 3
    python benchmarks/bench_transformers.py --overhead       # numpy only: per-layer call overhead

Needs the ``hf`` extra (torch, transformers), except ``--overhead``. Prints a
table; asserts nothing about time. Ratios are against ``DynamicCache`` with the
model's default attention (sdpa) in the same round. "no read cache" is storage
mode gathering every visible key and value from the pages each call
(``read_cache=False``).

``--overhead`` is issue 14's "fast path for trusted callers": what one decode
layer's ``write`` + ``attend`` cost on a ``KVCacheManager`` beyond the kernel
itself, ``attend_dense`` on the very arrays ``attend`` reads (read again, untimed,
after each call). ``attend`` is timed twice: first after the write, then
("again") right after the kernel, as warm as the kernel was (attend changes
nothing); the overhead column compares like with like, ``write + again -
kernel``. Medians over every layer of every step, the managers (default,
``trusted_inputs=True``, and trusted with attend's one-sequence fast path
switched off, the general path) interleaved step by step.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pagedkv import KVCacheManager, KVPool
from pagedkv.attention import attend_dense

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


def build(config_kwargs: dict[str, Any]) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024, max_position_embeddings=4096, initializer_range=0.2, **config_kwargs
    )
    return LlamaForCausalLM(config).eval()


def run(model: Any, prompt: Any, num_new: int, make_cache: Callable[[], Any]) -> tuple[float, list[float]]:
    """One greedy ``generate``: (seconds to the first token's logits, seconds between later tokens' logits).

    NOTE: the clock is read where ``generate`` hands each step's logits to
    the logits processors, so the decode time is measured per step, not as
    the difference of two whole runs (whose prefill noise, on a shared
    machine, swamped the decode by several percent).
    """
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Stamp(LogitsProcessor):  # type: ignore[misc]
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            stamps.append(time.perf_counter())
            return scores

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
            logits_processor=LogitsProcessorList([Stamp()]),
        )
    return stamps[0] - start, [later - earlier for earlier, later in itertools.pairwise(stamps)]


def bench(name: str, num_new: int, repeats: int) -> list[tuple[str, str, float, float]]:
    import torch
    from transformers import DynamicCache

    from pagedkv.integrations.transformers import PagedCache, use_pagedkv_attention

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
            first, steps = run(model, prompt, 1 + num_new, make_cache)
            if round_index:
                prefill[mode].append(first)
                decode[mode].extend(steps)
    rows = []
    for mode in modes:
        rows.append((name, mode, statistics.median(prefill[mode]), statistics.median(decode[mode])))
    return rows


#: ``--overhead``'s shape: issue 14's decode probe (2 kv / 4 q heads, head_dim 64, float32).
OVERHEAD_SHAPE = dict(num_layers=4, num_kv_heads=2, num_q_heads=4, head_dim=64, block_size=16)


class _DecodeProbe:
    """A manager decoding one sequence of ``prompt + 1 .. prompt + period`` tokens, restarted each period."""

    def __init__(self, trusted: bool, fast_path: bool, prompt: int, period: int) -> None:
        shape = OVERHEAD_SHAPE
        self.num_layers, self.head_dim = shape["num_layers"], shape["head_dim"]
        self.num_kv_heads = shape["num_kv_heads"]
        pool = KVPool(
            4 * (prompt + period) // shape["block_size"] + 4,
            block_size=shape["block_size"],
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            num_layers=self.num_layers,
            dtype=np.float32,
        )
        self.manager = KVCacheManager(
            pool, num_q_heads=shape["num_q_heads"], scale=self.head_dim**-0.5, trusted_inputs=trusted
        )
        self.fast_path, self.prompt, self.period = fast_path, prompt, period
        self.rng = np.random.default_rng(0)
        self.token = self.rng.standard_normal((1, self.num_kv_heads, self.head_dim)).astype(np.float32)
        self.query = self.rng.standard_normal((1, shape["num_q_heads"], self.head_dim)).astype(np.float32)
        self.times: dict[str, list[float]] = {
            "reserve": [], "write": [], "attend": [], "kernel": [], "attend again": []
        }
        self.num_steps = 0

    def step(self) -> None:
        manager, times = self.manager, self.times
        if self.num_steps % self.period == 0:
            if "s" in manager:
                manager.free("s")
            manager.add_sequence("s")
            batch = manager.reserve({"s": self.prompt})
            history = self.rng.standard_normal((self.prompt, self.num_kv_heads, self.head_dim))
            for layer in range(self.num_layers):
                manager.write(layer, batch, history.astype(np.float32), history.astype(np.float32))
        self.num_steps += 1
        saved = KVCacheManager._attend_one_sequence
        if not self.fast_path:  # the general path: the fast path always declines
            KVCacheManager._attend_one_sequence = lambda *args: None  # type: ignore[method-assign,assignment]
        try:
            start = time.perf_counter()
            batch = manager.reserve({"s": 1})
            times["reserve"].append(time.perf_counter() - start)
            table = manager.block_table("s")
            for layer in range(self.num_layers):
                start = time.perf_counter()
                manager.write(layer, batch, self.token, self.token)
                middle = time.perf_counter()
                manager.attend(layer, batch, self.query)
                end = time.perf_counter()
                times["write"].append(middle - start)
                times["attend"].append(end - middle)
                keys, values = manager.pool.read(layer, table, [(0, table.num_tokens)])  # what attend read
                start = time.perf_counter()
                attend_dense(self.query[0], keys.transpose(1, 0, 2), values.transpose(1, 0, 2), manager.scale)
                middle = time.perf_counter()
                manager.attend(layer, batch, self.query)  # again (it changes nothing): as warm as the kernel
                end = time.perf_counter()
                times["kernel"].append(middle - start)
                times["attend again"].append(end - middle)
        finally:
            KVCacheManager._attend_one_sequence = saved  # type: ignore[method-assign]


def bench_overhead(num_steps: int, prompt: int, period: int) -> None:
    """Print ``--overhead``'s table: per-layer write, attend, kernel and their overhead, in µs."""
    probes = {
        "default": _DecodeProbe(trusted=False, fast_path=True, prompt=prompt, period=period),
        "trusted_inputs=True": _DecodeProbe(trusted=True, fast_path=True, prompt=prompt, period=period),
        "  attend general path": _DecodeProbe(trusted=True, fast_path=False, prompt=prompt, period=period),
    }
    for _ in range(num_steps):  # interleaved, step by step
        for probe in probes.values():
            probe.step()
    print(
        f"decode of one token over {prompt + 1}..{prompt + period} tokens, {OVERHEAD_SHAPE}, float32; "
        f"medians of {num_steps} steps (x{OVERHEAD_SHAPE['num_layers']} layers), microseconds"
    )
    print(
        f"{'manager':22} {'reserve/step':>12} {'write':>7} {'attend':>7} {'again':>7} {'kernel':>7} "
        f"{'w+again-kernel':>15}"
    )
    for name, probe in probes.items():
        reserve, write, attend, again, kernel = (
            statistics.median(probe.times[key]) * 1e6
            for key in ("reserve", "write", "attend", "attend again", "kernel")
        )
        print(
            f"{name:22} {reserve:12.1f} {write:7.1f} {attend:7.1f} {again:7.1f} {kernel:7.1f} "
            f"{write + again - kernel:15.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--overhead", action="store_true", help="only the per-layer call overhead (numpy)")
    parser.add_argument("--overhead-steps", type=int, default=2000)
    args = parser.parse_args()
    from threadpoolctl import threadpool_limits

    if args.overhead:
        with threadpool_limits(limits=1):
            bench_overhead(args.overhead_steps, prompt=8, period=16)
        return
    import torch

    torch.set_num_threads(1)
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
