"""Stable device memory (runner/stable_memory.py) on CPU: which sleep path a runner takes and why,
the packing, and a StableBuffer's driver bookkeeping against a fake driver (the real round trip,
graphs kept across sleep, is in tests/test_gpu.py)."""
from __future__ import annotations

import ctypes
import gc

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.runner import memory, stable_memory
from asyncllm.runner.memory import stable_memory_refusal
from asyncllm.runner.stable_memory import (CudaDriver, StableBuffer, StableMemoryError, StableTensors, pack_offsets,
                                           round_up)
from asyncllm.testing import build_tiny_checkpoint


class FakeDriver:
    """Records the driver calls a StableBuffer makes; hands out addresses and handles; fails the
    call named in fail_on."""
    granularity_bytes = 2 << 20

    def __init__(self, fail_on: str | None = None):
        self.calls: list[tuple] = []
        self.fail_on = fail_on
        self.next_value = 0x7f0000000000

    def ensure_context(self, ordinal: int) -> None:
        self.calls.append(("ensure_context", ordinal))

    def granularity(self, ordinal: int) -> int:
        return self.granularity_bytes

    def call(self, name: str, *args) -> None:
        if name == self.fail_on:
            raise StableMemoryError(f"{name} failed: CUDA_ERROR_OUT_OF_MEMORY (2)")
        if name in ("cuMemAddressReserve", "cuMemCreate"):
            args[0]._obj.value = self.next_value  # the out-parameter, passed by reference
            self.next_value += 1 << 32
            args = args[1:]
        self.calls.append((name, *args[:2]))

    def names(self) -> list[str]:
        return [call[0] for call in self.calls if call[0] != "ensure_context"]


def test_the_sleep_path_says_why_it_recaptures():
    assert stable_memory_refusal(torch.device("cpu"), False, False).startswith("device cpu")
    # decided before the driver is asked (this machine has none)
    assert stable_memory_refusal(torch.device("cuda", 0), True, False).startswith("enforce_eager")
    assert stable_memory_refusal(torch.device("cuda", 0), False, True).startswith("tensor parallel")


def test_a_missing_or_unable_driver_is_a_reason_not_an_error(monkeypatch):
    def no_libcuda():
        raise OSError("libcuda.so.1: cannot open shared object file")
    monkeypatch.setattr(stable_memory, "cuda_driver", no_libcuda)
    reason = stable_memory.stable_memory_unavailable(torch.device("cuda", 0))
    assert "virtual memory API" in reason and "libcuda.so.1" in reason

    class NoVmm(FakeDriver):
        def supports_vmm(self, ordinal):
            return False
    monkeypatch.setattr(stable_memory, "cuda_driver", NoVmm)
    assert "does not support" in stable_memory.stable_memory_unavailable(torch.device("cuda", 3))


def test_a_cpu_engine_takes_the_recapture_path_and_still_sleeps(tmp_path):
    model = build_tiny_checkpoint(str(tmp_path / "m"), "qwen3")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(model, num_kvcache_blocks=16, kvcache_block_size=16) as llm:
        runner = llm.core.runner
        assert runner.sleep_path.startswith("recapture (device cpu") and runner.stable_weights is None
        before = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0]["token_ids"]
        llm.sleep(2)
        llm.wake()
        assert llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0]["token_ids"] == before


def test_packing_aligns_every_tensor_without_overlap():
    sizes = [6, 512, 1, 256, 300]
    offsets, total = pack_offsets(sizes, 256)
    assert offsets == [0, 256, 768, 1024, 1280] and total == 1580
    assert all(a + size <= b for a, size, b in zip(offsets, sizes, offsets[1:]))
    assert pack_offsets([], 256) == ([], 0)
    assert [round_up(n, 4) for n in (0, 1, 4, 5)] == [0, 4, 4, 8]


