"""Latency and throughput of a run, in model seconds: means and percentiles of what requests saw.

Owns :class:`Latency` and :func:`summarize`, over the clock's records: TTFT, TPOT,
end-to-end and normalised latency per request, requests and tokens per model second.
Counterpart: the metrics of vLLM's ``benchmark_serving`` (normalised latency is the
PagedAttention paper's). The formulas and an example: docs/simulate.md, "Latency and throughput".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["PERCENTILES", "Latency", "summarize"]

#: The percentiles every distribution reports.
PERCENTILES = (50, 90, 99)


@dataclass
class Latency:
    """What requests saw, in model seconds: means and percentiles (p50, p90, p99).

    Attributes:
        num_requests: finished requests behind the numbers.
        duration_s: model seconds from the first arrival to the last finish.
        requests_per_s: finished requests per model second.
        tokens_per_s: output tokens (every sample) per model second.
        ttft_mean, ttft_p50, ttft_p90, ttft_p99: time to first token.
        tpot_mean, tpot_p50, tpot_p90, tpot_p99: time per output token after the first.
        e2e_mean, e2e_p50, e2e_p90, e2e_p99: end-to-end latency.
        normalised_mean, normalised_p50, normalised_p90, normalised_p99:
            end-to-end latency per output token.
    """

    num_requests: int = 0
    duration_s: float = 0.0
    requests_per_s: float = 0.0
    tokens_per_s: float = 0.0
    ttft_mean: float = 0.0
    ttft_p50: float = 0.0
    ttft_p90: float = 0.0
    ttft_p99: float = 0.0
    tpot_mean: float = 0.0
    tpot_p50: float = 0.0
    tpot_p90: float = 0.0
    tpot_p99: float = 0.0
    e2e_mean: float = 0.0
    e2e_p50: float = 0.0
    e2e_p90: float = 0.0
    e2e_p99: float = 0.0
    normalised_mean: float = 0.0
    normalised_p50: float = 0.0
    normalised_p90: float = 0.0
    normalised_p99: float = 0.0


def summarize(records: Sequence[tuple[float, float, float, int]], *, num_generated_tokens: int) -> Latency:
    """Means and percentiles of ``(arrival_s, first_token_s, finish_s, num_output_tokens)`` records.

    Args:
        records: one per finished request.
        num_generated_tokens: output tokens of every sample (for ``tokens_per_s``).

    Returns:
        The summary; all zeros when there are no records.
    """
    if not records:
        return Latency()
    table = np.array(records, dtype=np.float64)  # (num_requests, 4)
    arrival, first, finish, num_out = table[:, 0], table[:, 1], table[:, 2], table[:, 3]
    duration = float(finish.max() - arrival.min())
    series = {
        "ttft": first - arrival,
        "tpot": (finish - first) / num_out,
        "e2e": finish - arrival,
        "normalised": (finish - arrival) / num_out,
    }
    latency = Latency(
        num_requests=len(records),
        duration_s=duration,
        requests_per_s=len(records) / duration if duration > 0 else 0.0,
        tokens_per_s=num_generated_tokens / duration if duration > 0 else 0.0,
    )
    for name, values in series.items():
        setattr(latency, f"{name}_mean", float(values.mean()))
        for percentile, value in zip(PERCENTILES, np.percentile(values, PERCENTILES)):
            setattr(latency, f"{name}_p{percentile}", float(value))
    return latency
