"""The prefix-aware router's index: orphans, resyncs, and a brute-force oracle over random event streams.

The streams are built the way a manager builds them: every block hash
chains its parent's (``chained`` below stands for the manager's hash
function, which the router never sees), and a ``BlockStored`` may start
anywhere in a chain, its parent already evicted (a sliding window, LRU).
The oracle knows the hash function: a replica holds a prompt's first ``n``
blocks exactly when it holds the prompt's first ``n`` chained hashes.
"""

from __future__ import annotations

import hashlib
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.prefix.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBuffer, PrefixIndex
from pagedkv.simulate.router import PrefixAware

BLOCK_SIZE = 2
#: The only block contents the streams use: few, so that chains share blocks and orphans collide.
BLOCKS = ((0, 0), (0, 1), (1, 0))
MAX_BLOCKS = 3
#: Every prompt of MAX_BLOCKS blocks: its leading matches cover every shorter prefix.
PROMPTS = [[t for block in blocks for t in block] for blocks in itertools.product(BLOCKS, repeat=MAX_BLOCKS)]


def chained(prompt: list[int]) -> list[bytes]:
    """The hash of each full block of ``prompt``, chained (a stand-in for the manager's)."""
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, len(prompt) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = hashlib.sha256(parent + repr(prompt[start : start + BLOCK_SIZE]).encode()).digest()[:8]
        hashes.append(parent)
    return hashes


def stored(prompt: list[int], first: int, end: int) -> BlockStored:
    """``BlockStored`` of blocks ``first`` to ``end - 1`` of ``prompt``, its parent the block before."""
    hashes = chained(prompt)
    parent = hashes[first - 1] if first else None
    tokens = prompt[first * BLOCK_SIZE : end * BLOCK_SIZE]
    return BlockStored(hashes[first:end], parent, tokens, BLOCK_SIZE, None, "GPU", None)


def offer(buffer: KVEventBuffer, event: BlockStored | BlockRemoved) -> None:
    """Record ``event`` in ``buffer``, as the manager would have."""
    if isinstance(event, BlockStored):
        buffer.stored(event.block_hashes, event.parent_block_hash, event.token_ids, block_size=BLOCK_SIZE)
    else:
        buffer.removed(event.block_hashes[0])


def oracle(held: set[bytes], prompt: list[int]) -> int:
    """Leading blocks of ``prompt`` whose chained hashes are all in ``held``, by brute force."""
    hashes = chained(prompt)
    return next((n for n, block_hash in enumerate(hashes) if block_hash not in held), len(hashes))


def matches(router: PrefixAware) -> list[int]:
    return [router.num_cached_blocks(0, prompt) for prompt in PROMPTS]


def test_an_orphan_block_never_matches_a_prompts_first_block() -> None:
    # A replica holds block 1 of [1 2][1 2] only: its parent h0 was evicted before it was keyed.
    #   prompt        [1 2]     [1 2]
    #   hashes         h0        h1 (parent h0)
    #   replica holds  -         h1          -> 0 leading blocks, not 1
    prompt = [1, 2, 1, 2]
    router = PrefixAware(BLOCK_SIZE, load_weight=0.0)
    router.observe(0, [stored(prompt, 1, 2)])
    assert router.num_cached_blocks(0, prompt) == 0
    assert router.num_cached_blocks(0, [1, 2]) == 0
    assert router.choose(prompt, [1, 0]) == 1  # nothing cached anywhere: the less loaded
    router.check_invariants()


def test_an_orphan_becomes_matchable_exactly_when_its_own_parent_is_stored() -> None:
    prompt = [1, 2, 1, 2]
    router = PrefixAware(BLOCK_SIZE, load_weight=0.0)
    router.observe(0, [stored(prompt, 1, 2)])
    router.observe(0, [stored([7, 7, 1, 2], 0, 1)])  # another first block: not h1's parent
    assert router.num_cached_blocks(0, [7, 7, 1, 2]) == 1
    router.observe(0, [stored(prompt, 0, 1)])  # h0 comes back: h0, h1 chain again
    assert router.num_cached_blocks(0, prompt) == 2
    router.observe(0, [BlockRemoved([chained(prompt)[0]], "GPU")])  # h0 evicted again
    assert router.num_cached_blocks(0, prompt) == 0
    router.check_invariants()


def test_a_sliding_window_stream_matches_only_from_the_first_block() -> None:
    # A window so short that the block before is out of it, freed and evicted
    # for reuse, before this one fills and is keyed: every block but the
    # first is keyed after its parent's key is gone.
    #   time 1: h0 keyed;  time 2: h0 evicted, h1 keyed;  time 3: h1 evicted, h2 keyed
    prompt = [0, 0] * 3
    router = PrefixAware(BLOCK_SIZE, load_weight=0.0)
    hashes = chained(prompt)
    router.observe(0, [stored(prompt, 0, 1)])
    for block in range(1, 3):
        router.observe(0, [BlockRemoved([hashes[block - 1]], "GPU"), stored(prompt, block, block + 1)])
    # held: h2 alone; it holds [0 0], yet no prompt starts with a cached block.
    assert [router.num_cached_blocks(0, prompt[: 2 * n]) for n in range(1, 4)] == [0, 0, 0]
    router.check_invariants()


