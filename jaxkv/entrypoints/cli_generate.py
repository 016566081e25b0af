"""``jaxkv generate``: the README's main job (SmolLM2-135M-Instruct on the CPU by default).

Every flag is checked before the model loads (``SamplingParams`` / ``BeamSearchParams`` are
built first, prompts are read and, for a model known to have no tokenizer, required to be
token ids), so a bad flag costs no load; an error is one line, exit code 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from jaxkv.entrypoints.cli_common import (
    Parser,
    error,
    host_devices,
    name_flags,
    parse_token_ids,
    positive_int,
)
from jaxkv.entrypoints.engine_args import NODE_FLAGS, SHARED_FLAGS, EngineArgs

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a KV cache is.",
    "List three prime numbers.",
)

EPILOG = """\
prompts:
  --prompt TEXT and --prompt-token-ids 1,2,3 (both repeatable, kept in the order given), then
  the lines of --prompts-file PATH (one prompt per line, "-" reads stdin). A model without a
  tokenizer (tiny-llama, tiny-hybrid) takes token ids only: each line of --prompts-file is
  then ids separated by commas or spaces. With no prompt at all the built-in prompts run
  (synthetic token ids for a model without a tokenizer).

examples:
  jaxkv generate
  jaxkv generate --prompt "Write a limerick." --max-tokens 64 --temperature 0.8 --top-p 0.95
  jaxkv generate --prompt "Name a colour." -n 3 --temperature 1.0 --stop "."
  jaxkv generate --model tiny-llama --prompt-token-ids 1,2,3 --prompt-token-ids "4 5 6" --max-tokens 8
  printf '1,2,3\\n4,5\\n' | jaxkv generate --model tiny-llama --prompts-file -
  jaxkv generate --model tiny-llama --beam-width 4 --max-tokens 16

two nodes (vLLM's multi-node flags; tensor parallel 2, one worker process per node):
  node 1: jaxkv generate --headless --nnodes 2 --node-rank 1 --master-addr HOST0 --master-port 29500 -tp 2
  node 0: jaxkv generate --model tiny-llama --nnodes 2 --node-rank 0 --master-addr HOST0 --master-port 29500 -tp 2
"""

#: The sampling flags with their defaults: beam search takes none but --temperature.
_SAMPLING_ONLY = {"n": 1, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "stop": None}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate completions (default: SmolLM2-135M-Instruct on the CPU)",
        description="Generates completions with the paged KV-cache engine (vLLM's LLM.generate)\n"
        "and prints them, then the throughput and the KV cache's use.",
        epilog=EPILOG,
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="NAME|PATH",
        help="smollm2-135m-instruct | tiny-llama | tiny-hybrid | HF directory | .gguf file "
        f"(default: {DEFAULT_MODEL}, downloaded once)",
    )
    g.add_argument(
        "--no-chat",
        action="store_true",
        help="do not apply the model's chat template to text prompts (default: applied)",
    )
    g = p.add_argument_group("prompts")
    g.add_argument(
        "--prompt",
        dest="prompts",
        action="append",
        metavar="TEXT",
        help="a text prompt, repeatable (default: the built-in prompts)",
    )
    g.add_argument(
        "--prompt-token-ids",
        dest="prompts",
        action="append",
        type=parse_token_ids,
        metavar="IDS",
        help="a prompt as token ids, e.g. 1,2,3 or '1 2 3', repeatable (default: none)",
    )
    g.add_argument(
        "--prompts-file",
        metavar="PATH",
        help='one prompt per line ("-": stdin); token ids per line for a model without a '
        "tokenizer (default: none)",
    )
    add_sampling_args(p.add_argument_group("sampling"))
    g = p.add_argument_group("engine")
    EngineArgs.add_cli_args(g, SHARED_FLAGS, defaults={"warmup": "off"})
    EngineArgs.add_cli_args(p.add_argument_group("processes and nodes (vLLM's)"), NODE_FLAGS)
    p.set_defaults(func=cmd_generate)


def add_sampling_args(g) -> None:
    """vLLM's sampling flags (``SamplingParams``), and ``--beam-width``."""
    g.add_argument(
        "--max-tokens",
        type=int,
        default=48,
        metavar="N",
        help="most tokens generated per completion (default: 48)",
    )
    g.add_argument(
        "-n", type=int, default=1, metavar="N", help="completions per prompt (default: 1)"
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="softmax temperature, 0 is greedy; above 0 samples with --seed (default: 0.0)",
    )
    g.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        help="nucleus probability mass, in (0, 1] (default: 1.0, off)",
    )
    g.add_argument(
        "--top-k",
        type=int,
        default=0,
        metavar="K",
        help="keep the K most likely tokens, 0 or -1 is off (default: 0)",
    )
    g.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        metavar="P",
        help="drop tokens below P times the top token's probability, in [0, 1] (default: 0.0)",
    )
    g.add_argument(
        "--stop",
        action="append",
        metavar="TEXT",
        help="stop string, repeatable; needs a tokenizer (default: none)",
    )
    g.add_argument(
        "--beam-width",
        type=positive_int,
        default=None,
        metavar="N",
        help="beam search with N beams (vLLM's LLM.beam_search) instead of sampling (default: off)",
    )


