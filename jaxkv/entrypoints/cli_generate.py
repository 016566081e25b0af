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
    from jaxkv.engine_config import EXECUTOR_BACKEND_NAMES
    from jaxkv.entrypoints.engine_args import add_engine_args
    from jaxkv.entrypoints.cli import MODEL_DTYPES, parse_token_ids, positive_int

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
        "--dtype",
        choices=MODEL_DTYPES,
        default="float32",
        help="model weights dtype (default: float32)",
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
    g = p.add_argument_group("sampling")
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
        help="softmax temperature, 0 is greedy (default: 0.0)",
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
        "--seed",
        type=int,
        default=0,
        help="engine seed, and the sampling seed when --temperature > 0 (default: 0)",
    )
    g.add_argument(
        "--beam-width",
        type=positive_int,
        default=None,
        metavar="N",
        help="beam search with N beams (vLLM's LLM.beam_search) instead of sampling (default: off)",
    )
    g = p.add_argument_group("engine")
    add_engine_args(g, warmup="off")
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=positive_int,
        default=1,
        metavar="N",
        help="split the model over N devices; on CPU, N host devices set up here (default: 1)",
    )
    g = p.add_argument_group("processes and nodes (vLLM's)")
    g.add_argument(
        "--distributed-executor-backend",
        choices=EXECUTOR_BACKEND_NAMES,
        default=None,
        help="uni: the worker in this process; mp: one worker process per device group, "
        "over --nnodes hosts (default: mp with --nnodes > 1 or --headless, else uni)",
    )
    g.add_argument(
        "--nnodes",
        type=positive_int,
        default=1,
        metavar="N",
        help="hosts the mp workers are spread over, -tp / N workers each (default: 1)",
    )
    g.add_argument(
        "--node-rank",
        type=int,
        default=0,
        metavar="R",
        help="this host's rank: 0 runs the engine, others run --headless (default: 0)",
    )
    g.add_argument(
        "--master-addr",
        default="127.0.0.1",
        metavar="HOST",
        help="node 0's address, which every node can reach (default: 127.0.0.1)",
    )
    g.add_argument(
        "--master-port",
        type=int,
        default=0,
        metavar="PORT",
        help="jax.distributed coordinator port on node 0, the next port is the control "
        "socket; needed with --nnodes > 1 (default: 0, two free ports)",
    )
    g.add_argument(
        "--devices-per-worker",
        type=positive_int,
        default=1,
        metavar="N",
        help="devices of each mp worker process (CPU host devices, or GPUs), so -tp / N "
        "processes (default: 1)",
    )
    g.add_argument(
        "--headless",
        action="store_true",
        help="only start this node's workers and wait for node 0's engine; generates "
        "nothing (default: off)",
    )
    p.set_defaults(func=cmd_generate)


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
    from jaxkv.entrypoints.cli import parse_token_ids

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


def executor_backend(args) -> str:
    """``--distributed-executor-backend``, defaulting to mp where the flags need processes."""
    given = getattr(args, "distributed_executor_backend", None)
    if given is not None:
        return given
    return "mp" if getattr(args, "nnodes", 1) > 1 or getattr(args, "headless", False) else "uni"


def check_executor_flags(args) -> None:
    """The executor and multi-node flags, before anything loads (ValueError / TypeError)."""
    from jaxkv.engine_config import check_executor_args

    check_executor_args(
        executor_backend(args),
        args.model,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        headless=args.headless,
        tensor_parallel_size=args.tensor_parallel_size,
        devices_per_worker=args.devices_per_worker,
        engine=not args.headless,
    )


def _headless(args) -> int:
    """A ``--headless`` node: starts its workers (``run_headless``) and waits until node 0's
    engine shuts them down; loads no model and generates nothing."""
    from jaxkv.executor.multiproc import run_headless

    print(
        f"jaxkv generate --headless: node {args.node_rank} of {args.nnodes}, waiting for node 0's "
        f"engine at {args.master_addr}:{args.master_port}",
        file=sys.stderr,
        flush=True,
    )
    return run_headless(
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        tensor_parallel_size=args.tensor_parallel_size,
        devices_per_worker=args.devices_per_worker,
    )


