"""One place that decides how kernels run, and owns every interpreter workaround.

Three backends:

* ``"triton"``      compiled Triton on a CUDA GPU (the default when one is visible);
* ``"interpreter"`` Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, the default without a GPU);
* ``"reference"``   the pure-torch reference of each op, on request only:
  ``LYNN_BACKEND=reference`` in the environment, or ``with use_reference(): ...``.

The interpreter is switched on here, at import, before any ``@triton.jit`` function is defined: ``import
lynn_kernels`` imports this module first, so a plain import just works on a laptop.

Interpreter workarounds (docs/interpreter.md says what each works around) live here and nowhere else:

* :func:`autotune` keeps one config under the interpreter (more fail without a driver);
* :data:`DOT_DTYPE` is fp32 under the interpreter (its bf16 arithmetic is wrong), bf16 on the GPU;
* :func:`kernel_flags` passes ``INTERPRET`` to kernels as a constexpr, so a kernel can take the
  integer-arithmetic rounding path (:func:`round_to_bf16`) where the interpreter's casts truncate.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import sys
import warnings

import torch
from torch.utils.weak import WeakIdKeyDictionary

BACKENDS = ("triton", "interpreter", "reference")


def _cuda_visible() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:  # a broken driver install must not stop a CPU user
        return False


# Decide before triton is imported by anything else: TRITON_INTERPRET is read when a kernel is decorated.
if "TRITON_INTERPRET" not in os.environ and not _cuda_visible():
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton.language" in sys.modules:       # its own jit functions (tl.sum, tl.max) were made compiled-only
        warnings.warn("triton was imported before lynn_kernels on a machine without a GPU: kernels that call "
                      "tl.sum, tl.max and the like will fail under the interpreter ('Cannot call @triton.jit'd "
                      "outside of the scope of a kernel'). Import lynn_kernels first, or set TRITON_INTERPRET=1 "
                      "before starting Python.", RuntimeWarning, stacklevel=2)

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

import triton  # noqa: E402  (must follow the environment decision above)
import triton.language as tl  # noqa: E402

#: Device every kernel input must live on: the GPU when compiled, the CPU under the interpreter.
DEVICE = torch.device("cpu") if INTERPRET else torch.device("cuda")

#: Operand dtype for ``tl.dot``: bf16 on the GPU, fp32 under the interpreter (its bf16 dot is garbage).
DOT_DTYPE = tl.float32 if INTERPRET else tl.bfloat16

_env_backend = os.environ.get("LYNN_BACKEND", "").strip().lower()


def _startup_error(err: Exception) -> Exception:
    """Mark ``err`` as a start-up configuration error: raised at import, so no code of the package has run yet; the
    ``lynn`` command (``lynn_cli.py``) reports one so marked as a usage error, one line and exit status 2."""
    err.lynn_startup_error = True
    return err


if _env_backend and _env_backend not in BACKENDS:
    raise _startup_error(ValueError(f"LYNN_BACKEND={_env_backend!r}: expected one of {BACKENDS} or unset"))
if _env_backend == "triton" and INTERPRET:
    raise _startup_error(RuntimeError("LYNN_BACKEND=triton asks for compiled kernels, but no CUDA GPU is visible "
                                      "(or TRITON_INTERPRET=1 is set)"))
if _env_backend == "interpreter" and not INTERPRET:
    raise _startup_error(RuntimeError("LYNN_BACKEND=interpreter must be chosen before start-up: set "
                                      "TRITON_INTERPRET=1 in the environment instead"))

_force_reference: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "lynn_force_reference", default=_env_backend == "reference")


def backend() -> str:
    """The backend the next op call will use: ``"triton"``, ``"interpreter"`` or ``"reference"``."""
    if _force_reference.get():
        return "reference"
    return "interpreter" if INTERPRET else "triton"


@contextlib.contextmanager
def use_reference(enabled: bool = True):
    """Run every op on its pure-torch reference inside the block (``enabled=False`` undoes an outer one)."""
    token = _force_reference.set(enabled)
    try:
        yield
    finally:
        _force_reference.reset(token)


_trusted: contextvars.ContextVar[bool] = contextvars.ContextVar("lynn_trusted", default=False)


@contextlib.contextmanager
def trusted(enabled: bool = True):
    """Skip the checks that read tensor *values* back to the host inside the block (ids in range, finite logits,
    sequence lengths within the cache): the hot path of a caller that validated its inputs once, such as a captured
    decode step whose positions, slots and token ids it makes itself. Shapes, dtypes and devices are still checked
    (they cost no sync). ``enabled=False`` undoes an outer one."""
    token = _trusted.set(enabled)
    try:
        yield
    finally:
        _trusted.reset(token)


_as_batch: contextvars.ContextVar[int | None] = contextvars.ContextVar("lynn_as_batch", default=None)


@contextlib.contextmanager
def as_batch(rows: int | None):
    """Inside the block, every op that picks a kernel or its tiles by its number of rows picks them as for a call of
    ``rows`` rows, so each row gets the bits such a call would give it: a speculative verify runs ``k + 1`` tokens
    of each of ``rows`` sequences and must sum each one as the decode step of ``rows`` rows does. An op of more rows
    runs in pieces that each sum a row as that call would (one launch where the kernel's sums do not depend on its
    row count, else ``rows`` rows a launch). ``None`` undoes an outer one."""
    if rows is not None and (not isinstance(rows, int) or rows < 1):
        raise ValueError(f"as_batch(rows): rows must be a positive int or None, got {rows!r}")
    token = _as_batch.set(rows)
    try:
        yield
    finally:
        _as_batch.reset(token)


def batch_rows(m: int) -> int:
    """The row count an op of ``m`` rows chooses its kernel by: ``m``, or :func:`as_batch`'s inside one."""
    rows = _as_batch.get()
    return m if rows is None else rows


