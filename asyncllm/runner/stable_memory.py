"""Device memory at a virtual address that outlives its physical memory (the CUDA driver's virtual
memory management, through ctypes on libcuda: no compiled extension).

A CUDA graph bakes in the addresses of every tensor it reads. A sleeping engine frees its weights
and KV cache; allocated again by torch they land elsewhere, and every graph must be captured anew
(most of a wake's time). A StableBuffer reserves its address range once and maps physical memory
into it, or unmaps it (the memory goes back to the device), as often as asked: the tensors over it
keep their addresses, so the graphs stay valid across sleep and wake (vLLM's sleep mode does the
same with its CuMemAllocator). Where the API is missing (CPU, ROCm, an old driver or device),
stable_memory_unavailable says why and the runner keeps torch's allocator (wake re-captures).

torch's memory statistics do not see this memory: mapped_bytes() counts it (process-wide).
"""
from __future__ import annotations

import ctypes
import threading

import torch

from asyncllm.layers import device_wide

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
TENSOR_ALIGNMENT = 256  # each tensor packed into a buffer starts at a multiple of this (any dtype's, and kernels')

_mapped_lock = threading.Lock()
_mapped_bytes = 0  # physical memory mapped by every StableBuffer of the process


class StableMemoryError(RuntimeError):
    """A driver call failed (its name and the driver's error name in the message)."""


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _MemAllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _MemLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _MemAccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _MemLocation), ("flags", ctypes.c_int)]


_u64, _size, _p = ctypes.c_ulonglong, ctypes.c_size_t, ctypes.POINTER
# CUdeviceptr and CUmemGenericAllocationHandle are unsigned long long; CUdevice an int; CUcontext a pointer
_SIGNATURES = {
    "cuInit": [ctypes.c_uint],
    "cuDeviceGet": [_p(ctypes.c_int), ctypes.c_int],
    "cuDeviceGetAttribute": [_p(ctypes.c_int), ctypes.c_int, ctypes.c_int],
    "cuCtxGetCurrent": [_p(ctypes.c_void_p)],
    "cuCtxSetCurrent": [ctypes.c_void_p],
    "cuCtxSynchronize": [],
    "cuDevicePrimaryCtxRetain": [_p(ctypes.c_void_p), ctypes.c_int],
    "cuMemGetAllocationGranularity": [_p(_size), _p(_MemAllocationProp), ctypes.c_int],
    "cuMemAddressReserve": [_p(_u64), _size, _size, _u64, _u64],
    "cuMemAddressFree": [_u64, _size],
    "cuMemCreate": [_p(_u64), _size, _p(_MemAllocationProp), _u64],
    "cuMemMap": [_u64, _size, _size, _u64, _u64],
    "cuMemSetAccess": [_u64, _size, _p(_MemAccessDesc), _size],
    "cuMemUnmap": [_u64, _size],
    "cuMemRelease": [_u64],
}


