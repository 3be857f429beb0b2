"""fastio benchmarks: ``python -m bench [--quick]``.

Suites: ``codec`` (serialization), ``transport`` (request fabric), ``weights`` (weight
updates). Each reports fastio next to baselines measured in the same run.
"""
