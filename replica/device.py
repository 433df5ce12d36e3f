"""What differs between CUDA and CPU: pinned memory, host->device copies, synchronization.

Everything above this module is the same code on both.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

import torch


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when present, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pinned(t: torch.Tensor) -> torch.Tensor:
    """Page-locked host copy when CUDA exists (so non_blocking copies are truly async)."""
    return t.pin_memory() if torch.cuda.is_available() else t


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor -> device without waiting; a no-op on CPU."""
    if host.device == device:
        return host
    return pinned(host).to(device, non_blocking=True)


def collective_backend(device: torch.device) -> str:
    """The torch.distributed backend for tensors on `device`."""
    return "nccl" if device.type == "cuda" else "gloo"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto': bfloat16 on CUDA, float32 on CPU (exact against the reference)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r}: expected one of auto, {', '.join(DTYPES)}") from None


class LoadHandle:
    """A load in flight; done() polls and never blocks (future done + event query)."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def done(self) -> bool:
        if not self._future.done():
            return False
        if self._future.exception() is not None:
            return True
        event = self._future.result()
        return event is None or event.query()

    def result(self) -> None:
        """Re-raise the load's exception, if any. Call only once done()."""
        self._future.result()

    def wait(self, timeout_s: float) -> None:
        """Block until the load's copies are complete on the device; re-raise its error."""
        event = self._future.result(timeout_s)
        if event is not None:
            event.synchronize()


def wait_any(handles: list[LoadHandle], timeout_s: float) -> None:
    """Block until one load's job has finished (or the timeout): only for a step loop
    with nothing else to run. A CUDA event still pending is caught by the next poll."""
    futures_wait([h._future for h in handles], timeout_s, return_when=FIRST_COMPLETED)


class SideStreamLoader:
    """Runs copy jobs on one worker thread; on CUDA inside a side stream, then records an event.

    The job's copies overlap the main stream's compute; readiness is polled with
    LoadHandle.done(), never waited on by the step loop."""

    def __init__(self, device: torch.device) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-load")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def submit(self, job: Callable[[], None]) -> LoadHandle:
        return LoadHandle(self._pool.submit(self._run, job))

    def _run(self, job: Callable[[], None]):
        if self._stream is None:
            job()
            return None
        with torch.cuda.stream(self._stream):
            job()
            event = torch.cuda.Event()
            event.record(self._stream)
        return event

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class InlineLoader:
    """The no-overlap ablation: the job runs in the caller, on the current stream, to the end."""

    def __init__(self, device: torch.device) -> None:
        self._device = device

    def submit(self, job: Callable[[], None]) -> LoadHandle:
        future: Future = Future()
        try:
            job()
            synchronize(self._device)
            future.set_result(None)
        except Exception as e:  # surfaced through LoadHandle.result()
            future.set_exception(e)
        return LoadHandle(future)

    def shutdown(self) -> None:
        pass
