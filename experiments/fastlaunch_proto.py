"""A prototype, measured and rejected (docs/history/prefill.md, "The prefill's host time"): kernel launches with
Triton's per-call bookkeeping done once per specialisation. Not part of the package; ``experiments/launch_cost.py``
installs it to time it against Triton's own path.

``kernel[grid](...)`` on a compiled Triton (3.6 on the H200's host) spent 35-130 us of host time a call before the
GPU sees anything (``experiments/prefill_host.py``, docs/history/prefill.md): it reads its knobs from the environment,
binds and specialises every argument, builds a string key for its kernel cache, checks the globals the kernel used,
and builds launch metadata for profiler hooks. A decode step replayed from a CUDA graph never pays this, but an
eager prefill launches ~800 kernels, and at 2,048 tokens the host took longer than the GPU.

:func:`install` gives each of our ``@triton.jit`` kernels (and ``@autotune`` wrappers) a ``run`` that remembers,
per *specialisation key*, the compiled kernel Triton chose, and then launches it directly through the compiled
kernel's launcher with the same arguments in the same order. The key is at least as fine as Triton's own:

* a constexpr parameter: its value;
* a tensor: its dtype and whether its address is a multiple of 16 (Triton's alignment specialisation);
* an int: whether it is 1, whether it is a multiple of 16, and whether it fits 32 bits (Triton's three);
* a float, a bool, None: the kind alone (Triton compiles them as fp32, i1, a constexpr None);
* the launch options (``num_warps``, ``num_stages``, ``launch_pdl``, ...): their values, and the device.

Anything else (an argument of another type, a launch-enter hook installed by a profiler) takes Triton's own path,
which also compiles on a miss. An autotuned kernel's fast path reuses the autotuner's chosen config for the same key
the autotuner forms (its key arguments' values and every tensor's dtype); a config with a pre-hook takes the
autotuner's own path. Under the interpreter nothing is installed. :func:`enabled` switches the fast path off for
a block (tests compare the two, bit for bit).
"""

from __future__ import annotations

import contextlib
import inspect
import sys

import torch
import triton

from lynn_kernels.runtime import INTERPRET

_on = [True]


@contextlib.contextmanager
def enabled(on: bool = True):
    """Use the fast path (``on``) or Triton's own launch path for every launch inside the block."""
    old, _on[0] = _on[0], bool(on)
    try:
        yield
    finally:
        _on[0] = old


def _driver():
    from triton.runtime import driver
    return driver.active


