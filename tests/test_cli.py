"""The ``lynn`` command line, called in-process through ``lynn_kernels.cli.main``."""

from __future__ import annotations

import re

import pytest
import torch

from lynn_kernels import checks
from lynn_kernels import cli
from lynn_kernels.cli import main

ON_GPU = torch.cuda.is_available()


def test_check_prints_a_passing_table(capsys):
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("lynn check on ") and "backend " in lines[0]
    header = lines[1].split()
    assert header == checks.COLUMNS
    rows = [line for line in lines[3:] if line.startswith("nvfp4")]
    assert rows, out
    ops = {line.split()[0] for line in rows}
    assert {"nvfp4.quantize", "nvfp4.dequantize"} <= ops
    assert all(line.rstrip().endswith("yes") for line in rows), out      # the passed column
    every = [line for line in lines[3:] if line.rstrip().endswith((" yes", " no"))]
    assert {line.split()[0].split(".")[0] for line in every} >= {"nvfp4", "matmul", "attention", "deltanet", "moe"}
    done = re.search(r"^(\d+)/(\d+) checks passed in [\d.]+ s$", out, re.M)
    assert done and done.group(1) == done.group(2) == str(len(every))


def test_check_rows_all_pass():
    rows, seconds = checks.run_checks(["nvfp4"])
    assert rows and seconds >= 0
    assert all(r["passed"] is True for r in rows), [r["case"] for r in rows if not r["passed"]]
    assert {r["backend"] for r in rows} == {"triton" if ON_GPU else "interpreter"}
    quant = [r for r in rows if r["op"] in ("nvfp4.quantize", "nvfp4.dequantize")]
    assert quant and all((r["metrics"].mismatches if "mismatches" not in r else r["mismatches"]) == 0 for r in quant)
    assert all(r["mismatches"] == 0 for r in rows if r["op"] == "nvfp4.quantize")   # codes + scales + global


def test_check_unknown_family():
    with pytest.raises(KeyError, match=r"unknown kernel family \['nvfp5'\]; available: \['attention', 'deltanet', 'matmul', 'moe', 'norm', 'nvfp4'\]"):
        main(["check", "nvfp5"])


@pytest.mark.skipif(ON_GPU, reason="on a GPU `lynn bench` runs the benchmarks")
def test_bench_needs_a_gpu(capsys):
    assert main(["bench"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "lynn bench needs a CUDA GPU" in captured.err and "data/bench/h200/" in captured.err


def test_bench_list(capsys):
    assert main(["bench", "--list"]) == 0
    listed = capsys.readouterr().out.split()
    assert listed == ["attention.decode", "attention.prefill", "decoder.qwen3-next-80b-a3b",
                      "decoder.qwen3.5-35b-a3b", "deltanet.chunk", "deltanet.conv",
                      "deltanet.recurrent", "matmul.chain", "matmul.graph", "matmul.linear", "moe.block",
                      "nvfp4.dequantize", "nvfp4.quantize"]


def test_info(capsys):
    assert main(["info"]) == 0
    fields = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
    fields = {k.strip(): v for k, v in fields.items()}
    assert {"backend", "device", "torch", "triton"} <= set(fields)
    assert fields["torch"] == torch.__version__
    if not ON_GPU:
        assert fields["backend"] == "interpreter" and fields["device"] == "cpu (Triton interpreter)"


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    assert "usage: lynn" in capsys.readouterr().err


def test_lab_opens_jupyterlab_on_the_notebooks(monkeypatch):
    calls = []
    monkeypatch.setattr(cli.os, "execv", lambda exe, argv: calls.append(argv))
    assert cli.main(["lab", "--no-browser", "--port", "8899"]) == 0
    (argv,) = calls
    assert argv[1:3] == ["-m", "jupyterlab"]
    assert argv[3].startswith("--notebook-dir=") and argv[3].endswith("notebooks")
    assert argv[4:] == ["--no-browser", "--port", "8899"]


def test_unknown_options_are_refused_outside_lab():
    with pytest.raises(SystemExit):
        cli.main(["check", "--bogus"])
