"""`FrontendArgs`: the options of the HTTP server (vLLM's names), which `treadle serve` adds
beside `EngineArgs`'s. The API server reads them from this frozen object (it travels to extra
API server processes as it is); the part the front end's engine client needs goes into the
`FrontendConfig` (`frontend_config()`)."""

from __future__ import annotations

import argparse
import json
import os
import typing
from dataclasses import dataclass

from treadle.config import EngineConfig, FrontendConfig, RestartConfig
from treadle.engine_args import arg, from_namespace, parse_bytes
from treadle.entrypoints.openai.reasoning import check_reasoning_parser
from treadle.frontend.loras import llamacpp_flag_refusal, parse_lora_module

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def str_list(text: str) -> tuple[str, ...]:
    """vLLM's JSON list (`'["http://a.example"]'`), or comma-separated names."""
    text = text.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {text!r} ({e})") from None
        return tuple(str(item) for item in items)
    return tuple(item.strip() for item in text.split(",") if item.strip())


@dataclass(frozen=True)
class FrontendArgs:
    host: str = arg("127.0.0.1", group="frontend")
    """Address to listen on."""
    port: int = arg(8000, group="frontend")
    """Port to listen on (0: the OS picks one, and the log says which)."""
    api_key: str | None = arg(None, group="frontend")
    """Require this key as `Authorization: Bearer KEY` on /v1, /topology and /dashboard/events (default: $TREADLE_API_KEY)."""
    uvicorn_log_level: str = arg("info", group="frontend", choices=UVICORN_LOG_LEVELS)
    """Log level of uvicorn (its access log included)."""
    disable_uvicorn_access_log: bool = arg(False, group="frontend")
    """No access log line per HTTP request."""
    allowed_origins: tuple[str, ...] = arg((), group="frontend", type=str_list)
    """CORS: origins whose browser pages may call the API (a JSON list, or comma-separated; `*` for any). Default: none, so no CORS headers are sent (vLLM allows any)."""
    allowed_methods: tuple[str, ...] = arg(("*",), group="frontend", type=str_list)
    """CORS: HTTP methods allowed to those origins."""
    allowed_headers: tuple[str, ...] = arg(("*",), group="frontend", type=str_list)
    """CORS: request headers allowed to those origins."""
    allow_credentials: bool = arg(False, group="frontend")
    """CORS: allow credentials (cookies, Authorization)."""
    ssl_keyfile: str | None = arg(None, group="frontend")
    """Serve HTTPS with this private key file (with --ssl-certfile)."""
    ssl_certfile: str | None = arg(None, group="frontend")
    """Serve HTTPS with this certificate file (with --ssl-keyfile)."""
    ssl_ca_certs: str | None = arg(None, group="frontend")
    """CA certificates file to verify client certificates with."""
    root_path: str = arg("", group="frontend")
    """The path prefix under which a proxy serves this server (FastAPI's root_path): the API docs and the OpenAPI servers list use it."""
    disable_fastapi_docs: bool = arg(False, group="frontend")
    """No /docs, /redoc and /openapi.json."""
    chat_template: str | None = arg(None, group="frontend")
    """A chat template file, or the template itself, to use instead of the tokenizer's."""
    enable_log_requests: bool = arg(False, group="frontend", area=FrontendConfig)
    trust_request_chat_template: bool = arg(False, group="frontend", area=FrontendConfig)
    enable_auto_tool_choice: bool = arg(False, group="frontend")
    """Let the model decide when to call tools (`tool_choice: "auto"`, the default when a request has tools); needs --tool-call-parser."""
    tool_call_parser: str | None = arg(None, group="frontend", area=FrontendConfig)
    exclude_tools_when_tool_choice_none: bool = arg(False, group="frontend", area=FrontendConfig)
    reasoning_parser: str | None = arg(None, group="frontend", area=FrontendConfig)
    parallel: int | None = arg(None, "-np", "--parallel", group="frontend", area=FrontendConfig)
    max_request_body_bytes: int = arg(
        FrontendConfig.max_request_body_bytes,
        group="frontend",
        type=parse_bytes,
    )
    """Largest HTTP request body; a larger one gets 413. Accepts 8MiB or bytes (default 8MiB)."""
    max_prompt_chars: int | None = arg(None, group="frontend", area=FrontendConfig)
    lora_modules: tuple[str, ...] = arg((), group="frontend", area=FrontendConfig, nargs="+")
    lora: tuple[str, ...] = arg((), group="frontend", nargs="+")
    """llama.cpp's --lora FNAME: refused, saying what to give instead (docs/lora.md)."""
    allowed_local_media_path: str | None = arg(None, group="frontend", area=FrontendConfig)
    allowed_media_domains: tuple[str, ...] = arg(
        (), group="frontend", area=FrontendConfig, nargs="+"
    )
    headless: bool = arg(False, group="parallel")
    """Run only this host's engine cores (no API server); they connect to the front end at --data-parallel-address:--data-parallel-rpc-port."""
    api_server_count: int | None = arg(None, "-asc", "--api-server-count", group="parallel")
    """API server processes sharing the HTTP port and all engine cores (default: the data parallel size)."""
    shutdown_timeout: float = arg(0.0, group="frontend")
    """On SIGTERM, seconds to let running requests finish before aborting them."""
    log_level: str = arg("info", group="frontend", choices=("debug", "info", "warning", "error"))
    """Log level of treadle's own logs (TREADLE_LOGGING_LEVEL wins)."""
    max_engine_restarts: int = arg(
        RestartConfig.max_engine_restarts, group="frontend", area=RestartConfig
    )
    engine_stall_timeout: float = arg(
        RestartConfig.engine_stall_timeout, group="frontend", area=RestartConfig
    )
    engine_stall_kill_timeout: float = arg(
        RestartConfig.engine_stall_kill_timeout, group="frontend", area=RestartConfig
    )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> FrontendArgs:
        """The options, with `$TREADLE_API_KEY` for a missing --api-key; raises `ValueError`
        for what cannot work (a missing SSL file, a half SSL pair, a template not found)."""
        self = typing.cast(FrontendArgs, from_namespace(cls, args))
        if self.api_key is None and os.environ.get("TREADLE_API_KEY"):
            self = FrontendArgs(**{**vars(self), "api_key": os.environ["TREADLE_API_KEY"]})
        self.check()
        return self

    def check(self) -> None:
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
        for flag, path in (
            ("--ssl-keyfile", self.ssl_keyfile),
            ("--ssl-certfile", self.ssl_certfile),
            ("--ssl-ca-certs", self.ssl_ca_certs),
        ):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{flag} {path!r}: no such file")
        if self.root_path and not self.root_path.startswith("/"):
            raise ValueError(f"--root-path must start with '/', not {self.root_path!r}")
        self.chat_template_text()
        check_reasoning_parser(self.reasoning_parser)
        if self.parallel is not None and self.parallel < 1:
            raise ValueError(f"--parallel (-np) must be at least 1, not {self.parallel}")
        self.restart_config().check()
        for module in self.lora_modules:
            parse_lora_module(module)  # (raises ValueError with what to change)
        for path in self.lora:
            raise ValueError(llamacpp_flag_refusal("--lora", path))
        media = self.allowed_local_media_path
        if media is not None and not os.path.isdir(os.path.expanduser(media)):
            raise ValueError(f"--allowed-local-media-path {media!r}: not a directory")

    def api_servers(self, config: EngineConfig) -> int:
        """How many API servers share the HTTP port (`--api-server-count`, default the data
        parallel size)."""
        count = self.api_server_count
        return config.parallel.data_parallel_size if count is None else count

    def chat_template_text(self) -> str | None:
        """--chat-template as vLLM reads it: a file's contents, or the template itself."""
        value = self.chat_template
        if value is None:
            return None
        path = os.path.expanduser(value)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return f.read()
        if any(mark in value for mark in ("{{", "{%")):
            return value.encode().decode("unicode_escape") if "\\n" in value else value
        raise ValueError(
            f"--chat-template {value!r}: no such file, and not a Jinja template either"
        )

    def frontend_config(self) -> FrontendConfig:
        return FrontendConfig(
            max_request_body_bytes=self.max_request_body_bytes,
            max_prompt_chars=self.max_prompt_chars,
            trust_request_chat_template=self.trust_request_chat_template,
            tool_call_parser=self.tool_call_parser if self.enable_auto_tool_choice else None,
            exclude_tools_when_tool_choice_none=self.exclude_tools_when_tool_choice_none,
            reasoning_parser=self.reasoning_parser,
            parallel=self.parallel,
            chat_template=self.chat_template_text(),
            enable_log_requests=self.enable_log_requests,
            lora_modules=tuple(
                (m.name, m.path, m.base_model_name)
                for m in map(parse_lora_module, self.lora_modules)
            ),
            allowed_local_media_path=None
            if self.allowed_local_media_path is None
            else os.path.realpath(os.path.expanduser(self.allowed_local_media_path)),
            allowed_media_domains=tuple(
                d.strip().lower().rstrip(".")
                for item in self.allowed_media_domains
                for d in str_list(item)
            ),
        )

    def restart_config(self) -> RestartConfig:
        return RestartConfig(
            self.max_engine_restarts, self.engine_stall_timeout, self.engine_stall_kill_timeout
        )

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"
