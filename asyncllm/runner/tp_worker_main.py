"""A tensor-parallel worker rank's process: join the group, build its shard, run rank 0's steps.

Started by rank 0 (tp_workers.py, with spawn) or by hand on another machine (`asyncllm tp-worker`).
"""
from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist

from asyncllm.runner.model_runner import ModelRunner
from asyncllm.runner.step_inputs import StepInputs
from asyncllm.runner.tp_protocol import check_same_model, init_distributed, joined_key, make_store, receive_step


def _exit_with_parent(parent_pid: int) -> None:
    """A spawned worker whose engine process vanished (e.g. SIGKILL) ends itself."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, name="asyncllm-tp-parent-watch", daemon=True).start()


def run_worker(config, rank: int, world_size: int, init_method: str, device_index: int | None = None,
               watch_parent: bool = False) -> None:
    """A worker rank's life: join the group, build its shard of the model and its KV cache, then run
    every step rank 0 sends until told to exit."""
    if watch_parent:
        _exit_with_parent(os.getppid())
    if config.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if config.device == "cuda":
        torch.cuda.set_device(device_index if device_index is not None else rank % torch.cuda.device_count())
    store = make_store(init_method, rank, world_size)
    store.set(joined_key(rank), "1")
    group = init_distributed(rank, world_size, store, config.device, device_index)
    runner = None
    try:
        check_same_model(config, rank, group)
        runner = ModelRunner(config, rank=rank, step_group=group)
        while (packed := receive_step(group)) is not None:
            runner.forward(StepInputs.unpack(packed))
    finally:
        if runner is not None:
            runner.release_cuda_graphs()  # before the group: see CudaGraphRunner.release
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
