"""Benchmarks of the limiter (``qos bench ...``).

``qos bench admission`` measures admit+enqueue decisions/s and p50/p99 latency against a
plain ``SET`` and the ``limits`` library's moving-window limiter on the same Redis.
"""
