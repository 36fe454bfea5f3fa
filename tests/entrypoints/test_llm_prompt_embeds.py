"""`LLM(enable_prompt_embeds=True).generate({"prompt_embeds": tensor})` (issue 23): the model's
own embedding rows of a prompt's token ids give the same greedy output as the prompt, alone
and in a batch with token-id prompts, through chunked prefill and preemption; equal
embeddings share prefix-cache blocks, others do not."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from treadle import LLM, SamplingParams
from treadle.validation import InvalidRequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
TEXTS = [
    "The quick brown fox jumps over the lazy dog, and then it runs away",
    "Hello world",
    "One two three four five six seven eight nine ten eleven twelve",
]
KV_BLOCK_BYTES = 2 * 2 * 16 * 4 * 16 * 2  # K and V, 2 KV heads x 16, float32, 16 tokens, 2 layers


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:  # type: ignore[no-untyped-def]
    return Path(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[LLM]:
    # Prefill in chunks of 16 tokens; 6 KV blocks, so a batch of four prompts preempts.
    engine = LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=64,
        enable_prompt_embeds=True,
        max_num_batched_tokens=16,
        kv_cache_memory=6 * KV_BLOCK_BYTES,
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def table(model_dir: Path) -> torch.Tensor:
    return load_file(str(model_dir / "model.safetensors"))["model.embed_tokens.weight"]


def ids_of(llm: LLM, text: str) -> list[int]:
    return list(llm.get_tokenizer()(text).input_ids)


def test_own_embedding_rows_give_the_prompts_greedy_output(llm: LLM, table: torch.Tensor) -> None:
    for text in TEXTS:
        ids = ids_of(llm, text)
        by_ids = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
        by_embeds = llm.generate({"prompt_embeds": table[ids]}, GREEDY, use_tqdm=False)[0]
        assert by_embeds.outputs[0].token_ids == by_ids.outputs[0].token_ids
        assert by_embeds.outputs[0].text == by_ids.outputs[0].text
        assert by_embeds.prompt_token_ids == [] and by_embeds.prompt is None


def test_a_batch_mixes_embeddings_and_token_ids(llm: LLM, table: torch.Tensor) -> None:
    alone = [llm.generate(t, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for t in TEXTS]
    prompts: list[object] = [
        {"prompt_embeds": table[ids_of(llm, TEXTS[0])]},
        TEXTS[1],
        {"prompt_embeds": table[ids_of(llm, TEXTS[2])]},
        {"prompt_token_ids": ids_of(llm, TEXTS[0])},
    ]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)  # type: ignore[arg-type]
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [alone[0], alone[1], alone[2], alone[0]]
    assert llm.get_stats().num_preemptions > 0  # 6 blocks for 4 requests of 2 or 3


def test_equal_embeddings_share_blocks_and_others_none(llm: LLM, table: torch.Tensor) -> None:
    ids = (ids_of(llm, TEXTS[0]) + ids_of(llm, TEXTS[2])) * 2
    ids = ids[:40]
    assert len(ids) == 40
    embeds = table[ids].clone()
    first = llm.generate({"prompt_embeds": embeds}, GREEDY, use_tqdm=False)[0]
    again = llm.generate({"prompt_embeds": embeds.clone()}, GREEDY, use_tqdm=False)[0]
    assert (
        again.num_cached_tokens == 32 and again.outputs[0].token_ids == first.outputs[0].token_ids
    )
    changed = embeds.clone()
    changed[0, 5] += 1e-4
    assert (
        llm.generate({"prompt_embeds": changed}, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    )
    token_prompt = llm.generate({"prompt_token_ids": [0] * 40}, GREEDY, use_tqdm=False)[0]
    assert token_prompt.num_cached_tokens == 0  # the placeholder ids are no prompt of their own


def test_half_precision_rows_run_in_the_model_dtype(llm: LLM, table: torch.Tensor) -> None:
    """float16 / bfloat16 rows give what the same values as float32 rows give: the tokens and
    their log-probabilities (the rows are cast, not reinterpreted, scaled or dropped)."""
    ids = ids_of(llm, TEXTS[0])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    for dtype in (torch.float16, torch.bfloat16):
        rows = table[ids].to(dtype)
        out = llm.generate({"prompt_embeds": rows}, params, use_tqdm=False)[0].outputs[0]
        ref = llm.generate({"prompt_embeds": rows.float()}, params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == ref.token_ids, dtype
        assert out.cumulative_logprob == pytest.approx(ref.cumulative_logprob, abs=1e-4), dtype


@pytest.mark.parametrize(
    ("embeds", "param"),
    [
        (torch.randn(3, 65), "prompt_embeds"),
        (torch.randn(1, 3, 64), "prompt_embeds"),
        (torch.full((2, 64), float("nan")), "prompt_embeds"),
        (torch.zeros(2, 64, dtype=torch.int64), "prompt_embeds"),
        (torch.randn(64, 64), "prompt_embeds"),  # no room for an output in 64 tokens
        (torch.eye(64)[:3].to_sparse(), "prompt_embeds"),
        ([[0.0] * 64], "prompt_embeds"),
    ],
)
def test_bad_tensors_are_refused_naming_prompt_embeds(llm: LLM, embeds: object, param: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        llm.generate({"prompt_embeds": embeds}, GREEDY, use_tqdm=False)  # type: ignore[dict-item]
    assert e.value.param == param


def test_prompt_logprobs_are_refused_with_embeddings(llm: LLM, table: torch.Tensor) -> None:
    params = SamplingParams(max_tokens=2, prompt_logprobs=1)
    with pytest.raises(InvalidRequest) as e:
        llm.generate({"prompt_embeds": table[[1, 2, 3]]}, params, use_tqdm=False)
    assert e.value.param == "prompt_logprobs"


def test_without_the_flag_embeddings_are_refused_naming_it(model_dir: Path) -> None:
    from treadle.config import resolve_model
    from treadle.frontend.input_processor import InputProcessor
    from treadle.tokenizer import load_tokenizer
    from treadle.validation import ModelLimits

    processor = InputProcessor(
        load_tokenizer(resolve_model(str(model_dir))), ModelLimits(49152, 64)
    )
    for call in (processor.check_embeds, processor.decode_embeds):
        with pytest.raises(InvalidRequest, match="--enable-prompt-embeds") as e:
            call(torch.randn(2, 64))  # type: ignore[arg-type]
        assert e.value.param == "prompt_embeds"


def test_tensor_parallel_workers_all_get_the_rows(
    model_dir: Path, table: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """-tp 2: the rows reach both workers through the shared-memory queue, in a chunk and
    (10 KiB chunks, a 15 KiB tensor) over its overflow socket."""
    monkeypatch.setenv("TREADLE_MQ_MAX_CHUNK_BYTES_MB", "0.01")
    llm = LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=128,
        enable_prompt_embeds=True,
        tensor_parallel_size=2,
    )
    try:
        short = ids_of(llm, TEXTS[1])
        long = (ids_of(llm, TEXTS[0]) + ids_of(llm, TEXTS[2])) * 3
        long = long[:60]
        prompts = [{"prompt_token_ids": short}, {"prompt_token_ids": long}]
        by_ids = llm.generate(prompts, GREEDY, use_tqdm=False)  # type: ignore[arg-type]
        embeds = [{"prompt_embeds": table[short]}, {"prompt_embeds": table[long]}]
        by_embeds = llm.generate(embeds, GREEDY, use_tqdm=False)  # type: ignore[arg-type]
        assert [o.outputs[0].token_ids for o in by_embeds] == [
            o.outputs[0].token_ids for o in by_ids
        ]
    finally:
        llm.shutdown()
