"""Model time of one simulated engine: when each step ends, and what each request saw.

Owns :class:`Clock`: each step's end time from the :class:`~pagedkv.simulate.cost.CostModel`,
idle jumps to the next arrival, and per request its arrival, first token and finish. No
vLLM counterpart (vLLM runs in wall time); it models the timestamps vLLM's
``benchmark_serving`` records. The timeline and an example: docs/simulate.md, "The clock".
"""

from __future__ import annotations

from pagedkv.simulate.cost import CostModel

__all__ = ["Clock"]


class Clock:
    """Step end times in model seconds, and the latency records of finished requests.

    Args:
        cost: turns a step's work into seconds.

    Invariants:
        * ``step_end`` is non-decreasing, one entry per ended step;
        * every record's times satisfy ``arrival <= first token <= finish``.
    """

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        #: The model time now: the end of the last step (or an idle jump past it).
        self.now = 0.0
        #: ``step_end[k]``: the model time step ``k`` ended.
        self.step_end: list[float] = []
        #: ``(arrival_s, first_token_s, finish_s, num_output_tokens)`` per finished request.
        self.records: list[tuple[float, float, float, int]] = []
        #: Seconds spent copying KV to and from the host (part of the step times).
        self.transfer_s = 0.0
        #: Seconds spent loading blocks from the host tier (part of the step times).
        self.tier_load_s = 0.0
        #: Seconds of steps that computed something (the rest is overhead of idle steps).
        self.busy_s = 0.0
        #: Of ``busy_s``, seconds memory-bound steps spent reading KV (``CostModel.attention_read_time``).
        self.attention_s = 0.0

    def idle_until(self, time_s: float) -> None:
        """Nothing to do until ``time_s`` (the next arrival): jump there, if it is later."""
        if time_s > self.now:
            self.now = time_s

    def end_step(
        self,
        num_tokens: int,
        kv_tokens_read: int,
        num_attention_pairs: int = 0,
        swapped_tokens: int = 0,
        loaded_tokens: int = 0,
    ) -> float:
        """End a step that did this work; return the time it ended.

        ``loaded_tokens`` came from the host tier: copied over the same link
        as swap (``cost.host_bandwidth``), counted apart in ``tier_load_s``.
        """
        moved = swapped_tokens + loaded_tokens
        duration = self.cost.step_time(num_tokens, kv_tokens_read, num_attention_pairs, moved)
        if loaded_tokens:
            self.tier_load_s += self.cost.transfer_time(loaded_tokens)
        if num_tokens or moved:
            self.busy_s += duration
            self.attention_s += self.cost.attention_read_time(num_tokens, kv_tokens_read, num_attention_pairs)
        if swapped_tokens:
            self.transfer_s += self.cost.transfer_time(swapped_tokens)
        self.now += duration
        self.step_end.append(self.now)
        return self.now

    def record(self, *, arrival_s: float, first_step: int, finish_step: int, num_output_tokens: int) -> None:
        """A request finished: keep its arrival, first-token and finish times."""
        ends = self.step_end
        self.records.append((arrival_s, ends[first_step], ends[finish_step], num_output_tokens))

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if a step ends before the previous one or a record is out of order."""
        ends = self.step_end
        for index in range(1, len(ends)):
            if ends[index] < ends[index - 1]:
                raise AssertionError(f"step {index} ends at {ends[index]} before step {index - 1}")
        for arrival, first, finish, _ in self.records:
            if not arrival <= first <= finish:
                raise AssertionError(f"a request arrived {arrival}, first token {first}, finished {finish}")
