"""Draft-model proposals: a smaller checkpoint with the target's tokenizer (Qwen3-0.6B for Qwen3-8B),
run in the same process, on the same device and in the same dtype, proposes each row's next k
tokens greedily. Its proposals are point masses (a function of the tokens so far), so the target's
rejection sampler keeps the target's distribution exactly as it does for prompt lookup.

The proposer owns a second ModelRunner (eager: no CUDA graphs yet) over the draft checkpoint, with
a paged KV cache of its own and, per request, a block table and the number of its tokens whose
draft KV is valid. Each propose() over the speculating rows:
1. catches each row's draft KV up on the tokens added since its last proposal (the prompt at
   first; after a verification the drafts it accepted, then the target's own token): varlen
   forwards of up to max_num_batched_tokens tokens, the last position's argmax the first draft. Drafts it fed
   itself last time and the target accepted keep their KV: only the tokens after them are fed;
2. feeds each draft back as one token per forward, k - 1 more forwards batched over the rows;
3. the rollback is implicit: the KV past the accepted tokens is overwritten by the next catch-up,
   and whole blocks past what the next proposal needs go back to the pool then.
A row whose blocks the pool cannot give (or past the draft's max_model_len) gets None: it decodes
one token this step (no error, no wait). release() hands a request's blocks back (it ended, or was
preempted: engine/speculation.py calls it).
"""
from __future__ import annotations

import numpy as np
import torch

from asyncllm.config import Config, config_error
from asyncllm.errors import InvalidValueError
from asyncllm.models.checkpoint import load_tokenizer
from asyncllm.models.resolve import resolve_config
from asyncllm.runner.model_runner import ModelRunner
from asyncllm.runner.step_inputs import StepInputs
from asyncllm.speculative.proposer import DraftRow

FIELD = "speculative_config.model"
# on CUDA, the share of the device's free memory (after the draft's weights) its KV cache may take at
# most; the target's memory probe, which runs after, sees it as used
DRAFT_KV_GPU_SHARE = 0.1


def draft_config(target: Config, max_rows: int) -> Config:
    """The draft's Config: the target's device, dtype, block size and attention backend; eager; its
    KV cache sized by draft_kv_blocks (checked: the draft directory's config and vocabulary)."""
    spec = target.speculative
    config = Config(spec.model, max_num_batched_tokens=target.max_num_batched_tokens, max_num_seqs=max_rows,
                    max_model_len=target.max_model_len, enforce_eager=True, kvcache_block_size=target.kvcache_block_size,
                    num_kvcache_blocks=1, cpu_kvcache_bytes=target.cpu_kvcache_bytes,
                    dtype=str(target.torch_dtype).removeprefix("torch."), device=target.device,
                    enable_prefix_caching=False, attention_backend=target.attention_backend, seed=target.seed,
                    kv_cache_dtype=target.kv_cache_dtype,
                    kv_cache_rotation=target.kv_cache_rotation, overlap_scheduling=False)
    try:
        resolve_config(config)
    except Exception as e:  # noqa: BLE001 - a missing or broken config.json: the draft's, so named as such
        raise config_error(FIELD, f"the draft checkpoint {spec.model!r} cannot be read: {e}") from e
    if config.hf_config.vocab_size != target.hf_config.vocab_size:
        raise config_error(FIELD, f"the draft's vocab_size {config.hf_config.vocab_size} is not the target's "
                                  f"{target.hf_config.vocab_size}: a draft must share the target's tokenizer")
    return config


def check_same_tokenizer(config: Config, target_tokenizer) -> None:
    """The draft directory's tokenizer maps every token as the target's does."""
    try:
        tokenizer = load_tokenizer(config.model)
    except Exception as e:  # noqa: BLE001 - load_tokenizer names "model": here it is the draft's
        raise config_error(FIELD, f"the draft checkpoint {config.model!r} has no loadable tokenizer: {e}") from e
    if tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise config_error(FIELD, f"the tokenizer in {config.model!r} is not the target's (their vocabularies "
                                  "differ): a draft must share the target's tokenizer")


