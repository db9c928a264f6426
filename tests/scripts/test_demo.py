"""scripts/demo.py (the README's first command; CI does not run it whole): its arguments are
checked before any run starts."""

from __future__ import annotations

import pytest

from tests.utils import load_script


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--iters", "3"], "--iters must be >= 6 (two windows of 3 losses), got 3"),
        (["--straggler-iters", "5"], "--straggler-iters must be >= 12, got 5"),
    ],
)
def test_too_few_iterations_are_refused_by_name(argv, message, tmp_path, capsys):
    demo = load_script("demo")
    with pytest.raises(SystemExit) as exit_:
        demo.main([*argv, "--out", str(tmp_path / "demo")])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()  # nothing ran