def _hook_set(hook) -> bool:
    """A launch hook that would be called: Triton 3.6 keeps an empty ``HookChain`` there by default."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True


def _launch_hooks_set() -> bool:
    knobs = getattr(triton, "knobs", None)
    rt = getattr(knobs, "runtime", None)
    return rt is not None and (_hook_set(getattr(rt, "launch_enter_hook", None))
                               or _hook_set(getattr(rt, "launch_exit_hook", None)))


_I32 = 2 ** 31


class _FastRun:
    """The replacement ``run`` of one ``JITFunction`` (see the module docstring)."""

    def __init__(self, fn):
        self.fn = fn
        self.orig = type(fn).run.__get__(fn)           # Triton's own bound method
        params = fn.params
        self.names = tuple(p.name for p in params)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.constexpr = tuple(bool(p.is_constexpr) for p in params)
        self.defaults = tuple(p.default for p in params)
        self.cache: dict = {}
        self.hooks_checked = False
        d = _driver()
        self.get_device, self.get_stream = d.get_current_device, d.get_current_stream
        self.hits = 0
        self.misses = 0
        self.last = None

    def _key(self, vals, options):
        key = []
        for v, c in zip(vals, self.constexpr):
            if c:
                key.append(v)
            elif isinstance(v, torch.Tensor):
                key.append((v.dtype, v.data_ptr() & 15 == 0))
            elif isinstance(v, bool):
                key.append(bool)
            elif isinstance(v, int):
                key.append((v == 1, v & 15 == 0, -_I32 <= v < _I32))
            elif isinstance(v, float):
                key.append(float)
            elif v is None:
                key.append(None)
            else:
                return None                             # a type this path does not model: Triton's own
        key.append(options)
        return tuple(key)

    def __call__(self, *args, grid, warmup, **kwargs):
        if warmup or not _on[0] or _launch_hooks_set():
            return self.orig(*args, grid=grid, warmup=warmup, **kwargs)
        n = len(args)
        vals = list(args)
        options = []
        rest = dict(kwargs)
        for i in range(n, len(self.names)):
            name = self.names[i]
            if name in rest:
                vals.append(rest.pop(name))
            else:
                vals.append(self.defaults[i])
        for k in sorted(rest):                           # launch options; sorted: call sites may order them apart
            options.append((k, rest[k]))
        device = self.get_device()
        options.append(device)
        try:
            key = self._key(vals, tuple(options))
            hit = self.cache.get(key) if key is not None else None
        except TypeError:                                # an unhashable value: Triton's own path
            key = hit = None
        if hit is None:
            kernel = self.orig(*args, grid=grid, warmup=False, **kwargs)
            if key is not None and kernel is not None and all(v is not inspect.Parameter.empty for v in vals):
                self.cache[key] = kernel
            self.misses += 1
            return kernel
        self.hits += 1
        if callable(grid):
            grid = grid(dict(zip(self.names, vals)))
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = self.get_stream(device)
        hit.run(grid[0], g1, g2, stream, hit.function, hit.packed_metadata, None, None, None, *vals)
        self.last = (hit, (grid[0], g1, g2, stream), vals)
        return hit


class _FastAutotune:
    """The replacement ``run`` of one ``Autotuner``: its chosen config reused without its per-call bookkeeping."""

    def __init__(self, tuner):
        self.tuner = tuner
        self.orig = type(tuner).run.__get__(tuner)
        self.arg_names = tuple(tuner.arg_names)
        self.keys = tuple(tuner.keys)
        self.chosen: dict = {}

    def _key(self, args, kwargs):
        named = dict(zip(self.arg_names, args))
        named.update((k, v) for k, v in kwargs.items() if k in self.arg_names)
        key = [named[k] for k in self.keys if k in named]
        key.extend(str(v.dtype) for v in named.values() if hasattr(v, "dtype"))
        return tuple(key)

    def __call__(self, *args, **kwargs):
        if not _on[0] or len(self.tuner.configs) <= 1:
            return self.orig(*args, **kwargs)
        try:
            key = self._key(args, kwargs)
            hit = self.chosen.get(key)
        except TypeError:
            return self.orig(*args, **kwargs)
        if hit is None:
            ret = self.orig(*args, **kwargs)
            config = getattr(self.tuner, "best_config", None)
            if config is not None and getattr(config, "pre_hook", None) is None:
                self.chosen[key] = config.all_kwargs()
            return ret
        return self.tuner.fn.run(*args, **kwargs, **hit)


def install(modules=None) -> int:
    """Give every ``JITFunction`` and ``Autotuner`` defined in ``modules`` (default: every loaded ``lynn_kernels``
    module) the fast ``run``; returns how many were installed. Does nothing under the interpreter."""
    if INTERPRET:
        return 0
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction
    if modules is None:
        modules = [m for name, m in list(sys.modules.items()) if name.startswith("lynn_kernels") and m is not None]
    n = 0
    for mod in modules:
        for obj in list(vars(mod).values()):
            if isinstance(obj, Autotuner) and not isinstance(obj.__dict__.get("run"), _FastAutotune):
                obj.run = _FastAutotune(obj)
                n += 1
                inner = obj.fn
                if isinstance(inner, JITFunction) and not isinstance(inner.__dict__.get("run"), _FastRun):
                    inner.run = _FastRun(inner)
                    n += 1
            elif isinstance(obj, JITFunction) and not isinstance(obj.__dict__.get("run"), _FastRun):
                obj.run = _FastRun(obj)
                n += 1
    return n


def stats() -> dict:
    """``{kernel name: (fast launches, launches through Triton's path)}`` since the process started."""
    from triton.runtime.jit import JITFunction
    out = {}
    for name, m in list(sys.modules.items()):
        if not name.startswith("lynn_kernels") or m is None:
            continue
        for obj in vars(m).values():
            fn = getattr(obj, "fn", None) if not isinstance(obj, JITFunction) else obj
            fr = getattr(fn, "__dict__", {}).get("run") if fn is not None else None
            if isinstance(fr, _FastRun) and (fr.hits or fr.misses):
                out[fn.__name__] = (fr.hits, fr.misses)
    return out