def _default_kv_budget(args) -> None:
    """Sets ``--kv-cache-memory`` to the engine's CPU default where the device reports no
    memory stats, and says so naming the flag (the engine's note names its parameter). With
    the mp backend this process starts no jax backend (it would take a GPU from the workers):
    the workers' platform decides."""
    if args.kv_cache_memory is not None:
        return
    from jaxkv.engine_config import DEFAULT_CPU_KV_CACHE_BYTES

    if executor_backend(args) == "mp":
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
    from jaxkv.entrypoints.cli import error, name_flags
    from jaxkv.entrypoints.engine_args import engine_kwargs

    try:  # every check that needs no model, before it loads
        params = sampling_params(args)
        if (
            args.max_num_batched_tokens is not None
            and args.max_num_batched_tokens < args.max_num_seqs
        ):
            raise ValueError(
                f"max_num_batched_tokens={args.max_num_batched_tokens} must be >= "
                f"max_num_seqs={args.max_num_seqs} (every running request needs a token "
                f"a step)"
            )
        if args.speculative_ngram is not None and args.async_scheduling:
            raise ValueError(
                "speculative_config does not work with async_scheduling (turn one off)"
            )
        if not 0.0 < args.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {args.gpu_memory_utilization}"
            )
        check_executor_flags(args)
        if args.headless:  # no model, no prompts here: node 0 has them
            return _headless(args)
        file_lines = read_prompts_file(args.prompts_file) if args.prompts_file else None
        has_tok = known_tokenizer(args.model)
        if has_tok is not None:
            resolve_prompts(args, file_lines, has_tok)
    except (ValueError, TypeError) as e:
        return error("generate", name_flags(e))

    if args.tensor_parallel_size > 1 and executor_backend(args) == "uni":  # mp: the workers' own
        _host_devices(args.tensor_parallel_size)
    from jaxkv.entrypoints.llm import LLM

    _default_kv_budget(args)
    t0 = time.perf_counter()
    try:
        llm = LLM(
            args.model,
            dtype=args.dtype,
            seed=args.seed,
            verbose=True,
            **engine_kwargs(args),
            tensor_parallel_size=args.tensor_parallel_size,
            distributed_executor_backend=executor_backend(args),
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            devices_per_worker=args.devices_per_worker,
        )
    except (ValueError, TypeError, RuntimeError, OSError) as e:
        return error("generate", name_flags(e))
    from jaxkv.executor.multiproc import WorkerDiedError, WorkerTimeoutError

    try:
        return _run(llm, args, params, file_lines, time.perf_counter() - t0)
    except (ValueError, TypeError) as e:  # a prompt the engine refuses (length, vocabulary)
        return error("generate", name_flags(e))
    except (WorkerDiedError, WorkerTimeoutError) as e:  # mp: a worker process died or hung
        error("generate", e)
        return 1
    finally:
        llm.shutdown()  # the mp backend's workers (and the --headless nodes) exit now


def _run(llm, args, params, file_lines, load_s: float) -> int:
    from jaxkv.entrypoints.cli import error, name_flags

    engine = llm.llm_engine
    tok = engine.tokenizer
    try:
        prompts = resolve_prompts(args, file_lines, tok is not None)
    except ValueError as e:  # a model whose lack of a tokenizer showed only once loaded
        return error("generate", name_flags(e))
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
    c0, cs0 = before["num_compiles"], before["compile_seconds"]
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
        f"(includes {stats['num_compiles'] - c0} compiles, {stats['compile_seconds'] - cs0:.1f} s; "
        f"load includes {c0} warm-up compiles)"
    )
    print(
        f"KV cache: {num_blocks} blocks of {engine.config.block_size} tokens, peak use "
        f"{stats['peak_kv_cache_usage'] * 100:.1f}% ({round(stats['peak_kv_cache_usage'] * (num_blocks - 1))} blocks); "
        f"prefix-cache hits {stats['prefix_hit_tokens']} tokens; preemptions {stats['num_preemptions']}"
    )
    if "spec_num_draft_tokens" in stats:
        print(
            f"speculative: {stats['spec_num_accepted_tokens']} of {stats['spec_num_draft_tokens']} "
            f"drafts accepted ({stats['spec_acceptance_rate'] * 100:.0f}%)"
        )
    return 0


def _beam_search(llm, args, params, prompts, shown, load_s: float) -> int:
    engine = llm.llm_engine
    tok = engine.tokenizer
    c0 = engine.get_stats()["num_compiles"]
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
        f"(includes {stats['num_compiles'] - c0} compiles); prefix-cache hits {stats['prefix_hit_tokens']} tokens"
    )
    return 0


def _host_devices(n: int) -> None:
    """Asks for ``n`` CPU host devices. XLA reads XLA_FLAGS when jax's backends start (the
    first device query, after this; importing jax does not start them). The flag only
    concerns the host platform, so on GPU / TPU nothing changes."""
    import os

    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


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
    if executor_backend(args) == "mp":
        n = len(engine.engine_core.model_executor.worker_pids)
        procs = f", {n} worker process{'es' if n > 1 else ''} on {args.nnodes} node{'s' if args.nnodes > 1 else ''}"
    return f"{backend} ({device}{tp}{procs})"
