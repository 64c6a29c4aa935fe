"""The ``lynn`` command line, called in-process through ``lynn_cli.main``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch

import lynn_cli
import lynn_kernels
from lynn_cli import check as check_cmd
from lynn_cli import lab as lab_cmd
from lynn_cli import main
from lynn_kernels import check, compare

ON_GPU = torch.cuda.is_available()


def test_check_prints_a_passing_table(capsys):
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("lynn check on ") and "backend " in lines[0]
    header = lines[1].split()
    assert header == ["fam", *check.PORTABLE_COLUMNS]
    assert all(len(line) <= 120 for line in lines), max(lines, key=len)
    every = [line for line in lines[3:] if re.match(r"\[\d/6\]  ", line)]
    rows = [line.split()[1] for line in every if line.split()[1].startswith("nvfp4")]
    assert {"nvfp4.quantize", "nvfp4.dequantize"} <= set(rows), out
    assert all(line.rstrip().endswith(" yes") for line in every), out      # the passed column
    assert {line.split()[1].split(".")[0] for line in every} >= {"nvfp4", "matmul", "attention", "deltanet", "moe",
                                                                 "norm"}
    assert [int(line[1]) for line in every] == sorted(int(line[1]) for line in every)    # families in order
    done = re.search(r"^(\d+)/(\d+) checks passed in [\d.]+ s$", out, re.MULTILINE)
    assert done and done.group(1) == done.group(2) == str(len(every))


def test_check_rows_all_pass():
    rows, seconds = check.run_checks(["nvfp4"])
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
    rows, _ = check.run_checks(["nvfp4.quantize"])
    assert rows and {r["op"] for r in rows} == {"nvfp4.quantize"}
    rows, _ = check.run_checks(["nvfp4 round trip"])                 # printed without a dot
    assert rows and {r["op"] for r in rows} == {"nvfp4 round trip"}


def test_check_refuses_a_bad_op_before_running_anything(monkeypatch, capsys):
    """A bad op name of a real family is refused up front, not after its family's checks have run."""
    def boom():
        raise AssertionError("a check ran before the bad name was refused")

    monkeypatch.setitem(check.CHECKS, "matmul", boom)
    with pytest.raises(ValueError, match="no check of op matmul.bogus; the ops of matmul: matmul.nvfp4_gemv"):
        check.run_checks(["matmul.bogus"])
    assert main(["check", "matmul.bogus"]) == 2
    assert "no check of op matmul.bogus" in capsys.readouterr().err


def test_check_refuses_an_op_without_rows_on_this_backend(monkeypatch):
    """A real op whose checks need another backend (the packed decode kernels under the reference) is an error,
    not an empty table that passes."""
    rows = [{"op": "nvfp4.quantize", "case": "c", "mismatches": 0, "passed": True}]
    monkeypatch.setitem(check.CHECKS, "nvfp4", lambda: iter(rows))
    with pytest.raises(ValueError, match="nvfp4.dequantize: no rows on backend"):
        check.run_checks(["nvfp4.dequantize"])
    assert check.run_checks(["nvfp4.quantize"])[0] == [{"backend": lynn_kernels.runtime.backend(), **rows[0]}]


def test_every_family_lists_its_ops():
    """Each family's check.OPS: the op names its rows carry (run_checks raises on a row outside it)."""
    for fam in check.CHECKS:
        ops = check.family_ops(fam)
        assert ops and len(set(ops)) == len(ops)
        assert all(check._family(op) == fam for op in ops), (fam, ops)


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
    monkeypatch.setattr(lab_cmd.os, "execv", lambda exe, argv: calls.append(argv))
    assert main(["lab", "--no-browser", "--port", "8899"]) == 0
    assert main(["lab", "--port=8900", "--ip", "0.0.0.0", "--ServerApp.token=x"]) == 0   # the rest: jupyter lab's
    (argv, other) = calls
    assert argv[1:3] == ["-m", "jupyterlab"]
    root = Path(lab_cmd.__file__).resolve().parents[1]                # the repository, so ../docs links resolve
    start = "/lab/tree/notebooks/00-start-here.ipynb"
    assert argv[3] == f"--ServerApp.root_dir={root}" and argv[4] == f"--LabApp.default_url={start}"
    assert (root / "notebooks" / "00-start-here.ipynb").exists()
    assert argv[-3:] == ["--no-browser", "--port", "8899"]
    assert ("--allow-root" in argv) == (os.geteuid() == 0)
    assert other[-5:] == ["--port", "8900", "--ip", "0.0.0.0", "--ServerApp.token=x"]
    assert "--no-browser" not in other


