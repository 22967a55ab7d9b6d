"""Constrained steps' token bitmasks: filled on a worker thread while the engine thread goes on,
then uploaded for the sampler.

xgrammar releases the GIL while it fills a mask, so a step's bitmask is filled beside the engine
thread (which resolves the previous step and plans the next meanwhile); the upload waits for the
fill only when the step's sampling is queued. One host buffer (pinned on CUDA) is reused: a fill
first waits for the previous upload out of it.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch


def _fill_in_inference_mode(constraints, host: torch.Tensor) -> None:
    with torch.inference_mode():  # per thread: the buffer is an inference tensor
        constraints.fill(host)


class StepBitmasks:
    def __init__(self, vocab_size: int, device: torch.device):
        self.words = (vocab_size + 31) // 32
        self.device = device
        self._staging: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None  # the last upload out of the staging buffer
        self._filler: ThreadPoolExecutor | None = None

    def fill(self, constraints, wait: bool = False) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """Start filling the bitmask of constraints' rows (structured.step_masks.StepConstraints);
        returns upload(): (the rows, their bitmask) on the device, once filled. wait: filled before
        this returns (a speculative step's fill moves the matchers, which the engine reads next)."""
        host = self._host_buffer(len(constraints.rows))
        if self._filler is None:
            self._filler = ThreadPoolExecutor(1, thread_name_prefix="asyncllm-bitmask")
        filled = self._filler.submit(_fill_in_inference_mode, constraints, host)
        if wait:
            filled.result()

        def upload() -> tuple[torch.Tensor, torch.Tensor]:
            filled.result()
            if self.device.type == "cuda":
                bitmask = host.to(self.device, non_blocking=True)
                self._copied = torch.cuda.Event()
                self._copied.record()
            else:
                bitmask = host.clone()
            # non_blocking: a blocking copy from pageable memory would wait for this step's forward
            return torch.tensor(constraints.rows, dtype=torch.int64).to(self.device, non_blocking=True), bitmask
        return upload

    def _host_buffer(self, num_rows: int) -> torch.Tensor:
        if self._copied is not None:
            self._copied.synchronize()  # the last constrained step's copy out of the buffer
            self._copied = None
        if self._staging is None or self._staging.shape[0] < num_rows:
            self._staging = torch.empty((max(num_rows, 64), self.words), dtype=torch.int32,
                                        pin_memory=self.device.type == "cuda")
        return self._staging[:num_rows]

    def close(self) -> None:
        if self._filler is not None:
            self._filler.shutdown(wait=True)
            self._filler = None
