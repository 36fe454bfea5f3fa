"""`EngineArgs`: the one list of engine arguments, with vLLM's names (as vLLM's `EngineArgs`).

Its fields generate `treadle serve`'s options (`add_cli_args`, help from the config docstrings),
are what `LLM(**kwargs)` accepts (`from_kwargs`), and build the `EngineConfig`
(`create_engine_config`). vLLM arguments that mean nothing here are accepted with a one-line
warning saying what treadle does instead, those that cannot be honoured are refused
(`VLLM_ARGS`, `check_vllm_args`), and an unknown one is an error naming the closest known name.
"""

from __future__ import annotations

import argparse
import os
import re
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from treadle.config import (
    CPU_ACTIVATION_DTYPES,
    KV_CACHE_DTYPES,
    CacheConfig,
    EngineConfig,
    FrontendConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    field_docs,
    resolve_model,
    served_names,
)
from treadle.ipc import cluster_auth
from treadle.validation import POOLING_TYPES, TENSOR_IPC_MODES
from treadle.vllm_args import (  # noqa: F401 - re-exported: the CLI and tests import them here
    GROUP_TITLE,
    VLLM_ARGS,
    VllmArg,
    add_vllm_cli_args,
    check_vllm_args,
    suggest,
    vllm_args_given,
)
from treadle.vllm_args.values import (
    MM_TENSOR_IPC,
    parse_generation_overrides,
    parse_hf_overrides,
    parse_mm_limit,
)

# Argument groups of `--help`, in vLLM's order.
GROUPS = {
    "model": "model",
    "cache": "cache",
    "parallel": "parallel",
    "scheduler": "scheduler",
    "frontend": "frontend",
    "vllm": GROUP_TITLE,
}


def parse_bytes(text: str | int) -> int:
    """`2147483648`, `2GiB`, `512MiB`, `1.5G` -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([\d.]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (try 2GiB or 2147483648)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def arg(
    default: Any,
    *flags: str,
    group: str,
    area: type | None = None,
    type: Callable[[str], Any] | None = None,
    choices: Iterable[str] | None = None,
    help: str | None = None,
    positional: str | None = None,
    nargs: str | None = None,
) -> Any:
    """A dataclass field that is also a command-line option. `flags`: its option strings
        (default `--field-name`); `area`: the config class whose docstring of the same field is
        the help; `positional`: also accepted as this positional argument (`serve MODEL`); `nargs`:
    argparse's, for a tuple field that takes several values after one flag."""
    meta = {
        "flags": flags,
        "group": group,
        "area": area,
        "type": type,
        "choices": tuple(choices) if choices else None,
        "help": help,
        "positional": positional,
        "nargs": nargs,
    }
    return field(default=default, metadata=meta)


def _value_type(cls: type, name: str) -> Any:
    """`int | None` -> int; `str` -> str."""
    hint = typing.get_type_hints(cls)[name]
    if isinstance(hint, types.UnionType):
        hint = next(t for t in typing.get_args(hint) if t is not type(None))
    return hint


