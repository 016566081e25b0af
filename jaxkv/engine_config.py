"""EngineConfig: every engine knob resolved and validated once, plus the KV-cache plan."""

from __future__ import annotations

import dataclasses
import numbers
import os

from jaxkv.core import SchedulerConfig
from jaxkv.core.stop_check import merge_eos_token_ids
from jaxkv.models.config import DTYPES
from jaxkv.models.sharding import check_device_count
from jaxkv.pooling_params import PoolerConfig
from jaxkv.worker.backends import BACKENDS
from jaxkv.worker.sampler import LOGPROBS_MODES
from jaxkv.worker.spec_decode import SpeculativeConfig

#: vLLM's ``runner`` values; "auto" takes generation and pooling requests alike.
RUNNERS = ("auto", "generate", "pooling")

#: KV budget on devices that report no memory stats (CPU) when none is given.
DEFAULT_CPU_KV_CACHE_BYTES = 512 * 2**20


def default_max_num_batched_tokens(
    max_num_seqs: int, max_model_len: int, enable_chunked_prefill: bool = True
) -> int:
    """Tokens per step when none is given: 2048 with chunked prefill, else a whole prompt of
    ``max_model_len``; at least one per running request."""
    return max(2048 if enable_chunked_prefill else max_model_len, max_num_seqs)


#: vLLM's ``distributed_executor_backend`` values jaxkv has: "uni" (the worker in process)
#: and "mp" (one worker process per JAX process of a ``jax.distributed`` job).
EXECUTOR_BACKEND_NAMES = ("uni", "mp")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Every engine knob, resolved. Picklable: it is what a worker process is started with.
    The KV-cache plan is not here: the engine core builds it from the workers' reports."""

    model_name: str
    model: str | None  # what a worker loads (a name or path); None: a model built in process
    dtype: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    cache_dtype: str
    attention_backend: str
    seed: int
    warmup: bool
    scheduler_config: SchedulerConfig
    speculative_config: SpeculativeConfig | None = None
    logprobs_mode: str = "raw_logprobs"  # vLLM's: what sampled tokens' logprobs are computed from
    tensor_parallel_size: int = 1  # devices the model and KV heads are split over
    pooler_config: PoolerConfig = PoolerConfig()  # how LLM.embed pools (vLLM's PoolerConfig)
    runner: str = "auto"  # vLLM's: "generate" / "pooling" take one kind of request
    max_logprobs: int = 20  # vLLM's: most logprobs a request may ask for (-1: vocab)
    eos_token_ids: tuple[
        int, ...
    ] = ()  # the tokenizer's EOS then the model config's; [0] is primary
    # the KV budget of each worker (Worker.determine_available_memory)
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    verbose: bool = False
    # executors (vLLM's names): "uni" in process, "mp" one process per worker over nnodes hosts
    distributed_executor_backend: str = "uni"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port (one node only)
    headless: bool = False  # this node only runs workers (node_rank > 0)
    devices_per_worker: int = (
        1  # "mp": devices of each worker process (CPU host devices; GPUs per process)
    )
    kv_transfer_config: object = None  # a KVTransferConfig: the KV connector (P/D disaggregation)
    compile_cache_dir: str | None = None  # jax's persistent compilation cache (None: left alone)
    # weight-only quantization of the linear layers and LM head: None, "int8", "fp8", "q4"
    # (jaxkv.models.quant; load_model(..., quantization=...))
    quantization: str | None = None


def _compile_cache_dir(setting) -> str | None:
    from jaxkv.compile_cache import resolve

    path = resolve(setting)
    return None if path is None else str(path)


