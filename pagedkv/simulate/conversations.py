"""Multi-turn chat: conversations under shared system prompts, each turn's prompt extending the last.

Owns :func:`conversations`, the workload of the replica and host-tier studies: Poisson
conversation starts, open-loop turns, lognormal message lengths. Models the multi-turn chat
of SGLang's RadixAttention paper (SGLang's ``benchmark/multi_turn_chat``). The turn layout
and an example: docs/simulate.md, "Conversations".
"""

from __future__ import annotations

import numpy as np

from pagedkv.simulate.workload import VOCAB_SIZE, Request, Workload, WorkloadError

__all__ = ["conversations"]

#: Mean lengths and sigma of the lognormal draws: (user message, reply).
USER_LEN, REPLY_LEN, SIGMA = 40.0, 120.0, 0.6


def conversations(
    num_conversations: int,
    *,
    num_turns: int = 4,
    num_system_prompts: int = 4,
    system_prompt_len: int = 200,
    rate: float = 1.0,
    think_s: float = 20.0,
    seed: int = 0,
    max_model_len: int = 2048,
) -> Workload:
    """Multi-turn conversations (see the module docstring); requests sorted by arrival.

    Args:
        num_conversations: conversations.
        num_turns: turns per conversation (fewer if one would pass ``max_model_len``).
        num_system_prompts: distinct system prompts the conversations share.
        system_prompt_len: tokens of each system prompt.
        rate: conversations starting per model second (Poisson).
        think_s: model seconds between a conversation's turns.
        seed: seeds lengths, tokens, system prompts and arrivals.
        max_model_len: the longest sequence.

    Raises:
        WorkloadError: a parameter out of range.
    """
    for name, value, minimum in (
        ("num_conversations", num_conversations, 1),
        ("num_turns", num_turns, 1),
        ("num_system_prompts", num_system_prompts, 1),
        ("system_prompt_len", system_prompt_len, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise WorkloadError(f"{name} must be an int >= {minimum}, got {value!r}")
    if not 0 < rate < float("inf") or not 0 <= think_s < float("inf"):
        raise WorkloadError(f"rate must be > 0 and think_s >= 0, got rate={rate!r}, think_s={think_s!r}")
    if system_prompt_len + 2 * USER_LEN > max_model_len:
        raise WorkloadError(
            f"system_prompt_len {system_prompt_len} leaves no room under max_model_len {max_model_len}"
        )
    rng = np.random.default_rng([seed, 4])
    systems = [rng.integers(0, VOCAB_SIZE, system_prompt_len).tolist() for _ in range(num_system_prompts)]
    starts = np.cumsum(rng.exponential(1.0 / rate, num_conversations))
    drafts: list[tuple[float, Request]] = []
    for conversation in range(num_conversations):
        group = int(rng.integers(0, num_system_prompts))
        history: list[int] = list(systems[group])
        for turn in range(num_turns):
            user_len, reply_len = (
                max(1, round(float(rng.lognormal(np.log(mean) - SIGMA**2 / 2, SIGMA))))
                for mean in (USER_LEN, REPLY_LEN)
            )
            history += rng.integers(0, VOCAB_SIZE, user_len).tolist()
            if len(history) + reply_len > max_model_len:
                break
            arrival_s = float(starts[conversation]) + turn * think_s
            request = Request(
                request_id=0,
                prompt_len=len(history),
                output_len=reply_len,
                prefix_group=f"system-{group}",
                prefix_len=system_prompt_len,
                arrival_s=arrival_s,
                prompt=tuple(history),
            )
            drafts.append((arrival_s, request))
            history += rng.integers(0, VOCAB_SIZE, reply_len).tolist()
    drafts.sort(key=lambda draft: draft[0])
    requests = tuple(
        Request(
            request_id=rank,
            prompt_len=r.prompt_len,
            output_len=r.output_len,
            prefix_group=r.prefix_group,
            prefix_len=r.prefix_len,
            arrival_s=r.arrival_s,
            prompt=r.prompt,
        )
        for rank, (_, r) in enumerate(drafts)
    )
    source = (
        f"chat x {num_conversations} conversations of up to {num_turns} turns, {num_system_prompts} "
        f"system prompts of {system_prompt_len} tokens, {rate:g} conversations/s"
    )
    return Workload(requests, seed=seed, source=source, max_model_len=max_model_len)
