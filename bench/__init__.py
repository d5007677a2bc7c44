"""Benchmarks: the in-process engine's limit, the serving loads, the peers, the kernels (public APIs only)."""