def _positive(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_bool(name, value):
    if not isinstance(value, bool):  # "no" and 0 / 1 would be taken for their truth value
        raise TypeError(f"{name} must be a bool (True or False), got {value!r}")


def _check_optional_int(name, value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise TypeError(f"{name} must be an int or None, got {value!r}")


def _checked_model(model):
    """``model`` as ``load_model`` or the engine takes it (a path becomes its str); TypeError
    naming the argument for anything that is neither a name / path nor an NNX model."""
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if isinstance(model, str) or (
        hasattr(model, "config")
        and hasattr(model, "kv_layer_infos")
        and not isinstance(model, (bytes, numbers.Number))
    ):
        return model
    raise TypeError(
        f"model must be a model name, a path or an NNX model (with .config and "
        f".kv_layer_infos()), got {model!r}"
    )


def _check_argument_types(
    *,
    flags: dict,
    warmup,
    max_logprobs,
    seed,
    dtype,
    gpu_memory_utilization,
    num_gpu_blocks_override,
    kv_cache_memory_bytes,
    attention_backend,
    tokenizer,
    pipeline_parallel_size,
) -> None:
    """The checks of ``resolve_engine_config``'s arguments that need no model: each wrong
    type or value a TypeError / ValueError naming the argument (bool flags must be bools:
    ``"no"`` is truthy; ``warmup=1`` would compare equal to True)."""
    if not isinstance(warmup, bool):
        raise ValueError(f"warmup must be True or False, got {warmup!r}")
    for name, value in flags.items():
        _check_bool(name, value)
    if isinstance(max_logprobs, bool) or not isinstance(max_logprobs, int) or max_logprobs < -1:
        raise ValueError(
            f"max_logprobs must be an int >= 0, or -1 (the vocabulary size), got {max_logprobs!r}"
        )
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if not -(2**63) <= seed < 2**63:  # the model's random init takes a C long
        raise ValueError(f"seed must be in [-2**63, 2**63), got {seed}")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if (
        isinstance(gpu_memory_utilization, bool)
        or not isinstance(gpu_memory_utilization, numbers.Real)
        or not 0.0 < gpu_memory_utilization <= 1.0
    ):  # NaN fails the range too
        raise ValueError(
            f"gpu_memory_utilization must be a number in (0, 1], got {gpu_memory_utilization!r}"
        )
    _check_optional_int("num_gpu_blocks_override", num_gpu_blocks_override)
    _check_optional_int("kv_cache_memory_bytes", kv_cache_memory_bytes)
    if not isinstance(attention_backend, str) or attention_backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {attention_backend!r}")
    if tokenizer is not None and not (
        hasattr(tokenizer, "encode") and hasattr(tokenizer, "decode")
    ):
        raise TypeError(
            f"tokenizer must have encode() and decode() (or be None), got {tokenizer!r}"
        )
    if (
        type(pipeline_parallel_size) is not int or pipeline_parallel_size != 1
    ):  # 1: as vLLM scripts pass it
        raise ValueError(
            f"pipeline_parallel_size={pipeline_parallel_size!r}: pipeline "
            f"parallelism is not implemented (README, 'Not here (yet)')"
        )


def check_executor_args(
    backend,
    model,
    *,
    nnodes,
    node_rank,
    master_addr,
    master_port,
    headless,
    tensor_parallel_size,
    devices_per_worker: int = 1,
    engine: bool = True,
) -> None:
    """vLLM's executor and multi-node arguments: each wrong one a ValueError / TypeError
    naming it. ``engine``: the arguments build an engine (node 0); False for a headless
    node's launcher (``jaxkv generate --headless``, ``run_headless``), which builds none."""
    if backend not in EXECUTOR_BACKEND_NAMES:
        raise ValueError(
            f"distributed_executor_backend must be one of {EXECUTOR_BACKEND_NAMES}, got {backend!r}"
        )
    _positive("tensor_parallel_size", tensor_parallel_size)  # the engine's own message for it
    for name, value in (
        ("nnodes", nnodes),
        ("node_rank", node_rank),
        ("master_port", master_port),
        ("devices_per_worker", devices_per_worker),
    ):
        if type(value) is not int:
            raise TypeError(f"{name} must be an int, got {value!r}")
    _check_bool("headless", headless)
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(
            f"node_rank must be in [0, nnodes): got node_rank={node_rank}, nnodes={nnodes}"
        )
    if not 0 <= master_port < 65536:
        raise ValueError(f"master_port must be in [0, 65536), got {master_port}")
    if not isinstance(master_addr, str) or not master_addr:
        raise TypeError(f"master_addr must be a host name or address, got {master_addr!r}")
    if backend == "uni" and (nnodes > 1 or headless):
        raise ValueError(
            f"nnodes={nnodes} / headless={headless} need distributed_executor_backend='mp'"
        )
    if devices_per_worker < 1 or (backend == "uni" and devices_per_worker != 1):
        raise ValueError(
            f"devices_per_worker={devices_per_worker}: must be >= 1, and 1 unless "
            f"distributed_executor_backend='mp' (the in-process worker uses "
            f"tensor_parallel_size devices)"
        )
    if headless and node_rank == 0:
        raise ValueError(
            "headless is for the nodes that only run workers (node_rank >= 1); node 0 "
            "runs the engine: got headless=True, node_rank=0"
        )
    if node_rank > 0 and not headless:
        raise ValueError(
            f"node_rank={node_rank} runs only this node's workers, the engine runs on "
            f"node 0: pass headless=True there"
        )
    if backend == "mp":
        if engine and not isinstance(model, str):
            raise ValueError(
                "distributed_executor_backend='mp' loads the model in each worker process: "
                "pass a model name or path, not a built model"
            )
        if tensor_parallel_size % (nnodes * devices_per_worker):
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size} must divide evenly over "
                f"nnodes={nnodes} x devices_per_worker={devices_per_worker}"
            )
        if nnodes > 1 and not 0 < master_port < 65535:  # the control socket is master_port + 1
            raise ValueError(
                f"nnodes > 1 needs an explicit master_port below 65535 (every node must "
                f"agree on it; the next port is the control socket), got {master_port}"
            )
    if engine and headless:
        raise ValueError(
            "headless=True builds no engine: a headless node runs only its workers "
            "(jaxkv.executor.multiproc.run_headless, or jaxkv generate --headless)"
        )


