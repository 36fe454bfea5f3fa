"""What a front end takes from its PULL socket (channel 2), before anything acts on it.

A message is one of:
- `ENGINE_CORE_DEAD` (an engine failed) with its `DeathReport` (decoded within its bounds,
  and for the engine that sent it; a bad one is dropped, and the death stays, without a
  report), or `ENGINE_CORE_STOPPED` (an engine was stopped on purpose, after answering
  every request it had). Each ends with its sender's proof (`ipc/engine_auth.py`: the rank,
  the launch, an HMAC under that launch's token): one without a proof that holds is refused
  and logged, and nothing stops, dies or is blamed;
- `[msgpack EngineCoreOutputs][aux...]` from engine `engine_index`, whose token ids lie in the
  vocabulary and whose logprobs have one row of matching lengths per token.

Anything else (garbage, truncated msgpack, wrong field types, an unknown engine index, token
ids outside the vocabulary) is dropped and logged (`DropLog`), so
that what reaches the output processor cannot make it raise. The socket is open to any local
process of the same user (ipc files are 0600), or to the network with engines on other hosts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from treadle.ipc.engine_auth import EngineIdentities, EngineRefusedError
from treadle.ipc.inbound import DropLog
from treadle.ipc.serial import MsgpackDecoder
from treadle.logger import init_logger
from treadle.wire.control import (
    ENGINE_CORE_DEAD,
    ENGINE_CORE_STOPPED,
    DeathReport,
    decode_death_report,
)
from treadle.wire.engine import EngineCoreOutput, EngineCoreOutputs

logger = init_logger(__name__)

_CONTROL = {len(f): f for f in (ENGINE_CORE_DEAD, ENGINE_CORE_STOPPED)}
_FRAMES = {ENGINE_CORE_STOPPED: 2, ENGINE_CORE_DEAD: 3}  # with the proof


class OutputReader:
    """Decodes and checks one message at a time (one thread or task: it keeps state);
    `engines` (the client's, kept current) checks control messages' proofs."""

    def __init__(self, engines: EngineIdentities, vocab_size: int) -> None:
        self.engines = engines
        self.num_engines = engines.num_engines
        self.vocab_size = vocab_size
        self.decoder = MsgpackDecoder(EngineCoreOutputs)
        self.drops = DropLog(logger)
        self.refusals = DropLog(logger)  # control messages without a proof that holds

    def read(self, frames: Sequence[Any]) -> EngineCoreOutputs | DeathReport | bytes | None:
        """The outputs, an engine's death report, a control frame (`ENGINE_CORE_DEAD` without
        a usable report, `ENGINE_CORE_STOPPED`), or None for a message that was dropped (and
        logged)."""
        if 1 <= len(frames) <= 3 and len(frames[0]) in _CONTROL:
            control = _CONTROL[len(frames[0])]
            if bytes(frames[0]) == control:
                return self._control(control, [bytes(f) for f in frames])
        try:
            outputs: EngineCoreOutputs = self.decoder.decode(frames)
        except Exception as e:
            self.drops.drop(
                "Dropped a malformed engine output (%d frames, %d bytes): %s",
                len(frames),
                sum(len(f) for f in frames),
                e,
            )
            return None
        problem = self.check(outputs)
        if problem is not None:
            self.drops.drop("Dropped an engine output: %s", problem)
            return None
        return outputs

    def _control(self, control: bytes, frames: list[bytes]) -> DeathReport | bytes | None:
        try:
            if len(frames) != _FRAMES[control]:
                raise EngineRefusedError(f"{len(frames)} frames, not {_FRAMES[control]}")
            rank = self.engines.check_control(frames)
        except EngineRefusedError as e:
            self.refusals.drop(
                "Refused %s on the output socket: %s (not from an engine of this front end); "
                "nothing stops",
                control.decode(),
                e,
            )
            return None
        return self._death_report(frames[1], rank) if control == ENGINE_CORE_DEAD else control

    def _death_report(self, payload: bytes, rank: int) -> DeathReport | bytes:
        try:
            report = decode_death_report(payload)
            if report.engine_index != rank:
                raise ValueError(f"engine index {report.engine_index} from engine {rank}")
        except Exception as e:
            self.drops.drop("Dropped a malformed death report (%d bytes): %s", len(payload), e)
            return ENGINE_CORE_DEAD
        return report

    def check(self, outputs: EngineCoreOutputs) -> str | None:
        """Why `outputs` cannot be used, or None."""
        if not 0 <= outputs.engine_index < self.num_engines:
            return f"unknown engine index {outputs.engine_index} ({self.num_engines} engines)"
        for out in outputs.outputs:
            problem = self._check_output(out)
            if problem is not None:
                return f"request {out.request_id!r}: {problem}"
        return None

    def _check_output(self, out: EngineCoreOutput) -> str | None:
        if not self._in_vocab(out.new_token_ids):
            return f"token ids outside [0, {self.vocab_size})"
        for lp, rows in (
            (out.new_logprobs, len(out.new_token_ids)),
            (out.new_prompt_logprobs, None),
        ):
            if lp is None:
                continue
            if rows is None:
                rows = len(lp.token_ids)
            if not len(lp.token_ids) == len(lp.logprobs) == len(lp.ranks) == rows:
                return "logprobs do not have one row per token"
            for ids, values in zip(lp.token_ids, lp.logprobs, strict=True):
                if not ids or len(ids) != len(values) or not self._in_vocab(ids):
                    return "a logprobs row is empty, uneven or outside the vocabulary"
        return None

    def _in_vocab(self, ids: list[int]) -> bool:
        return not ids or (min(ids) >= 0 and max(ids) < self.vocab_size)
