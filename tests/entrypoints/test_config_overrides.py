"""vLLM's `--hf-overrides` and `--override-generation-config`: checked at the edge (one line,
exit 2), applied where the config is read (config.json and GGUF alike) and where the default
sampling parameters are made (the server and the offline `LLM`)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from serve_helpers import TREADLE, RemoteServer
from treadle import LLM, SamplingParams
from treadle.config import ModelConfig
from treadle.model.arch import ModelArch, VisionArch
from treadle.model.hf_overrides import apply_hf_overrides
from treadle.sampling_params import generation_defaults
from treadle.vllm_args.values import parse_generation_overrides, parse_hf_overrides

PROMPT = "The quick brown fox jumps over the lazy dog and then it runs into the dark forest"


@pytest.mark.parametrize(
    ("given", "words"),
    [
        ("{not json", "--hf-overrides '{not json' is not JSON"),
        ("[1]", "--hf-overrides must be a JSON object, not list"),
        ('{"vocab_size": 5}', "'vocab_size' cannot apply here: treadle reads rope_theta,"),
        ('{"eos_token_id": 5}', "'eos_token_id' cannot apply here"),
        ('{"text_config": {"hidden_size": 8}}', "'text_config.hidden_size' cannot apply"),
        ('{"rope_theta": -1}', "rope_theta must be a positive number"),
        ('{"rope_theta": true}', "rope_theta must be a positive number"),
        ('{"max_position_embeddings": 1.5}', "max_position_embeddings must be a positive integer"),
        ('{"rope_scaling": {"rope_type": "yarn", "factor": 2}}', "rope type 'yarn': treadle runs"),
    ],
)
def test_hf_overrides_that_cannot_apply_are_refused(given: str, words: str) -> None:
    with pytest.raises(ValueError, match="^--hf-overrides") as info:
        parse_hf_overrides(given)
    assert words in str(info.value)


@pytest.mark.parametrize(
    ("given", "words"),
    [
        ('{"temperature": "hot"}', "--override-generation-config: "),
        ('{"temperature": -1}', "--override-generation-config: "),
        ('{"top_p": 0}', "--override-generation-config: "),
        ('{"do_sample": true}', "'do_sample' is not a default sampling parameter (give temp"),
        ('{"max_new_tokens": 8}', "max_new_tokens cannot be honoured"),
        ("5", "--override-generation-config must be a JSON object, not int"),
    ],
)
def test_generation_overrides_are_checked(given: str, words: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_generation_overrides(given)
    assert words in str(info.value)


def test_generation_overrides_go_over_the_models_file_with_any_generation_config(
    tmp_path: Path,
) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True})
    )

    def defaults(gen: str, override: object) -> dict[str, object]:
        model = ModelConfig(
            str(tmp_path),
            generation_config=gen,
            override_generation_config=parse_generation_overrides(override),
        )
        return generation_defaults(model)

    assert defaults("auto", None) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    assert defaults("auto", '{"temperature": 0.5}') == {
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 20,
    }
    assert defaults("auto", {"top_k": None, "min_p": 0.1}) == {  # null drops the file's value
        "temperature": 0.6,
        "top_p": 0.9,
        "min_p": 0.1,
    }
    assert defaults("vllm", {"temperature": 0.5}) == {"temperature": 0.5}  # as vLLM's
    assert defaults(str(tmp_path), {"repetition_penalty": 1.1})["repetition_penalty"] == 1.1


def _arch(**changes: object) -> ModelArch:
    base = ModelArch("LlamaForCausalLM", 100, 64, 128, 2, 4, 2, 16, 1e-6, 10000.0, 512, False)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_overrides_map_onto_the_arch_read_from_config_json_or_gguf() -> None:
    arch = apply_hf_overrides(
        _arch(), parse_hf_overrides({"rope_theta": 500, "max_position_embeddings": 64})
    )
    assert (arch.rope_theta, arch.max_position_embeddings) == (500.0, 64)
    linear = {"rope_type": "linear", "factor": 2.0}
    assert apply_hf_overrides(_arch(), parse_hf_overrides({"rope_scaling": linear})).rope_scaling
    params = {"rope_theta": 7.0, "rope_type": "default"}
    arch = apply_hf_overrides(_arch(), parse_hf_overrides({"rope_parameters": params}))
    assert (arch.rope_theta, arch.rope_scaling) == (7.0, None)
    assert (
        apply_hf_overrides(_arch(), parse_hf_overrides({"rms_norm_eps": 1e-3})).rms_norm_eps == 1e-3
    )
    with pytest.raises(ValueError, match="rope_scaling lacks or mistypes 'low_freq_factor'"):
        apply_hf_overrides(
            _arch(), parse_hf_overrides({"rope_scaling": {"rope_type": "llama3", "factor": 8}})
        )
    with pytest.raises(ValueError, match="text_config is a vision-language model's"):
        apply_hf_overrides(_arch(), parse_hf_overrides({"text_config": {"rope_theta": 5}}))
    vision = VisionArch(8, 16, 1, 2, 28, 14, 1e-5, "gelu", -1, "default", "gelu", True, 7)
    llava = _arch(vision=vision, multimodal_architecture="LlavaForConditionalGeneration")
    with pytest.raises(ValueError, match="rope_theta at the top level would not reach"):
        apply_hf_overrides(llava, parse_hf_overrides({"rope_theta": 5}))
    nested = apply_hf_overrides(llava, parse_hf_overrides({"text_config": {"rope_theta": 5}}))
    assert nested.rope_theta == 5.0 and nested.vision == vision


def test_overrides_apply_to_a_gguf_header(default_model_path: str) -> None:
    from treadle.config import model_source
    from treadle.model.loader import read_arch

    plain = read_arch(model_source(ModelConfig(default_model_path)))
    over = read_arch(
        model_source(
            ModelConfig(default_model_path, hf_overrides=parse_hf_overrides({"rope_theta": 5e5}))
        )
    )
    assert plain.rope_theta != 5e5 and over == dataclasses.replace(plain, rope_theta=5e5)


def _reference_logprobs(path: Path, ids: list[int], rope_theta: float) -> list[float]:
    """transformers' greedy continuation's logprobs with `rope_theta` in the config."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.rope_parameters["rope_theta"] = rope_theta
    model.model.rotary_emb.__init__(model.config)  # its inv_freq from the new theta
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=6,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(ids) :]
    return [
        torch.log_softmax(score[0].double(), -1)[t].item()
        for score, t in zip(out.scores, tokens, strict=True)
    ]


