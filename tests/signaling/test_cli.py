import pytest

from signaling.cli import main


@pytest.mark.parametrize(
    "argv", [["--port", "abc"], ["--bogus"], ["--data", "nope"], ["--port", "0"]]
)
def test_bad_flags_one_line_nonzero(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("daisyweb-signal: error:") and "\n" not in err
