"""The contiguous baseline: reserve each request's maximum length up front, as before PagedAttention.

Owns :class:`ContiguousEngine` and its first-fit slab allocator: the PagedAttention
paper's reimplementation of Orca (Max, Pow2, Oracle) and FasterTransformer's
contiguous slabs. The rules and a hand-checked run: docs/simulate.md, "The contiguous baseline".
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable

from pagedkv.errors import ConfigError
from pagedkv.simulate.clock import Clock
from pagedkv.simulate.config import Budget
from pagedkv.simulate.cost import CostModel
from pagedkv.simulate.progress import Progress
from pagedkv.simulate.result import Accumulator, PolicyResult
from pagedkv.simulate.workload import Arrivals, Request, Workload

__all__ = ["RESERVE_RULES", "ContiguousEngine", "FirstFit"]

#: Policy name -> reservation rule.
RESERVE_RULES = {"contiguous": "max", "contiguous-pow2": "pow2", "contiguous-oracle": "oracle"}


class FirstFit:
    """A contiguous address space of ``size`` slots: first-fit allocation, coalescing free.

    Holes are kept sorted by start; both operations cost O(number of holes).

    >>> space = FirstFit(10)
    >>> space.allocate(4), space.allocate(4), space.allocate(4)
    (0, 4, None)
    >>> space.free(0, 4); space.holes
    [(0, 4), (8, 2)]
    """

    def __init__(self, size: int) -> None:
        self.size = size
        #: ``(start, length)`` of every free hole, sorted by start, never adjacent.
        self.holes: list[tuple[int, int]] = [(0, size)] if size else []
        self.num_free = size

    def allocate(self, length: int) -> int | None:
        """The start of a new slab of ``length`` slots, or None if no hole is large enough."""
        holes = self.holes
        for index, (start, hole) in enumerate(holes):
            if hole >= length:
                if hole == length:
                    del holes[index]
                else:
                    holes[index] = (start + length, hole - length)
                self.num_free -= length
                return start
        return None

    def free(self, start: int, length: int) -> None:
        """Give a slab back, merging it with the holes on either side."""
        holes = self.holes
        index = bisect.bisect_left(holes, (start, 0))
        end = start + length
        if index < len(holes) and holes[index][0] == end:
            end += holes[index][1]
            del holes[index]
        if index > 0 and holes[index - 1][0] + holes[index - 1][1] == start:
            start = holes[index - 1][0]
            del holes[index - 1]
            index -= 1
        holes.insert(index, (start, end - start))
        self.num_free += length

    def largest_hole(self) -> int:
        """The longest slab that could be allocated now."""
        return max((length for _, length in self.holes), default=0)

    def free_in_holes_smaller_than(self, length: int) -> int:
        """Free slots in holes shorter than ``length`` (useless for such a slab)."""
        return sum(hole for _, hole in self.holes if hole < length)


class _Slabs:
    __slots__ = ("finish_step", "first_step", "live_cap", "request", "starts")

    def __init__(
        self, request: Request, starts: list[int], first_step: int, finish_step: int, live_cap: int
    ) -> None:
        self.request = request
        self.starts = starts
        self.first_step = first_step
        self.finish_step = finish_step
        self.live_cap = live_cap


class ContiguousEngine:
    """Contiguous up-front reservation under the same budget and schedule as the paged policy.

    Args:
        workload: the requests.
        budget: the memory, in token slots.
        policy: ``"contiguous"``, ``"contiguous-pow2"`` or ``"contiguous-oracle"``.
        max_size: a sliding window (each slab capped at it), or None.
        max_num_seqs: at most this many sequences at once, or None.
        sample_every: record the series every this many steps (the means use every step).
        cost: the step-time model (the OPT-13B-on-A100 preset by default).

    Raises:
        ConfigError: an unknown policy.
    """

    def __init__(
        self,
        workload: Workload,
        budget: Budget,
        *,
        policy: str = "contiguous",
        max_size: int | None = None,
        max_num_seqs: int | None = None,
        sample_every: int = 10,
        cost: CostModel | None = None,
    ) -> None:
        if policy not in RESERVE_RULES:
            raise ConfigError(f"policy must be one of {sorted(RESERVE_RULES)}, got {policy!r}")
        self.workload = workload
        self.budget = budget
        self.policy = policy
        self.max_size = max_size
        self.max_num_seqs = max_num_seqs
        self.sample_every = sample_every
        self.space = FirstFit(budget.num_tokens)
        self.step = -1
        self.result = PolicyResult(policy)
        self.clock = Clock(cost if cost is not None else CostModel())

    def reservation(self, request: Request) -> int:
        """Slots one of ``request``'s sequences reserves."""
        final = request.prompt_len + request.output_len
        rule = RESERVE_RULES[self.policy]
        if rule == "max":
            slots = request.prompt_len + self.workload.max_output_len(request)
        elif rule == "pow2":
            slots = 1 << (final - 1).bit_length()
        else:
            slots = final
        return slots if self.max_size is None else min(slots, self.max_size)

    def run(
        self,
        *,
        progress: Progress | None = None,
        observer: Callable[[ContiguousEngine], None] | None = None,
    ) -> PolicyResult:
        """Simulate until every request has finished or was rejected."""
        start_time = time.perf_counter()
        cpu_start = time.process_time()
        result = self.result
        space = self.space
        budget = self.budget.num_tokens
        stats = Accumulator(result, budget)
        window = self.max_size if self.max_size is not None else 1 << 62
        arrivals = Arrivals(self.workload)
        waiting: deque[Request] = deque()
        running: dict[int, _Slabs] = {}
        finish_at: dict[int, list[_Slabs]] = {}
        stop_growing_at: dict[int, int] = {}
        num_seqs = num_growing = live = reserved = final_live = 0
        clock = self.clock
        arrived_s: dict[int, float] = {}
        step = -1
        while arrivals.num_pending or waiting or running:
            step += 1
            self.step = step
            if arrivals.num_pending:
                if not (waiting or running):
                    next_s = arrivals.next_arrival_s()
                    if next_s is not None:
                        clock.idle_until(next_s)
                for request in arrivals.pop_arrived(step, clock.now):
                    arrived_s[request.request_id] = (
                        request.arrival_s if request.arrival_s is not None else clock.now
                    )
                    waiting.append(request)
            # Decode: every running sequence writes one token.
            live += num_growing
            result.num_decode_tokens += num_seqs
            num_step_tokens, num_step_context = num_seqs, live if num_seqs else 0
            num_step_pairs = num_step_context
            # Admit FCFS while the head's slabs fit.
            while waiting:
                request = waiting[0]
                n = request.n
                if self.max_num_seqs is not None and num_seqs + n > self.max_num_seqs:
                    break
                slots = self.reservation(request)
                if n * slots > budget:
                    waiting.popleft()  # it could never fit: earlier systems refused it
                    result.num_rejected += 1
                    continue
                starts = []
                for _ in range(n):
                    begin = space.allocate(slots)
                    if begin is None:
                        break
                    starts.append(begin)
                if len(starts) < n:
                    for begin in starts:
                        space.free(begin, slots)
                    break
                waiting.popleft()
                final = request.prompt_len + request.output_len
                slabs = _Slabs(request, starts, step, step + request.output_len, min(final, window))
                running[request.request_id] = slabs
                finish_at.setdefault(slabs.finish_step, []).append(slabs)
                num_seqs += n
                live += n * min(request.prompt_len, window)
                reserved += n * slots
                final_live += n * slabs.live_cap
                result.num_prefill_tokens += n * request.prompt_len
                prompt_len = request.prompt_len
                num_step_tokens += prompt_len  # the prompt is computed once, stored in every slab
                num_step_context += prompt_len
                num_step_pairs += prompt_len * (prompt_len + 1) // 2
                if request.prompt_len < window < final:
                    # The window is full after this step; the slab stops growing.
                    stop_growing_at.setdefault(step + window - request.prompt_len, 0)
                    stop_growing_at[step + window - request.prompt_len] += n
                    num_growing += n
                elif request.prompt_len < window:
                    num_growing += n
            clock.end_step(num_step_tokens, num_step_context, num_step_pairs)
            stats.on_step(num_seqs, len(running))
            external = 0
            if waiting:
                external = space.free_in_holes_smaller_than(self.reservation(waiting[0]))
            stats.on_sample(
                step,
                live=live,
                unfilled=reserved - live,
                never_used=reserved - final_live,
                external=external,
                num_seqs=num_seqs,
                loaded=bool(waiting),
                record=step % self.sample_every == 0,
            )
            if observer is not None:
                observer(self)
            num_growing -= stop_growing_at.pop(step, 0)
            for slabs in finish_at.pop(step, ()):
                request = slabs.request
                slots = self.reservation(request)
                for begin in slabs.starts:
                    space.free(begin, slots)
                n = request.n
                del running[request.request_id]
                num_seqs -= n
                live -= n * slabs.live_cap
                reserved -= n * slots
                final_live -= n * slabs.live_cap
                if request.prompt_len + request.output_len <= window and request.prompt_len < window:
                    num_growing -= n  # it was still growing when it finished
                result.num_finished += 1
                result.num_generated_tokens += n * request.output_len
                clock.record(
                    arrival_s=arrived_s.pop(request.request_id),
                    first_step=slabs.first_step,
                    finish_step=step,
                    num_output_tokens=request.output_len,
                )
            if progress is not None and step % 1024 == 0:
                progress.update(result.num_finished + result.num_rejected, f"step {step}")
        if progress is not None:
            progress.close(result.num_finished + result.num_rejected, f"step {step}")
        return stats.finish(time.perf_counter() - start_time, time.process_time() - cpu_start, clock)
