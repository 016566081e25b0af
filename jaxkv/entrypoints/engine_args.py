"""``EngineArgs`` (vLLM's): every engine argument, and the one place where the engine's
command-line flags get their names, defaults and help.

``LLM(model, **kwargs)`` takes its keyword arguments as ``EngineArgs`` fields; ``jaxkv
generate``, ``jaxkv serve``, ``jaxkv plan`` and the headless launcher
(``jaxkv.executor.headless``) add the flags of the fields they use with ``add_cli_args`` and
read them back with ``from_cli_args``. A field's defaults are the library's
(``resolve_engine_config``'s); a flag may have its own (``--max-model-len`` is 2048 where the
library takes the model's whole context), said in its help.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from jaxkv.engine_config import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    EXECUTOR_BACKEND_NAMES,
    check_executor_args,
    resolve_engine_config,
)
from jaxkv.entrypoints.cli_common import parse_bytes, parse_ngram, positive_int, power_of_two
from jaxkv.models.config import CACHE_DTYPES, DTYPES
from jaxkv.models.quant import QUANTIZATION_MODES
from jaxkv.worker.backends import BACKENDS

#: The choices of ``--dtype``, ``--kv-cache-dtype`` and ``--attention-backend``.
MODEL_DTYPES = DTYPES
KV_CACHE_DTYPES = ("auto", *CACHE_DTYPES)
ATTENTION_BACKENDS = BACKENDS

_NO_DEFAULT = object()


@dataclasses.dataclass(frozen=True)
class Flag:
    """A field's command-line flag: its option strings, help (one line, ending with
    ``(default: ...)``; ``{default}`` there is the flag's default as the command line writes
    it) and ``argparse`` keywords. ``dest``: the namespace attribute, when not the field's
    name; ``default``: the flag's, when not the field's; ``to_field``: the parsed value -> the
    field's; ``aliases``: other names the library's messages give the field."""

    names: tuple[str, ...]
    help: str
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    dest: str | None = None
    default: Any = _NO_DEFAULT
    to_field: Callable[[Any], Any] | None = None
    aliases: tuple[str, ...] = ()


def _flag(*names: str, help: str, **kwargs) -> dict:
    """A field's ``metadata`` with its ``Flag``."""
    own = {k: kwargs.pop(k) for k in ("dest", "default", "to_field", "aliases") if k in kwargs}
    return {"flag": Flag(names, help, kwargs, **own)}