def add_cli_args(
    parser: argparse.ArgumentParser, cls: type, groups: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Add an option per field of `cls` (fields made with `arg`) to `parser`, in argument
    groups; returns the groups (by key of `GROUPS`) so that another class can add to them."""
    groups = {} if groups is None else groups
    own_docs = field_docs(cls)
    for f in fields(cls):
        meta = f.metadata
        if "group" not in meta:
            continue
        if meta["group"] not in groups:
            groups[meta["group"]] = parser.add_argument_group(GROUPS[meta["group"]])
        group = groups[meta["group"]]
        doc = meta["help"] or own_docs.get(f.name) or ""
        if not doc and meta["area"] is not None:
            doc = field_docs(meta["area"]).get(f.name, "")
        doc = doc.replace("%", "%%")  # argparse %-formats help
        if meta["positional"]:
            group.add_argument(
                meta["positional"], nargs="?", default=None, metavar=f.name.upper(), help=doc
            )
            doc = f"same as the positional {f.name.upper()}"
        flags = meta["flags"] or ("--" + f.name.replace("_", "-"),)
        default = f.default
        kind = _value_type(cls, f.name)
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": doc}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction if default else "store_true"
        elif typing.get_origin(kind) is tuple:
            kwargs["type"] = meta["type"] or str
            if meta["nargs"]:
                kwargs["nargs"] = meta["nargs"]
        else:
            kwargs["type"] = meta["type"] or kind
            if meta["choices"]:
                kwargs["choices"] = meta["choices"]
        group.add_argument(*flags, **kwargs)
    return groups


def from_namespace(cls: type, args: argparse.Namespace) -> Any:
    """An instance of `cls` from the parsed options that `add_cli_args(cls)` added. A
    positional and its option (`serve M` and `--model M`) must agree."""
    values = {}
    for f in fields(cls):
        if "group" not in f.metadata:
            continue
        value = getattr(args, f.name)
        positional = f.metadata["positional"]
        given = getattr(args, positional, None) if positional else None
        if given is not None:
            if value is not None and value != given:
                raise ValueError(
                    f"the model is given twice ({given!r} and --{f.name} {value!r}): give one"
                )
            value = given
        values[f.name] = value
    return cls(**values)


@dataclass(frozen=True)
class EngineArgs:
    """Everything the engine needs, flat, with vLLM's names; `create_engine_config()` sorts
    it into the per-area configs."""

    model: str | None = arg(None, group="model", area=ModelConfig, positional="model_tag")
    served_model_name: tuple[str, ...] | str | None = arg(
        None, group="model", area=ModelConfig, nargs="+"
    )
    tokenizer: str | None = arg(None, group="model", area=ModelConfig)
    dtype: str = arg(ModelConfig.dtype, group="model", area=ModelConfig)
    max_model_len: int | None = arg(None, group="model", area=ModelConfig)
    seed: int = arg(ModelConfig.seed, group="model", area=ModelConfig)
    max_logprobs: int = arg(ModelConfig.max_logprobs, group="model", area=ModelConfig)
    generation_config: str = arg(ModelConfig.generation_config, group="model", area=ModelConfig)
    override_generation_config: Any = arg(None, group="model", area=ModelConfig, type=str)
    hf_overrides: Any = arg(None, group="model", area=ModelConfig, type=str)
    enable_prompt_embeds: bool = arg(
        ModelConfig.enable_prompt_embeds, group="model", area=ModelConfig
    )
    cpu_activation_dtype: str = arg(
        ModelConfig.cpu_activation_dtype,
        group="model",
        area=ModelConfig,
        choices=CPU_ACTIVATION_DTYPES,
    )
    tensor_ipc: str = arg(
        ModelConfig.tensor_ipc,
        "--tensor-ipc",
        "--mm-tensor-ipc",
        group="model",
        area=ModelConfig,
        choices=(*TENSOR_IPC_MODES, *MM_TENSOR_IPC),
    )
    limit_mm_per_prompt: int = arg(
        ModelConfig.limit_mm_per_prompt,
        group="model",
        type=parse_mm_limit,
        help=field_docs(ModelConfig)["limit_mm_per_prompt"] + ' Takes {"image": N} or N.',
    )
    pooling_type: str = arg(
        ModelConfig.pooling_type, group="model", area=ModelConfig, choices=POOLING_TYPES
    )
    block_size: int = arg(CacheConfig.block_size, group="cache", area=CacheConfig)
    kv_cache_memory: int | None = arg(
        None,
        "--kv-cache-memory",
        "--kv-cache-memory-bytes",
        group="cache",
        type=parse_bytes,
        help=field_docs(CacheConfig)["kv_cache_memory"]
        + " Accepts 2GiB, 512MiB or bytes (vLLM's --kv-cache-memory-bytes).",
    )
    enable_prefix_caching: bool = arg(
        CacheConfig.enable_prefix_caching, group="cache", area=CacheConfig
    )
    kv_cache_dtype: str = arg(
        CacheConfig.kv_cache_dtype, group="cache", area=CacheConfig, choices=KV_CACHE_DTYPES
    )
    speculative_config: Any = arg(
        None,
        "--speculative-config",
        group="scheduler",
        type=str,
        help='vLLM\'s JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
        '"prompt_lookup_min": 1, "prompt_lookup_max": 4}\' (n-gram prompt lookup) or '
        '\'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 3}\' (a smaller '
        "model with the same tokenizer): proposed tokens that one forward pass verifies "
        "(exact: greedy outputs unchanged, sampling keeps its distribution).",
    )
    enable_lora: bool = arg(
        False,
        group="model",
        help="Serve LoRA adapters of the base model (--lora-modules, the load endpoint, "
        "LLM(..., lora_request=...)), several in one batch.",
    )
    max_loras: int = arg(LoRAConfig.max_loras, group="model", area=LoRAConfig)
    max_lora_rank: int = arg(LoRAConfig.max_lora_rank, group="model", area=LoRAConfig)
    max_cpu_loras: int | None = arg(None, group="model", area=LoRAConfig)
    kv_cache_save_path: str | None = arg(
        None, "--kv-cache-save-path", "--slot-save-path", group="cache", area=CacheConfig
    )
    tensor_parallel_size: int = arg(
        1, "-tp", "--tensor-parallel-size", group="parallel", area=ParallelConfig
    )
    pipeline_parallel_size: int = arg(
        1, "-pp", "--pipeline-parallel-size", group="parallel", area=ParallelConfig
    )
    data_parallel_size: int = arg(
        1, "-dp", "--data-parallel-size", group="parallel", area=ParallelConfig
    )
    data_parallel_size_local: int | None = arg(
        None, "-dpl", "--data-parallel-size-local", group="parallel", area=ParallelConfig
    )
    data_parallel_start_rank: int = arg(
        0, "-dpr", "--data-parallel-start-rank", group="parallel", area=ParallelConfig
    )
    data_parallel_address: str | None = arg(
        None, "-dpa", "--data-parallel-address", group="parallel", area=ParallelConfig
    )
    data_parallel_rpc_port: int | None = arg(
        None, "-dpp", "--data-parallel-rpc-port", group="parallel", area=ParallelConfig
    )
    cpu_threads: int | None = arg(None, group="parallel", area=ParallelConfig)
    cluster_secret_file: str | None = arg(None, group="parallel", area=ParallelConfig)
    insecure_cluster: bool = arg(False, group="parallel", area=ParallelConfig)
    distributed_executor_backend: str = arg(
        ParallelConfig.distributed_executor_backend, group="parallel", area=ParallelConfig
    )
    nnodes: int = arg(1, group="parallel", area=ParallelConfig)
    node_rank: int = arg(0, group="parallel", area=ParallelConfig)
    master_addr: str = arg(ParallelConfig.master_addr, group="parallel", area=ParallelConfig)
    master_port: int | None = arg(None, group="parallel", area=ParallelConfig)
    max_num_seqs: int = arg(SchedulerConfig.max_num_seqs, group="scheduler", area=SchedulerConfig)
    max_num_batched_tokens: int = arg(
        SchedulerConfig.max_num_batched_tokens, group="scheduler", area=SchedulerConfig
    )
    disable_log_stats: bool = arg(False, group="frontend", area=FrontendConfig)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return typing.cast(EngineArgs, from_namespace(cls, args))

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> tuple[EngineArgs, list[str]]:
        """`LLM(**kwargs)`: vLLM's names and aliases; returns the args and the warnings about
        vLLM arguments that have no effect here. Raises `TypeError` for an unknown name
        (naming the closest known one) and `ValueError` for one that cannot be honoured."""
        known = {f.name for f in fields(cls)}
        ours, theirs = {}, {}
        for key, value in kwargs.items():
            key = KWARG_ALIASES.get(key, key)
            if key in known:
                ours[key] = value
            elif key in VLLM_ARGS:
                theirs[key] = value
            else:
                hint = suggest(key, [*known, *VLLM_ARGS, *KWARG_ALIASES])
                raise TypeError(f"LLM() got an unexpected keyword argument {key!r}{hint}")
        if isinstance(ours.get("kv_cache_memory"), str):
            ours["kv_cache_memory"] = parse_bytes(ours["kv_cache_memory"])
        return cls(**ours), check_vllm_args(theirs)

    def create_engine_config(self, frontend: FrontendConfig | None = None) -> EngineConfig:
        """The checked `EngineConfig` (the model path resolved to local files). Raises
        `ValueError` or `FileNotFoundError` with one line that says what to change; the checks
        that need the model's header run later (`start_checks.check_config`)."""
        if self.pipeline_parallel_size > 1 and self.speculative_config is not None:
            raise ValueError(
                "--speculative-config does not work with --pipeline-parallel-size > 1 yet"
            )
        source = resolve_model(self.model)
        if self.tokenizer is not None:
            path = os.path.expanduser(self.tokenizer)
            if not (os.path.isdir(path) or (os.path.isfile(path) and path.endswith(".gguf"))):
                raise ValueError(
                    f"--tokenizer {self.tokenizer!r}: not a local directory or .gguf file "
                    "(treadle never downloads tokenizers)"
                )
        gen = self.generation_config
        if gen not in ("auto", "vllm") and not os.path.isfile(
            os.path.join(os.path.expanduser(gen), "generation_config.json")
        ):
            raise ValueError(
                f"--generation-config {gen!r}: give auto, vllm or a directory that holds a "
                "generation_config.json"
            )
        tensor_ipc = MM_TENSOR_IPC.get(self.tensor_ipc, self.tensor_ipc)
        if tensor_ipc not in TENSOR_IPC_MODES:
            raise ValueError(
                f"--tensor-ipc {self.tensor_ipc!r}: choose one of {', '.join(TENSOR_IPC_MODES)}"
            )
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"--pooling-type {self.pooling_type!r}: choose one of {', '.join(POOLING_TYPES)}"
            )
        if self.cpu_activation_dtype not in CPU_ACTIVATION_DTYPES:
            raise ValueError(
                f"--cpu-activation-dtype {self.cpu_activation_dtype!r}: choose one of "
                f"{', '.join(CPU_ACTIVATION_DTYPES)}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"--kv-cache-dtype {self.kv_cache_dtype!r}: choose one of "
                f"{', '.join(KV_CACHE_DTYPES)} (vLLM's fp8 types are not supported)"
            )
        save_dir = self.kv_cache_save_path
        if save_dir is not None and not os.path.isdir(os.path.expanduser(save_dir)):
            raise ValueError(
                f"--kv-cache-save-path {save_dir!r}: not a directory (create it first)"
            )
        served, also = served_names(self.model, self.served_model_name)
        config = EngineConfig(
            model=ModelConfig(
                model=source.path,
                served_model_name=served,
                also_served_as=also,
                dtype=self.dtype,
                max_model_len=self.max_model_len,
                seed=self.seed,
                max_logprobs=self.max_logprobs,
                tokenizer=None if self.tokenizer is None else os.path.abspath(path),
                generation_config=gen,
                override_generation_config=parse_generation_overrides(
                    self.override_generation_config
                ),
                hf_overrides=parse_hf_overrides(self.hf_overrides),
                cpu_activation_dtype=self.cpu_activation_dtype,
                enable_prompt_embeds=self.enable_prompt_embeds,
                tensor_ipc=tensor_ipc,
                limit_mm_per_prompt=parse_mm_limit(self.limit_mm_per_prompt),
                pooling_type=self.pooling_type,
            ),
            cache=CacheConfig(
                self.block_size,
                self.kv_cache_memory,
                self.enable_prefix_caching,
                None
                if self.kv_cache_save_path is None
                else os.path.abspath(os.path.expanduser(self.kv_cache_save_path)),
                self.kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens),
            parallel=ParallelConfig(
                self.tensor_parallel_size,
                self.pipeline_parallel_size,
                self.data_parallel_size,
                self.data_parallel_size_local,
                self.data_parallel_start_rank,
                self.data_parallel_address,
                self.data_parallel_rpc_port,
                self.cpu_threads,
                cluster_secret_file=self.cluster_secret_file,
                insecure_cluster=self.insecure_cluster,
                distributed_executor_backend=self.distributed_executor_backend,
                nnodes=self.nnodes,
                node_rank=self.node_rank,
                master_addr=self.master_addr,
                master_port=self.master_port,
            ),
            frontend=replace(
                frontend or FrontendConfig(), disable_log_stats=self.disable_log_stats
            ),
            speculative=None
            if self.speculative_config is None
            else SpeculativeConfig.parse(self.speculative_config),
            lora=LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)
            if self.enable_lora
            else None,
        )
        config.parallel.check()
        if config.lora is not None:
            config.lora.check()
        if self.cluster_secret_file is not None:  # this process's and its children's
            cluster_auth.use_secret_file(self.cluster_secret_file)
        return config


# vLLM's keyword names that are another name of one of ours.
KWARG_ALIASES = {"kv_cache_memory_bytes": "kv_cache_memory"}
