"""Prompt caches on disk over HTTP (issue 26 item 2): llama.cpp's `POST /slots/{id}?action=
save|restore|erase` with `{"filename": ...}`, and treadle's own form that names the prompt
itself, `POST /prompt_cache/save` (`{"prompt": text or token ids, "filename": ...}`) and
`POST /prompt_cache/restore` (`{"filename": ...}`). Both need `--kv-cache-save-path DIR`.

Slots (issue 42 item 2) are llama-server's, per API server: `--parallel`/`-np` of them
(default `--max-num-seqs`). Each `/completion` and `/infill` takes one for its run: the
`id_slot` it names, else an idle one whose tokens share the longest common prefix with its
prompt (more than llama-server's default 10% of the prompt), else the least recently used idle
one; with none idle it waits, as llama-server defers a task. Its answer says which
(`id_slot`), and its prompt and output become the slot's tokens. `GET /slots` lists them with
llama-server's fields (`?fail_on_no_slot=1`: 503 when none is idle).

treadle's prefix cache is shared by all requests, so a slot is only a name for tokens: saving
the slot saves the KV of those tokens (the whole blocks the prefix cache still holds);
restoring puts a file's blocks in the prefix cache, where any request with that prompt finds
them, and makes its tokens the slot's; erasing forgets the slot's tokens (their blocks stay
cached until their space is needed).

With several engine cores (`-dp`), a prompt is saved from the engine that holds most of it
and restored into every engine. With TREADLE_SERVER_DEV_MODE=1, vLLM's `POST
/reset_prefix_cache` empties the prefix caches (to measure what a restore saves).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from treadle import envs
from treadle.entrypoints.openai.errors import APIError
from treadle.entrypoints.openai.openapi_responses import errors
from treadle.entrypoints.openai.serving import OpenAIServing
from treadle.validation import InvalidRequest, check_filename, check_prompt

KEYED_PATHS = ("/slots", "/prompt_cache", "/reset_prefix_cache")


class SlotFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    filename: str


class SavePrompt(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str | list[int]
    filename: str


SIMILARITY = 0.1
"""llama-server's `--slot-prompt-similarity` default: the share of a prompt that a slot's
tokens must start with for the slot to be picked for it by that prefix."""


@dataclass
class Slot:
    """One slot: its tokens, and while a request runs in it, that request's progress."""

    id: int
    tokens: list[int] = field(default_factory=list)
    id_task: int | None = None
    """The running request's task number; None while idle."""
    last_used: int = 0
    params: dict[str, Any] = field(default_factory=dict)
    n_prompt_tokens: int = 0
    n_decoded: int = 0
    n_remain: int = -1
    has_new_line: bool = False

    def json(self, n_ctx: int) -> dict[str, Any]:
        """llama-server's `GET /slots` entry."""
        return {
            "id": self.id,
            "id_task": -1 if self.id_task is None else self.id_task,
            "n_ctx": n_ctx,
            "speculative": False,
            "is_processing": self.id_task is not None,
            "n_prompt_tokens": self.n_prompt_tokens,
            "params": self.params,
            "next_token": {
                "has_next_token": self.id_task is not None,
                "has_new_line": self.has_new_line,
                "n_remain": self.n_remain,
                "n_decoded": self.n_decoded,
                "stopping_word": "",
            },
        }


