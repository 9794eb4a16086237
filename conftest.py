"""Collection rules for the whole repository (tests/conftest.py holds the Hypothesis profiles)."""

import importlib.util

# The compiled kernels' module imports numba at its top (the ``jit`` extra, part of ``test``);
# without numba, doctest collection of the package skips it, as the kernel's own tests skip.
collect_ignore = [] if importlib.util.find_spec("numba") else ["pagedkv/kernels/compiled.py"]
