"""The parts of :mod:`pagedkv.integrations.transformers`; import that module, not these.

* ``spec.py``: what pagedkv needs to know about a model, read from its config;
  what it refuses.
* ``rows.py``: batch rows mapped to a manager's sequences (beams, crop, reset).
* ``tensors.py``: transformers' ``(batch, heads, seq, head_dim)`` to pagedkv's
  ``(tokens, heads, head_dim)`` and back.
* ``extra.py``: loading torch and transformers when used (the ``hf`` extra).
* ``layers.py``: each storing layer as transformers' per-layer API sees it.
* ``cache.py``: :class:`PagedCache`, the transformers ``Cache``.
* ``attention.py``: pagedkv registered as a transformers attention implementation.
* ``models.py``: the ``models`` extra's real GGUF models, loaded; KV bytes of a cache.
"""
