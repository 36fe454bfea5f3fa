"""Prompt caches on disk over HTTP (issue 26 item 2): llama.cpp's `POST /slots/{id}?action=
save|restore|erase` with `{"filename": ...}`, and treadle's own form that names the prompt
itself, `POST /prompt_cache/save` (`{"prompt": text or token ids, "filename": ...}`) and
`POST /prompt_cache/restore` (`{"filename": ...}`). Both need `--kv-cache-save-path DIR`.

treadle has no slots: its prefix cache is shared by all requests. A llama.cpp-style request
(`/completion`, `/infill`) that gives `id_slot` makes its prompt and output that slot's
tokens in this API server; saving the slot saves the KV of those tokens (the whole blocks
the prefix cache still holds); restoring puts a file's blocks in the prefix cache, where any
request with that prompt finds them, and makes its tokens the slot's; erasing forgets the
slot's tokens (their blocks stay cached until their space is needed).

With several engine cores (`-dp`), a prompt is saved from the engine that holds most of it
and restored into every engine. With TREADLE_SERVER_DEV_MODE=1, vLLM's `POST
/reset_prefix_cache` empties the prefix caches (to measure what a restore saves).
"""

from __future__ import annotations

import time
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


class PromptFiles:
    """The slots' tokens and the engines' save and restore calls."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.engine = serving.engine
        self.slots: dict[int, list[int]] = {}

    def check_slot(self, id_slot: int) -> None:
        slots = self.engine.config.scheduler.max_num_seqs
        if not 0 <= id_slot < slots:
            raise InvalidRequest("id_slot", f"must be in [0, {slots}), got {id_slot}")

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


def _check_name(filename: str) -> None:
    why = check_filename(filename)
    if why is not None:
        raise InvalidRequest("filename", why)


def _answer(result: dict[str, Any]) -> dict[str, Any]:
    if "error" in result:
        raise APIError(str(result["error"]), 400, "BadRequestError", "filename")
    return result


def add_slot_routes(app: FastAPI, serving: OpenAIServing, files: PromptFiles) -> None:
    @app.post("/slots/{id_slot}", responses=errors(400))
    async def slot_action(
        id_slot: int,
        action: Literal["save", "restore", "erase"],
        body: SlotFile | None = None,
    ) -> dict[str, Any]:
        """llama.cpp's slot actions: save the slot's prompt to a file, restore a file into the
        prefix cache (and the slot), or forget the slot's prompt."""
        files.check_slot(id_slot)
        if action == "erase":
            return {"id_slot": id_slot, "n_erased": len(files.slots.pop(id_slot, []))}
        if body is None:
            raise InvalidRequest("filename", "is required")
        start = time.perf_counter()
        if action == "save":
            tokens = files.slots.get(id_slot)
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
        files.slots[id_slot] = list(restored["token_ids"])
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
