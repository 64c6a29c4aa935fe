"""Markdown tables for docs/performance.md from committed results: ``python -m lynn_kernels.bench.report OP...`` prints
them; ``python -m lynn_kernels.bench.report --update docs/performance.md`` rewrites every generated block there.

The doc's tables are compact (``markdown``): the matmuls at the M a decoder runs, the other kernels one row per shape
with the providers side by side; each names its JSON file, which holds every row. ``markdown_timed``,
``markdown_rows_plain`` and ``markdown_matmul``/``markdown_matmul_graph`` without ``only_m`` render every row."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from .harness import load


def git_label(p: dict) -> str:
    """The sha of a results file's provenance, labelled with what is known of its tree (rendered, never typed):

    * ``git 0123456789ab``: read by the harness from a clean checkout;
    * ``(dirty tree: ...)``: uncommitted changes outside data/ when it ran (the figures may not be the sha's), from
      ``git_dirty`` or, in files older than that field, a ``-dirty`` suffix;
    * ``(tree state unknown)``: no checkout and no ``LYNN_GIT_DIRTY``; ``(tree state not recorded)``: a file from
      before the harness recorded it; ``(sha from LYNN_GIT_SHA)``: given by the launcher, not read from git;
      ``(sha filled in by hand)``: a file whose provenance says it was edited (``git_sha_note``);
      ``(LYNN_GIT_SHA said ...)``: the launcher named another commit than the checkout's HEAD (``git_sha_env``: a
      copy of the tree whose ``.git`` is older than its files, as on a device machine).
    """
    sha = str(p.get("git_sha") or "unknown")
    recorded, dirty = "git_dirty" in p, p.get("git_dirty")
    if sha.endswith("-dirty"):                              # files written before git_dirty existed
        sha, recorded, dirty = sha[: -len("-dirty")], True, True
    short = sha[:12] if re.fullmatch(r"[0-9a-f]{12,40}", sha) else sha
    notes = []
    if dirty is True:
        paths = p.get("git_dirty_paths") or []
        notes.append("dirty tree: uncommitted changes" + (f" in {', '.join(paths[:3])}"
                                                          + (", ..." if len(paths) > 3 else "") if paths else ""))
    elif not recorded:
        notes.append("tree state not recorded")
    elif dirty is None:
        notes.append("tree state unknown")
    if p.get("git_source") == "LYNN_GIT_SHA":
        notes.append("sha from LYNN_GIT_SHA")
    if p.get("git_sha_note"):
        notes.append("sha filled in by hand")
    env = str(p.get("git_sha_env") or "")
    if env and p.get("git_source") == "git":
        notes.append(f"LYNN_GIT_SHA said {env[:12]}")
    return f"git {short}" + (f" ({'; '.join(notes)})" if notes else "")


def _head(op: str, doc: dict) -> str:
    p, c = doc["provenance"], doc["ceilings"]
    return (f"`{op}` on {p['gpu']}, {p['date']}, {git_label(p)}, torch {p['torch']}, triton {p['triton']}, "
            f"CUDA {p.get('cuda')}; command `{p['command']}`. Ceilings measured in the same process: copy "
            f"{c['copy_gbps']:,.0f} GB/s, read {c['read_gbps']:,.0f} GB/s, "
            f"bf16 matmul {c['bf16_tflops']:,.0f} TFLOP/s.")


def matmul_cells(doc: dict) -> list[dict]:
    """One dict per (shape, M) of a ``matmul.linear`` results file: ours and cuBLAS, kernel and call times."""
    cells: dict = {}
    for r in doc["results"]:
        key = (r["shape"], r["dims"]["M"])
        cell = cells.setdefault(key, {"shape": r["shape"], **r["dims"]})
        who = "lynn" if r["provider"].startswith("lynn") else "cublas"
        how = "kernel" if r["provider"].endswith("(kernel)") else "call"
        cell[f"{who}_{how}_us"] = r["median_ms"] * 1e3
        if who == "lynn" and how == "kernel":
            cell["read_frac"] = r["frac_of_ceiling"]
            cell["tflops"] = r["tflops"]
        if who == "cublas" and how == "kernel":
            cell["cublas_tflops"] = r["tflops"]
    for cell in cells.values():
        cell["speedup_kernel"] = cell["cublas_kernel_us"] / cell["lynn_kernel_us"]
        cell["speedup_call"] = cell["cublas_call_us"] / cell["lynn_call_us"]
    return list(cells.values())


def matmul_goal(cell: dict) -> str:
    """The issue's goal for this cell and whether the kernel time meets it."""
    m, big = cell["M"], cell["N"] * cell["K"] >= 4096 * 4096
    if m == 1 and big:
        ok = cell["speedup_kernel"] >= 3.0 and cell["read_frac"] >= 0.75
        return f"3.0x and 75%: {'met' if ok else 'not met'}"
    if m <= 16:
        return f"2.5x: {'met' if cell['speedup_kernel'] >= 2.5 else 'not met'}"
    if m == 4096:
        return f"0.7x: {'met' if cell['speedup_kernel'] >= 0.7 else 'not met'}"
    return "-"