class CudaDriver:
    """The few libcuda entry points a StableBuffer calls, each checked: a CUresult other than 0
    raises StableMemoryError naming the call and the error."""

    def __init__(self, library: str = "libcuda.so.1"):
        self._lib = ctypes.CDLL(library)
        for name, argtypes in _SIGNATURES.items():
            function = getattr(self._lib, name)
            function.argtypes, function.restype = argtypes, ctypes.c_int
        self._lib.cuGetErrorName.argtypes = [ctypes.c_int, _p(ctypes.c_char_p)]
        self._lib.cuGetErrorName.restype = ctypes.c_int
        self.call("cuInit", 0)

    def call(self, name: str, *args) -> None:
        result = getattr(self._lib, name)(*args)
        if result != 0:
            error = ctypes.c_char_p()
            known = self._lib.cuGetErrorName(result, ctypes.byref(error)) == 0 and error.value
            raise StableMemoryError(f"{name} failed: {known.decode() if known else 'CUresult'} ({result})")

    def ensure_context(self, ordinal: int) -> None:
        """The device's primary context (torch's) current on this thread: the driver's calls need one,
        and a thread that made no runtime call yet (an engine thread) has none."""
        context = ctypes.c_void_p()
        self.call("cuCtxGetCurrent", ctypes.byref(context))
        if not context.value:
            device = ctypes.c_int()
            self.call("cuDeviceGet", ctypes.byref(device), ordinal)
            self.call("cuDevicePrimaryCtxRetain", ctypes.byref(context), device)
            self.call("cuCtxSetCurrent", context)

    def supports_vmm(self, ordinal: int) -> bool:
        device, supported = ctypes.c_int(), ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(device), ordinal)
        self.call("cuDeviceGetAttribute", ctypes.byref(supported),
                  CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device)
        return bool(supported.value)

    def granularity(self, ordinal: int) -> int:
        granularity = _size()
        self.call("cuMemGetAllocationGranularity", ctypes.byref(granularity), ctypes.byref(_device_prop(ordinal)),
                  CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        return granularity.value


def _device_prop(ordinal: int) -> _MemAllocationProp:
    prop = _MemAllocationProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type, prop.location.id = CU_MEM_LOCATION_TYPE_DEVICE, ordinal
    return prop


_driver: CudaDriver | None = None


def cuda_driver() -> CudaDriver:
    """The process's CudaDriver (libcuda loaded once)."""
    global _driver
    if _driver is None:
        _driver = CudaDriver()
    return _driver


def stable_memory_unavailable(device: torch.device) -> str | None:
    """Why StableBuffers cannot be made on this device (None: they can)."""
    if device.type != "cuda":
        return f"device {device.type}: no CUDA graphs to keep"
    if torch.version.hip is not None:
        return "ROCm: the CUDA driver's virtual memory API is not there"
    try:
        driver = cuda_driver()
        driver.ensure_context(device.index)
        if not driver.supports_vmm(device.index):
            return f"cuda:{device.index} does not support virtual memory management"
        driver.granularity(device.index)
    except (OSError, AttributeError, StableMemoryError) as error:  # no libcuda, an old one, a failing call
        return f"the CUDA driver's virtual memory API: {error}"
    return None


def mapped_bytes() -> int:
    """Device memory mapped by StableBuffers in this process now (torch's statistics leave it out)."""
    return _mapped_bytes


def device_memory_allocated(device: torch.device | None = None) -> int:
    """torch's allocated memory plus the StableBuffers' mapped memory: the engine's tensors, all of them."""
    return torch.cuda.memory_allocated(device) + _mapped_bytes


def round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def pack_offsets(sizes: list[int], alignment: int = TENSOR_ALIGNMENT) -> tuple[list[int], int]:
    """Where tensors of these byte sizes start, packed one after the other (each aligned), and the
    bytes they take in all."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(round_up(end, alignment))
        end = offsets[-1] + size
    return offsets, end


def _track(delta: int) -> None:
    global _mapped_bytes
    with _mapped_lock:
        _mapped_bytes += delta


class StableBuffer:
    """nbytes of device memory at one virtual address for the buffer's life: map() gives it physical
    memory (contents undefined), unmap() hands that back to the device; the address range is
    released when the buffer is garbage (torch tensors over it hold it: see tensor()). The driver's
    calls run with the device's context current; the caller synchronizes before unmap() (the
    device may still be reading)."""

    def __init__(self, nbytes: int, ordinal: int, driver: CudaDriver | None = None):
        if nbytes <= 0:
            raise ValueError(f"nbytes: a StableBuffer needs at least one byte, got {nbytes}")
        self._driver = cuda_driver() if driver is None else driver
        self.ordinal = ordinal
        self._driver.ensure_context(ordinal)
        self.nbytes = nbytes
        self.size = round_up(nbytes, self._driver.granularity(ordinal))  # what is reserved and mapped
        address = ctypes.c_ulonglong()
        self._driver.call("cuMemAddressReserve", ctypes.byref(address), self.size, 0, 0, 0)
        self.address = address.value
        self._handle: int | None = None  # the physical allocation while mapped

    @property
    def mapped(self) -> bool:
        return self._handle is not None

    def map(self) -> None:
        """Physical memory at the buffer's address (a no-op where it has some)."""
        if self._handle is not None:
            return
        driver, size = self._driver, self.size
        driver.ensure_context(self.ordinal)
        handle = ctypes.c_ulonglong()
        driver.call("cuMemCreate", ctypes.byref(handle), size, ctypes.byref(_device_prop(self.ordinal)), 0)
        try:
            driver.call("cuMemMap", self.address, size, 0, handle.value, 0)
            try:
                access = _MemAccessDesc()
                access.location.type, access.location.id = CU_MEM_LOCATION_TYPE_DEVICE, self.ordinal
                access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                driver.call("cuMemSetAccess", self.address, size, ctypes.byref(access), 1)
            except BaseException:
                driver.call("cuMemUnmap", self.address, size)
                raise
        except BaseException:
            driver.call("cuMemRelease", handle.value)
            raise
        self._handle = handle.value
        _track(size)

    def unmap(self) -> None:
        """The physical memory back to the device; the address stays reserved (a no-op where unmapped)."""
        if self._handle is None:
            return
        self._driver.ensure_context(self.ordinal)
        self._driver.call("cuMemUnmap", self.address, self.size)
        handle, self._handle = self._handle, None
        _track(-self.size)
        self._driver.call("cuMemRelease", handle)

    def tensor(self) -> torch.Tensor:
        """A uint8 tensor over the buffer's nbytes (zero-copy, .view(dtype) slices of it for other
        dtypes). It holds this buffer: the address range outlives every tensor over it."""
        return torch.as_tensor(_ArrayInterface(self), device=torch.device("cuda", self.ordinal))

    def __del__(self):
        try:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return  # a collection inside a capture, which a synchronize would break: kept to the process's end
            if self.mapped:  # not unmapped by its owner (a failed start-up): the device may still read it
                self._driver.ensure_context(self.ordinal)
                self._driver.call("cuCtxSynchronize")
            self.unmap()
            self._driver.call("cuMemAddressFree", self.address, self.size)
        except Exception:  # noqa: BLE001 - at interpreter exit the driver may be gone: nothing to give back then
            pass