def in_calls_of(fn, x2: torch.Tensor, rows: int) -> torch.Tensor:
    """``fn`` over the rows of ``x2 [M, ...]`` as calls of exactly ``rows`` rows (the last piece padded with zero
    rows, their output dropped), concatenated: each row gets the bits a call of ``rows`` rows gives it, for an ``fn``
    that computes each row from its own input only (:func:`as_batch`)."""
    m = x2.shape[0]
    outs = []
    for r in range(0, m, rows):
        piece = x2[r:r + rows]
        if piece.shape[0] < rows:
            piece = torch.cat([piece, piece.new_zeros(rows - piece.shape[0], *piece.shape[1:])])
        outs.append(fn(piece))
    return torch.cat(outs)[:m]


def values_checkable() -> bool:
    """Whether an op may read index or value tensors back to validate them: not inside :func:`trusted`, and not
    while a CUDA graph is being captured (a read-back would break the capture)."""
    if _trusted.get():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


_HOST_INTS = WeakIdKeyDictionary()            # tensor (by identity) -> (its version, its values)


def _version(t: torch.Tensor) -> int | None:
    return None if t.is_inference() else t._version        # inference tensors keep no version counter


def remember_ints(t: torch.Tensor, values) -> torch.Tensor:
    """Record the values of an index tensor that was just built from host ints (``values``), so that
    :func:`host_ints` returns them without reading the device. Returns ``t``. The maker's promise: ``t`` is not
    written afterwards (checked through torch's version counter, except for inference tensors, which have none)."""
    _HOST_INTS[t] = (_version(t), tuple(int(v) for v in values))
    return t


def host_ints(t: torch.Tensor) -> tuple[int, ...]:
    """The values of a 1-D index tensor on the host: from :func:`remember_ints`, or from an earlier call while ``t``
    has not been written since (torch's version counter), else read back (a host sync) and remembered. A prefill's
    offsets are read by each of its layers: one read, or none when whoever built them remembered them. An inference
    tensor that nobody remembered is read on every call (no version counter tells a write)."""
    hit = _HOST_INTS.get(t)
    if hit is not None and hit[0] == _version(t):
        return hit[1]
    values = tuple(int(v) for v in t.tolist())
    if not t.is_inference():
        _HOST_INTS[t] = (t._version, values)
    return values