def flag_names() -> dict[str, str]:
    """The library's parameter names -> this command's flags (for ``name_flags``): the
    engine's and the sampling flags'."""
    sampling = Parser(add_help=False)
    add_sampling_args(sampling)
    return EngineArgs.flag_names() | {a.dest: a.option_strings[0] for a in sampling._actions}


def sampling_params(args):
    """The run's ``SamplingParams`` or, with ``--beam-width``, ``BeamSearchParams``: built from
    the flags before the model loads. Raises ValueError / TypeError (library names)."""
    if args.beam_width is not None:
        from jaxkv.beam_search import BeamSearchParams

        given = [k for k, default in _SAMPLING_ONLY.items() if getattr(args, k) != default]
        if given:
            raise ValueError(
                f"beam_width takes no {', '.join(given)} (beam search ranks the top "
                f"logprob candidates; only temperature applies)"
            )
        return BeamSearchParams(
            beam_width=args.beam_width, max_tokens=args.max_tokens, temperature=args.temperature
        )
    from jaxkv.sampling_params import SamplingParams

    return SamplingParams(
        n=args.n,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        stop=args.stop,
        seed=args.seed if args.temperature > 0 else None,
    )


def read_prompts_file(path: str) -> list[str]:
    """The non-blank lines of ``path`` ("-": stdin), stripped. ValueError if none."""
    if path == "-":
        lines = sys.stdin.read().splitlines()
    else:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise ValueError(f"--prompts-file {path}: {e.strerror or e}") from None
    lines = [line.strip() for line in lines if line.strip()]
    if not lines:
        raise ValueError(f"--prompts-file {path}: no prompts (one prompt per line)")
    return lines


def no_tokenizer_message(model: str) -> str:
    return (
        f"model {model!r} has no tokenizer, so text prompts cannot be encoded: pass token ids "
        f"instead, e.g. --prompt-token-ids 1,2,3 (or --prompts-file with one id list per line)"
    )


def resolve_prompts(args, file_lines: list[str] | None, has_tokenizer: bool) -> list:
    """The prompts in order: --prompt texts and --prompt-token-ids lists as given, then the
    file's lines (token ids without a tokenizer). Empty when none was given. ValueError: text
    prompts or --stop for a model without a tokenizer, or a file line that is not token ids."""
    prompts = list(args.prompts or [])
    if not has_tokenizer:
        if any(isinstance(p, str) for p in prompts):
            raise ValueError(no_tokenizer_message(args.model))
        if args.stop:
            raise ValueError(
                f"model {args.model!r} has no tokenizer, so --stop strings cannot be matched"
            )
    for i, line in enumerate(file_lines or [], start=1):
        if has_tokenizer:
            prompts.append(line)
            continue
        try:
            prompts.append(parse_token_ids(line))
        except argparse.ArgumentTypeError:  # the line is text
            raise ValueError(
                f"--prompts-file {args.prompts_file} line {i}: {line[:40]!r} is not token "
                f"ids, and {no_tokenizer_message(args.model)}"
            ) from None
    return prompts


def known_tokenizer(model: str) -> bool | None:
    """Whether ``model`` has a tokenizer, when that shows without loading it (None: unknown)."""
    from jaxkv.models.registry import BUILTIN_NAMES, RANDOM_INIT_NAMES

    if model in RANDOM_INIT_NAMES:
        return False
    if model in BUILTIN_NAMES:
        return True
    path = Path(model).expanduser()
    if path.is_dir():  # models.tokenizer.Tokenizer.from_hf_dir reads tokenizer.json
        return (path / "tokenizer.json").is_file()
    return None


