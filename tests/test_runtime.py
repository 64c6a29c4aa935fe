"""The runtime: backend choice at import, the reference switch, ``runtime.op``, the interpreter workarounds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import lynn_kernels
from lynn_kernels import nvfp4, runtime
from lynn_kernels.metrics import bit_mismatches

REPO = Path(__file__).resolve().parents[1]
ON_GPU = torch.cuda.is_available()


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with TRITON_INTERPRET / LYNN_BACKEND unset and no GPU visible."""
    clean = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LYNN_BACKEND")}
    clean["CUDA_VISIBLE_DEVICES"] = ""
    clean.update(env)
    return subprocess.run([sys.executable, "-c", code], env=clean, cwd=REPO, capture_output=True, text=True,
                          timeout=120)


# ---------------------------------------------------------------------------------------------------------------
# backend choice


@pytest.mark.skipif(ON_GPU, reason="checks the CPU default")
def test_backend_is_interpreter_on_cpu():
    assert lynn_kernels.backend() == "interpreter" == runtime.backend()
    assert runtime.INTERPRET is True and os.environ["TRITON_INTERPRET"] == "1"
    assert runtime.DEVICE == torch.device("cpu")
    assert runtime.DOT_DTYPE == tl.float32
    assert runtime.kernel_flags() == {"INTERPRET": True}
    info = runtime.device_summary()
    assert info["backend"] == "interpreter" and info["device"] == "cpu (Triton interpreter)"
    assert info["torch"] == torch.__version__ and info["triton"] == triton.__version__


