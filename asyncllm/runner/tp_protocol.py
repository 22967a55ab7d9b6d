"""Tensor parallelism's wire: the rendezvous, the process group, and the per-step protocol.

Each step rank 0 broadcasts one int64 header over a gloo group of its own: the length of the
packed StepInputs that follow, _EXIT (the workers leave their loop) or _HEARTBEAT (nothing to run;
keeps an idle worker's receive from timing out). All ranks' forwards all-reduce through the default
group (NCCL on GPUs, gloo on CPU).

Environment: ASYNCLLM_TP_TIMEOUT_S, seconds a rank waits on a collective or the rendezvous
(default 300). See docs/TENSOR_PARALLEL.md.
"""
from __future__ import annotations

import hashlib
import json
import urllib.parse
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from asyncllm import settings

_EXIT = -1  # step header: the workers leave their loop
HEARTBEAT = -2  # step header: nothing to run; keeps an idle worker's receive from timing out


def collective_timeout() -> timedelta:
    return timedelta(seconds=settings.TP_TIMEOUT_S.read())


def parse_ranks(text: str, world_size: int) -> list[int]:
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
        host, port = settings.MASTER_ADDR.read(), settings.MASTER_PORT.read()
        if host is None or port is None:
            unset = settings.MASTER_ADDR.name if host is None else settings.MASTER_PORT.name
            raise ValueError(f"tensor-parallel rendezvous {init_method}: ${unset} is not set")
    elif init_method.startswith("tcp://"):
        parsed = urllib.parse.urlparse(init_method)
        host, port = parsed.hostname, parsed.port
        if host is None or port is None:
            raise ValueError(f"tensor-parallel rendezvous {init_method!r}: expected tcp://HOST:PORT")
    else:
        raise ValueError(f"ASYNCLLM_TP_INIT_METHOD: {init_method!r} is not supported; use env:// or tcp://HOST:PORT")
    return dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=collective_timeout(),
                         wait_for_workers=False)


def joined_key(rank: int) -> str:
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
              "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
              "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size")
    out = {name: getattr(hf, name, None) for name in fields}
    out.update(dtype=str(config.torch_dtype), kv_cache_dtype=config.kv_cache_dtype,
               kvcache_block_size=config.kvcache_block_size,
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
        if int(length.item()) != HEARTBEAT:
            break
    if int(length.item()) == _EXIT:
        return None
    payload = torch.empty(int(length.item()), dtype=torch.int64)
    dist.broadcast(payload, src=0, group=group)
    return payload.numpy()


class RankDiedError(RuntimeError):
    """A tensor-parallel worker process ended while the engine needed it."""