def op(reference, *, docs="host"):
    """Decorate a host function (check, allocate, launch) so that it runs ``reference`` instead when the reference
    backend is on: the one way a public op is declared.

    The host function and the reference take the same arguments and return the same thing; the decorator only picks
    one, it never falls back silently. The op keeps both as ``op.host`` and ``op.reference``.

    ``docs`` says whose name, signature and docstring the op shows (what ``help()`` shows):

    * ``"host"``: the host's, for a host written as the public function in the family's ``__init__.py``
      (``@runtime.op(reference=reference.rmsnorm)`` above ``def rmsnorm(...)``);
    * ``"reference"``: the reference's, with a line saying which runs when, for a host that lives beside its kernel
      in a ``triton_*.py`` file (``quantize = runtime.op(reference=reference.quantize,
      docs="reference")(quantize_triton)``).
    """
    if docs not in ("host", "reference"):
        raise ValueError(f"docs={docs!r}: expected 'host' or 'reference'")

    def wrap(host):
        @functools.wraps(host)
        def public(*args, **kwargs):
            routes = _routes.get()
            if routes and public in routes:
                return _routed(routes, public, args, kwargs)
            if _force_reference.get():
                return reference(*args, **kwargs)
            return host(*args, **kwargs)

        if docs == "reference":
            functools.update_wrapper(public, reference)
            public.__doc__ = ((reference.__doc__ or "").rstrip() + f"\n\nRuns the Triton kernels through "
                              f"``{host.__module__}.{host.__name__}``; under ``use_reference()``, this torch "
                              f"reference.")
        public.reference = reference
        public.host = host
        return public

    return wrap


# --- routing: what lynn_kernels.lab.using(...) changes --------------------------------------------------------------

#: Routes in force: a public op -> the callable that answers for it, a kernel's name -> the ``@triton.jit`` kernel
#: its launcher runs. Empty (the shipped code) unless :func:`routed` is on.
_routes: contextvars.ContextVar[dict] = contextvars.ContextVar("lynn_routes", default={})


#: The routes' key of a tuple of ``collections.Counter``s, each told every route taken (one per counting block).
HITS = "lynn.hits"


def _routed(routes: dict, public, args, kwargs):
    """Call the variant routed for ``public``; inside it, ``public`` is the shipped op again (a variant may call it)."""
    for hits in routes.get(HITS, ()):
        hits[public] += 1
    token = _routes.set({k: v for k, v in routes.items() if k is not public})
    try:
        return routes[public](*args, **kwargs)
    finally:
        _routes.reset(token)


def route_counters() -> tuple:
    """The counters of the routes in force (``routes[HITS]``): a nested counting block adds its own to them."""
    return _routes.get().get(HITS, ())


@contextlib.contextmanager
def routed(routes: dict):
    """Inside the block, a call of each public op in ``routes`` goes to its callable, and each launcher whose
    :class:`Kernel` name is in ``routes`` launches that kernel instead (``lynn_kernels.lab.using`` builds the dict
    and checks each variant; this only installs it). Nested blocks add to the outer routes."""
    token = _routes.set({**_routes.get(), **routes})
    try:
        yield
    finally:
        _routes.reset(token)


#: Every launcher's kernel by name (``"norm.rmsnorm"``): the kernels a variant may stand in for.
KERNELS: dict[str, "Kernel"] = {}


