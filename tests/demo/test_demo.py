"""`dlstore demo`: its arguments are checked before it generates anything."""

from __future__ import annotations

import pytest

from dlstore.cli import main as cli


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--epochs", "0"], "epochs must be at least 1"),
        (["--store", "swfit://c/demo"], "swfit"),
        (["--workdir", "/proc/no-such-folder"], "cannot use /proc/no-such-folder (--workdir)"),
    ],
)
def test_the_demo_refuses_bad_arguments_before_it_makes_anything(tmp_path, capsys, extra, said):
    """`--epochs 0` and a mistyped `--store` failed only after the images were generated (and,
    for the epochs, converted and loaded); a `--workdir` that cannot be made was a traceback."""
    argv = ["demo", "--no-train", *extra] if extra[0] == "--workdir" else ["demo", *extra]
    if "--workdir" not in extra:
        argv += ["--workdir", str(tmp_path / "work")]
    assert cli(argv) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "work" / "source").exists()  # nothing generated
