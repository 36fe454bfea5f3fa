"""Images through the offline `LLM` (vLLM's `{"prompt", "multi_modal_data": {"image": ...}}`)
on a tiny random LLaVA: greedy token ids identical to transformers' own LLaVA on the same
directory, for one image, two, a batch that mixes images and text, a prefill chunked through
the image's placeholders, and preemptions; the encoder runs once per image; the prefix cache
tells two images apart."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from llava_helpers import Reference, random_image
from treadle import LLM, SamplingParams
from treadle.validation import InvalidRequest

PROMPT = "USER: <image>\nWhat is in the picture? ASSISTANT:"
TWO = "USER: <image>\n<image>\nWhich one is brighter? ASSISTANT:"
TEXT = "USER: Tell me about the sea. ASSISTANT:"
MAX = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX)


@pytest.fixture(scope="module")
def reference(llava_reference: Reference) -> Reference:
    return llava_reference


@pytest.fixture(scope="module")
def llm(llava: Path) -> Iterator[LLM]:
    # 256 tokens a step: every image prompt (590+ tokens) is prefilled in chunks that cut
    # through its 576 placeholders.
    engine = LLM(str(llava), dtype="float32", max_num_batched_tokens=256, max_model_len=2048)
    yield engine
    engine.shutdown()


def ids_of(out) -> list[int]:  # type: ignore[no-untyped-def]
    return list(out.outputs[0].token_ids)


def test_one_image_gives_transformers_greedy_tokens(llm: LLM, reference: Reference) -> None:
    image = random_image(1)
    before = llm.get_stats().mm_images_encoded
    [out] = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": image}}, GREEDY)
    assert ids_of(out) == reference.greedy(PROMPT, [image], MAX)
    assert len(out.prompt_token_ids) == len(reference.prompt_ids(PROMPT))
    # Three chunks cut through the placeholders; the tower ran once.
    assert llm.get_stats().mm_images_encoded == before + 1


def test_two_images_in_one_prompt(llm: LLM, reference: Reference) -> None:
    images = [random_image(2), random_image(3, 300, 600)]
    [out] = llm.generate({"prompt": TWO, "multi_modal_data": {"image": images}}, GREEDY)
    assert ids_of(out) == reference.greedy(TWO, images, MAX)


def test_a_batch_mixing_images_and_text(llm: LLM, reference: Reference) -> None:
    a, b = random_image(4), random_image(5, 640, 480)
    prompts = [
        {"prompt": PROMPT, "multi_modal_data": {"image": a}},
        TEXT,
        {"prompt": PROMPT, "multi_modal_data": {"image": b}},
        {"prompt": TWO, "multi_modal_data": {"image": [b, a]}},
    ]
    outs = llm.generate(prompts, GREEDY)
    assert ids_of(outs[0]) == reference.greedy(PROMPT, [a], MAX)
    assert ids_of(outs[1]) == reference.greedy(TEXT, [], MAX)
    assert ids_of(outs[2]) == reference.greedy(PROMPT, [b], MAX)
    assert ids_of(outs[3]) == reference.greedy(TWO, [b, a], MAX)


def test_the_same_image_again_hits_the_encoder_cache_and_the_prefix_cache(llm: LLM) -> None:
    image, other = random_image(6), random_image(7)
    llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": image}}, GREEDY)
    stats = llm.get_stats()
    [again] = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": image}}, GREEDY)
    after = llm.get_stats()
    assert after.mm_images_encoded == stats.mm_images_encoded  # the tower did not run
    assert again.num_cached_tokens >= 576  # the image's blocks came from the prefix cache
    [different] = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": other}}, GREEDY)
    assert llm.get_stats().mm_images_encoded == after.mm_images_encoded + 1
    # The image starts in the first block: another image shares no block with it.
    assert different.num_cached_tokens == 0


def test_preempted_image_requests_finish_with_the_same_tokens(
    llava: Path, reference: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In this process: the three requests are queued before the first step, every time.
    monkeypatch.setenv("TREADLE_ENABLE_MULTIPROCESSING", "0")
    # 115 blocks of 16 tokens (8 KiB each): room for three image prompts (37 blocks each),
    # not for their outputs as well (40 blocks each).
    engine = LLM(
        str(llava),
        dtype="float32",
        kv_cache_memory_bytes=115 * 8192,
        max_model_len=1024,
    )
    try:
        images = [random_image(10 + i) for i in range(3)]
        params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        outs = engine.generate(
            [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in images], params
        )
        stats = engine.get_stats()
        assert stats.num_preemptions > 0
        assert stats.mm_images_encoded == 3  # the preempted one's came from the cache
        assert stats.mm_encoder_cache_hits >= 1
    finally:
        engine.shutdown()
    for out, image in zip(outs, images, strict=True):
        assert ids_of(out) == reference.greedy_ignore_eos(PROMPT, [image], 48)


def test_images_are_refused_where_they_do_not_fit(llm: LLM, tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    image = random_image(8)
    with pytest.raises(InvalidRequest, match="placeholder"):
        llm.generate({"prompt": TEXT, "multi_modal_data": {"image": image}}, GREEDY)
    with pytest.raises(InvalidRequest, match="PIL"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": "cat.png"}}, GREEDY)
    with pytest.raises(InvalidRequest, match="cannot cut"):
        llm.generate(
            {"prompt": PROMPT, "multi_modal_data": {"image": image}},
            SamplingParams(max_tokens=2, truncate_prompt_tokens=100),
        )
    # The engine still serves.
    assert llm.generate(TEXT, SamplingParams(temperature=0.0, max_tokens=2))[0].outputs[0].text


@pytest.mark.parametrize(
    "layout",
    [
        {"tensor_parallel_size": 2},
        {"pipeline_parallel_size": 2},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    ],
)
def test_images_under_tensor_and_pipeline_parallelism(
    llava: Path, reference: Reference, layout: dict[str, int]
) -> None:
    # -tp: every worker runs the (replicated) tower on the image the broadcast queue brings;
    # -pp: the first stage alone holds the tower and embeds; n-gram speculation proposes
    # from the prompt's ids (placeholders included) and verifies against the image's rows.
    engine = LLM(str(llava), dtype="float32", max_model_len=2048, **layout)  # type: ignore[arg-type]
    try:
        images = [random_image(20 + i) for i in range(2)]
        outs = engine.generate(
            [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in images] + [TEXT],
            GREEDY,
        )
    finally:
        engine.shutdown()
    for out, image in zip(outs, images, strict=False):
        assert ids_of(out) == reference.greedy(PROMPT, [image], MAX)
    assert ids_of(outs[2]) == reference.greedy(TEXT, [], MAX)


def test_chat_with_an_image_part(llm: LLM, reference: Reference) -> None:
    import base64
    import io

    image = random_image(40)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "What is in the picture?"},
            ],
        }
    ]
    [out] = llm.chat(messages, GREEDY)
    assert ids_of(out) == reference.greedy(PROMPT, [image], MAX)