class Kernel:
    """A ``@triton.jit`` kernel as its launcher sees it: the shipped one unless a route names it.

    The launcher asks :meth:`current` (or :meth:`launch`, for a :class:`DirectLaunch`) on every call, so a variant
    routed by name reaches every call site, the decoder's included, with nothing else changed: same grid, same
    arguments, same constexprs. A variant must take the shipped kernel's parameters, by name and in order.
    """

    __slots__ = ("name", "shipped", "_direct", "_shipped_direct", "_adapted")

    def __init__(self, name: str, fn):
        known = KERNELS.get(name)
        if known is not None and _where(known.shipped) != _where(fn):       # a reloaded module may re-register
            raise ValueError(f"kernel name {name!r} is taken by {_where(known.shipped)}")
        self.name, self.shipped, self._direct, self._adapted = name, fn, {}, {}
        self._shipped_direct = DirectLaunch(fn)
        KERNELS[name] = self

    def current(self, kernel=None):
        """``kernel`` when given (a launcher's ``kernel=`` argument, :meth:`adapt`-ed), else the routed variant,
        else the shipped one."""
        if kernel is not None:
            return self.adapt(kernel)
        routes = _routes.get()
        if not routes or self.name not in routes:
            return self.shipped
        for hits in routes.get(HITS, ()):
            hits[self.name] += 1
        return routes[self.name]

    def launch(self, kernel=None) -> "DirectLaunch":
        """The :class:`DirectLaunch` of :meth:`current` (one per kernel object, so each keeps its compiled cache)."""
        fn = self.current(kernel)
        if fn is self.shipped:                            # the hot path: no hashing of a JITFunction
            return self._shipped_direct
        hit = self._direct.get(id(fn))
        if hit is None or hit[0] is not fn:
            hit = self._direct[id(fn)] = (fn, DirectLaunch(fn))
        return hit[1]

    def adapt(self, fn):
        """``fn`` as the launcher can run it: under the shipped kernel's ``triton.heuristics`` (the constexprs they
        compute, the launcher does not pass) and its autotuning configs, reset and restore lists and pruning (the
        tiles the launcher does not pass), where the shipped kernel has them and ``fn`` is a bare kernel."""
        if fn is self.shipped or hasattr(fn, "configs") or hasattr(fn, "values"):
            return fn
        hit = self._adapted.get(id(fn))
        if hit is not None and hit[0] is fn:
            return hit[1]
        made, shipped = fn, self.shipped
        tuner = shipped if hasattr(shipped, "configs") else None
        inner = shipped.fn if tuner is not None else shipped
        if hasattr(inner, "values"):                          # autotune(heuristics(jit)), or heuristics(jit)
            made = triton.heuristics(dict(inner.values))(made)
        elif hasattr(shipped, "values") and hasattr(shipped.fn, "configs"):   # heuristics(autotune(jit))
            tuner = shipped.fn
        if tuner is not None:
            prune = getattr(tuner, "early_config_prune", None)
            made = autotune(configs=list(tuner.configs), key=list(tuner.keys),
                            prune_configs_by={"early_config_prune": prune} if prune else None,
                            reset_to_zero=list(getattr(tuner, "reset_to_zero", []) or []) or None,
                            restore_value=list(getattr(tuner, "restore_value", []) or []) or None)(made)
            if tuner is not shipped:
                made = triton.heuristics(dict(shipped.values))(made)
        self._adapted[id(fn)] = (fn, made)
        return made


def _where(fn) -> str:
    """Module and qualified name of a kernel (inside an autotuner or heuristics): who registered a name."""
    while hasattr(fn, "fn"):
        fn = fn.fn
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"


def autotune(configs, key, prune_configs_by=None, **kwargs):
    """``triton.autotune`` that runs one config per key under the interpreter (benchmarking needs a driver).

    Without a pruner the interpreter keeps the first config; with ``prune_configs_by={"early_config_prune": f}`` it
    keeps the first config ``f`` keeps, so a kernel whose configs depend on the shape (an M bucket) still gets a
    fitting one on the CPU.
    """
    if INTERPRET:
        if prune_configs_by and "early_config_prune" in prune_configs_by:
            prune = prune_configs_by["early_config_prune"]
            prune_configs_by = {**prune_configs_by,
                                "early_config_prune": lambda cfgs, nargs, **kw: list(prune(cfgs, nargs, **kw))[:1]}
        else:
            configs = configs[:1]
    return triton.autotune(configs=configs, key=key, prune_configs_by=prune_configs_by, **kwargs)


#: The first Triton taken as free of the register-operand wgmma hazard below: none yet. The fault was measured on
#: 3.6; upstream fixed its two parts in 2026 (#9514 in February; #11056, for 8 warps, in July, after the 3.8
#: release branch opened), and 3.7 / 3.8 have not been run on a GPU here. Our local 3.8 compiles the GEMM's tiles
#: without the overlap (one ``warp_group_dot`` per step, ``pendings = 0``), which says nothing of the 8-warp part.
REGISTER_DOT_SAFE_FROM = (3, 9)


