"""A recording stand-in for torch.cuda, for testing on CPU which device CUDA work lands on.

It keeps what the driver keeps: a current device per thread (0 until set), a current
stream per thread and device, events recorded on streams. `torch.cuda.stream(s)` makes
s's device current while it lasts, as torch's does. Every stream created, event recorded
and launch() made is logged with the device it landed on.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


def _index(device) -> int:
    if isinstance(device, int):
        return device
    return torch.device(device).index or 0


@dataclass(eq=False)
class FakeStream:
    index: int  # the device it belongs to
    waits: list = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.index)

    def wait_event(self, event: FakeEvent) -> None:
        self.waits.append(event)

    def wait_stream(self, stream: FakeStream) -> None:
        self.waits.append(stream)


class FakeCUDA:
    def __init__(self, count: int) -> None:
        self.count = count
        self._local = threading.local()
        self._default = {i: FakeStream(i) for i in range(count)}
        self.streams: list[int] = []  # device of each stream created
        self.recorded: list[int] = []  # device of the stream each event was recorded on
        self.launches: list[int] = []  # current device at each launch()

    # -- what tests call --------------------------------------------------------------------

    def launch(self) -> None:
        """A kernel launch (Triton's, a graph capture's): it goes to the current device."""
        self.launches.append(self.current_device())

    # -- torch.cuda's functions -------------------------------------------------------------

    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    def set_device(self, device) -> None:
        index = _index(device)
        assert 0 <= index < self.count, f"no device {index}"
        self._local.device = index

    def current_stream(self, device=None) -> FakeStream:
        index = self.current_device() if device is None else _index(device)
        current = getattr(self._local, "streams", {})
        return current.get(index, self._default[index])

    def default_stream(self, device=None) -> FakeStream:
        return self._default[self.current_device() if device is None else _index(device)]

    def make_stream(self, device=None, priority: int = 0) -> FakeStream:
        index = self.current_device() if device is None else _index(device)
        self.streams.append(index)
        return FakeStream(index)

    @contextmanager
    def stream(self, stream: FakeStream):
        device, streams = self.current_device(), dict(getattr(self._local, "streams", {}))
        self.set_device(stream.index)
        self._local.streams = {**streams, stream.index: stream}
        try:
            yield
        finally:
            self._local.streams = streams
            self.set_device(device)

    def make_event(self, *args, **kwargs) -> FakeEvent:
        return FakeEvent(self)

    def properties(self, device):
        return _Properties(f"uuid-{_index(device)}")


@dataclass
class _Properties:
    uuid: str


class FakeEvent:
    def __init__(self, cuda: FakeCUDA) -> None:
        self._cuda, self.device = cuda, None

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self._cuda.current_stream()
        self.device = stream.index
        self._cuda.recorded.append(stream.index)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def install(monkeypatch, count: int = 2) -> FakeCUDA:
    """torch.cuda replaced by a FakeCUDA of `count` devices, until the test ends."""
    cuda = FakeCUDA(count)
    for name, value in {
        "is_available": lambda: True,
        "device_count": lambda: cuda.count,
        "current_device": cuda.current_device,
        "set_device": cuda.set_device,
        "current_stream": cuda.current_stream,
        "default_stream": cuda.default_stream,
        "Stream": cuda.make_stream,
        "stream": cuda.stream,
        "Event": cuda.make_event,
        "get_device_properties": cuda.properties,
        "synchronize": lambda device=None: None,
    }.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return cuda
