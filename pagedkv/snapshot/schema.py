"""The JSON form of a snapshot's state: a typed reader, the encoders, and the checks loads share.

The state is one JSON object (block ids plain ints, bytes as hex): its ``kind``
(``"KVCacheManager"``, ``"HybridKVCacheManager"`` or ``"KVCache"``), the object's own state
(a hybrid manager's: its layout and one manager state per group), and its
``pools`` (each one's configuration, saved block ids and allocator state); the full layout is
drawn in "The state" in docs/snapshots.md. Every check here raises
:class:`~pagedkv.errors.SnapshotError` naming the field's path
(``state.manager.sequences[2].table.num_tokens``).
"""

from __future__ import annotations

import math
import reprlib
import sys
from collections.abc import Callable, Hashable
from typing import Any, NoReturn

from pagedkv.blocks.allocator import AllocatorState
from pagedkv.blocks.table import TableState
from pagedkv.errors import SnapshotError
from pagedkv.manager.sequence import SequenceState
from pagedkv.memory.quantization import STORAGE_DTYPES

__all__ = [
    "DTYPES",
    "STORAGE",
    "Reader",
    "State",
    "allocator_json",
    "fail",
    "hex_bytes",
    "ints",
    "invariants",
    "is_int",
    "pair",
    "role_of",
    "seq_id_json",
    "shown",
    "table_json",
]

State = dict[str, Any]

#: Compute dtypes a snapshot may name.
DTYPES = ("float32", "float64")
#: Storage dtypes a snapshot may name (None: floats in the compute dtype).
STORAGE: tuple[str | None, ...] = (None, *STORAGE_DTYPES)


# NOTE: every value a message quotes comes from the file. A plain repr of a
# list nested a few hundred deep (json.loads accepts up to the recursion
# limit) would itself raise RecursionError; reprlib stops at maxlevel.
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxdict = 2, 4, 4
_SHOWN.maxstring, _SHOWN.maxlong, _SHOWN.maxother = 40, 40, 40


def shown(value: object) -> str:
    """A short repr of an untrusted value, bounded in length and in depth.

    >>> shown([[[[1]]], 2, 3, 4, 5, 6])
    '[[[...]], 2, 3, 4, ...]'
    """
    return _SHOWN.repr(value)


def fail(message: str) -> NoReturn:
    """Raise :class:`~pagedkv.errors.SnapshotError` with ``message``."""
    raise SnapshotError(message)


def is_int(value: object) -> bool:
    """Whether ``value`` is a JSON integer (bools are not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def ints(values: object, where: str, low: int = 0, high: int | None = None) -> list[int]:
    """``values`` as a list of ints in ``low .. high``, or fail naming ``where``."""
    if not isinstance(values, list):
        fail(f"{where} must be a list, got {type(values).__name__}")
    for value in values:
        if not is_int(value) or value < low or (high is not None and value > high):
            fail(f"{where} holds {shown(value)}; expected ints in {low}..{'' if high is None else high}")
    return values


def pair(value: object, where: str, what: str) -> tuple[int, int]:
    """``value`` as a pair of ints >= 0, or fail naming ``where`` and ``what`` the pairs mean."""
    if not (isinstance(value, list) and len(value) == 2):
        fail(f"{where} holds {shown(value)}; expected {what} pairs")
    first, second = ints(value, where)
    return first, second


def hex_bytes(value: object, where: str, size: int | None = None) -> bytes:
    """The bytes a hex string spells (of ``size`` bytes when given), or fail naming ``where``."""
    if not isinstance(value, str):
        fail(f"{where} holds {shown(value)}, not a hex string")
    try:
        data = bytes.fromhex(value)
    except ValueError:
        fail(f"{where} holds {shown(value)}, not hex")
    if size is not None and len(data) != size:
        fail(f"{where} holds a {len(data)}-byte key; the hash makes {size}-byte keys")
    return data


def role_of(state: SequenceState) -> str:
    """The pool a sequence's blocks are in: ``"host"`` when it is swapped, else ``"device"``."""
    return "host" if state is SequenceState.SWAPPED else "device"


def invariants(check: Callable[[], None], what: str) -> None:
    """Run a ``check_invariants`` and turn its ``AssertionError`` into a ``SnapshotError``."""
    try:
        check()
    except AssertionError as error:
        fail(f"the snapshot's {what} is inconsistent: {error}")


