"""Assertions for test suites that compare an engine's tensors with a qwencuda trace."""
from __future__ import annotations


def assert_matches(actual, name, trace, rtol=1e-3, atol=1e-4):
    """Fail with qwencuda's compare report (first divergence, error table) unless `actual`
    matches `trace[name]`. Lives in qwencuda.compare; re-exported here for test suites."""
    from ..debug.compare import assert_matches as _assert_matches

    return _assert_matches(actual, name, trace, rtol=rtol, atol=atol)
