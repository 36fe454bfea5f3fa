"""`POST /v1/embeddings` (OpenAI's shape, issue 23 item 4): `input` as a string, a list of
strings, token ids or lists of them; each becomes a pooling request on the same engine cores as
generation (its prompt read, no token sampled: `SamplingParams.pooling`), batched in the same
steps. The pooled final hidden state (`--pooling-type`: last position or mean) comes back out
of band as a tensor and is normalised here; `encoding_format` `float` gives a list,
`base64` the little-endian float32 bytes (as OpenAI's). `dimensions` is refused: no model
treadle serves was trained for shortened embeddings (Matryoshka)."""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from treadle.entrypoints.openai.inputs import Prompt
from treadle.entrypoints.openai.protocol import OpenAIModel, TokenIds, random_id
from treadle.entrypoints.openai.serving_base import ServingBase
from treadle.outputs import RequestOutput, unit_vector
from treadle.sampling_params import SamplingParams
from treadle.validation import InvalidRequest

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


class EmbeddingRequest(OpenAIModel):
    model: str | None = None
    input: (
        str
        | Annotated[list[str], Field(json_schema_extra={"minItems": 1, "maxItems": MAX_INPUTS})]
        | TokenIds
        | Annotated[list[TokenIds], Field(json_schema_extra={"minItems": 1})]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # OpenAI's end-user id for abuse monitoring: nothing to do here
    add_special_tokens: bool = True  # vLLM's


class EmbeddingServing:
    def __init__(self, base: ServingBase):
        self.base = base

    async def create(self, req: EmbeddingRequest, raw: Request) -> Response:
        base = self.base
        if base.check_model(req.model) is not None:
            raise InvalidRequest(
                "model", "LoRA adapters serve generation; embed with the base model"
            )
        if req.dimensions is not None:
            raise InvalidRequest(
                "dimensions", "is not supported: this model's embeddings have one size"
            )
        if req.model_extra:
            raise InvalidRequest(
                sorted(req.model_extra)[0], "is not a field of /v1/embeddings treadle knows"
            )
        _check_inputs(req.input)
        try:
            prompts: list[Prompt] = await base.inputs.completion_prompts(
                req.input, False, None, req.add_special_tokens
            )
        except InvalidRequest as e:
            raise e.renamed({"prompt": "input"}) from None
        params = SamplingParams(
            max_tokens=1, temperature=0.0, pooling=base.engine.config.model.pooling_type
        )
        rid = random_id("embd")
        prepare = base.engine.input_processor.prepare
        size = sum(len(ids) for _, ids in prompts)
        try:
            requests = await base.inputs.run(
                size,
                lambda: [
                    prepare(f"{rid}-{i}", t, ids, params) for i, (t, ids) in enumerate(prompts)
                ],
            )
        except InvalidRequest as e:
            raise e.renamed({"prompt": "input"}) from None
        return await base.until_done(
            raw, self._body(req, prompts, base.run(requests, base.dp_rank(raw)))
        )

    async def _body(
        self, req: EmbeddingRequest, prompts: list[Prompt], outputs: Any
    ) -> dict[str, Any]:
        final: dict[int, RequestOutput] = {}
        async for i, out in outputs:
            if out.finished:
                final[i] = out
        data = []
        for i in range(len(prompts)):
            out = final[i]
            if out.pooled is None:  # the engine refused it: its reason is the stop reason
                comp = out.outputs[0] if out.outputs else None
                reason = comp.stop_reason if comp is not None else "no embedding"
                raise InvalidRequest("input", f"{reason}")
            vector = unit_vector(out.pooled)
            embedding: Any = (
                base64.b64encode(vector.astype("<f4").tobytes()).decode()
                if req.encoding_format == "base64"
                else vector.tolist()
            )
            data.append({"object": "embedding", "embedding": embedding, "index": i})
        tokens = sum(len(ids) for _, ids in prompts)
        return {
            "object": "list",
            "data": data,
            "model": self.base.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }


def _check_inputs(value: Any) -> None:
    """Refuse what `completion_prompts` would call a prompt but an embedding request may not
    have: an empty string, more than `MAX_INPUTS` inputs."""
    items = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else value
    if not items:
        raise InvalidRequest("input", "is empty")
    if len(items) > MAX_INPUTS:
        raise InvalidRequest("input", f"has more than {MAX_INPUTS} items")
    if any(isinstance(item, str) and not item for item in items):
        raise InvalidRequest("input", "has an empty string")
