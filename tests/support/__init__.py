"""Helpers the test modules share: one home for each, imported as ``support.<module>``.

``tests/`` is on ``sys.path`` while pytest runs (rootdir conftest, the default
``prepend`` import mode: ``tests/`` has no ``__init__.py``), so test modules
import these as ``from support.managers import make_manager``.

* :mod:`support.managers`: one pool shape (``POOL_SHAPE``), one ``make_manager``, ``settle``,
  ``ceil_div`` and the "nothing changed" state of a manager;
* :mod:`support.arrays`: the good and bad token arrays ``write`` and ``attend`` get;
* :mod:`support.pools`: a pool two tables fill in turn (`interleaved`);
* :mod:`support.windows`: which earlier tokens a token sees (the oracle's rule);
* :mod:`support.prefix`: k/v that are a function of the whole prefix, and a
  runner that feeds sequences through a prefix-caching manager.
"""
