"""Device sync: the CPU no-op implementation and the CUDA streams/events."""

from __future__ import annotations

import pytest
import torch

from pipeline.device_sync import (
    CpuDeviceSync,
    CudaDeviceSync,
    DeviceEvent,
    DeviceSync,
    make_device_sync,
)


class TestCpuDeviceSync:
    def test_chosen_once_for_cpu(self) -> None:
        """CPU gets the no-op implementation, one shared object per device."""
        sync = make_device_sync("cpu")
        assert isinstance(sync, CpuDeviceSync)
        assert make_device_sync(torch.device("cpu")) is sync
        assert isinstance(sync, DeviceSync)

    def test_streams_and_events_are_no_ops(self) -> None:
        """Stream contexts run their body; events are complete at once."""
        sync = make_device_sync("cpu")
        x = torch.zeros(3)
        with sync.compute_stream():
            x += 1
            event = sync.record_event(0)
        with sync.save_stream():
            sync.wait_event(event)
            y = x.clone()
        with sync.load_stream():
            pass
        assert isinstance(event, DeviceEvent)
        assert event.query() is True
        event.synchronize()
        sync.synchronize()
        assert torch.equal(y, torch.ones(3))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
class TestCudaDeviceSync:
    def test_chosen_for_cuda(self) -> None:
        """CUDA gets real streams, shared per device; 'cuda' means the current device."""
        sync = make_device_sync("cuda")
        assert isinstance(sync, CudaDeviceSync)
        assert make_device_sync(torch.device("cuda", torch.cuda.current_device())) is sync

    def test_save_stream_waits_for_compute_event(self) -> None:
        """A copy on the save stream after wait_event sees the compute stream's result."""
        sync = make_device_sync("cuda")
        src = torch.zeros(1 << 20, device="cuda")
        with sync.compute_stream():
            for _ in range(20):
                src += 1
            event = sync.record_event("layer0")
        host = torch.empty(1 << 20, pin_memory=True)
        with sync.save_stream():
            sync.wait_event(event)
            host.copy_(src, non_blocking=True)
            done = sync.record_event("saved")
        done.synchronize()
        assert done.query()
        assert torch.all(host == 20)
        sync.synchronize()

    def test_load_stream_is_distinct(self) -> None:
        """Load and save streams are their own streams, not the compute stream."""
        sync = make_device_sync("cuda")
        with sync.compute_stream():
            compute = torch.cuda.current_stream()
        with sync.load_stream():
            load = torch.cuda.current_stream()
        with sync.save_stream():
            save = torch.cuda.current_stream()
        assert len({compute, load, save}) == 3
