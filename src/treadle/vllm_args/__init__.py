"""vLLM's arguments that treadle has no use for (`VLLM_ARGS`): accepted with a warning, or
refused with the reason, from the CLI and from `LLM(**kwargs)` alike (`engine_args.py` reads
them beside its own)."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

GROUP_TITLE = "vLLM arguments without effect here (accepted with a warning) or refused"


@dataclass(frozen=True)
class VllmArg:
    """A vLLM argument treadle has no use for. `refuse`: it cannot be honoured (start-up
    error); otherwise a warning. `fine`: values that mean what treadle does anyway (silent).
    `kind`: how the CLI reads it: "flag" (no value), "bool" (--x / --no-x) or "value"."""

    note: str
    kind: str = "value"
    refuse: bool = False
    fine: tuple[Any, ...] = ()
    flags: tuple[str, ...] = ()


VLLM_ARGS: dict[str, VllmArg] = {
    "gpu_memory_utilization": VllmArg(
        "treadle sizes the KV cache by --kv-cache-memory-bytes (1 GiB on the CPU by default, "
        "90% of free memory on CUDA)"
    ),
    "enforce_eager": VllmArg(
        "treadle always runs eagerly (no CUDA graphs, no torch.compile)", "flag", fine=(False,)
    ),
    "trust_remote_code": VllmArg(
        "treadle runs its own code for the architectures it supports (Llama, Mistral, Qwen2, "
        "Qwen3, SmolLM) and never loads a model's code",
        "flag",
        fine=(False,),
    ),
    "download_dir": VllmArg(
        "treadle never downloads weights: give a local directory or .gguf file"
    ),
    "swap_space": VllmArg("preempted requests are recomputed, never swapped to CPU memory"),
    "cpu_offload_gb": VllmArg("weights stay where the model runs", fine=(0,)),
    "disable_custom_all_reduce": VllmArg(
        "tensor parallelism all-reduces with torch.distributed (gloo on the CPU)",
        "flag",
        fine=(False,),
    ),
    "max_seq_len_to_capture": VllmArg("there are no CUDA graphs to capture"),
    "compilation_config": VllmArg(
        "nothing is compiled by torch.compile", flags=("-O", "--compilation-config")
    ),
    "tokenizer_mode": VllmArg("the Hugging Face fast tokenizer is used", fine=("auto",)),
    "load_format": VllmArg(
        "weights load from safetensors or GGUF by the kind of file",
        fine=("auto", "safetensors", "gguf"),
    ),
    "revision": VllmArg("treadle loads the local files as they are"),
    "code_revision": VllmArg("treadle loads no model code"),
    "tokenizer_revision": VllmArg("treadle loads the local tokenizer files as they are"),
    "hf_token": VllmArg("treadle never contacts the Hugging Face hub"),
    "device": VllmArg("treadle runs on CUDA when present, else on the CPU", fine=("auto",)),
    "async_scheduling": VllmArg(
        "the engine core's IO threads already overlap the step", "flag", fine=(False,)
    ),
    "enable_expert_parallel": VllmArg(
        "treadle runs dense models only",
        "flag",
        fine=(False,),
        flags=("-ep", "--enable-expert-parallel"),
    ),
    "disable_log_requests": VllmArg(
        "requests are logged only with --enable-log-requests", "flag", fine=(True, False)
    ),
    "guided_decoding_backend": VllmArg("structured outputs always run on llguidance"),
    "structured_outputs_config": VllmArg("structured outputs always run on llguidance"),
    "max_log_len": VllmArg("--enable-log-requests logs prompt lengths, not prompts"),
    "enable_chunked_prefill": VllmArg(
        "chunked prefill is always on", "bool", refuse=True, fine=(True,)
    ),
    "quantization": VllmArg(
        "treadle runs the quantizations of a GGUF file (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K ...) and no "
        "other method",
        refuse=True,
        fine=(None, "gguf"),
        flags=("-q", "--quantization"),
    ),
    "enable_reasoning": VllmArg(
        "vLLM's old spelling: use --reasoning-parser NAME alone (deepseek_r1 or qwen3)",
        "flag",
        refuse=True,
        fine=(False,),
    ),
    "rope_scaling": VllmArg("RoPE scaling cannot be overridden", refuse=True),
    "middleware": VllmArg("custom ASGI middleware is not supported", refuse=True),
}


def suggest(name: str, known: Iterable[str], prefix: str = "") -> str:
    """`"; did you mean 'max_num_seqs'?"` for the closest known name, or ''."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"; did you mean {prefix}{close[0]!r}?" if close else ""


def check_vllm_args(given: dict[str, Any], cli: bool = False) -> list[str]:
    """The warnings about the vLLM-only arguments `given` (name -> value); raises
    `ValueError` for one that cannot be honoured."""
    warnings = []
    for name, value in given.items():
        spec = VLLM_ARGS[name]
        if value in spec.fine:
            continue
        shown = "--" + name.replace("_", "-") if cli else name
        if cli and spec.kind != "value":  # a flag: its name says it all
            if value is False:
                shown = "--no-" + shown[2:]
        else:
            shown = f"{shown}={value!r}"
        if spec.refuse:
            raise ValueError(f"{shown} cannot be honoured: {spec.note}")
        warnings.append(f"{shown.split('=')[0]} has no effect: {spec.note}")
    return warnings


def add_vllm_cli_args(parser: argparse.ArgumentParser, groups: dict[str, Any]) -> None:
    """The `VLLM_ARGS` as options that appear in the namespace only when given."""
    group = groups.setdefault("vllm", parser.add_argument_group(GROUP_TITLE))
    for name, spec in VLLM_ARGS.items():
        flags = spec.flags or ("--" + name.replace("_", "-"),)
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS}
        if spec.refuse:
            fine = ", ".join(str(v) for v in spec.fine if v not in (None, True, False))
            doc = f"refused{f' (except {fine})' if fine else ''}: {spec.note}"
        else:
            doc = f"no effect: {spec.note}"
        kwargs["help"] = doc.replace("%", "%%")
        if spec.kind == "flag":
            kwargs["action"] = "store_true"
        elif spec.kind == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        group.add_argument(*flags, **kwargs)


def vllm_args_given(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in VLLM_ARGS if hasattr(args, name)}
