"""What a kernel boundary costs a chain of small dependent GEMVs, against the same chain as one persistent kernel
whose phases wait on a counter in global memory: the question a persistent decode step (issue 40) must answer first.

The chain: ``L`` phases, phase ``i`` computes ``x[i + 1] = W[i] @ x[i]`` (bf16 weights ``[N, N]``, fp32 sums, the
output rounded to bf16), so each phase needs the whole output of the one before, as a decoder's projections do.
Every weight is its own slab (``L x N x N x 2`` bytes, past the L2), so each phase reads its bytes from HBM. Forms:

* ``launches``: one launch per phase (:func:`gemv_kernel`), captured as a CUDA graph;
* ``launches + PDL``: the same with programmatic dependent launch (each kernel lets the next one launch, then waits
  for the one before);
* ``persistent``: one launch of as many programs as the GPU has SMs; each program takes its row tiles of phase
  ``i``, then adds one to the counter (release) and waits until every program has (acquire) before phase ``i + 1``;
* ``persistent, weights first``: the same, but a program loads its first tile of ``W[i + 1]`` before it waits,
  as a persistent decode step would stream its next weights while the activations they meet are being produced;
* ``launches, rows ahead``, ``launches + PDL, rows ahead`` and ``persistent, rows ahead``: each program owns one
  block of rows (``N / programs`` rounded up to a power of two) and loads *all* of its weights for a phase into
  registers before it waits, so a phase's whole 8 MB is in flight while the one before finishes; only the
  activations wait;
* ``persistent, two phases ahead``: the same with the weights of the phase after next loaded before each wait.

``--n 128`` makes the bytes negligible: what is left is each form's floor per dependent phase.

Each form's output is compared with the launches' (the same sums in the same order: the same bits) and with an
fp32 product chain. Reported: microseconds per chain and per phase, each form's GB/s and fraction of the measured
read ceiling, and the boundary's cost, ``(launches - persistent) / L``.

    PYTHONPATH=. python3 experiments/boundary_cost.py [--n 2048] [--phases 30]

Writes ``data/experiments/boundary-cost/<sha>.json`` (under ``$OUT`` when set). GPU for the timings; ``--check``
runs every form once on this machine (the Triton interpreter runs one program, so the counter never waits) and
compares the outputs.
"""

from __future__ import annotations  # noqa: I001  (lynn_kernels before triton: it picks the backend)

import argparse
import sys

from lynn_kernels import runtime
import torch
import triton
import triton.language as tl

from lynn_kernels.bench.harness import graph_us, measure_ceilings, provenance, save_experiment
from lynn_kernels.runtime import cast_output, kernel_view, pdl_enter, to_float32

BLOCK_N = 16
BLOCK_K = 256


@triton.jit
def _rows(w_ptr, x_ptr, y_ptr, tile, N, first, use_first, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          HAS_FIRST: tl.constexpr, INTERPRET: tl.constexpr):
    """``y[tile rows] = W[tile rows] @ x``: fp32 partial sums per lane, reduced once, rounded to bf16. With
    ``HAS_FIRST`` and ``use_first``, ``first`` is the tile's first ``[BLOCK_N, BLOCK_K]`` weights, loaded before."""
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, N, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < N
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * N + offs_k[None, :]
        if HAS_FIRST:
            if use_first and k0 == 0:
                w = first
            else:
                w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0)
        else:
            w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0)
        x = tl.load(x_ptr + offs_k, mask=mask_k, other=0, cache_modifier=".cg")   # another program wrote it
        acc += to_float32(w, tl.bfloat16, INTERPRET) * to_float32(x, tl.bfloat16, INTERPRET)[None, :]
    tl.store(y_ptr + offs_n, cast_output(tl.sum(acc, axis=1), tl.bfloat16, INTERPRET), mask=mask_n)


@triton.jit
def _wait_tickets(count_ptr, want):
    """Spin (every thread) until the counter holds ``want`` tickets; acquire: the writes before them are visible."""
    seen = tl.atomic_add(count_ptr, 0, sem="acquire")
    while seen < want:
        seen = tl.atomic_add(count_ptr, 0, sem="acquire")


@triton.jit
def gemv_kernel(w_ptr, x_ptr, y_ptr, N, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
                USE_PDL: tl.constexpr = False):
    """One phase: program ``t`` computes row tile ``t``."""
    pdl_enter(USE_PDL)
    _rows(w_ptr, x_ptr, y_ptr, tl.program_id(0), N, 0, False, BLOCK_N, BLOCK_K, False, INTERPRET)


