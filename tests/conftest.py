"""Hypothesis profiles for the whole suite.

* ``quick`` (the default): what plain ``pytest`` runs. The whole suite must
  finish in under two minutes on a 2-core machine, so examples are few.
* ``ci``: chosen with ``PAGEDKV_HYPOTHESIS_PROFILE=ci``; eight times the
  examples and longer state-machine runs, still a few minutes.

Both use ``deadline=None``: the machines this runs on are shared and noisy, and
no test in this suite asserts anything about time.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "quick",
    max_examples=25,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "ci",
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
# An unknown name raises InvalidArgument here, so a typo in CI cannot quietly
# fall back to the quick profile.
settings.load_profile(os.environ.get("PAGEDKV_HYPOTHESIS_PROFILE", "quick"))
