"""Damaged and hostile files and arguments at the ``lynn`` command line, swept from one table.

Each row of :data:`CASES` damages a fresh copy of the demo model (a checkpoint, its config, its tokenizer) or passes
bad arguments, runs one ``lynn`` command in this process, and asserts what a user sees: the exit status (2 for a
usage error, 1 for a failure, 0 where the command copes), a one-line ``lynn <command>: error:`` naming the problem, no
traceback, nothing changed outside the folders the command names (every file around them hashed before and after),
and no hang (a timer ends a case that runs past its limit). The kernels' own argument table is
``tests/test_bad_inputs.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lynn_cli import main
from lynn_cli.generate import DEMO_MODEL

SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"
#: Seconds a case may run before it counts as a hang.
LIMIT = 60


# ---------------------------------------------------------------------------------------------------------------
# damage: each function changes the copy of the demo model in `m` (files are rewritten, never edited in place)


def edit_json(name: str, change: Callable[[dict], object]) -> Callable[[Path], None]:
    def damage(m: Path) -> None:
        d = json.loads((m / name).read_text())
        change(d)
        (m / name).write_text(json.dumps(d))
    return damage


def edit_config(**fields) -> Callable[[Path], None]:
    return edit_json("config.json", lambda d: d.update(fields))


def drop_config(*keys) -> Callable[[Path], None]:
    return edit_json("config.json", lambda d: [d.pop(k) for k in keys])


def index_entry(value) -> Callable[[Path], None]:
    """The index sends the first tensor of shard 2 to ``value`` (a str may hold ``{root}``: the case's folder)."""
    def damage(m: Path) -> None:
        v = value.format(root=m.parent) if isinstance(value, str) else value

        def change(d: dict) -> None:
            d["weight_map"][next(k for k, s in d["weight_map"].items() if s == SHARD2)] = v
        edit_json(INDEX, change)(m)
    return damage


def edit_tensor(name: str, change: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Path], None]:
    def damage(m: Path) -> None:
        shard = json.loads((m / INDEX).read_text())["weight_map"][name]
        tensors = load_file(m / shard)
        tensors[name] = change(tensors[name].clone()).contiguous()
        (m / shard).unlink()
        save_file(tensors, str(m / shard), metadata={"format": "pt"})
    return damage


def set_first(value: float):
    def change(t: torch.Tensor) -> torch.Tensor:
        t.view(-1)[0] = value
        return t
    return change


def raw_header(change: Callable[[dict], object]) -> Callable[[Path], None]:
    """Rewrite shard 2's JSON header (the data after it unchanged)."""
    def damage(m: Path) -> None:
        blob = (m / SHARD2).read_bytes()
        n = struct.unpack("<Q", blob[:8])[0]
        header = json.loads(blob[8:8 + n])
        text = change(header)
        raw = (text if isinstance(text, str) else json.dumps(header)).encode()
        (m / SHARD2).unlink()
        (m / SHARD2).write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + n:])
    return damage


def random_bytes_over_data(m: Path) -> None:
    blob = bytearray((m / SHARD2).read_bytes())
    start = len(blob) // 2
    blob[start:start + 4096] = os.urandom(4096)
    (m / SHARD2).unlink()
    (m / SHARD2).write_bytes(bytes(blob))


