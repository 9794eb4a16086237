"""Test kit for KV caches: the naive oracle, Hypothesis strategies and a state machine.

Run pagedkv's stateful property tests on any cache with the seed's
``attend(q, k, v)``; see ``docs/testing.md``. The oracle and the contract
check need nothing but Python; the strategies and the state machine need
Hypothesis (``pip install "pagedkv[test]"``) and are imported on first use.

* :mod:`~pagedkv.testing.oracle`: the naive oracle (plain lists, ``math.exp``);
* :mod:`~pagedkv.testing.contract`: :class:`CheckedCache`, the seed contract as a check;
* :mod:`~pagedkv.testing.strategies`: shapes, window sizes and tokens;
* :mod:`~pagedkv.testing.machine`: :class:`CacheMachine`, :func:`make_cache_machine`;
* :mod:`~pagedkv.testing.stateful`: :func:`run_cache_machine`, :func:`check_cache`;
* :mod:`~pagedkv.testing.verdict`: :class:`Verdict`, what a run found;
* :mod:`~pagedkv.testing.program`: failing runs as runnable programs;
* :mod:`~pagedkv.testing.factory_code`: the source that imports a factory in a program;
* :mod:`~pagedkv.testing.shrink`: the program shrinker;
* :mod:`~pagedkv.testing.buggy`: caches with planted bugs, the kit's own fixtures;
* :mod:`~pagedkv.testing.check`: the ``pagedkv check`` command.

>>> from pagedkv.testing import check_cache
>>> from pagedkv.testing.buggy import EvictsAfterScoring
>>> check_cache(EvictsAfterScoring, max_examples=50, seed=0).passed
False
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pagedkv.testing.contract import CheckedCache, ContractError, error_bounds
from pagedkv.testing.oracle import OracleCache, attend, tolerance, within_tolerance

if TYPE_CHECKING:
    from pagedkv.testing.machine import CacheMachine
    from pagedkv.testing.stateful import check_cache, make_cache_machine, run_cache_machine
    from pagedkv.testing.strategies import Config, Shape
    from pagedkv.testing.verdict import Verdict

__all__ = [
    "CacheMachine",
    "CheckedCache",
    "Config",
    "ContractError",
    "OracleCache",
    "Shape",
    "Verdict",
    "attend",
    "check_cache",
    "error_bounds",
    "make_cache_machine",
    "run_cache_machine",
    "tolerance",
    "within_tolerance",
]

# Names from modules that need Hypothesis: imported on first use, so the oracle
# works without it and a missing Hypothesis says which extra to install.
# (verdict needs no Hypothesis, but a Verdict only ever comes from a run.)
_LAZY = {
    "CacheMachine": "machine",
    "make_cache_machine": "stateful",
    "check_cache": "stateful",
    "run_cache_machine": "stateful",
    "Config": "strategies",
    "Shape": "strategies",
    "Verdict": "verdict",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedkv.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pagedkv.testing.{module}"), name)
