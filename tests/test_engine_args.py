"""`EngineArgs`: one source for `treadle serve`'s options and `LLM(**kwargs)`, with vLLM's
names and aliases; vLLM arguments without meaning here warn, those that cannot be honoured are
refused, unknown ones name the closest known one."""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import fields
from pathlib import Path

import pytest

from treadle.cli.main import build_parser, main
from treadle.cli.serve import prepare
from treadle.config import CacheConfig, ModelConfig, SchedulerConfig
from treadle.engine_args import VLLM_ARGS, EngineArgs, check_vllm_args


@functools.cache
def _parser() -> argparse.ArgumentParser:
    return build_parser()  # (a third of a second each: built once)


def parse(*argv: str) -> argparse.Namespace:
    args, extras = _parser().parse_known_args(["serve", *argv])
    assert extras == [], extras
    return args


def test_defaults_are_the_configs_defaults() -> None:
    config = EngineArgs().create_engine_config()
    assert config.model.dtype == ModelConfig.dtype and config.model.seed == ModelConfig.seed
    assert config.cache == CacheConfig()
    assert config.scheduler == SchedulerConfig()
    assert config.model.model is not None and config.model.model.endswith(".gguf")


def test_every_field_is_a_serve_option_with_help() -> None:
    actions = {
        a.dest: a for a in build_parser()._subparsers._group_actions[0].choices["serve"]._actions
    }  # type: ignore[union-attr]
    for f in fields(EngineArgs):
        assert f.name in actions, f.name
        assert actions[f.name].help, f.name


def test_model_positional_or_option() -> None:
    assert EngineArgs.from_cli_args(parse("/m")).model == "/m"
    assert EngineArgs.from_cli_args(parse("--model", "/m")).model == "/m"
    assert EngineArgs.from_cli_args(parse()).model is None
    with pytest.raises(ValueError, match="given twice"):
        EngineArgs.from_cli_args(parse("/a", "--model", "/b"))


def test_vllm_aliases() -> None:
    a = EngineArgs.from_cli_args(parse("--kv-cache-memory-bytes", "1073741824", "--dtype", "half"))
    assert a.kv_cache_memory == 1 << 30 and a.dtype == "half"
    assert EngineArgs.from_cli_args(parse("--kv-cache-memory", "2GiB")).kv_cache_memory == 2 << 30
    args, _ = EngineArgs.from_kwargs(kv_cache_memory_bytes=1 << 20)
    assert args.kv_cache_memory == 1 << 20


def test_groups_in_help_are_vllms() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    titles = [g.title for g in serve._action_groups]
    for title in ("model", "cache", "parallel", "scheduler", "frontend"):
        assert title in titles


def test_misspelt_flag_names_the_closest(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--max-num-seq", "8"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == (  # one line for the command used (no usage dump)
        "treadle serve: error: unrecognized arguments: --max-num-seq; "
        "did you mean '--max-num-seqs'?\n"
    )


def test_misspelt_kwarg_names_the_closest() -> None:
    with pytest.raises(TypeError, match="did you mean 'max_num_seqs'"):
        EngineArgs.from_kwargs(max_num_seq=8)
    with pytest.raises(TypeError, match="did you mean 'gpu_memory_utilization'"):
        EngineArgs.from_kwargs(gpu_memory_utilisation=0.5)


def test_vllm_kwargs_warn_and_refuse() -> None:
    args, warnings = EngineArgs.from_kwargs(
        gpu_memory_utilization=0.5, enforce_eager=True, trust_remote_code=True, max_num_seqs=8
    )
    assert args.max_num_seqs == 8
    assert len(warnings) == 3 and all("has no effect" in w for w in warnings)
    assert "kv-cache-memory-bytes" in warnings[0]
    assert EngineArgs.from_kwargs(kv_cache_dtype="auto", enable_chunked_prefill=True)[1] == []
    with pytest.raises(ValueError, match="enable_chunked_prefill=False cannot be honoured"):
        EngineArgs.from_kwargs(enable_chunked_prefill=False)


# vLLM's most used `serve` flags (from its docs and common deployment recipes), with a value.
VLLM_FLAGS = [
    ["--model", "MODEL"],
    ["--served-model-name", "m"],
    ["--host", "127.0.0.1"],
    ["--port", "0"],
    ["--api-key", "k"],
    ["--dtype", "half"],
    ["--dtype", "float"],
    ["--max-model-len", "256"],
    ["--gpu-memory-utilization", "0.9"],
    ["--tensor-parallel-size", "1"],
    ["--pipeline-parallel-size", "1"],
    ["--data-parallel-size", "1"],
    ["--max-num-seqs", "8"],
    ["--max-num-batched-tokens", "512"],
    ["--enable-prefix-caching"],
    ["--enable-chunked-prefill"],
    ["--trust-remote-code"],
    ["--enforce-eager"],
    ["--kv-cache-dtype", "auto"],
    ["--quantization", "gguf"],
    ["--download-dir", "/tmp"],
    ["--seed", "1"],
    ["--block-size", "16"],
    ["--swap-space", "4"],
    ["--chat-template", "{{ messages[0]['content'] }}"],
    ["--tokenizer", "TOKENIZER"],
    ["--generation-config", "vllm"],
    ["--disable-log-stats"],
    ["--disable-log-requests"],
    ["--enable-log-requests"],
    ["--uvicorn-log-level", "warning"],
    ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
    ["--max-logprobs", "5"],
    ["--allowed-origins", '["http://a.example"]'],
    ["--root-path", "/x"],
    ["--disable-fastapi-docs"],
    ["--kv-cache-memory-bytes", "1073741824"],
    ["--tokenizer-mode", "auto"],
    ["--load-format", "auto"],
    ["--distributed-executor-backend", "mp"],
    ["--disable-custom-all-reduce"],
    ["--max-seq-len-to-capture", "8192"],
    ["--cpu-offload-gb", "0"],
    ["--revision", "main"],
    ["--device", "cpu"],
    ["--api-server-count", "1"],
]
REFUSED = [
    ["--quantization", "awq"],
    ["--no-enable-chunked-prefill"],
    ["--enable-reasoning"],
]


