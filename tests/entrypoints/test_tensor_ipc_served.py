"""`--tensor-ipc shm` served (issue 23 item 3): `prompt_embeds` reach the engine core through the
API server's tensor ring and give the greedy text of the prompt's token ids; the ring is gone
from /dev/shm once the server has stopped."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from safetensors.torch import load_file
from test_leftovers import left_in_dev_shm, shm_inodes, wait_gone
from test_prompt_embeds_served import GREEDY, TEXT, saved

from serve_helpers import RemoteServer


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_factory) -> Iterator[RemoteServer]:  # type: ignore[no-untyped-def]
    srv = RemoteServer(
        [
            str(tiny_model_factory("llama")),
            "--max-model-len",
            "128",
            "--enable-prompt-embeds",
            "--tensor-ipc",
            "shm",
        ],
        tmp_path_factory.mktemp("tensor-ipc"),
        # The tiny model's rows are small: let every prompt's tensor take the ring.
        env={"TREADLE_TENSOR_IPC_SHM_THRESHOLD": "1024"},
    )
    yield srv
    srv.stop()


def _ring_mapped_by(server: RemoteServer, process_name: str) -> bool:
    maps = Path(f"/proc/{server.pid_of(process_name)}/maps").read_text()
    return "/dev/shm/treadle_tr_" in maps


def test_embeds_through_the_ring_give_the_greedy_text_and_nothing_is_left(
    server: RemoteServer, tiny_model_factory
) -> None:  # type: ignore[no-untyped-def]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    ids = list(
        httpx.post(server.url + "/tokenize", json={"prompt": TEXT}, timeout=30).json()["tokens"]
    )
    weights = load_file(str(Path(tiny_model_factory("llama")) / "model.safetensors"))
    embeds = weights["model.embed_tokens.weight"][ids]
    assert embeds.nbytes >= 1024
    greedy = client.completions.create(model=model, prompt=ids, extra_body=GREEDY)  # type: ignore[arg-type]
    for _ in range(3):  # regions are released and used again
        out = client.completions.create(
            model=model, prompt="", extra_body={**GREEDY, "prompt_embeds": saved(embeds)}
        )  # type: ignore[call-overload]
        assert out.choices[0].text == greedy.choices[0].text
    assert _ring_mapped_by(server, "treadle::EngineCore_DP0")  # the tensors came through the ring
    inodes = shm_inodes(server)
    family = server.family()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0
    wait_gone(family)
    assert left_in_dev_shm(inodes) == []


def test_the_offline_llm_sends_embeds_through_its_ring(
    tiny_model_factory, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    from treadle.entrypoints.llm import LLM
    from treadle.sampling_params import SamplingParams

    monkeypatch.setenv("TREADLE_TENSOR_IPC_SHM_THRESHOLD", "1024")
    model = Path(tiny_model_factory("llama"))
    llm = LLM(str(model), enable_prompt_embeds=True, tensor_ipc="shm", max_model_len=128)
    try:
        ring = llm.engine.tensor_ring  # type: ignore[union-attr]
        assert ring is not None
        ids = list(range(5, 25))
        embeds = load_file(str(model / "model.safetensors"))["model.embed_tokens.weight"][ids]
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        want = llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids
        got = llm.generate([{"prompt_embeds": embeds}], params)[0].outputs[0].token_ids
        assert list(got) == list(want)
        assert ring.in_flight == 1 and ring._next_seq == 2  # it went through the ring
        name = ring.name
    finally:
        llm.shutdown()
    assert not Path(f"/dev/shm/{name}").exists()
