"""A Hypothesis state machine over ``KVCacheManager`` against a deliberately dumb model.

The configuration is drawn once per example and kept tiny (2–16 blocks of 1–4
slots, 1–2 layers, a window of 1–8 or none, 0–2 sinks, GQA sometimes, a small
host pool or none), so the pool runs out in most examples. Live sequence ids
sit in a Bundle. The model keeps, per sequence, its state, token count,
window start, written counts, per-layer (k, v) history, and which *model
block* holds each logical block (model blocks are plain counters, shared by
forks), and predicts from that alone:

* whether a reservation fits, how many blocks it takes, copies and releases
  (compared with ``plan()``), and that ``reserve`` then raises exactly when
  it does not fit;
* the free block count, the host pool's, and the sharing pattern: model
  blocks and real block ids must correspond one to one;
* live slots and tokens of ``metrics()``;
* every attend output, per sequence and per layer, from the pure-Python
  oracle over that sequence's own history (window and sinks applied), and
  bit for bit from ``reference.attend_window`` for single-token decodes.

``truncate`` (speculative decoding's rollback) cuts the model's history, written
counts and blocks to the kept tokens, window start unchanged; the model alone
says which lengths are allowed (unwritten layers, tokens the window evicted),
and later attends are checked against its recompute over the kept tokens plus
the new ones.

Misuse rules, one a wrong call and each enabled only where that misuse is
possible, check the error type and that nothing changed. After every step
``check_invariants()`` runs.
"""

from __future__ import annotations

import itertools
import os
import re
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)
from support.managers import ceil_div, make_manager, manager_state, settle
from support.windows import visible

from pagedkv import (
    Batch,
    ConfigError,
    DuplicateSequenceError,
    InputTypeError,
    KVCacheManager,
    KVPool,
    LayerIndexError,
    PoolExhaustedError,
    SequenceState,
    SequenceStateError,
    ShapeError,
    UnknownSequenceError,
)
from pagedkv.manager.sequence import SequenceRecord
from pagedkv.reference import attend_window
from pagedkv.testing.oracle import FLOAT32_EPS, FLOAT64_EPS, attend, within_tolerance

RUNNING, PREEMPTED, SWAPPED = "running", "preempted", "swapped"
STATES = {SequenceState.RUNNING: RUNNING, SequenceState.PREEMPTED: PREEMPTED, SequenceState.SWAPPED: SWAPPED}


@dataclass
class Seq:
    """The model of one sequence."""

    num_layers: int
    num_sinks: int
    state: str = RUNNING
    num_tokens: int = 0
    window_start: int = 0
    written: list[int] = field(default_factory=list)
    hist: list[list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=list)
    blocks: dict[int, int] = field(default_factory=dict)  # logical block -> model block
    num_host_blocks: int = 0

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.num_tokens = 0
        self.window_start = self.num_sinks
        self.written = [0] * self.num_layers
        self.hist = [[] for _ in range(self.num_layers)]
        self.blocks = {}

    @property
    def settled(self) -> bool:
        return self.state == RUNNING and all(n == self.num_tokens for n in self.written)

    def copy(self) -> Seq:
        twin = Seq(self.num_layers, self.num_sinks)
        twin.num_tokens, twin.window_start = self.num_tokens, self.window_start
        twin.written = list(self.written)
        twin.hist = [list(h) for h in self.hist]
        twin.blocks = dict(self.blocks)
        return twin


@dataclass
class Pending:
    """A batch reserved and written in layer 0 only."""

    batch: Batch
    kvq: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
    stale: bool = False


class ManagerMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.m: KVCacheManager | None = None
        self.model: dict[Hashable, Seq] = {}
        self.freed: list[Hashable] = []
        self.pending: Pending | None = None
        self.last_batch: Batch | None = None
        self.ids = itertools.count()
        self.block_names = itertools.count()

    # ------------------------------------------------------------ set-up

    @initialize(
        target=seqs,
        num_blocks=st.integers(2, 16),
        block_size=st.integers(1, 4),
        num_layers=st.integers(1, 2),
        window=st.none() | st.integers(1, 8),
        per_layer=st.booleans(),
        layer_windows=st.lists(st.none() | st.integers(1, 8), min_size=2, max_size=2),
        sinks=st.integers(0, 2),
        num_kv_heads=st.integers(1, 2),
        group=st.sampled_from([1, 1, 2]),
        head_dim=st.integers(1, 2),
        dtype=st.sampled_from([np.float64, np.float32]),
        host_blocks=st.sampled_from([0, 2, 4, 8, 16]),
        scale=st.sampled_from([1.0, 0.5]),
    )
    def configure(
        self,
        num_blocks: int,
        block_size: int,
        num_layers: int,
        window: int | None,
        per_layer: bool,
        layer_windows: list[int | None],
        sinks: int,
        num_kv_heads: int,
        group: int,
        head_dim: int,
        dtype: Any,
        host_blocks: int,
        scale: float,
    ) -> Any:
        windows: dict[str, Any] = {"max_size": window}
        if per_layer and num_layers == 2:
            windows = {"layer_max_sizes": tuple(layer_windows)}
            self.windows = list(layer_windows)
        else:
            self.windows = [window] * num_layers
        self.m = make_manager(
            num_blocks,
            host_blocks=host_blocks,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            num_layers=num_layers,
            dtype=dtype,
            num_sink_tokens=sinks,
            num_q_heads=num_kv_heads * group,
            scale=scale,
            **windows,
        )
        self.num_blocks, self.block_size, self.num_layers = num_blocks, block_size, num_layers
        self.num_host_blocks, self.num_sinks, self.scale = host_blocks, sinks, scale
        self.num_sink_blocks = ceil_div(sinks, block_size)
        # the window that frees blocks: the largest, unbounded if any layer is
        self.free_window = None if any(w is None for w in self.windows) else max(self.windows)  # type: ignore[type-var]
        self.kv_shape = (num_kv_heads, head_dim)
        self.q_shape = (num_kv_heads * group, head_dim)
        self.dtype = np.dtype(dtype)
        self.eps = FLOAT32_EPS if self.dtype == np.float32 else FLOAT64_EPS
        note(
            f"config: blocks={num_blocks} bs={block_size} layers={num_layers} windows={self.windows} "
            f"sinks={sinks} heads={num_kv_heads}x{group} d={head_dim} {self.dtype} host={host_blocks}"
        )
        return multiple(self.add_sequence(), self.add_sequence())

    @property
    def mgr(self) -> KVCacheManager:
        assert self.m is not None
        return self.m

    # ------------------------------------------------------------ the model

    def held_model_blocks(self) -> Counter[int]:
        return Counter(b for s in self.model.values() if s.state == RUNNING for b in s.blocks.values())

    def num_free(self) -> int:
        return self.num_blocks - len(self.held_model_blocks())

    def num_host_free(self) -> int:
        return self.num_host_blocks - sum(
            s.num_host_blocks for s in self.model.values() if s.state == SWAPPED
        )

    def predict(self, request: dict[Hashable, int]) -> tuple[dict[str, Any], dict[Hashable, Seq]]:
        """Run a reservation on copies of the model: evict all, copy shared partial blocks, take new ones."""
        bs = self.block_size
        after = {s: m.copy() for s, m in self.model.items() if m.state == RUNNING}
        before = self.held_model_blocks()
        for s in request:
            seq = after[s]
            if self.free_window is not None:
                # the window start only moves forward, and never past the newest token
                start = min(seq.num_tokens + 1 - self.free_window, seq.num_tokens)
                seq.window_start = max(seq.window_start, start)
            seq.blocks = {
                j: b
                for j, b in seq.blocks.items()
                if j < self.num_sink_blocks or (j + 1) * bs > seq.window_start
            }
        refs = Counter(b for seq in after.values() for b in seq.blocks.values())
        released = len(set(before) - set(refs))
        num_copies = num_new = 0
        for s, n in request.items():
            seq = after[s]
            last = (seq.num_tokens - 1) // bs
            if seq.num_tokens % bs and refs[seq.blocks[last]] > 1:
                refs[seq.blocks[last]] -= 1
                seq.blocks[last] = next(self.block_names)
                num_copies += 1
            for j in range(ceil_div(seq.num_tokens, bs), ceil_div(seq.num_tokens + n, bs)):
                seq.blocks[j] = next(self.block_names)
                num_new += 1
            seq.num_tokens += n
        free = self.num_free()
        prediction = {
            "fits": num_new + num_copies <= free + released,
            "num_new_blocks": num_new + num_copies,
            "num_copy_on_write": num_copies,
            "num_released_blocks": released,
            "num_free_blocks": free,
        }
        return prediction, after

    def arrays(self, n: int, seed: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        rng = np.random.default_rng(seed)
        return [
            (
                rng.standard_normal((n, *self.kv_shape)).astype(self.dtype),
                rng.standard_normal((n, *self.kv_shape)).astype(self.dtype),
                rng.standard_normal((n, *self.q_shape)).astype(self.dtype),
            )
            for _ in range(self.num_layers)
        ]

    def write_and_check(
        self, layer: int, batch: Batch, kvq: tuple[np.ndarray, np.ndarray, np.ndarray], method: str
    ) -> None:
        k, v, q = kvq
        self.mgr.write(layer, batch, k, v)
        starts = batch.query_start
        for s, lo, hi in zip(batch.seq_ids, starts[:-1], starts[1:]):
            self.model[s].hist[layer].extend(zip(k[lo:hi], v[lo:hi]))
            self.model[s].written[layer] += int(hi - lo)
        self.attend_and_check(layer, batch, q, method)

    def attend_and_check(self, layer: int, batch: Batch, q: np.ndarray, method: str) -> None:
        out = self.mgr.attend(layer, batch, q, method=method)
        window = self.windows[layer]
        starts = batch.query_start
        for s, lo, hi in zip(batch.seq_ids, starts[:-1], starts[1:]):
            hist = self.model[s].hist[layer]
            first = len(hist) - int(hi - lo)
            for t in range(int(lo), int(hi)):
                p = first + t - int(lo)
                seen = visible(p, self.num_sinks, window)
                keys, values = [hist[j][0] for j in seen], [hist[j][1] for j in seen]
                expected, peak = attend(
                    q[t].tolist(), [x.tolist() for x in keys], [x.tolist() for x in values], self.scale
                )
                assert within_tolerance(out[t].tolist(), expected, peak, self.eps), (
                    f"oracle mismatch: seq {s!r} layer {layer} position {p} ({method}): "
                    f"{out[t]} vs {expected}"
                )
                if hi - lo == 1 and method == "loop":
                    exact = attend_window(q[t], keys, values, scale=self.scale, dtype=self.dtype)
                    assert np.array_equal(exact, out[t]), (
                        f"decode not bit-exact: seq {s!r} layer {layer} p {p}"
                    )

    def refused(self, error: type[Exception], action: Any, fragment: str | None = None) -> None:
        before = manager_state(self.mgr)
        with pytest.raises(error, match=fragment):
            action()
        assert manager_state(self.mgr) == before, "a refused call changed the manager"

    def invalidate(self, seq_id: Hashable) -> None:
        if self.pending is not None and seq_id in self.pending.batch.seq_ids:
            self.pending.stale = True

    def truncate_refusal(self, model: Seq, num_tokens: int) -> str | None:
        """Why keeping the first ``num_tokens`` (0 .. length) of a running ``model`` is refused, or None."""
        if num_tokens == model.num_tokens:
            return None
        if num_tokens > min(model.written):
            return "have not written"
        # the token after the kept ones sees the sinks and the widest window
        # before it: every one of those must still be held
        oldest = self.num_sinks
        if self.free_window is not None:
            oldest = max(self.num_sinks, num_tokens + 1 - self.free_window)
        return "left the window" if oldest < model.window_start else None

    def truncations(self, refusal: str | None) -> list[tuple[str, int]]:
        """(running sequence, length) pairs whose truncate the model answers with ``refusal``."""
        return [
            (s, n)
            for s, model in sorted(self.model.items())
            if model.state == RUNNING
            for n in range(model.num_tokens + 1)
            if self.truncate_refusal(model, n) == refusal
        ]

    def truncate_model(self, seq_id: str, num_tokens: int) -> None:
        """Keep the first ``num_tokens``: history, written counts and blocks; the window start stays."""
        model = self.model[seq_id]
        num_kept_blocks = ceil_div(num_tokens, self.block_size)
        model.blocks = {j: b for j, b in model.blocks.items() if j < num_kept_blocks}
        model.num_tokens = num_tokens
        model.written = [min(n, num_tokens) for n in model.written]
        model.hist = [h[:num_tokens] for h in model.hist]

    # ------------------------------------------------------------ rules: use

    @rule(target=seqs)
    def add_sequence(self) -> str:
        seq_id = f"s{next(self.ids)}"
        self.mgr.add_sequence(seq_id)
        self.model[seq_id] = Seq(self.num_layers, self.num_sinks)
        return seq_id

    @precondition(lambda self: bool(self.model))
    @rule(
        seq_ids=st.lists(seqs, min_size=1, max_size=3, unique=True),
        sizes=st.lists(st.integers(1, 6), min_size=3, max_size=3),
        seed=st.integers(0, 2**16),
        method=st.sampled_from(["loop", "loop", "padded"]),
        partial=st.booleans(),
    )
    def reserve_write_attend(
        self, seq_ids: list[str], sizes: list[int], seed: int, method: str, partial: bool
    ) -> None:
        request = dict(zip(seq_ids, sizes))
        note(f"reserve {request} ({method}{', layer 0 only' if partial else ''})")
        if not all(self.model[s].settled for s in seq_ids):
            self.refused(SequenceStateError, lambda: self.mgr.reserve(request))
            self.refused(SequenceStateError, lambda: self.mgr.plan(request))
            return
        prediction, after = self.predict(request)
        plan = self.mgr.plan(request)
        assert plan.fits == self.mgr.can_reserve(request)
        assert {name: getattr(plan, name) for name in prediction} == prediction, (plan, prediction)
        if not prediction["fits"]:
            event("reserve: pool exhausted")
            self.refused(PoolExhaustedError, lambda: self.mgr.reserve(request), "need")
            return
        event(f"reserve: {len(request)} sequences")
        if prediction["num_copy_on_write"]:
            event("reserve: copy-on-write")
        if prediction["num_released_blocks"]:
            event("reserve: window released blocks")
        batch = self.mgr.reserve(request)
        for s in request:
            model = self.model[s]
            model.num_tokens, model.window_start = after[s].num_tokens, after[s].window_start
        for s, seq in after.items():
            self.model[s].blocks = seq.blocks
        assert (
            self.mgr.pool.num_free_blocks
            == prediction["num_free_blocks"]
            + prediction["num_released_blocks"]
            - prediction["num_new_blocks"]
        )
        kvq = self.arrays(batch.num_tokens, seed)
        stop_early = partial and self.num_layers == 2 and self.pending is None
        for layer in range(1 if stop_early else self.num_layers):
            self.write_and_check(layer, batch, kvq[layer], method)
        if stop_early:
            self.pending = Pending(batch, kvq)
            event("reserve: layer 0 only (pending)")
        self.last_batch = batch

    @rule(seed=st.integers(0, 2**16), method=st.sampled_from(["loop", "padded"]), skip=st.integers(0, 3))
    def decode_step(self, seed: int, method: str, skip: int) -> None:
        """One new token for the settled running sequences (minus one, sometimes) in one batch."""
        ready = sorted(s for s, model in self.model.items() if model.settled)
        if skip and ready:
            del ready[skip % len(ready)]
        if ready:
            self.reserve_write_attend(ready, [1] * len(ready), seed, method, partial=False)

    @precondition(lambda self: self.pending is not None)
    @rule(method=st.sampled_from(["loop", "padded"]))
    def finish_pending(self, method: str) -> None:
        pending = self.pending
        assert pending is not None
        self.pending = None
        k, v, _ = pending.kvq[1]
        if pending.stale:
            event("pending batch went stale")
            note("finish a stale pending batch: refused")
            self.refused(
                SequenceStateError, lambda: self.mgr.write(1, pending.batch, k, v), "no longer reserved"
            )
            return
        self.write_and_check(1, pending.batch, pending.kvq[1], method)
        self.attend_and_check(0, pending.batch, pending.kvq[0][2], method)  # attending again is a query

    @precondition(lambda self: bool(self.model))
    @rule(target=seqs, parent=seqs)
    def fork(self, parent: str) -> Any:
        child = f"s{next(self.ids)}"
        if not self.model[parent].settled:
            self.refused(SequenceStateError, lambda: self.mgr.fork(parent, child))
            return multiple()
        free = self.mgr.pool.num_free_blocks
        self.mgr.fork(parent, child)
        assert self.mgr.pool.num_free_blocks == free
        self.model[child] = self.model[parent].copy()
        event("fork")
        return child

    @precondition(lambda self: bool(self.model))
    @rule(seq_id=consumes(seqs))
    def free(self, seq_id: str) -> None:
        self.mgr.free(seq_id)
        self.invalidate(seq_id)
        del self.model[seq_id]
        self.freed.append(seq_id)

    @precondition(lambda self: bool(self.model))
    @rule(seq_id=seqs, swap=st.booleans())
    def preempt(self, seq_id: str, swap: bool) -> None:
        model = self.model[seq_id]
        mode = "swap" if swap else "recompute"
        if model.state != RUNNING:
            self.refused(SequenceStateError, lambda: self.mgr.preempt(seq_id, mode), "not running")
        elif not swap:
            self.mgr.preempt(seq_id)
            event("recompute preemption" + (" mid-prefill" if not model.settled else ""))
            self.invalidate(seq_id)
            model.reset()
            model.state = PREEMPTED
        elif self.num_host_blocks == 0:
            self.refused(ConfigError, lambda: self.mgr.preempt(seq_id, "swap"), "host pool")
        elif not model.settled:
            event("swap out: refused mid-prefill")
            self.refused(SequenceStateError, lambda: self.mgr.preempt(seq_id, "swap"), "cannot swap out")
        elif len(model.blocks) > self.num_host_free():
            event("swap out: host pool full")
            self.refused(PoolExhaustedError, lambda: self.mgr.preempt(seq_id, "swap"), "need")
        else:
            self.mgr.preempt(seq_id, "swap")
            event("swap out")
            model.state = SWAPPED
            model.num_host_blocks = len(model.blocks)
            model.blocks = {}

    @precondition(lambda self: any(model.state != RUNNING for model in self.model.values()))
    @rule(pick=st.integers(0, 2**8))
    def resume(self, pick: int) -> None:
        # drawn among the sequences that can resume; resuming a running one is a misuse rule
        waiting = sorted(s for s, model in self.model.items() if model.state != RUNNING)
        seq_id = waiting[pick % len(waiting)]
        model = self.model[seq_id]
        if model.state == PREEMPTED:
            assert self.mgr.resume(seq_id) == 0
            model.state = RUNNING
        elif model.num_host_blocks > self.num_free():
            event("swap in: device pool full")
            self.refused(PoolExhaustedError, lambda: self.mgr.resume(seq_id), "need")
        else:
            event("swap in")
            assert self.mgr.resume(seq_id) == model.num_tokens
            bs = self.block_size
            held = [
                j
                for j in range(ceil_div(model.num_tokens, bs))
                if j < self.num_sink_blocks or (j + 1) * bs > model.window_start
            ]
            assert len(held) == model.num_host_blocks
            model.blocks = {j: next(self.block_names) for j in held}
            model.num_host_blocks = 0
            model.state = RUNNING

    @precondition(lambda self: any(model.state == RUNNING for model in self.model.values()))
    @rule(
        pick=st.integers(0, 2**8),
        into_shared=st.booleans(),
        as_numpy=st.booleans(),
        num_appended=st.integers(0, 3),
        seed=st.integers(0, 2**16),
    )
    def truncate(self, pick: int, into_shared: bool, as_numpy: bool, num_appended: int, seed: int) -> None:
        """Roll back to an allowed length (often into a block a fork shares), then append and attend."""
        allowed = self.truncations(None)
        refs = self.held_model_blocks()
        bs = self.block_size
        shared = [(s, n) for s, n in allowed if n % bs and refs[self.model[s].blocks.get(n // bs, -1)] > 1]
        candidates = shared if into_shared and shared else allowed
        seq_id, num_tokens = candidates[pick % len(candidates)]
        model = self.model[seq_id]
        note(f"truncate {seq_id} to {num_tokens} of {model.num_tokens}")
        self.mgr.truncate(seq_id, np.int64(num_tokens) if as_numpy else num_tokens)
        if num_tokens == model.num_tokens:
            event("truncate: nothing to drop")
        else:
            event("truncate: to 0 tokens" if num_tokens == 0 else "truncate: some tokens kept")
            if num_tokens % bs and refs[model.blocks.get(num_tokens // bs, -1)] > 1:
                event("truncate: into a shared block")
            if model.window_start > self.num_sinks:
                event("truncate: after the window moved")
            self.invalidate(seq_id)
            self.truncate_model(seq_id, num_tokens)
        kept = (self.mgr.num_tokens(seq_id), self.mgr.pool.num_free_blocks)
        assert kept == (num_tokens, self.num_free()), (
            f"truncate kept {kept[0]} tokens and {kept[1]} free blocks; "
            f"the model keeps {num_tokens} and {self.num_free()}"
        )
        if num_appended and model.settled:
            self.reserve_write_attend([seq_id], [num_appended], seed, "loop", partial=False)

    # ------------------------------------------------------------ rules: misuse
    # One rule per wrong call, enabled only where that misuse is possible; each
    # raises its own error and changes nothing (``refused`` checks both).

    def fresh_pending(self) -> Pending | None:
        """The half-written batch, unless a free or preemption made it stale."""
        return self.pending if self.pending is not None and not self.pending.stale else None

    @rule(op=st.integers(0, 7))
    def misuse_unknown_id(self, op: int) -> None:
        self.refuse_every_call_on("never-added", op)
        event("misuse: unknown id")

    @precondition(lambda self: bool(self.freed))
    @rule(pick=st.integers(0, 2**8), op=st.integers(0, 7))
    def misuse_freed_id(self, pick: int, op: int) -> None:
        self.refuse_every_call_on(self.freed[pick % len(self.freed)], op)
        event("misuse: freed id")

    def refuse_every_call_on(self, seq_id: Hashable, op: int) -> None:
        m = self.mgr
        calls = [
            lambda: m.reserve({seq_id: 1}),
            lambda: m.plan({seq_id: 1}),
            lambda: m.fork(seq_id, "child"),
            lambda: m.free(seq_id),
            lambda: m.preempt(seq_id),
            lambda: m.resume(seq_id),
            lambda: m.block_table(seq_id),
            lambda: m.truncate(seq_id, 0),
        ]
        self.refused(UnknownSequenceError, calls[op], f"no sequence '{seq_id}'")

    @precondition(lambda self: bool(self.model))
    @rule(seq_id=seqs)
    def misuse_duplicate_id(self, seq_id: str) -> None:
        self.refused(DuplicateSequenceError, lambda: self.mgr.add_sequence(seq_id), "already exists")
        event("misuse: duplicate id")

    @precondition(lambda self: any(model.settled for model in self.model.values()))
    @rule(child=seqs, pick=st.integers(0, 2**8))
    def misuse_fork_onto_existing(self, child: str, pick: int) -> None:
        parents = sorted(s for s, model in self.model.items() if model.settled)
        parent = parents[pick % len(parents)]
        self.refused(DuplicateSequenceError, lambda: self.mgr.fork(parent, child), "exists")
        event("misuse: fork onto existing")

    @precondition(lambda self: bool(self.model))
    @rule(seq_id=seqs, count=st.integers(-7, 0))
    def misuse_zero_or_negative_tokens(self, seq_id: str, count: int) -> None:
        fragment = f"must be an int >= 1, got {count}"
        self.refused(ConfigError, lambda: self.mgr.reserve({seq_id: count}), fragment)
        event("misuse: zero tokens" if count == 0 else "misuse: negative tokens")

    @precondition(lambda self: self.last_batch is not None)
    @rule(beyond=st.integers(-1, 6))
    def misuse_layer_out_of_range(self, beyond: int) -> None:
        batch = self.last_batch
        assert batch is not None
        layer = -1 if beyond == -1 else self.num_layers + beyond
        zeros = np.zeros((batch.num_tokens, *self.kv_shape))
        self.refused(LayerIndexError, lambda: self.mgr.write(layer, batch, zeros, zeros), "out of range")
        q = np.zeros((batch.num_tokens, *self.q_shape))
        self.refused(LayerIndexError, lambda: self.mgr.attend(layer, batch, q), "out of range")
        event("misuse: layer out of range")

    @precondition(lambda self: self.last_batch is not None)
    @rule()
    def misuse_write_again(self) -> None:
        # layer 0 of the newest batch is written, or the batch is stale by now
        batch = self.last_batch
        assert batch is not None
        zeros = np.zeros((batch.num_tokens, *self.kv_shape))
        self.refused(SequenceStateError, lambda: self.mgr.write(0, batch, zeros, zeros))
        event("misuse: write again")

    @precondition(lambda self: self.fresh_pending() is not None)
    @rule()
    def misuse_attend_before_write(self) -> None:
        pending = self.fresh_pending()
        assert pending is not None
        q = pending.kvq[1][2]
        self.refused(SequenceStateError, lambda: self.mgr.attend(1, pending.batch, q), "call write")
        event("misuse: attend before write")

    @precondition(lambda self: self.fresh_pending() is not None)
    @rule(too_many_heads=st.booleans())
    def misuse_wrong_shape(self, too_many_heads: bool) -> None:
        pending = self.fresh_pending()
        assert pending is not None
        m, n = self.mgr, pending.batch.num_tokens
        heads, head_dim = self.kv_shape
        k = np.zeros((n, heads + 1, head_dim) if too_many_heads else (n + 1, heads, head_dim))
        self.refused(ShapeError, lambda: m.write(1, pending.batch, k, k), "must have shape")
        bad_q = np.zeros((n, self.q_shape[0], self.q_shape[1] + 1))
        self.refused(ShapeError, lambda: m.attend(0, pending.batch, bad_q), "must have shape")
        event("misuse: wrong shape")

    @precondition(lambda self: self.fresh_pending() is not None)
    @rule(pick=st.integers(0, 2**8))
    def misuse_reserve_while_pending(self, pick: int) -> None:
        pending = self.fresh_pending()
        assert pending is not None
        m = self.mgr
        seq_id = pending.batch.seq_ids[pick % pending.batch.num_seqs]
        self.refused(SequenceStateError, lambda: m.reserve({seq_id: 1}), "have not written")
        if self.num_host_blocks:
            self.refused(SequenceStateError, lambda: m.preempt(seq_id, "swap"), "cannot swap out")
        self.refused(SequenceStateError, lambda: m.fork(seq_id, "child"), "cannot fork")
        event("misuse: reserve while pending")

    @precondition(lambda self: any(model.state == RUNNING for model in self.model.values()))
    @rule(pick=st.integers(0, 2**8))
    def misuse_resume_running(self, pick: int) -> None:
        running = sorted(s for s, model in self.model.items() if model.state == RUNNING)
        seq_id = running[pick % len(running)]
        self.refused(SequenceStateError, lambda: self.mgr.resume(seq_id), "is running")
        event("misuse: resume running")

    @precondition(lambda self: any(model.state == RUNNING for model in self.model.values()))
    @rule(
        pick=st.integers(0, 2**8),
        bad=st.sampled_from(["negative", "too many", "float", "string", "none", "bool"]),
        by=st.integers(1, 3),
    )
    def misuse_truncate_bad_count(self, pick: int, bad: str, by: int) -> None:
        running = sorted(s for s, model in self.model.items() if model.state == RUNNING)
        seq_id = running[pick % len(running)]
        num = self.model[seq_id].num_tokens
        value: object
        if bad == "negative":
            error, value, fragment = ConfigError, -by, f"must be an int >= 0, got {-by}"
        elif bad == "too many":
            error, value, fragment = ConfigError, num + by, f"holds {num} tokens; cannot keep {num + by}"
        else:
            value = {"float": float(by), "string": str(by), "none": None, "bool": by % 2 == 1}[bad]
            error, fragment = InputTypeError, f"must be an int >= 0, got {value!r}"
        self.refused(error, lambda: self.mgr.truncate(seq_id, value), re.escape(fragment))  # type: ignore[arg-type]
        event(f"misuse: truncate to a bad count ({bad})")

    @precondition(lambda self: any(model.state != RUNNING for model in self.model.values()))
    @rule(pick=st.integers(0, 2**8), num_tokens=st.integers(0, 3))
    def misuse_truncate_not_running(self, pick: int, num_tokens: int) -> None:
        waiting = sorted(s for s, model in self.model.items() if model.state != RUNNING)
        seq_id = waiting[pick % len(waiting)]
        self.refused(SequenceStateError, lambda: self.mgr.truncate(seq_id, num_tokens), "not running")
        event("misuse: truncate a sequence not running")

    @precondition(lambda self: bool(self.truncations("left the window")))
    @rule(pick=st.integers(0, 2**8))
    def misuse_truncate_past_the_window(self, pick: int) -> None:
        forbidden = self.truncations("left the window")
        seq_id, num_tokens = forbidden[pick % len(forbidden)]
        note(f"truncate {seq_id} to {num_tokens}: the window already evicted what the next token sees")
        self.refused(SequenceStateError, lambda: self.mgr.truncate(seq_id, num_tokens), "left the window")
        event("misuse: truncate past the window")

    @precondition(lambda self: bool(self.truncations("have not written")))
    @rule(pick=st.integers(0, 2**8))
    def misuse_truncate_keeping_unwritten_tokens(self, pick: int) -> None:
        forbidden = self.truncations("have not written")
        seq_id, num_tokens = forbidden[pick % len(forbidden)]
        self.refused(SequenceStateError, lambda: self.mgr.truncate(seq_id, num_tokens), "have not written")
        event("misuse: truncate keeping unwritten tokens")

    # ------------------------------------------------------------ invariants

    @invariant()
    def manager_matches_the_model(self) -> None:
        if self.m is None:
            return
        m = self.m
        m.check_invariants()
        assert sorted(m.seq_ids) == sorted(self.model)
        names: dict[int, int] = {}
        bs = self.block_size
        live_slots: dict[int, set[int]] = {}
        num_live_tokens = 0
        for s, model in self.model.items():
            assert STATES[m.state(s)] == model.state, s
            assert m.num_tokens(s) == model.num_tokens, s
            table = m.block_table(s)
            if model.state != RUNNING:
                continue
            assert table.window_start == model.window_start, s
            assert len(table.block_ids) == len(model.blocks), (s, table, model.blocks)
            for j, block_id in zip(sorted(model.blocks), table.block_ids):
                assert names.setdefault(model.blocks[j], block_id) == block_id, (
                    "sharing differs from the model"
                )
            live = list(range(min(self.num_sinks, model.num_tokens))) + list(
                range(model.window_start, model.num_tokens)
            )
            num_live_tokens += len(live)
            for p in live:
                live_slots.setdefault(model.blocks[p // bs], set()).add(p % bs)
        assert len(set(names.values())) == len(names), "two model blocks share one real block"
        assert m.pool.num_free_blocks == self.num_free()
        if m.host_pool is not None:
            assert m.host_pool.num_free_blocks == self.num_host_free()
        metrics = m.metrics()
        assert metrics.num_live_tokens == num_live_tokens
        assert metrics.num_live_slots == sum(len(x) for x in live_slots.values())
        assert metrics.num_used_blocks == len(names)


# NOTE: scaled from the loaded profile (quick or ci), not fixed: each example
# is cheap (a few ms), and copy-on-write or a stale pending batch needs a fork
# or a partial write followed by the right reservation, which short runs rarely
# reach. CI: 4x its examples (800) of up to 70 steps. Quick: 2x (50 examples of
# up to 50 steps, about 1.5 s), to keep plain pytest under two minutes.
_profile = settings()
_EXAMPLES_FACTOR = 4 if os.environ.get("PAGEDKV_HYPOTHESIS_PROFILE") == "ci" else 2
ManagerMachine.TestCase.settings = settings(
    _profile,
    max_examples=_EXAMPLES_FACTOR * _profile.max_examples,
    stateful_step_count=_profile.stateful_step_count + 20,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestManagerMachine = ManagerMachine.TestCase


def test_the_machine_catches_a_planted_copy_on_write_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    # Planted bug: copy-on-write takes a new block but copies nothing into it.
    # check_invariants() cannot see it (ref counts stay right); only the
    # oracle comparison can, when a forked sequence attends its old tokens.
    monkeypatch.setattr(KVPool, "copy_blocks", lambda self, sources, destinations: None)
    with pytest.raises(AssertionError, match=r"oracle mismatch|bit-exact"):
        run_state_machine_as_test(
            ManagerMachine,
            settings=settings(
                max_examples=300,
                stateful_step_count=30,
                derandomize=True,
                database=None,
                phases=[Phase.generate],
                deadline=None,
                suppress_health_check=list(HealthCheck),
            ),
        )


def test_the_machine_catches_a_planted_truncate_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    # Planted bug: the rollback keeps the first rejected draft token too (an
    # inclusive/exclusive slip). Table, written counts and freed blocks stay
    # consistent with each other, so check_invariants() cannot see it; only the
    # model's token and free-block counts (and later its outputs) can.
    keep_all = SequenceRecord.truncate

    def keeps_one_token_too_many(self: SequenceRecord, num_tokens: int) -> list[int]:
        return keep_all(self, min(num_tokens + 1, self.table.num_tokens))

    monkeypatch.setattr(SequenceRecord, "truncate", keeps_one_token_too_many)
    with pytest.raises(AssertionError, match="the model keeps"):
        run_state_machine_as_test(
            ManagerMachine,
            settings=settings(
                max_examples=300,
                stateful_step_count=30,
                derandomize=True,
                database=None,
                phases=[Phase.generate],
                deadline=None,
                suppress_health_check=list(HealthCheck),
            ),
        )


def test_a_truncate_the_window_forbids_is_refused_with_nothing_changed() -> None:
    # The machine reaches a moved window in only a few quick-profile examples,
    # so the boundary is pinned here too. Window 2, blocks of 1, no sinks:
    #
    #   reserve 5, then 1:   tokens 0..5, window_start 4, blocks held for 4, 5
    #   truncate to 4:       token 4 (next) sees 3, 4: 3 already evicted, refused
    #   truncate to 5:       token 5 (next) sees 4, 5: both held, allowed
    manager = make_manager(8, block_size=1, max_size=2)
    manager.add_sequence("a")
    settle(manager, {"a": 5})
    settle(manager, {"a": 1})
    assert manager.block_table("a").window_start == 4
    before = manager_state(manager)
    with pytest.raises(SequenceStateError, match=r"tokens 3\.\.3 already left the window"):
        manager.truncate("a", 4)
    assert manager_state(manager) == before
    manager.truncate("a", 5)
    assert manager.num_tokens("a") == 5 and manager.block_table("a").block_ids == [4]


def test_a_copy_on_write_plan_does_not_depend_on_the_order_of_the_request() -> None:
    # Found by the truncate rule (shrunk). Window 1, blocks of 2:
    #
    #   a  [0 1]          two decodes; fork a -> b: both hold block X full
    #   a  [0 .]          truncate a to 1: a holds X partly, b holds it full
    #   reserve {a: 1, b: 1}: b's window drops X, so a is X's only holder and
    #   appends in place; reserve evicts for every sequence first (plan_steps'
    #   docstring). Planned as {b: 1, a: 1} it does; as {a: 1, b: 1} a copies
    #   X into a new block and X is freed: a copy for nothing.
    plans = []
    for order in (["a", "b"], ["b", "a"]):
        manager = make_manager(8, block_size=2, max_size=1)
        manager.add_sequence("a")
        settle(manager, {"a": 1})
        settle(manager, {"a": 1})
        manager.fork("a", "b")
        manager.truncate("a", 1)
        plan = manager.plan({seq_id: 1 for seq_id in order})
        plans.append((plan.num_copy_on_write, plan.num_new_blocks, plan.num_released_blocks))
    assert plans[0] == plans[1] == (0, 1, 0), plans
