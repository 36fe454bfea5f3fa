"""llama.cpp's `--lora FNAME` is refused at start with one line saying what to give instead
(issue 40: treadle reads PEFT adapter directories, not GGUF adapters)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_llama_cpp_lora_flag_is_one_line_and_exit_2(
    default_model_path: str, tmp_path: Path
) -> None:
    adapter = tmp_path / "adapter.gguf"
    adapter.write_bytes(b"GGUF")
    cmd = [sys.executable, "-m", "treadle.cli.main", "serve", default_model_path]
    out = subprocess.run(
        [*cmd, "--lora", str(adapter)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert "GGUF" in line and "--enable-lora --lora-modules NAME=DIR" in line, out.stderr
