"""runner/host_upload.upload_arrays: a step's small arrays reach the device whole and in place, in one copy."""
import numpy as np
import pytest
import torch

from asyncllm.runner.host_upload import upload_arrays

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_arrays_arrive_equal_with_their_dtypes_and_shapes(device):
    rng = np.random.default_rng(0)
    arrays = [rng.integers(-2**62, 2**62, size=7, dtype=np.int64),  # odd lengths: offsets must realign
              rng.standard_normal(3).astype(np.float32),
              rng.integers(0, 100, size=(5, 3), dtype=np.int32),
              np.array([], dtype=np.int64),
              np.array([1.5], dtype=np.float32)]
    tensors = upload_arrays(arrays, torch.device(device))
    for array, tensor in zip(arrays, tensors):
        assert tensor.device.type == device
        assert tensor.dtype == {np.int64: torch.int64, np.int32: torch.int32, np.float32: torch.float32}[array.dtype.type]
        assert tuple(tensor.shape) == array.shape
        assert np.array_equal(tensor.cpu().numpy(), array)
        if device == "cuda":
            assert tensor.data_ptr() % 16 == 0


@pytest.mark.parametrize("device", DEVICES)
def test_arrays_changed_after_the_upload_do_not_change_the_tensors(device):
    array = np.arange(4, dtype=np.int64)
    (tensor,) = upload_arrays([array], torch.device(device))
    array[:] = -1
    assert tensor.cpu().tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("device", DEVICES)
def test_no_arrays_make_no_tensors(device):
    assert upload_arrays([], torch.device(device)) == []
