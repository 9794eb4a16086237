"""A Hypothesis state machine over ``KVCacheManager`` with prefix caching on.

Prompts are drawn from a tiny token alphabet (2 or 3 ids) with blocks of 1 to 4
tokens, so prefixes collide all the time, and the pool is tiny (3 to 10
blocks), so cached free blocks are evicted in almost every example. Rules:
add with lookup (then prefill the rest in one or two chunks), add two
identical prompts in one step, decode, fork, free, preempt (recompute and
swap), resume, preempt-then-resume, a half-written step abandoned with
``cancel_reservation``, reset, and misuse (a rule on a sequence in the wrong
state, a second free, a reset while blocks are in use: each refused with
nothing changed). Two extra-key sets take turns: no salt, and
``{"salt": "tenant-b"}``. Windows (1 to 6, or none) and sinks (0 to 5) are
drawn once per run.

The model of the network (the assumption every output check rests on)::

    q, k, v of the token at position p, layer l = f(token_ids[0 .. p], l)

a deterministic function of the token's *whole prefix* (its id, its position
and every id before it), as in a real transformer. Two sequences therefore
hold equal k/v in a block exactly when their prefixes through that block are
equal, which is what the chained block key promises; a key that forgot its
parent would share a block whose k/v a from-scratch run would not compute,
and the output and content checks below see it, apart from the checks that
recompute keys (``test_machine_catches_unchained_keys`` plants that bug). With
k/v a function of ``(token id, position)`` alone, the output checks would not.

After every step:

* ``manager.check_invariants()``, plus: the allocator marks cached exactly
  the blocks that have a key;
* every key in the map names a block whose stored k/v (every layer) are those
  of the prefix the key was computed from: no stale key on a reused block;
* every held slot of every sequence (device or host pool) holds the k/v of
  that sequence's own history;
* no block is held at once by two sequences with different extra keys.

Every attend output is compared, per token and layer, with the pure-Python
oracle (:func:`pagedkv.testing.oracle.attend`) over exactly the tokens it
should see, computed from scratch from the sequence's own history.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Mapping
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, note, settings
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
from support.managers import manager_state
from support.prefix import key_chain, kv_of, make, prefix_of
from support.windows import visible

import pagedkv.manager.prefix_sharing
from pagedkv import KVCacheManager, SequenceState
from pagedkv.blocks.allocator import BlockAllocator
from pagedkv.errors import (
    DuplicateSequenceError,
    PoolExhaustedError,
    SequenceStateError,
    UnknownSequenceError,
)
from pagedkv.manager.prefix_sharing import PrefixSharing
from pagedkv.prefix.cache import ROOT_KEY, block_keys, token_bytes
from pagedkv.prefix.events import BlockStored, PrefixIndex
from pagedkv.testing.oracle import attend as oracle_attend
from pagedkv.testing.oracle import within_tolerance

#: The two extra-key sets sequences are admitted with.
EXTRA_KEYS: tuple[Mapping[str, str] | None, ...] = (None, {"salt": "tenant-b"})


class PrefixCachingMachine(RuleBasedStateMachine):
    """Drives a prefix-caching manager and a dumb per-sequence model in lockstep."""

    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.manager: KVCacheManager
        #: Per sequence id: the tokens its table holds, and its extra keys.
        self.tokens: dict[Hashable, list[int]] = {}
        #: Per recompute-preempted id: (the history the manager remembers, the caller's full history).
        self.preempted: dict[Hashable, tuple[list[int], list[int]]] = {}
        self.extras: dict[Hashable, Mapping[str, str] | None] = {}
        #: Every key the test has computed: key -> (extra keys, the tokens through its block).
        self.known: dict[bytes, tuple[int, tuple[int, ...]]] = {}
        self.next_id = 0
        #: Every history seen so far: new prompts often extend a prefix of one.
        self.histories: list[tuple[int, ...]] = []

    # ------------------------------------------------------------- set-up

    @initialize(
        block_size=st.integers(1, 4),
        num_blocks=st.integers(3, 10),
        num_layers=st.integers(1, 2),
        window=st.one_of(st.none(), st.integers(1, 6)),
        num_sink_tokens=st.sampled_from([0, 0, 1, 2, 5]),
        alphabet_size=st.integers(2, 3),
    )
    def setup(
        self,
        block_size: int,
        num_blocks: int,
        num_layers: int,
        window: int | None,
        num_sink_tokens: int,
        alphabet_size: int,
    ) -> None:
        note(
            f"block_size={block_size} num_blocks={num_blocks} num_layers={num_layers} "
            f"window={window} sinks={num_sink_tokens} alphabet={alphabet_size}"
        )
        self.block_size = block_size
        self.window = window
        self.num_sink_tokens = num_sink_tokens
        self.alphabet = list(range(alphabet_size))
        self.max_prompt = 3 * block_size + 2
        self.manager = make(
            num_blocks, block_size, num_layers, host=True, max_size=window, num_sink_tokens=num_sink_tokens,
            kv_events=True,
        )
        #: What a cluster router knows of this replica: the KV events, replayed.
        self.index = PrefixIndex()

    # ------------------------------------------------------------ helpers

    def draw_prompt(self, data: st.DataObject) -> list[int]:
        """A prompt that, half the time, starts with a prefix of an earlier history."""
        tokens = st.sampled_from(self.alphabet)
        base: list[int] = []
        if self.histories and data.draw(st.booleans()):
            history = data.draw(st.sampled_from(self.histories))
            base = list(history[: data.draw(st.integers(0, len(history)))])
        room = max(1, self.max_prompt - len(base))
        tail = data.draw(st.lists(tokens, min_size=0 if base else 1, max_size=min(room, self.block_size + 2)))
        return (base + tail)[: self.max_prompt] or [self.alphabet[0]]

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def learn_keys(self, seq_id: Hashable) -> None:
        tokens = self.tokens[seq_id]
        kind = EXTRA_KEYS.index(self.extras[seq_id])
        for i, key in enumerate(key_chain(tokens, self.block_size, self.extras[seq_id])):
            self.known[key] = (kind, tuple(tokens[: (i + 1) * self.block_size]))

    def run_step(self, chunks: dict[Hashable, list[int]]) -> None:
        """Reserve, write every layer and attend ``chunks``; check every output with the oracle.

        The caller has checked that the reservation fits.
        """
        manager = self.manager
        batch = manager.reserve(chunks)
        positions = []
        for seq_id, new_tokens in chunks.items():
            history = self.tokens[seq_id]
            start = len(history)
            assert manager.num_tokens(seq_id) == start + len(new_tokens)
            history.extend(new_tokens)
            positions += [(seq_id, start + i) for i in range(len(new_tokens))]
        for layer in range(manager.pool.num_layers):
            rows = np.array([kv_of(tuple(self.tokens[s][: p + 1]), layer) for s, p in positions])
            # rows: (num_tokens, 3, num_kv_heads, head_dim)
            manager.write(layer, batch, rows[:, 1], rows[:, 2])
            out = manager.attend(layer, batch, rows[:, 0])  # (num_tokens, num_kv_heads, head_dim)
            for (seq_id, position), actual, row in zip(positions, out, rows):
                history = self.tokens[seq_id]
                seen = visible(position, self.num_sink_tokens, manager.layer_max_sizes[layer])
                kv = [kv_of(tuple(history[: j + 1]), layer) for j in seen]
                expected, peak = oracle_attend(
                    row[0].tolist(), [x[1].tolist() for x in kv], [x[2].tolist() for x in kv]
                )
                assert within_tolerance(actual.tolist(), expected, peak), (
                    f"sequence {seq_id} position {position} layer {layer}: {actual.tolist()} "
                    f"!= oracle {expected}"
                )
        for seq_id in chunks:
            self.learn_keys(seq_id)
            self.histories.append(tuple(self.tokens[seq_id]))

    def expected_hit(self, tokens: list[int], extra_keys: Mapping[str, str] | None) -> int:
        """Leading tokens the cache should report for ``tokens`` now (looked up before the call)."""
        bs = self.block_size
        num_usable = (len(tokens) - 1) // bs
        prefix = prefix_of(self.manager)
        cached = [prefix.block_for(key) is not None for key in key_chain(tokens, bs, extra_keys)[:num_usable]]
        # The most blocks n such that every token the next one (index n * bs) attends to
        # is in a cached block: the sinks, and the window (every token without one).
        for n in range(num_usable, 0, -1):
            attended = set(range(min(self.num_sink_tokens, n * bs)))
            start = 0 if self.window is None else max(0, n * bs + 1 - self.window)
            attended.update(range(start, n * bs))
            if all(cached[i // bs] for i in attended):
                return n * bs
        return 0

    def check_shared_keys(self, seq_id: Hashable) -> None:
        """Every held full block of ``seq_id`` that has a key has *its* key (salt included)."""
        table = self.manager.block_table(seq_id)
        keys = key_chain(self.tokens[seq_id], self.block_size, self.extras[seq_id])
        prefix = prefix_of(self.manager)
        for logical_block, key in enumerate(keys):
            held = logical_block < table.num_sink_blocks or logical_block >= table.first_block_index
            if held:
                block_key = prefix.key_of(table.slot(logical_block * self.block_size) // self.block_size)
                assert block_key in (None, key), f"block {logical_block} of {seq_id} has a foreign key"

    def try_prefill(self, seq_id: Hashable, rest: list[int], split: int) -> bool:
        """Feed ``rest`` in one or two chunks; False (nothing reserved) if it does not fit."""
        if not rest:  # a sequence truncated to nothing, resumed: nothing to re-feed
            return True
        chunks = [rest[:split], rest[split:]] if 0 < split < len(rest) else [rest]
        for chunk in chunks:
            request = {seq_id: chunk}
            if not self.manager.can_reserve(request):
                before = manager_state(self.manager)
                with pytest.raises(PoolExhaustedError):
                    self.manager.reserve(request)
                assert manager_state(self.manager) == before
                return False
            self.run_step(request)
        return True

    # -------------------------------------------------------------- rules

    @rule(target=seqs, data=st.data())
    def look_then_add(self, data: st.DataObject) -> Any:
        """``lookup`` changes nothing and predicts what ``add_sequence`` and one prefill reserve take."""
        prompt = self.draw_prompt(data)
        extra_keys = data.draw(st.sampled_from(EXTRA_KEYS))
        manager = self.manager
        before = manager_state(manager)
        plan = manager.lookup(prompt, extra_keys=extra_keys)
        assert manager_state(manager) == before, "lookup changed the manager"
        assert plan.num_cached_tokens == self.expected_hit(prompt, extra_keys)
        free = manager.pool.num_free_blocks
        assert plan.num_free_blocks == free and plan.fits == (plan.num_blocks_taken <= free)
        assert manager.can_reserve({}, admit=[plan]) == plan.fits
        seq_id = self.new_id()
        cached_free = set(manager.pool.allocator.cached_free_block_ids())
        assert manager.add_sequence(seq_id, prompt, extra_keys=extra_keys) == plan.num_cached_tokens
        assert manager.block_table(seq_id).num_blocks == plan.num_shared_blocks
        revived = cached_free - set(manager.pool.allocator.cached_free_block_ids())
        assert revived == set(plan.revived_block_ids)
        self.tokens[seq_id] = list(prompt[: plan.num_cached_tokens])
        self.extras[seq_id] = extra_keys
        rest = list(prompt[plan.num_cached_tokens :])
        if not plan.fits:
            assert not manager.can_reserve({seq_id: rest})
            self.drop(seq_id)
            return multiple()
        free = manager.pool.num_free_blocks
        self.run_step({seq_id: rest})
        assert free - manager.pool.num_free_blocks == plan.num_new_blocks
        return seq_id

    @rule(target=seqs, data=st.data())
    def add(self, data: st.DataObject) -> Any:
        prompt = self.draw_prompt(data)
        extra_keys = data.draw(st.sampled_from(EXTRA_KEYS))
        split = data.draw(st.integers(0, len(prompt)))
        seq_id = self.new_id()
        manager = self.manager
        expected = self.expected_hit(prompt, extra_keys)
        before = manager.metrics()
        num_hit = manager.add_sequence(seq_id, prompt, extra_keys=extra_keys)
        note(f"add {seq_id} {prompt} {extra_keys} -> {num_hit} cached")
        assert num_hit == expected
        assert num_hit % self.block_size == 0 and num_hit < len(prompt)
        after = manager.metrics()
        assert after.num_prefix_queries == before.num_prefix_queries + len(prompt)
        assert after.num_prefix_hits == before.num_prefix_hits + num_hit
        assert manager.num_tokens(seq_id) == num_hit
        self.tokens[seq_id] = list(prompt[:num_hit])
        self.extras[seq_id] = extra_keys
        self.check_shared_keys(seq_id)
        if not self.try_prefill(seq_id, list(prompt[num_hit:]), split):
            note(f"{seq_id} does not fit: not admitted")
            self.drop(seq_id)
            return multiple()
        return seq_id

    @rule(target=seqs, data=st.data())
    def add_identical_in_one_step(self, data: st.DataObject) -> Any:
        """nano-vllm #219: two identical prompts admitted, reserved and written in one step."""
        prompt = self.draw_prompt(data)
        extra_keys = data.draw(st.sampled_from(EXTRA_KEYS))
        first, second = self.new_id(), self.new_id()
        manager = self.manager
        expected = self.expected_hit(prompt, extra_keys)
        hits = [manager.add_sequence(s, prompt, extra_keys=extra_keys) for s in (first, second)]
        note(f"add {first}, {second} {prompt} {extra_keys} in one step -> {hits} cached")
        assert hits == [expected, expected] and expected < len(prompt)
        for seq_id in (first, second):
            self.tokens[seq_id] = list(prompt[: hits[0]])
            self.extras[seq_id] = extra_keys
        rest = list(prompt[hits[0] :])
        request = {first: rest, second: rest}
        if not manager.can_reserve(request):
            for seq_id in (first, second):
                self.drop(seq_id)
            return multiple()
        self.run_step(request)
        table_a, table_b = manager.block_table(first), manager.block_table(second)
        if hits[0] == 0 and table_a.num_blocks and table_b.num_blocks:
            # Same contents computed twice: neither table may hold a block of the other's
            # newly computed part, and at most one of each pair got the key.
            assert not set(table_a.block_ids) & set(table_b.block_ids)
        return multiple(first, second)

    @rule(seq_id=seqs, data=st.data())
    def decode(self, seq_id: Hashable, data: st.DataObject) -> None:
        token = data.draw(st.sampled_from(self.alphabet))
        manager = self.manager
        state = manager.state(seq_id)
        if state is not SequenceState.RUNNING:
            before = manager_state(manager)
            with pytest.raises(SequenceStateError):
                manager.reserve({seq_id: [token]})
            assert manager_state(manager) == before
            return
        note(f"decode {seq_id} {token}")
        self.try_prefill(seq_id, [token], 0)

    @rule(data=st.data())
    def decode_every_running_sequence(self, data: st.DataObject) -> None:
        """An engine's decode step: one token for every running sequence, in one reservation if it
        fits, else one sequence at a time (those that do not fit wait)."""
        manager = self.manager
        running = [s for s in self.tokens if manager.state(s) is SequenceState.RUNNING]
        if not running:
            return
        chunks = {seq_id: [data.draw(st.sampled_from(self.alphabet))] for seq_id in running}
        note(f"decode every running sequence: {chunks}")
        if manager.can_reserve(chunks):
            self.run_step(chunks)
            return
        for seq_id, token in chunks.items():
            self.try_prefill(seq_id, token, 0)

    @rule(seq_id=seqs, data=st.data())
    def abandon_half_written_step(self, seq_id: Hashable, data: st.DataObject) -> None:
        """Reserve, write all layers but the last, cancel: nothing of the step may be keyed."""
        manager = self.manager
        if manager.state(seq_id) is not SequenceState.RUNNING:
            return
        new = data.draw(st.lists(st.sampled_from(self.alphabet), min_size=1, max_size=self.block_size + 1))
        request = {seq_id: new}
        if not manager.can_reserve(request):
            return
        note(f"reserve {new} for {seq_id}, write {manager.pool.num_layers - 1} layers, cancel")
        history = self.tokens[seq_id]
        batch = manager.reserve(request)
        full = history + new
        for layer in range(manager.pool.num_layers - 1):
            rows = np.array([kv_of(tuple(full[: p + 1]), layer) for p in range(len(history), len(full))])
            manager.write(layer, batch, rows[:, 1], rows[:, 2])
        prefix = prefix_of(manager)
        old = key_chain(history, self.block_size, self.extras[seq_id])
        for key in key_chain(full, self.block_size, self.extras[seq_id])[len(old) :]:
            owner = prefix.block_for(key)
            assert owner is None or owner not in manager.block_table(seq_id).block_ids, (
                "a block not written in every layer got a key"
            )
        manager.cancel_reservation(seq_id)
        assert manager.num_tokens(seq_id) == len(history)

    @rule(seq_id=seqs, data=st.data())
    def truncate(self, seq_id: Hashable, data: st.DataObject) -> None:
        """Roll back to a drawn length, often into a full, keyed block another sequence shares.

        Issue 27: a truncate into a shared keyed block kept its key; once the
        other holder left, the next append wrote into the keyed block in
        place, and a later hit read the wrong k/v.
        """
        manager = self.manager
        before = manager_state(manager)
        if manager.state(seq_id) is not SequenceState.RUNNING:
            with pytest.raises(SequenceStateError, match="not running"):
                manager.truncate(seq_id, 0)
            assert manager_state(manager) == before
            return
        history = self.tokens[seq_id]
        table = manager.block_table(seq_id)
        into_shared = self.cuts_into_shared_keyed_blocks(seq_id)
        if into_shared and data.draw(st.booleans()):
            num_tokens = data.draw(st.sampled_from(into_shared))
        else:
            num_tokens = data.draw(st.integers(0, len(history)))
        # The token after the kept ones attends from ``needed`` on: it must still be held.
        needed = self.num_sink_tokens if self.window is None else max(
            self.num_sink_tokens, num_tokens + 1 - self.window
        )
        if num_tokens < len(history) and needed < table.window_start:
            with pytest.raises(SequenceStateError, match="left the window"):
                manager.truncate(seq_id, num_tokens)
            assert manager_state(manager) == before
            return
        note(f"truncate {seq_id} to {num_tokens} of {len(history)}")
        manager.truncate(seq_id, num_tokens)
        del history[num_tokens:]
        assert manager.num_tokens(seq_id) == num_tokens

    @rule(seq_id=seqs, data=st.data())
    def roll_back_into_a_shared_block_then_go_on_alone(self, seq_id: Hashable, data: st.DataObject) -> None:
        """Issue 27 in one rule: cut into a keyed block others hold full, preempt them, decode.

        The decoded token differs from the one cut off, so a block written under
        its old key would hold other k/v than the key names (the content checks
        see it) and a later hit would read them.
        """
        manager = self.manager
        if manager.state(seq_id) is not SequenceState.RUNNING:
            return
        into_shared = self.cuts_into_shared_keyed_blocks(seq_id)
        if not into_shared:
            return
        num_tokens = data.draw(st.sampled_from(into_shared))
        history = self.tokens[seq_id]
        block_id = manager.block_table(seq_id).block_id(num_tokens // self.block_size)
        note(f"truncate {seq_id} to {num_tokens} of {len(history)}, into shared block {block_id}")
        cut_off = history[num_tokens]
        manager.truncate(seq_id, num_tokens)
        del history[num_tokens:]
        for other in list(self.tokens):
            if other != seq_id and manager.state(other) is SequenceState.RUNNING and (
                block_id in manager.block_table(other).block_ids
            ):
                self.preempt(other, "recompute")
        token = data.draw(st.sampled_from([t for t in self.alphabet if t != cut_off]))
        self.try_prefill(seq_id, [token], 0)

    def cuts_into_shared_keyed_blocks(self, seq_id: Hashable) -> list[int]:
        """Lengths ``seq_id`` could be truncated to that cut into a keyed block another sequence holds."""
        manager = self.manager
        table = manager.block_table(seq_id)
        allocator, prefix, bs = manager.pool.allocator, prefix_of(manager), self.block_size
        cuts = []
        for num_tokens in range(1, table.num_tokens):
            # The token after the kept ones attends from ``needed`` on: it must still be held.
            needed = self.num_sink_tokens if self.window is None else max(
                self.num_sink_tokens, num_tokens + 1 - self.window
            )
            if num_tokens % bs and table.holds_block(num_tokens // bs) and needed >= table.window_start:
                block_id = table.block_id(num_tokens // bs)
                if prefix.key_of(block_id) is not None and allocator.is_shared(block_id):
                    cuts.append(num_tokens)
        return cuts

    @rule(target=seqs, parent=seqs)
    def fork(self, parent: Hashable) -> Any:
        manager = self.manager
        child = self.new_id()
        if manager.state(parent) is not SequenceState.RUNNING:
            before = manager_state(manager)
            with pytest.raises(SequenceStateError):
                manager.fork(parent, child)
            assert manager_state(manager) == before
            return multiple()
        with pytest.raises(DuplicateSequenceError):
            manager.fork(parent, parent)
        manager.fork(parent, child)
        note(f"fork {parent} -> {child}")
        self.tokens[child] = list(self.tokens[parent])
        self.extras[child] = self.extras[parent]
        assert manager.block_table(child).block_ids == manager.block_table(parent).block_ids
        return child

    @rule(seq_id=consumes(seqs))
    def free(self, seq_id: Hashable) -> None:
        note(f"free {seq_id}")
        self.drop(seq_id)
        manager = self.manager
        before = manager_state(manager)
        with pytest.raises(UnknownSequenceError):
            manager.free(seq_id)
        if manager.pool.num_used_blocks:
            with pytest.raises(SequenceStateError):
                manager.reset_prefix_cache()
        assert manager_state(manager) == before

    @rule(seq_id=seqs, mode=st.sampled_from(["recompute", "swap"]))
    def preempt(self, seq_id: Hashable, mode: str) -> None:
        manager = self.manager
        before, metrics_before = manager_state(manager), manager.metrics()
        if manager.state(seq_id) is not SequenceState.RUNNING:
            with pytest.raises(SequenceStateError):
                manager.preempt(seq_id, mode)
            assert manager_state(manager) == before
            return
        host = manager.host_pool
        assert host is not None
        if mode == "swap" and not host.can_allocate(manager.block_table(seq_id).num_blocks):
            with pytest.raises(PoolExhaustedError):
                manager.preempt(seq_id, mode)
            assert manager_state(manager) == before
            return
        note(f"preempt {seq_id} ({mode})")
        manager.preempt(seq_id, mode)
        after = manager.metrics()
        assert after.num_prefix_hits == metrics_before.num_prefix_hits
        if mode == "recompute":
            history = self.tokens[seq_id]
            self.preempted[seq_id] = (list(history), list(history))
            self.tokens[seq_id] = []

    @rule(seq_id=seqs, split=st.integers(0, 12))
    def resume(self, seq_id: Hashable, split: int) -> None:
        manager = self.manager
        state = manager.state(seq_id)
        before, metrics_before = manager_state(manager), manager.metrics()
        if state is SequenceState.RUNNING:
            with pytest.raises(SequenceStateError):
                manager.resume(seq_id)
            assert manager_state(manager) == before
            return
        prefix = prefix_of(manager)
        if state is SequenceState.SWAPPED:
            history = self.tokens[seq_id]
            num_held = manager.block_table(seq_id).num_blocks
            if not manager.pool.can_allocate(num_held):
                with pytest.raises(PoolExhaustedError):
                    manager.resume(seq_id)
                assert manager_state(manager) == before
                return
            keys = key_chain(history, self.block_size, self.extras[seq_id])
            free_keys = {key for key in keys if prefix.block_for(key) is None}
            assert manager.resume(seq_id) == len(history)
            note(f"resume {seq_id} from swap")
            # Restored blocks are keyed again where their key is free.
            table = manager.block_table(seq_id)
            for logical_block, key in enumerate(keys):
                held = logical_block < table.num_sink_blocks or logical_block >= table.first_block_index
                if held and key in free_keys:
                    block_id = table.slot(logical_block * self.block_size) // self.block_size
                    assert prefix.block_for(key) == block_id
            self.check_shared_keys(seq_id)
            return
        # Recompute: the sequence's own cached blocks are reused, counted apart from hits.
        # NOTE: the manager remembers only the tokens it was given; a sequence preempted
        # again before its re-fed tokens were reserved is looked up by that shorter history.
        remembered, history = self.preempted.pop(seq_id)
        expected = self.expected_hit(remembered, self.extras[seq_id])
        num_reused = manager.resume(seq_id)
        note(f"resume {seq_id} for recompute: {num_reused} of {len(history)} tokens reused")
        assert num_reused == expected
        after = manager.metrics()
        assert after.num_prefix_hits == metrics_before.num_prefix_hits
        assert after.num_prefix_queries == metrics_before.num_prefix_queries
        assert after.num_resumed_reuse_tokens == metrics_before.num_resumed_reuse_tokens + num_reused
        self.tokens[seq_id] = list(history[:num_reused])
        self.check_shared_keys(seq_id)
        if not self.try_prefill(seq_id, history[num_reused:], split):
            note(f"{seq_id} does not fit: preempted again")
            manager.preempt(seq_id)
            self.preempted[seq_id] = (self.tokens[seq_id], history)
            self.tokens[seq_id] = []

    @rule(seq_id=seqs, mode=st.sampled_from(["recompute", "swap"]), split=st.integers(0, 12))
    def preempt_then_resume(self, seq_id: Hashable, mode: str, split: int) -> None:
        """Preempt and resume at once: the own cached blocks are all still there to reuse."""
        if self.manager.state(seq_id) is SequenceState.RUNNING:
            self.preempt(seq_id, mode)
            self.resume(seq_id, split)

    @precondition(lambda self: self.manager.pool.num_used_blocks == 0)
    @rule()
    def reset(self) -> None:
        """Drop every key (refused while blocks are in use: checked in ``free``)."""
        manager = self.manager
        note("reset")
        manager.reset_prefix_cache()
        metrics = manager.metrics()
        assert metrics.num_cached_blocks == 0
        assert metrics.num_cached_free_blocks == 0
        assert metrics.num_free_blocks == metrics.num_blocks

    # --------------------------------------------------------- invariants

    def drop(self, seq_id: Hashable) -> None:
        self.manager.free(seq_id)
        del self.tokens[seq_id]
        del self.extras[seq_id]
        self.preempted.pop(seq_id, None)

    @invariant()
    def manager_invariants_hold(self) -> None:
        self.manager.check_invariants()
        prefix = prefix_of(self.manager)
        allocator = self.manager.pool.allocator
        assert allocator._cached == set(prefix._key_of), "cached marks and keys disagree"
        metrics = self.manager.metrics()
        assert metrics.num_cached_blocks == len(prefix._block_of)
        assert metrics.num_cached_free_blocks == len(allocator.cached_free_block_ids())

    @invariant()
    def kv_events_rebuild_the_prefix_cache(self) -> None:
        """A router replaying the events holds exactly the manager's keys, each stored with its true
        tokens and parent (checked against the keys this test computed itself)."""
        events = self.manager.drain_kv_events()
        bs = self.block_size
        for event in events:
            if not isinstance(event, BlockStored):
                continue
            assert event.block_size == bs and len(event.token_ids) == bs * len(event.block_hashes)
            parent = event.parent_block_hash
            for i, block_hash in enumerate(event.block_hashes):
                kind, tokens = self.known[block_hash]
                assert list(tokens[-bs:]) == event.token_ids[i * bs : (i + 1) * bs], "wrong token ids"
                assert (parent is None) == (len(tokens) == bs), "parent given at the start, or missing"
                if parent is not None:
                    assert self.known[parent] == (kind, tokens[:-bs]), "wrong parent"
                parent = block_hash
        self.index.apply(events)
        assert self.index.hashes == set(prefix_of(self.manager)._block_of), "event index != prefix cache"
        buffer = self.manager.kv_events
        assert buffer is not None and buffer.num_dropped == 0

    @invariant()
    def every_key_names_its_contents(self) -> None:
        """No stale key: a keyed block holds the k/v of the prefix its key was computed from."""
        pool = self.manager.pool
        bs = self.block_size
        for key, block_id in prefix_of(self.manager)._block_of.items():
            entry = self.known.get(key)
            assert entry is not None, f"block {block_id} has a key no prefix of any history gives"
            _, tokens = entry
            start = len(tokens) - bs
            for layer in range(pool.num_layers):
                expected = np.array([kv_of(tokens[: p + 1], layer) for p in range(start, start + bs)])
                stored_k = pool.keys(layer)[:, block_id].transpose(1, 0, 2)  # (bs, heads, head_dim)
                stored_v = pool.values(layer)[:, block_id].transpose(1, 0, 2)
                assert np.array_equal(stored_k, expected[:, 1]), f"block {block_id}: stale key"
                assert np.array_equal(stored_v, expected[:, 2]), f"block {block_id}: stale key"

    @invariant()
    def every_held_slot_holds_its_own_history(self) -> None:
        manager = self.manager
        for seq_id, history in self.tokens.items():
            state = manager.state(seq_id)
            if state is SequenceState.PREEMPTED:
                assert manager.block_table(seq_id).num_blocks == 0
                continue
            pool = manager.pool if state is SequenceState.RUNNING else manager.host_pool
            assert pool is not None
            table = manager.block_table(seq_id)
            assert table.num_tokens == len(history)
            bs = self.block_size
            for start, end in table.live_ranges():
                for p in range(start, end):
                    block_id, offset = divmod(table.slot(p), bs)
                    for layer in range(pool.num_layers):
                        expected = kv_of(tuple(history[: p + 1]), layer)
                        assert np.array_equal(pool.keys(layer)[:, block_id, offset], expected[1])
                        assert np.array_equal(pool.values(layer)[:, block_id, offset], expected[2])

    @invariant()
    def tenants_never_share_a_block(self) -> None:
        owner: dict[int, Mapping[str, str] | None] = {}
        for seq_id in self.tokens:
            if self.manager.state(seq_id) is not SequenceState.RUNNING:
                continue
            for block_id in self.manager.block_table(seq_id).block_ids:
                extra_keys = owner.setdefault(block_id, self.extras[seq_id])
                assert extra_keys == self.extras[seq_id], f"block {block_id} shared across salts"


TestPrefixCaching = PrefixCachingMachine.TestCase
# Collisions, evictions and reuse after preemption need many runs to meet: the CI
# profile runs six times its examples (1,200). The quick profile runs three times
# its own (75, about 3 s), to keep plain pytest under two minutes.
EXAMPLES_FACTOR = 6 if os.environ.get("PAGEDKV_HYPOTHESIS_PROFILE") == "ci" else 3
TestPrefixCaching.settings = settings(
    settings.default, max_examples=EXAMPLES_FACTOR * (settings.default.max_examples or 25)
)


# ----------------------------------------------------- the machine catches bugs


def _planted(block_keys_impl: Any) -> None:
    """Run the machine against a manager whose block keys come from ``block_keys_impl``."""
    original = pagedkv.manager.prefix_sharing.block_keys
    pagedkv.manager.prefix_sharing.block_keys = block_keys_impl
    try:
        run_state_machine_as_test(
            PrefixCachingMachine,
            settings=settings(
                max_examples=300,
                stateful_step_count=30,
                phases=[Phase.generate],
                database=None,
                derandomize=True,  # the same hunt every run: the test cannot flake
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            ),
        )
    finally:
        pagedkv.manager.prefix_sharing.block_keys = original


def test_machine_catches_unchained_keys() -> None:
    """Planted bug: a block's key forgets its parent, so equal blocks after different prefixes
    share k/v a from-scratch run would not compute. Whichever check sees it first (most often
    ``every_key_names_its_contents``, which recomputes keys), it fails as an AssertionError."""

    def unchained(
        parent: bytes, tokens: bytes, block_size: int, extras: bytes, hasher: Any, first_block: int = 0
    ) -> list[bytes]:
        step = 8 * block_size  # int64 token ids
        return [
            block_keys(ROOT_KEY, tokens[i : i + step], block_size, extras, hasher)[0]
            for i in range(0, len(tokens) - step + 1, step)
        ]

    with pytest.raises(AssertionError):
        _planted(unchained)


def test_machine_catches_a_lookup_that_reports_the_whole_prompt() -> None:
    """Planted bug: the lookup may report every full block of the prompt (nano-vllm #144)."""
    original = pagedkv.manager.prefix_sharing.PrefixSharing.share_cached_prefix

    def greedy(
        self: PrefixSharing, seq: Any, token_ids: list[int], tokens: bytes, max_blocks: int | None = None,
        prefetched: Any = None,
    ) -> int:
        return original(self, seq, [*token_ids, 0], tokens + token_bytes([0]), max_blocks, prefetched)

    pagedkv.manager.prefix_sharing.PrefixSharing.share_cached_prefix = greedy  # type: ignore[method-assign]
    try:
        with pytest.raises(AssertionError):
            _planted(block_keys)
    finally:
        pagedkv.manager.prefix_sharing.PrefixSharing.share_cached_prefix = original  # type: ignore[method-assign]


def _appends_in_place(self: BlockAllocator, block_id: int, num_dropped: int = 0) -> bool:
    """The copy rule before issue 27: copy a partly filled last block only when shared."""
    return self.ref_count(block_id) - num_dropped > 1


def test_machine_catches_an_append_into_a_truncated_keyed_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug (issue 27): a truncate cut into a keyed block another sequence held full; once
    that one left, the next append wrote into the keyed block in place. Caught by
    ``check_invariants`` (a keyed block held partly with no copy ahead) or the content checks."""
    monkeypatch.setattr(BlockAllocator, "must_copy_before_append", _appends_in_place)
    with pytest.raises(AssertionError):
        _planted(block_keys)


def test_machine_catches_it_by_contents_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same planted bug with the manager's own prefix check off: the machine's content and
    output checks (a stale key, a wrong attend output) still see it."""
    monkeypatch.setattr(BlockAllocator, "must_copy_before_append", _appends_in_place)
    monkeypatch.setattr(PrefixSharing, "check_invariants", lambda self, records: None)
    with pytest.raises(AssertionError):
        _planted(block_keys)
