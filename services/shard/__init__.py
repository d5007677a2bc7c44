"""The shard: model weights, the paged KV cache, the forward pass and sampling (README.md, Architecture)."""

import os

# oneDNN keeps a compiled primitive per (weight shape, row count) it has seen, up to 1,024 by default: with the row
# count changing every step (decode batch sizes, prefill chunks) the cache grows for minutes after warm-up, holding
# primitives of shapes that never come back (docs/attention.md). 256 keeps the steady shapes of a running batch and
# bounds the rest. Set before torch loads oneDNN; an explicit setting wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256")
