"""Tensor parallelism over torch.distributed: one process per rank.

Rank 0 lives in the engine's process and runs the scheduler; ranks 1..N-1 are worker processes
started with spawn. Every rank holds a shard of each layer (see layers/linear.py) and its own KV
cache of the same number of blocks. Each step rank 0 broadcasts the packed StepInputs (one int64
array) over a CPU group; then all ranks run the same forward, whose all-reduces go through the
default group (NCCL on GPUs, gloo on CPU). Only rank 0 samples.

A rank that dies is noticed by rank 0 before its next step (or by the next collective failing);
the error ends the engine, and close() ends every worker, so no process outlives the engine.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import threading
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger("asyncllm")

_EXIT = -1
_COLLECTIVE_TIMEOUT = timedelta(seconds=int(os.environ.get("ASYNCLLM_TP_TIMEOUT_S", "300")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(rank: int, world_size: int, init_method: str, device_type: str):
    """Join the process group; returns the CPU group that carries step inputs."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=_COLLECTIVE_TIMEOUT)
    return dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD


def agree_on_min(value: int, group) -> int:
    """The smallest value any rank proposes (e.g. KV blocks: every rank must have the same cache)."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def send_step(packed: np.ndarray | None, group) -> None:
    """Rank 0: broadcast one step's packed inputs (None tells the workers to exit)."""
    length = torch.tensor([_EXIT if packed is None else len(packed)], dtype=torch.int64)
    dist.broadcast(length, src=0, group=group)
    if packed is not None:
        dist.broadcast(torch.from_numpy(packed), src=0, group=group)


def receive_step(group) -> np.ndarray | None:
    """Ranks 1..N-1: the next step's packed inputs, or None when told to exit."""
    length = torch.empty(1, dtype=torch.int64)
    dist.broadcast(length, src=0, group=group)
    if int(length.item()) == _EXIT:
        return None
    payload = torch.empty(int(length.item()), dtype=torch.int64)
    dist.broadcast(payload, src=0, group=group)
    return payload.numpy()


class TensorParallelWorkers:
    """Rank 0's handle on ranks 1..N-1: starts them, feeds them steps, ends them."""

    def __init__(self, config):
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError("Config.tensor_parallel_size: a tensor-parallel engine already runs in this process; "
                               "close it first")
        world_size = config.tensor_parallel_size
        if config.device == "cuda" and torch.cuda.device_count() < world_size:
            raise ValueError(f"Config.tensor_parallel_size: {world_size} ranks need {world_size} GPUs, "
                             f"found {torch.cuda.device_count()}")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        self.processes = [ctx.Process(target=_worker_main, args=(config, rank, world_size, init_method),
                                      name=f"asyncllm-tp{rank}", daemon=True)
                          for rank in range(1, world_size)]
        for p in self.processes:
            p.start()
        self.closed = False
        # join the group in a thread, so a worker that dies while starting is reported at once
        # rather than after the rendezvous timeout
        joined: dict = {}

        def join() -> None:
            try:
                joined["group"] = init_distributed(0, world_size, init_method, config.device)
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                joined["error"] = e

        joiner = threading.Thread(target=join, name="asyncllm-tp-join", daemon=True)
        joiner.start()
        while joiner.is_alive():
            joiner.join(0.1)
            if not joiner.is_alive():
                break
            try:
                self.check_alive()
            except RuntimeError as e:
                self.close()
                raise RuntimeError(f"tensor-parallel start-up failed: {e}") from None
        if "error" in joined:
            self.close()
            raise joined["error"]
        self.group = joined["group"]

    def check_alive(self) -> None:
        for rank, p in enumerate(self.processes, start=1):
            if not p.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} died (exit code {p.exitcode})")

    def run_step(self, inputs) -> None:
        self.check_alive()
        send_step(inputs.pack(), self.group)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if all(p.is_alive() for p in self.processes) and dist.is_initialized():
                send_step(None, self.group)
        except Exception:  # noqa: BLE001 - a broken group cannot say goodbye; the workers are ended below
            pass
        for p in self.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def _worker_main(config, rank: int, world_size: int, init_method: str) -> None:
    from asyncllm.model_runner import ModelRunner, StepInputs
    if config.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    group = init_distributed(rank, world_size, init_method, config.device)
    runner = ModelRunner(config, rank=rank, step_group=group)
    while (packed := receive_step(group)) is not None:
        runner.forward(StepInputs.unpack(packed))
    dist.destroy_process_group()