def test_plain_import_without_gpu_sets_the_interpreter():
    r = run_python("import os, lynn_kernels; print(os.environ.get('TRITON_INTERPRET'), lynn_kernels.backend(), "
                   "lynn_kernels.runtime.DEVICE)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "interpreter", "cpu"]


@pytest.mark.parametrize("value", ["reference", " Reference "], ids=["reference", "spaces-and-case"])
def test_lynn_backend_reference(value):
    r = run_python("import lynn_kernels, torch\n"
                   "from lynn_kernels.nvfp4 import quantize, reference\n"
                   "w = torch.randn(3, 32)\n"
                   "with lynn_kernels.use_reference(False):\n"
                   "    inner = lynn_kernels.backend()\n"
                   "print(lynn_kernels.backend(), inner, torch.equal(quantize(w).codes, reference.quantize(w).codes))",
                   LYNN_BACKEND=value)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["reference", "interpreter", "True"]


def test_lynn_backend_bogus_fails_clearly():
    r = run_python("import lynn_kernels", LYNN_BACKEND="bogus")
    assert r.returncode != 0
    assert "ValueError: LYNN_BACKEND='bogus': expected one of ('triton', 'interpreter', 'reference') or unset" \
        in r.stderr


def test_lynn_backend_triton_without_gpu_fails_clearly():
    r = run_python("import lynn_kernels", LYNN_BACKEND="triton")
    assert r.returncode != 0
    assert "RuntimeError: LYNN_BACKEND=triton asks for compiled kernels, but no CUDA GPU is visible" in r.stderr


# ---------------------------------------------------------------------------------------------------------------
# the reference switch


def test_use_reference_switches_and_nests():
    base = runtime.backend()
    assert base in ("interpreter", "triton")
    with lynn_kernels.use_reference():
        assert lynn_kernels.backend() == "reference"
        with lynn_kernels.use_reference(False):
            assert lynn_kernels.backend() == base
            with lynn_kernels.use_reference():
                assert lynn_kernels.backend() == "reference"
            assert lynn_kernels.backend() == base
        assert lynn_kernels.backend() == "reference"
        assert runtime.device_summary()["backend"] == "reference"
    assert lynn_kernels.backend() == base


def test_use_reference_restores_after_an_exception():
    base = runtime.backend()
    with pytest.raises(KeyError):
        with lynn_kernels.use_reference():
            raise KeyError("boom")
    assert runtime.backend() == base


def _toy_reference(x, scale=2.0):
    return ("reference", x * scale)


@runtime.op(reference=_toy_reference)
def toy(x, scale=2.0):
    """The toy host function."""
    return ("host", x * scale)


def test_op_decorator_calls_reference_on_request():
    assert toy(3, scale=4.0) == ("host", 12.0)
    with lynn_kernels.use_reference():
        assert toy(3, scale=4.0) == ("reference", 12.0)
        assert toy(1) == ("reference", 2.0)
        with lynn_kernels.use_reference(False):
            assert toy(1) == ("host", 2.0)
    assert toy(1) == ("host", 2.0)
    assert toy.reference is _toy_reference and toy.host.__name__ == "toy"
    assert toy.__name__ == "toy" and toy.__doc__ == "The toy host function."


def test_op_can_show_the_reference_instead_of_the_host():
    """``docs="reference"``: an op whose host lives beside its kernel shows the reference's name, signature and doc,
    and still dispatches as the host one does; any other ``docs`` is refused."""
    import inspect

    def _toy_host(x, scale=2.0):
        return ("host", x * scale)

    shown = runtime.op(reference=_toy_reference, docs="reference")(_toy_host)
    assert shown.__name__ == "_toy_reference" and inspect.signature(shown) == inspect.signature(_toy_reference)
    assert "Runs the Triton kernels through" in shown.__doc__ and shown.host is _toy_host
    assert shown(1) == ("host", 2.0)
    with lynn_kernels.use_reference():
        assert shown(1) == ("reference", 2.0)
    with pytest.raises(ValueError, match="docs='both': expected 'host' or 'reference'"):
        runtime.op(reference=_toy_reference, docs="both")


def test_every_public_op_and_its_reference_take_the_same_arguments():
    """What ``use_reference()`` (and a routed callable) is handed is what the host was: the same parameters, kinds
    and defaults, for every op declared with ``runtime.op`` in the package."""
    import importlib
    import inspect
    import pkgutil

    ops = {}
    for info in pkgutil.walk_packages(lynn_kernels.__path__, "lynn_kernels."):
        for name, obj in vars(importlib.import_module(info.name)).items():
            if callable(obj) and hasattr(obj, "reference") and hasattr(obj, "host"):
                ops.setdefault(id(obj), (f"{info.name}.{name}", obj))
    assert len(ops) >= 20, sorted(n for n, _ in ops.values())
    for name, op in ops.values():
        host, ref = (inspect.signature(f).parameters.values() for f in (op.host, op.reference))
        assert [(p.name, p.kind, p.default) for p in host] == [(p.name, p.kind, p.default) for p in ref], name


def test_nvfp4_ops_run_their_reference_without_launching(monkeypatch):
    from lynn_kernels.nvfp4 import triton_quant

    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel was launched under use_reference()")

    monkeypatch.setattr(triton_quant, "launch_quantize", no_kernel)
    monkeypatch.setattr(triton_quant, "_nvfp4_dequantize_kernel", None)
    w = torch.randn(3, 48, generator=torch.Generator().manual_seed(0)).to(runtime.DEVICE)
    with lynn_kernels.use_reference():
        q = nvfp4.quantize(w, recipe="compressed-tensors")
        out = nvfp4.dequantize(q, torch.float32)
    want = nvfp4.reference.quantize(w, recipe="compressed-tensors")
    assert bit_mismatches(q.codes, want.codes) == 0
    assert torch.equal(out, nvfp4.reference.dequantize(want, torch.float32))
    with pytest.raises(AssertionError, match="a kernel was launched"):
        nvfp4.quantize(w)


# ---------------------------------------------------------------------------------------------------------------
# interpreter workarounds


@runtime.autotune(configs=[triton.Config({"BLOCK": 16}, num_warps=1), triton.Config({"BLOCK": 64}, num_warps=4)],
                  key=["n"])
@triton.jit
def _toy_copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)


