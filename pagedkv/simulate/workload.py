"""Request streams for the serving simulator: requests, workloads, arrivals, and the JSONL file format.

Owns :class:`Request`, :class:`Workload`, :class:`Arrivals` and the JSONL format
(:func:`parse_jsonl`, :func:`load_jsonl`); synthetic streams live in
:mod:`pagedkv.simulate.synthetic`. Counterpart: the dataset loaders of vLLM's
``benchmark_serving``. The JSONL schema and an example: docs/simulate.md, "Workloads and the JSONL format".
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.errors import PagedKVError

__all__ = [
    "Arrivals",
    "Request",
    "Workload",
    "WorkloadError",
    "load_jsonl",
    "parse_jsonl",
]

#: Token ids are drawn from ``range(VOCAB_SIZE)`` (LLaMA's vocabulary size).
VOCAB_SIZE = 32000

SAMPLING_KINDS = ("parallel", "beam")


class WorkloadError(PagedKVError, ValueError):
    """A workload is malformed: a bad JSONL line, field or synthetic parameter."""


@dataclass(frozen=True, slots=True)
class Request:
    """One request: a prompt, the tokens generated for it, and its samples.

    Attributes:
        request_id: position in the workload, from 0.
        prompt_len: prompt tokens (the shared prefix included).
        output_len: tokens generated per sample; the request's sequences end
            at ``prompt_len + output_len`` tokens.
        n: samples: ``n`` sequences fork from the prompt after prefill.
        sampling: ``"parallel"`` (independent samples) or ``"beam"`` (beams
            are pruned and re-forked from surviving beams as they decode).
        prefix_group: requests of one group start with the same
            ``prefix_len`` tokens (a system prompt).
        prefix_len: tokens of the prompt shared with the group.
        max_output_len: the output a contiguous system must reserve room for.
        arrival_step: the simulated step the request arrives at.
        arrival_s: the model second it arrives at (a Poisson stream of a
            request rate), or None to arrive by ``arrival_step`` alone.
        prompt: explicit prompt token ids, or None to draw them from the seed.
    """

    request_id: int
    prompt_len: int
    output_len: int
    n: int = 1
    sampling: str = "parallel"
    prefix_group: str | None = None
    prefix_len: int = 0
    max_output_len: int | None = None
    arrival_step: int = 0
    arrival_s: float | None = None
    prompt: tuple[int, ...] | None = field(default=None, repr=False)

    @property
    def num_sequences(self) -> int:
        """Sequences the request runs at once (its samples or beams)."""
        return self.n


@dataclass(frozen=True)
class Workload:
    """Requests in arrival order, and the seed their token ids derive from.

    Attributes:
        requests: the requests, sorted by ``arrival_step`` (stable).
        seed: seeds every drawn token id.
        source: a short description (``"sharegpt x 1000"``, a file name).
        max_model_len: the longest sequence the modeled model accepts; a
            contiguous system reserves up to it by default.
    """

    requests: tuple[Request, ...]
    seed: int = 0
    source: str = "custom"
    max_model_len: int = 2048

    def max_output_len(self, request: Request) -> int:
        """What a contiguous system reserves for ``request``'s output."""
        if request.max_output_len is not None:
            return request.max_output_len
        return max(request.output_len, self.max_model_len - request.prompt_len)

    def prompt_tokens(self, request: Request) -> list[int]:
        """``request``'s prompt token ids: explicit, or drawn from the seed.

        The first ``prefix_len`` ids are the prefix group's (the same for
        every request of the group); the rest are the request's own.
        """
        if request.prompt is not None:
            return list(request.prompt)
        rng = np.random.default_rng([self.seed, 1, request.request_id])
        own: list[int] = rng.integers(0, VOCAB_SIZE, request.prompt_len - request.prefix_len).tolist()
        if not request.prefix_len or request.prefix_group is None:
            return own
        group = zlib.crc32(request.prefix_group.encode("utf-8"))
        shared: list[int] = (
            np.random.default_rng([self.seed, 2, group]).integers(0, VOCAB_SIZE, request.prefix_len).tolist()
        )
        return shared + own

    def stats(self) -> dict[str, float | int | str]:
        """Counts and mean lengths, for reports."""
        requests = self.requests
        num = len(requests)
        return {
            "source": self.source,
            "seed": self.seed,
            "num_requests": num,
            "num_sequences": sum(r.n for r in requests),
            "mean_prompt_len": round(sum(r.prompt_len for r in requests) / num, 2) if num else 0.0,
            "mean_output_len": round(sum(r.output_len for r in requests) / num, 2) if num else 0.0,
            "max_seq_len": max((r.prompt_len + r.output_len for r in requests), default=0),
            "max_model_len": self.max_model_len,
        }


