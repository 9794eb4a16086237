"""The paged policy: a continuous-batching loop that drives the real :class:`KVCacheManager`.

Owns the loop and the decode step; who waits and runs lives in :mod:`pagedkv.simulate.requests`,
the sequences' writes in :mod:`pagedkv.simulate.sequences`, admission in
:mod:`pagedkv.simulate.admission`. Counterpart: vLLM v1's ``Scheduler.schedule`` loop
over ``KVCacheManager``. The step, phase by phase: docs/simulate.md, "The paged engine".
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from pagedkv import KVCacheManager, KVPool, PoolExhaustedError
from pagedkv.blocks.occupancy import count_live_slots
from pagedkv.counts import ceil_div
from pagedkv.simulate.admission import Admitter
from pagedkv.simulate.clock import Clock
from pagedkv.simulate.config import BudgetError, SimConfig
from pagedkv.simulate.progress import Progress
from pagedkv.simulate.requests import Schedule
from pagedkv.simulate.result import Accumulator, PolicyResult
from pagedkv.simulate.sequences import SequenceBook
from pagedkv.simulate.workload import Arrivals, Request, Workload, WorkloadError
from pagedkv.tiers import MEDIUM_CPU, BlockLayout, HostTier, TieredStore

__all__ = ["PagedEngine"]


class PagedEngine:
    """Continuous batching over a real :class:`KVCacheManager` under a memory budget.

    Args:
        workload: the requests (a replica of a cluster takes only their prompts
            from it; requests come in by ``submit``).
        config: the budget, block size, window, prefix caching and scheduler knobs.
        kv_events: have the manager emit KV events (``drain_kv_events``).

    Raises:
        BudgetError: the pool cannot hold some request's prompt at all.
        WorkloadError: a request wants more samples than ``max_num_seqs``.

    Attributes:
        manager: the manager being driven (read it from an observer).
        sequences: the simulator's side of the manager's sequences (owners, tokens).
        schedule: the requests in flight: who waits, who runs.
        admitter: step 4, admission.
        step: the current step.

    Invariants (``check_consistency``): those of the manager and of the
    schedule, and the live slots counted here are ``manager.metrics()``'s.
    """

    def __init__(self, workload: Workload, config: SimConfig, *, kv_events: bool = False) -> None:
        self.workload = workload
        self.config = config
        bs = config.block_size
        num_blocks = config.num_blocks
        for request in workload.requests:
            need = ceil_div(request.prompt_len, bs)
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
        host_pool = None
        if config.num_host_blocks:
            host_pool = KVPool(config.num_host_blocks, block_size=bs, head_dim=1, dtype=np.float32)
        self.tiers: TieredStore | None = None
        if config.num_host_tier_blocks:
            # NOTE: the real tier over the tiny pool: its blocks are bytes of
            # the bookkeeping pool, and what a load costs is the modeled model's.
            layout = BlockLayout.of_pool(self.pool, "simulated")
            host = HostTier(
                block_nbytes=layout.block_nbytes,
                num_blocks=config.num_host_tier_blocks,
                policy=config.host_tier_policy,
            )
            self.tiers = TieredStore(layout, host=host)
        self.manager = KVCacheManager(
            self.pool,
            max_size=config.max_size,
            enable_prefix_caching=config.enable_prefix_caching,
            host_pool=host_pool,
            kv_events=kv_events,
            tiers=self.tiers,
        )
        self.result = PolicyResult("paged", scheduler=config.scheduler)
        self.sequences = SequenceBook(self.manager, self.result, with_tokens=config.enable_prefix_caching)
        self.clock = Clock(config.cost)
        self.schedule = Schedule(self.sequences, self.clock)
        self.admitter = Admitter(workload, config, self.schedule)
        self.step = -1
        self._rng = random.Random(config.seed)
        self._start = (0.0, 0.0)
        self._stats = Accumulator(self.result, num_blocks * bs)
        self._sample_every = config.sample_every
        self._num_tier_loaded = 0

    @property
    def seq_owner(self) -> dict[Hashable, int]:
        """``seq_id -> request_id`` of every known sequence (the book's own dict)."""
        return self.sequences.seq_owner

    # ---------------------------------------------------------------- the loop

    def run(
        self,
        *,
        progress: Progress | None = None,
        observer: Callable[[PagedEngine], None] | None = None,
    ) -> PolicyResult:
        """Simulate until every request of the workload has finished (or was aborted).

        Args:
            progress: a bar to update now and then.
            observer: called after every step's measurement, with the engine.

        Returns:
            The measurements; ``self.result`` is the same object.
        """
        self.begin()
        result, schedule, clock = self.result, self.schedule, self.clock
        arrivals = Arrivals(self.workload)
        while arrivals.num_pending or self.has_work:
            if arrivals.num_pending:
                if not self.has_work:
                    next_s = arrivals.next_arrival_s()
                    if next_s is not None:
                        clock.idle_until(next_s)
                for request in arrivals.pop_arrived(self.step + 1, clock.now):
                    schedule.arrive(request, clock.now)
            self.run_step(observer)
            if progress is not None and self.step % 256 == 0:
                progress.update(result.num_finished + result.num_aborted, f"step {self.step}")
        if progress is not None:
            progress.close(result.num_finished + result.num_aborted, f"step {self.step}")
        return self.end()

    # ------------------------------------------- stepping (a replica of a cluster)

    @property
    def has_work(self) -> bool:
        """Whether a request waits, prefills or runs."""
        schedule = self.schedule
        return bool(schedule.waiting or schedule.running or schedule.prefilling)

    @property
    def num_requests_in_flight(self) -> int:
        """Requests waiting, prefilling or running (a router's load signal)."""
        schedule = self.schedule
        return len(schedule.waiting) + len(schedule.running) + len(schedule.prefilling)

    def begin(self) -> None:
        """Start measuring (``run`` calls it; a cluster calls it once per replica)."""
        self._start = (time.perf_counter(), time.process_time())
        config = self.config
        self._stats = Accumulator(self.result, config.num_blocks * config.block_size)
        self._sample_every = 1 if config.check_every_step else config.sample_every

    def submit(self, request: Request) -> None:
        """``request`` arrives now (at its ``arrival_s``, if later: the engine idles until then)."""
        if request.arrival_s is not None and not self.has_work:
            self.clock.idle_until(request.arrival_s)
        self.schedule.arrive(request, self.clock.now)

    def advance_until(self, time_s: float) -> None:
        """Run steps while there is work and the clock is before ``time_s``."""
        while self.has_work and self.clock.now < time_s:
            self.run_step()

    def run_step(self, observer: Callable[[PagedEngine], None] | None = None) -> None:
        """One step: decode, prefill, admit, measure, free the finished (the module docstring)."""
        config, schedule, result = self.config, self.schedule, self.result
        book, admitter, stats = self.sequences, self.admitter, self._stats
        running = schedule.running
        self.step += 1
        step = self.step
        book.begin_step()
        preempted = False
        num_decode = decode_context = 0
        if running:
            if config.beam_replace_prob > 0:
                self._beam_events()
            num_before = result.num_decode_tokens
            preempted = self._decode_step(step)
            num_decode = result.num_decode_tokens - num_before
            decode_context = schedule.num_running_tokens(step) if num_decode else 0
        admitter.begin_step(num_decode)
        if schedule.prefilling:
            admitter.continue_prefills(step)
        if not preempted:
            admitter.admit_waiting(step)
        swapped_blocks = book.num_step_swapped_blocks
        result.swap_bytes += swapped_blocks * config.block_size * config.cost.shape.bytes_per_token
        loaded_blocks = self._step_tier_loads()
        self.clock.end_step(
            num_decode + book.num_step_prefill_tokens,
            decode_context + book.num_step_prefill_context,
            decode_context + book.num_step_prefill_pairs,
            swapped_blocks * config.block_size,
            loaded_blocks * config.block_size,
        )
        stats.on_step(schedule.num_running_seqs, len(running))
        if step % self._sample_every == 0:
            self._sample(stats, step)
        if observer is not None:
            observer(self)
        if config.check_every_step:
            self.check_consistency()
        schedule.finish(step)

    def end(self) -> PolicyResult:
        """Finish measuring; return the result (checked, with ``check_every_step``)."""
        manager, pool = self.manager, self.pool
        if self.config.check_every_step:
            manager.check_invariants()
            self.clock.check_invariants()
            if self.tiers is not None:
                self.tiers.check_invariants()
            if pool.num_used_blocks or manager.seq_ids:
                raise AssertionError(
                    f"after the run {pool.num_used_blocks} blocks are used and "
                    f"{len(manager.seq_ids)} sequences are known"
                )
        wall, cpu = self._start
        return self._stats.finish(time.perf_counter() - wall, time.process_time() - cpu, self.clock)

    def _step_tier_loads(self) -> int:
        """Blocks the host tier handed back this step (admissions and resumes load them)."""
        if self.tiers is None:
            return 0
        total = self.tiers.num_hits.get(MEDIUM_CPU, 0)
        loaded = total - self._num_tier_loaded
        self._num_tier_loaded = total
        self.result.num_tier_loaded_blocks += loaded
        return loaded

    # ---------------------------------------------------------------- phases

    def _decode_step(self, step: int) -> bool:
        """Reserve and write one token for every running sequence; return whether it preempted.

        All or nothing: while the reservation does not fit, the newest
        running request is preempted (or, running alone, aborted) and the
        reservation retried without it.
        """
        manager, book, schedule = self.manager, self.sequences, self.schedule
        if book.with_tokens:
            # NOTE: the tokens join the histories only once the reservation
            # succeeded, so a preempted sequence re-feeds exactly what it wrote.
            randbits = self._rng.getrandbits
            wanted: dict[Hashable, Any] = {seq_id: [randbits(15)] for seq_id in schedule.running_seq_ids()}
        else:
            wanted = book.decode
        preempted = False
        while True:
            try:
                batch = manager.reserve(wanted)
                break
            except PoolExhaustedError:
                victim = schedule.preempt_newest(step, self.config.preempt_mode)
                preempted = True
                for seq_id in victim.seq_ids:
                    wanted.pop(seq_id, None)
                if not wanted:
                    return preempted
        book.write(batch)
        self.result.num_decode_tokens += batch.num_tokens
        if book.with_tokens:
            history = book.history
            for key, token_ids in wanted.items():
                history[key].append(token_ids[0])
        return preempted

    def _beam_events(self) -> None:
        """Beam-like sampling: prune beams at random and fork a surviving beam into their place."""
        book = self.sequences
        rng = self._rng
        probability = self.config.beam_replace_prob
        for live in self.schedule.running:
            request = live.request
            if request.sampling != "beam" or request.n < 2:
                continue
            seq_ids = live.seq_ids
            for index in range(1, len(seq_ids)):
                if rng.random() >= probability:
                    continue
                parent_index = rng.randrange(len(seq_ids) - 1)
                parent_index += parent_index >= index
                child = book.refork(
                    seq_ids[index], seq_ids[parent_index], request.request_id, keep_history=False
                )
                seq_ids[index] = child
                book.decode[child] = 1

    # ------------------------------------------------------------ measuring

    def live_slots(self) -> tuple[int, int]:
        """``(live slots, block ids held over all tables)`` of the sequences holding device blocks.

        The count ``manager.metrics().num_live_slots`` gives, by the same
        function (:func:`pagedkv.blocks.occupancy.count_live_slots`), over the
        running and prefilling sequences only (a preempted one holds no
        device block).
        """
        manager = self.manager
        tables = [manager.block_table(seq_id) for seq_id in self.schedule.held_seq_ids()]
        return count_live_slots(tables, self.pool.allocator)

    def _sample(self, stats: Accumulator, step: int) -> None:
        num_live, num_held = self.live_slots()
        used = self.pool.num_used_blocks
        stats.on_sample(
            step,
            live=num_live,
            unfilled=used * self.config.block_size - num_live,
            blocks_saved=num_held - used,
            num_used_blocks=used,
            num_seqs=self.schedule.num_running_seqs,
            loaded=bool(self.schedule.waiting),
        )

    def check_consistency(self) -> None:
        """Raise ``AssertionError`` if the simulator and the manager disagree.

        Checks the manager's own ``check_invariants()``, then the schedule's
        (every running sequence holds exactly the tokens the schedule says,
        every preempted one holds no block, the manager knows no other
        sequence), then that the live slots counted here are the metrics'.
        """
        manager = self.manager
        manager.check_invariants()
        self.schedule.check_consistency(self.step)
        num_live, _ = self.live_slots()
        metrics = manager.metrics()
        if num_live != metrics.num_live_slots:
            raise AssertionError(
                f"live slots counted {num_live}, the manager's metrics say {metrics.num_live_slots}"
            )
