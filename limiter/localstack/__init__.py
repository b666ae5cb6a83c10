"""The local-stack tools: ``qos up``, a private or embedded Redis, the demo load and the
load generator, and the launcher that starts a stack of role processes.

Runtime code, the benchmarks and the tests import these from here; nothing here imports
the benchmark package.
"""
