"""pagedkv: a paged key/value cache for transformer attention, in numpy.

Fixed-size blocks come from one shared pool, a block table per sequence maps
token positions to blocks, and ``KVCache.attend`` gathers across them, never
changing an output, only the work it costs.

>>> import pagedkv
>>> pagedkv.KVCache().attend([1.0], [1.0], [42.0])
[42.0]
"""

from pagedkv.blocks.allocator import BlockAllocator
from pagedkv.blocks.table import BlockTable
from pagedkv.cache import KVCache
from pagedkv.errors import (
    BlockStateError,
    BlockTableError,
    ClosedCacheError,
    ConfigError,
    DoubleFreeError,
    DuplicateSequenceError,
    InputTypeError,
    LayerIndexError,
    NonFiniteError,
    PagedKVError,
    PoolExhaustedError,
    PoolTooLargeError,
    ReadOnlyArrayError,
    SequenceStateError,
    ShapeError,
    SnapshotError,
    SnapshotIOError,
    UnknownBlockError,
    UnknownSequenceError,
)
from pagedkv.manager.groups import GroupLayout
from pagedkv.manager.hybrid import HybridKVCacheManager
from pagedkv.manager.manager import KVCacheManager, SequenceState
from pagedkv.manager.metrics import ManagerMetrics
from pagedkv.manager.reserve import Batch, ReservationPlan
from pagedkv.memory.pool import KVPool

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "BlockAllocator",
    "BlockStateError",
    "BlockTable",
    "BlockTableError",
    "ClosedCacheError",
    "ConfigError",
    "DoubleFreeError",
    "DuplicateSequenceError",
    "GroupLayout",
    "HybridKVCacheManager",
    "InputTypeError",
    "KVCache",
    "KVCacheManager",
    "KVPool",
    "LayerIndexError",
    "ManagerMetrics",
    "NonFiniteError",
    "PagedKVError",
    "PoolExhaustedError",
    "PoolTooLargeError",
    "ReadOnlyArrayError",
    "ReservationPlan",
    "SequenceState",
    "SequenceStateError",
    "ShapeError",
    "SnapshotError",
    "SnapshotIOError",
    "UnknownBlockError",
    "UnknownSequenceError",
    "__version__",
]
