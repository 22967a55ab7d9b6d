"""Tensor parallelism, rank 0's side: start ranks 1..N-1, feed them steps, keep them alive, end them.

Rank 0 lives in the engine's process and runs the scheduler; ranks 1..N-1 are worker processes
(tp_worker_main.run_worker), started with spawn, or, over several machines, by hand with
`asyncllm tp-worker`. Every rank holds a shard of each layer (see layers/linear.py) and its own KV
cache of the same number of blocks; only rank 0 samples. The wire is in tp_protocol.py.

A rank that dies is noticed by rank 0 before its next step (or by the step's collectives
failing); the error names the rank and ends the engine, and close() ends every worker, so no
process outlives the engine. Idle workers hear a heartbeat, so an engine may idle for any time.

Environment (asyncllm/settings.py; docs/TENSOR_PARALLEL.md):
  ASYNCLLM_TP_INIT_METHOD   env:// (MASTER_ADDR, MASTER_PORT) or tcp://HOST:PORT: rank 0 hosts this
                            rendezvous instead of a free 127.0.0.1 port, and starts only
                            ASYNCLLM_TP_LOCAL_RANKS itself
  ASYNCLLM_TP_LOCAL_RANKS   ranks rank 0 spawns on its own machine under ASYNCLLM_TP_INIT_METHOD,
                            e.g. "1,2,3" (default: none; the others are started by hand)
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time

import torch
import torch.distributed as dist

from asyncllm import settings
from asyncllm.config import config_error
from asyncllm.runner.tp_protocol import (HEARTBEAT, RankDiedError, check_same_model, collective_timeout,
                                         init_distributed, joined_key, make_store, parse_ranks, send_step)
from asyncllm.runner.tp_worker_main import run_worker

logger = logging.getLogger("asyncllm")

_CLOSE_GRACE_S = 10.0  # how long close() lets workers leave on their own before killing them


class TensorParallelWorkers:
    """Rank 0's handle on ranks 1..N-1: starts the local ones, feeds all of them steps, ends them."""

    def __init__(self, config):
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError("Config.tensor_parallel_size: torch.distributed is already initialized in this process "
                               "(a tensor-parallel engine still runs?); close that engine first")
        world_size = config.tensor_parallel_size
        self.world_size = world_size
        self.processes: list = []
        self.ranks: list[int] = []
        self.closed = False
        self.broken = False  # a step failed: the ranks are out of lockstep, so close() kills at once
        self._lock = threading.Lock()  # one sender on the step group at a time
        self._last_send = time.monotonic()
        self._heartbeat_error: BaseException | None = None
        self._stop = threading.Event()

        init_method = settings.TP_INIT_METHOD.read()
        if init_method:
            # several machines: rank 0 joins the given rendezvous; the other machines' ranks are
            # started there with `asyncllm tp-worker`
            rank = settings.RANK.read()
            if rank not in (None, 0):
                raise ValueError(f"ASYNCLLM_TP_INIT_METHOD: the engine's process is rank 0, but RANK={rank}")
            env_world = settings.WORLD_SIZE.read()
            if env_world is not None and env_world != world_size:
                raise config_error("tensor_parallel_size", f"{world_size}, but WORLD_SIZE={env_world}")
            local_ranks = parse_ranks(settings.TP_LOCAL_RANKS.read(), world_size)
            first_device = settings.LOCAL_RANK.read() or 0
        else:
            init_method = None  # a free port on 127.0.0.1, picked when the store is made below
            local_ranks = list(range(1, world_size))
            first_device = 0
        if config.device == "cuda" and torch.cuda.device_count() < first_device + 1 + len(local_ranks):
            raise config_error("tensor_parallel_size", f"{1 + len(local_ranks)} ranks on this machine need as "
                               f"many GPUs, found {torch.cuda.device_count()}")

        # rank 0 hosts the rendezvous store; the process group is joined only once every rank has
        # said it is there, so a rank that dies while starting is reported at once (no thread is
        # left waiting on the rendezvous, which would upset the next engine's process group)
        if init_method is None:
            store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=collective_timeout(),
                                  wait_for_workers=False)
            init_method = f"tcp://127.0.0.1:{store.port}"
        else:
            store = make_store(init_method, 0, world_size)
        ctx = mp.get_context("spawn")
        self.ranks = local_ranks
        self.processes = [ctx.Process(target=run_worker,
                                      args=(config, rank, world_size, init_method, first_device + 1 + i, True),
                                      name=f"asyncllm-tp{rank}", daemon=True)
                          for i, rank in enumerate(local_ranks)]
        try:
            for p in self.processes:
                p.start()
            self._wait_for_ranks(store, world_size)
            self.group = init_distributed(0, world_size, store, config.device, first_device)
            check_same_model(config, 0, self.group)
        except RankDiedError as e:
            self.abort()
            raise RankDiedError(f"tensor-parallel start-up failed: {e}") from None
        except BaseException:
            self.abort()
            raise
        self._heartbeat = threading.Thread(target=self._beat, name="asyncllm-tp-heartbeat", daemon=True)
        self._heartbeat.start()

    def _wait_for_ranks(self, store, world_size: int) -> None:
        timeout = collective_timeout().total_seconds()
        deadline = time.monotonic() + timeout
        waiting = list(range(1, world_size))
        while waiting:
            self.check_alive()
            waiting = [r for r in waiting if not store.check([joined_key(r)])]
            if waiting and time.monotonic() > deadline:
                hint = "" if set(waiting) <= set(self.ranks) else \
                    " (ranks on other machines are started with `asyncllm tp-worker`)"
                raise TimeoutError(f"tensor-parallel start-up: ranks {waiting} did not join within {timeout:.0f} s "
                                   f"(ASYNCLLM_TP_TIMEOUT_S){hint}")
            if waiting:
                time.sleep(0.02)

    # ---- health --------------------------------------------------------------------------------
    def check_alive(self) -> None:
        for rank, p in zip(self.ranks, self.processes):
            if not p.is_alive():
                raise RankDiedError(f"tensor-parallel rank {rank} died (exit code {p.exitcode})")

    def _dead_rank_error(self, wait_s: float) -> RankDiedError | None:
        """A clear error naming a local rank that died, waiting up to wait_s for its death to show."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.check_alive()
            except RankDiedError as e:
                return e
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _beat(self) -> None:
        interval = max(0.5, min(30.0, collective_timeout().total_seconds() / 4))
        while not self._stop.wait(interval / 4):
            with self._lock:
                if self.closed or self.broken or time.monotonic() - self._last_send < interval:
                    continue
                try:
                    send_step(None, self.group, header=HEARTBEAT)
                    self._last_send = time.monotonic()
                except BaseException as e:  # noqa: BLE001 - reported by the next step
                    self._heartbeat_error = e
                    return

    # ---- steps ---------------------------------------------------------------------------------
    def run_step(self, inputs, forward):
        """Send one step's inputs to every rank, then run forward(inputs) here in lockstep with them.

        If a rank died, raises RuntimeError naming it; after any failure the workers are out of
        lockstep and close() kills them.
        """
        try:
            self.check_alive()
            if self._heartbeat_error is not None:
                raise RuntimeError(f"tensor-parallel heartbeat failed: {self._heartbeat_error!r}")
        except RuntimeError:
            self.broken = True
            raise
        try:
            with self._lock:
                send_step(inputs.pack(), self.group)
                self._last_send = time.monotonic()
            return forward(inputs)
        except Exception as e:
            # a rank killed mid-step shows here as a failed collective: say which rank it was
            self.broken = True
            dead = self._dead_rank_error(wait_s=2.0)
            if dead is not None:
                raise dead from e
            raise
        except BaseException:
            self.broken = True
            raise

    # ---- shutdown ------------------------------------------------------------------------------
    def abort(self) -> None:
        """End every worker now (start-up failed, or a step did)."""
        self.broken = True
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        with self._lock:
            self.closed = True
            self._stop.set()
            goodbye = not self.broken and self._heartbeat_error is None and dist.is_initialized() \
                and all(p.is_alive() for p in self.processes)
            if goodbye:
                try:
                    send_step(None, self.group)
                except Exception:  # noqa: BLE001 - a broken group cannot say goodbye; the workers are ended below
                    goodbye = False
        if not goodbye:
            self._end_workers(deadline=time.monotonic())
        # NCCL tears a communicator down collectively (every rank of a machine destroys it, or all
        # wait): rank 0 destroys its groups now, while the workers destroy theirs on the goodbye
        self._destroy_process_group()
        self._end_workers(deadline=time.monotonic() + _CLOSE_GRACE_S)
        self.group = None  # it holds the rendezvous store, whose port a new engine may reuse

    def _end_workers(self, deadline: float) -> None:
        """Wait for the workers to leave until deadline, then kill those still running."""
        for p in self.processes:
            if p.pid is None:  # start-up failed before this one was started
                continue
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    @staticmethod
    def _destroy_process_group() -> None:
        """dist.destroy_process_group(), given at most _CLOSE_GRACE_S: with a rank gone, NCCL's
        teardown may wait for it forever, and close() must return all the same."""
        if not dist.is_initialized():
            return

        def destroy() -> None:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - nothing more can be done with a broken group
                pass
        thread = threading.Thread(target=destroy, name="asyncllm-tp-destroy", daemon=True)
        thread.start()
        thread.join(timeout=_CLOSE_GRACE_S)
        if thread.is_alive():
            logger.warning("tensor-parallel close: the process group's teardown did not finish in %.0f s (a rank "
                           "died mid-step?); a new tensor-parallel engine needs a new process", _CLOSE_GRACE_S)
