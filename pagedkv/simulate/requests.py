"""The requests in flight in the paged simulation: their states, and who waits or runs.

A :class:`LiveRequest` records one request's state and step arithmetic; the
:class:`Schedule` is the one place that moves requests between states, and
frees or preempts their sequences as it does::

    WAITING ---start---> RUNNING ---finish (its last token written)---> FINISHED
                          |   ^
                  preempt |   | start again (re-admitted, its tokens recomputed)
                          v   |
                        PREEMPTED

    WAITING, RUNNING or PREEMPTED ---abort---> ABORTED   (it outgrew the whole pool running alone)

The scheduler (:mod:`pagedkv.simulate.engine` and
:mod:`~pagedkv.simulate.admission`) decides when; the schedule keeps the
order that says whom (FCFS admission, the newest preempted first). Step
arithmetic, a request with prompt 3 and output 4 admitted at step 10::

    step                  10   11   12   13   14
    tokens per sequence    3    4    5    6    7      = prompt_len + step - base
    base = 10, finish_step = base + output_len = 14: freed at the end of step 14

>>> from pagedkv.simulate.workload import Request
>>> live = LiveRequest(Request(0, prompt_len=3, output_len=4))
>>> live.base = 10
>>> live.state, live.finish_step, live.num_tokens(12)
(<RequestState.WAITING: 'waiting'>, 14, 5)
"""

from __future__ import annotations

import enum
from collections import deque

from pagedkv import SequenceState
from pagedkv.simulate.sequences import SequenceBook
from pagedkv.simulate.workload import Request

__all__ = ["LiveRequest", "RequestState", "Schedule"]


class RequestState(enum.Enum):
    """Where a request is in the paged simulation (its sequences' states follow it)."""

    #: Arrived, never admitted: it holds no sequence yet.
    WAITING = "waiting"
    #: Its sequences hold blocks and grow by one token every step.
    RUNNING = "running"
    #: Preempted (recompute mode): its sequences hold no block; it waits at the queue's front.
    PREEMPTED = "preempted"
    #: Its last output token was written; its sequences were freed.
    FINISHED = "finished"
    #: Dropped: it could not fit even running alone; its sequences were freed.
    ABORTED = "aborted"


class LiveRequest:
    """A request in flight: its sequences, its state and where it is in its output.

    Args:
        request: the request, as the workload gives it.
    """

    __slots__ = ("base", "num_generated", "request", "seq_ids", "state")

    def __init__(self, request: Request) -> None:
        self.request = request
        #: The manager's sequence ids of its samples (beams), the first one first.
        self.seq_ids: list[int] = []
        self.state = RequestState.WAITING
        #: Output tokens written so far, while preempted.
        self.num_generated = 0
        #: Output tokens written after step ``t`` = ``t - base`` while running.
        self.base = 0

    @property
    def finish_step(self) -> int:
        """The step whose end frees it (while running)."""
        return self.base + self.request.output_len

    def num_tokens(self, step: int) -> int:
        """Tokens each of its sequences holds after ``step`` (while running)."""
        return self.request.prompt_len + step - self.base


