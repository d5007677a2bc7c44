"""The shard: model weights, the paged KV cache, the forward pass and sampling (README.md, Architecture)."""
