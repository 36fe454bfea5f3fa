"""Errors that point somewhere (issue 42 item 4): a flag spelt as vLLM's users type it
(`--tp`, `--pp`, `--dp`) gets one line naming the short flag and its long name, not the whole
usage; a tensor-parallel size that does not divide the heads lists the sizes that do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from treadle.cli.main import main
from treadle.config import resolve_model
from treadle.worker.start_checks import check_parallel_layout, model_arch, tp_sizes

TREADLE = str(Path(sys.executable).parent / "treadle")


@pytest.mark.parametrize(
    ("typed", "short", "long"),
    [
        ("--tp", "-tp", "--tensor-parallel-size"),
        ("--pp", "-pp", "--pipeline-parallel-size"),
        ("--dp", "-dp", "--data-parallel-size"),
        ("--tp=2", "-tp", "--tensor-parallel-size"),
    ],
)
def test_a_short_flag_spelt_long_gets_one_line_naming_it(
    typed: str, short: str, long: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", typed] if "=" in typed else ["serve", typed, "2"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no usage dump
    assert err.startswith("treadle serve: error: unrecognized arguments: ")
    assert f"did you mean '{short}' ({long})?" in err


def test_the_real_command_prints_one_line() -> None:
    result = subprocess.run(
        [TREADLE, "serve", "--tp", "2"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "treadle serve: error: unrecognized arguments: --tp; "
        "did you mean '-tp' (--tensor-parallel-size)?"
    ]


def test_tp_on_nine_heads_lists_the_sizes_that_divide_them() -> None:
    smollm2 = model_arch(resolve_model(None))  # the default model, SmolLM2-135M
    assert (smollm2.num_heads, smollm2.num_kv_heads, smollm2.intermediate_size) == (9, 3, 1536)
    assert tp_sizes(smollm2) == [1, 3]  # (9 divides the heads, not the MLP width)
    with pytest.raises(ValueError) as info:
        check_parallel_layout(smollm2, 2)
    message = str(info.value)
    assert "the sizes that divide them: 1, 3, 9" in message
    assert "that this model splits at: 1, 3" in message
    with pytest.raises(ValueError, match=r"this model splits at: 1, 3\)"):
        check_parallel_layout(smollm2, 9)
