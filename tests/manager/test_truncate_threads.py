"""Threads, prefix caching and truncate on one manager: every output equals a single-threaded recompute.

Issue 27: under 4-6 threads driving their own sequences on one manager with
prefix caching and ``truncate``, a truncate into a keyed block shared with
another thread's sequence left the block keyed; after the other sequence
left, an append rewrote it in place and later prefix hits read the wrong k/v
(18-610 wrong decodes, 16-1,144 wrong prefill rows a run). This workload is
that engine: four threads, each admitting sequences with prompts drawn from a
few shared ones (so prefix hits cross threads), prefilling the rest, decoding,
truncating (often into a block), freeing and re-admitting the history it had,
with KV events drained and replayed into a router's index.

The model (as in ``tests/test_stateful_prefix.py``): q, k, v of the token at
position ``p`` are a function of ``token_ids[0 .. p]``, a chained hash, so
equal prefixes hold equal k/v and a shared block is right only when its
prefix is. Every output is checked bit for bit against a recompute that
shares nothing: a decode against :func:`pagedkv.reference.attend_window`
over the sequence's own tokens; a prefill chunk against a fresh manager
without caching fed the same history in the same chunks.

Length: a few seconds under the default profile; ``PAGEDKV_HYPOTHESIS_PROFILE=ci``
runs twenty times the steps, and ``PAGEDKV_THREAD_STEPS=n`` sets the steps per
thread for a long run by hand.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import pytest

from pagedkv import KVCacheManager, KVPool
from pagedkv.blocks.allocator import BlockAllocator
from pagedkv.errors import PoolExhaustedError
from pagedkv.prefix.events import PrefixIndex
from pagedkv.reference import attend_window

BLOCK_SIZE = 2
NUM_LAYERS = 2
NUM_KV_HEADS = 1
HEAD_DIM = 2
NUM_THREADS = 4
#: Prompts every thread draws from: prefixes of them collide across threads.
#: What a thread does at each step, and how often.
OPS = ("admit", "decode", "truncate", "fork", "readmit", "free", "drain")
OP_WEIGHTS = (15, 30, 20, 10, 10, 10, 5)
MAX_LIVE_PER_THREAD = 4
SHARED_PROMPTS = ([1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9, 9], [5, 6, 7, 8, 1], [1, 2, 8, 8, 8, 8, 2])


def _steps_per_thread() -> int:
    """Steps each thread runs: about a second a run by default, twenty times that for the ``ci`` profile."""
    by_hand = os.environ.get("PAGEDKV_THREAD_STEPS")
    if by_hand:
        return int(by_hand)
    return 20_000 if os.environ.get("PAGEDKV_HYPOTHESIS_PROFILE") == "ci" else 1000


def _row(digest: bytes) -> np.ndarray:
    """``(3, NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM)`` q, k, v of one token, exact multiples of 1/128 in [-1, 1).

    Small scores keep the softmax flat, so a wrong key or value anywhere in
    the window moves the output.
    """
    values = (np.frombuffer(digest, np.uint8).astype(np.float64) - 128.0) / 128.0
    return values.reshape(3, NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM)


_ROW_BYTES = 3 * NUM_LAYERS * NUM_KV_HEADS * HEAD_DIM


@dataclass
class History:
    """The tokens a sequence logically holds, with each one's prefix hash and q, k, v."""

    token_ids: list[int] = field(default_factory=list)
    digests: list[bytes] = field(default_factory=list)
    rows: list[np.ndarray] = field(default_factory=list)

    def extend(self, token_ids: list[int]) -> None:
        for token_id in token_ids:
            parent = self.digests[-1] if self.digests else b"root"
            digest = hashlib.blake2b(parent + token_id.to_bytes(8, "little"), digest_size=_ROW_BYTES).digest()
            self.token_ids.append(token_id)
            self.digests.append(digest)
            self.rows.append(_row(digest))

    def truncate(self, num_tokens: int) -> None:
        del self.token_ids[num_tokens:], self.digests[num_tokens:], self.rows[num_tokens:]


@dataclass
class Tally:
    """What one thread saw."""

    num_steps: int = 0
    num_decodes: int = 0
    num_prefill_rows: int = 0
    num_truncates: int = 0
    num_prefix_hits: int = 0
    wrong_decodes: int = 0
    wrong_prefill_rows: int = 0
    first_wrong: str = ""


