"""Kernel launches with less host time than Triton's `kernel[grid](...)`: each distinct call's compiled kernel cached
by a key, and TMA descriptors with Triton's checks run once per block (docs/kernels.md, "Host time per launch").

An eager training step issues about ten launches per mHC sublayer, and an eager forward can be host-bound. Most of a
launch's host time is Triton's generic path run again on every call: binding the arguments and specialising each, a
cache key that formats the launch options as a string, environment reads, launch metadata and the (empty) launch
hooks. `Launcher` takes that path once per distinct call and keeps the compiled kernel; later calls with the same
key go straight to the compiled kernel's launcher.

The key is a superset of what Triton specialises on: every non-tensor argument by value (ints, floats, flags,
constexprs, launch options) and, per tensor, its dtype and whether its address is 16-byte aligned (Triton's
pointer specialisation), plus the current device. A new value of a runtime-only argument (the token count, the
Sinkhorn count) therefore misses here and takes Triton's path once, which finds its own compiled kernel (no
recompile) and hands it back to be kept under the new key.
"""
import dataclasses
import inspect
from typing import Optional

import torch

try:
    from triton import knobs
    from triton.runtime.jit import JITFunction
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - triton ships with torch's CUDA wheels and is a test dependency
    knobs, JITFunction, TensorDescriptor = None, (), ()

Tensor = torch.Tensor
MAX_KEYS = 256  # distinct calls kept per kernel (token counts, Sinkhorn counts); past it, the oldest half goes


class Launcher:
    """`launcher[grid](name=value, ...)`, as for the Triton kernel it wraps.

    The fused ops pass every argument by name, so that a launch reads without the kernel's definition beside it. The
    kernel's runtime arguments are put back in its order (`positional`), as the key and the compiled kernel's launcher
    take them; constexprs and launch options stay keywords. Every call takes Triton's own path under the interpreter
    and while a launch hook is installed (Triton's profiler).
    """

    misses = 0  # calls, over every Launcher, that took Triton's path for want of a kept key

    def __init__(self, fn):
        self.fn = fn
        self.fast = isinstance(fn, JITFunction)
        self.kept: dict[tuple, tuple] = {}
        py = getattr(fn, "fn", None)  # the Python function of a JITFunction or the interpreter's InterpretedFunction
        params = inspect.signature(py).parameters.values() if callable(py) else ()
        self.runtime = tuple(p.name for p in params if "constexpr" not in str(p.annotation))
        if self.fast:
            # a parameter's default, for the launcher's argument list (it takes every parameter, constexprs too)
            self.params = [(p.name, p.default) for p in fn.signature.parameters.values()]

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, *self.positional(args, kwargs))

    def positional(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """(runtime arguments in the kernel's order, the other keywords): those passed by name are taken out of
        kwargs (a dict of this call's own)."""
        rest = self.runtime[len(args):]
        if rest and rest[0] in kwargs:
            args = (*args, *map(kwargs.pop, rest))
        return args, kwargs

    def __repr__(self) -> str:
        return f"Launcher({getattr(self.fn, '__name__', self.fn)})"

    def launch(self, grid, args: tuple, kwargs: dict):
        if not self.fast or _hooked():
            return self.fn[grid](*args, **kwargs)
        device = torch.cuda.current_device()
        key = call_key(device, args, kwargs)
        kept = self.kept.get(key)
        if kept is None:
            return self._first(key, grid, args, kwargs)
        kernel, tail = kept
        g = grid if len(grid) == 3 else (*grid, 1, 1)
        kernel.run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(device), kernel.function,
                   kernel.packed_metadata, None, None, None, *args, *tail)
        return kernel

    def _first(self, key: tuple, grid, args: tuple, kwargs: dict):
        """Triton's own launch; its compiled kernel kept under key with the values of the parameters not passed
        positionally (constexprs and defaults: part of the key, so fixed for it)."""
        Launcher.misses += 1
        kernel = self.fn[grid](*args, **kwargs)
        if kernel is None or not hasattr(kernel, "packed_metadata"):  # compiled asynchronously or another Triton
            return kernel
        if any(isinstance(v, Tensor) for v in kwargs.values()):  # a tensor by keyword would be fixed in the tail
            return kernel
        tail = tuple(kwargs[name] if name in kwargs else default for name, default in self.params[len(args):])
        if len(self.kept) >= MAX_KEYS:
            for k in list(self.kept)[:MAX_KEYS // 2]:
                del self.kept[k]
        self.kept[key] = (kernel, tail)
        return kernel


LAUNCHERS: dict = {}  # each kernel's Launcher, by its Triton function


def launcher(kernel) -> Launcher:
    """The kernel's Launcher (one per kernel), through which the fused ops launch it: `launcher(kernel)[grid](...)`."""
    kept = LAUNCHERS.get(kernel)
    if kept is None:
        kept = LAUNCHERS[kernel] = Launcher(kernel)
    return kept


def call_key(device: int, args: tuple, kwargs: dict) -> tuple:
    """What a launch is kept under (module docstring): the device, keyword arguments by name and value, and the
    positional ones by value, tensors by dtype and 16-byte alignment, TMA descriptors by dtype and block (what Triton
    specialises them on; their shape and strides are runtime values, and the launcher encodes each call's
    descriptor)."""
    return (device, *kwargs.items(), *[_arg_key(a) for a in args])


def _arg_key(a):
    if isinstance(a, Tensor):
        return a.dtype, (a.data_ptr() & 15) == 0
    if isinstance(a, TensorDescriptor):
        return "desc", a.base.dtype, tuple(a.block_shape), a.padding
    return a


def _field_defaults(cls) -> Optional[dict]:
    """A plain (not frozen, no slots) dataclass's field defaults, else None."""
    if not dataclasses.is_dataclass(cls) or cls.__dataclass_params__.frozen or hasattr(cls, "__slots__"):
        return None
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


_DESC_DEFAULTS = _field_defaults(TensorDescriptor)
_checked_blocks: set = set()


def descriptor(base: Tensor, shape: list, strides: list, block: list):
    """`TensorDescriptor(base, shape, strides, block)`, with Triton's checks (`__post_init__`) run on the first
    descriptor of each block shape and dtype only: the caller vouches for the rest (`projection.rows_descriptor`
    checks the 16-byte alignment of base and row stride, the contiguous rows and a positive shape itself). Triton's
    checks are half a descriptor's host time, and the eager backward builds five per sublayer."""
    key = (tuple(block), base.dtype)
    if _DESC_DEFAULTS is None or key not in _checked_blocks:
        d = TensorDescriptor(base, shape, strides, block)
        _checked_blocks.add(key)
        return d
    d = object.__new__(TensorDescriptor)
    d.__dict__.update(_DESC_DEFAULTS, base=base, shape=shape, strides=strides, block_shape=block)
    return d


def _hooked() -> bool:
    """A launch hook is installed (Triton 3.6 keeps them as chains of callables; older ones as one or None)."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(getattr(h, "calls", h) for h in hooks)

