"""Admission: which waiting request runs next, and how it gets its tokens into the pool.

Owns :class:`Admitter`, step 4 of :mod:`pagedkv.simulate.engine`'s loop: FCFS admission
under the watermark and token budget, chunked prefill, forks after prefill, and the
return of a preempted request (recompute or swap in). Counterpart: the waiting-queue
half of vLLM v1's ``Scheduler.schedule`` (and v0's watermark in ``BlockSpaceManager``).
The rules and an example: docs/simulate.md, "Admission".
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from pagedkv import PoolExhaustedError, SequenceState
from pagedkv.counts import ceil_div
from pagedkv.simulate.config import SimConfig
from pagedkv.simulate.requests import LiveRequest, RequestState, Schedule
from pagedkv.simulate.workload import Workload
from pagedkv.tiers import MEDIUM_CPU

__all__ = ["Admitter"]


class Admitter:
    """Admits the waiting requests of a schedule: first admissions and re-admissions.

    Args:
        workload: where prompts' token ids come from.
        config: block size, ``max_num_seqs`` and the watermark.
        schedule: the requests in flight (its book holds their sequences).
    """

    def __init__(self, workload: Workload, config: SimConfig, schedule: Schedule) -> None:
        self.workload = workload
        self.config = config
        self.schedule = schedule
        self.book = schedule.book
        self.manager = self.book.manager
        self.pool = self.manager.pool
        self._num_watermark_blocks = config.num_watermark_blocks
        #: Prefill tokens this step may still compute (None: no budget).
        self.budget_left: int | None = None
        #: The host tier below the device cache, or None (``SimConfig.num_host_tier_blocks``).
        self.tiers = None if self.manager.tiering is None else self.manager.tiering.tiers
        #: ``request_id -> tokens`` loaded from the host tier by admissions that did not go through yet.
        self._tier_tokens: dict[int, int] = {}

    def begin_step(self, num_decode_tokens: int) -> None:
        """Start a step's admission: the token budget left after ``num_decode_tokens`` decode tokens."""
        budget = self.config.max_num_batched_tokens
        self.budget_left = None if budget is None else max(0, budget - num_decode_tokens)

    def _num_keep_free(self) -> int:
        """Blocks admission keeps free: the watermark, and room for the running batch to grow."""
        config = self.config
        keep = self._num_watermark_blocks
        if config.growth_reserve_steps:
            keep += ceil_div(self.schedule.num_running_seqs * config.growth_reserve_steps, config.block_size)
        return keep

    def _spend(self, num_tokens: int) -> None:
        if self.budget_left is not None:
            self.budget_left = max(0, self.budget_left - num_tokens)

    def _over_budget(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` of prefill do not fit the step's budget (an untouched budget takes any)."""
        budget_left = self.budget_left
        if budget_left is None:
            return False
        return num_tokens > budget_left and budget_left < (self.config.max_num_batched_tokens or 0)

    def continue_prefills(self, step: int) -> None:
        """Feed the next chunk of every prefilling request, oldest first, while budget and memory allow.

        A chunk that does not fit memory preempts newer prefilling requests
        first; the oldest waits for memory instead.
        """
        schedule = self.schedule
        index = 0
        while index < len(schedule.prefilling):
            if self.budget_left is not None and self.budget_left <= 0:
                return
            live = schedule.prefilling[index]
            try:
                self._feed_chunk(live, step)
            except PoolExhaustedError:
                if index == len(schedule.prefilling) - 1:
                    return  # the newest waits for memory
                schedule.preempt_newest(step)
                continue
            index += 1

    def _feed_chunk(self, live: LiveRequest, step: int) -> None:
        """Feed one chunk of a prefilling request's prompt; start it once the prompt is in."""
        book, request = self.book, live.request
        seq_id = live.seq_ids[0]
        start = live.num_prefilled
        end = request.prompt_len
        if self.budget_left is not None:
            end = min(end, start + self.budget_left)
        num_fed = book.feed({seq_id: book.tokens(seq_id, start, end)})
        self._count_lost(live, start, num_fed)
        self._spend(num_fed)
        live.num_prefilled = end
        if end == request.prompt_len:
            self._fork_samples(live)
            self.schedule.start(step, 0, live)

    def _count_lost(self, live: LiveRequest, start: int, num_fed: int) -> None:
        """Count re-fed prompt tokens a preemption threw away as recomputed."""
        lost = min(live.num_lost_prefill, start + num_fed) - start
        if lost > 0:
            self.book.result.num_recomputed_tokens += lost

    def _fork_samples(self, live: LiveRequest) -> None:
        book, request = self.book, live.request
        for _ in range(request.n - 1):
            live.seq_ids.append(book.fork(live.seq_ids[0], request.request_id))

    def admit_waiting(self, step: int) -> None:
        """Admit waiting requests in order until the head does not fit (it stays first)."""
        schedule = self.schedule
        waiting = schedule.waiting
        max_num_seqs = self.config.max_num_seqs
        while waiting:
            live = waiting[0]
            num_seqs = schedule.num_running_seqs + sum(p.request.n for p in schedule.prefilling)
            if max_num_seqs is not None and num_seqs + live.request.n > max_num_seqs:
                return
            if self.budget_left is not None and self.budget_left <= 0:
                return
            force = not schedule.running and not schedule.prefilling
            if live.state is RequestState.PREEMPTED:
                self._readmit(live, step, force=force)
            else:
                self._admit(live, step, force=force)
            if live.state is RequestState.WAITING or live.state is RequestState.PREEMPTED:
                return  # it did not fit

    def _admit(self, live: LiveRequest, step: int, *, force: bool) -> None:
        """First admission: look the prompt up, prefill it (or its first chunk), fork the samples.

        The request then runs (or prefills, chunked), still waits (it does
        not fit above the kept-free blocks or the token budget), or, with
        ``force`` (nothing else runs), is aborted.
        """
        manager, book, config = self.manager, self.book, self.config
        request = live.request
        prompt_len = request.prompt_len
        keep_free = 0 if force else self._num_keep_free()
        seq_id = book.new_seq_id(request.request_id)
        if book.with_tokens:
            prompt = self.workload.prompt_tokens(request)
            num_loaded = self._num_tier_blocks()
            num_cached = manager.add_sequence(seq_id, prompt)
            num_loaded = self._num_tier_blocks() - num_loaded
            if num_loaded:
                tokens = self._tier_tokens
                num_tokens = num_loaded * config.block_size
                tokens[request.request_id] = tokens.get(request.request_id, 0) + num_tokens
            end = prompt_len
        else:
            # A cheap necessary condition first: without prefix caching the
            # prompt takes exactly ceil(P / block_size) new blocks.
            need = ceil_div(prompt_len, config.block_size)
            if not force and not config.chunked_prefill and self.pool.num_free_blocks - need < keep_free:
                book.forget(seq_id)
                return
            manager.add_sequence(seq_id)
            num_cached = 0
            end = prompt_len
        if self.budget_left is not None and end - num_cached > self.budget_left:
            if config.chunked_prefill:
                end = num_cached + self.budget_left  # the first chunk
            elif self._over_budget(end - num_cached):
                manager.free(seq_id)
                book.forget(seq_id)
                return
        if book.with_tokens:
            book.history[seq_id] = prompt
        wanted = book.tokens(seq_id, num_cached, end)
        plan = manager.plan({seq_id: wanted})
        num_left = plan.num_free_blocks + plan.num_released_blocks - plan.num_new_blocks
        if end == num_cached or not plan.fits or num_left < keep_free:
            manager.free(seq_id)
            book.forget(seq_id)
            if force and not plan.fits:
                self.schedule.abort_head()
            return
        num_fed = book.feed({seq_id: wanted})
        self._count_lost(live, num_cached, num_fed)
        self._spend(num_fed)
        result = book.result
        num_tier_tokens = self._tier_tokens.pop(request.request_id, 0)
        if live.first_step < 0 and not live.num_lost_prefill:
            result.num_prefix_query_tokens += prompt_len
            result.num_prefix_hit_tokens += num_cached
            # A failed attempt's loads stay cached on device; one reloaded after eviction counts once.
            result.num_tier_hit_tokens += min(num_tier_tokens, num_cached)
        live.seq_ids = [seq_id]
        if end < prompt_len:
            self.schedule.begin_prefill(end)
            return
        self._fork_samples(live)
        self.schedule.start(step, 0)

    def _num_tier_blocks(self) -> int:
        """Blocks the host tier has handed back so far (0 without one)."""
        return 0 if self.tiers is None else self.tiers.num_hits.get(MEDIUM_CPU, 0)

    def _readmit(self, live: LiveRequest, step: int, *, force: bool) -> None:
        """Bring a preempted request back: swap it in, or resume its sequences and re-feed their tokens.

        The request then runs, stays preempted (it does not fit), or, with
        ``force`` (nothing else runs), is aborted.

        NOTE: what a re-admission takes is known only once ``resume`` has
        looked the history up, so it is bounded first. The samples of a
        request re-fork from the first one at the prompt; that path takes at
        most ``tight`` free blocks (a revived cached block costs a free one,
        like a new one). With prefix caching the first sample may find more
        than its prompt cached, and the others then resume on their own: only
        ``loose`` (every sequence its own blocks) bounds that, so between the
        two bounds the re-admission is tried and, if it does not fit after
        all, preempted again at once (``num_preemptions`` counts only the
        scheduler's decisions, not such retries). A re-feed is not chunked:
        it waits for a step whose token budget is untouched if it is larger.
        """
        request = live.request
        bs = self.config.block_size
        n, prompt_len = request.n, request.prompt_len
        length = prompt_len + live.num_generated
        room = self.pool.num_free_blocks - (0 if force else self._num_keep_free())
        if live.swapped:
            self._swap_in(live, step, room=room, force=force)
            return
        if not force and self._over_budget(length):
            return
        loose = n * ceil_div(length, bs)
        tight = ceil_div(prompt_len, bs) + n * (ceil_div(length, bs) - ceil_div(prompt_len, bs))
        if live.num_generated and prompt_len % bs:
            tight += n - 1  # each sample but one copies the shared, partly filled prompt block
        if not force and room < min(tight, loose):
            return
        fed_before = self.book.result.num_prefill_tokens
        try:
            num_reused = self._refeed(live)
        except PoolExhaustedError:
            if force:
                self.schedule.abort_head()  # running alone, it still does not fit
                return
            for seq_id in live.seq_ids:
                if self.manager.state(seq_id) is SequenceState.RUNNING:
                    self.manager.preempt(seq_id, "recompute")
            return
        self._spend(self.book.result.num_prefill_tokens - fed_before)
        self.book.result.num_resumed_reuse_tokens += num_reused
        self.schedule.start(step, live.num_generated)

    def _swap_in(self, live: LiveRequest, step: int, *, room: int, force: bool) -> None:
        """Copy a swapped request's blocks back, if they fit above the kept-free blocks."""
        manager, book = self.manager, self.book
        num_blocks = sum(manager.block_table(seq_id).num_blocks for seq_id in live.seq_ids)
        if num_blocks > room:
            if force:
                self.schedule.abort_head()  # running alone, it still does not fit
            return
        for seq_id in live.seq_ids:
            manager.resume(seq_id)
        book.num_step_swapped_blocks += num_blocks
        book.result.num_swapped_in_blocks += num_blocks
        self.schedule.start(step, live.num_generated)

    def _refeed(self, live: LiveRequest) -> int:
        """Resume and re-feed every sequence of ``live``; return the tokens found cached."""
        manager, book = self.manager, self.book
        request = live.request
        prompt_len, num_generated = request.prompt_len, live.num_generated
        length = prompt_len + num_generated
        seq_ids = live.seq_ids
        first = seq_ids[0]
        num_reused = manager.resume(first)
        total_reused = num_reused
        if request.n == 1:
            book.feed({first: book.tokens(first, num_reused, length)}, recomputed=True)
            return total_reused
        parts: dict[Hashable, Any] = {}
        if num_reused < prompt_len:
            book.feed({first: book.tokens(first, num_reused, prompt_len)}, recomputed=True)
        if manager.num_tokens(first) == prompt_len:
            # The samples share the prompt again: fork them from the first.
            for index in range(1, len(seq_ids)):
                child = book.refork(seq_ids[index], first, request.request_id, keep_history=True)
                seq_ids[index] = child
                if num_generated:
                    parts[child] = book.tokens(child, prompt_len, length)
            if num_generated:
                parts[first] = book.tokens(first, prompt_len, length)
        else:
            # The first sample found more than its prompt cached: resume the others on their own.
            parts[first] = book.tokens(first, manager.num_tokens(first), length)
            for seq_id in seq_ids[1:]:
                reused = manager.resume(seq_id)
                total_reused += reused
                parts[seq_id] = book.tokens(seq_id, reused, length)
        if parts:
            book.feed(parts, recomputed=True)
        return total_reused