def register_dot_hazard(capability: tuple[int, int] | None, triton_version: str) -> bool:
    """Hopper (capability 9.x) with a Triton older than :data:`REGISTER_DOT_SAFE_FROM`; ``capability`` None (no GPU,
    the interpreter) is never affected.

    On Hopper a ``tl.dot`` becomes ``wgmma.mma_async``; when its first operand is a register tensor (a weight tile
    decoded in registers) the PTX rules forbid writing those registers until a ``wgmma.wait_group`` has covered that
    wgmma. Triton 3.6's software pipeliner (``num_stages >= 2``) leaves up to seven of a loop's wgmmas in flight
    while the next iteration already decodes into their registers (triton-lang/triton#9433; with 8 warps the wait
    also fails to cover the other warpgroup, #11047). Measured on the H200 with Triton 3.6
    (docs/history/compiler-fault.md, a compiler fault): the packed GEMM at M = 80, 4 warps, 3 stages gave 8 weight
    rows of garbage (near 1e31) in 0.4-0.7% of calls, and at M = 2048 with 8 warps and 3 stages 42% of the output
    on every call; with one stage, none in 1,000 and 250 calls."""
    if capability is None:
        return False
    major_minor = tuple(int(p) for p in triton_version.split("+")[0].split(".")[:2])
    return capability[0] == 9 and major_minor < REGISTER_DOT_SAFE_FROM


@functools.lru_cache(maxsize=None)
def register_dot_hazard_here() -> bool:
    """:func:`register_dot_hazard` for this process's GPU and Triton (asked on first use, not at import: reading
    the GPU's capability initialises CUDA)."""
    cap = None if INTERPRET or not torch.cuda.is_available() else torch.cuda.get_device_capability()
    return register_dot_hazard(cap, triton.__version__)


def register_dot_stages(stages: int, requested: bool = False) -> int:
    """``num_stages`` for a kernel whose ``tl.dot`` takes a register operand: ``stages``, or 1 where
    :func:`register_dot_hazard_here` says this Triton would pipeline it unsafely. Called at launch time by the
    packed and checkpoint-layout GEMM (its autotune configs, in the pruner) and tensor-core GEMV, and the router.
    The MoE prefill expert kernels put their decoded tile in the dot's second operand instead, which wgmma reads
    from shared memory. Attention and the Gated DeltaNet kernels keep their stages: their loops rescale or consume
    the accumulator every step (docs/history/compiler-fault.md says what is and is not known). ``requested``: the
    caller asked for ``stages`` (a ``config=`` override); overriding it then warns, so a sweep does not time one
    stage under another's name."""
    if not register_dot_hazard_here() or stages <= 1:
        return stages
    if requested:
        warnings.warn(f"num_stages={stages} requested, compiled with 1: this Triton on Hopper pipelines a register-"
                      f"operand tl.dot unsafely (lynn_kernels.runtime.register_dot_hazard)", RuntimeWarning,
                      stacklevel=3)
    return 1


_pdl: contextvars.ContextVar[bool] = contextvars.ContextVar("lynn_pdl", default=False)


@functools.lru_cache(maxsize=None)
def pdl_supported() -> bool:
    """Programmatic dependent launch is available: compiled Triton on a GPU of capability 9.0 or newer (Hopper).
    Asked on first use, not at import (reading the capability initialises CUDA)."""
    return not INTERPRET and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@contextlib.contextmanager
def programmatic_launches(enabled: bool = True):
    """Launch the decode-path kernels with programmatic dependent launch inside the block (a no-op where
    :func:`pdl_supported` is false). Each such kernel starts before the kernel ahead of it on the stream has
    finished, waits in ``gdc_wait`` before it touches memory anything before it may write, and lets the kernel
    behind it start early in turn (:func:`pdl_enter`). What loads before the wait: weights (the packed GEMV's first
    step, the router's first chunk); where the kernel ahead releases its dependents only after its own wait (so
    everything before *it* has finished), what those earlier kernels wrote: the packed MoE down kernel's routing
    (gate_up ahead of it), the fused Gated DeltaNet step's own states (its layer's projection ahead of it). The results
    are the same bits; what changes is the gap between kernels (about 0.4 us of 1.1 a boundary on the H200,
    docs/history/decode.md). Launches made by anything else (torch, cuBLAS) keep their full ordering. ``enabled=False``
    undoes an outer one. :class:`lynn_model.graphs.DecodeStep` captures its step inside it."""
    token = _pdl.set(bool(enabled) and pdl_supported())
    try:
        yield
    finally:
        _pdl.reset(token)


def pdl() -> bool:
    """Whether a launch made now uses programmatic dependent launch (inside :func:`programmatic_launches`)."""
    return _pdl.get()


_PDL_ON = {"USE_PDL": True, "launch_pdl": True}
_PDL_OFF = {"USE_PDL": False}


