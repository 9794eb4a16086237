"""The requests in flight in the paged simulation: their states, and who waits or runs.

Owns :class:`LiveRequest` (one request's state and step arithmetic) and :class:`Schedule`,
the one place that moves requests between states and frees or preempts their sequences.
Counterpart: vLLM v1's ``Request`` / ``RequestStatus`` and the scheduler's ``waiting`` and
``running`` queues. The state diagram, the step arithmetic and an example:
docs/simulate.md, "Requests in flight".
"""

from __future__ import annotations

import enum
from collections import deque

from pagedkv import SequenceState
from pagedkv.simulate.clock import Clock
from pagedkv.simulate.sequences import SequenceBook
from pagedkv.simulate.workload import Request

__all__ = ["LiveRequest", "RequestState", "Schedule"]


class RequestState(enum.Enum):
    """Where a request is in the paged simulation (its sequences' states follow it)."""

    #: Arrived, never admitted: it holds no sequence yet.
    WAITING = "waiting"
    #: Its sequences hold blocks and grow by one token every step.
    RUNNING = "running"
    #: Preempted: its sequences hold no device block (recompute: none at all;
    #: swap: their blocks are on the host); it waits at the queue's front.
    PREEMPTED = "preempted"
    #: Admitted with chunked prefill: its first sequence holds part of the prompt.
    PREFILLING = "prefilling"
    #: Its last output token was written; its sequences were freed.
    FINISHED = "finished"
    #: Dropped: it could not fit even running alone; its sequences were freed.
    ABORTED = "aborted"