class Arrivals:
    """A workload's requests, handed out as their arrival steps come: the one arrival rule of every policy.

    Args:
        workload: the requests, sorted by ``arrival_step``.

    Attributes:
        num_pending: requests not handed out yet.

    >>> arrivals = Arrivals(Workload((Request(0, 4, 2), Request(1, 4, 2, arrival_step=3))))
    >>> [r.request_id for r in arrivals.pop_arrived(2)], arrivals.num_pending
    ([0], 1)
    """

    def __init__(self, workload: Workload) -> None:
        self._requests = workload.requests
        self._next = 0
        self.num_pending = len(self._requests)

    def pop_arrived(self, step: int, now_s: float = math.inf) -> tuple[Request, ...]:
        """The requests arrived by ``step`` (and by model second ``now_s``) not handed out yet, in order."""
        requests = self._requests
        first = index = self._next
        while index < len(requests) and requests[index].arrival_step <= step:
            arrival_s = requests[index].arrival_s
            if arrival_s is not None and arrival_s > now_s:
                break
            index += 1
        self._next = index
        self.num_pending -= index - first
        return requests[first:index]

    def next_arrival_s(self) -> float | None:
        """The model second the next pending request arrives at (None: none, or it arrives by step)."""
        if self._next == len(self._requests):
            return None
        return self._requests[self._next].arrival_s


_FIELDS = (
    "prompt_len",
    "output_len",
    "prompt",
    "n",
    "sampling",
    "prefix_group",
    "prefix_len",
    "max_output_len",
    "arrival_step",
    "arrival_s",
)


def _int_field(
    record: dict[str, Any], name: str, where: str, minimum: int, default: int | None
) -> int | None:
    if name not in record:
        if default is None:
            return None
        return default
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise WorkloadError(f"{where}: field {name!r} must be an int >= {minimum}, got {value!r}")
    return value


def _seconds_field(record: dict[str, Any], name: str, where: str) -> float | None:
    value = record.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise WorkloadError(f"{where}: field {name!r} must be a number of seconds >= 0, got {value!r}")
    return float(value)


