"""A variant: a stand-in for one op (a callable with its signature) or for one of its kernels (a ``@triton.jit``
function with the shipped kernel's parameters, launched by the shipped launcher), and :func:`using`, which routes
every call to it, the decoder's included."""

from __future__ import annotations

import ast
import collections
import contextlib
import hashlib
import inspect
from dataclasses import dataclass, field

from .. import runtime
from .ops import OPS, Op, find


def _is_kernel(fn) -> bool:
    """A ``@triton.jit`` function (compiled or interpreted) or an autotuner around one."""
    return hasattr(fn, "arg_names") and hasattr(fn, "__getitem__") or hasattr(fn, "fn") and hasattr(fn, "configs")


def _jit_of(fn):
    """The ``@triton.jit`` function inside an autotuner and / or ``triton.heuristics`` (or ``fn`` itself)."""
    while hasattr(fn, "fn") and (hasattr(fn, "configs") or hasattr(fn, "values")):
        fn = fn.fn
    return fn


def source_of(fn) -> str:
    """The variant's source text (a kernel's as written, a callable's from its file), or its repr when Python has
    none (a builtin)."""
    jit = _jit_of(fn)
    src = getattr(jit, "src", None)
    if isinstance(src, str):
        return src
    try:
        return inspect.getsource(getattr(jit, "fn", jit))
    except (OSError, TypeError):
        return repr(fn)


@dataclass
class Variant:
    """One stand-in: for the op ``op``, either a callable (``kernel is None``: every call of the op goes to ``fn``) or
    a kernel (``kernel``: the name of the shipped kernel ``fn`` replaces in the op's launchers)."""

    op: Op
    fn: object
    kernel: str | None = None
    name: str = ""
    _routed: object = field(default=None, repr=False)

    @property
    def source_hash(self) -> str:
        """sha256 of the variant's source, first 12 hex digits: what a saved race result records."""
        return hashlib.sha256(source_of(self.fn).encode()).hexdigest()[:12]

    @property
    def label(self) -> str:
        return self.name or getattr(_jit_of(self.fn), "__name__", None) or type(self.fn).__name__

    def __post_init__(self):
        if self.kernel is not None and self._routed is None:      # what the launcher runs: fn under the shipped
            self._routed = runtime.KERNELS[self.kernel].adapt(self.fn)   # kernel's autotuning and heuristics

    def routes(self) -> dict:
        """What :func:`lynn_kernels.runtime.routed` installs for this variant."""
        if self.kernel is None:
            return {self.op.fn: self.fn}
        return {self.kernel: self._routed}


def _shipped_kernel(name: str):
    known = runtime.KERNELS.get(name)
    if known is None:
        raise ValueError(f"no launcher runs a kernel called {name!r}; the kernels: "
                         f"{', '.join(sorted(runtime.KERNELS))}")
    return known.shipped


def _check_parameters(name: str, fn) -> None:
    """A kernel variant takes the shipped kernel's parameters by name and in order (the launcher passes some by
    position, some by name)."""
    shipped = _jit_of(_shipped_kernel(name)).arg_names
    got = list(_jit_of(fn).arg_names)
    if got != list(shipped):
        missing = [a for a in shipped if a not in got]
        extra = [a for a in got if a not in shipped]
        what = "; ".join(s for s in (f"missing {missing}" if missing else "", f"not in the shipped kernel {extra}"
                                     if extra else "", "" if missing or extra else "in another order") if s)
        raise TypeError(f"kernel variant {_jit_of(fn).__name__}: its parameters must be the shipped kernel "
                        f"{name!r}'s, in order ({', '.join(shipped)}); {what}")


