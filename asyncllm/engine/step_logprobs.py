"""A resolved step's log-probabilities as TokenLogprob objects: one per token, the alternatives left as
rows of the step's host arrays (chosen, ranks, top ids, top log-probs)."""
from __future__ import annotations

from asyncllm.outputs import TokenLogprob


def add_prompt_logprobs(plan, host) -> None:
    """Append the prompt positions' scores (runner.sampling_inputs.PromptLogprobsPlan) to their
    sequences' prompt_logprobs."""
    row = 0
    for seq, count, k in plan.spans:
        if not seq.is_finished:
            seq.prompt_logprobs.extend(_token_logprob(host, j, plan.targets[j], k) for j in range(row, row + count))
        row += count


def token_logprobs(ks: list[int], token_ids: list[int], host) -> list[TokenLogprob | None]:
    """Each sampling row's TokenLogprob (None for rows that did not ask: ks[row] < 0)."""
    out, j = [], 0
    for k, token_id in zip(ks, token_ids):
        if k < 0:
            out.append(None)
            continue
        out.append(_token_logprob(host, j, token_id, k))
        j += 1
    return out


def _token_logprob(host, j: int, token_id: int, k: int) -> TokenLogprob:
    """Row j of a step's host logprobs as token_id's TokenLogprob with its k best alternatives."""
    chosen, ranks, top_ids, top_logprobs = host
    return TokenLogprob(token_id, chosen[j], ranks[j], top_ids[j, :k], top_logprobs[j, :k])