@pytest.mark.skipif(ON_GPU, reason="the interpreter keeps one config; a GPU keeps them all")
def test_autotune_keeps_one_config_under_the_interpreter(device):
    assert [c.kwargs for c in _toy_copy_kernel.configs] == [{"BLOCK": 16}]
    from lynn_kernels.nvfp4 import triton_quant

    assert len(triton_quant._nvfp4_quantize_kernel.configs) == 1
    assert len(triton_quant._nvfp4_dequantize_kernel.configs) == 1
    x = torch.arange(40, dtype=torch.float32, device=device)
    y = torch.full_like(x, -1.0)
    _toy_copy_kernel[lambda meta: (triton.cdiv(40, meta["BLOCK"]),)](x, y, 40)
    assert torch.equal(x, y)


@triton.jit
def _toy_cast_kernel(x_ptr, y_ptr, n, OUT_DTYPE: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, runtime.cast_output(x, OUT_DTYPE, INTERPRET), mask=mask)


def _cast(x: torch.Tensor, dtype) -> torch.Tensor:
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    _toy_cast_kernel[(triton.cdiv(x.numel(), 256),)](x, runtime.kernel_view(y), x.numel(),
                                                    OUT_DTYPE=runtime.TORCH_TO_TL[dtype],
                                                    BLOCK=256, **runtime.kernel_flags())
    return y


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")   # 70000 -> fp16 inf, on purpose
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_cast_output_rounds_to_nearest_even(dtype, device):
    """cast_output is the interpreter-safe fp32 -> out cast: it must round exactly like torch's .to()."""
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(1000, generator=g) * torch.logspace(-6, 6, 1000)      # includes fp16 subnormals
    ties = torch.tensor([1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8),     # bf16 ties: to even
                         1 + 2.0**-11, 1 + 3 * 2.0**-11,                      # fp16 ties
                         3.3895e38, -3.3895e38, 70000.0, float("inf"), float("-inf"), 0.0, -0.0, 2.0**-126])
    x = torch.cat([rand, ties]).to(device)
    assert bit_mismatches(_cast(x, dtype), x.to(dtype)) == 0


def test_cast_output_bf16_subnormals(device):
    x = torch.tensor([1e-40, -1e-40, 1e-39, 2.0**-130, 5e-39, -1.1e-38], device=device)
    assert bit_mismatches(_cast(x, torch.bfloat16), x.to(torch.bfloat16)) == 0


def test_check_device_names_the_tensor():
    with pytest.raises(ValueError, match=r"weights is on meta, but kernels run on .*move it with "
                                         r"\.to\('(cpu|cuda)'\) or use the reference backend"):
        runtime.check_device("weights", torch.empty(2, device="meta"))
    runtime.check_device("weights", torch.zeros(2, device=runtime.DEVICE))   # the right device passes silently


