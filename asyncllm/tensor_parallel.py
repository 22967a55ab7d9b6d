"""Tensor parallelism over torch.distributed: one process per rank.

Rank 0 lives in the engine's process and runs the scheduler; ranks 1..N-1 are worker processes,
started with spawn (or, over several machines, by hand with `python -m asyncllm.tensor_parallel`).
Every rank holds a shard of each layer (see layers/linear.py) and its own KV cache of the same
number of blocks. Each step rank 0 broadcasts the packed StepInputs (one int64 array) over a gloo
group of its own; then all ranks run the same forward, whose all-reduces go through the default
group (NCCL on GPUs, gloo on CPU). Only rank 0 samples.

A rank that dies is noticed by rank 0 before its next step (or by the step's collectives
failing); the error names the rank and ends the engine, and close() ends every worker, so no
process outlives the engine. Idle workers hear a heartbeat, so an engine may idle for any time.

Environment (see docs/TENSOR_PARALLEL.md):
  ASYNCLLM_TP_TIMEOUT_S     seconds a rank waits on a collective or the rendezvous (default 300)
  ASYNCLLM_TP_INIT_METHOD   env:// (MASTER_ADDR, MASTER_PORT) or tcp://HOST:PORT: rank 0 hosts this
                            rendezvous instead of a free 127.0.0.1 port, and starts only
                            ASYNCLLM_TP_LOCAL_RANKS itself
  ASYNCLLM_TP_LOCAL_RANKS   ranks rank 0 spawns on its own machine under ASYNCLLM_TP_INIT_METHOD,
                            e.g. "1,2,3" (default: none; the others are started by hand)
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import multiprocessing as mp
import os
import sys
import threading
import time
import urllib.parse
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger("asyncllm")

_EXIT = -1  # step header: the workers leave their loop
_HEARTBEAT = -2  # step header: nothing to run; keeps an idle worker's receive from timing out
_CLOSE_GRACE_S = 10.0  # how long close() lets workers leave on their own before killing them


def collective_timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get("ASYNCLLM_TP_TIMEOUT_S", "300")))


def _parse_ranks(text: str, world_size: int) -> list[int]:
    try:
        ranks = sorted({int(r) for r in text.replace(" ", "").split(",") if r})
    except ValueError:
        raise ValueError(f"ASYNCLLM_TP_LOCAL_RANKS: expected comma-separated ranks such as 1,2,3, "
                         f"got {text!r}") from None
    bad = [r for r in ranks if not 1 <= r < world_size]
    if bad:
        raise ValueError(f"ASYNCLLM_TP_LOCAL_RANKS: ranks {bad} are outside 1..{world_size - 1}")
    return ranks


def make_store(init_method: str, rank: int, world_size: int) -> dist.Store:
    """The rendezvous store: rank 0 hosts it, the others connect (retrying until the timeout).

    init_method is env:// (MASTER_ADDR, MASTER_PORT) or tcp://HOST:PORT.
    """
    if init_method.startswith("env://"):
        try:
            host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        except KeyError as e:
            raise ValueError(f"tensor-parallel rendezvous {init_method}: ${e.args[0]} is not set") from None
    elif init_method.startswith("tcp://"):
        parsed = urllib.parse.urlparse(init_method)
        host, port = parsed.hostname, parsed.port
        if host is None or port is None:
            raise ValueError(f"tensor-parallel rendezvous {init_method!r}: expected tcp://HOST:PORT")
    else:
        raise ValueError(f"ASYNCLLM_TP_INIT_METHOD: {init_method!r} is not supported; use env:// or tcp://HOST:PORT")
    return dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=collective_timeout(),
                         wait_for_workers=False)


def _joined_key(rank: int) -> str:
    return f"asyncllm_tp/joined/{rank}"


def init_distributed(rank: int, world_size: int, store: dist.Store, device_type: str,
                     device_index: int | None = None):
    """Join the process group; returns the gloo group that carries step inputs."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(device_index if device_index is not None else rank % torch.cuda.device_count())
    timeout = collective_timeout()
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    # a group of its own, also on CPU: rank 0's heartbeat may use it while a forward all-reduces
    return dist.new_group(backend="gloo", timeout=timeout)


def agree_on_min(value: int, group) -> int:
    """The smallest value any rank proposes (e.g. KV blocks: every rank must have the same cache)."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def _model_fingerprint(config) -> dict:
    hf = config.hf_config
    fields = ("architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")
    out = {name: getattr(hf, name, None) for name in fields}
    out.update(dtype=str(config.torch_dtype), kvcache_block_size=config.kvcache_block_size,
               tensor_parallel_size=config.tensor_parallel_size, device=config.device)
    return out


def check_same_model(config, rank: int, group) -> None:
    """Every rank must run the same model shape, dtype and cache layout; all ranks raise if not."""
    text = json.dumps(_model_fingerprint(config), sort_keys=True, default=str)
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, torch.tensor([digest], dtype=torch.int64), group=group)
    differ = [r for r, t in enumerate(gathered) if int(t.item()) != int(gathered[0].item())]
    if differ:
        raise ValueError(f"tensor-parallel rank(s) {differ} run a different model or engine options than rank 0 "
                         f"(model shape, dtype, kvcache_block_size and device must match; rank {rank} has {text})")


def send_step(packed: np.ndarray | None, group, header: int | None = None) -> None:
    """Rank 0: broadcast one step's packed inputs (None tells the workers to exit)."""
    if header is None:
        header = _EXIT if packed is None else len(packed)
    dist.broadcast(torch.tensor([header], dtype=torch.int64), src=0, group=group)
    if packed is not None:
        dist.broadcast(torch.from_numpy(packed), src=0, group=group)