def _headless(engine_args: EngineArgs) -> int:
    """A ``--headless`` node: starts its workers (``run_headless``) and waits until node 0's
    engine shuts them down; loads no model and generates nothing."""
    from jaxkv.executor import headless

    ea = engine_args
    print(
        f"jaxkv generate --headless: node {ea.node_rank} of {ea.nnodes}, waiting for node 0's "
        f"engine at {ea.master_addr}:{ea.master_port}",
        file=sys.stderr,
        flush=True,
    )
    return headless.run_headless(
        nnodes=ea.nnodes,
        node_rank=ea.node_rank,
        master_addr=ea.master_addr,
        master_port=ea.master_port,
        tensor_parallel_size=ea.tensor_parallel_size,
        devices_per_worker=ea.devices_per_worker,
    )


def _default_kv_budget(args) -> None:
    """Sets ``--kv-cache-memory`` to the engine's CPU default where the device reports no
    memory stats, and says so naming the flag (the engine's note names its parameter). With
    the mp backend this process starts no jax backend (it would take a GPU from the workers):
    the workers' platform decides."""
    if args.kv_cache_memory is not None:
        return
    from jaxkv.engine_config import DEFAULT_CPU_KV_CACHE_BYTES

    if EngineArgs.from_cli_args(args).distributed_executor_backend == "mp":
        from jaxkv.executor.multiproc import default_platform

        stats = None if default_platform() == "cpu" else True
    else:
        import jax

        try:
            stats = jax.devices()[0].memory_stats()
        except Exception:  # noqa: BLE001 - some backends raise instead of returning None
            stats = None
    if not stats:
        args.kv_cache_memory = DEFAULT_CPU_KV_CACHE_BYTES
        print(
            f"jaxkv generate: the device reports no memory stats; KV cache budget "
            f"{DEFAULT_CPU_KV_CACHE_BYTES / 2**20:.0f} MiB (set --kv-cache-memory)",
            file=sys.stderr,
        )


def cmd_generate(args) -> int:
    flags = flag_names()
    try:  # every check that needs no model, before it loads
        params = sampling_params(args)
        engine_args = EngineArgs.from_cli_args(args)
        engine_args.check(engine=not engine_args.headless)
        if engine_args.headless:  # no model, no prompts here: node 0 has them
            return _headless(engine_args)
        file_lines = read_prompts_file(args.prompts_file) if args.prompts_file else None
        has_tok = known_tokenizer(args.model)
        if has_tok is not None:
            resolve_prompts(args, file_lines, has_tok)
    except (ValueError, TypeError) as e:
        return error("generate", name_flags(e, flags))

    mp = engine_args.distributed_executor_backend == "mp"
    if engine_args.tensor_parallel_size > 1 and not mp:  # mp: the workers set up their own
        host_devices(engine_args.tensor_parallel_size)
    from jaxkv.entrypoints.llm import LLM

    _default_kv_budget(args)
    engine_args.kv_cache_memory_bytes = args.kv_cache_memory
    engine_args.verbose = True
    t0 = time.perf_counter()
    try:
        llm = LLM(**engine_args.to_kwargs())
    except (ValueError, TypeError, RuntimeError, OSError) as e:
        return error("generate", name_flags(e, flags))
    from jaxkv.executor.multiproc import WorkerDiedError, WorkerTimeoutError

    try:
        return _run(llm, args, params, file_lines, time.perf_counter() - t0)
    except (ValueError, TypeError) as e:  # a prompt the engine refuses (length, vocabulary)
        return error("generate", name_flags(e, flags))
    except (WorkerDiedError, WorkerTimeoutError) as e:  # mp: a worker process died or hung
        error("generate", e)
        return 1
    finally:
        llm.shutdown()  # the mp backend's workers (and the --headless nodes) exit now


def _run(llm, args, params, file_lines, load_s: float) -> int:
    engine = llm.llm_engine
    tok = engine.tokenizer
    try:
        prompts = resolve_prompts(args, file_lines, tok is not None)
    except ValueError as e:  # a model whose lack of a tokenizer showed only once loaded
        return error("generate", name_flags(e, flag_names()))
    if prompts:
        shown = [p if isinstance(p, str) else f"{len(p)} token ids" for p in prompts]
    elif tok is not None:
        prompts, shown = list(DEFAULT_PROMPTS), list(DEFAULT_PROMPTS)
    else:  # random-weight models have no tokenizer: synthetic token ids
        vocab = engine.model_config.vocab_size
        prompts = [
            [(7 * i + 3 * j) % (vocab - 3) + 3 for j in range(8 + 4 * i)]
            for i in range(len(DEFAULT_PROMPTS))
        ]
        shown = [f"{len(p)} synthetic token ids" for p in prompts]
    if tok is not None and not args.no_chat and tok.chat_template:
        prompts = [
            tok.apply_chat_template([{"role": "user", "content": p}]) if isinstance(p, str) else p
            for p in prompts
        ]
    if args.beam_width is not None:
        return _beam_search(llm, args, params, prompts, shown, load_s)
    return _generate(llm, args, params, prompts, shown, load_s)