@triton.jit
def persistent_kernel(w_ptr, x_ptr, count_ptr, N, L, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      WEIGHTS_FIRST: tl.constexpr, INTERPRET: tl.constexpr):
    """Every phase in one launch: program ``p`` of ``P`` takes row tiles ``p, p + P, ...`` of phase ``i`` (weights
    ``w_ptr + i N N``, input ``x_ptr + i N``, output the next row of x), then takes a ticket and waits until all
    ``P`` have, before phase ``i + 1``. ``count`` starts at 0 (the host zeroes it before the launch)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    tiles = tl.cdiv(N, BLOCK_N)
    offs_n0 = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k0 = tl.arange(0, BLOCK_K)
    for i in range(0, L):
        w_i = w_ptr + i * N * N                                 # < 2^31: the host checks
        if WEIGHTS_FIRST:             # this program's first tile of phase i: its weights need no earlier phase
            first = tl.load(w_i + offs_n0[:, None].to(tl.int64) * N + offs_k0[None, :],
                            mask=(offs_n0[:, None] < N) & (offs_k0[None, :] < N), other=0)
        if i > 0:                     # wait until every program has written phase i - 1 (each thread spins)
            _wait_tickets(count_ptr, i * P)
        for tile in range(pid, tiles, P):
            if WEIGHTS_FIRST:
                _rows(w_i, x_ptr + i * N, x_ptr + (i + 1) * N, tile, N, first, tile == pid, BLOCK_N, BLOCK_K, True,
                      INTERPRET)
            else:
                _rows(w_i, x_ptr + i * N, x_ptr + (i + 1) * N, tile, N, 0, False, BLOCK_N, BLOCK_K, False, INTERPRET)
        tl.debug_barrier()            # every thread's rows stored before the ticket
        tl.atomic_add(count_ptr, 1, sem="release")


@triton.jit
def _ahead_rows(w_ptr, pid, N, BLOCK_N: tl.constexpr, NP: tl.constexpr):
    """This program's ``[BLOCK_N, NP]`` block of rows: every weight of its phase, issued at once."""
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, NP)
    return tl.load(w_ptr + offs_n[:, None].to(tl.int64) * N + offs_k[None, :],
                   mask=(offs_n[:, None] < N) & (offs_k[None, :] < N), other=0)


@triton.jit
def _ahead_finish(w, x_ptr, y_ptr, pid, N, BLOCK_N: tl.constexpr, NP: tl.constexpr, INTERPRET: tl.constexpr):
    """``y[rows] = w @ x`` for rows already in registers, each row summed as one tree: not the launches' order of
    sums, so not always their bits (the check compares both with the fp32 chain)."""
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, NP)
    x = tl.load(x_ptr + offs_k, mask=offs_k < N, other=0, cache_modifier=".cg")
    prod = to_float32(w, tl.bfloat16, INTERPRET) * to_float32(x, tl.bfloat16, INTERPRET)[None, :]
    tl.store(y_ptr + offs_n, cast_output(tl.sum(prod, axis=1), tl.bfloat16, INTERPRET), mask=offs_n < N)


@triton.jit
def gemv_ahead_kernel(w_ptr, x_ptr, y_ptr, N, BLOCK_N: tl.constexpr, NP: tl.constexpr, INTERPRET: tl.constexpr,
                      USE_PDL: tl.constexpr = False):
    """One phase, one block of rows a program, its weights loaded before the PDL wait."""
    pid = tl.program_id(0)
    w = _ahead_rows(w_ptr, pid, N, BLOCK_N, NP)
    pdl_enter(USE_PDL)
    _ahead_finish(w, x_ptr, y_ptr, pid, N, BLOCK_N, NP, INTERPRET)


