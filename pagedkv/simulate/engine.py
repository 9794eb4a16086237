"""The paged policy: a continuous-batching loop that drives the real :class:`KVCacheManager`.

Nothing about memory is modeled here: every block is taken, shared, copied
on write, evicted and freed by the manager on a real (tiny) pool, and the
report reads the manager's own block tables and pool. The pool is one layer, one head,
``head_dim`` 1; writing each step's k/v (the manager requires it before the
next reservation) is cheap. Attention is not computed: outputs do not change
what memory holds.

One step, as in vLLM's scheduler (v1)::

    1. arrivals join the waiting queue (FCFS)
    2. beam-like requests prune some beams and fork survivors into their place
    3. decode: reserve one token for every running sequence, all or nothing;
       if it does not fit, preempt the newest running request (recompute mode:
       its blocks are freed, it goes back to the front of the waiting queue)
       and try again
    4. admit waiting requests in order while ``plan`` (``can_reserve``'s
       details) says the prompt fits with ``watermark`` of the blocks still
       free, after the prefix-cache lookup of ``add_sequence``; skipped in a
       step that preempted. A request with ``n`` samples forks after prefill.
       A preempted request comes back with ``resume`` and re-feeds its tokens
    5. measure memory every ``sample_every`` steps from the block tables
       (the count ``metrics()`` gives, checked with ``check_every_step``)
    6. free requests whose last output token was written in this step

A request with prompt ``P`` and output ``O`` holds ``P`` tokens after its
prefill step and one more after each of the next ``O`` steps; it is freed at
the end of the step that writes its ``P + O``-th token. A request that cannot
grow even when it runs alone (it outgrew the whole pool) is aborted.

>>> from pagedkv.simulate import Budget, SimConfig, synthetic
>>> workload = synthetic("alpaca", 20, seed=0)
>>> result = PagedEngine(workload, SimConfig(Budget(256), block_size=8, check_every_step=True)).run()
>>> result.num_finished, result.num_preemptions > 0
(20, True)
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.errors import PoolExhaustedError
from pagedkv.manager import KVCacheManager, SequenceState
from pagedkv.pool import KVPool
from pagedkv.simulate.config import BudgetError, SimConfig
from pagedkv.simulate.occupancy import count_live_slots
from pagedkv.simulate.progress import Progress
from pagedkv.simulate.result import Accumulator, PolicyResult
from pagedkv.simulate.workload import Request, Workload, WorkloadError

__all__ = ["PagedEngine"]

_WAITING, _RUNNING, _PREEMPTED, _DONE = range(4)
_FAIL, _OK, _ABORTED = range(3)


class _Live:
    """A request in flight: its sequences and where it is in its output."""

    __slots__ = ("base", "finish_step", "num_generated", "request", "seq_ids", "state")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.seq_ids: list[int] = []
        self.state = _WAITING
        #: Output tokens written so far, while preempted.
        self.num_generated = 0
        #: Output tokens written after step ``t`` = ``t - base`` while running.
        self.base = 0
        self.finish_step = -1


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class PagedEngine:
    """Continuous batching over a real :class:`KVCacheManager` under a memory budget.

    Args:
        workload: the requests.
        config: the budget, block size, window, prefix caching and scheduler knobs.

    Raises:
        BudgetError: the pool cannot hold some request's prompt at all.
        WorkloadError: a request wants more samples than ``max_num_seqs``.

    Attributes:
        manager: the manager being driven (read it from an observer).
        seq_owner: ``seq_id -> request_id`` of every known sequence.
        step: the current step.
    """

    def __init__(self, workload: Workload, config: SimConfig) -> None:
        self.workload = workload
        self.config = config
        bs = config.block_size
        num_blocks = config.num_blocks
        for request in workload.requests:
            need = _ceil_div(request.prompt_len, bs)
            if need > num_blocks:
                raise BudgetError(
                    f"request {request.request_id}'s prompt of {request.prompt_len} tokens needs {need} "
                    f"blocks of {bs}, the memory holds {num_blocks}; give more memory or shorter prompts"
                )
            if config.max_num_seqs is not None and request.n > config.max_num_seqs:
                raise WorkloadError(
                    f"request {request.request_id} wants n={request.n} samples, more than "
                    f"max_num_seqs={config.max_num_seqs}"
                )
        self.pool = KVPool(num_blocks, block_size=bs, head_dim=1, dtype=np.float32)
        self.manager = KVCacheManager(
            self.pool, max_size=config.max_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self._with_tokens = config.enable_prefix_caching
        self.seq_owner: dict[Hashable, int] = {}
        self.step = -1
        self._rng = random.Random(config.seed)
        self._next_seq_id = 0
        self._kv: npt.NDArray[np.float32] = np.zeros((1024, 1, 1), np.float32)
        #: Token ids per sequence (prompt and output), kept only with prefix caching.
        self._history: dict[Hashable, list[int]] = {}
        #: Persistent decode request ``{seq_id: 1}`` of every running sequence (without tokens).
        self._decode: dict[Hashable, Any] = {}
        self._running: list[_Live] = []
        self._waiting: deque[_Live] = deque()
        self._finish_at: dict[int, list[_Live]] = {}
        self._num_running_seqs = 0
        self._num_watermark_blocks = config.num_watermark_blocks
        self.result = PolicyResult("paged")

    # ---------------------------------------------------------------- the loop

    def run(
        self,
        *,
        progress: Progress | None = None,
        observer: Callable[[PagedEngine], None] | None = None,
    ) -> PolicyResult:
        """Simulate until every request has finished (or was aborted).

        Args:
            progress: a bar to update now and then.
            observer: called after every step's measurement, with the engine.

        Returns:
            The measurements; ``self.result`` is the same object.
        """
        start = time.perf_counter()
        cpu_start = time.process_time()
        config = self.config
        manager, pool = self.manager, self.pool
        result = self.result
        stats = Accumulator(result, config.num_blocks * config.block_size)
        requests = self.workload.requests
        num_requests = len(requests)
        next_arrival = 0
        running, waiting, finish_at = self._running, self._waiting, self._finish_at
        sample_every = 1 if config.check_every_step else config.sample_every
        step = -1
        while next_arrival < num_requests or waiting or running:
            step += 1
            self.step = step
            while next_arrival < num_requests and requests[next_arrival].arrival_step <= step:
                waiting.append(_Live(requests[next_arrival]))
                next_arrival += 1
            preempted = False
            if running:
                if config.beam_replace_prob > 0:
                    self._beam_events()
                preempted = self._decode_step(step)
            if not preempted:
                self._admit_waiting(step)
            stats.on_step(self._num_running_seqs, len(running))
            if step % sample_every == 0:
                self._sample(stats, step)
            if observer is not None:
                observer(self)
            if config.check_every_step:
                self.check_consistency()
            finished = finish_at.pop(step, None)
            if finished:
                self._finish(finished, step)
            if progress is not None and step % 256 == 0:
                progress.update(result.num_finished + result.num_aborted, f"step {step}")
        if progress is not None:
            progress.close(result.num_finished + result.num_aborted, f"step {step}")
        if config.check_every_step:
            manager.check_invariants()
            if pool.num_used_blocks or manager.seq_ids:
                raise AssertionError(
                    f"after the run {pool.num_used_blocks} blocks are used and "
                    f"{len(manager.seq_ids)} sequences are known"
                )
        return stats.finish(time.perf_counter() - start, time.process_time() - cpu_start)

    # ---------------------------------------------------------------- phases

    def _decode_step(self, step: int) -> bool:
        """Reserve and write one token for every running sequence; return whether it preempted."""
        manager = self.manager
        running = self._running
        if self._with_tokens:
            # NOTE: the tokens join the histories only once the reservation
            # succeeded, so a preempted sequence re-feeds exactly what it wrote.
            randbits = self._rng.getrandbits
            wanted: dict[Hashable, Any] = {
                seq_id: [randbits(15)] for live in running for seq_id in live.seq_ids
            }
        else:
            wanted = self._decode
        preempted = False
        while True:
            try:
                batch = manager.reserve(wanted)
                break
            except PoolExhaustedError:
                victim = running.pop()
                preempted = True
                for seq_id in victim.seq_ids:
                    wanted.pop(seq_id, None)
                if running:
                    self._preempt(victim, step)
                else:
                    self._abort(victim)  # it cannot grow even alone: it outgrew the pool
                if not wanted:
                    return preempted
        num = batch.num_tokens
        kv = self._kv_buffer(num)
        manager.write(0, batch, kv, kv)
        self.result.num_decode_tokens += num
        if self._with_tokens:
            history = self._history
            for key, token_ids in wanted.items():
                history[key].append(token_ids[0])
        return preempted

    def _admit_waiting(self, step: int) -> None:
        waiting, running = self._waiting, self._running
        max_num_seqs = self.config.max_num_seqs
        while waiting:
            live = waiting[0]
            if max_num_seqs is not None and self._num_running_seqs + live.request.n > max_num_seqs:
                return
            force = not running
            outcome = (
                self._readmit(live, step, force)
                if live.state == _PREEMPTED
                else self._admit(live, step, force)
            )
            if outcome == _FAIL:
                return
            waiting.popleft()
            if outcome == _OK:
                running.append(live)

    def _admit(self, live: _Live, step: int, force: bool) -> int:
        """First admission: look the prompt up, prefill it, fork the samples."""
        manager = self.manager
        request = live.request
        prompt_len = request.prompt_len
        seq_id = self._new_seq_id(request.request_id)
        if self._with_tokens:
            prompt = self.workload.prompt_tokens(request)
            num_cached = manager.add_sequence(seq_id, prompt)
            wanted: Any = prompt[num_cached:]
        else:
            # A cheap necessary condition first: without prefix caching the
            # prompt takes exactly ceil(P / block_size) new blocks.
            need = _ceil_div(prompt_len, self.config.block_size)
            if not force and self.pool.num_free_blocks - need < self._num_watermark_blocks:
                self._forget(seq_id)
                return _FAIL
            manager.add_sequence(seq_id)
            num_cached = 0
            wanted = prompt_len
        single: dict[Hashable, Any] = {seq_id: wanted}
        plan = manager.plan(single)
        num_left = plan.num_free_blocks + plan.num_released_blocks - plan.num_new_blocks
        if not plan.fits or (not force and num_left < self._num_watermark_blocks):
            manager.free(seq_id)
            self._forget(seq_id)
            if force:
                self._abort(live)
                return _ABORTED
            return _FAIL
        self._feed(seq_id, wanted)
        result = self.result
        result.num_prefix_query_tokens += prompt_len
        result.num_prefix_hit_tokens += num_cached
        live.seq_ids = [seq_id]
        if self._with_tokens:
            self._history[seq_id] = prompt
        for _ in range(request.n - 1):
            child = self._new_seq_id(request.request_id)
            manager.fork(seq_id, child)
            live.seq_ids.append(child)
            if self._with_tokens:
                self._history[child] = list(prompt)
        self._start_running(live, step, 0)
        return _OK

    def _readmit(self, live: _Live, step: int, force: bool) -> int:
        """Bring a preempted request back: resume its sequences and re-feed their tokens.

        NOTE: what a re-admission takes is known only once ``resume`` has
        looked the history up, so it is bounded first. The samples of a
        request re-fork from the first one at the prompt; that path takes at
        most ``tight`` free blocks (a revived cached block costs a free one,
        like a new one). With prefix caching the first sample may find more
        than its prompt cached, and the others then resume on their own: only
        ``loose`` (every sequence its own blocks) bounds that, so between the
        two bounds the re-admission is tried and, if it does not fit after
        all, preempted again at once (``num_preemptions`` counts only the
        scheduler's decisions, not such retries).
        """
        request = live.request
        bs = self.config.block_size
        n, prompt_len = request.n, request.prompt_len
        length = prompt_len + live.num_generated
        loose = n * _ceil_div(length, bs)
        tight = _ceil_div(prompt_len, bs) + n * (_ceil_div(length, bs) - _ceil_div(prompt_len, bs))
        if live.num_generated and prompt_len % bs:
            tight += n - 1  # each sample but one copies the shared, partly filled prompt block
        room = self.pool.num_free_blocks - self._num_watermark_blocks
        if not force and room < min(tight, loose):
            return _FAIL
        try:
            num_reused = self._refeed(live)
        except PoolExhaustedError:
            if force:
                self._abort(live)  # running alone, it still does not fit
                return _ABORTED
            for seq_id in live.seq_ids:
                if self.manager.state(seq_id) is SequenceState.RUNNING:
                    self.manager.preempt(seq_id, "recompute")
            return _FAIL
        self.result.num_resumed_reuse_tokens += num_reused
        self._start_running(live, step, live.num_generated)
        return _OK

    def _refeed(self, live: _Live) -> int:
        """Resume and re-feed every sequence of ``live``; return the tokens found cached."""
        manager = self.manager
        request = live.request
        prompt_len, num_generated = request.prompt_len, live.num_generated
        length = prompt_len + num_generated
        seq_ids = live.seq_ids
        first = seq_ids[0]
        num_reused = manager.resume(first)
        total_reused = num_reused
        if request.n == 1:
            self._feed(first, self._slice(first, num_reused, length), recomputed=True)
            return total_reused
        parts: dict[Hashable, Any] = {}
        if num_reused < prompt_len:
            self._feed(first, self._slice(first, num_reused, prompt_len), recomputed=True)
        if manager.num_tokens(first) == prompt_len:
            # The samples share the prompt again: fork them from the first.
            for index in range(1, len(seq_ids)):
                old = seq_ids[index]
                manager.free(old)
                child = self._new_seq_id(request.request_id)
                manager.fork(first, child)
                self._forget(old, child)
                seq_ids[index] = child
                if num_generated:
                    parts[child] = self._slice(child, prompt_len, length)
            if num_generated:
                parts[first] = self._slice(first, prompt_len, length)
        else:
            # The first sample found more than its prompt cached: resume the others on their own.
            parts[first] = self._slice(first, manager.num_tokens(first), length)
            for seq_id in seq_ids[1:]:
                reused = manager.resume(seq_id)
                total_reused += reused
                parts[seq_id] = self._slice(seq_id, reused, length)
        if parts:
            self._feed_many(parts, recomputed=True)
        return total_reused

    def _beam_events(self) -> None:
        """Beam-like sampling: prune beams at random and fork a surviving beam into their place."""
        manager = self.manager
        rng = self._rng
        probability = self.config.beam_replace_prob
        for live in self._running:
            request = live.request
            if request.sampling != "beam" or request.n < 2:
                continue
            seq_ids = live.seq_ids
            for index in range(1, len(seq_ids)):
                if rng.random() >= probability:
                    continue
                parent_index = rng.randrange(len(seq_ids) - 1)
                parent_index += parent_index >= index
                old, parent = seq_ids[index], seq_ids[parent_index]
                manager.free(old)
                child = self._new_seq_id(request.request_id)
                manager.fork(parent, child)
                seq_ids[index] = child
                self._forget(old)
                self._decode[child] = 1
                if self._with_tokens:
                    self._history[child] = list(self._history[parent])

    def _finish(self, finished: list[_Live], step: int) -> None:
        manager = self.manager
        result = self.result
        any_done = False
        for live in finished:
            if live.state != _RUNNING or live.finish_step != step:
                continue  # preempted since; it has a new finish step
            for seq_id in live.seq_ids:
                manager.free(seq_id)
                self._forget(seq_id)
            live.state = _DONE
            self._num_running_seqs -= len(live.seq_ids)
            result.num_finished += 1
            result.num_generated_tokens += live.request.n * live.request.output_len
            any_done = True
        if any_done:
            self._running[:] = [live for live in self._running if live.state == _RUNNING]

    # ---------------------------------------------------------------- helpers

    def _start_running(self, live: _Live, step: int, num_generated: int) -> None:
        live.state = _RUNNING
        live.base = step - num_generated
        live.finish_step = live.base + live.request.output_len
        self._finish_at.setdefault(live.finish_step, []).append(live)
        self._num_running_seqs += len(live.seq_ids)
        for seq_id in live.seq_ids:
            self._decode[seq_id] = 1

    def _preempt(self, live: _Live, step: int) -> None:
        manager = self.manager
        for seq_id in live.seq_ids:
            manager.preempt(seq_id, "recompute")
            self._decode.pop(seq_id, None)
        live.num_generated = step - 1 - live.base
        live.state = _PREEMPTED
        live.finish_step = -1
        self._num_running_seqs -= len(live.seq_ids)
        self._waiting.appendleft(live)
        self.result.num_preemptions += 1

    def _abort(self, live: _Live) -> None:
        """Drop a request that cannot fit even alone; free whatever it holds."""
        manager = self.manager
        if live.state == _RUNNING:
            self._num_running_seqs -= len(live.seq_ids)
        for seq_id in live.seq_ids:
            if seq_id in manager:
                manager.free(seq_id)
            self._forget(seq_id)
        live.state = _DONE
        live.finish_step = -1
        self.result.num_aborted += 1

    def _new_seq_id(self, request_id: int) -> int:
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        self.seq_owner[seq_id] = request_id
        return seq_id

    def _forget(self, seq_id: int, successor: int | None = None) -> None:
        """Drop a sequence id's bookkeeping (its history passes to ``successor``)."""
        self.seq_owner.pop(seq_id, None)
        self._decode.pop(seq_id, None)
        history = self._history.pop(seq_id, None)
        if successor is not None and history is not None:
            self._history[successor] = history

    def _slice(self, seq_id: int, start: int, end: int) -> Any:
        """What to reserve for tokens ``start:end`` of a sequence: their ids, or a count."""
        if self._with_tokens:
            return self._history[seq_id][start:end]
        return end - start

    def _feed(self, seq_id: int, wanted: Any, *, recomputed: bool = False) -> None:
        self._feed_many({seq_id: wanted}, recomputed=recomputed)

    def _feed_many(self, parts: dict[Hashable, Any], *, recomputed: bool = False) -> None:
        batch = self.manager.reserve(parts)
        kv = self._kv_buffer(batch.num_tokens)
        self.manager.write(0, batch, kv, kv)
        self.result.num_prefill_tokens += batch.num_tokens
        if recomputed:
            self.result.num_recomputed_tokens += batch.num_tokens

    def _kv_buffer(self, num_tokens: int) -> npt.NDArray[np.float32]:
        if len(self._kv) < num_tokens:
            self._kv = np.zeros((max(num_tokens, 2 * len(self._kv)), 1, 1), np.float32)
        return self._kv[:num_tokens]

    def live_slots(self) -> tuple[int, int]:
        """``(live slots, block ids held over all tables)`` of the running sequences.

        The same count as ``manager.metrics().num_live_slots`` (checked at
        every step with ``check_every_step``), but O(sequences); see
        :func:`~pagedkv.simulate.occupancy.count_live_slots`.
        """
        return count_live_slots(self.manager, [s for live in self._running for s in live.seq_ids])

    def _sample(self, stats: Accumulator, step: int) -> None:
        num_live, num_held = self.live_slots()
        used = self.pool.num_used_blocks
        stats.on_sample(
            step,
            live=num_live,
            unfilled=used * self.config.block_size - num_live,
            blocks_saved=num_held - used,
            num_used_blocks=used,
            num_seqs=self._num_running_seqs,
            loaded=bool(self._waiting),
        )

    # ------------------------------------------------------------- invariants

    def check_consistency(self) -> None:
        """Raise ``AssertionError`` if the simulator and the manager disagree.

        Checks the manager's own ``check_invariants()``, then that every
        running sequence holds exactly the tokens the schedule says, every
        preempted one holds no block, and the manager knows no other sequence.
        """
        manager = self.manager
        manager.check_invariants()
        expected: set[Hashable] = set()
        num_seqs = 0
        for live in self._running:
            if live.state != _RUNNING:
                raise AssertionError(
                    f"request {live.request.request_id} is in the running list but not running"
                )
            length = live.request.prompt_len + self.step - live.base
            for seq_id in live.seq_ids:
                expected.add(seq_id)
                num_seqs += 1
                if manager.state(seq_id) is not SequenceState.RUNNING:
                    raise AssertionError(f"sequence {seq_id} should be running")
                if manager.num_tokens(seq_id) != length:
                    raise AssertionError(
                        f"sequence {seq_id} holds {manager.num_tokens(seq_id)} tokens, "
                        f"the schedule says {length}"
                    )
                if self._with_tokens and len(self._history[seq_id]) != length:
                    raise AssertionError(f"sequence {seq_id}'s token history has the wrong length")
        for live in self._waiting:
            if live.state != _PREEMPTED:
                continue
            for seq_id in live.seq_ids:
                expected.add(seq_id)
                if manager.state(seq_id) is not SequenceState.PREEMPTED:
                    raise AssertionError(f"sequence {seq_id} should be preempted")
                if manager.block_table(seq_id).num_blocks:
                    raise AssertionError(f"preempted sequence {seq_id} still holds blocks")
        if set(manager.seq_ids) != expected:
            raise AssertionError(
                f"the manager knows {len(manager.seq_ids)} sequences, the simulator {len(expected)}"
            )
        if num_seqs != self._num_running_seqs:
            raise AssertionError(f"{num_seqs} sequences run, counted {self._num_running_seqs}")
        if set(self._decode) != {s for live in self._running for s in live.seq_ids}:
            raise AssertionError("the decode request and the running sequences disagree")
        num_live, _ = self.live_slots()
        metrics = manager.metrics()
        if num_live != metrics.num_live_slots:
            raise AssertionError(
                f"live slots counted {num_live}, the manager's metrics say {metrics.num_live_slots}"
            )
