"""Running a model: KV cache, batches and u-batches, sampling, generation."""