@triton.jit
def persistent_ahead_kernel(w_ptr, x_ptr, count_ptr, N, L, BLOCK_N: tl.constexpr, NP: tl.constexpr,
                            INTERPRET: tl.constexpr):
    """Every phase in one launch, one block of rows a program: phase ``i``'s weights are loaded, then the program
    waits for phase ``i - 1``'s tickets, then finishes its rows and takes its ticket."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    for i in range(0, L):
        w = _ahead_rows(w_ptr + i * N * N, pid, N, BLOCK_N, NP)
        if i > 0:
            _wait_tickets(count_ptr, i * P)
        _ahead_finish(w, x_ptr + i * N, x_ptr + (i + 1) * N, pid, N, BLOCK_N, NP, INTERPRET)
        tl.debug_barrier()
        tl.atomic_add(count_ptr, 1, sem="release")


#: Warps of the rows-ahead kernels (``--ahead-warps``): each thread holds ``rows x N / (32 warps)`` weights.
AHEAD_WARPS = 8
#: Registers and spilled bytes of each compiled kernel, by kernel name (GPU only): spills would explain a slow form.
REGISTERS: dict = {}


def _note_registers(name: str, handle) -> None:
    if not runtime.INTERPRET and handle is not None:
        REGISTERS[name] = {"registers": getattr(handle, "n_regs", None), "spills": getattr(handle, "n_spills", None)}


@triton.jit
def persistent_two_ahead_kernel(w_ptr, x_ptr, count_ptr, N, L, BLOCK_N: tl.constexpr, NP: tl.constexpr,
                                INTERPRET: tl.constexpr):
    """:func:`persistent_ahead_kernel` with two phases of weights in registers: phase ``i + 1``'s are loaded before
    the wait for phase ``i - 1``, so a phase's bytes stream while two syncs go by."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    w = _ahead_rows(w_ptr, pid, N, BLOCK_N, NP)
    for i in range(0, L):
        w_next = _ahead_rows(w_ptr + tl.minimum(i + 1, L - 1) * N * N, pid, N, BLOCK_N, NP)
        if i > 0:
            _wait_tickets(count_ptr, i * P)
        _ahead_finish(w, x_ptr + i * N, x_ptr + (i + 1) * N, pid, N, BLOCK_N, NP, INTERPRET)
        tl.debug_barrier()
        tl.atomic_add(count_ptr, 1, sem="release")
        w = w_next


def ahead_block(n: int, programs: int) -> int:
    """Rows per program when each program owns one block: ``n / programs`` rounded up to a power of two."""
    return triton.next_power_of_2(triton.cdiv(n, programs))


def chain_ahead(w, x, count, programs: int, persistent: bool, pdl: bool = True, two: bool = False) -> None:
    L, N = w.shape[0], w.shape[1]
    bn, np2 = ahead_block(N, programs), triton.next_power_of_2(N)
    warps = {} if runtime.INTERPRET else {"num_warps": AHEAD_WARPS}
    if persistent:
        count.zero_()
        assert L * N * N < 2 ** 31, "the persistent kernel offsets its weights in int32"
        kernel = persistent_two_ahead_kernel if two else persistent_ahead_kernel
        h = kernel[(triton.cdiv(N, bn),)](kernel_view(w), kernel_view(x), count, N, L, BLOCK_N=bn, NP=np2,
                                          **runtime.kernel_flags(), **warps)
        _note_registers(kernel.fn.__name__, h)
        return
    flags = {"USE_PDL": True, "launch_pdl": True} if pdl and not runtime.INTERPRET else {}
    for i in range(L):
        h = gemv_ahead_kernel[(triton.cdiv(N, bn),)](kernel_view(w[i]), kernel_view(x[i]), kernel_view(x[i + 1]), N,
                                                     BLOCK_N=bn, NP=np2, **runtime.kernel_flags(), **flags, **warps)
    _note_registers("gemv_ahead_kernel", h)


def chain_launches(w, x, pdl: bool) -> None:
    L, N = w.shape[0], w.shape[1]
    flags = {"USE_PDL": True, "launch_pdl": True} if pdl and not runtime.INTERPRET else {}   # no PDL there
    for i in range(L):
        h = gemv_kernel[(triton.cdiv(N, BLOCK_N),)](kernel_view(w[i]), kernel_view(x[i]), kernel_view(x[i + 1]), N,
                                                   BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, **runtime.kernel_flags(), **flags)
    _note_registers("gemv_kernel", h)


def chain_persistent(w, x, count, programs: int, weights_first: bool) -> None:
    count.zero_()
    L, N = w.shape[0], w.shape[1]
    assert L * N * N < 2 ** 31, "the persistent kernel offsets its weights in int32"
    h = persistent_kernel[(programs,)](kernel_view(w), kernel_view(x), count, N, L, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                       WEIGHTS_FIRST=weights_first, **runtime.kernel_flags())
    _note_registers(f"persistent_kernel (weights first {weights_first})", h)


def forms(programs: int) -> dict:
    return {"launches": lambda w, x, c: chain_launches(w, x, False),
            "launches + PDL": lambda w, x, c: chain_launches(w, x, True),
            "persistent": lambda w, x, c: chain_persistent(w, x, c, programs, False),
            "persistent, weights first": lambda w, x, c: chain_persistent(w, x, c, programs, True),
            "launches, rows ahead": lambda w, x, c: chain_ahead(w, x, c, programs, False, pdl=False),
            "launches + PDL, rows ahead": lambda w, x, c: chain_ahead(w, x, c, programs, False),
            "persistent, rows ahead": lambda w, x, c: chain_ahead(w, x, c, programs, True),
            "persistent, two phases ahead": lambda w, x, c: chain_ahead(w, x, c, programs, True, two=True)}


