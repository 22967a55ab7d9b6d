"""Draft-model proposals: a smaller checkpoint with the target's tokenizer (Qwen3-0.6B for Qwen3-8B),
run in the same process, on the same device and in the same dtype, proposes each row's next k
tokens: greedily for a greedy request (point proposals), and for a sampled one drawn from the
draft's own distribution q (the request's temperature, top-k, top-p and min-p over the draft's
logits), returned with q (SampledDrafts) so that the target's rejection sampler accepts with
min(1, p/q) and keeps the target's distribution exactly; those draws come from the proposer's
generator (seeded by Config.seed). A seeded request's drafts are the plain sampler's draws over the
draft's logits with the noise key the target samples that completion index with (layers/sampler.
noise_key), point proposals: its verification is an exact match against the target's keyed token
(layers/rejection_sampler.py), which the shared noise makes a close draft draw mostly (a draft equal
to the target: always), and its output is the plain engine's whatever the speculation schedule.

The proposer owns a second ModelRunner over the draft checkpoint (on CUDA, unless the target is
eager, with CUDA graphs: decode graphs for its one-token steps over up to max_rows rows, mixed ones
up to draft_graph_tokens tokens for the catch-ups after a verification and a pause; a prompt's
catch-up of up to REPLAYED_CATCH_UP_GRAPHS times their tokens replays them in pieces, a longer one
runs eagerly; the target's verification replays the target's mixed graphs, runner/cuda_graph.py), with
a paged KV cache of its own, kept by a BlockManager as the target's is: per request a DraftKV (its
block table, block hashes, and the number of its tokens whose draft KV is valid), full blocks of
valid KV hashed into the draft's prefix cache, so a new request (a chat's next turn) over a cached
prefix feeds the draft only the rest. Each propose() over the speculating rows:
1. catches each row's draft KV up on the tokens added since its last proposal (the prompt less its
   cached prefix at first; after a verification the drafts it accepted, then the target's own
   token): varlen forwards of up to max_num_batched_tokens tokens, the last position's logits give
   the first draft. Drafts it fed itself last time and the target accepted keep their KV;
2. feeds each draft back as one token per forward, k - 1 more forwards batched over the rows, the
   drafts kept on the device in between (the host reads them back once, after the last);
3. the rollback is implicit: the KV past the accepted tokens is overwritten by the next catch-up,
   and whole blocks past what the next proposal needs go back to the pool then (never hashed ones:
   a block is hashed only once full of valid KV of the request's tokens).
A row whose blocks the pool cannot give (or past the draft's max_model_len) gets None: it decodes
one token this step (no error, no wait). release() hands a request's blocks back (it ended, or was
preempted: engine/speculation.py calls it); their hashed blocks stay in the prefix cache.
"""
from __future__ import annotations

import numpy as np
import torch

from asyncllm.config import Config, config_error
from asyncllm.engine.block_manager import BlockManager
from asyncllm.errors import InvalidValueError
from asyncllm.layers.rejection_sampler import speculative_probs
from asyncllm.layers.sampler import Sampler, SamplingTensors, noise_key
from asyncllm.models.tokenizer_loader import load_tokenizer
from asyncllm.models.resolve import resolve_config
from asyncllm.runner.model_runner import ModelRunner
from asyncllm.runner.step_inputs import StepInputs, padded_block_tables
from asyncllm.speculative.proposer import DraftRow, SampledDrafts

FIELD = "speculative_config.model"
# on CUDA, the share of the device's free memory (after the draft's weights) its KV cache may take at
# most; the target's memory probe, which runs after, sees it as used
DRAFT_KV_GPU_SHARE = 0.1
# a catch-up of at most this many of the draft's largest mixed graphs' tokens (a prompt of ~1k
# tokens at the default graphs) runs as replays of them, not as one eager forward: below ~1k tokens
# a forward is launch-bound, and an eager one costs the host's launches of every layer's kernels
# (a few ms for a Qwen3-0.6B-sized draft, against ~1 ms of GPU time for 300 tokens); a longer
# catch-up is compute-bound (its launches hide behind the GPU's work), so eager forwards of up to
# max_num_batched_tokens cost no more than replays of a few hundred tokens each
REPLAYED_CATCH_UP_GRAPHS = 4