@pytest.mark.parametrize("flags", VLLM_FLAGS, ids=lambda f: f[0])
def test_a_vllm_flag_is_accepted_or_warned(
    flags: list[str], default_model_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = str(Path(default_model_path).parent)
    flags = [{"MODEL": default_model_path, "TOKENIZER": model_dir}.get(f, f) for f in flags]
    model = [] if flags[0] == "--model" else [default_model_path]
    config, server, name = prepare(parse(*model, *flags), warn=True)
    err = capsys.readouterr().err
    assert all(line.startswith("treadle serve: warning: ") for line in err.splitlines()), err
    assert config.model.model == default_model_path
    if flags[0] == "--dtype":
        assert config.model.dtype == flags[1]
    if flags[0] == "--root-path":
        assert server.root_path == "/x"
    if flags[0] == "--allowed-origins":
        assert server.allowed_origins == ("http://a.example",)


@pytest.mark.parametrize("flags", REFUSED, ids=lambda f: f[0])
def test_a_vllm_flag_that_cannot_be_honoured_is_refused(
    flags: list[str], default_model_path: str
) -> None:
    with pytest.raises(ValueError, match="cannot be honoured: "):
        prepare(parse(default_model_path, *flags))


def test_every_vllm_arg_is_a_flag_and_a_kwarg(default_model_path: str) -> None:
    for name, spec in VLLM_ARGS.items():
        flag = spec.flags[-1] if spec.flags else "--" + name.replace("_", "-")
        value = [] if spec.kind != "value" else ["1"]
        args = parse(default_model_path, flag, *value)
        assert hasattr(args, name), name
        given = True if spec.kind != "value" else "1"
        if not spec.refuse and given not in spec.fine:
            assert check_vllm_args({name: given}), name


def test_flags_that_need_files_are_refused(tmp_path: Path, default_model_path: str) -> None:
    for flags, words in (
        (["--ssl-keyfile", str(tmp_path / "k.pem")], "needs both --ssl-keyfile and"),
        (
            ["--ssl-keyfile", str(tmp_path / "k"), "--ssl-certfile", str(tmp_path / "c")],
            "no such file",
        ),
        (["--tokenizer", "org/hub-name"], "not a local directory"),
        (["--chat-template", "missing.jinja"], "no such file, and not a Jinja template"),
        (["--generation-config", str(tmp_path)], "holds a generation_config.json"),
        (["--root-path", "x"], "must start with '/'"),
    ):
        with pytest.raises(ValueError, match=words):
            prepare(parse(default_model_path, *flags))


def test_chat_template_file_or_inline(tmp_path: Path, default_model_path: str) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ 'from a file' }}")
    _, server, _ = prepare(parse(default_model_path, "--chat-template", str(path)))
    assert server.frontend_config().chat_template == "{{ 'from a file' }}"
    _, server, _ = prepare(parse(default_model_path, "--chat-template", "{{ 'inline' }}"))
    assert server.frontend_config().chat_template == "{{ 'inline' }}"


def test_cpu_activation_dtype_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """float32 by default; int8 as a flag or a kwarg; another value is refused naming the flag."""
    assert EngineArgs().create_engine_config().model.cpu_activation_dtype == "int8x2"
    for dtype in ("float32", "int8"):
        args = EngineArgs.from_cli_args(parse("--cpu-activation-dtype", dtype))
        assert args.create_engine_config().model.cpu_activation_dtype == dtype
    kwargs, _ = EngineArgs.from_kwargs(cpu_activation_dtype="int8")
    assert kwargs.create_engine_config().model.cpu_activation_dtype == "int8"
    with pytest.raises(SystemExit) as info:
        main(["serve", "--cpu-activation-dtype", "int4"])
    assert info.value.code == 2
    assert "--cpu-activation-dtype: invalid choice: 'int4'" in capsys.readouterr().err
    bad, _ = EngineArgs.from_kwargs(cpu_activation_dtype="bfloat16")
    with pytest.raises(ValueError, match="--cpu-activation-dtype 'bfloat16': choose one of"):
        bad.create_engine_config()


def test_speculative_config_from_the_command_line(default_model_path: str) -> None:
    config, _, _ = prepare(
        parse(
            default_model_path,
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 5}',
        )
    )
    assert config.speculative is not None and config.speculative.num_speculative_tokens == 5
    with pytest.raises(ValueError, match='choose "ngram" or "draft_model"'):
        prepare(parse(default_model_path, "--speculative-config", '{"method": "eagle"}'))
    draft = json.dumps({"method": "draft_model", "model": default_model_path})
    config, _, _ = prepare(parse(default_model_path, "--speculative-config", draft))
    assert config.speculative is not None and config.speculative.model == default_model_path