def test_offline_llm_runs_the_overridden_config(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    path = tiny_model_factory("llama")
    llm = LLM(
        str(path),
        dtype="float32",
        hf_overrides={"rope_theta": 500.0, "max_position_embeddings": 96},
        override_generation_config={"temperature": 0.0},
    )
    try:
        assert llm.engine.info.max_model_len == 96  # the default: the model's (overridden) limit
        assert llm.get_default_sampling_params().temperature == 0.0
        ids = llm.tokenizer(PROMPT).input_ids
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
        comp = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
        got = [e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs or [], strict=True)]
        # No SamplingParams: the overridden default (greedy), the same tokens.
        default = llm.generate({"prompt_token_ids": ids}, use_tqdm=False)[0].outputs[0]
        assert list(default.token_ids)[:6] == list(comp.token_ids)
    finally:
        llm.shutdown()
    want = _reference_logprobs(path, ids, 500.0)
    assert got == pytest.approx(want, abs=1e-4)
    plain = _reference_logprobs(path, ids, 10000.0)
    assert max(abs(a - b) for a, b in zip(plain, want, strict=True)) > 1e-3  # it mattered


def test_a_refused_override_stops_serve_in_one_line(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    path = str(tiny_model_factory("llama"))
    cases = {
        '{"vocab_size": 5}': "--hf-overrides: 'vocab_size' cannot apply here",
        '{"text_config": {"rope_theta": 5}}': "text_config is a vision-language model's",
    }
    procs = {
        given: subprocess.Popen(
            [TREADLE, "serve", path, "--port", "0", "--hf-overrides", given],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for given in cases
    }
    procs["gen"] = subprocess.Popen(
        [TREADLE, "serve", path, "--port", "0", "--override-generation-config", "{"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    cases["gen"] = "--override-generation-config '{' is not JSON"
    for given, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (given, out, err)
        assert err.splitlines() == [err.strip()] and "Traceback" not in out + err, err
        assert err.startswith("treadle serve: error: ") and cases[given] in err, err


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:  # type: ignore[no-untyped-def]
    model = tmp_path_factory.mktemp("gen") / "m"
    shutil.copytree(tiny_model_factory("llama"), model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 1.0, "top_k": 5}))
    args = [
        str(model),
        "--dtype",
        "float32",
        "--kv-cache-memory-bytes",
        str(1 << 22),
        "--override-generation-config",
        '{"temperature": 0}',
        "--hf-overrides",
        '{"max_position_embeddings": 80}',
    ]
    srv = RemoteServer(args, tmp_path_factory.mktemp("overrides"))
    yield srv
    srv.stop()


def test_served_defaults_and_limit_follow_the_overrides(server: RemoteServer) -> None:
    tokenized = httpx.post(server.url + "/tokenize", json={"prompt": "Hi"}).json()
    assert tokenized["max_model_len"] == 80
    body = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True}
    texts = {
        httpx.post(server.url + "/v1/completions", json=b, timeout=60).json()["choices"][0]["text"]
        for b in (body, body, {**body, "temperature": 0}, {**body, "seed": 7})
    }
    assert len(texts) == 1  # no temperature given: greedy, as the override says
    sampled = {
        httpx.post(
            server.url + "/v1/completions",
            json={**body, "temperature": 1.0, "seed": s},
            timeout=60,
        ).json()["choices"][0]["text"]
        for s in range(3)
    }
    assert sampled - texts  # a request's own temperature still wins
