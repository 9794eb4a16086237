"""Admission: which waiting request runs next, and how it gets its tokens into the pool.

Step 4 of :mod:`pagedkv.simulate.engine`'s loop. Waiting requests are
admitted in order while ``plan`` (``can_reserve``'s details) says the prompt
fits with ``watermark`` of the blocks still free, after the prefix-cache
lookup of ``add_sequence`` (vLLM v0's watermark, so running sequences have
room to grow before anyone is preempted). A request with ``n`` samples forks
after its prefill. A preempted request comes back with ``resume`` and
re-feeds the tokens it had written (recompute mode). The head of the queue
that does not fit stops admission; when nothing runs it is admitted anyway
(``force``), and aborted if it does not fit even then.

>>> from pagedkv.simulate import Budget, PagedEngine, Request, SimConfig, Workload
>>> engine = PagedEngine(Workload((Request(0, 6, 2, n=2),)), SimConfig(Budget(16), block_size=4))
>>> engine.schedule.arrive(engine.workload.requests[0])
>>> engine.admitter.admit_waiting(step=0)
>>> [engine.manager.num_tokens(s) for s in engine.schedule.running[0].seq_ids]
[6, 6]
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from pagedkv import PoolExhaustedError, SequenceState
from pagedkv.counts import ceil_div
from pagedkv.simulate.config import SimConfig
from pagedkv.simulate.requests import LiveRequest, RequestState, Schedule
from pagedkv.simulate.workload import Workload

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

    def admit_waiting(self, step: int) -> None:
        """Admit waiting requests in order until the head does not fit (it stays first)."""
        schedule = self.schedule
        waiting = schedule.waiting
        max_num_seqs = self.config.max_num_seqs
        while waiting:
            live = waiting[0]
            if max_num_seqs is not None and schedule.num_running_seqs + live.request.n > max_num_seqs:
                return
            force = not schedule.running
            if live.state is RequestState.PREEMPTED:
                self._readmit(live, step, force=force)
            else:
                self._admit(live, step, force=force)
            if live.state is RequestState.WAITING or live.state is RequestState.PREEMPTED:
                return  # it did not fit

    def _admit(self, live: LiveRequest, step: int, *, force: bool) -> None:
        """First admission: look the prompt up, prefill it, fork the samples.

        The request then runs, still waits (it does not fit above the
        watermark), or, with ``force`` (nothing else runs), is aborted.
        """
        manager, book = self.manager, self.book
        request = live.request
        prompt_len = request.prompt_len
        seq_id = book.new_seq_id(request.request_id)
        if book.with_tokens:
            prompt = self.workload.prompt_tokens(request)
            num_cached = manager.add_sequence(seq_id, prompt)
            wanted: Any = prompt[num_cached:]
        else:
            # A cheap necessary condition first: without prefix caching the
            # prompt takes exactly ceil(P / block_size) new blocks.
            need = ceil_div(prompt_len, self.config.block_size)
            if not force and self.pool.num_free_blocks - need < self._num_watermark_blocks:
                book.forget(seq_id)
                return
            manager.add_sequence(seq_id)
            num_cached = 0
            wanted = prompt_len
        plan = manager.plan({seq_id: wanted})
        num_left = plan.num_free_blocks + plan.num_released_blocks - plan.num_new_blocks
        if not plan.fits or (not force and num_left < self._num_watermark_blocks):
            manager.free(seq_id)
            book.forget(seq_id)
            if force:
                self.schedule.abort_head()
            return
        book.feed({seq_id: wanted})
        result = book.result
        result.num_prefix_query_tokens += prompt_len
        result.num_prefix_hit_tokens += num_cached
        live.seq_ids = [seq_id]
        if book.with_tokens:
            book.history[seq_id] = prompt
        for _ in range(request.n - 1):
            live.seq_ids.append(book.fork(seq_id, request.request_id))
        self.schedule.start(step, 0)

    def _readmit(self, live: LiveRequest, step: int, *, force: bool) -> None:
        """Bring a preempted request back: resume its sequences and re-feed their tokens.

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
        scheduler's decisions, not such retries).
        """
        request = live.request
        bs = self.config.block_size
        n, prompt_len = request.n, request.prompt_len
        length = prompt_len + live.num_generated
        loose = n * ceil_div(length, bs)
        tight = ceil_div(prompt_len, bs) + n * (ceil_div(length, bs) - ceil_div(prompt_len, bs))
        if live.num_generated and prompt_len % bs:
            tight += n - 1  # each sample but one copies the shared, partly filled prompt block
        room = self.pool.num_free_blocks - self._num_watermark_blocks
        if not force and room < min(tight, loose):
            return
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
        self.book.result.num_resumed_reuse_tokens += num_reused
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
