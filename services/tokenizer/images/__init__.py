"""Images for a vision-language model, on the tokenizer: where they are in a prompt (markdown), getting their bytes
(fetch: data URIs and http(s) URLs, with limits), decoding them (decode) and the model's own processor turning them
into pixel values and placeholder tokens (processor)."""