def write_file(name: str, data: bytes | str) -> Callable[[Path], None]:
    def damage(m: Path) -> None:
        (m / name).unlink(missing_ok=True)
        (m / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    return damage


def truncate(name: str, keep: float) -> Callable[[Path], None]:
    def damage(m: Path) -> None:
        blob = (m / name).read_bytes()
        (m / name).unlink()
        (m / name).write_bytes(blob[: int(len(blob) * keep)])
    return damage


def symlink_shard(m: Path) -> None:
    """Shard 2 replaced by a symlink to a file outside the model folder."""
    outside = m.parent / "elsewhere" / SHARD2
    outside.parent.mkdir()
    shutil.copy(m / SHARD2, outside)
    (m / SHARD2).unlink()
    (m / SHARD2).symlink_to(outside)


def chat_template(template: str) -> Callable[[Path], None]:
    return edit_json("tokenizer_config.json", lambda d: d.update(chat_template=template))


def both(*damages) -> Callable[[Path], None]:
    def damage(m: Path) -> None:
        for d in damages:
            d(m)
    return damage


# ---------------------------------------------------------------------------------------------------------------
# the table


@dataclass
class Case:
    id: str
    args: list[str]                      #: after ``lynn``; ``{model}``, ``{out}``, ``{root}`` are filled in
    code: int                            #: the exit status
    says: str                            #: a regex stderr must match
    damage: Callable[[Path], None] | None = None


GEN = ["generate", "--model", "{model}", "--backend", "reference", "--max-new-tokens", "2", "--temperature", "0"]
QUANT = ["quantize", "{model}", "{out}", "--quiet"]
#: A nested loop that renders nothing: only a bound on time or iterations stops it.
TEMPLATE_BOMB = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
TEMPLATE_FLOOD = "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}"

CASES = [
    # -- 1. shard names stay inside the folder (the loader and quantize alike) ----------------------------------
    Case("quantize/index-dotdot", QUANT, 1, r"weight_map\[.*\] names the shard '\.\./outside\.safetensors': a shard "
         r"must be a plain file name", index_entry("../outside.safetensors")),
    Case("quantize/index-absolute", QUANT, 1, r"names the shard '/.*neighbour/model-00002-of-00002\.safetensors'.*"
         r"not an absolute path", index_entry("{root}/neighbour/" + SHARD2)),
    Case("quantize/shard-symlink-outside", QUANT, 1, r"a symlink to .*elsewhere.*outside", symlink_shard),
    Case("generate/index-dotdot", GEN, 1, r"names the shard '\.\./outside\.safetensors'",
         index_entry("../outside.safetensors")),
    Case("generate/index-etc-passwd", GEN, 1, r"names the shard '/etc/passwd'", index_entry("/etc/passwd")),
    Case("generate/shard-symlink-outside", GEN, 1, r"a symlink to .*outside", symlink_shard),
    Case("generate/index-value-int", GEN, 1, r"a shard must be a file name \(a string\), found 7", index_entry(7)),
    Case("generate/index-not-json", GEN, 1, rf"{INDEX}: not valid JSON", write_file(INDEX, "{\"weight_map\": ")),
    # -- 2. --overwrite replaces a model, not any folder --------------------------------------------------------
    Case("quantize/overwrite-user-folder", [*QUANT, "--overwrite"], 1,
         r"is not replaced by --overwrite: it holds files lynn quantize does not write: \.bashrc, thesis\.tex"),
    # -- 3. bounded work ------------------------------------------------------------------------------------------
    Case("generate/layers-1e9", GEN, 1, r"num_hidden_layers = 1000000000, but the checkpoint's safetensors hold 8",
         both(drop_config("layer_types"), edit_config(num_hidden_layers=10**9))),
    Case("quantize/layers-1e9", QUANT, 1, r"num_hidden_layers = 1000000000",
         both(drop_config("layer_types"), edit_config(num_hidden_layers=10**9))),
    Case("generate/experts-1e6", GEN, 1, r"num_experts = 1000000, but the checkpoint's safetensors hold 8",
         edit_config(num_experts=10**6)),
    Case("generate/template-loops", [*GEN, "--chat"], 1, r"chat_template", chat_template(TEMPLATE_BOMB)),
    Case("generate/template-output", [*GEN, "--chat"], 1, r"chat_template", chat_template(TEMPLATE_FLOOD)),
    Case("generate/prompt-beyond-context", [*GEN, "one two three four five six seven eight nine ten"], 1,
         r"the prompt has \d+ tokens; the model's context is 4", edit_config(max_position_embeddings=4)),
    Case("generate/max-new-tokens-beyond-context", [*GEN[:-4], "--max-new-tokens", "10000000", "--temperature",
                                                   "0", "--ignore-eos"], 0,
         r"note: max_new_tokens = 10,000,000 cut to 11: the model's context is 24 tokens.*11 new tokens",
         edit_config(max_position_embeddings=24)),
    Case("generate/cache-full", [*GEN, "--max-tokens", "2", "a longer prompt than two tokens"], 1,
         r"max-tokens|max_tokens|cache"),
    # -- 4. damaged weights --------------------------------------------------------------------------------------
    Case("generate/nan-in-an-expert", GEN, 1, r"model\.layers\.5\.mlp\.experts\.3\.up_proj\.weight in model-0000"
         r"\d-of-00002\.safetensors: 1 NaN and 0 infinite values", edit_tensor(
             "model.layers.5.mlp.experts.3.up_proj.weight", set_first(float("nan")))),
    Case("generate/embedding-all-nan", GEN, 1, r"model\.embed_tokens\.weight .*NaN", edit_tensor(
        "model.embed_tokens.weight", lambda t: t.fill_(float("nan")))),
    Case("generate/inf-in-a-norm", GEN, 1, r"model\.layers\.2\.input_layernorm\.weight .*1 infinite",
         edit_tensor("model.layers.2.input_layernorm.weight", set_first(float("inf")))),
    Case("generate/A_log-inf", GEN, 1, r"model\.layers\.0\.linear_attn\.A_log .*infinite",
         edit_tensor("model.layers.0.linear_attn.A_log", lambda t: t.fill_(float("inf")))),
    Case("generate/random-bytes-over-data", GEN, 1, r"in model-00002-of-00002\.safetensors: .*damaged",
         random_bytes_over_data),
    Case("generate/logits-overflow", GEN, 1, r"non-finite|not finite|NaN|Inf",
         edit_tensor("model.norm.weight", lambda t: t.fill_(3e38))),
    Case("quantize/nan-weight", QUANT, 1, r"NaN|finite", edit_tensor(
        "model.layers.5.mlp.experts.3.up_proj.weight", set_first(float("nan")))),
    # -- 5. headers, tokenizers, arguments -----------------------------------------------------------------------
    Case("generate/header-nested-100000", GEN, 1, r"model-00002-of-00002\.safetensors.*corrupt safetensors header",
         raw_header(lambda h: "[" * 100_000 + "]" * 100_000)),
    Case("generate/header-dtype-list", GEN, 1, r"has dtype \['BF16'\], which the loader does not read",
         raw_header(lambda h: h[next(k for k in h if k != "__metadata__")].update(dtype=["BF16"]))),
    Case("quantize/header-dtype-list", QUANT, 1, r"has dtype \['BF16'\]",
         raw_header(lambda h: h[next(k for k in h if k != "__metadata__")].update(dtype=["BF16"]))),
    Case("generate/header-shape-string", GEN, 1, r"shape '7'",
         raw_header(lambda h: h[next(k for k in h if k != "__metadata__")].update(shape="7"))),
    Case("generate/shard-truncated", GEN, 1, r"model-00002-of-00002\.safetensors is truncated",
         truncate(SHARD2, 0.5)),
    Case("generate/tokenizer-truncated", GEN, 1, r"tokenizer\.json", truncate("tokenizer.json", 0.5)),
    Case("generate/tokenizer-random", GEN, 1, r"tokenizer\.json", write_file("tokenizer.json", os.urandom(2048))),
    Case("generate/tokenizer-config-list", GEN, 1, r"tokenizer_config\.json", write_file("tokenizer_config.json",
                                                                                         "[1, 2]")),
    Case("generate/model-missing", ["generate", "--model", "{root}/nonexistent", "hi"], 2,
         r"--model .*nonexistent: the folder does not exist"),
    Case("generate/unknown-flag", ["generate", "--modle", "x", "hi"], 2,
         r"usage: lynn generate .*\n.*unrecognized option: --modle \(did you mean --model\?\)"),
    *(Case(f"generate/{flag[2:]}={value}", ["generate", flag, value, "hi"], 2, rf"argument {flag}: ")
      for flag, value in (("--top-k", "-1"), ("--top-p", "2"), ("--top-p", "nan"), ("--top-p", "0"),
                          ("--temperature", "-1"), ("--temperature", "nan"), ("--temperature", "inf"),
                          ("--max-new-tokens", "-5"), ("--max-tokens", "0"), ("--threads", "-1"),
                          ("--seed", "1e23"), ("--seed", str(2**64)))),
    Case("quantize/src-missing", ["quantize", "{root}/nonexistent", "{out}"], 2, r"SRC .*nonexistent does not exist"),
    Case("quantize/bad-regex", [*QUANT, "--ignore", "(("], 2, r"argument --ignore: '\(\(' is not a valid regular"),
    Case("bench/result-missing", ["bench", "--check-only", "{root}/nonexistent.json"], 1,
         r"No such file or directory: '.*nonexistent\.json'"),
    Case("bench/result-not-a-result", ["bench", "--check-only", "{model}/config.json"], 1,
         r"config\.json: not a lynn bench result"),
    Case("bench/result-from-a-card-without-a-baseline", ["bench", "--check-only", "{model}/r.json"], 1,
         r"no perf baseline for the NVIDIA A0 at .*a0.perf_baseline\.json: make one",
         write_file("r.json", '{"op": "decoder.x", "provenance": {"gpu": "NVIDIA A0"}, "results": []}')),
    # -- 6. configs: what the kernels divide by ------------------------------------------------------------------
    *(Case(f"generate/config-{key}={value!r}", GEN, 1, key, edit_config(**{key: value}))
      for key, value in (("rms_norm_eps", 0), ("rms_norm_eps", float("nan")), ("num_key_value_heads", 0),
                         ("hidden_size", "2048"), ("eos_token_id", "eos"), ("eos_token_id", 10**6),
                         ("num_hidden_layers", 0))),
    Case("generate/config-rope_theta=0", GEN, 1, "rope_theta",
         edit_json("config.json", lambda d: d["rope_parameters"].update(rope_theta=0))),
    Case("quantize/config-refused-by-the-loader", QUANT, 1, "num_key_value_heads", edit_config(num_key_value_heads=0)),
]


# ---------------------------------------------------------------------------------------------------------------
# running a case


def tree_hash(root: Path) -> dict:
    """Every file and folder under ``root``: content hash (a link: its target) and mode."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        here = Path(dirpath)
        for name in dirs + files:
            p = here / name
            st = p.lstat()
            if p.is_symlink():
                out[str(p)] = ("link", os.readlink(p))
            elif p.is_file():
                out[str(p)] = (hashlib.sha256(p.read_bytes()).hexdigest(), st.st_mode)
            else:
                out[str(p)] = ("dir", st.st_mode)
    return out


class Hang(Exception):
    pass


@contextmanager
def deadline(seconds: float):
    def ring(signum, frame):
        raise Hang(f"still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def lynn(argv: list[str]) -> int:
    """``main(argv)`` with a usage error's ``SystemExit`` turned into its status."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def setup(root: Path) -> dict:
    """A copy of the demo model, an output folder's parent, and files a careless command could hit."""
    m = root / "model"
    shutil.copytree(DEMO_MODEL, m, ignore=shutil.ignore_patterns("training", "quality*.json", "*.txt"))
    (root / "outside.safetensors").write_bytes(b"a user's file beside the model")
    (root / "neighbour").mkdir()
    shutil.copy(DEMO_MODEL / SHARD2, root / "neighbour" / SHARD2)
    out = root / "out"
    return {"model": m, "out": out, "root": root}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_file_or_argument(case: Case, tmp_path, capsys):
    paths = setup(tmp_path)
    if case.id == "quantize/overwrite-user-folder":
        paths["out"].mkdir()
        (paths["out"] / "thesis.tex").write_text("\\chapter{One}")
        (paths["out"] / ".bashrc").write_text("export PATH")
    if case.damage:
        case.damage(paths["model"])
    before = tree_hash(tmp_path)
    argv = [a.format(**{k: str(v) for k, v in paths.items()}) for a in case.args]
    with deadline(LIMIT):
        code = lynn(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert code == case.code, err
    assert re.search(case.says, err, re.DOTALL), err
    if code == 1:
        assert re.search(rf"^lynn {argv[0]}: error: ", err, re.MULTILINE), err
    assert tree_hash(tmp_path) == before
    if case.id != "quantize/overwrite-user-folder":
        assert not paths["out"].exists()
    assert not list(tmp_path.glob(".out.lynn-quantize-*"))


# ---------------------------------------------------------------------------------------------------------------
# the cases that need more than one command


def test_quantize_cleans_up_a_killed_run_and_writes_the_usual_modes(tmp_path, capsys):
    paths = setup(tmp_path)
    dead = tmp_path / ".out.lynn-quantize-999999999"           # no such process
    dead.mkdir()
    (dead / SHARD1).write_bytes(b"half a shard")
    with deadline(300):
        assert lynn(["quantize", str(paths["model"]), str(paths["out"])]) == 0
    err = capsys.readouterr().err
    assert "removed .out.lynn-quantize-999999999, left in" in err and not dead.exists()
    mask = os.umask(0)
    os.umask(mask)
    for f in paths["out"].iterdir():
        assert f.stat().st_mode & 0o777 == 0o666 & ~mask, f
    # the output is a model: --overwrite replaces it, and a leftover of a live process is refused
    live = tmp_path / f".out.lynn-quantize-{os.getppid()}"
    live.mkdir()
    assert lynn(["quantize", str(paths["model"]), str(paths["out"]), "--overwrite", "--quiet"]) == 1
    assert f"process {os.getppid()} is running" in capsys.readouterr().err and live.is_dir()
    live.rmdir()
    with deadline(300):
        assert lynn(["quantize", str(paths["model"]), str(paths["out"]), "--overwrite", "--quiet"]) == 0


def test_negative_nvfp4_scales_are_refused(tmp_path, capsys):
    paths = setup(tmp_path)
    with deadline(300):
        assert lynn(["quantize", str(paths["model"]), str(paths["out"]), "--quiet"]) == 0
    name = "model.layers.1.mlp.experts.2.down_proj.weight_scale"
    edit_tensor(name, lambda s: (-(s.float())).to(s.dtype))(paths["out"])
    before = tree_hash(tmp_path)
    with deadline(LIMIT):
        assert lynn([*(a.replace("{model}", str(paths["out"])) for a in GEN)]) == 1
    err = capsys.readouterr().err
    assert re.search(rf"{re.escape(name)} in model-0000\d-of-00002\.safetensors: 0 NaN and \d+ negative NVFP4 "
                     r"block scales", err), err
    assert tree_hash(tmp_path) == before


def test_a_disk_full_while_quantizing_leaves_nothing(tmp_path, capsys, monkeypatch):
    import safetensors.torch

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    paths = setup(tmp_path)
    before = tree_hash(tmp_path)
    assert lynn(["quantize", str(paths["model"]), str(paths["out"]), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert re.search(r"lynn quantize: error: cannot write .*out/model-00001-of-00002\.safetensors .*No space left",
                     err), err
    assert tree_hash(tmp_path) == before and not paths["out"].exists()


def test_help_version_and_usage_errors_import_no_torch():
    """``--help``, ``--version`` and a usage error answer without importing torch (it takes seconds)."""
    probe = ("import sys, lynn_cli\n"
             "for argv in (['--help'], ['--version'], ['generate', '--help'], ['generate', '--top-p', '2'],\n"
             "             ['quantize', '--help'], ['bogus']):\n"
             "    try:\n"
             "        lynn_cli.main(argv)\n"
             "    except SystemExit:\n"
             "        pass\n"
             "print('torch' in sys.modules, 'lynn_kernels' in sys.modules, file=sys.stderr)\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0 and r.stderr.splitlines()[-1] == "False False", r.stderr


def test_cases_are_counted_in_the_docs():
    """docs/reliability.md counts this table's cases; the count follows the table."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "reliability.md").read_text()
    n = len(CASES) + 4                                        # the rows, and the four tests above
    assert f"| {n} cases (tests/test_bad_files.py) |" in text, f"docs/reliability.md should count {n} cases"
