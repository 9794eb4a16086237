"""Test kit for KV caches: the naive oracle, Hypothesis strategies and a state machine.

Runs pagedkv's stateful property tests on any cache with the seed's ``attend(q, k, v)``, the
way zarr ships ``zarr.testing.stateful`` for other stores. The oracle and the contract check
need nothing but Python; the strategies and the state machine need Hypothesis
(``pip install "pagedkv[test]"``) and are imported on first use. Start at
:func:`check_cache`; the modules, one concept each (oracle, contract, strategies, machine,
stateful, verdict, program, factory_code, shrink, buggy, check), are mapped in
docs/testing.md ("Where the code is").
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
