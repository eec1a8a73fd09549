"""The inference engine: LLM, sampling, KV cache, graphs."""
