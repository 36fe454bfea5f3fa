"""`treadle serve [MODEL]`: the OpenAI-compatible server, with vLLM's flag names."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from dataclasses import replace
from typing import Any

from treadle.config import EngineConfig, field_docs
from treadle.engine_args import (
    EngineArgs,
    add_cli_args,
    add_vllm_cli_args,
    check_vllm_args,
    parse_bytes,
    vllm_args_given,
)
from treadle.entrypoints.openai.cli_args import FrontendArgs

__all__ = ["add_serve_parser", "cli_docs", "parse_bytes", "serve"]


def cli_docs(cls: type) -> dict[str, str]:
    """`field_docs` made safe as argparse help (which %-formats it: `90%` would crash)."""
    return {name: doc.replace("%", "%%") for name, doc in field_docs(cls).items()}


def add_serve_parser(sub: Any) -> None:
    """`serve`'s options: `EngineArgs` and `FrontendArgs` fields, grouped as vLLM's `--help`
    (model, cache, parallel, scheduler, frontend), then vLLM's arguments that have no effect
    here or are refused. No abbreviations: a misspelt flag is an error that names the closest
    one (see `cli.main`)."""
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API, with vLLM's flag names.",
        allow_abbrev=False,
    )
    groups = add_cli_args(p, EngineArgs)
    add_cli_args(p, FrontendArgs, groups)
    add_vllm_cli_args(p, groups)
    p.set_defaults(func=serve)


def check_tool_flags(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> None:
    """vLLM's rule: auto tool choice needs a parser, and a parser is named from the list.
    Raises ValueError."""
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (e.g. hermes)")
    if tool_call_parser is not None:  # (the parsers' modules only then: they import pydantic)
        from treadle.entrypoints.openai.tool_calls import get_tool_parser

        get_tool_parser(tool_call_parser)
        if not enable_auto_tool_choice:
            print(
                "treadle serve: warning: --tool-call-parser is used only with "
                '--enable-auto-tool-choice; without it tool_choice "auto" is refused',
                file=sys.stderr,
            )


def prepare(args: argparse.Namespace, warn: bool = False) -> tuple[EngineConfig, FrontendArgs, str]:
    """The checked engine config, server options and the name responses report, before any process
    starts; raises `ValueError` (or `FileNotFoundError`) with one line saying what to change.
    `warn`: print a warning line per vLLM flag that has no effect here."""
    from treadle.config import resolve_model
    from treadle.worker.start_checks import check_config, check_parallel_layout, model_arch

    for warning in check_vllm_args(vllm_args_given(args), cli=True):
        if warn:
            print(f"treadle serve: warning: {warning}", file=sys.stderr)
    engine_args = EngineArgs.from_cli_args(args)
    server = FrontendArgs.from_cli_args(args)
    config = replace(
        engine_args.create_engine_config(server.frontend_config()),
        restart=server.restart_config(),
    )
    source = resolve_model(config.model.model)
    check_tool_flags(server.enable_auto_tool_choice, server.tool_call_parser)
    api_servers = (
        engine_args.data_parallel_size
        if server.api_server_count is None
        else server.api_server_count
    )
    if api_servers < 1 and not server.headless:
        raise ValueError(f"--api-server-count must be at least 1, not {api_servers}")
    nodes = config.parallel
    if nodes.nnodes > 1 and server.headless != (nodes.node_rank > 0):
        raise ValueError(
            "--node-rank 0 serves (it runs the engine core): drop --headless there"
            if server.headless
            else f"--node-rank {nodes.node_rank} runs only its ranks' workers: add --headless"
        )
    if engine_args.tensor_parallel_size > 1:
        check_parallel_layout(model_arch(source), engine_args.tensor_parallel_size)
    check_config(config)  # dtype, max_model_len, KV budget: before any process starts
    return config, server, config.model.served_model_name[0]


def serve(args: argparse.Namespace) -> int:
    # The CLI starts children with spawn unless told otherwise (ARCHITECTURE §7).
    os.environ.setdefault("TREADLE_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("TREADLE_LOGGING_LEVEL", args.log_level.upper())
    from treadle.cli.supervise import bind_http_socket
    from treadle.ipc.process import set_process_title

    api_servers = (
        args.data_parallel_size if args.api_server_count is None else args.api_server_count
    )
    if args.headless and args.nnodes > 1:
        set_process_title(f"Node_{args.node_rank}")
    elif args.headless:
        set_process_title("Headless")
    elif api_servers > 1:
        set_process_title("APIServerSupervisor")
    else:
        set_process_title("APIServer_0")

    def stop(signum: int, frame: Any) -> None:  # until uvicorn installs its own handlers
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        config, server, name = prepare(args, warn=True)
        if server.headless:
            from treadle.cli.supervise import run_headless

            return run_headless(config, server.shutdown_timeout)
        sock = bind_http_socket(server.host, server.port)  # a port in use fails before loading
        if api_servers > 1:
            from treadle.cli.supervise import run_api_servers

            model_path = config.model.model or ""
            return run_api_servers(config, name, model_path, api_servers, server, sock)
        # The HTTP server's modules only here: a supervisor or a headless CLI has no use for
        # them (FastAPI, pydantic, uvicorn: ~40 MiB of each one's memory).
        from treadle.entrypoints.openai.api_server import run_server
        from treadle.entrypoints.openai.starting import EngineStart
        from treadle.frontend.async_llm import AsyncLLM
        from treadle.frontend.startup import StartupProgress

        progress = StartupProgress(config.parallel.data_parallel_size)
        # Built while HTTP already serves (`/health/startup` follows its progress).
        start = EngineStart(
            lambda: AsyncLLM(config, name, server.shutdown_timeout, progress=progress), progress
        )
    except KeyboardInterrupt:
        return 0
    except (ValueError, FileNotFoundError) as e:  # what the user asked for cannot work
        print(f"treadle serve: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        print(f"treadle serve: error: {e}", file=sys.stderr)
        return 1
    port = sock.getsockname()[1]
    return run_server(start, name, config.model.model or "", server, port, sock=sock)