def receive_step(group) -> np.ndarray | None:
    """Ranks 1..N-1: the next step's packed inputs, or None when told to exit."""
    length = torch.empty(1, dtype=torch.int64)
    while True:
        dist.broadcast(length, src=0, group=group)
        if int(length.item()) != _HEARTBEAT:
            break
    if int(length.item()) == _EXIT:
        return None
    payload = torch.empty(int(length.item()), dtype=torch.int64)
    dist.broadcast(payload, src=0, group=group)
    return payload.numpy()


class RankDiedError(RuntimeError):
    """A tensor-parallel worker process ended while the engine needed it."""


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

        init_method = os.environ.get("ASYNCLLM_TP_INIT_METHOD")
        if init_method:
            # several machines: rank 0 joins the given rendezvous; the other machines' ranks are
            # started there with `python -m asyncllm.tensor_parallel`
            if os.environ.get("RANK", "0") != "0":
                raise ValueError(f"ASYNCLLM_TP_INIT_METHOD: the engine's process is rank 0, "
                                 f"but RANK={os.environ['RANK']}")
            env_world = os.environ.get("WORLD_SIZE")
            if env_world is not None and int(env_world) != world_size:
                raise ValueError(f"Config.tensor_parallel_size: {world_size}, but WORLD_SIZE={env_world}")
            local_ranks = _parse_ranks(os.environ.get("ASYNCLLM_TP_LOCAL_RANKS", ""), world_size)
            first_device = int(os.environ.get("LOCAL_RANK", "0"))
        else:
            init_method = None  # a free port on 127.0.0.1, picked when the store is made below
            local_ranks = list(range(1, world_size))
            first_device = 0
        if config.device == "cuda" and torch.cuda.device_count() < first_device + 1 + len(local_ranks):
            raise ValueError(f"Config.tensor_parallel_size: {1 + len(local_ranks)} ranks on this machine need as "
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
            waiting = [r for r in waiting if not store.check([_joined_key(r)])]
            if waiting and time.monotonic() > deadline:
                hint = "" if set(waiting) <= set(self.ranks) else \
                    " (ranks on other machines are started with `python -m asyncllm.tensor_parallel`)"
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
                    send_step(None, self.group, header=_HEARTBEAT)
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
    from asyncllm.model_runner import ModelRunner, StepInputs
    if watch_parent:
        _exit_with_parent(os.getppid())
    if config.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if config.device == "cuda":
        torch.cuda.set_device(device_index if device_index is not None else rank % torch.cuda.device_count())
    store = make_store(init_method, rank, world_size)
    store.set(_joined_key(rank), "1")
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


# ---- a worker rank on another machine ----------------------------------------------------------
_NOT_OPTIONS = {"model", "tensor_parallel_size", "hf_config", "torch_dtype", "max_queued_requests"}


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    from asyncllm.config import Config
    parser = argparse.ArgumentParser(
        prog="python -m asyncllm.tensor_parallel",
        description="Run one tensor-parallel worker rank (1..N-1) of an engine whose rank 0 runs elsewhere. "
                    "Rendezvous: --init-method (default $ASYNCLLM_TP_INIT_METHOD or env://, which reads "
                    "MASTER_ADDR and MASTER_PORT). Engine options must match rank 0's.")
    parser.add_argument("--model", required=True, help="the checkpoint directory on this machine")
    parser.add_argument("--rank", type=int, default=os.environ.get("RANK"), help="default: $RANK")
    parser.add_argument("--world-size", type=int, default=os.environ.get("WORLD_SIZE"),
                        help="= rank 0's tensor_parallel_size (default: $WORLD_SIZE)")
    parser.add_argument("--init-method", default=os.environ.get("ASYNCLLM_TP_INIT_METHOD", "env://"))
    parser.add_argument("--local-rank", type=int, default=os.environ.get("LOCAL_RANK"),
                        help="this machine's GPU index for the rank (default: $LOCAL_RANK, else rank %% GPUs)")
    options = parser.add_argument_group("engine options (as given to rank 0)")
    for f in dataclasses.fields(Config):
        if not f.init or f.name in _NOT_OPTIONS:
            continue
        kind = type(f.default)
        options.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None,
                             type=_bool if kind is bool else kind, help=f"default {f.default!r}")
    return parser


def main(argv: list[str] | None = None) -> int:
    from asyncllm.config import Config
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rank is None or args.world_size is None:
        parser.error("--rank and --world-size (or $RANK and $WORLD_SIZE) are required")
    if not 1 <= args.rank < args.world_size:
        parser.error(f"--rank must be in 1..{args.world_size - 1}: rank 0 is the engine's own process")
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s rank {args.rank}: %(message)s")
    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(Config)
               if f.init and f.name not in _NOT_OPTIONS and getattr(args, f.name) is not None}
    config = Config(model=args.model, tensor_parallel_size=args.world_size, **options)
    run_worker(config, args.rank, args.world_size, args.init_method, args.local_rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