class Schedule:
    """Who waits, who runs, and when each running request ends.

    Args:
        book: the sequences of the requests (its manager holds them; its
            result counts what the schedule does).

    Attributes:
        waiting: FCFS; a preempted request goes back to its front.
        running: in admission order, so the newest, the first to preempt, is last.
        num_running_seqs: sequences of the running requests.

    Invariants (``check_consistency``):
        * ``running`` holds exactly the RUNNING requests, ``waiting`` the
          WAITING and PREEMPTED ones;
        * a running request's sequences are running, hold
          ``num_tokens(step)`` tokens each, and are the decode request's;
        * a preempted request's sequences are preempted and hold no block;
        * the manager knows no other sequence.
    """

    def __init__(self, book: SequenceBook) -> None:
        self.book = book
        self.waiting: deque[LiveRequest] = deque()
        self.running: list[LiveRequest] = []
        self.num_running_seqs = 0
        self._finish_at: dict[int, list[LiveRequest]] = {}

    def arrive(self, request: Request) -> None:
        """``request`` joins the back of the waiting queue."""
        self.waiting.append(LiveRequest(request))

    def start(self, step: int, num_generated: int) -> None:
        """The head of the waiting queue runs from ``step`` on, ``num_generated`` tokens written."""
        live = self.waiting.popleft()
        live.state = RequestState.RUNNING
        live.base = step - num_generated
        self.running.append(live)
        self._finish_at.setdefault(live.finish_step, []).append(live)
        self.num_running_seqs += len(live.seq_ids)
        decode = self.book.decode
        for seq_id in live.seq_ids:
            decode[seq_id] = 1

    def preempt_newest(self, step: int) -> LiveRequest:
        """Stop the newest running request before ``step``'s token; return it.

        It is preempted (recompute mode: its blocks are freed, it goes back
        to the front of the waiting queue), or aborted if it was running alone.
        """
        live = self.running.pop()
        if not self.running:
            self._drop(live)  # it cannot grow even alone: it outgrew the pool
            return live
        manager, decode = self.book.manager, self.book.decode
        for seq_id in live.seq_ids:
            manager.preempt(seq_id, "recompute")
            decode.pop(seq_id, None)
        live.num_generated = step - 1 - live.base
        live.state = RequestState.PREEMPTED
        self.num_running_seqs -= len(live.seq_ids)
        self.waiting.appendleft(live)
        self.book.result.num_preemptions += 1
        return live

    def abort_head(self) -> None:
        """Drop the head of the waiting queue: it does not fit even running alone."""
        self._drop(self.waiting.popleft())

    def finish(self, step: int) -> None:
        """Free the requests whose last output token was written in ``step``."""
        ending = self._finish_at.pop(step, None)
        if not ending:
            return
        book = self.book
        manager, result = book.manager, book.result
        running = RequestState.RUNNING
        any_done = False
        for live in ending:
            if live.state is not running or live.finish_step != step:
                continue  # preempted since; it has a new finish step
            for seq_id in live.seq_ids:
                manager.free(seq_id)
                book.forget(seq_id)
            live.state = RequestState.FINISHED
            self.num_running_seqs -= len(live.seq_ids)
            result.num_finished += 1
            result.num_generated_tokens += live.request.n * live.request.output_len
            any_done = True
        if any_done:
            self.running[:] = [live for live in self.running if live.state is running]

    def running_seq_ids(self) -> list[int]:
        """The sequences of every running request, in admission order."""
        return [seq_id for live in self.running for seq_id in live.seq_ids]

    def _drop(self, live: LiveRequest) -> None:
        manager, book = self.book.manager, self.book
        if live.state is RequestState.RUNNING:
            self.num_running_seqs -= len(live.seq_ids)
        for seq_id in live.seq_ids:
            if seq_id in manager:
                manager.free(seq_id)
            book.forget(seq_id)
        live.state = RequestState.ABORTED
        book.result.num_aborted += 1

    def check_consistency(self, step: int) -> None:
        """Raise ``AssertionError`` if the schedule and the manager disagree (the invariants)."""
        manager, book = self.book.manager, self.book
        expected: set[object] = set()
        num_seqs = 0
        for live in self.running:
            if live.state is not RequestState.RUNNING:
                raise AssertionError(
                    f"request {live.request.request_id} is in the running list but {live.state.value}"
                )
            length = live.num_tokens(step)
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
                if book.with_tokens and len(book.history[seq_id]) != length:
                    raise AssertionError(f"sequence {seq_id}'s token history has the wrong length")
        for live in self.waiting:
            if live.state is not RequestState.PREEMPTED:
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
        if num_seqs != self.num_running_seqs:
            raise AssertionError(f"{num_seqs} sequences run, counted {self.num_running_seqs}")
        if set(book.decode) != set(self.running_seq_ids()):
            raise AssertionError("the decode request and the running sequences disagree")
