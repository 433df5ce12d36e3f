"""Recording Triton launches: which kernel, with which arguments, under which compile key.

A launch compiles a new binary when its key is new: the constexpr values, the launch
options (num_warps, ...) and, per other argument, Triton's own specialisation (dtype; an
int's value 1 or divisibility by 16, a pointer's 16-byte alignment, unless the kernel
opts out). The key is computed here with triton's `native_specialize_impl`, the function
its launcher calls, so it holds in the interpreter (CPU tests) exactly as compiled.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend


@dataclass
class Launch:
    kernel: str
    key: tuple
    args: dict[str, Any] = field(repr=False)


def launch_key(kernel: Any, args: tuple, kwargs: dict) -> tuple:
    """The compile key of one launch of `kernel` (a JITFunction or InterpretedFunction)."""
    sig = inspect.signature(kernel.fn)
    bound = sig.bind(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
    opts = getattr(kernel, "kwargs", None) or {}
    plain = set(getattr(kernel, "do_not_specialize", None) or opts.get("do_not_specialize") or ())
    unaligned = set(
        getattr(kernel, "do_not_specialize_on_alignment", None)
        or opts.get("do_not_specialize_on_alignment")
        or ()
    )
    key = []
    for name, param in sig.parameters.items():
        value = bound.arguments.get(name, param.default)
        if "constexpr" in str(param.annotation):
            key.append((name, "constexpr", value))
        else:
            spec = native_specialize_impl(
                BaseBackend, value, False, name not in plain, name not in unaligned
            )
            key.append((name, *spec))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in sig.parameters))
    return (*key, options)


@contextlib.contextmanager
def recorded_launches(
    monkeypatch: pytest.MonkeyPatch, *kernels: Any, execute: bool = True
) -> Iterator[list[Launch]]:
    """Every launch of `kernels` inside the block, in order; with execute=False the
    launches are only recorded (their outputs hold whatever they held: for tests of
    which launches a workload makes, whose sizes never depend on values)."""
    launches: list[Launch] = []
    with monkeypatch.context() as patch:
        for kernel in kernels:

            def run(*args, _kernel=kernel, _run=kernel.run, **kwargs):
                bound = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
                sig = inspect.signature(_kernel.fn)
                named = sig.bind_partial(
                    *args, **{k: v for k, v in bound.items() if k in sig.parameters}
                )
                key = launch_key(_kernel, args, bound)
                launches.append(Launch(_kernel.fn.__name__, key, dict(named.arguments)))
                return _run(*args, **kwargs) if execute else None

            patch.setattr(kernel, "run", run)
        yield launches
