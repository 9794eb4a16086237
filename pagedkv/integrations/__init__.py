"""Bridges from pagedkv to other libraries; each lives behind its own extra.

* :mod:`pagedkv.integrations.transformers` (the ``hf`` extra: torch and
  transformers): a transformers ``Cache`` on a pagedkv pool, and pagedkv as a
  transformers attention implementation.

Importing this package imports nothing optional.
"""