def parse_jsonl(
    lines: Iterable[str], *, source: str = "<jsonl>", seed: int = 0, max_model_len: int = 2048
) -> Workload:
    """Parse JSONL request lines (schema in the module docstring) into a workload.

    Args:
        lines: the file's lines.
        source: the name quoted in error messages.
        seed: seeds the token ids of requests without an explicit ``prompt``.
        max_model_len: the modeled model's longest sequence.

    Raises:
        WorkloadError: naming the line number and the field of the first bad line.

    >>> parse_jsonl(['{"prompt_len": 4, "output_len": 2}']).requests[0].prompt_len
    4
    >>> parse_jsonl(['{"prompt_len": 4}'], source="reqs.jsonl")
    Traceback (most recent call last):
        ...
    pagedkv.simulate.workload.WorkloadError: reqs.jsonl line 1: field 'output_len' is required
    """
    records: list[tuple[str, dict[str, Any]]] = []
    for number, line in enumerate(lines, start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        where = f"{source} line {number}"
        try:
            record = json.loads(text)
        except json.JSONDecodeError as error:
            raise WorkloadError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
        if not isinstance(record, dict):
            raise WorkloadError(f"{where}: expected a JSON object, got {type(record).__name__}")
        unknown = sorted(set(record) - set(_FIELDS))
        if unknown:
            raise WorkloadError(f"{where}: unknown field {unknown[0]!r}; known fields: {', '.join(_FIELDS)}")
        records.append((where, record))
    if not records:
        raise WorkloadError(f"{source}: no requests (every line is blank or a comment)")
    partial = []
    group_min: dict[str, int] = {}
    for where, record in records:
        prompt = record.get("prompt")
        if prompt is not None and (
            not isinstance(prompt, list)
            or not prompt
            or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in prompt)
        ):
            raise WorkloadError(f"{where}: field 'prompt' must be a non-empty list of non-negative ints")
        prompt_len = _int_field(record, "prompt_len", where, 1, None)
        if prompt_len is None:
            if prompt is None:
                raise WorkloadError(f"{where}: field 'prompt_len' is required (or give 'prompt')")
            prompt_len = len(prompt)
        elif prompt is not None and len(prompt) != prompt_len:
            raise WorkloadError(
                f"{where}: field 'prompt_len' is {prompt_len} but 'prompt' has {len(prompt)} token ids"
            )
        if "output_len" not in record:
            raise WorkloadError(f"{where}: field 'output_len' is required")
        output_len = _int_field(record, "output_len", where, 1, 1)
        assert output_len is not None
        sampling = record.get("sampling", "parallel")
        if sampling not in SAMPLING_KINDS:
            raise WorkloadError(
                f"{where}: field 'sampling' must be one of {SAMPLING_KINDS}, got {sampling!r}"
            )
        group = record.get("prefix_group")
        if group is not None:
            if isinstance(group, bool) or not isinstance(group, (str, int)):
                raise WorkloadError(
                    f"{where}: field 'prefix_group' must be a string or an int, got {group!r}"
                )
            group = str(group)
            group_min[group] = min(group_min.get(group, prompt_len), prompt_len)
        elif "prefix_len" in record:
            raise WorkloadError(f"{where}: field 'prefix_len' needs a 'prefix_group'")
        prefix_len = _int_field(record, "prefix_len", where, 0, None)
        if prefix_len is not None and prefix_len > prompt_len:
            raise WorkloadError(
                f"{where}: field 'prefix_len' is {prefix_len}, longer than the prompt ({prompt_len})"
            )
        max_output_len = _int_field(record, "max_output_len", where, 1, None)
        if max_output_len is not None and max_output_len < output_len:
            raise WorkloadError(
                f"{where}: field 'max_output_len' is {max_output_len}, less than 'output_len' ({output_len})"
            )
        partial.append(
            {
                "prompt_len": prompt_len,
                "output_len": output_len,
                "n": _int_field(record, "n", where, 1, 1),
                "sampling": sampling,
                "prefix_group": group,
                "prefix_len": prefix_len,
                "max_output_len": max_output_len,
                "arrival_step": _int_field(record, "arrival_step", where, 0, 0),
                "arrival_s": _seconds_field(record, "arrival_s", where),
                "prompt": tuple(prompt) if prompt is not None else None,
            }
        )
    for fields in partial:
        group = fields["prefix_group"]
        if group is not None and fields["prefix_len"] is None:
            fields["prefix_len"] = group_min[group]
        elif fields["prefix_len"] is None:
            fields["prefix_len"] = 0
    order = sorted(
        range(len(partial)), key=lambda i: (partial[i]["arrival_step"], partial[i]["arrival_s"] or 0.0)
    )
    requests = tuple(Request(request_id=rank, **partial[i]) for rank, i in enumerate(order))
    return Workload(requests, seed=seed, source=source, max_model_len=max_model_len)


def load_jsonl(path: str | Path, *, seed: int = 0, max_model_len: int = 2048) -> Workload:
    """Read a JSONL request file (schema in the module docstring).

    Raises:
        WorkloadError: the file is missing or a line is malformed (line number and field named).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise WorkloadError(f"cannot read workload file {str(path)!r}: {error.strerror}") from None
    return parse_jsonl(text.splitlines(), source=path.name, seed=seed, max_model_len=max_model_len)
