"""Test kit for KV caches: the naive oracle, Hypothesis strategies and a state machine."""