class _ArrayInterface:
    """What torch.as_tensor reads a device pointer from (the __cuda_array_interface__ protocol); the
    tensor keeps this object, and so the buffer, alive."""

    def __init__(self, buffer: StableBuffer):
        self.buffer = buffer
        self.__cuda_array_interface__ = {"shape": (buffer.nbytes,), "typestr": "|u1", "data": (buffer.address, False),
                                         "strides": None, "version": 2}


class StableTensors:
    """Tensors moved into one StableBuffer (a model's parameters): each tensor's data becomes a view
    of it at the same shape and dtype. park() hands the memory back (a copy kept in pinned host
    memory, or none); restore() maps it again at the same addresses and copies the host copy back,
    or leaves the caller to fill the views (a checkpoint read again)."""

    def __init__(self, tensors: list[torch.Tensor], device: torch.device, driver: CudaDriver | None = None):
        sizes = [t.numel() * t.element_size() for t in tensors]
        offsets, total = pack_offsets(sizes)
        self.buffer = StableBuffer(max(total, 1), device.index, driver)
        try:  # before any tensor moves: a failure here leaves them where they were
            self.buffer.map()
            flat = self.buffer.tensor()
            if flat.data_ptr() != self.buffer.address:
                raise StableMemoryError(f"torch.as_tensor put the buffer at {flat.data_ptr():#x}, not at "
                                        f"{self.buffer.address:#x}")
        except StableMemoryError:
            raise
        except Exception as error:  # noqa: BLE001 - torch refusing the array interface: the caller's fallback
            raise StableMemoryError(f"a tensor over stable memory: {error}") from error
        for tensor, offset, size in zip(tensors, offsets, sizes):
            view = flat[offset:offset + size].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor.data)
            tensor.data = view  # the old storage goes with its last reference
        self._flat = flat
        self._host: torch.Tensor | None = None

    def park(self, keep_copy: bool) -> None:
        """keep_copy: the contents to pinned host memory first (allocated before anything changes, so
        a failure there leaves the tensors as they were). Then the device memory goes."""
        if keep_copy:
            self._host = torch.empty(self._flat.shape, dtype=torch.uint8, pin_memory=True)
            self._host.copy_(self._flat)
        device_wide.synchronize(self._flat.device)
        self.buffer.unmap()

    def restore(self) -> None:
        """The memory back at the same addresses, and the host copy (if park kept one) in it."""
        self.buffer.map()
        if self._host is not None:
            self._flat.copy_(self._host, non_blocking=True)
            device_wide.synchronize(self._flat.device)  # before the pinned copy is freed
            self._host = None

    def close(self) -> None:
        """The device and host memory go now (the address range with the last view)."""
        self._host = None
        self.buffer.unmap()
