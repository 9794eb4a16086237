"""A Hypothesis state machine over ``HybridKVCacheManager`` against a model that knows no blocks.

Drawn once per example and tiny: 2–4 layers, each full attention, a window
of 1–4 (one sink sometimes) or chunked local attention of 2–4 (Llama 4),
blocks of 1–3 slots, 6–16 blocks, prefix caching on or off. The model keeps
each sequence's token ids and whether it runs; every key and value is a
function of the token ids up to it and the layer, so a prefix hit must hand
back exactly what the sequence would have written. It predicts, from those
alone:

* every attend output of every layer: the pure-Python oracle over the tokens
  that layer sees (its own window, its sinks);
* each group's held blocks of each running sequence: the blocks from its
  window start (raised at each reservation) to its last token, and its sinks;
* which truncations every group allows, and that a refused call (a full pool,
  a truncation one group refuses) changes no group.

A prefix hit is checked against the model's history (multiple of the block
size, short of the whole prompt) and then by every later output. After every
step ``check_invariants()`` runs (every group in step, one owner per key).
Planted bugs (a group that frees one block early; a hit taken by the full
group alone) must be caught.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv import KVPool, PoolExhaustedError, SequenceStateError
from pagedkv.counts import ChunkedWindow
from pagedkv.manager.groups import GroupLayout
from pagedkv.manager.hybrid import HybridKVCacheManager
from pagedkv.testing.oracle import attend, within_tolerance

HEAD_DIM = 2


def value(token_ids: tuple[int, ...], layer: int, part: int) -> list[float]:
    """The key (part 0) or value (part 1) a sequence writes for its newest token: a function of its prefix."""
    digest = hashlib.blake2b(
        struct.pack(f"<{len(token_ids) + 2}q", layer, part, *token_ids), digest_size=8
    ).digest()
    return [((byte % 16) - 8) / 4.0 for byte in digest[:HEAD_DIM]]


def sees(position: int, sinks: int, window: int | None) -> list[int]:
    """Indices the token at ``position`` attends to (written again here: no shared code).

    A chunked layer (``ChunkedWindow(C)``) sees the tokens of its own chunk of ``C``.
    """
    if isinstance(window, ChunkedWindow):
        return list(range((position // int(window)) * int(window), position + 1))
    first = sinks if window is None else max(sinks, position - window + 1)
    return [i for i in range(position + 1) if i < sinks or i >= first]


@dataclass
class Model:
    token_ids: list[int]
    running: bool = True
    window_starts: list[int] = field(default_factory=list)  # per group: first held index after the sinks


class GroupsMachine(RuleBasedStateMachine):
    @initialize(
        windows=st.lists(
            st.one_of(st.none(), st.integers(1, 4), st.integers(2, 4).map(ChunkedWindow)),
            min_size=2,
            max_size=4,
        ),
        block_size=st.integers(1, 3),
        num_blocks=st.integers(6, 16),
        sinks=st.sampled_from([0, 0, 1]),
        caching=st.booleans(),
    )
    def setup(self, windows, block_size, num_blocks, sinks, caching):
        self.layout = GroupLayout.from_layer_windows(windows, num_sink_tokens=sinks)
        self.pool = KVPool(
            num_blocks, block_size=block_size, head_dim=HEAD_DIM, num_layers=self.layout.layers_per_group
        )
        self.manager = HybridKVCacheManager(self.pool, self.layout, enable_prefix_caching=caching)
        self.block_size = block_size
        self.caching = caching
        self.models: dict[str, Model] = {}
        self.next_id = 0

    # ------------------------------------------------------------------ helpers

    def group_window(self, g: int) -> tuple[int | None, int]:
        group = self.layout.groups[g]
        return group.window, group.num_sink_tokens

    def start_after(self, g: int, start: int, num_tokens: int) -> int:
        """A group's window start once a token at ``num_tokens`` comes (the table's rule, restated)."""
        window, sinks = self.group_window(g)
        if window is None:
            return sinks
        return max(start, sinks, min(num_tokens + 1 - window, num_tokens))

    def expected_blocks(self, g: int, model: Model) -> int:
        bs, n = self.block_size, len(model.token_ids)
        window, sinks = self.group_window(g)
        num_sink_blocks = min(-(-sinks // bs), -(-n // bs))
        if window is None:
            return -(-n // bs)
        first = max(num_sink_blocks, model.window_starts[g] // bs)
        return num_sink_blocks + max(0, -(-n // bs) - first)

    def running(self) -> list[str]:
        return [seq for seq, model in self.models.items() if model.running]

    def snapshot(self):
        return [
            (
                seq,
                self.manager.state(seq),
                self.manager.num_tokens(seq),
                [self.manager.block_table(seq, g).block_ids for g in range(len(self.layout.groups))],
            )
            for seq in self.manager.seq_ids
        ], self.pool.num_free_blocks

    def write_and_check(self, batch, seqs: list[str]) -> None:
        """Write every layer's k/v for the batch's tokens, attend, and compare with the oracle."""
        rows = [
            (seq, position)
            for seq, start, count in zip(batch.seq_ids, batch.first_positions, batch.num_new_tokens)
            for position in range(start, start + count)
        ]
        for layer in range(self.layout.num_layers):
            keys = np.array([[value(tuple(self.models[s].token_ids[: p + 1]), layer, 0)] for s, p in rows])
            values = np.array([[value(tuple(self.models[s].token_ids[: p + 1]), layer, 1)] for s, p in rows])
            self.manager.write(layer, batch, keys, values)
            queries = np.ones((len(rows), 1, HEAD_DIM)) * 0.5
            out = self.manager.attend(layer, batch, queries)
            g, _ = self.layout.locate(layer)
            window, sinks = self.group_window(g)
            for row, (seq, position) in enumerate(rows):
                ids = self.models[seq].token_ids
                seen = sees(position, sinks, window)
                expected, peak = attend(
                    [0.5] * HEAD_DIM,
                    [value(tuple(ids[: i + 1]), layer, 0) for i in seen],
                    [value(tuple(ids[: i + 1]), layer, 1) for i in seen],
                )
                assert within_tolerance(out[row, 0].tolist(), expected, peak), (seq, position, layer)

    # ------------------------------------------------------------------ rules

    @rule(prompt=st.lists(st.integers(0, 1), min_size=0, max_size=12))
    def add(self, prompt):
        seq = f"s{self.next_id}"
        self.next_id += 1
        num_groups = len(self.layout.groups)
        if not self.caching or not prompt:
            assert (
                self.manager.add_sequence(seq, prompt or None, cache_blocks=self.caching and bool(prompt))
                == 0
            )
            self.models[seq] = Model([], window_starts=[self.group_window(g)[1] for g in range(num_groups)])
            return
        hit = self.manager.add_sequence(seq, prompt)
        assert hit % self.block_size == 0 and hit < len(prompt)
        model = Model(list(prompt[:hit]))
        model.window_starts = [
            self.group_window(g)[1] if not hit else self.start_after(g, 0, hit) for g in range(num_groups)
        ]
        self.models[seq] = model
        try:  # prefill the rest of the prompt when it fits
            batch = self.manager.reserve({seq: prompt[hit:]})
        except PoolExhaustedError:
            return
        model.window_starts = [self.start_after(g, start, hit) for g, start in enumerate(model.window_starts)]
        model.token_ids.extend(prompt[hit:])
        self.write_and_check(batch, [seq])

    @precondition(lambda self: self.running())
    @rule(data=st.data(), count=st.integers(1, 4))
    def step(self, data, count):
        seq = data.draw(st.sampled_from(self.running()))
        self.extend(seq, data.draw(st.lists(st.integers(0, 1), min_size=count, max_size=count)))

    def extend(self, seq: str, new_ids: list[int]) -> None:
        """Reserve ``new_ids`` for ``seq``, write and attend every layer, check against the model."""
        model = self.models[seq]
        before = self.snapshot()
        try:
            batch = self.manager.reserve({seq: new_ids})
        except PoolExhaustedError:
            assert self.snapshot() == before
            return
        n = len(model.token_ids)
        model.window_starts = [self.start_after(g, start, n) for g, start in enumerate(model.window_starts)]
        model.token_ids.extend(new_ids)
        self.write_and_check(batch, [seq])

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.running()))
        child = f"s{self.next_id}"
        self.next_id += 1
        self.manager.fork(parent, child)
        source = self.models[parent]
        self.models[child] = Model(list(source.token_ids), True, list(source.window_starts))

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def truncate(self, data):
        seq = data.draw(st.sampled_from(self.running()))
        model = self.models[seq]
        num = data.draw(st.integers(0, len(model.token_ids)))
        allowed = num == len(model.token_ids) or all(
            (self.group_window(g)[0] is None and True)
            or max(self.group_window(g)[1], num + 1 - self.group_window(g)[0]) >= model.window_starts[g]
            for g in range(len(self.layout.groups))
        )
        before = self.snapshot()
        if not allowed:
            with pytest.raises(SequenceStateError):
                self.manager.truncate(seq, num)
            assert self.snapshot() == before
            return
        self.manager.truncate(seq, num)
        del model.token_ids[num:]

    @precondition(lambda self: self.models)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.models)))
        self.manager.free(seq)
        del self.models[seq]

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def preempt_and_resume(self, data):
        seq = data.draw(st.sampled_from(self.running()))
        model = self.models[seq]
        self.manager.preempt(seq)
        hit = self.manager.resume(seq)
        assert hit % self.block_size == 0 and hit <= max(0, len(model.token_ids) - 1)
        if not self.caching:
            assert hit == 0
        del model.token_ids[hit:]
        model.window_starts = [
            self.group_window(g)[1] if not hit else self.start_after(g, 0, hit)
            for g in range(len(self.layout.groups))
        ]

    # ------------------------------------------------------------------ invariants

    @invariant()
    def groups_hold_what_their_windows_see(self):
        if not hasattr(self, "manager"):
            return
        self.manager.check_invariants()
        for seq in self.running():
            model = self.models[seq]
            assert self.manager.num_tokens(seq) == len(model.token_ids)
            for g in range(len(self.layout.groups)):
                held = self.manager.block_table(seq, g).num_blocks
                assert held == self.expected_blocks(g, model), (seq, g, held, self.expected_blocks(g, model))


GroupsMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestGroupsMachine = GroupsMachine.TestCase


# ------------------------------------------------------------------ planted bugs


def _run_machine() -> None:
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(
        GroupsMachine,
        settings=settings(
            max_examples=300,
            stateful_step_count=30,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            phases=[Phase.generate],
            report_multiple_bugs=False,
        ),
    )


def test_machine_catches_a_group_that_frees_one_block_early(monkeypatch):
    """A sliding group that frees by a window one token shorter than the one its layers attend with."""
    init = HybridKVCacheManager.__init__

    def early(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for manager in self.groups:
            if manager.max_size is not None and manager.max_size > 1:
                manager.max_size -= 1

    monkeypatch.setattr(HybridKVCacheManager, "__init__", early)
    # A held-block count or an output differs from the model (or the walk, asked for a token the
    # group freed, refuses the read).
    with pytest.raises((AssertionError, ValueError)):
        _run_machine()


def test_machine_catches_a_hit_accepted_by_the_full_group_only(monkeypatch):
    """The full group's hit taken as is: the window group cannot follow where its blocks were evicted.

    The machine's own steps, chosen so the window group's cached blocks are evicted while the full
    group still holds the prefix: s0 prefills 5 tokens and moves on (its window group frees tokens
    0..4, keyed), s1 takes every free block, and s2 then shares s0's first 5 tokens.
    """

    def full_only(self, prompt, extra_keys):
        return self.groups[0].lookup(prompt, extra_keys=extra_keys).num_cached_tokens

    def scenario() -> None:
        machine = GroupsMachine()
        machine.setup(windows=[2, None], block_size=1, num_blocks=17, sinks=0, caching=True)
        machine.add(prompt=[0, 1, 0, 1, 0])
        machine.extend("s0", [1])
        machine.extend("s0", [0])
        machine.add(prompt=[])
        machine.extend("s1", [1, 1, 1, 1])
        assert machine.pool.num_free_blocks == 0 and machine.pool.allocator.num_cached_free_blocks == 0
        machine.groups_hold_what_their_windows_see()
        machine.add(prompt=[0, 1, 0, 1, 0, 1])
        machine.groups_hold_what_their_windows_see()

    scenario()  # the real manager passes
    monkeypatch.setattr(HybridKVCacheManager, "_common_hit", full_only)
    with pytest.raises(AssertionError, match="differs between group 0 and group 1"):
        scenario()


def test_machine_catches_a_chunked_layer_that_attends_like_a_sliding_window(monkeypatch):
    """The kernel's chunk test disabled: a chunked layer sees its last ``C`` tokens, not its chunk."""

    class NotChunked(int):
        pass

    monkeypatch.setattr("pagedkv.attention.ChunkedWindow", NotChunked)
    with pytest.raises(AssertionError, match=r"\('s\d+', \d+, \d+\)"):  # an attend output differs
        _run_machine()
