"""One operation at a time: attention, linear products, LoRA, quantized linears, the token choice."""
