"""Beyond one engine: transfer of KV pages between engines (prefill/decode disaggregation)."""
