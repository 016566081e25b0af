"""jaxkv: a JAX/Pallas port of vLLM's paged KV-cache engine."""