def pdl_flags() -> dict:
    """The ``USE_PDL`` constexpr and the launch option of a decode-path kernel launched now (:func:`pdl`): pass
    as ``**runtime.pdl_flags()`` to a kernel whose first statement is :func:`pdl_enter`."""
    return _PDL_ON if _pdl.get() else _PDL_OFF


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """The first statement of a decode-path kernel: with ``USE_PDL``, let the next kernel launch now (its programs
    wait in their own ``gdc_wait``), then wait until the kernels before this one have finished and their writes are
    visible. Nothing before it may read what an earlier kernel writes or write anything."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


#: Launch the decode kernels through their compiled launcher (:class:`DirectLaunch`); ``LYNN_DIRECT_LAUNCH=0``
#: sends every launch through Triton's own ``kernel[grid](...)`` path.
DIRECT_LAUNCH = os.environ.get("LYNN_DIRECT_LAUNCH", "1") != "0"


class DirectLaunch:
    """A ``@triton.jit`` kernel launched straight through its compiled launcher on repeat calls.

    ``kernel[grid](...)`` binds and specialises every argument on every call (tens of microseconds on a slow host,
    more than a decode GEMV takes on the GPU). A :class:`DirectLaunch` makes the first call with a given ``key``
    through that path, keeps the compiled kernel it returns, and from then on calls the kernel's launcher with the
    arguments as they are. ``key`` is the caller's promise: it must change whenever anything Triton specialises on
    changes, i.e. the constexprs, the launch options, every integer argument's value and every pointer argument's
    dtype and alignment to 16 bytes (:meth:`key_of` builds the generic one); the current device is added to it
    here. Triton's process-wide options (``knobs.runtime.debug``, instrumentation) are not in it: changing them
    after a kept launch needs a new :class:`DirectLaunch`. What the direct path skips: Triton's
    launch hooks (profilers that register ``launch_enter_hook`` see only first calls) and its check that the
    kernel's global variables have not changed. Under the interpreter, or with ``DIRECT_LAUNCH`` off, every call is
    a plain ``kernel[grid](...)``.
    """

    __slots__ = ("fn", "compiled")

    def __init__(self, fn):
        self.fn = fn
        self.compiled: dict = {}

    @staticmethod
    def key_of(args) -> tuple:
        """The generic specialisation key of positional arguments: each tensor's dtype and 16-byte alignment, every
        other argument with its type (Triton compiles ``True``, ``1`` and ``1.0`` differently; Python hashes them
        alike) and value."""
        return tuple((a.dtype, a.data_ptr() & 15) if isinstance(a, torch.Tensor) else (type(a), a) for a in args)

    def __call__(self, grid: tuple, key, args: tuple, constexprs: dict, num_warps: int, num_stages: int,
                  launch_pdl: bool = False) -> None:
        direct = DIRECT_LAUNCH and not INTERPRET
        device = torch.cuda.current_device() if direct else None     # Triton launches on the current device
        key = (device, key)                                           # a kernel loaded on one GPU serves that one
        entry = self.compiled.get(key) if direct else None
        if entry is None:
            extra = {"launch_pdl": True} if launch_pdl else {}
            kernel = self.fn[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages, **extra)
            if direct and kernel is not None:
                names = self.fn.arg_names[len(args):]
                missing = [n for n in names if n not in constexprs]
                if missing:
                    raise TypeError(f"{self.fn.__name__}: DirectLaunch needs every argument after the positional "
                                    f"ones by name; missing {missing}")
                self.compiled[key] = (kernel.run, kernel.function, kernel.packed_metadata,
                                      tuple(constexprs[n] for n in names))
            return
        run, function, metadata, tail = entry
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        run(grid[0], g1, g2, torch._C._cuda_getCurrentRawStream(device), function, metadata, None, None, None, *args,
            *tail)


def cdiv(a: int, b: int) -> int:
    """Ceil division for host code. ``triton.cdiv`` is a constexpr function (triton 3.8): about 6 us per call from
    Python, several times per launch, on the hot path of a decode step."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for 0, as ``triton.next_power_of_2``), for host code (see :func:`cdiv`)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def size_bucket(n: int) -> int:
    """An autotuner key for a size that sets a kernel's grid (the longest query run, the programs of a chunked
    scan): powers of 4 (1-2, 3-8, ..., 513-2,048, 2,049-8,192, then 8,193 and up). Without one a process keeps the
    config it timed at the first size it met: a short prompt's tiling for a 16,384-token prefill."""
    return min(max(n - 1, 1).bit_length() // 2, 7)


def kernel_flags() -> dict:
    """Constexpr flags every kernel launch passes: ``INTERPRET`` selects the interpreter-safe code paths."""
    return {"INTERPRET": INTERPRET}


def check_device(name: str, t: torch.Tensor) -> None:
    """Raise a clear error when ``t`` is not on the device the kernels run on."""
    if t.device.type != DEVICE.type:
        where = "a CUDA GPU (compiled Triton)" if DEVICE.type == "cuda" else "the CPU (Triton interpreter)"
        raise ValueError(f"{name} is on {t.device}, but kernels run on {where}: move it with .to({DEVICE.type!r}) "
                         f"or use the reference backend (lynn_kernels.use_reference())")


def device_summary() -> dict:
    """What this process runs on, for tables, notebooks and benchmark provenance."""
    info = {
        "backend": backend(),
        "device": "cpu (Triton interpreter)" if INTERPRET else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    if not INTERPRET:
        props = torch.cuda.get_device_properties(0)
        info["capability"] = f"sm_{props.major}{props.minor}"
        info["sms"] = props.multi_processor_count
        info["memory_gib"] = round(props.total_memory / 2**30, 1)
    return info


# ---------------------------------------------------------------------------------------------------------------
# Rounding helpers shared by kernels. The interpreter truncates fp32 -> bf16 and drops the carry in fp32 -> fp8,
# so where bits matter the kernels round with integer arithmetic (exact on both backends).


@triton.jit
def round_to_bf16(x, INTERPRET: tl.constexpr):
    """Round fp32 ``x`` to the nearest bf16 (ties to even), returned as fp32 holding a bf16 value. No NaN input."""
    if INTERPRET:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def round_to_dtype(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 ``x`` rounded to ``DTYPE`` (bf16 / fp16, nearest even; fp32 unchanged) and held as fp32."""
    if DTYPE == tl.bfloat16:
        return round_to_bf16(x, INTERPRET)
    elif DTYPE == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def min_nan_to_bound(x, bound, INTERPRET: tl.constexpr):
    """``min(x, bound)`` with NaN mapped to ``bound``: one ``fminf`` on the GPU; the interpreter's numpy minimum
    propagates NaN, so it compares instead."""
    if INTERPRET:
        return tl.where(x < bound, x, bound)
    else:
        return tl.minimum(x, bound)


@triton.jit
def div_rn_by(x, d, r, INTERPRET: tl.constexpr):
    """Correctly rounded ``x / d`` given ``r = RN(1 / d)`` (a per-block reciprocal, computed with ``tl.div_rn``).

    On the GPU: Markstein's correction, ``q0 = x r``, ``e = fma(-q0, d, x)`` (exact), ``q = fma(e, r, q0)``: three
    instructions instead of a full IEEE division. The interpreter has no fused multiply-add, so it divides (numpy's
    fp32 division is already correctly rounded).
    """
    if INTERPRET:
        return x / d
    else:
        q0 = x * r
        return tl.fma(tl.fma(-q0, d, x), r, q0)


def kernel_view(t: torch.Tensor) -> torch.Tensor:
    """What to pass a kernel for ``t``: bf16 travels as its int16 bits under the interpreter, whose bf16 <-> fp32
    conversions truncate and mangle subnormals; kernels convert with :func:`to_float32` / :func:`cast_output`."""
    return t.view(torch.int16) if INTERPRET and t.dtype == torch.bfloat16 else t


@triton.jit
def to_float32(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """A loaded ``DTYPE`` value (raw int16 bits for bf16 under the interpreter, see :func:`kernel_view`) -> fp32."""
    if INTERPRET:
        if DTYPE == tl.bfloat16:
            return (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            return x.to(tl.float32)
    else:
        return x.to(tl.float32)


@triton.jit
def cast_output(x, OUT_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 -> ``OUT_DTYPE``, round to nearest even on every backend (bf16 as int16 bits under the interpreter)."""
    if OUT_DTYPE == tl.bfloat16:
        if INTERPRET:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            return bits.to(tl.uint16).to(tl.int16, bitcast=True)
        else:
            return x.to(tl.bfloat16)
    else:
        return x.to(OUT_DTYPE)


TORCH_TO_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