def test_after_a_resync_the_router_matches_as_one_fed_every_event() -> None:
    # Chain h0 h1 h2 stored, h0 evicted, then the buffer overflows: the resync
    # replays [h1, h2] with parent h0, which the router no longer holds.
    prompt = [0, 1, 0, 1, 0, 1]
    evicted = BlockRemoved([chained(prompt)[0]], "GPU")
    events: list[BlockStored | BlockRemoved] = [stored(prompt, 0, 3), evicted]
    buffer, full, resynced = KVEventBuffer(max_events=1), PrefixAware(BLOCK_SIZE), PrefixAware(BLOCK_SIZE)
    for event in events:
        offer(buffer, event)
    full.observe(0, events)
    drained = buffer.drain()
    assert buffer.num_resyncs == 1 and isinstance(drained[0], AllBlocksCleared)
    resynced.observe(0, drained)
    assert matches(resynced) == matches(full)
    assert matches(resynced) == [oracle(buffer.keyed_hashes, p) for p in PROMPTS]  # all 0: h0 is gone
    resynced.observe(0, [stored(prompt, 0, 1)])  # h0 stored again: the whole chain is back
    assert resynced.num_cached_blocks(0, prompt) == 3


def test_blocks_of_the_same_tokens_under_one_parent_are_all_walked() -> None:
    # Two adapters key [1 2] differently (a0, b0); only b0 has a child, b1.
    # The router does not see adapters, so a prompt walks both.
    def block(block_hash: bytes, parent: bytes | None, tokens: list[int]) -> BlockStored:
        return BlockStored([block_hash], parent, tokens, BLOCK_SIZE, None, "GPU", None)

    router = PrefixAware(BLOCK_SIZE)
    router.observe(0, [block(b"a0", None, [1, 2]), block(b"b0", None, [1, 2]), block(b"b1", b"b0", [3, 4])])
    assert router.num_cached_blocks(0, [1, 2, 3, 4]) == 2
    router.observe(0, [BlockRemoved([b"b0"], "GPU")])
    assert router.num_cached_blocks(0, [1, 2, 3, 4]) == 1  # a0 still holds [1 2]
    router.observe(0, [block(b"b1", None, [3, 4])])  # stored again: its last event wins
    assert router.num_cached_blocks(0, [3, 4]) == 1
    router.check_invariants()


# A random stream: store a run of a prompt's blocks, remove a held block, clear, or drain.
operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("store"),
            st.integers(0, len(PROMPTS) - 1),
            st.integers(0, MAX_BLOCKS - 1),
            st.integers(1, MAX_BLOCKS),
        ),
        st.tuples(st.just("remove"), st.integers(0, 10_000)),
        st.tuples(st.just("clear")),
        st.tuples(st.just("drain")),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(operations, st.integers(1, 4))
def test_the_router_finds_the_oracles_longest_match_through_overflows(
    ops: list[tuple[object, ...]], max_events: int
) -> None:
    small, large = KVEventBuffer(max_events=max_events), KVEventBuffer(max_events=10_000)
    resynced, full, index = PrefixAware(BLOCK_SIZE), PrefixAware(BLOCK_SIZE), PrefixIndex()

    def drain_and_compare() -> None:
        resynced.observe(0, small.drain())
        events = large.drain()
        full.observe(0, events)
        index.apply(events)
        held = large.keyed_hashes
        assert small.keyed_hashes == held
        expected = [oracle(held, prompt) for prompt in PROMPTS]
        assert matches(full) == expected
        assert matches(resynced) == expected
        assert [index.num_leading_blocks(chained(prompt)) for prompt in PROMPTS] == expected
        resynced.check_invariants()
        full.check_invariants()

    for op in ops:
        if op[0] == "store":
            _, which, first, num_blocks = op
            assert isinstance(which, int) and isinstance(first, int) and isinstance(num_blocks, int)
            event = stored(PROMPTS[which], first, min(MAX_BLOCKS, first + num_blocks))
            offer(small, event)
            offer(large, event)
        elif op[0] == "remove":
            held = sorted(large.keyed_hashes)
            if held:
                assert isinstance(op[1], int)
                for buffer in (small, large):
                    buffer.removed(held[op[1] % len(held)])
        elif op[0] == "clear":
            for buffer in (small, large):
                buffer.cleared()
        else:
            drain_and_compare()
    drain_and_compare()