def test_a_buffer_maps_and_unmaps_at_one_address_rounded_to_the_granularity():
    driver = FakeDriver()
    start = stable_memory.mapped_bytes()
    buffer = StableBuffer(3 << 20, ordinal=1, driver=driver)
    assert buffer.size == 4 << 20 and buffer.nbytes == 3 << 20 and not buffer.mapped
    assert driver.calls[-1] == ("cuMemAddressReserve", 4 << 20, 0)
    address = buffer.address
    for _ in range(2):
        buffer.map()
        buffer.map()  # mapped already: nothing
        assert buffer.mapped and buffer.address == address
        assert stable_memory.mapped_bytes() - start == 4 << 20
        buffer.unmap()
        buffer.unmap()
        assert not buffer.mapped and stable_memory.mapped_bytes() == start
    assert driver.names() == ["cuMemAddressReserve"] + ["cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap",
                                                        "cuMemRelease"] * 2
    assert all(call[1] == address for call in driver.calls if call[0] in ("cuMemMap", "cuMemSetAccess", "cuMemUnmap"))
    assert all(call[1] == 1 for call in driver.calls if call[0] == "ensure_context")  # the device's context
    buffer.map()
    del buffer  # mapped at the end: the device's work waited for, unmapped, released, the range freed
    assert driver.names()[-4:] == ["cuCtxSynchronize", "cuMemUnmap", "cuMemRelease", "cuMemAddressFree"]
    assert stable_memory.mapped_bytes() == start


@pytest.mark.parametrize("failing", ["cuMemCreate", "cuMemMap", "cuMemSetAccess"])
def test_a_failed_map_leaves_nothing_mapped_or_held(failing):
    driver = FakeDriver(fail_on=failing)
    start = stable_memory.mapped_bytes()
    buffer = StableBuffer(1, ordinal=0, driver=driver)
    with pytest.raises(StableMemoryError, match=failing):
        buffer.map()
    assert not buffer.mapped and stable_memory.mapped_bytes() == start
    names = driver.names()  # the calls that succeeded: each undone
    assert names.count("cuMemCreate") == names.count("cuMemRelease")
    assert names.count("cuMemMap") == names.count("cuMemUnmap")


def test_a_buffer_of_no_bytes_is_refused():
    with pytest.raises(ValueError, match="nbytes"):
        StableBuffer(0, ordinal=0, driver=FakeDriver())


def test_a_failing_driver_call_names_the_call_and_the_error():
    class Lib:
        @staticmethod
        def cuMemMap(*args):
            return 2

        @staticmethod
        def cuGetErrorName(result, name):
            name._obj.value = b"CUDA_ERROR_OUT_OF_MEMORY"
            return 0
    driver = CudaDriver.__new__(CudaDriver)
    driver._lib = Lib()
    with pytest.raises(StableMemoryError, match=r"cuMemMap failed: CUDA_ERROR_OUT_OF_MEMORY \(2\)"):
        driver.call("cuMemMap", ctypes.c_ulonglong(1), 2, 0, 3, 0)


def test_tensors_stay_where_they_were_when_torch_cannot_take_the_buffer():
    """No CUDA here: torch.as_tensor over the (fake) buffer fails before any tensor moves."""
    driver = FakeDriver()
    start = stable_memory.mapped_bytes()
    weights = [torch.nn.Parameter(torch.randn(4, 3), requires_grad=False), torch.arange(5)]
    before = [(w.data_ptr(), w.clone()) for w in weights]
    with pytest.raises(StableMemoryError, match="a tensor over stable memory"):
        StableTensors(weights, torch.device("cuda", 0), driver=driver)
    assert [w.data_ptr() for w in weights] == [address for address, _ in before]
    assert all(torch.equal(w, copy) for w, (_, copy) in zip(weights, before))
    gc.collect()  # the buffer's memory and range went back
    assert stable_memory.mapped_bytes() == start and driver.names()[-1] == "cuMemAddressFree"


def test_a_driver_failure_at_start_up_falls_back_to_the_recapture_path(tmp_path, monkeypatch):
    def out_of_memory(tensors, device):
        raise StableMemoryError("cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY (2)")
    monkeypatch.setattr(memory, "stable_memory_refusal", lambda *args: None)
    monkeypatch.setattr(memory, "StableTensors", out_of_memory)
    model = build_tiny_checkpoint(str(tmp_path / "m"), "qwen3")
    with LLM(model, num_kvcache_blocks=16, kvcache_block_size=16) as llm:
        assert llm.core.runner.sleep_path == "recapture (cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY (2))"
        assert llm.core.runner.stable_weights is None
        assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)[0]["token_ids"]) == 3