def test_lab_help_says_where_the_options_go(capsys):
    with pytest.raises(SystemExit):
        main(["lab", "--help"])
    out = capsys.readouterr().out
    assert "00-start-here.ipynb" in out and "--no-browser" in out and "--port PORT" in out
    assert "jupyter lab --help" in out


def test_unknown_options_are_refused_outside_lab():
    with pytest.raises(SystemExit):
        main(["check", "--bogus"])


# ---------------------------------------------------------------------------------------------------------------
# start-up configuration errors: one line and exit status 2 from the `lynn` command, a traceback for Python users

REPO = Path(__file__).resolve().parents[1]


def run_lynn(command: list[str], args: list[str], **env) -> subprocess.CompletedProcess:
    """Run a ``lynn`` command line in a fresh process with TRITON_INTERPRET / LYNN_BACKEND unset and no GPU visible,
    plus ``env``."""
    clean = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LYNN_BACKEND")}
    clean["CUDA_VISIBLE_DEVICES"] = ""
    clean.update(env)
    return subprocess.run([*command, *args], env=clean, cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=False)


#: The two ways to start the command: the installed script and ``python -m lynn_cli``.
COMMANDS = {"script": [str(Path(sys.executable).with_name("lynn"))], "module": [sys.executable, "-m", "lynn_cli"]}


def test_the_lynn_script_enters_outside_the_package():
    """The script starts at ``lynn_cli.main``, outside ``lynn_kernels``, so that it can report an error raised while
    ``lynn_kernels`` is imported."""
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert meta["project"]["scripts"]["lynn"] == "lynn_cli:main"
    assert Path(COMMANDS["script"][0]).is_file(), "the lynn script is not installed next to this python"


@pytest.mark.parametrize("how", list(COMMANDS))
def test_a_bad_lynn_backend_is_a_usage_error(how):
    r = run_lynn(COMMANDS[how], ["info"], LYNN_BACKEND="bogus")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == ("lynn: error: LYNN_BACKEND='bogus': expected one of ('triton', 'interpreter', 'reference') "
                        "or unset\n")


def test_lynn_backend_triton_without_a_gpu_is_a_usage_error():
    r = run_lynn(COMMANDS["module"], ["check", "norm"], LYNN_BACKEND="triton")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == ("lynn: error: LYNN_BACKEND=triton asks for compiled kernels, but no CUDA GPU is visible "
                        "(or TRITON_INTERPRET=1 is set)\n")


def test_lynn_cli_main_runs_the_command(capsys):

    assert lynn_cli.main(["info"]) == 0
    assert "backend: " in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------------
# lynn check streams its table: the header first, each row as its family hands it over, 120 columns at most

SUMMARY = re.compile(r"^(\d+)/(\d+) checks passed in [\d.]+ s$", re.MULTILINE)


def check_lines(out: str) -> tuple[list[str], list[str]]:
    """The lines of ``lynn check``'s output, and those that start a row (with their ``[i/n]`` marker)."""
    lines = out.splitlines()
    return lines, [line for line in lines if re.match(r"\[\d+/\d+\]  \S", line)]


def test_check_norm_streams_a_table_of_120_columns(capsys):
    assert main(["check", "norm"]) == 0
    lines, rows = check_lines(capsys.readouterr().out)
    assert lines[0].startswith("lynn check on ") and "note:" not in "\n".join(lines)
    assert lines[1].split() == ["fam", *check.PORTABLE_COLUMNS] and set(lines[2]) == {"-", " "}
    assert max(len(line) for line in lines) <= 120
    assert len(rows) == 18 and all(r.startswith("[1/1]  norm.rmsnorm") and r.endswith(" yes") for r in rows)
    done = SUMMARY.search("\n".join(lines))
    assert done and done.group(1) == done.group(2) == "18"


def fake_family(capsys, seen, rows):
    """A check family that yields ``rows`` one at a time and notes, before each, what ``lynn check`` had printed."""
    def family():
        for row in rows:
            seen.append(capsys.readouterr().out)
            yield row
        seen.append(capsys.readouterr().out)

    return family