class LiveRequest:
    """A request in flight: its sequences, its state and where it is in its output.

    Args:
        request: the request, as the workload gives it.
    """

    __slots__ = (
        "arrival_s",
        "base",
        "first_step",
        "num_generated",
        "num_lost_prefill",
        "num_prefilled",
        "request",
        "seq_ids",
        "state",
        "swapped",
    )

    def __init__(self, request: Request, arrival_s: float = 0.0) -> None:
        self.request = request
        #: The model second it arrived.
        self.arrival_s = arrival_s
        #: The step of its first prefill (its first token), -1 before.
        self.first_step = -1
        #: Prompt tokens its first sequence holds while PREFILLING.
        self.num_prefilled = 0
        #: Prompt tokens a preemption threw away while it was PREFILLING (recomputed later).
        self.num_lost_prefill = 0
        #: Preempted by swap: its sequences' blocks are on the host.
        self.swapped = False
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

    Args:
        book: the sequences of the requests (its manager holds them; its
            result counts what the schedule does).
        clock: where finished requests' latencies go, or None.

    Attributes:
        waiting: FCFS; a preempted request goes back to its front.
        running: in admission order, so the newest, the first to preempt, is last.
        prefilling: admitted requests whose prompt is still being fed in chunks
            (newer than every running one: the prefill budget goes in order).
        num_running_seqs: sequences of the running requests.

    Invariants (``check_consistency``):
        * ``running`` holds exactly the RUNNING requests, ``waiting`` the
          WAITING and PREEMPTED ones;
        * a running request's sequences are running, hold
          ``num_tokens(step)`` tokens each, and are the decode request's;
        * a preempted request's sequences are preempted and hold no block
          (swapped ones: swapped, their blocks on the host);
        * a prefilling request's one sequence runs and holds ``num_prefilled`` tokens;
        * ``num_running_tokens(step)`` is the sum of the running sequences' tokens;
        * the manager knows no other sequence.
    """

    def __init__(self, book: SequenceBook, clock: Clock | None = None) -> None:
        self.book = book
        self.clock = clock
        self.waiting: deque[LiveRequest] = deque()
        self.running: list[LiveRequest] = []
        self.prefilling: list[LiveRequest] = []
        self.num_running_seqs = 0
        #: sum over running requests of ``n x (prompt_len - base)``: the running
        #: tokens at ``step`` are this plus ``step x num_running_seqs``.
        self._token_offset = 0
        self._finish_at: dict[int, list[LiveRequest]] = {}

    def arrive(self, request: Request, now_s: float = 0.0) -> None:
        """``request`` joins the back of the waiting queue (it arrived at ``arrival_s``, else ``now_s``)."""
        arrival_s = request.arrival_s if request.arrival_s is not None else now_s
        self.waiting.append(LiveRequest(request, arrival_s))

    def num_running_tokens(self, step: int) -> int:
        """Tokens the running sequences hold after ``step``'s decode (the context attention reads)."""
        return self._token_offset + step * self.num_running_seqs

    def start(self, step: int, num_generated: int, live: LiveRequest | None = None) -> None:
        """A request runs from ``step`` on, ``num_generated`` tokens written.

        Args:
            step: the step it was (re-)admitted in.
            num_generated: output tokens it had written before.
            live: a PREFILLING request whose last chunk was written; None
                for the head of the waiting queue.
        """
        if live is None:
            live = self.waiting.popleft()
        else:
            self.prefilling.remove(live)
        if live.first_step < 0:
            live.first_step = step
        live.state = RequestState.RUNNING
        live.swapped = False
        live.base = step - num_generated
        self.running.append(live)
        self._finish_at.setdefault(live.finish_step, []).append(live)
        self.num_running_seqs += len(live.seq_ids)
        self._token_offset += len(live.seq_ids) * (live.request.prompt_len - live.base)
        decode = self.book.decode
        for seq_id in live.seq_ids:
            decode[seq_id] = 1

    def begin_prefill(self, num_prefilled: int) -> LiveRequest:
        """The head of the waiting queue was admitted with ``num_prefilled`` prompt tokens of its prompt."""
        live = self.waiting.popleft()
        live.state = RequestState.PREFILLING
        live.num_prefilled = num_prefilled
        self.prefilling.append(live)
        return live

    def preempt_newest(self, step: int, mode: str = "recompute") -> LiveRequest:
        """Stop the most recently admitted request before ``step``'s token; return it.

        A prefilling request (the newest) loses its prompt chunks and goes back
        to the front of the queue. A running one is preempted (``"recompute"``:
        its blocks are freed; ``"swap"``: copied to the host pool, if they fit
        there, else recompute) and goes back to the front of the waiting queue,
        or is aborted if it was running alone.
        """
        book = self.book
        manager, decode, result = book.manager, book.decode, book.result
        if self.prefilling:
            live = self.prefilling.pop()
            for seq_id in live.seq_ids:
                manager.free(seq_id)
                book.forget(seq_id)
            live.seq_ids = []
            live.num_lost_prefill = max(live.num_lost_prefill, live.num_prefilled)
            live.num_prefilled = 0
            live.state = RequestState.WAITING
            self.waiting.appendleft(live)
            result.num_preemptions += 1
            return live
        live = self.running.pop()
        if not self.running:
            self._drop(live)  # it cannot grow even alone: it outgrew the pool
            return live
        host = manager.host_pool
        num_blocks = sum(manager.block_table(seq_id).num_blocks for seq_id in live.seq_ids)
        swap = mode == "swap" and host is not None and host.num_free_blocks >= num_blocks
        for seq_id in live.seq_ids:
            manager.preempt(seq_id, "swap" if swap else "recompute")
            decode.pop(seq_id, None)
        if swap:
            book.num_step_swapped_blocks += num_blocks
            result.num_swapped_out_blocks += num_blocks
        self.num_running_seqs -= len(live.seq_ids)
        self._token_offset -= len(live.seq_ids) * (live.request.prompt_len - live.base)
        live.num_generated = step - 1 - live.base
        live.state = RequestState.PREEMPTED
        live.swapped = swap
        self.waiting.appendleft(live)
        result.num_preemptions += 1
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
            self._token_offset -= len(live.seq_ids) * (live.request.prompt_len - live.base)
            result.num_finished += 1
            result.num_generated_tokens += live.request.n * live.request.output_len
            if self.clock is not None:
                self.clock.record(
                    arrival_s=live.arrival_s,
                    first_step=live.first_step,
                    finish_step=step,
                    num_output_tokens=live.request.output_len,
                )
            any_done = True
        if any_done:
            self.running[:] = [live for live in self.running if live.state is running]

    def held_seq_ids(self) -> list[int]:
        """The sequences that hold device blocks: the running ones, then the prefilling ones."""
        return self.running_seq_ids() + [seq_id for live in self.prefilling for seq_id in live.seq_ids]

    def running_seq_ids(self) -> list[int]:
        """The sequences of every running request, in admission order."""
        return [seq_id for live in self.running for seq_id in live.seq_ids]

    def _drop(self, live: LiveRequest) -> None:
        manager, book = self.book.manager, self.book
        if live.state is RequestState.RUNNING:
            self.num_running_seqs -= len(live.seq_ids)
            self._token_offset -= len(live.seq_ids) * (live.request.prompt_len - live.base)
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
        for live in self.prefilling:
            if live.state is not RequestState.PREFILLING or len(live.seq_ids) != 1:
                raise AssertionError(f"request {live.request.request_id} is in the prefilling list but "
                                     f"{live.state.value} with {len(live.seq_ids)} sequences")
            expected.add(live.seq_ids[0])
            if manager.num_tokens(live.seq_ids[0]) != live.num_prefilled:
                raise AssertionError(f"prefilling request {live.request.request_id} holds the wrong tokens")
        for live in self.waiting:
            if live.state is not RequestState.PREEMPTED:
                continue
            state = SequenceState.SWAPPED if live.swapped else SequenceState.PREEMPTED
            for seq_id in live.seq_ids:
                expected.add(seq_id)
                if manager.state(seq_id) is not state:
                    raise AssertionError(f"sequence {seq_id} should be {state.value}")
                if not live.swapped and manager.block_table(seq_id).num_blocks:
                    raise AssertionError(f"preempted sequence {seq_id} still holds blocks")
        if set(manager.seq_ids) != expected:
            raise AssertionError(
                f"the manager knows {len(manager.seq_ids)} sequences, the simulator {len(expected)}"
            )
        if num_seqs != self.num_running_seqs:
            raise AssertionError(f"{num_seqs} sequences run, counted {self.num_running_seqs}")
        if set(book.decode) != set(self.running_seq_ids()):
            raise AssertionError("the decode request and the running sequences disagree")
        if self.num_running_tokens(step) != sum(
            live.num_tokens(step) * len(live.seq_ids) for live in self.running
        ):
            raise AssertionError(f"num_running_tokens({step}) disagrees with the running requests")
