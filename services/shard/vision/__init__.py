"""A vision-language model's image side on the shard: loading the model (loader), its vision tower and projector
(encoder), and the encoder outputs kept while a prompt's prefill needs them, merged at the placeholders (cache)."""
