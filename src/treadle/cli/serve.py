"""`treadle serve [MODEL]`: the OpenAI-compatible server, with vLLM's flag names."""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from typing import Any

from treadle.config import (
    DEFAULT_MODEL_NAME,
    CacheConfig,
    EngineConfig,
    FrontendConfig,
    ModelConfig,
    ParallelConfig,
    RestartConfig,
    SchedulerConfig,
    field_docs,
)


def parse_bytes(text: str) -> int:
    """`2147483648`, `2GiB`, `512MiB`, `1.5G` -> bytes."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (try 2GiB or 2147483648)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def cli_docs(cls: type) -> dict[str, str]:
    """`field_docs` made safe as argparse help (which %-formats it: `90%` would crash)."""
    return {name: doc.replace("%", "%%") for name, doc in field_docs(cls).items()}


def add_serve_parser(sub: Any) -> None:
    model_doc, cache_doc = cli_docs(ModelConfig), cli_docs(CacheConfig)
    sched_doc, par_doc = cli_docs(SchedulerConfig), cli_docs(ParallelConfig)
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model", nargs="?", default=None, help=model_doc["model"])
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--served-model-name", default=None, help=model_doc["served_model_name"])
    p.add_argument("--dtype", default="auto", help=model_doc["dtype"])
    p.add_argument("--max-model-len", type=int, default=None, help=model_doc["max_model_len"])
    p.add_argument("--seed", type=int, default=0, help=model_doc["seed"])
    p.add_argument(
        "--max-logprobs",
        type=int,
        default=ModelConfig.max_logprobs,
        help=model_doc["max_logprobs"],
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=SchedulerConfig.max_num_seqs,
        help=sched_doc["max_num_seqs"],
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=SchedulerConfig.max_num_batched_tokens,
        help=sched_doc["max_num_batched_tokens"],
    )
    p.add_argument(
        "--block-size", type=int, default=CacheConfig.block_size, help=cache_doc["block_size"]
    )
    p.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        default=None,
        help=cache_doc["kv_cache_memory"] + " Accepts 2GiB, 512MiB or bytes.",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=cache_doc["enable_prefix_caching"],
    )
    p.add_argument(
        "-tp", "--tensor-parallel-size", type=int, default=1, help=par_doc["tensor_parallel_size"]
    )
    p.add_argument(
        "-pp",
        "--pipeline-parallel-size",
        type=int,
        default=1,
        help=par_doc["pipeline_parallel_size"],
    )
    p.add_argument("--cpu-threads", type=int, default=None, help=par_doc["cpu_threads"])
    p.add_argument(
        "-dp",
        "--data-parallel-size",
        type=int,
        default=1,
        help=par_doc["data_parallel_size"],
    )
    p.add_argument(
        "-dpl",
        "--data-parallel-size-local",
        type=int,
        default=None,
        help=par_doc["data_parallel_size_local"],
    )
    p.add_argument(
        "-dpr",
        "--data-parallel-start-rank",
        type=int,
        default=0,
        help=par_doc["data_parallel_start_rank"],
    )
    p.add_argument(
        "-dpa", "--data-parallel-address", default=None, help=par_doc["data_parallel_address"]
    )
    p.add_argument(
        "-dpp",
        "--data-parallel-rpc-port",
        type=int,
        default=None,
        help=par_doc["data_parallel_rpc_port"],
    )
    p.add_argument(
        "--headless",
        action="store_true",
        help="run only this host's engine cores (no API server); they connect to the front end "
        "at --data-parallel-address:--data-parallel-rpc-port",
    )
    p.add_argument(
        "-asc",
        "--api-server-count",
        type=int,
        default=None,
        help="API server processes sharing the HTTP port and all engine cores (default: the "
        "data parallel size)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("TREADLE_API_KEY"),
        help="require this key as `Authorization: Bearer KEY` (default: $TREADLE_API_KEY)",
    )
    front_doc = cli_docs(FrontendConfig)
    p.add_argument(
        "--max-request-body-bytes",
        type=parse_bytes,
        default=FrontendConfig.max_request_body_bytes,
        help=front_doc["max_request_body_bytes"] + " Accepts 8MiB or bytes (default 8MiB).",
    )
    p.add_argument("--max-prompt-chars", type=int, default=None, help=front_doc["max_prompt_chars"])
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help=front_doc["trust_request_chat_template"],
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (`tool_choice: "auto"`, the default when '
        "a request has tools); needs --tool-call-parser",
    )
    p.add_argument("--tool-call-parser", default=None, help=front_doc["tool_call_parser"])
    p.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help=front_doc["exclude_tools_when_tool_choice_none"],
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=0.0,
        help="on SIGTERM, seconds to let running requests finish before aborting them",
    )
    restart_doc = cli_docs(RestartConfig)
    for flag, kind in (
        ("max_engine_restarts", int),
        ("engine_stall_timeout", float),
        ("engine_stall_kill_timeout", float),
    ):
        p.add_argument(
            "--" + flag.replace("_", "-"),
            type=kind,
            default=getattr(RestartConfig, flag),
            help=restart_doc[flag] + f" (default {getattr(RestartConfig, flag)})",
        )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level",
    )
    p.set_defaults(func=serve)


def check_tool_flags(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> None:
    """vLLM's rule: auto tool choice needs a parser, and a parser is named from the list.
    Raises ValueError."""
    from treadle.entrypoints.openai.tool_calls import get_tool_parser

    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (e.g. hermes)")
    if tool_call_parser is not None:
        get_tool_parser(tool_call_parser)
        if not enable_auto_tool_choice:
            print(
                "treadle serve: warning: --tool-call-parser is used only with "
                '--enable-auto-tool-choice; without it tool_choice "auto" is refused',
                file=sys.stderr,
            )


def check_restart_config(c: RestartConfig) -> None:
    """Raises ValueError for a restart or stall setting that cannot work."""
    if c.max_engine_restarts < 0:
        raise ValueError(f"--max-engine-restarts must be 0 or more, not {c.max_engine_restarts}")
    if not 0 < c.engine_stall_timeout < float("inf"):
        raise ValueError(f"--engine-stall-timeout must be positive, not {c.engine_stall_timeout}")
    kill = c.engine_stall_kill_timeout
    if not (kill == 0 or c.engine_stall_timeout <= kill < float("inf")):
        raise ValueError(
            f"--engine-stall-kill-timeout must be 0 (never) or at least --engine-stall-timeout "
            f"({c.engine_stall_timeout}), not {kill}"
        )


def serve(args: argparse.Namespace) -> int:
    # The CLI starts children with spawn unless told otherwise (ARCHITECTURE §7).
    os.environ.setdefault("TREADLE_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("TREADLE_LOGGING_LEVEL", args.log_level.upper())
    from treadle.cli.supervise import bind_http_socket
    from treadle.config import resolve_model
    from treadle.entrypoints.openai.api_server import run_server
    from treadle.executor.multiproc import check_parallel_layout
    from treadle.frontend.async_llm import AsyncLLM
    from treadle.ipc.process import set_process_title
    from treadle.worker.worker import check_config, model_arch

    api_servers = (
        args.data_parallel_size if args.api_server_count is None else args.api_server_count
    )
    if args.headless:
        set_process_title("Headless")
    elif api_servers > 1:
        set_process_title("APIServerSupervisor")
    else:
        set_process_title("APIServer_0")

    def stop(signum: int, frame: Any) -> None:  # until uvicorn installs its own handlers
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    if args.pipeline_parallel_size != 1:
        print(
            "treadle serve: error: pipeline parallelism is not supported yet: use --pipeline-parallel-size 1",
            file=sys.stderr,
        )
        return 2
    try:
        source = resolve_model(args.model)
        config = EngineConfig(
            model=ModelConfig(
                model=source.path,
                served_model_name=args.served_model_name,
                dtype=args.dtype,
                max_model_len=args.max_model_len,
                seed=args.seed,
                max_logprobs=args.max_logprobs,
            ),
            cache=CacheConfig(args.block_size, args.kv_cache_memory, args.enable_prefix_caching),
            scheduler=SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens),
            parallel=ParallelConfig(
                args.tensor_parallel_size,
                args.pipeline_parallel_size,
                args.data_parallel_size,
                args.data_parallel_size_local,
                args.data_parallel_start_rank,
                args.data_parallel_address,
                args.data_parallel_rpc_port,
                args.cpu_threads,
            ),
            frontend=FrontendConfig(
                args.max_request_body_bytes,
                args.max_prompt_chars,
                args.trust_request_chat_template,
                args.tool_call_parser if args.enable_auto_tool_choice else None,
                args.exclude_tools_when_tool_choice_none,
            ),
            restart=RestartConfig(
                args.max_engine_restarts, args.engine_stall_timeout, args.engine_stall_kill_timeout
            ),
        )
        check_restart_config(config.restart)
        config.parallel.check()
        check_tool_flags(args.enable_auto_tool_choice, args.tool_call_parser)
        if api_servers < 1 and not args.headless:
            raise ValueError(f"--api-server-count must be at least 1, not {api_servers}")
        if args.tensor_parallel_size > 1:
            check_parallel_layout(model_arch(source), args.tensor_parallel_size)
        check_config(config)  # dtype, max_model_len, KV budget: before any process starts
        name = args.served_model_name or (
            DEFAULT_MODEL_NAME
            if args.model is None
            else os.path.basename(os.path.normpath(args.model))
        )
        if args.headless:
            from treadle.cli.supervise import run_headless

            return run_headless(config, args.shutdown_timeout)
        sock = bind_http_socket(args.host, args.port)  # a port in use fails before loading
        if api_servers > 1:
            from treadle.cli.supervise import run_api_servers

            return run_api_servers(config, name, source.path, api_servers, args, sock)
        engine = AsyncLLM(config, name, shutdown_timeout=args.shutdown_timeout)
    except KeyboardInterrupt:
        return 0
    except (ValueError, FileNotFoundError) as e:  # what the user asked for cannot work
        print(f"treadle serve: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        print(f"treadle serve: error: {e}", file=sys.stderr)
        return 1
    port = sock.getsockname()[1]
    return run_server(
        engine, name, source.path, args.host, port, args.api_key, args.log_level, sock=sock
    )
