"""The command lines: a user's mistake is one line, found before any model loads."""
import os
import subprocess
import sys

import pytest

from serving import server
import superinfer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("argv,match", [
    (["hi", "--policy", "lifo"], "unknown policy 'lifo'"),
    ([""], "prompt: empty"), (["", "--no-chat"], "prompt: empty"),
    (["hi", "--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
    (["hi", "--model", "/no/such/dir"], "no such file or directory"),
    (["hi", "--dtype", "int32"], "dtype must be a floating-point type"),
    (["hi", "--temperature", "nan"], "temperature must be a finite number"),
    (["hi", "--max-tokens", "0"], "max_tokens must be >= 1"),
    (["hi", "--block-size", "x"], "invalid int value"),
    (["hi", "--policy", "rotasched:alpha=-2"], "alpha must be a finite number"),
    (["hi", "--swap-in-overlap", "maybe"], "invalid choice: 'maybe'"),
    (["hi", "--device", "tpu"], "device: cannot read 'tpu'"),
    (["hi", "--nope"], "unrecognized arguments"),
])
def test_bad_arguments_are_one_line(argv, match, capsys, monkeypatch):
    def no_loading(*a, **k):
        raise AssertionError("loaded a model before checking the arguments")
    monkeypatch.setattr(superinfer, "LLM", no_loading)
    with pytest.raises(SystemExit) as e:
        superinfer.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and match in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("argv,match", [
    (["--port", "0"], "--port must be in 1..65535"),
    (["--policy", "x"], "unknown policy 'x'"),
    (["--swap-in-overlap", "maybe"], "invalid choice: 'maybe'"),
])
def test_bad_server_arguments_are_one_line(argv, match, capsys, monkeypatch):
    def no_loading(*a, **k):
        raise AssertionError("loaded a model before checking the arguments")
    monkeypatch.setattr(server, "Engine", no_loading)
    with pytest.raises(SystemExit) as e:
        server.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and match in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("argv", [["serve", "--port", "0"], ["--swap-in-overlap", "maybe", "hi"]])
def test_the_entry_point_reports_one_line(argv):
    out = subprocess.run([sys.executable, "superinfer.py", *argv], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_question_gets_an_answer():
    out = subprocess.run([sys.executable, "superinfer.py", "What is the capital of France?",
                          "--max-tokens", "12"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "Paris" in out.stdout