def inputs(n: int, phases: int, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    w = (torch.randn(phases, n, n, generator=g, device=device) / n ** 0.5).to(torch.bfloat16)
    x = torch.zeros(phases + 1, n, dtype=torch.bfloat16, device=device)
    x[0] = torch.randn(n, generator=g, device=device).to(torch.bfloat16)
    return w, x, torch.zeros(1, dtype=torch.int32, device=device)


def fp32_chain(w, x0):
    y = x0.float()
    for i in range(w.shape[0]):
        y = (w[i].float() @ y).to(torch.bfloat16).float()
    return y


def check(n: int, phases: int) -> dict:
    """Every form once on this machine's device; outputs against the launches' and the fp32 chain."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = {}
    programs = 1 if runtime.INTERPRET else torch.cuda.get_device_properties(0).multi_processor_count
    for name, run in forms(programs).items():
        w, x, c = inputs(n, phases, device)
        run(w, x, c)
        out[name] = x[-1].clone()
    w, x, _ = inputs(n, phases, device)
    want = fp32_chain(w, x[0])
    base = out["launches"]
    return {name: {"bit_equal_to_launches": bool(torch.equal(y, base)),
                   "max_abs_vs_fp32_chain": float((y.float() - want).abs().max())} for name, y in out.items()}


def main() -> None:
    global AHEAD_WARPS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2048, help="rows and columns of each phase's weight")
    ap.add_argument("--phases", type=int, default=30)
    ap.add_argument("--check", action="store_true", help="run every form once and compare (any machine)")
    ap.add_argument("--ahead-warps", type=int, default=8, help="warps of the rows-ahead kernels")
    ap.add_argument("--forms", nargs="*", help="time only the forms whose names contain one of these")
    args = ap.parse_args()
    AHEAD_WARPS = args.ahead_warps
    if args.check:
        for name, r in check(min(args.n, 64), min(args.phases, 3)).items():
            print(f"{name:28} same bits as launches {r['bit_equal_to_launches']}, "
                  f"max abs vs fp32 chain {r['max_abs_vs_fp32_chain']:.3g}")
        return
    if not torch.cuda.is_available():
        sys.exit("boundary_cost.py times GPU kernels: no GPU here (--check runs the forms on the interpreter)")
    ceilings = measure_ceilings()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    nbytes = args.phases * args.n * args.n * 2
    res = {"provenance": provenance("PYTHONPATH=. python3 experiments/boundary_cost.py " + " ".join(sys.argv[1:])),
           "ceilings": ceilings.as_dict(), "n": args.n, "phases": args.phases, "programs": sms,
           "weight_bytes": nbytes, "check": check(args.n, args.phases), "rows": []}
    sets = [inputs(args.n, args.phases, "cuda", seed) for seed in range(max(1, -(-3 * 50 * 2 ** 20 // nbytes)))]
    for name, run in forms(sms).items():
        if args.forms and not any(f in name for f in args.forms):
            continue
        calls = [lambda s=s, run=run: run(*s) for s in sets]
        us = graph_us(calls)
        res["rows"].append({"form": name, "us_per_chain": us, "us_per_phase": us / args.phases,
                            "gb_s": nbytes / us / 1e3, "frac_of_read": nbytes / us / 1e3 / ceilings.read_gbps})
    by = {r["form"]: r["us_per_chain"] for r in res["rows"]}
    if "launches" in by:
        res["boundary_us"] = {f"launches - {k}": (by["launches"] - by[k]) / args.phases for k in by if k != "launches"}
    res["ahead_warps"], res["registers"] = AHEAD_WARPS, REGISTERS
    save_experiment("boundary-cost", res)
    print(f"{args.phases} phases of {args.n}x{args.n} bf16 ({nbytes / 1e6:.1f} MB), read ceiling "
          f"{ceilings.read_gbps:,.0f} GB/s ({nbytes / ceilings.read_gbps / 1e3:.1f} us for the bytes)")
    for name, r in REGISTERS.items():
        print(f"{name:40} {r['registers']} registers, {r['spills']} bytes spilled")
    for r in res["rows"]:
        ok = res["check"][r["form"]]["bit_equal_to_launches"]
        err = res["check"][r["form"]]["max_abs_vs_fp32_chain"]
        print(f"{r['form']:28} {r['us_per_chain']:8.1f} us  {r['us_per_phase']:6.2f} us a phase  "
              f"{r['frac_of_read']:6.1%} of read  same bits {ok}  max abs vs fp32 {err:.3g}")


if __name__ == "__main__":
    main()
