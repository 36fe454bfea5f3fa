"""`treadle bench serve`'s datasets, vLLM's names: `random` (token ids, no tokenizer needed) and
`sharegpt` (a local ShareGPT JSON file; nothing is downloaded). Each turns its flags into a list
of `SampleRequest`s; token counting is passed in, so these run without a server."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

# Token ids drawn for prompts: inside every common vocabulary and clear of the special tokens
# at the bottom of it, so the benchmark needs no tokenizer.
PROMPT_TOKEN_RANGE = (1000, 20000)

# vLLM's ShareGPT pruning (`is_valid_sequence`): both sides at least 4 tokens, the prompt at most
# 1024, prompt and output together at most 2048.
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048
HUMAN_ROLES, GPT_ROLES = ("human", "user"), ("gpt", "chatgpt", "assistant")


class DatasetError(ValueError):
    """A dataset that cannot be used; the message is the whole CLI error line."""


@dataclass(frozen=True, slots=True)
class SampleRequest:
    """One request to send: token ids or text, its token count and its max_tokens."""

    prompt: list[int] | str
    prompt_len: int
    expected_output_len: int


# -- random ----------------------------------------------------------------------------------------


def random_prompts(num: int, input_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lo, hi = PROMPT_TOKEN_RANGE
    return [[rng.randrange(lo, hi) for _ in range(input_len)] for _ in range(num)]


def random_lengths(num: int, length: int, range_ratio: float, seed: int) -> list[int]:
    """vLLM's `--random-range-ratio`: lengths drawn uniformly from
    [length x (1 - ratio), length x (1 + ratio)] (at least 1); all `length` for 0."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    lo, hi = max(1, math.floor(length * (1 - range_ratio))), math.ceil(length * (1 + range_ratio))
    return [rng.randint(lo, hi) for _ in range(num)]


def sample_random(
    num: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[SampleRequest]:
    """`--dataset-name random`: random token-id prompts of --random-input-len tokens and
    max_tokens of --random-output-len, both spread by --random-range-ratio."""
    input_lens = random_lengths(num, input_len, range_ratio, seed)
    output_lens = random_lengths(num, output_len, range_ratio, seed + 1)
    prompts = random_prompts(num, max(input_lens, default=0), seed)
    return [
        SampleRequest(p[:n], n, out)
        for p, n, out in zip(prompts, input_lens, output_lens, strict=True)
    ]


# -- sharegpt --------------------------------------------------------------------------------------


def is_valid_sequence(prompt_len: int, output_len: int, check_output: bool = True) -> bool:
    """vLLM's filter of ShareGPT pairs: neither side too short, neither too long."""
    return not (
        prompt_len < MIN_LEN
        or (check_output and output_len < MIN_LEN)
        or prompt_len > MAX_PROMPT_LEN
        or prompt_len + output_len > MAX_TOTAL_LEN
    )


def _first_exchange(entry: object) -> tuple[str, str] | None:
    """The first human turn of a ShareGPT entry and the gpt turn that answers it."""
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list):
        return None
    for turn, reply in zip(turns, turns[1:], strict=False):
        if not (isinstance(turn, dict) and isinstance(reply, dict)):
            continue
        prompt, answer = turn.get("value"), reply.get("value")
        if (
            turn.get("from") in HUMAN_ROLES
            and reply.get("from") in GPT_ROLES
            and isinstance(prompt, str)
            and isinstance(answer, str)
        ):
            return prompt, answer
    return None


def load_sharegpt(path: str) -> list[tuple[str, str]]:
    """(prompt, answer) of every entry of a ShareGPT JSON file (a list of
    `{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}`):
    its first human turn and the gpt turn right after it. Entries without one are skipped;
    DatasetError for a file that is missing, not JSON, or has no such entry."""
    where = f"--dataset-path {path}"
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise DatasetError(f"{where}: no such file (nothing is downloaded)") from None
    except json.JSONDecodeError as e:
        raise DatasetError(f"{where}: not valid JSON ({e.msg}, line {e.lineno})") from None
    except UnicodeDecodeError:
        raise DatasetError(f"{where}: not UTF-8 text") from None
    except OSError as e:
        raise DatasetError(f"{where}: cannot read it ({e.strerror})") from None
    if not isinstance(data, list):
        raise DatasetError(
            f'{where}: expected a JSON list of {{"conversations": [...]}} entries, '
            f"got a JSON {type(data).__name__}"
        )
    pairs = [pair for entry in data if (pair := _first_exchange(entry)) is not None]
    if not pairs:
        raise DatasetError(
            f'{where}: no entry of {len(data)} has a "human" turn followed by a "gpt" turn'
        )
    return pairs


def sample_sharegpt(
    pairs: list[tuple[str, str]],
    num: int,
    seed: int,
    count_tokens: Callable[[list[str]], list[int]],
    output_len: int | None = None,
) -> list[SampleRequest]:
    """vLLM's ShareGPT sampling: the pairs shuffled by `seed`, taken in order while they pass
    `is_valid_sequence`, until `num`; fewer valid pairs are repeated (drawn with the same seed) to
    reach `num`. max_tokens is the answer's token count, or `output_len`
    (--sharegpt-output-len; then a short answer is no reason to skip a pair). `count_tokens`:
    token counts of texts, as the server's tokenizer counts them. DatasetError when no pair
    passes."""
    order = list(pairs)
    random.Random(seed).shuffle(order)
    samples: list[SampleRequest] = []
    pos = 0
    while len(samples) < num and pos < len(order):
        chunk = order[pos : pos + max(32, 2 * (num - len(samples)))]  # counted in batches
        pos += len(chunk)
        prompt_lens = count_tokens([prompt for prompt, _ in chunk])
        if output_len is None:
            output_lens = count_tokens([answer for _, answer in chunk])
        else:
            output_lens = [output_len] * len(chunk)
        for (prompt, _), n_in, n_out in zip(chunk, prompt_lens, output_lens, strict=True):
            if len(samples) < num and is_valid_sequence(n_in, n_out, output_len is None):
                samples.append(SampleRequest(prompt, n_in, n_out))
    if not samples:
        raise DatasetError(
            f"--dataset-name sharegpt: none of {len(pairs)} conversations has {MIN_LEN} to "
            f"{MAX_PROMPT_LEN} prompt tokens, at least {MIN_LEN} answer tokens and at most "
            f"{MAX_TOTAL_LEN} together"
        )
    rng = random.Random(seed)
    samples += [rng.choice(samples) for _ in range(num - len(samples))]
    return samples
