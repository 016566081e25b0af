"""vLLM's KV-connector layer: moving a request's KV pages from a prefill engine to a decode one."""
