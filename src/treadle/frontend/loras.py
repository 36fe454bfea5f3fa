"""The API server's LoRA adapters: names a request's `model` may give (vLLM's
`--lora-modules name=path`, and adapters loaded while serving with
`POST /v1/load_lora_adapter` when TREADLE_ALLOW_RUNTIME_LORA_UPDATING=1), each a
`LoRARequest` whose id is derived from its name and directory, so that every API server and
every engine core agrees on it without a word. llama.cpp's `GET`/`POST /lora-adapters` and
/completion's `"lora": [{"id", "scale"}]` reach the same adapters by their place in the list
(a scale of 1 or 0: treadle applies one adapter whole, at its own lora_alpha).

A directory given to the load endpoint must lie under a folder of `--lora-modules`' adapters
(its real path: `..` and symlinks out are refused); the engine cores read and check it (rank,
shapes, finite weights) before the name is taken, so a bad adapter is a 400 and nothing
else changes. An unloaded adapter's running requests finish first (`core/loras.py`)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from treadle import envs
from treadle.model.arch import ModelArch
from treadle.validation import InvalidRequest
from treadle.wire.engine import LoRARequest


@dataclass(frozen=True)
class LoRAModule:
    """One `--lora-modules` entry: `name=path` or vLLM's JSON form."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """`name=path` or `{"name": ..., "path": ..., "base_model_name": ...}`; raises
    `ValueError` with what to change."""
    text = text.strip()
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {text!r}: not JSON ({e})") from None
        if not isinstance(raw, dict) or set(raw) - {"name", "path", "base_model_name"}:
            raise ValueError(
                f'--lora-modules {text!r}: give {{"name": ..., "path": ..., "base_model_name": ...}}'
            )
        name, path, base = raw.get("name"), raw.get("path"), raw.get("base_model_name")
    else:
        name, sep, path = text.partition("=")
        base = None
        if not sep:
            raise ValueError(f"--lora-modules {text!r}: give name=path (or vLLM's JSON form)")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise ValueError(f"--lora-modules {text!r}: the name and the path must be non-empty")
    if base is not None and not isinstance(base, str):
        raise ValueError(f"--lora-modules {text!r}: base_model_name must be a string")
    return LoRAModule(name, os.path.abspath(os.path.expanduser(path)), base)


def lora_id(name: str, path: str) -> int:
    """The adapter's id: the same on every API server and engine core (31 bits of a sha256
    of its name and real path; 0 is never one)."""
    digest = hashlib.sha256(f"{name}\0{os.path.realpath(path)}".encode()).digest()
    return int.from_bytes(digest[:4], "little") % (2**31 - 1) + 1


def llamacpp_flag_refusal(flag: str, path: str) -> str:
    """The one line that refuses llama.cpp's `--lora FNAME` / `--lora-scaled FNAME SCALE`,
    saying what to give treadle instead."""
    kind = (
        "a GGUF adapter (llama.cpp's format), which treadle does not read"
        if path.endswith(".gguf") or os.path.isfile(path)
        else "an adapter"
    )
    return (
        f"{flag} {path}: {kind}; serve PEFT adapter directories (adapter_config.json + "
        "adapter_model.safetensors) with --enable-lora --lora-modules NAME=DIR, then name one "
        'per request ("model": NAME, or llama.cpp\'s "lora": [{"id", "scale"}]) or apply one '
        "to /completion with POST /lora-adapters"
    )


def runtime_updates_allowed() -> bool:
    """TREADLE_ALLOW_RUNTIME_LORA_UPDATING=1 (or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    return envs.allow_runtime_lora_updating()


EngineCall = Callable[[str, list[Any]], Awaitable[None]]
"""Calls a utility method with these arguments on every engine core (raises its refusal)."""


class FrontendLoRAs:
    def __init__(
        self, modules: tuple[LoRAModule, ...], base_names: tuple[str, ...], enabled: bool
    ) -> None:
        if modules and not enabled:
            raise ValueError("--lora-modules needs --enable-lora")
        self.enabled = enabled
        self.base_names = base_names
        self.adapters: dict[str, LoRARequest] = {}
        self.parents: dict[str, str] = {}
        self.roots = tuple(sorted({os.path.dirname(os.path.realpath(m.path)) for m in modules}))
        self.applied: str | None = None  # llama.cpp's endpoints' adapter (POST /lora-adapters)
        for module in modules:
            self._check_name(module.name)
            if not os.path.isdir(module.path):
                raise ValueError(f"--lora-modules {module.name}={module.path}: not a directory")
            self.adapters[module.name] = LoRARequest(
                module.name, lora_id(module.name, module.path), module.path
            )
            self.parents[module.name] = module.base_model_name or base_names[0]

    def check_files(self, arch: ModelArch, max_rank: int) -> None:
        """At start-up: each `--lora-modules` adapter is read and checked against the base
        model here, so a bad one stops the start with its reason (ValueError)."""
        from treadle.model.lora import LoRAError, lora_shapes, read_adapter  # (torch)

        for name, request in self.adapters.items():
            try:
                read_adapter(request.lora_path, max_rank, lora_shapes(arch), arch.num_layers)
            except LoRAError as e:
                raise ValueError(f"--lora-modules {name}: {e}") from None

    def _check_name(self, name: str) -> None:
        if name in self.base_names:
            raise InvalidRequest("lora_name", f"{name!r} is the base model's name")
        if name in self.adapters:
            raise InvalidRequest("lora_name", f"an adapter named {name!r} is already loaded")

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names, or None (the base model or unknown)."""
        return None if model is None else self.adapters.get(model)

    def cards(self) -> list[tuple[str, str, str]]:
        """(name, its directory, its parent model) of each adapter, for /v1/models."""
        return [(n, r.lora_path, self.parents[n]) for n, r in self.adapters.items()]

    async def load_all(self, call: EngineCall) -> None:
        """At start-up: every engine reads every `--lora-modules` adapter (a bad one fails
        the start with its reason)."""
        for request in self.adapters.values():
            await call("add_lora", [[request.lora_name, request.lora_int_id, request.lora_path]])

    async def load(self, name: object, path: object, call: EngineCall) -> LoRARequest:
        """`POST /v1/load_lora_adapter`: check, have every engine read it, take the name."""
        self._check_allowed()
        if not isinstance(name, str) or not name:
            raise InvalidRequest("lora_name", "must be a non-empty string")
        if not isinstance(path, str) or not path:
            raise InvalidRequest("lora_path", "must be a non-empty string")
        self._check_name(name)
        real = os.path.realpath(os.path.expanduser(path))
        if not any(os.path.commonpath([real, root]) == root for root in self.roots):
            where = ", ".join(self.roots) or "none: start with --lora-modules"
            raise InvalidRequest(
                "lora_path", f"{path!r} is outside the folders of --lora-modules ({where})"
            )
        if not os.path.isdir(real):
            raise InvalidRequest("lora_path", f"{path!r} is not a directory")
        request = LoRARequest(name, lora_id(name, real), real)
        await call("add_lora", [[request.lora_name, request.lora_int_id, request.lora_path]])
        self.adapters[name] = request
        self.parents[name] = self.base_names[0]
        return request

    async def unload(self, name: object, call: EngineCall) -> None:
        """`POST /v1/unload_lora_adapter`: the name goes now; its requests finish first."""
        self._check_allowed()
        if not isinstance(name, str) or name not in self.adapters:
            raise InvalidRequest("lora_name", f"no adapter named {name!r} is loaded")
        request = self.adapters.pop(name)
        self.parents.pop(name, None)
        if self.applied == name:
            self.applied = None
        await call("remove_lora", [request.lora_int_id])

    # -- llama.cpp's /lora-adapters and /completion's "lora" -------------------------------

    def llamacpp_list(self) -> list[dict[str, Any]]:
        """`GET /lora-adapters`: each adapter as `{"id", "path", "scale"}` (ids: the order
        /v1/models lists them in; scale 1 for the one applied to llama.cpp's endpoints)."""
        return [
            {"id": i, "path": r.lora_path, "scale": 1.0 if name == self.applied else 0.0}
            for i, (name, r) in enumerate(self.adapters.items())
        ]

    def llamacpp_set(self, entries: object) -> None:
        """`POST /lora-adapters` with `[{"id", "scale"}]`: the adapter that /completion and
        /infill apply when a request names none (a listed adapter's scale, 0 unless given)."""
        self.applied = self._chosen(entries, "body")

    def llamacpp_request(self, model: str | None, entries: object) -> LoRARequest | None:
        """The adapter of a llama.cpp request: its `lora` list, else its `model` if that
        names an adapter, else the one `POST /lora-adapters` applied."""
        named = self.resolve(model)
        if entries is not None:
            chosen = self._chosen(entries, "lora")
            picked = None if chosen is None else self.adapters[chosen]
            if named is not None and picked != named:
                raise InvalidRequest("lora", f"names another adapter than model {model!r}")
            return picked
        if named is not None or self.applied is None:
            return named
        return self.adapters.get(self.applied)

    def _chosen(self, entries: object, field: str) -> str | None:
        """The one adapter of `[{"id", "scale"}]` with a scale (None: none has one)."""
        if not isinstance(entries, list):
            raise InvalidRequest(field, 'must be a list of {"id": ..., "scale": ...}')
        names = list(self.adapters)
        chosen: list[str] = []
        for i, entry in enumerate(entries):
            where = f"{field}[{i}]"
            if not isinstance(entry, dict) or set(entry) - {"id", "scale"}:
                raise InvalidRequest(where, 'must be {"id": ..., "scale": ...}')
            lora_id, scale = entry.get("id"), entry.get("scale", 1.0)
            if not isinstance(lora_id, int) or isinstance(lora_id, bool):
                raise InvalidRequest(f"{where}.id", "must be an integer")
            if not 0 <= lora_id < len(names):
                raise InvalidRequest(f"{where}.id", f"no adapter {lora_id} (GET /lora-adapters)")
            if scale not in (0, 1) or isinstance(scale, bool):
                raise InvalidRequest(
                    f"{where}.scale",
                    f"{scale!r}: treadle applies an adapter whole (1) or not (0), at the "
                    "lora_alpha its adapter_config.json gives",
                )
            if scale == 1:
                chosen.append(names[lora_id])
        if len(chosen) > 1:
            raise InvalidRequest(field, "treadle applies one adapter to a request, not several")
        return chosen[0] if chosen else None

    def _check_allowed(self) -> None:
        if not self.enabled:
            raise InvalidRequest(
                "lora_name", "LoRA adapters are not enabled: start with --enable-lora"
            )
        if not runtime_updates_allowed():
            raise InvalidRequest(
                "lora_name",
                "loading adapters while serving is off: set TREADLE_ALLOW_RUNTIME_LORA_UPDATING=1",
            )
