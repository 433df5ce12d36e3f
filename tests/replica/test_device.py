"""replica/device.py: the device a name means, the thread's current device, streams and
events on the device they are for, and pinned staging counted as the allocator holds it.
CUDA is a recording fake (tests/replica/fake_cuda.py): what is checked is which device
each call lands on, with the engine's device cuda:1 while threads start on device 0."""

from __future__ import annotations

import threading

import pytest
import torch

from replica import device as dev
from replica.device import (
    PINNED_CHUNK_BYTES,
    HostPacking,
    SideStreamLoader,
    StepProgress,
    device_uuid,
    other_visible_gpus,
    rank_device,
    resolve_device,
)

CUDA1 = torch.device("cuda", 1)


def test_a_cuda_name_resolves_to_an_index_this_process_sees(fake_cuda, monkeypatch):
    assert resolve_device("auto") == torch.device("cuda", 0)
    fake_cuda.set_device(1)
    assert resolve_device("cuda") == CUDA1  # 'cuda' is the current device, named
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    with pytest.raises(ValueError, match=r"'cuda:2': this process sees 2 .*'3,5'"):
        resolve_device("cuda:2")
    assert resolve_device("cpu") == torch.device("cpu")


def test_a_rank_actor_uses_the_one_gpu_ray_shows_it(fake_cuda):
    fake_cuda.count = 1  # Ray's CUDA_VISIBLE_DEVICES: the actor's own GPU only
    assert rank_device("cuda:1") == rank_device("auto") == torch.device("cuda", 0)
    assert rank_device("cpu") == torch.device("cpu")


def test_other_visible_gpus_leave_out_the_device_as_cuda_visible_devices_names_it(
    fake_cuda, monkeypatch
):
    fake_cuda.count = 4
    assert other_visible_gpus(CUDA1) == ["0", "2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 6,7,9,11")  # more listed than seen
    assert other_visible_gpus(torch.device("cuda", 0)) == ["6", "7", "9"]
    assert device_uuid(CUDA1) == "GPU-uuid-1" and device_uuid(torch.device("cpu")) is None


def test_the_loader_thread_works_on_the_engine_device(fake_cuda):
    """Its stream is made on cuda:1, its jobs run with cuda:1 current (also outside the
    stream), and the event that says a load is done is recorded on that stream."""
    seen = []

    def job():
        fake_cuda.launch()
        seen.append(torch.cuda.current_stream(CUDA1))

    loader = SideStreamLoader(CUDA1)
    try:
        loader.submit(job).wait(5.0)
        # what a loader thread does outside a job's stream: staging, pinning
        loader._pool.submit(fake_cuda.launch).result(5.0)
    finally:
        loader.shutdown()
    assert fake_cuda.streams == [1] and seen == [loader._stream]
    assert fake_cuda.launches == [1, 1] and fake_cuda.recorded == [1]


def test_step_progress_records_and_waits_on_its_device_from_any_thread(fake_cuda):
    progress = StepProgress(CUDA1)
    progress.layer_done(0)  # this thread's current device is 0
    assert fake_cuda.recorded == [1]
    side = torch.cuda.Stream(device=CUDA1)
    with torch.cuda.stream(side):
        fake_cuda.set_device(0)  # a thread whose current device moved: still device 1's
        progress.wait_layer(0)
        progress.finish()
        progress.wait_layer(5)  # past the forward's end: waits for all of device 1's work
    assert side.waits == [progress._events[0], torch.cuda.default_stream(CUDA1)]


def test_use_device_is_per_thread(fake_cuda):
    dev.use_device(CUDA1)
    other: list[int] = []
    thread = threading.Thread(target=lambda: other.append(torch.cuda.current_device()))
    thread.start()
    thread.join()
    assert torch.cuda.current_device() == 1 and other == [0]


# -- pinned staging ------------------------------------------------------------------------------


def test_packing_counts_chunks_and_rounded_own_buffers(monkeypatch):
    monkeypatch.setattr(dev, "pinning", lambda: True)
    allocated: list[int] = []
    monkeypatch.setattr(
        dev, "host_buffer", lambda n: allocated.append(n) or torch.empty(n, dtype=torch.uint8)
    )
    mib = 1 << 20
    sizes = [3 * mib, 2 * mib, mib, mib + 4, 5 * mib, 100]  # bytes of float32 tensors
    tensors = [torch.arange(n // 4 or 1, dtype=torch.float32) for n in sizes]
    packing = HostPacking(tensors)
    # largest first: 5 MiB alone (8 MiB block); 3 MiB + 1 MiB; 2 MiB + 1 MiB + 100 B; ...
    assert packing.nbytes == 8 * mib + 2 * PINNED_CHUNK_BYTES
    copies = packing.copy(tensors)
    assert sorted(allocated) == [PINNED_CHUNK_BYTES, PINNED_CHUNK_BYTES, 5 * mib]
    assert all(torch.equal(c, t) and c.is_contiguous() for c, t in zip(copies, tensors))


def test_without_pinning_nothing_is_copied():
    tensors = [torch.ones(3, 4), torch.zeros(5)]
    packing = HostPacking(tensors)
    assert packing.nbytes == 68 and all(a is b for a, b in zip(packing.copy(tensors), tensors))
