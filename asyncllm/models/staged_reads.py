"""A safetensors file's tensors read with few large sequential reads into one reused host buffer.

Taking each tensor from safetensors' memory map costs a page fault per page of the source at the
copy into the parameter, and on CUDA a copy from pageable memory, which the driver bounces through
a pinned buffer of its own. Here the tensors' byte ranges are read in chunks of about CHUNK_BYTES
with readinto, into a staging buffer (pinned on CUDA, so the copy into the parameter is a plain DMA),
and each tensor is a view of it. A buffer is touched (and pinned) once and reused for a later chunk,
but only while no tensor made from it is still referenced: a consumer that keeps tensors longer (the
FP8 stream pairs weights with scales that come later) keeps their buffer, and the next chunk gets
another. Nothing read is ever overwritten while it is held.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Iterator

import torch

CHUNK_BYTES = 128 << 20  # large enough for sequential reads, small beside a model

# safetensors' dtype names (the header's); a file holding another dtype is read by safetensors itself
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _references(tensor: torch.Tensor) -> int:
    """How many tensors (this one and every view of it) share tensor's memory."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


class StagingBuffers:
    """Host memory the reads land in (pinned where pin): buffers reused while nothing made from them is
    held. A for loop over the tensors holds the last one while it asks for the next, so two buffers
    take turns; a consumer that holds more makes more."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.buffers: list[tuple[torch.Tensor, int]] = []  # (buffer, _references(buffer) with no view alive)

    def take(self, nbytes: int) -> torch.Tensor:
        for buffer, unreferenced in self.buffers:
            if buffer.numel() >= nbytes and _references(buffer) == unreferenced:
                return buffer[:nbytes]
        buffer = torch.empty(max(nbytes, CHUNK_BYTES), dtype=torch.uint8, pin_memory=self.pin)
        self.buffers.append((buffer, _references(buffer)))
        return buffer[:nbytes]


def header_entries(file) -> tuple[int, list[tuple[int, int, str, dict]]]:
    """(where the data begins, [(begin, end, name, entry)] by offset) from an open safetensors file's
    JSON header, which safe_open has already validated."""
    file.seek(0)
    (length,) = struct.unpack("<Q", file.read(8))
    header = json.loads(file.read(length))
    entries = sorted((*entry["data_offsets"], name, entry) for name, entry in header.items() if name != "__metadata__")
    return 8 + length, entries


def staged_tensors(path: str, staging: StagingBuffers) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(name, tensor) for every tensor of the safetensors file at path, in file order; the tensor is a
    view of staging's buffer, or None for a dtype not in DTYPES (the caller reads that one itself)."""
    with open(path, "rb", buffering=0) as file:
        data_start, entries = header_entries(file)
        first = 0
        while first < len(entries):
            begin = entries[first][0]
            last = first + 1  # one chunk: the tensors that end within CHUNK_BYTES of its start (at least one)
            while last < len(entries) and entries[last][1] - begin <= CHUNK_BYTES:
                last += 1
            end = entries[last - 1][1]
            chunk = staging.take(end - begin)
            _read_exactly(file, data_start + begin, chunk, path)
            for offset, stop, name, entry in entries[first:last]:
                yield name, _view(chunk[offset - begin:stop - begin], entry)
            del chunk  # the views the consumer still holds are what keeps the buffer from reuse
            first = last


def _view(raw: torch.Tensor, entry: dict) -> torch.Tensor | None:
    dtype = DTYPES.get(entry["dtype"])
    if dtype is None:
        return None
    if raw.storage_offset() % dtype.itemsize:  # an unaligned tensor (the format allows it): copied
        raw = raw.clone()
    return raw.view(dtype).reshape(entry["shape"])


def _read_exactly(file, position: int, out: torch.Tensor, path: str) -> None:
    file.seek(position)
    view = memoryview(out.numpy()).cast("B")
    done = 0
    while done < len(view):
        count = file.readinto(view[done:])
        if not count:
            raise ValueError(f"{path}: not a readable safetensors file: it ends inside a tensor's data")
        done += count
