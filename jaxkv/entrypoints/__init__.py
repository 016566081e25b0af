"""What users call: ``LLM`` (offline batches) and the ``jaxkv`` command line."""