def _generate(llm, args, params, prompts, shown, load_s: float) -> int:
    engine = llm.llm_engine
    tok = engine.tokenizer
    before = engine.get_stats()  # warm-up's compiles are in load
    c0, cs0 = before.num_compiles, before.compile_seconds
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.perf_counter() - t1
    for i, o in enumerate(outs):
        print(f"--- [{i}] {shown[i]}")
        for j, c in enumerate(o.outputs):
            text = c.text if tok is not None else " ".join(map(str, c.token_ids))
            head = "" if len(o.outputs) == 1 else f"[{i}.{j}] "
            print(
                f"{head}{text.strip()}\n    ({len(c.token_ids)} tokens, finish: {c.finish_reason})"
            )
    stats = engine.get_stats()
    num_blocks = engine.kv_cache_config.num_blocks
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    print(f"\nmodel {args.model} on {_where(engine, args)}, load {load_s:.1f} s")
    print(
        f"{n_out} tokens in {gen_s:.2f} s = {n_out / gen_s:.1f} tok/s "
        f"(includes {stats.num_compiles - c0} compiles, {stats.compile_seconds - cs0:.1f} s; "
        f"load includes {c0} warm-up compiles)"
    )
    print(
        f"KV cache: {num_blocks} blocks of {engine.config.block_size} tokens, peak use "
        f"{stats.peak_kv_cache_usage * 100:.1f}% ({round(stats.peak_kv_cache_usage * (num_blocks - 1))} blocks); "
        f"prefix-cache hits {stats.prefix_hit_tokens} tokens; preemptions {stats.num_preemptions}"
    )
    if stats.spec_decode is not None:
        print(
            f"speculative: {stats.spec_decode.num_accepted_tokens} of {stats.spec_decode.num_draft_tokens} "
            f"drafts accepted ({stats.spec_decode.acceptance_rate * 100:.0f}%)"
        )
    return 0


def _beam_search(llm, args, params, prompts, shown, load_s: float) -> int:
    engine = llm.llm_engine
    tok = engine.tokenizer
    c0 = engine.get_stats().num_compiles
    t1 = time.perf_counter()
    results = llm.beam_search(prompts, params)
    gen_s = time.perf_counter() - t1
    for i, (p, r) in enumerate(zip(prompts, results)):
        n_prompt = len(engine.input_processor.tokenize(p)[1])
        print(f"--- [{i}] {shown[i]}")
        for rank, seq in enumerate(r.sequences):
            new = seq.tokens[n_prompt:]
            text = tok.decode(new).strip() if tok is not None else " ".join(map(str, new))
            print(
                f"  beam {rank}: cum logprob {seq.cum_logprob:.3f}, finish {seq.finish_reason}: {text}"
            )
    stats = engine.get_stats()
    print(
        f"\nmodel {args.model} on {_where(engine, args)}, load {load_s:.1f} s; "
        f"beam search width {args.beam_width}, {args.max_tokens} rounds in {gen_s:.2f} s "
        f"(includes {stats.num_compiles - c0} compiles); prefix-cache hits {stats.prefix_hit_tokens} tokens"
    )
    return 0


def worker_description(worker) -> tuple[str, str]:
    """(attention backend, "platform:device kind") of a worker; run by collective_rpc, in
    the worker's process with the mp backend."""
    import jax

    d = jax.local_devices()[0]
    return worker.model_runner.backend, f"{d.platform}:{getattr(d, 'device_kind', '')}"


def _where(engine, args) -> str:
    """'xla (cpu:cpu x 2 (tensor parallel))', and the worker processes with the mp backend."""
    backend, device = engine.engine_core.model_executor.collective_rpc(worker_description)[0]
    tp = (
        f" x {args.tensor_parallel_size} (tensor parallel)" if args.tensor_parallel_size > 1 else ""
    )
    procs = ""
    if engine.config.distributed_executor_backend == "mp":
        n = len(engine.engine_core.model_executor.worker_pids)
        procs = f", {n} worker process{'es' if n > 1 else ''} on {args.nnodes} node{'s' if args.nnodes > 1 else ''}"
    return f"{backend} ({device}{tp}{procs})"
