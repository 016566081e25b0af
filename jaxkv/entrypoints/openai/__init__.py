"""An OpenAI-compatible HTTP server over ``AsyncLLM`` (``jaxkv serve MODEL``), shaped like vLLM's
``vllm.entrypoints.openai``: ``api_server`` (the FastAPI app and the process), ``protocol``
(the request models), ``serving_*`` (one file per endpoint family), ``metrics`` (Prometheus).
"""