def draft_config(target: Config, max_rows: int, resume_tokens: int) -> Config:
    """The draft's Config: the target's device, dtype, block size, attention backend and eagerness;
    CUDA graphs for decode steps of up to max_rows rows and mixed steps of up to
    draft_graph_tokens(max_rows, resume_tokens) tokens; its KV cache sized by draft_kv_blocks (checked: the draft
    directory's config and vocabulary)."""
    spec = target.speculative
    graph_tokens = draft_graph_tokens(max_rows, resume_tokens)
    config = Config(spec.model, max_num_batched_tokens=target.max_num_batched_tokens, max_num_seqs=max_rows,
                    max_model_len=target.max_model_len, enforce_eager=target.enforce_eager,
                    cuda_graph_max_tokens=min(target.cuda_graph_max_tokens, graph_tokens),
                    kvcache_block_size=target.kvcache_block_size,
                    num_kvcache_blocks=1, cpu_kvcache_bytes=target.cpu_kvcache_bytes,
                    dtype=str(target.torch_dtype).removeprefix("torch."), device=target.device,
                    enable_prefix_caching=target.enable_prefix_caching, attention_backend=target.attention_backend,
                    seed=target.seed, kv_cache_dtype=target.kv_cache_dtype, kv_cache_rotation=target.kv_cache_rotation,
                    overlap_scheduling=False)
    try:
        resolve_config(config)
    except Exception as e:  # noqa: BLE001 - a missing or broken config.json: the draft's, so named as such
        raise config_error(FIELD, f"the draft checkpoint {spec.model!r} cannot be read: {e}") from e
    if config.hf_config.vocab_size != target.hf_config.vocab_size:
        raise config_error(FIELD, f"the draft's vocab_size {config.hf_config.vocab_size} is not the target's "
                                  f"{target.hf_config.vocab_size}: a draft must share the target's tokenizer")
    return config


def draft_graph_tokens(max_rows: int, resume_tokens: int) -> int:
    """The draft's largest mixed CUDA graph, in tokens: a catch-up brings each row the draft it never
    fed and the target's token after a verification (2 tokens a row, 2 * max_rows), or a row's tokens
    decoded while its speculation paused (resume_tokens at most: engine/speculation.py's longest pause
    and 2), so that a retry, a probe of whether its drafts pay, is a replay and not an eager forward;
    a prompt's catch-up replays it REPLAYED_CATCH_UP_GRAPHS times at most, a longer one runs eagerly."""
    return max(2 * max_rows, resume_tokens)


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


class DraftKV:
    """One request's draft KV as the BlockManager keeps a sequence's: its tokens (the request's own
    list), block table and block hashes, num_computed_tokens (those whose draft KV is valid), and
    the drafts the proposer fed last time (their KV is valid where the target accepted them)."""
    __slots__ = ("token_ids", "block_size", "block_table", "block_hashes", "num_computed_tokens", "fed",
                 "prompt_int64")

    def __init__(self, token_ids: list[int], block_size: int):
        self.token_ids = token_ids
        self.block_size = block_size
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.num_computed_tokens = 0
        self.fed: list[int] = []
        self.prompt_int64 = None  # no int64 form: the BlockManager converts its blocks' ids as it reads them

    def __len__(self) -> int:
        return len(self.token_ids)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_tokens(self, block_index: int) -> list[int]:
        start = block_index * self.block_size
        return self.token_ids[start:start + self.block_size]


