"""GPU memory through NVML (nvidia-ml-py, imported as pynvml), initialised once and kept;
after a driver-level error shut down, and initialised again on the next run. One GPU failing
(lost, not supported) skips that GPU only; --collector.gpu.timeout bounds a hanging call."""

import time
from contextlib import suppress
from typing import List, Optional, Tuple

from exporter.collectors.source import Source, register
from exporter.host.proctable import ProcessTable
from exporter.model.types import GpuDevice, GpuProcess, GpuSnapshot

# After "no library" / "no driver", try again this much later, not on every poll.
MISSING_DRIVER_RETRY_SECONDS = 60.0


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class GpuCollector(Source):
    name = "gpu"

    def __init__(self, table: ProcessTable):
        self.table = table
        self.nvml = None  # pynvml, once nvmlInit succeeded
        self.driver_version = ""
        self._missing: Optional[Tuple[float, str]] = None  # (retry at, why) no driver

    def _init(self) -> None:
        if self._missing and time.monotonic() < self._missing[0]:
            raise RuntimeError(self._missing[1])
        try:
            import pynvml as nvml  # nvidia-ml-py

            nvml.nvmlInit()
        except ImportError as err:
            why = f"nvidia-ml-py is not installed ({err})"
        except nvml.NVMLError as err:  # evaluated only once pynvml was imported
            why = {
                nvml.NVML_ERROR_LIBRARY_NOT_FOUND: "no NVIDIA driver: libnvidia-ml.so.1 not found",
                nvml.NVML_ERROR_DRIVER_NOT_LOADED: "the NVIDIA driver is not loaded",
            }.get(getattr(err, "value", None))
            if not why:
                raise RuntimeError(f"nvmlInit failed: {err}") from None
        else:
            self.nvml, self._missing = nvml, None
            self.driver_version = _text(nvml.nvmlSystemGetDriverVersion())
            return
        self._missing = (time.monotonic() + MISSING_DRIVER_RETRY_SECONDS, why)
        raise RuntimeError(why)

    def close(self) -> None:
        if self.nvml is not None:
            with suppress(Exception):  # after a driver error this may fail too
                self.nvml.nvmlShutdown()
        self.nvml = None

    def collect(self) -> GpuSnapshot:
        if self.nvml is None:
            self._init()
        nvml = self.nvml
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as err:
            self.close()  # driver-level trouble
            raise RuntimeError(f"nvmlDeviceGetCount failed: {err}") from None
        devices, errors = [], []
        for index in range(count):
            try:
                devices.extend(self._device(index))
            except nvml.NVMLError as err:
                errors.append(f"gpu {index}: {err}")
        if count and not devices:
            self.close()
            raise RuntimeError("every GPU failed: " + "; ".join(errors))
        return GpuSnapshot(self.driver_version, devices, errors)

    def _device(self, index: int) -> List[GpuDevice]:
        nvml = self.nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        name = _text(nvml.nvmlDeviceGetName(handle))
        devices = [self._measure(handle, str(index), name)]
        current_mode = 0
        with suppress(nvml.NVMLError):  # NotSupported on GPUs without MIG
            current_mode, _pending = nvml.nvmlDeviceGetMigMode(handle)
        if current_mode == getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
            for mig_index in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
                try:
                    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, mig_index)
                except nvml.NVMLError:
                    continue  # that MIG slot is not populated
                devices.append(self._measure(mig, f"{index}/{mig_index}", name))
        return devices

    def _measure(self, handle, gpu: str, name: str) -> GpuDevice:
        nvml = self.nvml
        # "Used" is all but free, the driver's reserve included: v1's used, v2's used + reserved.
        try:
            memory = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
            reserved = int(memory.reserved)
            used = int(memory.used) + reserved
        except nvml.NVMLError:
            # Drivers before R510 have no v2: reserved is then unknown, not 0.
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            used, reserved = int(memory.used), None
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        # Graphics is NotSupported on many data-centre GPUs.
        infos, by_pid = [], {}
        compute = nvml.nvmlDeviceGetComputeRunningProcesses
        for getter in (compute, nvml.nvmlDeviceGetGraphicsRunningProcesses):
            with suppress(nvml.NVMLError):
                infos += getter(handle)
        for info in infos:
            if info.usedGpuMemory is not None:  # None under WDDM or without permission
                pid = int(info.pid)
                by_pid[pid] = max(by_pid.get(pid, 0), int(info.usedGpuMemory))
        # NVML reports host PIDs; from another PID namespace they do not resolve here.
        comm = self.table.comm
        processes = tuple(GpuProcess(p, comm(p), b) for p, b in sorted(by_pid.items()))
        total, free = int(memory.total), int(memory.free)
        return GpuDevice(gpu, uuid, name, total, used, free, reserved, processes)


register("gpu", lambda c: GpuCollector(c.table))
