"""The errors pagedkv raises.

Every error derives from :class:`PagedKVError` *and* from the builtin that fits
it best, so callers may catch either ``pagedkv.PoolExhaustedError`` or plain
``MemoryError``. Every operation that raises leaves the cache, the pool and
every sequence exactly as they were before the call.

>>> from pagedkv.errors import PoolExhaustedError
>>> issubclass(PoolExhaustedError, MemoryError)
True
"""

from __future__ import annotations

from typing import NoReturn

__all__ = [
    "BlockStateError",
    "BlockTableError",
    "ClosedCacheError",
    "ConfigError",
    "DoubleFreeError",
    "DuplicateSequenceError",
    "InputTypeError",
    "LayerIndexError",
    "NonFiniteError",
    "PagedKVError",
    "PoolExhaustedError",
    "PoolTooLargeError",
    "ReadOnlyArrayError",
    "SequenceStateError",
    "ShapeError",
    "SnapshotError",
    "SnapshotIOError",
    "UnknownBlockError",
    "UnknownSequenceError",
]


class PagedKVError(Exception):
    """Base class of every error pagedkv raises on purpose."""


class ConfigError(PagedKVError, ValueError):
    """A configuration value (``max_size``, ``block_size``, a pool size...) is invalid."""


class InputTypeError(PagedKVError, TypeError):
    """An argument has the wrong type: a string, ``None``, a complex number, a bool..."""


class ShapeError(PagedKVError, ValueError):
    """An array has the wrong number of dimensions or a size that does not fit."""


class NonFiniteError(PagedKVError, ValueError):
    """An input holds NaN or infinity, or is so large that attention scores would overflow."""


class PoolExhaustedError(PagedKVError, MemoryError):
    """The pool has fewer free blocks than an operation needs.

    Attributes:
        num_needed: blocks the operation needed.
        num_free: blocks that were free.
        num_total: blocks in the pool.
    """

    def __init__(self, num_needed: int, num_free: int, num_total: int, hint: str = "") -> None:
        self.num_needed = num_needed
        self.num_free = num_free
        self.num_total = num_total
        hint = hint or "free or close a sequence, or give the pool more blocks"
        super().__init__(
            f"need {num_needed} block{'s' if num_needed != 1 else ''}, "
            f"{num_free} free of {num_total}; {hint}"
        )


class BlockStateError(PagedKVError, RuntimeError):
    """A block is in the wrong state for the operation: sharing a free block, reviving an uncached one."""


class PoolTooLargeError(PagedKVError, MemoryError):
    """A pool (or a growth of one) is too large to allocate; the message says how many bytes it wanted.

    Attributes:
        num_bytes: the bytes the pool's arrays and bookkeeping would take.
    """

    def __init__(self, message: str, num_bytes: int) -> None:
        self.num_bytes = num_bytes
        super().__init__(message)


class DoubleFreeError(BlockStateError):
    """A block was freed while its reference count was already zero."""


class UnknownBlockError(PagedKVError, LookupError):
    """A block id is not an id of this pool."""


class BlockTableError(PagedKVError, ValueError):
    """A block table was asked for something its tokens cannot give (a wrong number of new blocks,
    truncating into evicted tokens)."""


class LayerIndexError(PagedKVError, IndexError):
    """A layer index is outside ``0 .. num_layers - 1``."""


class ClosedCacheError(PagedKVError, RuntimeError):
    """An operation was attempted on a cache that has been closed."""


class UnknownSequenceError(PagedKVError, LookupError):
    """A sequence id is not (or no longer) known to the manager."""


class DuplicateSequenceError(PagedKVError, ValueError):
    """A sequence id is already in use."""


class SequenceStateError(PagedKVError, RuntimeError):
    """A sequence is in the wrong state for the operation (preempted, empty, unreserved...)."""


class ReadOnlyArrayError(PagedKVError, ValueError):
    """A read-only array pagedkv hands out (a ``Batch``'s ``slot_mapping`` or ``query_start``) was edited."""


class SnapshotError(PagedKVError, ValueError):
    """A snapshot file is truncated, damaged, of another version, or inconsistent; or cannot be saved."""


class SnapshotIOError(OSError, SnapshotError):
    """A snapshot cannot be written or read where its path says (a missing folder, a folder, no file).

    Also an ``OSError`` (``errno`` and ``filename`` set from the cause) and a
    ``SnapshotError``.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def refuse_pickling(obj: object) -> NoReturn:
    """What ``__reduce__`` of a pool, a cache and a manager does: pickle and copy are refused.

    Their pages may sit in shared memory and they hold locks; a snapshot is
    the way to save or move them.
    """
    raise InputTypeError(
        f"a {type(obj).__name__} cannot be pickled or copied (its pages may sit in shared memory, "
        "and it holds a lock); save a KVCache or a KVCacheManager with "
        "pagedkv.snapshot.save(obj, path) and load it with pagedkv.snapshot.load(path)"
    )