class DraftModelProposer:
    """The Proposer of method "draft_model". Build it before the target's runner: on CUDA the
    target's memory probe then counts the draft's weights and KV cache as used."""
    drafts_cost_forwards = True

    def __init__(self, target: Config, target_tokenizer, max_rows: int, resume_tokens: int):
        """max_rows: the most rows a proposal has; resume_tokens: the most a row's catch-up after a
        pause in its speculation takes (draft_graph_tokens)."""
        config = draft_config(target, max_rows, resume_tokens)
        check_same_tokenizer(config, target_tokenizer)
        k = target.speculative.num_speculative_tokens
        config.num_kvcache_blocks = draft_kv_blocks(config, target, max_rows, k)
        self.config = config
        try:
            self.runner = ModelRunner(config, samples=False)  # _draw samples the draft's logits
        except InvalidValueError as e:
            if e.field != "model":
                raise
            raise config_error(FIELD, f"the draft checkpoint: {e.reason}") from e
        self.block_size = config.kvcache_block_size
        self.max_len = config.max_model_len
        self.vocab_size = config.hf_config.vocab_size
        self.block_manager = BlockManager(self.runner.num_kvcache_blocks, self.block_size,
                                          config.enable_prefix_caching)
        self._held: dict[object, DraftKV] = {}
        # the tokens of a forward that replays the draft's largest mixed graph (0: no graphs, CPU or eager)
        graphs = self.runner.graph_runner
        self.replay_tokens = 0 if graphs is None else graphs.max_mixed_tokens
        self.num_prefix_hit_tokens = 0  # prompt tokens whose draft KV came from the prefix cache
        # the draws of sampled requests without a seed (a seeded one's are keyed: noise_key)
        self.generator = torch.Generator(self.runner.device).manual_seed(target.seed)
        self.sampler = Sampler(self.generator)  # seeded requests' draws, the target's plain ones

    @property
    def num_total_blocks(self) -> int:
        return self.runner.num_kvcache_blocks

    def release(self, request: object) -> None:
        state = self._held.pop(request, None)
        if state is not None:
            self.block_manager.free(state)

    def close(self) -> None:
        self.runner.close()

    def propose(self, rows: list[DraftRow]) -> list[list[int] | None]:
        out: list[list[int] | None] = [None] * len(rows)
        active = []  # (index in rows, row, its state)
        for i, row in enumerate(rows):
            state = self._room(row)
            if state is not None:
                active.append((i, row, state))
        if not active:
            return out
        num_drafts = max(row.max_tokens for _, row, _ in active)
        # the drafts stay on the device until the last is drawn (a step's inputs are the last step's
        # draws): one read-back a proposal, not one per draft
        tokens = torch.zeros((len(active), num_drafts), dtype=torch.int64, device=self.runner.device)
        probs: list[list[torch.Tensor]] = [[] for _ in active]
        tables = padded_block_tables([state.block_table for _, _, state in active])  # each row's, for every forward
        self._catch_up(active, tables, tokens, probs)
        lengths = np.array([len(row.token_ids) for _, row, _ in active], dtype=np.int64)
        for j in range(1, num_drafts):
            going = [n for n, (_, row, _) in enumerate(active) if row.max_tokens > j]
            every = len(going) == len(active)
            logits = self._forward(tokens[:, j - 1] if every else tokens[going, j - 1], lengths[going] + j - 1,
                                   tables if every else tables[going])
            self._draw(logits, [(n, active[n][1]) for n in going], j, tokens, probs)
        drafts = tokens.tolist()
        for n, (i, row, state) in enumerate(active):
            row_drafts, row_probs = drafts[n][:row.max_tokens], probs[n]
            out[i] = SampledDrafts(row_drafts, torch.stack(row_probs)) if row_probs else row_drafts
            state.num_computed_tokens = len(row.token_ids)
            state.fed = row_drafts[:-1]  # the last draft was never fed: its KV is not written
            self.block_manager.commit_computed(state)
        return out

    def _room(self, row: DraftRow) -> DraftKV | None:
        """row's state with its KV rolled back to the tokens still valid (a new one's: its cached
        prefix) and blocks for this proposal (its tokens and all but its last draft); None where the
        pool or max_model_len refuses them."""
        length = len(row.token_ids)
        needed_tokens = length + row.max_tokens - 1
        if row.request is None or needed_tokens > self.max_len:
            return None
        state = self._held.get(row.request)
        is_new = state is None
        if is_new:
            state = self._held[row.request] = DraftKV(row.token_ids, self.block_size)
            self.block_manager.match_prefix(state)
        state.token_ids = row.token_ids
        valid = state.num_computed_tokens
        # the drafts fed last time that the target accepted keep their KV; the last token is always fed
        # (its logits give the first draft)
        for token in state.fed:
            if valid >= length - 1 or row.token_ids[valid] != token:
                break
            valid += 1
        state.num_computed_tokens, state.fed = min(valid, length - 1), []
        needed_blocks = state.num_blocks_for(needed_tokens)
        if needed_blocks - len(state.block_table) > self.block_manager.num_free_blocks:
            if is_new:  # its prefix's blocks go back: it matches again when it has room
                self.release(row.request)
            return None
        if is_new:
            self.num_prefix_hit_tokens += state.num_computed_tokens
        if needed_blocks > len(state.block_table):
            self.block_manager.allocate(state, needed_tokens - state.num_computed_tokens)
        else:  # rolled back: blocks only rejected drafts used
            self.block_manager.truncate(state, needed_tokens)
        return state

    def _catch_up(self, active: list, tables: np.ndarray, tokens: torch.Tensor,
                  probs: list[list[torch.Tensor]]) -> None:
        """Each row's KV over its tokens from its state's valid count on; each row's first draft (into
        tokens' column 0). In forwards of at most max_num_batched_tokens tokens (a long prompt's over
        several, in order), the activation peak the target's memory probe sized; a catch-up of at most
        REPLAYED_CATCH_UP_GRAPHS graphs' tokens (a prompt's, a retry's after a long pause) in forwards
        that replay the draft's mixed graphs."""
        starts = [state.num_computed_tokens for _, _, state in active]
        budget = self.config.max_num_batched_tokens
        total = sum(len(row.token_ids) - start for (_, row, _), start in zip(active, starts))
        if total <= REPLAYED_CATCH_UP_GRAPHS * self.replay_tokens:
            budget = self.replay_tokens
        while True:
            input_ids, positions, query_lens, rows, left = [], [], [], [], budget
            for n, (_, row, state) in enumerate(active):
                take = min(len(row.token_ids) - starts[n], left)
                if take <= 0:
                    continue
                end = starts[n] + take
                input_ids.extend(row.token_ids[starts[n]:end])
                positions.extend(range(starts[n], end))
                query_lens.append(take)
                rows.append(n)
                starts[n], left = end, left - take
            if not rows:
                return
            logits = self._forward(np.array(input_ids, dtype=np.int64), np.array(positions, dtype=np.int64),
                                   tables if len(rows) == len(active) else tables[rows], query_lens)
            # the rows whose last token this forward fed: their first draft
            done = [(r, n) for r, n in enumerate(rows) if starts[n] == len(active[n][1].token_ids)]
            if len(done) < len(rows):
                logits = logits[[r for r, _ in done]] if done else None
            if done:
                self._draw(logits, [(n, active[n][1]) for _, n in done], 0, tokens, probs)

    def _draw(self, logits: torch.Tensor, entries: list[tuple[int, DraftRow]], column: int, tokens: torch.Tensor,
              probs: list[list[torch.Tensor]]) -> None:
        """The next draft of each entry (its index in tokens' rows, its row) from its row of logits,
        into tokens[index, column] on the device: the argmax for a greedy request; for a seeded one
        the plain sampler's draw with the key the target draws that position with (its verification
        is an exact match, layers/rejection_sampler.py: the shared noise makes a draft close to the
        target draw the target's token); for another sampled one a draw from q, appended to its probs."""
        drawn = logits.argmax(dim=-1)
        sampled = [r for r, (_, row) in enumerate(entries) if row.params is not None and row.params.temperature > 0]
        seeded = [r for r in sampled if entries[r][1].params.seed is not None]
        unseeded = [r for r in sampled if entries[r][1].params.seed is None]
        if seeded:
            # the completion index of each row's draft in column: the target draws that position with its key
            keys = [noise_key(row.params.seed, len(row.token_ids) - row.num_prompt_tokens + column)
                    for row in (entries[r][1] for r in seeded)]
            params = SamplingTensors.build([entries[r][1].params for r in seeded], self.vocab_size, logits.device,
                                           keys, list(enumerate(keys)))
            self._put(drawn, seeded, self.sampler.draw(self._rows(logits, seeded), params))
        if unseeded:
            params = SamplingTensors.build([entries[r][1].params for r in unseeded], self.vocab_size, logits.device,
                                           [0] * len(unseeded))
            q = speculative_probs(self._rows(logits, unseeded), params)
            exponentials = torch.empty_like(q).exponential_(generator=self.generator)
            self._put(drawn, unseeded, (q / exponentials).argmax(dim=-1))
            for r, row_q in zip(unseeded, q):
                probs[entries[r][0]].append(row_q)
        indices = [n for n, _ in entries]
        if indices == list(range(len(tokens))):
            tokens[:, column] = drawn
        else:
            tokens[indices, column] = drawn

    @staticmethod
    def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return logits if len(rows) == len(logits) else logits[rows]

    @staticmethod
    def _put(drawn: torch.Tensor, rows: list[int], values: torch.Tensor) -> None:
        if len(rows) == len(drawn):
            drawn.copy_(values)
        else:
            drawn[rows] = values

    def _forward(self, input_ids: np.ndarray | torch.Tensor, positions: np.ndarray, block_tables: np.ndarray,
                 query_lens: list[int] | None = None) -> torch.Tensor:
        """The draft's logits at each row's last fed token (query_lens None: one token a row). input_ids
        on the device: drafts just drawn, fed without the host reading them."""
        query_lens = np.ones(len(block_tables), dtype=np.int32) if query_lens is None else \
            np.asarray(query_lens, np.int32)
        rows = np.repeat(np.arange(len(block_tables)), query_lens)
        last = np.cumsum(query_lens) - 1
        seq_lens = positions[last] + 1
        bs = self.block_size
        slot_mapping = block_tables[rows, positions // bs].astype(np.int64) * bs + positions % bs
        on_device = isinstance(input_ids, torch.Tensor)
        host_ids = np.zeros(len(positions), dtype=np.int64) if on_device else input_ids  # placeholder: never read
        inputs = StepInputs(host_ids, positions, slot_mapping, query_lens, seq_lens.astype(np.int32), block_tables,
                            last)
        return self.runner.forward(inputs, input_ids if on_device else None)
