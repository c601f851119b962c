"""The backend's CLI: limits that make no sense are refused before anything loads."""

from __future__ import annotations

import pytest

from backends.vision_encoder.__main__ import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-pixels", "0"], "argument --max-pixels: must be at least 1, got 0"),
        (["--max-aspect-ratio", "0.5"], "argument --max-aspect-ratio: must be at least 1, got 0.5"),
        (["--max-aspect-ratio", "nan"], "argument --max-aspect-ratio: must be at least 1, got nan"),
        (["--decode-budget-pixels", "-5"], "argument --decode-budget-pixels: must be at least 1, got -5"),
    ],
)
def test_limits_below_one_are_a_usage_error(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
