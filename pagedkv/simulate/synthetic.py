"""Synthetic request streams: ShareGPT- and Alpaca-like lengths, shared system prompts, forks, arrivals.

Owns :func:`synthetic`: lognormal lengths whose clipped means match the PagedAttention
paper's ShareGPT and Alpaca averages (and ``longdoc`` for the hybrid-model study).
Counterpart: the ``sharegpt`` and ``random`` datasets of vLLM's ``benchmark_serving``.
The length table and an example: docs/simulate.md, "Synthetic workloads".
"""

from __future__ import annotations

import math

import numpy as np

from pagedkv.simulate.workload import SAMPLING_KINDS, Request, Workload, WorkloadError

__all__ = ["DATASETS", "synthetic"]

#: ``name: ((prompt mean, sigma), (output mean, sigma))`` of the synthetic length distributions.
DATASETS: dict[str, tuple[tuple[float, float], tuple[float, float]]] = {
    "sharegpt": ((161.0, 1.0), (338.0, 1.0)),
    "alpaca": ((19.31, 0.6), (58.45, 0.7)),
    "longdoc": ((6000.0, 0.5), (250.0, 0.7)),
}


def _lognormal_mu(mean: float, sigma: float, cap: float) -> float:
    """The ``mu`` whose lognormal, clipped at ``cap``, has mean ``mean`` (bisection)."""

    def phi(x: float) -> float:
        return 0.5 * (1 + math.erf(x / math.sqrt(2)))

    def clipped_mean(mu: float) -> float:
        log_cap = math.log(cap)
        body = math.exp(mu + sigma**2 / 2) * phi((log_cap - mu - sigma**2) / sigma)
        return body + cap * (1 - phi((log_cap - mu) / sigma))

    lo, hi = -10.0, math.log(cap) + 10
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if clipped_mean(mid) < mean else (lo, mid)
    return (lo + hi) / 2


def _lengths(rng: np.random.Generator, mean: float, sigma: float, cap: int, num: int) -> list[int]:
    if mean >= cap:
        raise WorkloadError(f"a mean length of {mean} does not fit under the clip of {cap} tokens")
    mu = _lognormal_mu(mean, sigma, cap)
    draws = np.rint(rng.lognormal(mu, sigma, num))
    return np.clip(draws, 1, cap).astype(np.int64).tolist()  # type: ignore[no-any-return]


def synthetic(
    dataset: str,
    num_requests: int,
    *,
    seed: int = 0,
    n: int = 1,
    sampling: str = "parallel",
    num_prefix_groups: int = 0,
    prefix_len: int = 0,
    arrival_rate: float | None = None,
    request_rate: float | None = None,
    max_model_len: int = 2048,
) -> Workload:
    """A synthetic request stream with ShareGPT- or Alpaca-like lengths.

    Args:
        dataset: ``"sharegpt"``, ``"alpaca"`` or ``"longdoc"`` (see the module docstring).
        num_requests: how many requests.
        seed: seeds lengths, groups, arrivals and token ids.
        n: samples per request (forks after prefill).
        sampling: ``"parallel"`` or ``"beam"``.
        num_prefix_groups: when > 0, each request joins one of this many
            groups at random, and its prompt starts with the group's
            ``prefix_len``-token system prompt (added to the drawn length).
        prefix_len: the shared system prompt's length.
        arrival_rate: requests per step (a Poisson process); None means
            every request arrives at step 0 (an offline batch).
        request_rate: requests per model second (a Poisson process, in the
            time of :mod:`pagedkv.simulate.cost`); None for none. The gaps are
            one unit-rate draw scaled by ``1 / request_rate``, so every rate
            sees the same requests in the same order, only closer together.
        max_model_len: the modeled model's longest sequence; each drawn
            length is clipped to half of it.

    Raises:
        WorkloadError: an unknown dataset or a parameter out of range.
    """
    if dataset not in DATASETS:
        raise WorkloadError(
            f"unknown workload {dataset!r}; expected one of {sorted(DATASETS)} or a .jsonl file"
        )
    _check_int("num_requests", num_requests, 1)
    _check_int("n", n, 1)
    _check_int("prefix_len", prefix_len, 0)
    _check_int("num_prefix_groups", num_prefix_groups, 0)
    _check_int("max_model_len", max_model_len, 4)
    if sampling not in SAMPLING_KINDS:
        raise WorkloadError(f"sampling must be one of {SAMPLING_KINDS}, got {sampling!r}")
    if arrival_rate is not None and not arrival_rate > 0:
        raise WorkloadError(f"arrival_rate must be > 0 requests per step, got {arrival_rate!r}")
    if request_rate is not None and not (0 < request_rate < math.inf):
        raise WorkloadError(f"request_rate must be > 0 requests per second, got {request_rate!r}")
    if prefix_len and not num_prefix_groups:
        num_prefix_groups = 1
    if prefix_len >= max_model_len // 2:
        raise WorkloadError(f"prefix_len {prefix_len} leaves no room under max_model_len {max_model_len}")
    (prompt_mean, prompt_sigma), (output_mean, output_sigma) = DATASETS[dataset]
    rng = np.random.default_rng([seed, 0])
    cap = max_model_len // 2
    prompt_lens = _lengths(rng, prompt_mean, prompt_sigma, cap - prefix_len, num_requests)
    output_lens = _lengths(rng, output_mean, output_sigma, cap, num_requests)
    groups = rng.integers(0, max(1, num_prefix_groups), num_requests).tolist()
    arrivals = [0] * num_requests
    if arrival_rate is not None:
        arrivals = np.floor(np.cumsum(rng.exponential(1 / arrival_rate, num_requests))).astype(int).tolist()
    arrival_s: list[float | None] = [None] * num_requests
    if request_rate is not None:
        gaps = np.random.default_rng([seed, 3]).exponential(1.0, num_requests)
        arrival_s = (np.cumsum(gaps) / request_rate).tolist()
    requests = tuple(
        Request(
            request_id=i,
            prompt_len=prompt_lens[i] + prefix_len,
            output_len=output_lens[i],
            n=n,
            sampling=sampling,
            prefix_group=f"group-{groups[i]}" if num_prefix_groups else None,
            prefix_len=prefix_len if num_prefix_groups else 0,
            arrival_step=arrivals[i],
            arrival_s=arrival_s[i],
        )
        for i in range(num_requests)
    )
    source = f"{dataset} x {num_requests}"
    if n > 1:
        source += f", n={n} {sampling}"
    if request_rate is not None:
        source += f", {request_rate:g} requests/s"
    if num_prefix_groups:
        source += f", {num_prefix_groups} prefix group(s) of {prefix_len} tokens"
    return Workload(requests, seed=seed, source=source, max_model_len=max_model_len)


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise WorkloadError(f"{name} must be an int >= {minimum}, got {value!r}")
