"""runner/decode_staging.DecodeStaging: a decode step's inputs land in the decode graphs' buffers in
one copy, with the padding the graphs' kernels need past the step's rows.

The graphs that read these buffers are GPU-only (tests/test_gpu.py replays them against eager
steps and unstaged replays); here the buffers' contents are checked on any device."""
import numpy as np
import pytest
import torch

from asyncllm.runner import decode_staging
from asyncllm.runner.decode_staging import DecodeStaging
from asyncllm.runner.step_inputs import StepInputs

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
MAX_BATCH, MAX_BLOCKS, BLOCK = 8, 6, 4


def decode_step(num_seqs: int, rng: np.random.Generator) -> StepInputs:
    lens = rng.integers(1, MAX_BLOCKS * BLOCK // 2, size=num_seqs)  # tables narrower than MAX_BLOCKS
    width = int(-(-lens.max() // BLOCK))
    tables = np.zeros((num_seqs, width), dtype=np.int32)
    for row, length in enumerate(lens):
        tables[row, :-(-length // BLOCK)] = rng.choice(100, size=-(-length // BLOCK), replace=False)
    positions = (lens - 1).astype(np.int64)
    slots = tables[np.arange(num_seqs), positions // BLOCK].astype(np.int64) * BLOCK + positions % BLOCK
    return StepInputs(rng.integers(0, 1000, size=num_seqs), positions, slots, np.ones(num_seqs, dtype=np.int32),
                      lens.astype(np.int32), tables, np.arange(num_seqs, dtype=np.int64))


def poisoned(device: str) -> DecodeStaging:
    staging = DecodeStaging(MAX_BATCH, MAX_BLOCKS, BLOCK, torch.device(device))
    staging.buffer.fill_(0x5A)  # a previous step's leftovers, everywhere
    return staging


def host(t: torch.Tensor) -> np.ndarray:
    return t.cpu().numpy()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("table_in_copy", [True, False])
def test_a_step_lands_in_the_buffers_with_padding_rows_that_store_and_read_nothing(device, table_in_copy,
                                                                                    monkeypatch):
    if not table_in_copy:  # long contexts: the table's columns in a copy of their own
        monkeypatch.setattr(decode_staging, "TABLE_BYTES_IN_COPY", 0)
    rng = np.random.default_rng(1)
    staging = poisoned(device)
    for num_seqs in (3, MAX_BATCH, 1):  # one buffer, steps of any size after each other
        step = decode_step(num_seqs, rng)
        staging.stage(step)
        n, width = step.block_tables.shape
        assert np.array_equal(host(staging.input_ids[:n]), step.input_ids)
        assert np.array_equal(host(staging.positions[:n]), step.positions)
        assert np.array_equal(host(staging.slot_mapping[:n]), step.slot_mapping)
        assert np.array_equal(host(staging.seq_lens[:n]), step.seq_lens)
        assert np.array_equal(host(staging.block_tables[:n, :width]), step.block_tables)
        if table_in_copy:  # whole rows: past the step's width, block 0 (no kernel reads it: length)
            assert (host(staging.block_tables[:n, width:]) == 0).all()
        # every row past the step's, up to the largest graph: no KV stored, none read
        assert (host(staging.slot_mapping[n:]) == -1).all()
        assert (host(staging.seq_lens[n:]) == 0).all()
        # ids and positions of padding rows are valid (0), not leftovers an embedding would overrun on
        assert (host(staging.input_ids[n:]) == 0).all() and (host(staging.positions[n:]) == 0).all()
        buffers = staging.paged_buffers
        assert buffers.slot_mapping.data_ptr() == staging.slot_mapping.data_ptr()
        assert buffers.block_tables.data_ptr() == staging.block_tables.data_ptr()
        assert host(buffers.query_start_loc).tolist() == list(range(MAX_BATCH + 1))


@pytest.mark.parametrize("device", DEVICES)
def test_temperatures_and_keys_are_staged_and_the_rest_uploaded_in_plan_order(device):
    rng = np.random.default_rng(2)
    staging = poisoned(device)
    step = decode_step(3, rng)
    extra = [np.array([0, 2], dtype=np.int64), np.array([1, 0], dtype=np.int64)]
    sampling = {"temperatures": np.array([0.6, 0.0, 1.2], dtype=np.float32),
                "keys": np.array([-5, 7, 2**62], dtype=np.int64),
                "top_ps": np.array([0.9, 1.0, 0.5], dtype=np.float32),
                "logprob_rows": np.array([2], dtype=np.int64)}
    input_ids, uploaded = staging.stage(step, extra, sampling)
    assert input_ids.data_ptr() == staging.input_ids.data_ptr() and len(input_ids) == 3
    assert len(uploaded) == len(extra) + len(sampling)
    for tensor, array in zip(uploaded, extra + list(sampling.values())):
        assert np.array_equal(host(tensor), array)
    temperatures, keys = uploaded[2], uploaded[3]
    # in the sampler graphs' buffers: a decode graph's sampling needs no copy of its own
    assert temperatures.data_ptr() == staging.temperatures.data_ptr()
    assert keys.data_ptr() == staging.keys.data_ptr()


@pytest.mark.parametrize("device", DEVICES)
def test_a_greedy_step_stages_no_settings_and_uploads_nothing_else(device):
    staging = poisoned(device)
    step = decode_step(2, np.random.default_rng(3))
    input_ids, uploaded = staging.stage(step)
    assert uploaded == []
    assert np.array_equal(host(input_ids), step.input_ids)


def test_the_arrays_may_be_reused_once_staged():
    staging = poisoned("cpu")
    step = decode_step(2, np.random.default_rng(4))
    expected = step.input_ids.copy()
    staging.stage(step)
    step.input_ids[:] = -7
    assert np.array_equal(host(staging.input_ids[:2]), expected)
