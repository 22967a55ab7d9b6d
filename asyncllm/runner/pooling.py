"""A step's pooling on the device: the hidden-state sums of its embedding rows (engine/pooling.py
plans which tokens each row sums and turns the sums into vectors)."""
from __future__ import annotations

import torch

from asyncllm.runner.host_upload import upload_arrays


def pooled_sums(hidden_states: torch.Tensor, token_index: torch.Tensor, row_of_token: torch.Tensor,
                num_rows: int) -> torch.Tensor:
    """(num_rows, hidden) float32: row r is the sum of hidden_states[token_index[i]] over the i with
    row_of_token[i] == r, summed in float32 (bf16 hidden states included)."""
    selected = hidden_states.index_select(0, token_index).float()
    sums = torch.zeros(num_rows, hidden_states.shape[1], dtype=torch.float32, device=hidden_states.device)
    return sums.index_add_(0, row_of_token, selected)


class StepPooling:
    """One step's pooling: its plan (a PoolingPlan: token_index, row_of_token, num_rows), the plan's
    index arrays on the device, and the sums once the forward has run (pool)."""
    __slots__ = ("plan", "token_index", "row_of_token", "sums")

    def __init__(self, plan, device: torch.device):
        self.plan = plan
        self.token_index, self.row_of_token = upload_arrays([plan.token_index, plan.row_of_token], device)
        self.sums: torch.Tensor | None = None

    def pool(self, hidden_states: torch.Tensor) -> None:
        """Queue the sums over the step's final-norm hidden states (the model's output)."""
        self.sums = pooled_sums(hidden_states, self.token_index, self.row_of_token, self.plan.num_rows)