def test_check_prints_each_row_as_it_comes(capsys, monkeypatch):
    seen = []
    rows = [{"op": "fake.op", "case": f"case {i}", "metrics": compare(torch.ones(4), torch.ones(4)), "passed": True}
            for i in range(3)]
    monkeypatch.setattr(check, "CHECKS", {"fake": fake_family(capsys, seen, rows),
                                           "other": fake_family(capsys, seen, rows[:1])})
    assert main(["check"]) == 0
    seen.append(capsys.readouterr().out)
    assert "lynn check on " in seen[0] and "fam  " in seen[0] and "[1/2]" not in seen[0]     # header first
    assert [len(re.findall(r"case \d", s)) for s in seen] == [0, 1, 1, 1, 0, 1, 0]    # then each row on its own
    assert "[1/2]  fake.op" in seen[1] and "[2/2]  fake.op" in seen[5]
    assert SUMMARY.search(seen[-1]).groups() == ("4", "4")


def test_check_wraps_long_names_and_fits_odd_numbers(capsys, monkeypatch):
    from lynn_kernels.metrics import Metrics

    odd = Metrics(cosine=-0.123456789, max_abs=123456.7, rel_l2=0.00123456789, err_ratio=99999.9, mismatches=None)
    long_case = "a case name far longer than its column, in several words, so that it wraps onto further lines"
    rows = [{"op": "fake.an_op_name_longer_than_the_column", "case": long_case, "metrics": odd, "passed": False},
            {"op": "fake.op", "case": "short", "mismatches": 123456, "passed": True}]
    monkeypatch.setattr(check, "CHECKS", {"fake": lambda: rows})
    assert main(["check"]) == 1                                          # a failed row: exit status 1
    lines, starts = check_lines(capsys.readouterr().out)
    assert max(len(line) for line in lines) <= 120
    assert len(starts) == 2 and starts[0].endswith(" NO") and starts[1].endswith(" yes")
    assert starts[0].rindex(" NO") == starts[1].rindex(" yes")          # the passed column lines up
    table = lines[lines.index(starts[0]):lines.index(starts[1])]
    assert len(table) > 1                                                # the long case went on over more lines
    case_col = lines[1].index("case")
    assert " ".join(line[case_col:case_col + 28].strip() for line in table) == long_case
    assert "fake.an_op_name_longer_than_the_column" == "".join(line[7:7 + 26].strip() for line in table)
    assert SUMMARY.search("\n".join(lines)).groups() == ("1", "2")


def test_check_says_the_reference_checks_itself(capsys):
    with lynn_kernels.use_reference():
        assert main(["check", "norm"]) == 0
    lines, rows = check_lines(capsys.readouterr().out)
    assert "backend reference" in lines[0]
    assert " ".join(lines[1:3]) == check_cmd.REFERENCE_NOTICE and lines[3].split()[0] == "fam"
    assert max(len(line) for line in lines) <= 120 and len(rows) == 18


def test_check_under_lynn_backend_reference():
    r = run_lynn(COMMANDS["module"], ["check", "norm"], LYNN_BACKEND="reference")
    assert r.returncode == 0, r.stderr
    lines, rows = check_lines(r.stdout)
    assert "backend reference" in lines[0] and "compare the reference with itself" in " ".join(lines[1:3])
    assert lines.index(rows[0]) > 3 and max(len(line) for line in lines) <= 120
    done = SUMMARY.search(r.stdout)
    assert done and done.groups() == ("18", "18")


def test_check_shows_a_progress_line_on_a_terminal(capsys, monkeypatch):
    """With stderr on a terminal, a line names the family running; the rows that follow overwrite it."""
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    err = Terminal()
    monkeypatch.setattr(check_cmd.sys, "stderr", err)
    row = {"op": "fake.op", "case": "one", "mismatches": 0, "passed": True}
    monkeypatch.setattr(check, "CHECKS", {"fake": lambda: [row], "other": lambda: [row]})
    assert main(["check"]) == 0
    assert re.fullmatch(r"\[1/2\] running the fake checks \.\.\. \(0 rows so far, \d+ s\)\r\033\[K"
                        r"\[2/2\] running the other checks \.\.\. \(1 row so far, \d+ s\)\r\033\[K", err.getvalue())
    _, rows = check_lines(capsys.readouterr().out)
    assert [r.split()[:2] for r in rows] == [["[1/2]", "fake.op"], ["[2/2]", "fake.op"]]