class Workload:
    """One manager, ``num_threads`` threads, each running its own sequences."""

    def __init__(self, num_threads: int, num_steps: int, seed: int) -> None:
        pool = KVPool(
            48, block_size=BLOCK_SIZE, num_layers=NUM_LAYERS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
            dtype=np.float64,
        )
        self.manager = KVCacheManager(pool, enable_prefix_caching=True, kv_events=True)
        self.num_threads, self.num_steps, self.seed = num_threads, num_steps, seed
        self.tallies = [Tally() for _ in range(num_threads)]
        self.errors: list[BaseException] = []
        self.index = PrefixIndex()
        self._events_lock = threading.Lock()  # a drain and its replay stay in order
        #: Histories sequences had before a truncate or a free, every thread's: later prompts
        #: start with them, so hits reach decoded blocks too (and any key left on rewritten ones).
        self.recent: deque[tuple[int, ...]] = deque(maxlen=32)

    def run(self) -> None:
        threads = [threading.Thread(target=self._guarded, args=(i,)) for i in range(self.num_threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def _guarded(self, thread_index: int) -> None:
        try:
            self._thread(thread_index)
        except BaseException as error:  # reported by the test, not lost in the thread
            self.errors.append(error)

    def _thread(self, thread_index: int) -> None:
        rng = random.Random(self.seed * 1000 + thread_index)
        tally = self.tallies[thread_index]
        live: dict[str, History] = {}
        next_id = 0
        for _ in range(self.num_steps):
            tally.num_steps += 1
            op = rng.choices(OPS, OP_WEIGHTS)[0] if live else "admit"
            if op == "admit" and len(live) < MAX_LIVE_PER_THREAD:
                next_id += 1
                self._admit(f"t{thread_index}-{next_id}", self._prompt(rng), live, tally)
                continue
            seq_id = rng.choice(sorted(live))
            history = live[seq_id]
            if op in ("admit", "decode"):
                self._decode(seq_id, rng.randint(0, 9), live, tally)
            elif op == "truncate":
                num_tokens = len(history.token_ids)
                # Half the time a speculative rollback of a few tokens, else anywhere (into the prompt's
                # shared blocks too).
                low = max(0, num_tokens - 2 * BLOCK_SIZE) if rng.random() < 0.5 else 0
                cut = rng.randint(low, num_tokens)
                self.recent.append(tuple(history.token_ids))
                self.manager.truncate(seq_id, cut)
                history.truncate(cut)
                tally.num_truncates += 1
            elif op == "fork" and len(live) < MAX_LIVE_PER_THREAD:  # parallel sampling: shares every block
                next_id += 1
                child = f"t{thread_index}-{next_id}"
                self.manager.fork(seq_id, child)
                live[child] = History(list(history.token_ids), list(history.digests), list(history.rows))
            elif op == "readmit":  # free, and admit the history it had again: a hit on its own blocks
                kept = list(history.token_ids)
                self._free(seq_id, live)
                if kept:
                    next_id += 1
                    self._admit(f"t{thread_index}-{next_id}", kept, live, tally)
            elif op == "free":
                self._free(seq_id, live)
            elif op == "drain":
                self._drain_events()

    # ------------------------------------------------------------ commands

    def _admit(self, seq_id: str, prompt: list[int], live: dict[str, History], tally: Tally) -> None:
        num_hit = self.manager.add_sequence(seq_id, prompt)
        tally.num_prefix_hits += num_hit
        history = History()
        history.extend(prompt[:num_hit])
        live[seq_id] = history
        self._feed(seq_id, prompt[num_hit:], live, tally)

    def _decode(self, seq_id: str, token_id: int, live: dict[str, History], tally: Tally) -> None:
        self._feed(seq_id, [token_id], live, tally)

    def _free(self, seq_id: str, live: dict[str, History]) -> None:
        self.manager.free(seq_id)
        self.recent.append(tuple(live.pop(seq_id).token_ids))

    def _prompt(self, rng: random.Random) -> list[int]:
        """A prefix of a shared prompt or of a recent history (any thread's), and a few more ids."""
        recent = list(self.recent)
        base = list(rng.choice(recent if recent and rng.random() < 0.5 else SHARED_PROMPTS))
        prompt = base[: rng.randint(1, len(base))] if base else []
        return prompt + [rng.randint(0, 3) for _ in range(rng.randint(0 if prompt else 1, 3))]

    def _feed(self, seq_id: str, token_ids: list[int], live: dict[str, History], tally: Tally) -> None:
        """Reserve, write and attend ``token_ids`` in every layer; check each output; on a full pool, free."""
        manager, history = self.manager, live[seq_id]
        try:
            batch = manager.reserve({seq_id: token_ids})
        except PoolExhaustedError:  # the other threads hold the pool: give this one up
            self._free(seq_id, live)
            return
        start = len(history.token_ids)
        history.extend(token_ids)
        rows = np.stack(history.rows[start:])  # (n, 3, num_layers, num_kv_heads, head_dim)
        for layer in range(NUM_LAYERS):
            manager.write(layer, batch, rows[:, 1, layer], rows[:, 2, layer])
            out = manager.attend(layer, batch, rows[:, 0, layer])  # (n, num_kv_heads, head_dim)
            expected = self._recompute(history, start, layer)
            for i, (actual, wanted) in enumerate(zip(out, expected)):
                if np.array_equal(actual, wanted):
                    continue
                if len(token_ids) == 1:
                    tally.wrong_decodes += 1
                else:
                    tally.wrong_prefill_rows += 1
                tally.first_wrong = tally.first_wrong or (
                    f"{seq_id} position {start + i} layer {layer}: {actual.tolist()} != {wanted.tolist()}"
                )
        if len(token_ids) == 1:
            tally.num_decodes += 1
        else:
            tally.num_prefill_rows += len(token_ids)

    def _drain_events(self) -> None:
        with self._events_lock:
            self.index.apply(self.manager.drain_kv_events())

    # ------------------------------------------------------------- oracle

    @staticmethod
    def _recompute(history: History, start: int, layer: int) -> list[np.ndarray]:
        """Outputs of tokens ``start ..`` of ``history`` in ``layer``, computed sharing nothing.

        A decode: the reference kernel over every token the sequence holds. A
        chunk: a fresh manager without caching, fed the tokens before it, then it.
        """
        rows = history.rows
        if len(rows) - start == 1:
            keys = [row[1, layer] for row in rows]
            values = [row[2, layer] for row in rows]
            return [attend_window(rows[-1][0, layer], keys, values)]
        pool = KVPool(
            len(rows) // BLOCK_SIZE + 1, block_size=BLOCK_SIZE, num_layers=NUM_LAYERS,
            num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype=np.float64,
        )
        fresh = KVCacheManager(pool)
        fresh.add_sequence("s")
        stacked = np.stack(rows)  # (num_tokens, 3, num_layers, num_kv_heads, head_dim)
        out = None
        for begin, end in ((0, start), (start, len(rows))):
            if begin == end:
                continue
            batch = fresh.reserve({"s": end - begin})
            for each in range(NUM_LAYERS):
                fresh.write(each, batch, stacked[begin:end, 1, each], stacked[begin:end, 2, each])
            if begin == start:
                out = fresh.attend(layer, batch, stacked[begin:end, 0, layer])
        assert out is not None
        return list(out)

    # -------------------------------------------------------------- report

    def summary(self) -> str:
        counts = [name for name in vars(Tally()) if name != "first_wrong"]
        total = {name: sum(getattr(tally, name) for tally in self.tallies) for name in counts}
        first = next((t.first_wrong for t in self.tallies if t.first_wrong), "none")
        return f"{total}; first wrong output: {first}"

    def num_wrong(self) -> int:
        return sum(t.wrong_decodes + t.wrong_prefill_rows for t in self.tallies)


def _run(num_threads: int, num_steps: int, seed: int) -> Workload:
    workload = Workload(num_threads, num_steps, seed)
    workload.run()
    if workload.errors:
        raise workload.errors[0]
    return workload


@pytest.mark.parametrize("seed", [0, 1])
def test_threads_truncating_shared_prefixes_give_the_recomputed_outputs(seed: int) -> None:
    workload = _run(NUM_THREADS, _steps_per_thread(), seed)
    assert workload.num_wrong() == 0, workload.summary()
    manager = workload.manager
    manager.check_invariants()  # the threads are done: quiet
    workload._drain_events()
    assert workload.index.hashes == set(manager.prefix_cache._block_of), "event index != prefix cache"
    assert manager.kv_events is not None and manager.kv_events.num_dropped == 0
    tally = workload.summary()
    # The workload did what it is for: truncates, decodes, prefills and prefix hits, in every thread.
    for thread in workload.tallies:
        assert thread.num_truncates and thread.num_decodes and thread.num_prefix_hits, tally


def test_the_workload_catches_an_append_into_a_keyed_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug (issue 27's): a partly held keyed block is copied only when shared. One thread,
    so the run is the same every time; its sequences share prompts as the threads do."""

    def appends_in_place(self: BlockAllocator, block_id: int, num_dropped: int = 0) -> bool:
        return self.ref_count(block_id) - num_dropped > 1

    monkeypatch.setattr(BlockAllocator, "must_copy_before_append", appends_in_place)
    # The bug needs a rare order (cut into a shared block, the sharers leave, then an append and
    # a hit): a few seeded runs, stopping at the first that sees a wrong output.
    runs = []
    for seed in range(10):
        runs.append(_run(1, 3000, seed))
        if runs[-1].num_wrong():
            break
    assert runs[-1].num_wrong() > 0, [run.summary() for run in runs]
