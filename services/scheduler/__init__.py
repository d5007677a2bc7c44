"""Scheduler: continuous batching over a paged KV cache, one per model replica."""