@pytest.mark.parametrize("a", [0, 1, 15, 16, 17, 1000, 2**31 + 5])
@pytest.mark.parametrize("b", [1, 16, 64, 1000])
def test_host_cdiv_matches_triton(a, b):
    assert runtime.cdiv(a, b) == triton.cdiv(a, b) == -(-a // b)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 16, 17, 1000, 4096, 4097])
def test_host_next_power_of_2_matches_triton(n):
    assert runtime.next_power_of_2(n) == triton.next_power_of_2(n)


# ---------------------------------------------------------------------------------------------------------------
# Triton's register-operand wgmma hazard (runtime.register_dot_hazard): the kernels whose tl.dot takes a register
# operand compile with one stage where it applies. The fault itself shows only compiled on Hopper with Triton 3.6:
# tests/test_matmul.py's churn test covers it there (docs/history/compiler-fault.md has the measurements).

@pytest.mark.parametrize("capability,version,affected", [
    ((9, 0), "3.6.0", True), ((9, 0), "3.7.1", True), ((9, 0), "3.8.0", True), ((9, 0), "3.9.0", False),
    ((9, 0), "3.10.0", False), ((9, 0), "3.6.0+git1234abcd", True), ((8, 0), "3.6.0", False),
    ((10, 0), "3.6.0", False), (None, "3.6.0", False)])
def test_register_dot_hazard_is_hopper_with_a_triton_not_yet_shown_safe(capability, version, affected):
    """Measured on 3.6; 3.7 and 3.8 are not shown safe on a GPU (runtime.REGISTER_DOT_SAFE_FROM)."""
    assert runtime.register_dot_hazard(capability, version) is affected


class _Launch:
    """Stands in for a ``@triton.jit`` kernel: records the keyword arguments of each ``kernel[grid](...)``."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(kwargs)

    @property
    def fn(self):
        return self


@pytest.mark.parametrize("affected", [True, False])
def test_the_register_operand_kernels_take_one_stage_where_the_hazard_applies(monkeypatch, affected):
    from lynn_kernels.matmul import pack, triton_matmul
    from lynn_kernels.moe import triton_experts, triton_experts_common, triton_route

    monkeypatch.setattr(runtime, "register_dot_hazard_here", lambda: affected)
    want = (lambda st: 1) if affected else (lambda st: st)
    # the GEMM's autotune configs as the pruner hands them to the autotuner (at launch), and each small-M bucket's
    configs = triton_matmul._nvfp4_gemm_kernel.configs
    assert [c.num_stages for c in configs] == [st for *_, st in triton_matmul._GEMM_SHAPES]   # untouched at import
    pruned = triton_matmul._prune_gemm(configs, {"M_BUCKET": 4096})
    stages = {(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_M"], c.kwargs["BLOCK_K"], c.num_warps): c.num_stages
              for c in pruned}
    assert len(pruned) == len(configs) and stages == {(bn, bm, bk, w): want(st)
                                                      for bn, bm, bk, w, st in triton_matmul._GEMM_SHAPES}
    for bucket, (*_, st) in triton_matmul.GEMM_SMALL_M.items():
        (cfg,) = triton_matmul._prune_gemm(configs, {"M_BUCKET": bucket})
        assert cfg.num_stages == want(st), bucket
    # the tensor-core GEMV, the GEMM with a given config, the router, the MoE prefill experts
    w = pack(nvfp4.quantize(torch.randn(64, 256, dtype=torch.bfloat16)))
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    y = torch.empty(4, 64, dtype=torch.bfloat16)
    for kernel in (triton_matmul.NVFP4_GEMV, triton_matmul.NVFP4_GEMM):
        monkeypatch.setattr(kernel, "shipped", _Launch())
    import contextlib
    import warnings

    def overridden():
        """A requested stage count that is overridden warns (a sweep must not time one stage under another's name);
        the default one does not."""
        if affected:
            return pytest.warns(RuntimeWarning, match="num_stages=3 requested, compiled with 1")
        return contextlib.nullcontext()

    with warnings.catch_warnings():
        warnings.simplefilter("error")                                  # the default stage count: no warning
        triton_matmul.launch_gemv(x, w, None, y)
    with overridden():
        triton_matmul.launch_gemm(x, w, None, y,
                                  config={"BLOCK_N": 64, "BLOCK_M": 16, "BLOCK_K": 128, "num_stages": 3})
    stages = [triton_matmul.NVFP4_GEMV.shipped.calls[0]["num_stages"],
              triton_matmul.NVFP4_GEMM.shipped.calls[0]["num_stages"]]
    monkeypatch.setattr(triton_route.ROUTER, "shipped", _Launch())
    triton_route.launch_router(x, torch.randn(8, 256, dtype=torch.bfloat16), 2, True,
                               torch.empty(4, 2), torch.empty(4, 2, dtype=torch.int32))
    stages.append(triton_route.ROUTER.shipped.calls[0]["num_stages"])
    for kernel in (triton_experts.MOE_GATE_UP, triton_experts.MOE_DOWN):
        monkeypatch.setattr(kernel, "shipped", _Launch())
    assert stages == [want(3)] * 3
    # the MoE prefill experts transpose their decoded tile into the dot's second operand (shared memory): the
    # stages asked for, and no warning, either way
    ww = triton_experts_common._Weights(x, x, x, 0, 1)
    slots = torch.zeros(16, dtype=torch.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        triton_experts._launch_ffn(x, torch.ones(4, 2), slots, slots, 1, 8, 2, ww, ww, True, torch.empty(8, 64), y,
                                   False, 16, config={"num_stages": 3})
    assert [triton_experts.MOE_GATE_UP.shipped.calls[0]["num_stages"],
            triton_experts.MOE_DOWN.shipped.calls[0]["num_stages"]] == [3, 3]


@pytest.mark.gpu
@pytest.mark.skipif(not runtime.register_dot_hazard_here(), reason="this Triton / GPU is taken as free of the "
                    "register-operand wgmma hazard (runtime.register_dot_hazard); the workaround is off")
def test_gpu_no_compiled_decoder_kernel_pipelines_a_register_operand_wgmma(tmp_path):
    """What the decoder compiles at the real shapes (one Gated DeltaNet and one attention layer of each family, prefill
    of 1 to 2,048 tokens, a few decode steps) into a fresh Triton cache, then its TTGIR read back: no kernel may
    pair a register-operand ``warp_group_dot`` with a wait that leaves wgmmas pending (experiments/rs_wgmma_scan.py;
    docs/history/compiler-fault.md, a compiler fault). Passed on the H200 at 609ede4 (Triton 3.6, 170 s)."""
    out = tmp_path / "scan.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, str(REPO / "experiments" / "rs_wgmma_scan.py"), "--skip-checks",
                           "--out", str(out)], env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json
    rec = json.loads(out.read_text())
    assert sum(1 for k in rec["kernels"] if k["wgmma_dots"]) > 0, "the scan found no wgmma at all: it tests nothing"
    exposed = sorted({k["kernel"] for k in rec["kernels"] if k["exposed"]})
    assert not exposed, f"kernels still pipelining a register-operand wgmma on this Triton: {exposed}"


def test_direct_launch_key_and_interpreter():
    """DirectLaunch's generic key: a tensor by dtype and 16-byte alignment (two views of one storage 2 bytes apart
    differ), anything else by type and value (True, 1 and 1.0 differ); under the interpreter every call takes
    Triton's path and nothing is kept."""
    t = torch.zeros(16, dtype=torch.bfloat16)
    k0 = runtime.DirectLaunch.key_of((t, 3, None))
    assert k0 == ((torch.bfloat16, t.data_ptr() & 15), (int, 3), (type(None), None))
    assert len({runtime.DirectLaunch.key_of((v,)) for v in (True, 1, 1.0)}) == 3
    assert runtime.DirectLaunch.key_of((t[1:], 3, None)) != k0
    assert runtime.DirectLaunch.key_of((t.float(), 3, None))[0][0] == torch.float32
    if runtime.INTERPRET:
        from lynn_kernels.matmul import nvfp4_linear, pack
        from lynn_kernels.matmul.triton_packed import PACKED_GEMV
        from lynn_kernels.nvfp4 import quantize

        p = pack(quantize(torch.randn(8, 32, dtype=torch.bfloat16)))
        nvfp4_linear(torch.randn(1, 32, dtype=torch.bfloat16), p)
        assert not PACKED_GEMV.launch().compiled


# ---------------------------------------------------------------------------------------------------------------
# programmatic dependent launch


def _pdl_kernels():
    """Every kernel that takes ``USE_PDL``: the decode path's, found in the package's modules."""
    import importlib
    import pkgutil

    found = {}
    for mod in pkgutil.walk_packages(lynn_kernels.__path__, "lynn_kernels."):
        m = importlib.import_module(mod.name)
        for obj in vars(m).values():
            while isinstance(getattr(obj, "fn", None), triton.runtime.KernelInterface):
                obj = obj.fn                                  # an autotuned kernel wraps its jitted one
            if isinstance(obj, triton.runtime.KernelInterface) and "USE_PDL" in getattr(obj, "arg_names", ()):
                found[f"{obj.fn.__module__}.{obj.fn.__name__}"] = obj.fn
    return found


def test_every_pdl_kernel_waits_before_it_touches_memory():
    """A kernel launched with programmatic dependent launch runs beside the kernel before it until it waits: each
    kernel that takes ``USE_PDL`` waits (``pdl_enter`` as its first statement, or the packed GEMV's own ``gdc_wait``
    after its first weight loads, the router's ``pdl_enter`` after loads of its weights alone, the fused Gated
    DeltaNet step's after loads of its layer's own states and constants, the packed MoE down kernel's after the
    routing and its first words, which the gate_up kernel before it makes safe by releasing it only after its own
    wait), and the decode path's kernels are all among them."""
    import inspect
    import re

    kernels = _pdl_kernels()
    want = {"_rmsnorm_kernel", "packed_gemv_kernel", "_causal_conv1d_update_kernel", "_recurrent_kernel",
            "_gated_rmsnorm_kernel", "_qk_norm_rope_kernel", "_decode_split_kernel", "_decode_merge_kernel",
            "_router_kernel", "_moe_packed_gate_up_kernel", "_moe_packed_down_kernel", "_gdn_decode_kernel"}
    assert want <= {k.rsplit(".", 1)[1] for k in kernels}, sorted(kernels)
    del kernels["lynn_kernels.runtime.pdl_enter"]                   # the helper itself
    for name, fn in kernels.items():
        body = inspect.getsource(fn).split('):\n', 1)[1]
        body = re.sub(r'^\s*"""(.|\n)*?"""\n', "", body)                    # the docstring
        first = body.strip().splitlines()[0].strip()
        if name.endswith("packed_gemv_kernel"):
            assert "tl.extra.cuda.gdc_wait()" in body and "if USE_PDL:" in body, name
        elif name.endswith("_router_kernel"):           # its first chunk of weights (constant) before the wait
            pre = body.split("pdl_enter(USE_PDL)", 1)
            assert len(pre) == 2, name
            assert "tl.store" not in pre[0] and "atomic" not in pre[0], name
            assert set(re.findall(r"tl\.load\((\w+)", pre[0])) == {"r_ptr", "g_ptr"}, name
        elif name.endswith("_gdn_decode_kernel"):      # with STATE_EARLY: its own states and constants first
            lines = [ln.strip() for ln in body.strip().splitlines()[:4]]
            assert lines == ["if USE_PDL:", "tl.extra.cuda.gdc_launch_dependents()", "if not STATE_EARLY:",
                             "tl.extra.cuda.gdc_wait()"], name
            pre = body.split("        if STATE_EARLY:\n            tl.extra.cuda.gdc_wait()", 1)
            assert len(pre) == 2, name
            assert "tl.store" not in pre[0] and "atomic" not in pre[0] and "_roll_store" not in pre[0], name
            # nothing an earlier kernel of the step writes: the projections, the layer input, the tickets, out
            for ptr in ("x_row", "x_ptr", "z_ptr", "hx_ptr", "hx_row", "a_ptr", "b_ptr", "count_ptr", "out_ptr"):
                assert re.search(rf"\b{ptr}\b", pre[0].split("tl.extra.cuda.gdc_wait()", 1)[1]) is None, (name, ptr)
            assert set(re.findall(r"tl\.load\((\w+)", pre[0])) == {"state", "alog_ptr", "dtb_ptr", "nw_ptr",
                                                                    "wa_ptr", "wb_ptr"}, name
        elif name.endswith("_moe_packed_gate_up_kernel"):   # waits, then releases the down kernel
            assert body.strip().splitlines()[:3] == ["if USE_PDL:", "        tl.extra.cuda.gdc_wait()",
                                                     "        tl.extra.cuda.gdc_launch_dependents()"], name
        elif name.endswith("_moe_packed_down_kernel"):       # the routing and its first words before the wait
            pre = body.split("tl.extra.cuda.gdc_wait()", 1)
            assert len(pre) == 2 and first == "if USE_PDL:", name
            assert "tl.store" not in pre[0] and "atomic" not in pre[0] and "_slots_step" not in pre[0], name
            assert "tl.load(" not in pre[0], name               # its loads: _slot_group's and load_words'
        else:
            assert first == "pdl_enter(USE_PDL)", (name, first)


def test_programmatic_launches_is_a_no_op_without_hopper(monkeypatch):
    """Off by default; on only where the GPU has it (not under the interpreter); nests and restores."""
    assert runtime.pdl() is False and runtime.pdl_flags() == {"USE_PDL": False}
    monkeypatch.setattr(runtime, "pdl_supported", lambda: False)
    with lynn_kernels.programmatic_launches():
        assert runtime.pdl() is False and runtime.pdl_flags() == {"USE_PDL": False}
    monkeypatch.setattr(runtime, "pdl_supported", lambda: True)
    with lynn_kernels.programmatic_launches():
        assert runtime.pdl() is True and runtime.pdl_flags() == {"USE_PDL": True, "launch_pdl": True}
        with lynn_kernels.programmatic_launches(False):
            assert runtime.pdl() is False
        assert runtime.pdl() is True
    assert runtime.pdl() is False


@pytest.mark.skipif(ON_GPU, reason="checks the interpreter")
def test_pdl_is_unsupported_under_the_interpreter():
    assert runtime.pdl_supported() is False


def test_host_ints_reads_once_and_follows_writes(monkeypatch):
    """host_ints: a tensor's values are read back once and remembered until the tensor is written; remember_ints
    spares even that read (a prefill's offsets, read by every layer)."""
    reads = []
    real = torch.Tensor.tolist

    def counting(self):
        reads.append(1)
        return real(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    t = torch.tensor([0, 3, 7], dtype=torch.int32)
    assert runtime.host_ints(t) == (0, 3, 7) and runtime.host_ints(t) == (0, 3, 7)
    assert len(reads) == 1
    t[1] = 5                                                  # a write bumps the version: read again
    assert runtime.host_ints(t) == (0, 5, 7) and len(reads) == 2
    u = runtime.remember_ints(torch.tensor([0, 2, 4], dtype=torch.int32), [0, 2, 4])
    assert runtime.host_ints(u) == (0, 2, 4) and len(reads) == 2
    u.add_(1)
    assert runtime.host_ints(u) == (1, 3, 5) and len(reads) == 3
    with torch.inference_mode():                              # no version counter: remembered ones trusted,
        v = runtime.remember_ints(torch.tensor([0, 1]), [0, 1])   # others read on every call
        w = torch.tensor([0, 6])
        assert runtime.host_ints(v) == (0, 1) and len(reads) == 3
        assert runtime.host_ints(w) == (0, 6) and runtime.host_ints(w) == (0, 6) and len(reads) == 5


def test_prefill_batch_offsets_need_no_read_back(monkeypatch):
    """cache.plan remembers the offsets it builds, so a multi-sequence prefill's layers read none back."""
    import lynn_model
    from lynn_model.loader import random_model

    model = random_model(lynn_model.preset("tiny-qwen3.5-moe"), weights="bf16", seed=0)
    cache = model.new_cache(max_batch=2, max_tokens=64)
    slots = [cache.add(), cache.add()]
    batch = cache.plan(slots, [5, 3])
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("an offset was read back"))
    assert runtime.host_ints(batch.cu_seqlens) == (0, 5, 8)
    assert runtime.host_ints(batch.prefix_lens_t) == (0, 0)
