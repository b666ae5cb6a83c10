"""The controller role (``qos controller``): consumes latency samples, rewrites class rates.

The math: :mod:`.control_law` (the pure law: inputs -> next rates), :mod:`.slo_window`
(per-class SLO compliance over a sliding window), :mod:`.capacity` (the pool's capacity and
each class's served rate); the samples they read: :mod:`limiter.samples`.
The role: :mod:`.settings` (the ``[controller]`` table), :mod:`.leader` (lease + fencing),
:mod:`.consumer` (the samples consumer group), :mod:`.usage` (the law's ``used`` input),
:mod:`.term` (one leadership's state), :mod:`.loop` (one pool's loops and tick),
:mod:`.observe` (Redis time, heartbeats in; compliance hash, gauges out),
:mod:`.service` (the process), :mod:`.metrics`, :mod:`.cli`. Design: docs/controller.md.
"""