def draft_kv_blocks(config: Config, target: Config, max_rows: int, k: int) -> int:
    """The draft's KV blocks: as many as the target's where that is set; else enough for max_rows
    sequences of max_model_len (more never speculate at once), capped by cpu_kvcache_bytes on CPU
    (as the target's cache is sized there) or DRAFT_KV_GPU_SHARE of the free device memory."""
    if target.num_kvcache_blocks > 0:
        return target.num_kvcache_blocks
    hf = config.hf_config
    heads = hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    block_bytes = 2 * hf.num_hidden_layers * config.kvcache_block_size * kv_heads * head_dim * \
        config.kv_cache_torch_dtype.itemsize
    needed = max_rows * -(-(config.max_model_len + k) // config.kvcache_block_size)
    if config.device == "cpu":
        budget = config.cpu_kvcache_bytes
    else:
        budget = DRAFT_KV_GPU_SHARE * torch.cuda.mem_get_info()[0]
    return max(1, min(needed, int(budget // block_bytes)))


class DraftModelProposer:
    """The Proposer of method "draft_model". Build it before the target's runner: on CUDA the
    target's memory probe then counts the draft's weights and KV cache as used."""

    def __init__(self, target: Config, target_tokenizer, max_rows: int):
        config = draft_config(target, max_rows)
        check_same_tokenizer(config, target_tokenizer)
        k = target.speculative.num_speculative_tokens
        config.num_kvcache_blocks = draft_kv_blocks(config, target, max_rows, k)
        self.config = config
        try:
            self.runner = ModelRunner(config)
        except InvalidValueError as e:
            if e.field != "model":
                raise
            raise config_error(FIELD, f"the draft checkpoint: {e.reason}") from e
        self.block_size = config.kvcache_block_size
        self.max_len = config.max_model_len
        self.free_blocks = list(range(self.runner.num_kvcache_blocks - 1, -1, -1))
        # request -> [its blocks, tokens whose draft KV is valid, drafts it fed (valid if accepted)]
        self._held: dict[object, list] = {}

    @property
    def num_total_blocks(self) -> int:
        return self.runner.num_kvcache_blocks

    def release(self, request: object) -> None:
        state = self._held.pop(request, None)
        if state is not None:
            self.free_blocks.extend(state[0])

    def close(self) -> None:
        self.runner.close()

    def propose(self, rows: list[DraftRow]) -> list[list[int] | None]:
        out: list[list[int] | None] = [None] * len(rows)
        active = []  # (index in rows, row, its state, the first token to feed)
        for i, row in enumerate(rows):
            state = self._room(row)
            if state is not None:
                active.append((i, row, state, state[1]))
        if not active:
            return out
        drafts = self._catch_up(active)
        for j in range(1, max(row.max_tokens for _, row, _, _ in active)):
            going = [(n, entry) for n, entry in enumerate(active) if entry[1].max_tokens > j]
            tokens = self._step([(entry[2][0], len(entry[1].token_ids) + j - 1, drafts[n][-1]) for n, entry in going])
            for (n, _), token in zip(going, tokens):
                drafts[n].append(token)
        for (i, row, state, _), row_drafts in zip(active, drafts):
            out[i] = row_drafts
            state[1] = len(row.token_ids)
            state[2] = row_drafts[:-1]  # the last draft was never fed: its KV is not written
        return out

    def _room(self, row: DraftRow) -> list | None:
        """row's state with its KV rolled back to the tokens still valid and blocks for this proposal
        (its tokens and all but its last draft); None where the pool or max_model_len refuses them."""
        length = len(row.token_ids)
        needed_tokens = length + row.max_tokens - 1
        if row.request is None or needed_tokens > self.max_len:
            return None
        state = self._held.get(row.request)
        if state is None:
            state = self._held[row.request] = [[], 0, []]
        blocks, valid, fed = state
        # the drafts fed last time that the target accepted keep their KV; the last token is always fed
        # (its logits give the first draft)
        for token in fed:
            if valid >= length - 1 or row.token_ids[valid] != token:
                break
            valid += 1
        state[1], state[2] = min(valid, length - 1), []
        needed_blocks = -(-needed_tokens // self.block_size)
        if needed_blocks - len(blocks) > len(self.free_blocks):
            return None
        while len(blocks) < needed_blocks:
            blocks.append(self.free_blocks.pop())
        while len(blocks) > needed_blocks:  # rolled back: blocks only rejected drafts used
            self.free_blocks.append(blocks.pop())
        return state

    def _catch_up(self, active: list) -> list[list[int]]:
        """Each row's KV over its tokens from its state's valid count on; each row's first draft. In
        forwards of at most max_num_batched_tokens tokens (a long prompt's over several, in order), the
        activation peak the target's memory probe sized."""
        firsts: list[list[int]] = [[] for _ in active]
        starts = [start for _, _, _, start in active]
        budget = self.config.max_num_batched_tokens
        while True:
            input_ids, positions, query_lens, seq_lens, tables, rows, left = [], [], [], [], [], [], budget
            for n, (_, row, state, _) in enumerate(active):
                take = min(len(row.token_ids) - starts[n], left)
                if take <= 0:
                    continue
                end = starts[n] + take
                input_ids.extend(row.token_ids[starts[n]:end])
                positions.extend(range(starts[n], end))
                query_lens.append(take)
                seq_lens.append(end)
                tables.append(state[0])
                rows.append(n)
                starts[n], left = end, left - take
            if not rows:
                return firsts
            tokens = self._forward(input_ids, positions, query_lens, seq_lens, tables, np.cumsum(query_lens) - 1)
            for n, token in zip(rows, tokens):
                if starts[n] == len(active[n][1].token_ids):  # the row's last token: its first draft
                    firsts[n] = [token]

    def _step(self, rows: list[tuple[list[int], int, int]]) -> list[int]:
        """One token each of rows (block table, position, token): each row's next draft."""
        tables = [blocks for blocks, _, _ in rows]
        positions = [position for _, position, _ in rows]
        return self._forward([token for _, _, token in rows], positions, [1] * len(rows),
                             [p + 1 for p in positions], tables, np.arange(len(rows)))

    def _forward(self, input_ids, positions, query_lens, seq_lens, tables, logits_indices) -> list[int]:
        positions = np.asarray(positions, dtype=np.int64)
        query_lens = np.asarray(query_lens, dtype=np.int32)
        rows = np.repeat(np.arange(len(tables)), query_lens)
        block_tables = np.zeros((len(tables), max(map(len, tables))), dtype=np.int32)
        for r, blocks in enumerate(tables):
            block_tables[r, :len(blocks)] = blocks
        bs = self.block_size
        slot_mapping = block_tables[rows, positions // bs].astype(np.int64) * bs + positions % bs
        inputs = StepInputs(np.asarray(input_ids, dtype=np.int64), positions, slot_mapping, query_lens,
                            np.asarray(seq_lens, dtype=np.int32), block_tables,
                            np.asarray(logits_indices, dtype=np.int64))
        return self.runner.forward(inputs).argmax(dim=-1).tolist()
