import json

import pytest

from daisyweb.checkpoint import load_checkpoint
from daisyweb.cli import demo, generate

TINY = ["--width", "16", "--layers", "1", "--heads", "2", "--seq", "16", "--batch", "2"]


def test_demo_single_peer_trains_saves_and_generate_reads_it(tmp_path, capsys) -> None:
    save, metrics = tmp_path / "demo.pt", tmp_path / "m.jsonl"
    code = demo.main(["--peers", "1", "--steps", "4", "--save", str(save),
                      "--metrics", str(metrics), *TINY])
    assert code == 0
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in records[:-1]] == [1, 2, 3, 4]
    ckpt = load_checkpoint(save)
    assert ckpt.step == 4 and ckpt.weight_hash == records[-1]["weight_hash"]
    capsys.readouterr()

    assert generate.main([str(save), "--prompt", "The ", "--tokens", "12", "--seed", "1"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("The ") and len(first) > len("The \n")
    generate.main([str(save), "--prompt", "The ", "--tokens", "12", "--seed", "1"])
    assert capsys.readouterr().out == first  # seeded sampling is reproducible


@pytest.mark.parametrize("argv", [["--peers", "0"], ["--steps", "0"], ["--width", "15"],
                                  ["--save-every", "5"], ["--peers", "x"]])
def test_demo_bad_flags_exit_2_with_message(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.main(argv)
    assert exc.value.code == 2
    assert "daisyweb-demo: error:" in capsys.readouterr().err


def test_generate_refuses_missing_and_bad_files(tmp_path, capsys) -> None:
    assert generate.main([str(tmp_path / "nope.pt")]) == 1
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    assert generate.main([str(bad)]) == 1
    assert "cannot use" in capsys.readouterr().err