#: The M of the matmul rows docs/performance.md shows: for the packed layout a decode step at batch 1 and 8 and a
#: prefill's 512 and 4096 rows; for the checkpoint layout, which the decoder no longer runs, one row and 4096.
DOC_M = {"matmul.graph": (1, 8, 512, 4096), "matmul.linear": (1, 4096)}


def _only_m(op: str, gpu: str, only_m) -> str:
    """The sentence after a matmul table's head that says which M it shows and where every M is."""
    return (f"Rows at M = {', '.join(map(str, only_m[:-1]))} and {only_m[-1]}; every M of the run: "
            f"`data/bench/{gpu}/{op}.json`.")


def markdown_matmul(op: str, gpu: str = "h200", only_m=None) -> str:
    """One row per (shape, M): ours against cuBLAS, kernel and call time; only the M in ``only_m``, if given."""
    doc = load(op, gpu)
    lines = [_head(op, doc) + (" " + _only_m(op, gpu, only_m) if only_m else ""), "",
             "| shape | M | ours kernel us | cuBLAS kernel us | speed-up (kernel) | of read BW | ours TFLOP/s | "
             "ours call us | cuBLAS call us | speed-up (call) | goal (kernel time) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in matmul_cells(doc):
        if only_m and c["M"] not in only_m:
            continue
        lines.append(f"| {c['shape']} | {c['M']} | {c['lynn_kernel_us']:,.1f} | {c['cublas_kernel_us']:,.1f} | "
                     f"{c['speedup_kernel']:.2f}x | {100 * c['read_frac']:.1f}% | {c['tflops']:,.1f} | "
                     f"{c['lynn_call_us']:,.1f} | {c['cublas_call_us']:,.1f} | {c['speedup_call']:.2f}x | "
                     f"{matmul_goal(c)} |")
    return "\n".join(lines)


_GRAPH_COLS = (("lynn packed", "packed"), ("lynn packed GEMV", "packed GEMV"),
               ("lynn packed tensor-core GEMV", "tensor-core GEMV"), ("lynn checkpoint layout", "checkpoint layout"),
               ("cuBLAS bf16", "cuBLAS bf16"), ("pure read (same bytes)", "pure read"))


def graph_cells(doc: dict) -> list[dict]:
    """One dict per (shape, M) of a ``matmul.graph`` file: microseconds per provider, graph replay and call."""
    cells: dict = {}
    for r in doc["results"]:
        key = (r["shape"], r["dims"]["M"])
        cell = cells.setdefault(key, {"shape": r["shape"], **r["dims"], "graph": {}, "call": {}, "gbps": {}})
        how = "graph" if r["provider"].endswith(" (graph)") else "call"
        name = r["provider"][: -len(f" ({how})")]
        cell[how][name] = r["median_ms"] * 1e3
        if how == "graph":
            cell["gbps"][name] = r["gbps"]
    return list(cells.values())


def graph_goal(c: dict) -> str:
    """Issue 13's goal for a cell, judged on the dispatch's (``lynn packed``) graph time."""
    ours, cub = c["graph"]["lynn packed"], c["graph"]["cuBLAS bf16"]
    m, big = c["M"], c["N"] * c["K"] >= 8192 * 8192
    if m == 1:
        read = c["graph"].get("pure read (same bytes)")
        need = 3.2 if big else 2.5
        ok = cub / ours >= need and read is not None and read / ours >= 0.8
        return f"{need}x and 80% of read: {'met' if ok else 'not met'}"
    if m <= 16:
        return f"2.5x: {'met' if cub / ours >= 2.5 else 'not met'}"
    if m >= 512:
        return f"0.8x: {'met' if cub / ours >= 0.8 else 'not met'}"
    return "-"


def markdown_matmul_graph(op: str, gpu: str = "h200", only_m=None) -> str:
    """Kernel time by graph replay per provider and cell, the dispatch against cuBLAS and the pure read, and a
    second table of call times; only the M in ``only_m``, if given."""
    doc = load(op, gpu)
    p, c0 = doc["provenance"], doc["ceilings"]
    head = (f"`{op}` on {p['gpu']}, {p['date']}, {git_label(p)}, torch {p['torch']}, triton {p['triton']}; command "
            f"`{p['command']}`. Ceilings in the same process: copy {c0['copy_gbps']:,.0f} GB/s, read "
            f"{c0['read_gbps']:,.0f} GB/s. Microseconds a call by graph replay; \"packed\" is what `nvfp4_linear` "
            f"dispatches to.")
    names = [label for _, label in _GRAPH_COLS]
    if only_m:
        head += " " + _only_m(op, gpu, only_m)
    lines = [head, "", "| shape | M | " + " us | ".join(names) + " us | packed vs cuBLAS | packed of pure read | "
             "packed GB/s | goal |", "|" + "---|" * (len(names) + 6)]
    cells = [c for c in graph_cells(doc) if not only_m or c["M"] in only_m]
    for c in cells:
        g = c["graph"]
        vals = " | ".join(f"{g[k]:,.2f}" if k in g else "-" for k, _ in _GRAPH_COLS)
        ours, cub, read = g["lynn packed"], g["cuBLAS bf16"], g.get("pure read (same bytes)")
        frac = f"{100 * read / ours:.0f}%" if read else "-"
        lines.append(f"| {c['shape']} | {c['M']} | {vals} | {cub / ours:.2f}x | {frac} | "
                     f"{c['gbps']['lynn packed']:,.0f} | {graph_goal(c)} |")
    lines += ["", "Call time (`do_bench` of one eager Python call, us):", "",
              "| shape | M | packed | packed GEMV | tensor-core GEMV | checkpoint layout | cuBLAS bf16 |",
              "|---|---|---|---|---|---|---|"]
    for c in cells:
        if c["call"]:
            vals = " | ".join(f"{c['call'][k]:,.1f}" if k in c["call"] else "-" for k, _ in _GRAPH_COLS[:5])
            lines.append(f"| {c['shape']} | {c['M']} | {vals} |")
    return "\n".join(lines)


def timed_pairs(doc: dict) -> list[dict]:
    """One dict per (shape, provider) of a file written by ``harness.timed``: the ``(kernel)`` and ``(call)`` rows
    of a provider side by side, plus any other row (wall-clock, or a provider that was not timed) on its own."""
    pairs: dict = {}
    for r in doc["results"]:
        name = r["provider"]
        how = next((h for h in ("kernel", "call") if name.endswith(f" ({h})")), "other")
        base = name[: -len(f" ({how})")] if how != "other" else name
        key = (r["shape"], tuple(sorted(r["dims"].items())), base)
        pair = pairs.setdefault(key, {"shape": r["shape"], "dims": r["dims"], "provider": base, "row": r})
        pair[how] = r
        if how == "kernel":
            pair["row"] = r
    return list(pairs.values())


def _ms(r: dict | None) -> str:
    return "-" if r is None or r["median_ms"] != r["median_ms"] else f"{r['median_ms'] * 1e3:,.1f}"


_CEILING_NAMES = {"read_gbps": "read", "copy_gbps": "copy", "bf16_tflops": "bf16 matmul"}


def markdown_timed(op: str, gpu: str = "h200") -> str:
    """Kernel time and call time per provider; GB/s, TFLOP/s (when the op counts flops) and the fraction of the
    ceiling the row is held against, all from the kernel time (the call time where no kernel time was taken)."""
    doc = load(op, gpu)
    flops = any(r.get("flops") for r in doc["results"])
    head = ("| shape | provider | kernel us | call us | GB/s | " + ("TFLOP/s | " if flops else "")
            + "of ceiling | validated |")
    lines = [_head(op, doc), "", head, "|" + "---|" * (head.count("|") - 1)]
    for p in timed_pairs(doc):
        r, k = p["row"], p.get("kernel")
        if "M" in p["dims"] and f"M{p['dims']['M']}" not in p["shape"]:
            p["shape"] = f"{p['shape']}, M={p['dims']['M']}"
        main = k if k is not None else p.get("other")
        if main is None or main["median_ms"] != main["median_ms"]:
            dashes = "- | " * (4 if flops else 3)
            lines.append(f"| {p['shape']} | {p['provider']} | - | {dashes}not timed: {r['note']} |")
            continue
        rate = f"{main['gbps']:,.0f} | " + (f"{main['tflops']:,.1f} | " if flops else "")
        frac = "-" if main.get("frac_of_ceiling") is None else \
            f"{100 * main['frac_of_ceiling']:.1f}% of {_CEILING_NAMES.get(main['ceiling'], main['ceiling'])}"
        v = main.get("validation")
        ok = "-" if not v else ("FAILED" if not v.get("passed") else "passed")
        kernel_us = _ms(k) if k is not None else "-"
        call_us = _ms(p.get("call") or p.get("other"))
        lines.append(f"| {p['shape']} | {p['provider']} | {kernel_us} | {call_us} | {rate}{frac} | {ok} |")
    return "\n".join(lines)


def _checks(rows: list) -> str:
    """One word for the checks of a table row's providers: ``exact`` (every check bit-exact), ``passed``, ``-`` (none
    checked) or ``FAILED`` with the providers that failed."""
    vs = [(r["provider"], r.get("validation")) for r in rows if r.get("validation")]
    failed = [p for p, v in vs if not v.get("passed")]
    if failed:
        return "FAILED: " + ", ".join(failed)
    if not vs:
        return "-"
    exact = all(v.get("mismatches", v.get("code_or_scale_mismatches")) == 0 for _, v in vs)
    return "exact" if exact else "passed"


def _side_by_side(head: str, rows: dict, providers: list, cell_note: str) -> str:
    """``rows``: shape -> {"cells": {provider: text}, "ceiling": name, "checked": [result rows]}."""
    lines = [f"{head} {cell_note}", "", "| shape | " + " | ".join(providers) + " | ceiling | validated |",
             "|" + "---|" * (len(providers) + 3)]
    for shape, row in rows.items():
        cells = " | ".join(row["cells"].get(name, "-") for name in providers)
        lines.append(f"| {shape} | {cells} | {row['ceiling'] or '-'} | {_checks(row['checked'])} |")
    return "\n".join(lines)


def _share(r: dict | None) -> str:
    f = None if r is None else r.get("frac_of_ceiling")
    return "" if f is None or f != f else f" ({100 * f:.1f}%)"


def markdown_timed_side_by_side(op: str, gpu: str = "h200") -> str:
    """docs/performance.md's form of a file written by ``harness.timed``: one row per shape, one column per provider,
    each cell ``kernel us / call us (share of the row's ceiling, from the kernel time)``. Every row as recorded, with
    GB/s and TFLOP/s: ``markdown_timed``."""
    doc = load(op, gpu)
    rows: dict = {}
    providers: list = []
    for p in timed_pairs(doc):
        shape = p["shape"]
        if "M" in p["dims"] and f"M{p['dims']['M']}" not in shape:
            shape = f"{shape}, M={p['dims']['M']}"
        row = rows.setdefault(shape, {"cells": {}, "ceiling": None, "checked": []})
        if p["provider"] not in providers:
            providers.append(p["provider"])
        k, c = p.get("kernel"), p.get("call") or p.get("other")
        kernel, call = _ms(k), _ms(c)
        main = k if kernel != "-" else c if call != "-" else None
        row["cells"][p["provider"]] = "not timed" if main is None else f"{kernel} / {call}{_share(main)}"
        if main is not None:
            row["ceiling"] = row["ceiling"] or _CEILING_NAMES.get(main.get("ceiling"), main.get("ceiling"))
            row["checked"].append(main)
    rates = "GB/s and TFLOP/s" if any(r.get("flops") for r in doc["results"]) else "GB/s"
    note = ("Each cell: kernel us / call us (the kernel time's share of the row's ceiling; the call time's where "
            f"there is no kernel time). Every row with its {rates}: `data/bench/{gpu}/{op}.json`.")
    return _side_by_side(_head(op, doc), rows, providers, note)


def markdown_side_by_side(op: str, gpu: str = "h200") -> str:
    """docs/performance.md's form of an NVFP4 results file: one row per shape, one column per provider, each cell
    ``median ms (share of the copy ceiling)``. Every row as recorded: ``markdown_rows_plain``."""
    doc = load(op, gpu)
    rows: dict = {}
    providers: list = []
    for r in doc["results"]:
        row = rows.setdefault(r["shape"], {"cells": {}, "ceiling": "copy", "checked": []})
        if r["provider"] not in providers:
            providers.append(r["provider"])
        row["cells"][r["provider"]] = f"{r['median_ms']:.4f}{_share(r)}"
        row["checked"].append(r)
    note = ("Each cell: median ms (its share of the copy ceiling, bytes read + written). Every row with its p20-p80 "
            f"and GB/s: `data/bench/{gpu}/{op}.json`.")
    return _side_by_side(_head(op, doc), rows, providers, note)


#: A generated block in a markdown file: ``<!-- generated by python -m lynn_kernels.bench.report OP... -->``, the
#: ops' tables, ``<!-- end generated -->``. ``update`` rewrites every such block from the committed JSON.
BLOCK = re.compile(r"(?P<open><!-- generated by python -m lynn_kernels\.bench\.report (?P<ops>[\w.\- ]+?) -->\n)"
                   r"(?P<body>.*?)(?P<close><!-- end generated -->)", re.S)


def render_block(ops: str) -> str:
    """The body of a generated block: each op's table, in the order named, a blank line after each."""
    return "".join(markdown(op) + "\n\n" for op in ops.split())


def blocks(text: str) -> list[tuple[str, str]]:
    """``(ops, body)`` of each generated block in a markdown text."""
    return [(m["ops"], m["body"]) for m in BLOCK.finditer(text)]


def update(path: str, ops=None) -> list[str]:
    """Rewrite each generated block of a markdown file (only those naming one of ``ops``, if given) from the committed
    results; returns the ops rendered."""
    text, done = Path(path).read_text(), []

    def fresh(m: re.Match) -> str:
        if ops and not set(m["ops"].split()) & set(ops):
            return m[0]
        done.extend(m["ops"].split())
        return m["open"] + render_block(m["ops"]) + m["close"]

    Path(path).write_text(BLOCK.sub(fresh, text))
    return done


def markdown_rows(op: str, gpu: str = "h200") -> str:
    """One line per result row, as recorded (the decoder and the projection chain): median and spread, the rate the
    note leads with, GB/s or TFLOP/s against the row's ceiling, and its check."""
    doc = load(op, gpu)
    lines = [_head(op, doc), "", "| step | shape | provider | median ms (p20-p80) | rate | GB/s or TFLOP/s | "
             "of ceiling | validated |", "|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        dims = ", ".join(f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}" for k, v in r["dims"].items())
        rate = (r.get("note") or "-").split(";")[0]
        speed = f"{r['gbps']:,.0f} GB/s" if r.get("gbps") else f"{r['tflops']:,.1f} TFLOP/s" if r.get("tflops") else "-"
        frac = "-" if r.get("frac_of_ceiling") is None else \
            f"{100 * r['frac_of_ceiling']:.1f}% of {_CEILING_NAMES.get(r['ceiling'], r['ceiling'])}"
        v = r.get("validation")
        ok = "-" if not v else ("FAILED" if not v.get("passed") else "passed")
        lines.append(f"| {r['op'].split('.')[-1]} | {r['shape']}, {dims} | {r['provider']} | {r['median_ms']:,.3f} "
                     f"({r['p20_ms']:,.3f}-{r['p80_ms']:,.3f}) | {rate} | {speed} | {frac} | {ok} |")
    return "\n".join(lines)


#: The censuses a decoder's results file may hold (``lynn_model.bench.census`` / ``prefill_census``), in the order
#: the doc shows them: (key in the file's ``info``, what was profiled).
CENSUSES = (("census_fused", "one decode step as `lynn generate` runs it (fused), batch 1"),
            ("census_b8_fused", "the same step at batch 8"),
            ("prefill_census_2048", "a fresh prefill of 2,048 tokens"),
            ("prefill_census_16384", "a fresh prefill of 16,384 tokens"))


def _census_table(c: dict) -> list[str]:
    """A decode census: per part its kernels, GPU time a call, calls a step, and, where the run recorded them, its
    bytes, the ideal time at the read ceiling and the efficiency."""
    parts = {k: v for k, v in c.items() if k not in ("per_step", "whole_step") and "error" not in v}
    ideal = any("bytes" in v for v in parts.values())
    more = (" MB | ideal us | efficiency |", "---|---|---|") if ideal else ("", "")
    lines = ["| part | kernels | us a call | calls a step | us a step | share |" + more[0],
             "|---|---|---|---|---|---|" + more[1]]
    total = c["per_step"]["us"]
    for name, v in parts.items():
        step = v["us"] * v["per_step"]
        us_step = f"{step:,.1f}" if v["per_step"] else "-"
        share = f"{100 * step / total:.1f}%" if step else "-"
        eff = ""
        if ideal:
            eff = (f" {v['bytes'] / 1e6:,.2f} | {v['ideal_us']:,.1f} | {100 * v['efficiency']:.0f}% |" if "bytes" in v
                   else " - | - | - |")
        lines.append(f"| {name} | {v['kernels']} | {v['us']:,.1f} | {v['per_step']} | {us_step} | {share} |{eff}")
    blank = " | | |" if ideal else ""
    lines.append(f"| **sum of the parts** | {c['per_step']['kernels']} | | | {total:,.1f} | 100% |{blank}")
    whole = c["whole_step"]
    lines.append(f"| the whole step, profiled | {whole['kernels']} | | | {whole['us']:,.1f} | |{blank}")
    return lines


def _prefill_census_table(c: dict) -> list[str]:
    """A prefill census: per part its kernels, GPU time, share and, where counted, TFLOP/s and the peak's fraction."""
    lines = ["| part | kernels | ms | share | TFLOP/s | of bf16 peak |", "|---|---|---|---|---|---|"]
    parts = sorted(((k, v) for k, v in c.items() if k != "total"), key=lambda kv: -kv[1]["us"])
    for name, v in parts:
        rate = f"{v['tflops']:,.0f}" if "tflops" in v else "-"
        frac = f"{100 * v['frac_of_bf16_peak']:.0f}%" if "frac_of_bf16_peak" in v else "-"
        lines.append(f"| {name} | {v['kernels']} | {v['us'] / 1e3:,.2f} | {100 * v['share']:.1f}% | {rate} | {frac} |")
    lines.append(f"| **all kernels** | {c['total']['kernels']} | {c['total']['us'] / 1e3:,.2f} | 100% | | |")
    return lines


def markdown_census(op: str, gpu: str = "h200") -> str:
    """The censuses of a decoder's results file (:data:`CENSUSES`), each a table under a line naming it; ``""``
    when it holds none."""
    doc, out = load(op, gpu), []
    for preset, info in (doc.get("info") or {}).items():
        for key, what in CENSUSES:
            c = info.get(key)
            if not c or "error" in c:
                continue
            table = _prefill_census_table(c) if key.startswith("prefill") else _census_table(c)
            out.append(f"Census of {preset}: {what} (GPU time by part from the CUDA profiler, `info.{key}`).\n\n"
                       + "\n".join(table))
    return "\n\n".join(out)


TIMED_OPS = ("attention.prefill", "attention.decode", "deltanet.chunk", "deltanet.recurrent", "deltanet.conv",
             "moe.block")
#: Every op with a table in docs/performance.md.
ROW_OPS = ("matmul.chain", "decoder.qwen3.5-35b-a3b", "decoder.qwen3-next-80b-a3b")
ALL_OPS = ("nvfp4.dequantize", "nvfp4.quantize", "matmul.linear", "matmul.graph", *TIMED_OPS, *ROW_OPS)


def markdown(op: str, gpu: str = "h200") -> str:
    """The table docs/performance.md shows for an op: the matmuls at their ``DOC_M``, the other kernels side by side
    (one row per shape), the decoder and the chain one row per result."""
    if op == "matmul.linear":
        return markdown_matmul(op, gpu, DOC_M[op])
    if op == "matmul.graph":
        return markdown_matmul_graph(op, gpu, DOC_M[op])
    if op in TIMED_OPS:
        return markdown_timed_side_by_side(op, gpu)
    if op in ROW_OPS:
        census = markdown_census(op, gpu)
        return markdown_rows(op, gpu) + (f"\n\n{census}" if census else "")
    return markdown_side_by_side(op, gpu)


def markdown_rows_plain(op: str, gpu: str = "h200") -> str:
    """One line per result row of an NVFP4 results file: median and spread, GB/s, share of the copy ceiling, check."""
    doc = load(op, gpu)
    lines = [
        _head(op, doc),
        "",
        "| shape | provider | median ms (p20-p80) | GB/s | of copy ceiling | validated |",
        "|---|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        v = r.get("validation")
        mism = None if not v else v.get("mismatches", v.get("code_or_scale_mismatches"))
        ok = "-" if not v else ("FAILED" if not v.get("passed") else "exact" if mism == 0 else "passed")
        frac = "-" if r.get("frac_of_ceiling") is None else f"{100 * r['frac_of_ceiling']:.1f}%"
        lines.append(f"| {r['shape']} | {r['provider']} | {r['median_ms']:.4f} ({r['p20_ms']:.4f}-{r['p80_ms']:.4f})"
                     f" | {r['gbps']:,.0f} | {frac} | {ok} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--update"]:        # --update docs/performance.md [OP...]: rewrite its generated blocks
        print("updated:", ", ".join(update(sys.argv[2], sys.argv[3:] or None)))
        sys.exit(0)
    for name in sys.argv[1:] or ALL_OPS:
        print(markdown(name))
        print()