class Reader:
    """Typed access to one JSON object of the state; a bad field fails naming its path."""

    def __init__(self, value: object, where: str) -> None:
        if not isinstance(value, dict):
            fail(f"{where} must be a JSON object, got {type(value).__name__}")
        self.value: dict[str, Any] = value
        self.where = where

    def _field(self, name: str) -> Any:
        if name not in self.value:
            fail(f"{self.where}.{name} is missing")
        return self.value[name]

    def get(self, name: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
        """Field ``name``, of type ``kind`` (None too when ``optional``)."""
        value = self._field(name)
        if value is None and optional:
            return None
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            fail(f"{self.where}.{name} = {shown(value)} has the wrong type")
        return value

    def integer(self, name: str, low: int = 0, *, optional: bool = False) -> Any:
        """Field ``name``, an int >= ``low`` (or None when ``optional``)."""
        value = self.get(name, int, optional=optional)
        if value is not None and value < low:
            fail(f"{self.where}.{name} = {value} is below {low}")
        return value

    def number(self, name: str, *, non_negative: bool = True) -> float:
        """Field ``name``, a finite number (>= 0 unless told otherwise)."""
        value = float(self.get(name, (int, float)))
        if not math.isfinite(value) or (non_negative and value < 0):
            fail(f"{self.where}.{name} = {value!r} must be finite" + (" and >= 0" if non_negative else ""))
        return value

    def choice(self, name: str, choices: tuple[Any, ...]) -> Any:
        """Field ``name``, one of ``choices``."""
        value = self._field(name)
        if isinstance(value, bool) or value not in choices:
            fail(f"{self.where}.{name} = {shown(value)}; expected one of {choices}")
        return value

    def ints(self, name: str, low: int = 0, high: int | None = None) -> list[int]:
        """Field ``name``, a list of ints in ``low .. high``."""
        return ints(self.get(name, list), f"{self.where}.{name}", low, high)

    def child(self, name: str) -> Reader:
        """Field ``name``, a JSON object, as a reader of its own."""
        return Reader(self.get(name, dict), f"{self.where}.{name}")

    def hex(self, name: str, size: int | None = None) -> bytes:
        """Field ``name``, a hex string, as bytes."""
        return hex_bytes(self.get(name, str), f"{self.where}.{name}", size)


# ------------------------------------------------------------------ encoders


def table_json(table: TableState) -> State:
    """A block table's state as JSON."""
    return {"num_tokens": table.num_tokens, "window_start": table.window_start,
            "first_block": table.first_block, "sink_ids": list(table.sink_ids),
            "window_ids": list(table.window_ids)}


def allocator_json(allocator: AllocatorState) -> State:
    """An allocator's state as JSON: used ids with ref counts, the plain free queue as runs."""
    runs: list[list[int]] = []  # the plain free queue, in order, as [first_id, length] runs
    for block_id in allocator.free:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1][1] += 1
        else:
            runs.append([block_id, 1])
    return {
        "used": [[block_id, n] for block_id, n in enumerate(allocator.ref_counts) if n],
        "free_runs": runs,
        "cached_free": list(allocator.cached_free),
        "cached": sorted(allocator.cached),
    }


def seq_id_json(seq_id: Hashable) -> list[Any]:
    """A sequence id as JSON, tagged so an int and its digits stay apart: ``["s", "7"]``, ``["i", 7]``."""
    if isinstance(seq_id, str):
        return ["s", seq_id]
    if isinstance(seq_id, int) and not isinstance(seq_id, bool):  # is_int, spelled out for mypy
        _check_int_digits(seq_id)
        return ["i", seq_id]
    fail(f"sequence id {seq_id!r} is a {type(seq_id).__name__}; only str and int ids can be saved")


def _check_int_digits(seq_id: int) -> None:
    """Fail if JSON cannot write ``seq_id``'s decimal digits (Python's int-to-str digit limit).

    Its ``repr`` fails the same way, so the message shows it in hex, which has no limit.
    """
    try:
        str(seq_id)
    except ValueError:
        digits = format(abs(seq_id), "x")
        fail(
            f"sequence id {'-' if seq_id < 0 else ''}0x{digits[:16]}... ({seq_id.bit_length()} bits) "
            f"has more than {sys.get_int_max_str_digits()} decimal digits, more than JSON may write; "
            "only ids of fewer digits (or str ids) can be saved"
        )
