"""One HTTP request is checked against the model once in the API server (issue 25 item 7):
`/v1/completions` and `/v1/chat/completions` served in this process (the engine core in its
own), with a spy on `validation.check_request` wherever it is called from."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest

from treadle.engine_args import EngineArgs
from treadle.entrypoints.openai.api_server import build_app
from treadle.frontend.async_llm import AsyncLLM

CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def engine(tiny_model_factory) -> Iterator[AsyncLLM]:  # type: ignore[no-untyped-def]
    model = str(tiny_model_factory("llama"))
    args, _ = EngineArgs.from_kwargs(model=model, dtype="float32", max_model_len=128)
    engine = AsyncLLM(args.create_engine_config(), "tiny")
    yield engine
    engine.shutdown()


def test_each_prompt_of_a_request_is_checked_once(
    engine: AsyncLLM, check_request_calls: list[Sequence[int]]
) -> None:
    app = build_app(engine, "tiny", "tiny")

    async def main() -> None:
        engine.start()  # (what the app's lifespan does)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:

            async def post(path: str, body: dict[str, Any], calls: int) -> httpx.Response:
                check_request_calls.clear()
                response = await client.post(path, json=body, timeout=60)
                assert len(check_request_calls) == calls, (path, body)
                return response

            n3 = {"prompt": [5, 6, 7], "n": 3, "max_tokens": 2, "seed": 1}
            response = await post("/v1/completions", n3, 1)
            assert len(response.json()["choices"]) == 3
            assert check_request_calls == [[5, 6, 7]]
            # Two prompts, each scored alone (max_tokens 0 with echo): one check each.
            score = {"prompt": [[5, 6], [7, 8, 9]], "max_tokens": 0, "echo": True, "logprobs": 0}
            response = await post("/v1/completions", score, 2)
            texts = [c["logprobs"]["tokens"] for c in response.json()["choices"]]
            assert [len(t) for t in texts] == [2, 3]
            cut = {"prompt": [5, 6, 7, 8], "max_tokens": 1, "truncate_prompt_tokens": 2}
            await post("/v1/completions", cut, 1)
            assert check_request_calls == [[7, 8]]
            chat = {"messages": CHAT, "n": 2, "max_tokens": 2, "stream": True}
            response = await post("/v1/chat/completions", chat, 1)
            events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert {c["index"] for e in events[:-1] for c in json.loads(e)["choices"]} == {0, 1}
            refused = {"messages": CHAT, "logprobs": True, "top_logprobs": 21}
            response = await post("/v1/chat/completions", refused, 1)
            assert response.status_code == 400
            assert response.json()["error"]["param"] == "top_logprobs"

    asyncio.run(main())