def parse_kv_transfer_config(text: str):
    """``--kv-transfer-config`` JSON -> ``KVTransferConfig`` (argparse reports a bad one)."""
    from jaxkv.distributed.kv_transfer.config import KVTransferConfig

    try:
        return KVTransferConfig.from_any(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclasses.dataclass
class EngineArgs:
    """The engine's arguments, as ``LLM(...)``, ``AsyncLLM(...)`` and ``resolve_engine_config``
    take them (see there for what each does); the fields with a ``Flag`` are also flags."""

    model: Any = "tiny-llama"  # a name, a path or a built NNX model; each command's own flag
    block_size: int = dataclasses.field(
        default=16,
        metadata=_flag(
            "--block-size",
            type=power_of_two,
            metavar="N",
            help="tokens per KV-cache block, a power of two (default: 16)",
        ),
    )
    kv_cache_memory_bytes: int | None = dataclasses.field(
        default=None,
        metadata=_flag(
            "--kv-cache-memory",
            "--kv-cache-memory-bytes",
            dest="kv_cache_memory",
            type=parse_bytes,
            metavar="BYTES",
            help=f"KV cache budget, e.g. 256MiB or 2GiB (default: "
            f"{DEFAULT_CPU_KV_CACHE_BYTES >> 20}MiB on CPU, --gpu-memory-utilization of the "
            f"device's memory on GPU)",
        ),
    )
    gpu_memory_utilization: float = dataclasses.field(
        default=0.9,
        metadata=_flag(
            "--gpu-memory-utilization",
            type=float,
            metavar="F",
            help="share of GPU memory the engine may use when --kv-cache-memory is not given "
            "(default: 0.9)",
        ),
    )
    num_gpu_blocks_override: int | None = None
    max_model_len: int | None = dataclasses.field(
        default=None,  # the model's max_position_embeddings
        metadata=_flag(
            "--max-model-len",
            default=2048,
            type=positive_int,
            metavar="N",
            help="longest request, prompt + output tokens (default: 2048)",
        ),
    )
    max_num_seqs: int = dataclasses.field(
        default=64,
        metadata=_flag(
            "--max-num-seqs",
            type=positive_int,
            metavar="N",
            help="most requests per step (default: 64)",
        ),
    )
    max_num_batched_tokens: int | None = dataclasses.field(
        default=None,
        metadata=_flag(
            "--max-num-batched-tokens",
            type=positive_int,
            metavar="N",
            help="most tokens per step (default: 2048, or --max-num-seqs when larger)",
        ),
    )
    enable_prefix_caching: bool = dataclasses.field(
        default=True,
        metadata=_flag(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            help="reuse the KV of shared prompt prefixes (default: on)",
        ),
    )
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    async_scheduling: bool = dataclasses.field(
        default=False,
        metadata=_flag(
            "--async-scheduling",
            action="store_true",
            help="schedule step N+1 while step N runs: same tokens, pays on GPU / TPU "
            "(default: off)",
        ),
    )
    kv_cache_dtype: str = dataclasses.field(
        default="auto",
        metadata=_flag(
            "--kv-cache-dtype",
            aliases=("cache_dtype",),
            choices=KV_CACHE_DTYPES,
            help="KV cache dtype; auto follows --dtype (default: auto)",
        ),
    )
    attention_backend: str = dataclasses.field(
        default="auto",
        metadata=_flag(
            "--attention-backend",
            choices=ATTENTION_BACKENDS,
            help="attention implementation (default: auto)",
        ),
    )
    dtype: str = dataclasses.field(
        default="float32",
        metadata=_flag(
            "--dtype", choices=MODEL_DTYPES, help="model weights dtype (default: float32)"
        ),
    )
    quantization: str | None = dataclasses.field(
        default=None,
        metadata=_flag(
            "--quantization",
            choices=QUANTIZATION_MODES,
            help="weight-only quantization of every linear layer and the LM head, kept "
            "quantized in device memory: int8 (per output channel; a GGUF checkpoint's Q8_0 "
            "blocks as stored), fp8, or q4 (4-bit blocks of 32 with a scale and an offset; a "
            "GGUF checkpoint's Q4_0 / Q4_1 / Q4_K blocks as stored) (default: none, the weights "
            "in --dtype; a checkpoint that ships fp8 weights: fp8, as stored)",
        ),
    )
    seed: int = dataclasses.field(
        default=0, metadata=_flag("--seed", type=int, help="engine seed (default: 0)")
    )
    tokenizer: Any = None
    warmup: bool = dataclasses.field(
        default=True,
        metadata=_flag(
            "--warmup",
            default="on",
            to_field=lambda value: value != "off",
            choices=("on", "off"),
            help="compile every program the engine can run at load, so nothing compiles "
            "while it works; off compiles each on first use (default: {default})",
        ),
    )
    speculative_config: Any = dataclasses.field(
        default=None,
        metadata=_flag(
            "--speculative-ngram",
            type=parse_ngram,
            metavar="K[,MAX[,MIN]]",
            help="draft K tokens a step by n-gram lookup over each request's tokens, n-grams "
            "MAX..MIN long (default: off; MAX..MIN 4..1)",
        ),
    )
    logprobs_mode: str = "raw_logprobs"
    tensor_parallel_size: int = dataclasses.field(
        default=1,
        metadata=_flag(
            "--tensor-parallel-size",
            "-tp",
            type=positive_int,
            metavar="N",
            help="split the model over N devices; on CPU, N host devices set up here (default: 1)",
        ),
    )
    pipeline_parallel_size: int = 1
    pooler_config: Any = None
    runner: str = "auto"
    max_logprobs: int = dataclasses.field(
        default=20,
        metadata=_flag(
            "--max-logprobs",
            type=int,
            metavar="N",
            help="most logprobs a request may ask for, -1 the vocabulary (default: 20)",
        ),
    )
    verbose: bool = False
    distributed_executor_backend: str = dataclasses.field(
        default="uni",
        metadata=_flag(
            "--distributed-executor-backend",
            default=None,  # from_cli_args: mp where the flags need processes
            choices=EXECUTOR_BACKEND_NAMES,
            help="uni: the worker in this process; mp: one worker process per device group, "
            "over --nnodes hosts (default: mp with --nnodes > 1 or --headless, else uni)",
        ),
    )
    nnodes: int = dataclasses.field(
        default=1,
        metadata=_flag(
            "--nnodes",
            type=positive_int,
            metavar="N",
            help="hosts the mp workers are spread over, -tp / N workers each (default: 1)",
        ),
    )
    node_rank: int = dataclasses.field(
        default=0,
        metadata=_flag(
            "--node-rank",
            type=int,
            metavar="R",
            help="this host's rank: 0 runs the engine, others run --headless (default: 0)",
        ),
    )
    master_addr: str = dataclasses.field(
        default="127.0.0.1",
        metadata=_flag(
            "--master-addr",
            metavar="HOST",
            help="node 0's address, which every node can reach (default: 127.0.0.1)",
        ),
    )
    master_port: int = dataclasses.field(
        default=0,
        metadata=_flag(
            "--master-port",
            type=int,
            metavar="PORT",
            help="jax.distributed coordinator port on node 0, the next port is the control "
            "socket; needed with --nnodes > 1 (default: 0, two free ports)",
        ),
    )
    headless: bool = dataclasses.field(
        default=False,
        metadata=_flag(
            "--headless",
            action="store_true",
            help="only start this node's workers and wait for node 0's engine; generates "
            "nothing (default: off)",
        ),
    )
    devices_per_worker: int = dataclasses.field(
        default=1,
        metadata=_flag(
            "--devices-per-worker",
            type=positive_int,
            metavar="N",
            help="devices of each mp worker process (CPU host devices, or GPUs), so -tp / N "
            "processes (default: 1)",
        ),
    )
    kv_transfer_config: Any = dataclasses.field(
        default=None,
        metadata=_flag(
            "--kv-transfer-config",
            type=parse_kv_transfer_config,
            metavar="JSON",
            help="the KV connector, as vLLM's flag: e.g. '{\"kv_connector\": "
            '"JaxTransferConnector", "kv_role": "kv_producer"}\' for a prefill instance '
            "(default: none)",
        ),
    )
    compile_cache: Any = dataclasses.field(
        default=True,
        metadata=_flag(
            "--compile-cache",
            metavar="DIR|off",
            help="jax's persistent compilation cache, so a restart reads its programs back "
            "(default: $JAXKV_COMPILE_CACHE, else ~/.cache/jaxkv/xla; off: not used)",
        ),
    )

    # ---- the command line -------------------------------------------------------------------

    @staticmethod
    def add_cli_args(
        parser, fields: Iterable[str], *, defaults: Mapping[str, Any] | None = None
    ) -> None:
        """Adds the flags of ``fields`` (field names, in that order) to ``parser`` (a parser
        or an argument group). ``defaults``: a command's own flag defaults, by field name, as
        the command line gives them (``{"warmup": "off"}``)."""
        defaults = dict(defaults or {})
        for name in fields:
            field, flag = _FIELDS[name], _flag_of(name)
            default = defaults.pop(name, flag.default)
            if default is _NO_DEFAULT:
                default = field.default
            parser.add_argument(
                *flag.names,
                dest=flag.dest or name,
                default=default,
                help=flag.help.format(default=default) if "{default}" in flag.help else flag.help,
                **flag.kwargs,
            )
        if defaults:
            raise ValueError(f"defaults for flags not added: {sorted(defaults)}")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The ``EngineArgs`` of the parsed flags: each field whose flag the command added,
        the field's default for the others (and ``model`` from the command's own)."""
        values = {}
        for name, field in _FIELDS.items():
            flag = field.metadata.get("flag")
            dest = (flag.dest or name) if flag is not None else name
            if (flag is None and name != "model") or not hasattr(args, dest):
                continue
            value = getattr(args, dest)
            values[name] = flag.to_field(value) if flag and flag.to_field else value
        if values.get("distributed_executor_backend", "uni") is None:  # vLLM's choice
            multi = values.get("nnodes", 1) > 1 or values.get("headless", False)
            values["distributed_executor_backend"] = "mp" if multi else "uni"
        return cls(**values)

    @staticmethod
    def flag_names() -> dict[str, str]:
        """``{field name (and its aliases): flag}`` of the fields with a flag, for
        ``cli_common.name_flags``."""
        names = {}
        for name, field in _FIELDS.items():
            flag = field.metadata.get("flag")
            if flag is not None:
                for key in (name, *flag.aliases):
                    names[key] = flag.names[0]
        return names

    # ---- the engine --------------------------------------------------------------------------

    def to_kwargs(self) -> dict:
        """The fields as keyword arguments (``LLM(**...)``, ``AsyncLLM(model, **...)``);
        shallow: a tokenizer or a model stays the object given."""
        return {name: getattr(self, name) for name in _FIELDS}

    def check(self, *, engine: bool = True) -> None:
        """The checks that need no model, so that a command refuses a bad flag before
        anything loads: each a ValueError / TypeError naming the field. ``engine``: these
        arguments build an engine (False for a headless node, which only runs workers)."""
        if self.max_num_batched_tokens is not None and (
            self.max_num_batched_tokens < self.max_num_seqs
        ):
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_num_seqs={self.max_num_seqs}"
            )
        if self.speculative_config is not None and self.async_scheduling:
            raise ValueError(
                "speculative_config does not work with async_scheduling (turn one off)"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        check_executor_args(
            self.distributed_executor_backend,
            self.model,
            nnodes=self.nnodes,
            node_rank=self.node_rank,
            master_addr=self.master_addr,
            master_port=self.master_port,
            headless=self.headless,
            tensor_parallel_size=self.tensor_parallel_size,
            devices_per_worker=self.devices_per_worker,
            engine=engine,
        )

    def create_engine_config(self):
        """Resolves and checks every argument (``resolve_engine_config``): ``(model,
        model_config, tokenizer, EngineConfig)``; reads the model's config and tokenizer, no
        weights."""
        kwargs = self.to_kwargs()
        return resolve_engine_config(kwargs.pop("model"), **kwargs)


_FIELDS = {f.name: f for f in dataclasses.fields(EngineArgs)}


def _flag_of(name: str) -> Flag:
    flag = _FIELDS[name].metadata.get("flag")
    if flag is None:
        raise ValueError(f"EngineArgs.{name} has no command-line flag")
    return flag


#: The engine flags of ``jaxkv generate`` and ``jaxkv serve``, in their help's order.
SHARED_FLAGS = (
    "dtype",
    "quantization",
    "kv_cache_memory_bytes",
    "gpu_memory_utilization",
    "kv_cache_dtype",
    "block_size",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "attention_backend",
    "warmup",
    "compile_cache",
    "async_scheduling",
    "speculative_config",
    "kv_transfer_config",
    "seed",
    "tensor_parallel_size",
)

#: vLLM's executor and multi-node flags (``jaxkv generate``; the headless launcher's).
NODE_FLAGS = (
    "distributed_executor_backend",
    "nnodes",
    "node_rank",
    "master_addr",
    "master_port",
    "devices_per_worker",
    "headless",
)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """``EngineArgs.from_cli_args(args).to_kwargs()``: the ``LLM`` / ``AsyncLLM`` keyword
    arguments of the parsed flags."""
    return EngineArgs.from_cli_args(args).to_kwargs()
