"""Prompts' KV blocks saved to files and restored into the prefix cache (issue 26 item 2:
llama.cpp's `--slot-save-path` and `/slots/{id}?action=save|restore`).

Saving writes the cached whole blocks of a prompt (a prompt run before: its blocks are in
the prefix cache, or it has been evicted and there is nothing to save). Restoring holds a
block for each whole block of the file's tokens (those already cached are kept, the others
are taken free), has every worker copy its part of the file into them, and only then
registers them in the prefix cache: the next request with that prompt is a prefix hit. Both
run between steps, in the engine core.

A restarted engine core (a later launch of its rank: the last one died) restores again the
files its rank had restored, listed in `.restored-dp<rank>` in the save directory, so that
the requests it resumes find their prompts cached as before; a first launch starts the list
anew.

The answers are dicts: a file that cannot be used here, a bad name or nothing to save is
`{"error": why}` (the front end's 400), not an exception.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

from treadle.config import EngineConfig
from treadle.core.kv_cache_manager import KVCacheManager
from treadle.executor.base import Executor
from treadle.executor.uniproc import UniProcExecutor
from treadle.logger import init_logger
from treadle.validation import check_filename
from treadle.worker import kv_file

logger = init_logger(__name__)


class PromptCacheFiles:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        executor: UniProcExecutor | Executor,
        vocab_size: int,
    ) -> None:
        self.directory = config.cache.kv_cache_save_path
        self.model = config.model.model or ""
        self.vocab_size = vocab_size
        self.kv = kv
        self.executor = executor
        self.dp_rank = 0  # (set by `on_launch` in a served engine core)
        self.restored: list[str] = []  # this rank's restored files, in order

    def on_launch(self, dp_rank: int, launch: int) -> None:
        """At start-up of DP rank `dp_rank`'s engine core: a first launch forgets what an
        earlier server restored; a later one (the last engine core died) restores those files
        again."""
        self.dp_rank = dp_rank
        manifest = self._manifest()
        if manifest is None:
            return
        if launch <= 1:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(manifest)
            return
        try:
            with open(manifest) as f:
                names = json.load(f)
        except (OSError, ValueError):
            return
        if not isinstance(names, list):
            return
        for name in names:
            if isinstance(name, str):
                answer = self.restore(name)
                if "error" in answer:
                    logger.warning("Not restored again after the restart: %s", answer["error"])

    def _manifest(self) -> str | None:
        if self.directory is None or not self.kv.enable_prefix_caching:
            return None
        return os.path.join(self.directory, f".restored-dp{self.dp_rank}")

    def _remember(self, filename: str) -> None:
        if filename in self.restored:
            self.restored.remove(filename)
        self.restored.append(filename)
        manifest = self._manifest()
        if manifest is None:
            return
        try:
            with open(manifest + ".tmp", "w") as f:
                json.dump(self.restored, f)
            os.replace(manifest + ".tmp", manifest)
        except OSError as e:
            logger.warning("Could not note the restored files in %s: %s", manifest, e)

    def save(self, token_ids: list[int], filename: str) -> dict[str, Any]:
        """Write the cached whole blocks of `token_ids` to `filename`."""
        path, why = self._path(filename)
        if path is None:
            return {"error": why}
        blocks = self.kv.cached_prefix(list(token_ids))
        if not blocks:
            return {
                "error": "none of this prompt is in the prefix cache (run it first; a prompt "
                f"shorter than one block ({self.kv.block_size} tokens) is never cached)"
            }
        n = len(blocks) * self.kv.block_size
        header = {"model": self.model, "token_ids": list(token_ids[:n])}
        start = time.perf_counter()
        ids = [b.block_id for b in blocks]
        written = sum(self.executor.collective_rpc("save_kv_blocks", (path, ids, header)))
        ms = (time.perf_counter() - start) * 1e3
        logger.info("Saved %d tokens of KV to %s (%d bytes, %.0f ms)", n, filename, written, ms)
        return {"n_saved": n, "n_written": written, "save_ms": ms, "token_ids": header["token_ids"]}

    def restore(self, filename: str) -> dict[str, Any]:
        """Read `filename` into the prefix cache (as much of it as free blocks hold)."""
        path, why = self._path(filename)
        if path is None:
            return {"error": why}
        if not self.kv.enable_prefix_caching:
            return {"error": "restoring needs the prefix cache (--enable-prefix-caching)"}
        if not os.path.isfile(path):
            return {"error": f"{filename!r} does not exist in the save directory"}
        start = time.perf_counter()
        try:
            header = kv_file.read_header(path)
        except kv_file.KVFileError as e:
            return {"error": f"{filename!r} {e}"}
        tokens = header["token_ids"]
        identity = self.executor.collective_rpc("kv_identity")[0]  # rank 0's: its file's
        problem = self._mismatch(header, identity)
        if problem is not None:
            return {"error": f"{filename!r} {problem}"}
        slots = self.kv.claim_for_restore(tokens)
        targets = {i: s.block.block_id for i, s in enumerate(slots) if s.new}
        try:
            read = sum(self.executor.collective_rpc("load_kv_blocks", (path, targets)))
        except (RuntimeError, ValueError, OSError) as e:  # a corrupt payload, a changed file
            self.kv.finish_restore(slots, filled=False)
            return {"error": f"{filename!r} could not be read: {e}"}
        self.kv.finish_restore(slots, filled=True)
        n = len(slots) * self.kv.block_size
        ms = (time.perf_counter() - start) * 1e3
        logger.info("Restored %d tokens of KV from %s (%.0f ms)", n, filename, ms)
        self._remember(filename)
        return {"n_restored": n, "n_read": read, "restore_ms": ms, "token_ids": tokens[:n]}

    def _path(self, filename: str) -> tuple[str | None, str]:
        if self.directory is None:
            return None, "saving and restoring prompts needs --kv-cache-save-path DIR"
        why = check_filename(filename)
        if why is not None:
            return None, f"filename {why}"
        path = os.path.join(self.directory, filename)
        if os.path.dirname(os.path.realpath(path)) != os.path.realpath(self.directory):
            return None, "filename must name a file in the save directory"
        return path, ""

    def _mismatch(self, header: dict[str, Any], identity: dict[str, Any]) -> str | None:
        """Why the file does not fit this server (its model, cache layout or TP size)."""
        expected = {"block_size": self.kv.block_size, **identity}
        expected.pop("tp_rank", None)
        for key, value in expected.items():
            if header.get(key) != value:
                return (
                    f"was saved with {key} {header.get(key)!r} (by {header.get('model')!r}); "
                    f"this server has {value!r}"
                )
        if not all(0 <= t < self.vocab_size for t in header["token_ids"]):
            return "has token ids outside the vocabulary"
        return None