def variant(op_or_fn, fn=None, *, kernel: str | None = None, name: str = "") -> Variant:
    """A :class:`Variant` of an op: ``variant("rmsnorm", my_rmsnorm)`` (a callable with the op's signature) or
    ``variant("rmsnorm", my_kernel)`` (a ``@triton.jit`` kernel with the shipped kernel's parameters, run by the
    op's own launcher; ``kernel=`` names which of the op's kernels it replaces when the op has several, the first
    of ``OPS[op].kernels`` by default). ``variant(v)`` of a :class:`Variant` returns it."""
    if isinstance(op_or_fn, Variant) and fn is None:
        return op_or_fn
    if fn is None:
        raise TypeError("variant(op, fn): name the op the variant stands in for, e.g. variant('rmsnorm', my_fn)")
    op = op_or_fn if isinstance(op_or_fn, Op) else find(str(op_or_fn))
    if _is_kernel(fn):
        kname = kernel or op.kernels[0]
        if kname not in op.kernels:
            raise ValueError(f"op {op.name} runs the kernels {', '.join(op.kernels)}; kernel={kname!r} is not one")
        _check_parameters(kname, fn)
        return Variant(op, fn, kname, name)
    if kernel is not None:
        raise TypeError(f"kernel={kernel!r} is for a @triton.jit variant; {fn!r} is a plain callable")
    if not callable(fn):
        raise TypeError(f"a variant is a callable or a @triton.jit kernel, got {type(fn).__name__}")
    return Variant(op, fn, None, name)


def edit(kernel: str, replace: dict[str, str], *, name: str | None = None, helpers: dict | None = None):
    """A new ``@triton.jit`` kernel: the shipped kernel ``kernel``'s source with each ``old`` of ``replace`` (text
    that must occur exactly once) replaced by its ``new``, defined beside the shipped one (its module's helpers in
    reach, and ``helpers``: more names the new text may use, such as your own ``@triton.jit`` functions; a name the
    module already has is refused) under ``name`` (default: the shipped name with ``_edited``). Its source is
    registered with ``linecache``, so Triton (and ``inspect``) read it as they read a file's."""
    import linecache
    import re

    import triton

    fn = getattr(_jit_of(_shipped_kernel(kernel)), "fn")
    lines = inspect.getsource(fn).splitlines()
    indent = len(lines[0]) - len(lines[0].lstrip())
    lines = [line[indent:] for line in lines]
    filename = f"<lynn lab edit of {kernel} #{len(_EDITS)}>"
    def_line = ast.parse("\n".join(lines), filename).body[0].lineno   # the decorators, over one line or several,
    head, src = "\n".join(lines[:def_line - 1]), "\n".join(lines[def_line - 1:]) + "\n"   # go: jit comes below
    for old, new in replace.items():
        count = src.count(old)
        if count != 1:
            where = (" (it is in the decorators, which the launcher's kernel object keeps: tiles and autotuning "
                     "are not the kernel's to edit)" if old in head else "")
            raise ValueError(f"edit({kernel!r}): {old!r} occurs {count} times in the shipped kernel's body{where}; "
                             f"give text that occurs exactly once")
        src = src.replace(old, new)
    new_name = name or f"{fn.__name__}_edited"
    src = re.sub(rf"\bdef {fn.__name__}\(", f"def {new_name}(", src, count=1)
    linecache.cache[filename] = (len(src), None, src.splitlines(keepends=True), filename)
    scope = dict(fn.__globals__)
    taken = sorted(set(helpers or {}) & set(scope))
    if taken:
        raise ValueError(f"edit({kernel!r}): helpers {taken} would hide names the kernel's module already has; "
                         f"give them other names")
    scope.update(helpers or {})
    exec(compile(src, filename, "exec"), scope)
    made = triton.jit(scope[new_name])
    _EDITS.append(made)
    return made


_EDITS: list = []          #: every edited kernel made, so their linecache entries have a reason to stay


def shipped(op: str | Op) -> Variant:
    """The shipped op as a variant (its own host function): what a race compares against."""
    o = op if isinstance(op, Op) else find(op)
    return Variant(o, o.fn.host, None, "shipped")


@contextlib.contextmanager
def using(*variants, count: bool = True):
    """Route every call of each variant's op (callables) or every launch of its kernel (kernel variants) to the
    variant inside the block, the decoder's calls included. Yields a ``Counter`` of how many times each routed op or
    kernel ran, keyed by the public op (callables) or the kernel's name (``count=False``: no counting)."""
    routes: dict = {}
    for v in variants:
        v = variant(v) if isinstance(v, Variant) else v
        if not isinstance(v, Variant):
            raise TypeError(f"using() takes variants (lynn_kernels.lab.variant(op, fn)), got {type(v).__name__}")
        routes.update(v.routes())
    hits: collections.Counter = collections.Counter()
    outer = runtime.route_counters()
    routes[runtime.HITS] = outer + (hits,) if count else outer     # an outer block counts what this one routes
    with runtime.routed(routes):
        yield hits


__all__ = ["Variant", "variant", "edit", "shipped", "using", "source_of", "OPS"]
