"""Device side: KV buffers, block tables, the jitted step, the sampler."""
