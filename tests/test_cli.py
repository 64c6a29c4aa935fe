"""The ``lynn`` command line, called in-process through ``lynn_kernels.cli.main``."""

from __future__ import annotations

import os
import re
from pathlib import Path

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


def test_check_unknown_names_are_usage_errors(capsys):
    """A bad name ends in a usage error that lists the choices, not a traceback."""
    assert main(["check", "nvfp5"]) == 2
    err = capsys.readouterr().err
    assert "unknown check nvfp5: expected a family (nvfp4, matmul, attention, deltanet, moe, norm)" in err
    assert main(["check", "nvfp4.bogus"]) == 2
    assert "no check of op nvfp4.bogus; the ops of nvfp4: " in capsys.readouterr().err


def test_check_takes_op_names_as_the_table_prints_them():
    rows, _ = checks.run_checks(["nvfp4.quantize"])
    assert rows and {r["op"] for r in rows} == {"nvfp4.quantize"}


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("lynn ")


def test_public_ops_show_their_spec_in_help():
    """The ops built from a host function carry the reference's name, signature and docstring."""
    import inspect

    import lynn_kernels as lk

    for op in (lk.nvfp4.quantize, lk.nvfp4.dequantize, lk.matmul.nvfp4_linear, lk.matmul.nvfp4_gemv,
               lk.matmul.nvfp4_gemm):
        assert op.__name__ == op.reference.__name__
        assert op.__doc__.startswith(op.reference.__doc__.rstrip()) and "use_reference()" in op.__doc__
        assert inspect.signature(op) == inspect.signature(op.reference)


@pytest.mark.skipif(ON_GPU, reason="on a GPU the benchmarks run")
def test_bench_run_from_python_needs_a_gpu():
    from lynn_kernels import bench

    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        bench.run(["nvfp4"])


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
    root = Path(cli.__file__).resolve().parents[1]                # the repository, so ../docs links resolve
    assert argv[3] == f"--ServerApp.root_dir={root}" and argv[4] == "--LabApp.default_url=/lab/tree/notebooks"
    assert argv[-3:] == ["--no-browser", "--port", "8899"]
    assert ("--allow-root" in argv) == (os.geteuid() == 0)


def test_unknown_options_are_refused_outside_lab():
    with pytest.raises(SystemExit):
        cli.main(["check", "--bogus"])
