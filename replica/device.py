"""What differs between CUDA and CPU: which device a thread works on, pinned memory,
host->device copies, streams and events, synchronization.

Everything above this module is the same code on both. Every CUDA call names its device
(streams, events, the current stream it records on); a thread that does device work
starts with use_device(), because Triton launches, graph capture and torch's
allocator statistics go to the thread's current device, which is GPU 0 unless set.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

import torch


def resolve_device(name: str) -> torch.device:
    """The device `name` means, with its index: 'auto' is CUDA when present, else CPU;
    'cuda' the current CUDA device. A CUDA index this process cannot see is refused
    (under Ray, an actor sees only the GPUs it was given: each is its cuda:0)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count()
    if device.index is None and count:
        device = torch.device("cuda", torch.cuda.current_device())
    if not count or device.index >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ValueError(
            f"device {name!r}: this process sees {count} CUDA device(s)"
            + ("" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})")
        )
    return device


def rank_device(name: str) -> torch.device:
    """The device of a tensor-parallel rank actor configured with device `name`: the first
    of its kind that Ray made visible to the actor (its own GPU, whatever index `name`
    gives rank 0)."""
    kind = "auto" if name == "auto" else torch.device(name).type
    return resolve_device(kind if kind != "cuda" else "cuda:0")


def use_device(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (nothing on CPU). Each thread
    has its own, GPU 0 until set: call it first in every thread that does device work."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def device_uuid(device: torch.device) -> str | None:
    """The GPU's UUID ('GPU-...', as nvidia-smi -L prints it): one per physical device,
    whatever index a process sees it at. None for a CPU."""
    if device.type != "cuda":
        return None
    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


def other_visible_gpus(device: torch.device) -> list[str]:
    """Every GPU this process sees but `device`, as CUDA_VISIBLE_DEVICES names them: what
    a Ray started from here may hand to actors while this process computes on `device`
    outside Ray's accounting."""
    count = torch.cuda.device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [str(i) for i in range(count)] if listed is None else listed.split(",")[:count]
    return [i.strip() for k, i in enumerate(ids) if k != device.index]


def pinned(t: torch.Tensor) -> torch.Tensor:
    """Page-locked host copy when CUDA exists (so non_blocking copies are truly async)."""
    return t.pin_memory() if pinning() else t


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor -> device without waiting; a no-op on CPU."""
    if host.device == device:
        return host
    return pinned(host).to(device, non_blocking=True)


# Fields packed into one buffer start 16 bytes apart: any dtype's view is valid, and a
# Triton kernel reading one sees the same pointer alignment whatever the step's sizes
# (a new alignment would compile another specialisation of the kernel mid-serving).
PACK_ALIGN = 16


def packed_offsets(sizes: dict[str, int]) -> tuple[dict[str, int], int]:
    """Each field's byte offset in a packed buffer (PACK_ALIGN-aligned), and its length."""
    offsets, end = {}, 0
    for name, size in sizes.items():
        end = -(-end // PACK_ALIGN) * PACK_ALIGN
        offsets[name] = end
        end += size
    return offsets, end


def to_device_packed(
    host: dict[str, torch.Tensor], device: torch.device
) -> dict[str, torch.Tensor]:
    """Host tensors -> device tensors through one copy: packed (PACK_ALIGN-aligned) into
    one pinned buffer, copied without blocking, returned as typed views. CPU: the host
    ones."""
    if device.type == "cpu":
        return host
    offsets, end = packed_offsets({n: t.numel() * t.element_size() for n, t in host.items()})
    packed = torch.empty(max(end, 1), dtype=torch.uint8, pin_memory=pinning())
    for name, t in host.items():
        size = t.numel() * t.element_size()
        packed[offsets[name] : offsets[name] + size].view(t.dtype).copy_(t.reshape(-1))
    on_device = packed.to(device, non_blocking=True)
    return {
        name: on_device[offsets[name] : offsets[name] + t.numel() * t.element_size()]
        .view(t.dtype)
        .view(t.shape)
        for name, t in host.items()
    }


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


# Pinned host memory. torch's caching host allocator rounds each pinned block up to a
# power of two and keeps a freed block for the next request of that size. Adapters are
# staged in chunks of one power-of-two size, so nothing is rounded and every freed chunk
# is reused; a tensor larger than a chunk gets a block of its own, counted rounded.
PINNED_CHUNK_BYTES = 4 << 20
_ALIGN = 64  # bytes: every tensor in a chunk starts on a cache line


def pinning() -> bool:
    """Whether host memory for copies to a device is page-locked (CUDA exists)."""
    return torch.cuda.is_available()


def host_buffer(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 host buffer, page-locked when pinning()."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinning())


def host_block_bytes(nbytes: int) -> int:
    """The memory host_buffer(nbytes) holds: with pinning, the allocator's power of two."""
    return 1 << (nbytes - 1).bit_length() if pinning() and nbytes > 1 else nbytes


class HostPacking:
    """Where copies of some host tensors go in page-locked memory: packed, largest first,
    into the first chunk of PINNED_CHUNK_BYTES with room, or a buffer of their own when
    larger than a chunk. `nbytes` is the host memory the copies hold (decided before any
    is allocated, so a cache can make room first). Without pinning nothing is copied and
    `nbytes` is the tensors' own bytes."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._pin = pinning()
        self._buffers: list[int] = []  # bytes of each buffer: chunks and own buffers
        self._places: list[tuple[int, int]] = [(0, 0)] * len(tensors)  # (buffer, offset)
        if not self._pin:
            self.nbytes = sum(t.nbytes for t in tensors)
            return
        used: dict[int, int] = {}  # chunk buffer -> bytes taken
        for i in sorted(range(len(tensors)), key=lambda i: -tensors[i].nbytes):
            size = -(-tensors[i].nbytes // _ALIGN) * _ALIGN
            if size > PINNED_CHUNK_BYTES:
                self._places[i] = (len(self._buffers), 0)
                self._buffers.append(size)
                continue
            chunk = next((c for c, u in used.items() if u + size <= PINNED_CHUNK_BYTES), None)
            if chunk is None:
                chunk = len(self._buffers)
                self._buffers.append(PINNED_CHUNK_BYTES)
                used[chunk] = 0
            self._places[i] = (chunk, used[chunk])
            used[chunk] += size
        self.nbytes = sum(host_block_bytes(size) for size in self._buffers)

    def copy(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Contiguous page-locked copies of `tensors` (the ones this packing was made for),
        in their order; the tensors themselves without pinning."""
        if not self._pin:
            return list(tensors)
        buffers = [host_buffer(size) for size in self._buffers]
        copies = []
        for t, (b, offset) in zip(tensors, self._places):
            view = buffers[b][offset : offset + t.nbytes].view(t.dtype).view(t.shape)
            copies.append(view.copy_(t))
        return copies


class StepProgress:
    """How far the running step's forward has got, for a load into a slot that step still
    reads (its sequences all end with this step): the load writes layer i only once the
    forward is past layer i. On CUDA each layer's end is an event on the compute stream
    that the loading stream waits on; on CPU the forward runs in the caller, so reaching
    the layer is enough. A step replayed as one CUDA graph reports step_done() instead:
    one event behind the whole step releases every layer. finish() releases every
    waiter, also when the forward failed. Under tensor parallelism begin() gives the
    step's number, which the other ranks' loads wait behind (StepClock)."""

    def __init__(self, device: torch.device, timeout_s: float = 60.0) -> None:
        self._device = device
        self._cuda = device.type == "cuda"
        self._cond = threading.Condition()
        self._done = -1  # last layer the forward has finished
        self._finished = False
        self._events: dict[int, torch.cuda.Event] = {}
        self._whole: torch.cuda.Event | None = None  # behind the whole step (step_done)
        self._step: int | None = None
        self._timeout_s = timeout_s

    def begin(self, step: int) -> None:
        """The executor issues the step now, numbered `step` on every rank."""
        with self._cond:
            self._step = step
            self._cond.notify_all()

    def step_number(self) -> int:
        """The step's number, once begin() has given it (blocks until then)."""
        with self._cond:
            self._cond.wait_for(lambda: self._step is not None or self._finished, self._timeout_s)
            if self._step is not None:
                return self._step
            if self._finished:
                raise RuntimeError("the step ended before it began")
            raise TimeoutError(f"the step did not begin within {self._timeout_s:.0f}s")

    def layer_done(self, layer: int) -> None:
        """Called by the forward after layer `layer` (on the compute thread)."""
        event = _recorded(self._device)
        with self._cond:
            if event is not None:
                self._events[layer] = event
            self._done = layer
            self._cond.notify_all()

    def step_done(self) -> None:
        """Called once the whole step is issued at once (a CUDA graph replay): past every
        layer, behind one event."""
        event = _recorded(self._device)
        with self._cond:
            self._whole = event
            self._done = sys.maxsize
            self._cond.notify_all()

    def finish(self) -> None:
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    def wait_layer(self, layer: int) -> None:
        """Block the loading thread until the forward is past `layer`; on CUDA also order
        the current (loading) stream after that layer's kernels."""
        with self._cond:
            if not self._cond.wait_for(
                lambda: self._done >= layer or self._finished, self._timeout_s
            ):
                raise TimeoutError(f"the step never finished layer {layer}")
            event = self._events.get(layer, self._whole)
        _wait_behind(self._device, event)


class StepClock:
    """The steps one rank has issued, for copies that must run behind one of them: a
    tensor-parallel rank's share of a slot handed over during step n waits for its own
    step n. On CUDA the copying stream then waits on an event recorded behind that step
    (the last `keep` steps keep theirs; an older step waits for everything issued); on
    CPU the step has run once it is issued."""

    def __init__(self, device: torch.device, keep: int = 16) -> None:
        self._device = device
        self._cond = threading.Condition()
        self._issued = -1
        self._events: dict[int, torch.cuda.Event] = {}
        self._keep = keep

    def issued(self, step: int) -> None:
        """Called by the step loop once step `step` is issued."""
        event = _recorded(self._device)
        with self._cond:
            self._issued = step
            if event is not None:
                self._events[step] = event
                self._events.pop(step - self._keep, None)
            self._cond.notify_all()

    def wait(self, step: int, timeout_s: float) -> None:
        """Block until step `step` is issued; on CUDA order the current stream after it."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._issued >= step, timeout_s):
                raise TimeoutError(f"step {step} was not issued within {timeout_s:.0f}s")
            event = self._events.get(step)
        _wait_behind(self._device, event)


def _recorded(device: torch.device) -> torch.cuda.Event | None:
    """An event recorded now on the device's current stream (None on CPU)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _wait_behind(device: torch.device, event: torch.cuda.Event | None) -> None:
    """Order the device's current stream after `event`; without one (the work stopped
    early, or its event is gone), after everything the default stream has issued."""
    if device.type != "cuda":
        return
    stream = torch.cuda.current_stream(device)
    if event is not None:
        stream.wait_event(event)
    else:
        stream.wait_stream(torch.cuda.default_stream(device))


_YIELD_S = 1e-4


class SideStreamLoader:
    """Runs copy jobs on one worker thread; on CUDA inside a side stream, then records an event.

    The job's copies overlap the main stream's compute; readiness is polled with
    LoadHandle.done(), never waited on by the step loop."""

    def __init__(self, device: torch.device) -> None:
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix="lora-load", initializer=use_device, initargs=(device,)
        )
        self._stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        # Start the worker now: started by the first submit, it would begin that job while
        # the step loop waits for the GIL inside submit (docs/performance.md, "Figures
        # behind code choices").
        self._pool.submit(lambda: None).result()

    def submit(self, job: Callable[[], None]) -> LoadHandle:
        return LoadHandle(self._pool.submit(self._run, job))

    def _run(self, job: Callable[[], None]):
        # Yield the GIL before each job: a step loop idle in wait_any() that the previous
        # job's end woke up would otherwise wait for this job's whole Python loop.
        time.sleep(_YIELD_S)
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


class StagedBuffer:
    """Persistent device tensors with pinned host mirrors, packed in one buffer: fill the
    `host` fields, then `upload()` issues one non_blocking copy of the whole buffer. The
    `device` fields keep their addresses for the buffer's life (CUDA graphs read them).
    On CPU host and device are one tensor and upload() does nothing.

    The host mirror is not refilled while a previous upload may still read it: the event
    recorded after each copy is waited on first (long passed in a step loop that reads
    the sampled tokens every step)."""

    def __init__(
        self, layout: dict[str, tuple[torch.dtype, tuple[int, ...]]], device: torch.device
    ) -> None:
        """`layout`: name -> (dtype, shape) of each field, packed in this order."""
        sizes = {
            name: math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            for name, (dtype, shape) in layout.items()
        }
        offsets, end = packed_offsets(sizes)
        self.offsets = offsets  # each field's first byte in the buffer
        self._device = device
        self._device_bytes = torch.zeros(max(end, 1), dtype=torch.uint8, device=device)
        cpu = device.type == "cpu"
        self._host_bytes = self._device_bytes if cpu else pinned(self._device_bytes.cpu())
        self._copied: torch.cuda.Event | None = None

        def views(raw: torch.Tensor) -> dict[str, torch.Tensor]:
            out = {}
            for name, (dtype, shape) in layout.items():
                size = sizes[name]
                out[name] = raw[offsets[name] : offsets[name] + size].view(dtype).view(shape)
            return out

        self.device, self.host = views(self._device_bytes), views(self._host_bytes)

    def writable(self) -> dict[str, torch.Tensor]:
        """The host fields, once no upload still reads them."""
        if self._copied is not None:
            if not self._copied.query():  # query() never synchronizes; done in steady state
                self._copied.synchronize()
            self._copied = None
        return self.host

    def upload(self, nbytes: int | None = None) -> None:
        """One copy of every field to the device (of the buffer's first `nbytes` only,
        when given), without blocking the host."""
        if self._host_bytes is self._device_bytes:
            return
        part = slice(0, self._device_bytes.numel() if nbytes is None else nbytes)
        self._device_bytes[part].copy_(self._host_bytes[part], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self._device))
