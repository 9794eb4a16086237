"""The parts of :mod:`pagedkv.integrations.transformers`; import that module, not these.

``spec`` reads a model's config; ``rows`` maps batch rows to sequences; ``tensors``
converts shapes; ``extra`` loads torch and transformers; ``layers`` is the per-layer
view; ``cache`` is :class:`PagedCache`; ``attention`` registers pagedkv as an
attention implementation; ``models`` loads the ``models`` extra's real models.
docs/integrations.md ("How the integration is built") walks through them.
"""
