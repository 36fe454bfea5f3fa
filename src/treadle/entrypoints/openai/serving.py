"""The OpenAI endpoints the API server routes to: the model list and the two generating
endpoints (`serving_completions.py`, `serving_chat.py`), and embeddings
(`serving_embeddings.py`), over what they share
(`serving_base.py`); errors are `errors.py`'s."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from treadle.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard
from treadle.entrypoints.openai.serving_base import ServingBase
from treadle.entrypoints.openai.serving_chat import ChatServing
from treadle.entrypoints.openai.serving_completions import CompletionServing
from treadle.entrypoints.openai.serving_embeddings import EmbeddingRequest, EmbeddingServing
from treadle.frontend.async_llm import AsyncLLM


class OpenAIServing(ServingBase):
    def __init__(self, engine: AsyncLLM, model_name: str):
        super().__init__(engine, model_name)
        self._completions = CompletionServing(self)
        self._chat = ChatServing(self)
        self._embeddings = EmbeddingServing(self)

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        return await self._completions.create(req, raw)

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        return await self._chat.create(req, raw)

    async def embeddings(self, req: EmbeddingRequest, raw: Request) -> Response:
        return await self._embeddings.create(req, raw)

    def model_cards(self) -> list[ModelCard]:
        """/v1/models: a card per served name, as vLLM's; `root` is the first served name (the
        path as given unless --served-model-name says otherwise: never a resolved path)."""
        cards = [self._card(name) for name in self.listed_names]
        return cards + [self._adapter_card(*adapter) for adapter in self.loras.cards()]

    def model_card(self, model: str) -> ModelCard:
        """/v1/models/{model}: its card, for any name the model answers to; 404 otherwise."""
        if self.check_model(model) is not None:
            return next(self._adapter_card(*a) for a in self.loras.cards() if a[0] == model)
        return self._card(model)

    def _adapter_card(self, name: str, path: str, parent: str) -> ModelCard:
        """A LoRA adapter's card, as vLLM's: `root` its directory, `parent` its base model."""
        return ModelCard(id=name, root=path, parent=parent, max_model_len=self.engine.max_model_len)

    def _card(self, name: str) -> ModelCard:
        return ModelCard(id=name, root=self.model_name, max_model_len=self.engine.max_model_len)
