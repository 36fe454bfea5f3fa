"""llama.cpp's `llama-server` endpoints that tools and UIs read (issue 26 item 5), with its
field names:

- `GET /props`: the context size, the slot count (`--parallel`, default `--max-num-seqs`), the chat template, the BOS
  and EOS tokens, the default sampling parameters and the build. llama.cpp reports the model's
  file path in `model_path`; treadle never reports a file-system path, so `model_path` and
  `model_alias` are the served name.
- `POST /apply-template`: `{"messages": [...]}` in, `{"prompt": text}` out: the chat as the
  model's template renders it, with the assistant's turn opened (as a chat request would be).

- `POST /completion` (and `/completions`) and `POST /infill`: llama.cpp's own generation
  endpoints (item 1), in `llamacpp_completion.py`.
- `GET`/`POST /lora-adapters` (in `lora_routes.py`) and /completion's `"lora"`: the
  `--lora-modules` adapters by their place in the list (`frontend/loras.py`).
- `GET /slots` and `POST /slots/{id}?action=save|restore|erase` and `/prompt_cache/save|restore`: prompts' KV
  saved to files and restored (item 2), in `llamacpp_slots.py`.

All are guarded by `--api-key` (`KEYED_PATHS`), as llama.cpp guards them.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

import treadle
from treadle.entrypoints.openai.llamacpp_completion import (
    LlamaCompletionRequest,
    LlamaCompletionServing,
)
from treadle.entrypoints.openai.llamacpp_slots import KEYED_PATHS as SLOT_PATHS
from treadle.entrypoints.openai.llamacpp_slots import PromptFiles, add_slot_routes, slot_count
from treadle.entrypoints.openai.openapi_responses import errors
from treadle.entrypoints.openai.protocol import ChatMessage
from treadle.entrypoints.openai.serving import OpenAIServing
from treadle.entrypoints.openai.tool_calls.plan import template_messages
from treadle.frontend.input_processor import message_chars
from treadle.validation import InvalidRequest

KEYED_PATHS = ("/props", "/apply-template", "/completion", "/infill", "/lora-adapters", *SLOT_PATHS)


class ApplyTemplateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    messages: list[ChatMessage]


def props(serving: OpenAIServing) -> dict[str, Any]:
    """`/props`'s body."""
    engine = serving.engine
    tokenizer = serving.tokenizer
    defaults = serving.sampling_defaults
    limits = engine.input_processor.limits
    name = serving.model_name
    return {
        "default_generation_settings": {
            "n_ctx": limits.max_model_len,
            "params": {
                "n_predict": -1,  # until the context is full, as llama.cpp's default
                "temperature": defaults.get("temperature", 1.0),
                "top_k": defaults.get("top_k", 0),  # 0: all tokens (llama.cpp's "off")
                "top_p": defaults.get("top_p", 1.0),
                "min_p": defaults.get("min_p", 0.0),
                "repeat_penalty": defaults.get("repetition_penalty", 1.0),
                "presence_penalty": defaults.get("presence_penalty", 0.0),
                "frequency_penalty": defaults.get("frequency_penalty", 0.0),
                "seed": -1,  # a random seed per request
                "stream": False,
            },
        },
        "total_slots": slot_count(serving),
        "model_alias": name,
        "model_path": name,
        "modalities": {"vision": False, "audio": False},
        "chat_template": getattr(tokenizer, "chat_template", None) or "",
        "bos_token": tokenizer.bos_token or "",
        "eos_token": tokenizer.eos_token or "",
        "build_info": f"treadle {treadle.__version__}",
    }


def add_llamacpp_routes(app: FastAPI, serving: OpenAIServing) -> None:
    inputs = serving.inputs
    processor = serving.engine.input_processor

    @app.get("/props")
    async def get_props() -> dict[str, Any]:
        return props(serving)

    @app.post("/apply-template", responses=errors(400))
    async def apply_template(req: ApplyTemplateRequest) -> dict[str, str]:
        if not req.messages:
            raise InvalidRequest("messages", "must not be empty")
        messages = template_messages([m.template_dict(i) for i, m in enumerate(req.messages)])
        size = message_chars(messages)
        processor.check_chars(size, "messages")
        return {"prompt": await inputs.run(size, processor.render_chat, messages, True)}

    files = PromptFiles(serving)
    completions = LlamaCompletionServing(serving, files.slots)
    add_slot_routes(app, serving, files)

    @app.post("/completion", responses=errors(400, 404))
    @app.post("/completions", responses=errors(400, 404), include_in_schema=False)
    async def completion(req: LlamaCompletionRequest, raw: Request) -> Response:
        """llama.cpp's completion endpoint (its fields and response shape)."""
        return await completions.create(req, raw, infill=False)

    @app.post("/infill", responses=errors(400, 404))
    async def infill(req: LlamaCompletionRequest, raw: Request) -> Response:
        """llama.cpp's fill-in-the-middle endpoint, for editor plug-ins."""
        return await completions.create(req, raw, infill=True)
