"""Shared test helpers: Redis servers, fake workers and upstreams, stacks, configs, clients."""