def resolve_engine_config(
    model="tiny-llama",
    *,
    block_size: int = 16,
    kv_cache_memory_bytes: int | None = None,
    gpu_memory_utilization: float = 0.9,
    num_gpu_blocks_override: int | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int | None = None,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    scheduling_policy: str = "fcfs",
    async_scheduling: bool = False,
    kv_cache_dtype: str = "auto",
    attention_backend: str = "auto",
    dtype: str = "float32",
    seed: int = 0,
    tokenizer=None,
    warmup: bool = True,
    speculative_config=None,
    logprobs_mode: str = "raw_logprobs",
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    pooler_config=None,
    runner: str = "auto",
    max_logprobs: int = 20,
    verbose: bool = False,
    distributed_executor_backend: str = "uni",
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int = 0,
    headless: bool = False,
    devices_per_worker: int = 1,
    kv_transfer_config=None,
    compile_cache=True,
    quantization: str | None = None,
):
    """Resolves and checks every engine argument. Returns (model, model_config, tokenizer,
    EngineConfig); ``model`` is the NNX model given (the in-process worker serves it), or
    None for a name or path: then only its config and tokenizer are read here
    (``load_model_config``: no weights, nothing placed on a device) and each worker loads
    ``EngineConfig.model`` onto its mesh shard by shard (``jaxkv.worker.worker``). The
    KV-cache plan is made later by the engine core from what each worker reports
    (``jaxkv.engine.core``).

    ``warmup`` (default True) compiles every program the engine can run at start-up (a
    progress line on stderr when ``verbose``): the forward of every token bucket, the greedy
    and the general sampler of every request bucket, prompt logprobs per token bucket, the
    verifier of every position bucket with speculative decoding, and three small update
    programs (``jaxkv.worker.program_set``; ``2 F + 2 Q + V + 3`` for F token, Q request and V
    position buckets). Sampling options are data, not compiled variants, so after warm-up no
    request compiles anything (a compile after it is counted in ``get_stats().late_compiles``
    and logged). ``False`` compiles each program on first use. jax's persistent compilation
    cache (``jaxkv.compile_cache``) makes a restart with the same configuration read the
    programs back instead of compiling them.

    ``async_scheduling`` pipelines the engine one step deep (``LLMEngine.step``; vLLM's
    ``--async-scheduling``): the same tokens, outputs one ``step()`` later.

    ``speculative_config`` (vLLM's): ``{"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": n, "prompt_lookup_min": m}`` drafts up to k tokens per request and
    step by n-gram lookup over its own tokens and verifies them in the next step (see
    ``jaxkv.worker.spec_decode``); not with ``async_scheduling``. ``"disable_by_batch_size":
    B`` (vLLM's) proposes no drafts after a step of B or more requests. Steps with drafts are
    verified by the ``verify`` programs (one per bucket of scored positions).

    ``logprobs_mode`` (vLLM's): what the logprobs of sampled tokens are computed from:
    "raw_logprobs" (default: the model's distribution), "raw_logits", "processed_logprobs" /
    "processed_logits" (the distribution each row samples from: after allow-lists, bias, bans
    and penalties, then temperature, min_p, top-k / top-p; masked tokens -inf). Prompt
    logprobs stay raw logprobs.

    ``tensor_parallel_size`` (vLLM's) splits the model over that many devices (a ``"tp"``
    mesh over the first n of ``jax.devices()``, ``jaxkv.models.sharding``): attention heads, KV heads
    and the MLP's intermediate are split, so each must divide by it, and every device keeps
    its own KV heads' pages. As in vLLM, the KV budget (``kv_cache_memory_bytes`` or
    ``gpu_memory_utilization``) is per device, so n devices hold n times the tokens of one.
    ``pipeline_parallel_size`` must be 1.

    ``pooler_config`` (vLLM's ``PoolerConfig``, or a dict of its fields): how pooling requests
    (``LLM.embed`` / ``encode`` / ``score``) pool a prompt by default: ``pooling_type`` "LAST"
    (default), "MEAN" or "CLS", and ``normalize`` (default True). Any engine serves pooling
    and generation requests side by side. ``runner`` (vLLM's) "generate" or "pooling" makes
    it take only that kind of request, as a vLLM engine does; "pooling" also skips the
    decode-step warm-up. "auto" (default) takes both.

    ``max_logprobs`` (vLLM's, default 20; -1: the vocabulary size): the most ``logprobs`` /
    ``prompt_logprobs`` a request may ask for; ``add_request`` refuses more (ValueError) and
    resolves a request's -1 (whole vocabulary) to the vocabulary size, which must then be
    within the cap. Beam search's own requests are checked against the vocabulary only.

    EOS: every id of the tokenizer's ``eos_token_id`` and the model config's (an int or a
    list, as Llama 3's ``[128001, 128008, 128009]``) stops generation unless ``ignore_eos``
    (``EngineConfig.eos_token_ids``; the first is the requests' ``eos_token_id``, the others
    join their ``stop_token_ids``, as vLLM does with a generation config's EOS ids).

    Executors (vLLM's names): ``distributed_executor_backend`` "uni" (default: the worker in
    this process) or "mp" (one worker process per JAX process of a ``jax.distributed`` job;
    the model must then be a name or path, which each worker loads). ``nnodes`` /
    ``node_rank`` / ``master_addr`` / ``master_port`` / ``headless`` spread the "mp"
    workers over several hosts as vLLM's multi-node flags do. ``devices_per_worker`` (not
    vLLM's: its workers have one GPU each) gives each worker process that many devices (CPU
    host devices, or the GPUs of one host), so there are ``tensor_parallel_size /
    devices_per_worker`` worker processes.

    ``kv_transfer_config`` (vLLM's ``KVTransferConfig``, a dict of its fields or its JSON):
    the KV connector and this instance's role (``jaxkv.distributed.kv_transfer``), e.g.
    ``{"kv_connector": "JaxTransferConnector", "kv_role": "kv_producer"}`` on a prefill
    instance. Requests then pass ``SamplingParams(extra_args={"kv_transfer_params": {...}})``.

    ``compile_cache`` (default True): jax's persistent compilation cache, so a restart with
    the same configuration reads its compiled programs back (``jaxkv.compile_cache``): True
    for ``$JAXKV_COMPILE_CACHE``, else a directory the process already gave jax, else
    ``~/.cache/jaxkv/xla``; a directory; or False / "off" to leave jax's setting alone.

    ``quantization`` (vLLM's name): None (float weights), "int8", "fp8" or "q4" (4-bit blocks
    of 32): every linear layer and the LM head kept quantized in device memory
    (``jaxkv.models.quant``; a GGUF checkpoint keeps its Q8_0 blocks for int8, its Q4_0 /
    Q4_1 / Q4_K blocks for q4). A model object given is quantized here, in place.

    ``model`` is a name or path (``str`` or ``os.PathLike``) for ``jaxkv.models.load_model``, or an
    already built NNX model (then ``tokenizer`` may be given). Flags (``enable_prefix_caching``,
    ``enable_chunked_prefill``, ``async_scheduling``, ``verbose``) must be real bools.
    """
    from jaxkv.models.registry import (  # the engine depends on models, never the reverse
        load_model_config,
        resolve_quantization,
    )

    _check_argument_types(
        flags=dict(
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            async_scheduling=async_scheduling,
            verbose=verbose,
        ),
        warmup=warmup,
        max_logprobs=max_logprobs,
        seed=seed,
        dtype=dtype,
        gpu_memory_utilization=gpu_memory_utilization,
        num_gpu_blocks_override=num_gpu_blocks_override,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        attention_backend=attention_backend,
        tokenizer=tokenizer,
        pipeline_parallel_size=pipeline_parallel_size,
    )
    from jaxkv.models.quant import check_quantization

    check_quantization(quantization)  # ValueError naming a bad value
    model = _checked_model(model)
    check_executor_args(
        distributed_executor_backend,
        model,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        headless=headless,
        tensor_parallel_size=tensor_parallel_size,
        devices_per_worker=devices_per_worker,
    )
    if distributed_executor_backend != "mp":  # "mp": the devices are the worker processes'
        check_device_count(tensor_parallel_size)  # ValueError saying how to get more devices
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    from jaxkv.distributed.kv_transfer.config import KVTransferConfig

    kv_transfer_config = KVTransferConfig.from_any(kv_transfer_config)
    if pooler_config is None:
        pooler_config = PoolerConfig()
    elif isinstance(pooler_config, dict):
        pooler_config = PoolerConfig(**pooler_config)
    elif not isinstance(pooler_config, PoolerConfig):
        raise TypeError(f"pooler_config must be a PoolerConfig or a dict, got {pooler_config!r}")
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
    speculative_config = SpeculativeConfig.from_value(speculative_config)
    if speculative_config is not None and async_scheduling:
        raise ValueError(
            "speculative_config does not work with async_scheduling (the drafts "
            "come from the tokens the host has; turn one of them off)"
        )

    if isinstance(model, str):  # config and tokenizer only: the workers load the weights sharded
        loaded, (model_config, tok) = None, load_model_config(model, dtype=dtype)
        # an fp8 checkpoint's own "fp8" (ValueError naming both for another quantization)
        quantization = resolve_quantization(model, quantization)
        name = model
    else:
        loaded, model_config, tok = model, model.config, None
        name = type(model).__name__
        if quantization is not None:
            from jaxkv.models.quant import quantize_model

            loaded = quantize_model(model, quantization)
    tokenizer = tokenizer if tokenizer is not None else tok

    _positive("block_size", block_size)
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    _positive("max_num_seqs", max_num_seqs)
    if max_model_len is None:
        max_model_len = model_config.max_position_embeddings
    _positive("max_model_len", max_model_len)
    if max_model_len > model_config.max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's "
            f"max_position_embeddings={model_config.max_position_embeddings}"
        )
    if max_num_batched_tokens is None:
        max_num_batched_tokens = default_max_num_batched_tokens(
            max_num_seqs, max_model_len, enable_chunked_prefill
        )
    _positive("max_num_batched_tokens", max_num_batched_tokens)
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(
            f"max_num_batched_tokens={max_num_batched_tokens} must be >= "
            f"max_num_seqs={max_num_seqs} (every running request needs a token a step)"
        )
    cache_dtype = model_config.dtype if kv_cache_dtype == "auto" else kv_cache_dtype

    eos_ids = merge_eos_token_ids(
        getattr(tokenizer, "eos_token_id", None), model_config.eos_token_id
    )
    eos = eos_ids[0] if eos_ids else None
    sched = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
        policy=scheduling_policy,
        eos_token_id=eos,
        async_scheduling=async_scheduling,
    )
    config = EngineConfig(
        model_name=name,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        cache_dtype=cache_dtype,
        attention_backend=attention_backend,
        seed=seed,
        warmup=warmup,
        scheduler_config=sched,
        speculative_config=speculative_config,
        logprobs_mode=logprobs_mode,
        tensor_parallel_size=tensor_parallel_size,
        pooler_config=pooler_config,
        runner=runner,
        max_logprobs=max_logprobs,
        eos_token_ids=eos_ids,
        model=model if isinstance(model, str) else None,
        dtype=dtype,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        num_gpu_blocks_override=num_gpu_blocks_override,
        verbose=verbose,
        distributed_executor_backend=distributed_executor_backend,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        headless=headless,
        devices_per_worker=devices_per_worker,
        kv_transfer_config=kv_transfer_config,
        compile_cache_dir=_compile_cache_dir(compile_cache),
        quantization=quantization,
    )
    return loaded, model_config, tokenizer, config
