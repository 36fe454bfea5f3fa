"""Fill-in-the-middle prompts as llama.cpp's `llama-server` lays them out (its
`format_prompt_infill`, repo-level pattern of arXiv 2409.12186), so an editor plug-in made for
llama.cpp (llama.vscode, llama.vim) gets the same tokens from treadle:

    extra context                     (its last tokens: what fits, see below)
    [BOS]                             (when the tokenizer adds one)
    [FIM_PRE] prefix prompt [FIM_SUF] suffix [FIM_MID]

where the extra context is `[FIM_REP]myproject\\n`, then `[FIM_SEP]{filename}\\n{text}` per
chunk of `input_extra` (without a FIM_SEP token: "\\n\\n--- snippet ---\\n\\n" before each chunk),
then `[FIM_SEP]filename\\n`. The prefix keeps its last `3/4 * n_batch` tokens, the suffix its
first `n_batch/4 - 2 - len(prompt)`, and the extra context the last
`n_ctx - n_batch - 2 * n_predict` tokens. Texts are tokenized without special tokens and with
special-token text taken literally (llama.cpp's `parse_special = false`); `prompt` is the
start of the middle, with its special tokens parsed.

The FIM tokens are found by their texts, as llama.cpp finds them in a vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from treadle.validation import InvalidRequest

# Token texts llama.cpp recognises (llama-vocab.cpp), in its order of preference.
_NAMES: dict[str, tuple[str, ...]] = {
    "prefix": (
        "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
        "<|code_prefix|>",
    ),
    "suffix": (
        "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
        "<|code_suffix|>",
    ),
    "middle": (
        "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
        "<|code_middle|>",
    ),
    "repo": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "file_sep": ("<|file_sep|>",),
}  # fmt: skip
_SNIPPET = "\n\n--- snippet ---\n\n"
# Texts of tokens llama.cpp always treats as end-of-generation (with eos and the FIM pad,
# repo and file-separator tokens).
_END_NAMES = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<｜end▁of▁sentence｜>",
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", *_NAMES["repo"], *_NAMES["file_sep"],
)  # fmt: skip

Mixed = str | Sequence[int | str]
"""A text, or token ids and texts mixed (llama.cpp's `tokenize_mixed`)."""


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    repo: int | None
    file_sep: int | None


def find_fim_tokens(tokenizer: Any) -> FimTokens:
    """The tokenizer's FIM tokens; `InvalidRequest` naming the missing ones if it has no
    prefix, suffix or middle token (the model was not trained to fill in the middle)."""
    vocab = tokenizer.get_vocab()
    found = {
        role: next((vocab[n] for n in names if n in vocab), None) for role, names in _NAMES.items()
    }
    missing = [role for role in ("prefix", "suffix", "middle") if found[role] is None]
    if missing:
        wanted = "; ".join(f"{role}: one of {', '.join(_NAMES[role][:3])}" for role in missing)
        raise InvalidRequest(
            "input_prefix",
            f"this model has no fill-in-the-middle tokens ({wanted}): use a model trained for "
            "FIM (e.g. Qwen2.5-Coder, StarCoder2, CodeLlama)",
        )
    prefix, suffix, middle = found["prefix"], found["suffix"], found["middle"]
    assert prefix is not None and suffix is not None and middle is not None
    return FimTokens(prefix, suffix, middle, found["repo"], found["file_sep"])


def end_of_generation_ids(tokenizer: Any) -> list[int]:
    """The tokens llama.cpp ends a generation at (its `is_eog`): eos and those of `_END_NAMES`
    the vocabulary has."""
    vocab = tokenizer.get_vocab()
    ids = {vocab[name] for name in _END_NAMES if name in vocab}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def tokenize_mixed(tokenizer: Any, value: Mixed, vocab_size: int, param: str) -> list[int]:
    """Token ids of a text, or of a list mixing ids and texts; texts without special tokens,
    special-token text taken literally."""
    items: Sequence[int | str] = [value] if isinstance(value, str) else value
    ids: list[int] = []
    for item in items:
        if isinstance(item, str):
            ids += literal_ids(tokenizer, item)
        elif isinstance(item, int) and not isinstance(item, bool) and 0 <= item < vocab_size:
            ids.append(item)
        else:
            raise InvalidRequest(param, f"token ids must be in [0, {vocab_size}), got {item!r}")
    return ids


def literal_ids(tokenizer: Any, text: str) -> list[int]:
    if not text:
        return []
    encoded = tokenizer(text, add_special_tokens=False, split_special_tokens=True)
    return list(encoded.input_ids)


def adds_bos(tokenizer: Any) -> bool:
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    ids = tokenizer("a", add_special_tokens=True).input_ids
    return bool(ids) and ids[0] == bos


@dataclass(frozen=True)
class FimBudget:
    n_batch: int
    """llama.cpp's logical batch size: the prefix and suffix share it (3:1)."""
    n_ctx: int
    """The context size: the extra context fills what the batch and the output leave."""
    n_predict: int
    """Tokens to generate (-1: no limit, llama.cpp's default)."""


def fim_prompt(
    tokenizer: Any,
    fim: FimTokens,
    prefix: list[int],
    suffix: list[int],
    extra: Sequence[tuple[str, str]],
    prompt: list[int],
    budget: FimBudget,
) -> list[int]:
    """The FIM prompt's token ids (see the module's docstring). `extra`: (filename, text)."""
    extra_ids: list[int] = []
    if fim.repo is not None:
        extra_ids += [fim.repo, *literal_ids(tokenizer, "myproject\n")]
    for filename, text in extra:
        if fim.file_sep is not None:
            extra_ids += [fim.file_sep, *literal_ids(tokenizer, filename + "\n")]
        else:
            extra_ids += literal_ids(tokenizer, _SNIPPET)
        extra_ids += literal_ids(tokenizer, text)
    if fim.file_sep is not None:
        extra_ids += [fim.file_sep, *literal_ids(tokenizer, "filename\n")]

    n_batch = budget.n_batch
    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra = min(max(0, budget.n_ctx - n_batch - 2 * budget.n_predict), len(extra_ids))

    head = [fim.prefix, *prefix[len(prefix) - n_prefix :], *prompt]
    tail = [fim.suffix, *suffix[:n_suffix]]
    bos = [tokenizer.bos_token_id] if adds_bos(tokenizer) else []
    context = extra_ids[len(extra_ids) - n_extra :] if n_extra else []
    # llama.cpp shifts its context when the prompt and the output do not fit; treadle refuses
    # such a prompt: the extra context gives up its first tokens so that they fit when it can
    over = (
        len(context)
        + len(bos)
        + len(head)
        + len(tail)
        + 1
        - (budget.n_ctx - max(budget.n_predict, 1))
    )
    if over > 0:
        context = context[min(over, len(context)) :]
    return [*context, *bos, *head, *tail, fim.middle]