class Slots:
    """This API server's slots (see the module docstring): `acquire` one for a request,
    `release` it when the request ends."""

    def __init__(self, n: int) -> None:
        self.all = [Slot(i) for i in range(n)]
        self._tasks = itertools.count()
        self._uses = itertools.count(1)
        self._freed = asyncio.Event()
        """Set (and replaced) each time a slot is released."""

    def check(self, id_slot: int, field_name: str = "id_slot", auto: bool = False) -> None:
        low = -1 if auto else 0
        if not low <= id_slot < len(self.all):
            either = "-1 or in" if auto else "in"
            raise InvalidRequest(
                field_name, f"must be {either} [0, {len(self.all)}), got {id_slot}"
            )

    def pick(self, id_slot: int, prompt: list[int]) -> Slot | None:
        """The slot a request would take now (None: it must wait)."""
        if id_slot >= 0:
            slot = self.all[id_slot]
            return slot if slot.id_task is None else None
        idle = [s for s in self.all if s.id_task is None]
        if not idle:
            return None
        best, best_len = None, SIMILARITY * len(prompt)
        for slot in idle:
            shared = _common_prefix(slot.tokens, prompt)
            if shared > best_len:
                best, best_len = slot, shared
        return best or min(idle, key=lambda s: s.last_used)

    async def acquire(self, id_slot: int, prompt: list[int], params: dict[str, Any]) -> Slot:
        """A slot for a request with this prompt (waits until one is idle)."""
        while (slot := self.pick(id_slot, prompt)) is None:
            await self._freed.wait()
        slot.id_task, slot.last_used = next(self._tasks), next(self._uses)
        slot.params, slot.n_prompt_tokens = params, len(prompt)
        slot.n_decoded, slot.has_new_line = 0, False
        slot.tokens = list(prompt)
        return slot

    def release(self, slot: Slot, tokens: list[int]) -> None:
        """The request in `slot` is over; `tokens` (its prompt and output) stay in it."""
        if slot.id_task is None:
            return
        slot.tokens, slot.id_task = tokens, None
        freed, self._freed = self._freed, asyncio.Event()
        freed.set()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PromptFiles:
    """The slots and the engines' save and restore calls."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.engine = serving.engine
        self.slots = Slots(slot_count(serving))

    async def save(self, token_ids: list[int], filename: str) -> dict[str, Any]:
        _check_name(filename)
        client = self.engine.client
        engine = 0
        if client.num_engines > 1:  # the engine that holds most of it
            held = [
                await client.call_utility("cached_prompt_tokens", token_ids, engine=e)
                for e in range(client.num_engines)
            ]
            engine = max(range(len(held)), key=held.__getitem__)
        return _answer(
            await client.call_utility("save_prompt_cache", token_ids, filename, engine=engine)
        )

    async def restore(self, filename: str) -> dict[str, Any]:
        _check_name(filename)
        client = self.engine.client
        results = [
            _answer(await client.call_utility("restore_prompt_cache", filename, engine=e))
            for e in range(client.num_engines)
        ]
        return min(results, key=lambda r: int(r["n_restored"]))


def slot_count(serving: OpenAIServing) -> int:
    """`--parallel` (`-np`), else `--max-num-seqs`."""
    config = serving.engine.config
    return config.frontend.parallel or config.scheduler.max_num_seqs


def _check_name(filename: str) -> None:
    why = check_filename(filename)
    if why is not None:
        raise InvalidRequest("filename", why)


def _answer(result: dict[str, Any]) -> dict[str, Any]:
    if "error" in result:
        raise APIError(str(result["error"]), 400, "BadRequestError", "filename")
    return result


def add_slot_routes(app: FastAPI, serving: OpenAIServing, files: PromptFiles) -> None:
    slots = files.slots

    @app.get("/slots", responses=errors(400, 503))
    async def list_slots(fail_on_no_slot: bool = False) -> list[dict[str, Any]]:
        """llama-server's slot list: each slot's state and its running request's progress."""
        if fail_on_no_slot and all(s.id_task is not None for s in slots.all):
            raise APIError("no slot available", 503, "ServiceUnavailableError")
        n_ctx = serving.engine.input_processor.limits.max_model_len
        return [slot.json(n_ctx) for slot in slots.all]

    @app.post("/slots/{id_slot}", responses=errors(400))
    async def slot_action(
        id_slot: int,
        action: Literal["save", "restore", "erase"],
        body: SlotFile | None = None,
    ) -> dict[str, Any]:
        """llama.cpp's slot actions: save the slot's prompt to a file, restore a file into the
        prefix cache (and the slot), or forget the slot's prompt."""
        slots.check(id_slot)
        slot = slots.all[id_slot]
        if action == "erase":
            erased, slot.tokens = len(slot.tokens), []
            return {"id_slot": id_slot, "n_erased": erased}
        if body is None:
            raise InvalidRequest("filename", "is required")
        start = time.perf_counter()
        if action == "save":
            tokens = slot.tokens
            if not tokens:
                raise InvalidRequest(
                    "id_slot",
                    f"slot {id_slot} has no prompt yet: send a /completion or /infill request "
                    "with this id_slot first",
                )
            saved = await files.save(tokens, body.filename)
            ms = (time.perf_counter() - start) * 1e3
            return {
                "id_slot": id_slot,
                "filename": body.filename,
                "n_saved": saved["n_saved"],
                "n_written": saved["n_written"],
                "timings": {"save_ms": ms},
            }
        restored = await files.restore(body.filename)
        slot.tokens = list(restored["token_ids"])
        ms = (time.perf_counter() - start) * 1e3
        return {
            "id_slot": id_slot,
            "filename": body.filename,
            "n_restored": restored["n_restored"],
            "n_read": restored["n_read"],
            "timings": {"restore_ms": ms},
        }

    @app.post("/prompt_cache/save", responses=errors(400))
    async def save_prompt(req: SavePrompt) -> dict[str, Any]:
        """Save a prompt run before (its whole blocks still cached) to a file."""
        processor = serving.engine.input_processor
        if isinstance(req.prompt, str):
            processor.check_chars(len(req.prompt))
            ids = await serving.inputs.run(len(req.prompt), processor.encode, req.prompt)
        else:
            check_prompt(req.prompt, processor.limits)
            ids = list(req.prompt)
        saved = await files.save(ids, req.filename)
        return {k: v for k, v in saved.items() if k != "token_ids"} | {"filename": req.filename}

    @app.post("/prompt_cache/restore", responses=errors(400))
    async def restore_prompt(req: SlotFile) -> dict[str, Any]:
        """Read a saved prompt's KV blocks into the prefix cache."""
        restored = await files.restore(req.filename)
        return {k: v for k, v in restored.items() if k != "token_ids"} | {"filename": req.filename}

    if envs.server_dev_mode():

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> dict[str, bool]:
            """vLLM's development route (TREADLE_SERVER_DEV_MODE=1): empty every engine's
            prefix cache (to measure a cold prefill, or a restore)."""
            client = serving.engine.client
            for e in range(client.num_engines):
                await client.call_utility("reset_prefix_cache", engine=e)
            return {"reset": True}
