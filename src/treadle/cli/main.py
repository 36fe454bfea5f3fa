"""`treadle` CLI: `treadle generate PROMPT`, `treadle serve [MODEL]`."""

from __future__ import annotations

import argparse
import sys

from treadle.cli.bench import add_bench_parser
from treadle.cli.serve import add_serve_parser, cli_docs
from treadle.config import ModelConfig
from treadle.engine_args import suggest
from treadle.ipc.fast_exit import exit_now


def _generate(args: argparse.Namespace) -> int:
    from treadle import LLM, SamplingParams

    try:
        params = SamplingParams(
            temperature=args.temperature,
            max_tokens=args.max_tokens,
            top_p=args.top_p,
            seed=args.seed,
        )
        llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len)
        prompt = args.prompt
        if args.chat:
            prompt = llm.input_processor.apply_chat_template([{"role": "user", "content": prompt}])
            prompt = {
                "prompt": prompt,
                "prompt_token_ids": llm.tokenizer(prompt, add_special_tokens=False).input_ids,
            }
        shown = 0
        for out in llm.stream(prompt, params):
            text = out.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
        sys.stdout.write("\n")
        return 0
    except (ValueError, FileNotFoundError, NotImplementedError, RuntimeError) as e:
        print(f"treadle generate: error: {e}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="treadle", description="treadle: a readable LLM serving engine"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    docs = cli_docs(ModelConfig)
    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--model", default=None, help=docs["model"])
    gen.add_argument("--dtype", default="auto", help=docs["dtype"])
    gen.add_argument("--max-model-len", type=int, default=None, help=docs["max_model_len"])
    gen.add_argument("--max-tokens", type=int, default=64, help="most new tokens (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.set_defaults(func=_generate)
    add_serve_parser(sub)
    add_bench_parser(sub)
    for command in _leaf_parsers(parser):  # for `unrecognized`: the usage of the command used
        command.set_defaults(_parser=command)
    return parser


def _leaf_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _leaf_parsers(sub) or [sub]
    return found


def unrecognized(command: argparse.ArgumentParser, extras: list[str]) -> str:
    """`unrecognized arguments: --max-num-seq; did you mean '--max-num-seqs'?`; a short
    flag spelt long, as vLLM's users type `--tp`, names the short one and its long name:
    `did you mean '-tp' (--tensor-parallel-size)?`."""
    message = f"unrecognized arguments: {' '.join(extras)}"
    first = next((e.split("=")[0] for e in extras if e.startswith("-")), None)
    if first is None:
        return message
    short = "-" + first.lstrip("-")
    for action in command._actions:
        if short in action.option_strings:
            long = next((s for s in action.option_strings if s.startswith("--")), None)
            return message + f"; did you mean {short!r}" + (f" ({long})?" if long else "?")
    flags = [s for a in command._actions for s in a.option_strings if s.startswith("--")]
    return message + suggest(first if first.startswith("--") else "-" + first, flags)


def main(argv: list[str] | None = None) -> int:
    args, extras = build_parser().parse_known_args(argv)
    if extras:  # one line that names the flag (argparse would add the whole usage, no hint)
        command = args._parser
        command.exit(2, f"{command.prog}: error: {unrecognized(command, extras)}\n")
    return int(args.func(args))


def run() -> None:
    """The `treadle` command: `main`, then an exit without the interpreter's teardown (see
    `exit_now`): a headless host or a stopped server is gone a second sooner."""
    try:
        code = main()
    except SystemExit as e:  # argparse's usage errors (printed already) and --help
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    exit_now(code)


if __name__ == "__main__":
    run()
