"""The shard: model weights, the paged KV cache, the forward pass and sampling (README.md, Architecture)."""

import os

# oneDNN keeps a compiled primitive per (weight shape, row count) it has seen, up to 1,024 by default: with the row
# count changing every step (decode batch sizes, prefill chunks) the cache fills over minutes and holds ~110 MiB
# (measured: the 3-minute soak's shard grew 85-124 MiB after warm-up with it, 12 MiB with 16 entries). 256 keeps
# the steady shapes of a running batch and bounds the rest. Set before torch loads oneDNN; an explicit setting wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256")
