"""Speculative decoding (n-gram prompt lookup, draft models) against plain decoding on a copy task, with
the real SmolLM2-135M-Instruct weights shipped for the default model.

    python benchmarks/bench_spec.py [--device cuda] [--batches 1,8,64] [--output-len 256] [--k 4]
                                    [--lookup 2,4] [--modes plain,ngram,draft,random-draft,oracle]
                                    [--draft-model-dir DIR] [--temperature T] [--dtype D] [--json PATH]

The task: the chat model is asked to repeat a text of four passages word for word (a different order per
request of a batch), greedy, max_tokens --output-len, EOS ignored. Prompt lookup then proposes
the passage's next words. Each mode runs in its own process (plain, then speculative with
{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": m, "prompt_lookup_max": n}),
one LLM.generate of the whole batch per --reps after a warm-up; the median's output tokens per second
is the row's figure. Draft-model modes: "draft" with {"model": --draft-model-dir, "num_speculative_tokens": k}
(default: the target itself, the mechanism's ceiling: every proposal accepted), "random-draft" with a
checkpoint of the target's shape and tokenizer but random weights (acceptance near zero: the overhead
floor, where adaptivity must keep the loss small). "oracle": the mechanism's ceiling, every proposal accepted at
no proposing cost (what a draft equal to the target was meant to show; that draft costs the target's forward a
draft, so its own ceiling is ~1x): a proposer installed through the engine's Proposer interface (as the tests
install theirs) drafts each request's next k tokens of its plain greedy output, which this process computes first
with the same engine and speculation opted out per request (SamplingParams(speculate=False)); greedy only. Rows: tok/s, the speculative rows' speedup over plain at the same batch, their
acceptance rate and mean accepted length (tokens a verifying request takes per step), whether
their text equals plain's (greedy: it must), Triton JIT compiles in the timed reps (the warm-up should
meet them all), and for draft models a proposal's mean wall time (what a probe's draft costs) and the
draft's forwards a rep, eager or CUDA-graph replays. --model-dir another checkpoint instead (tests: the tiny one).
--temperature T > 0: seeded sampling at T (request i with seed i) instead of greedy: a seeded request's
drafts are keyed draws (a draft model's, with the target's noise keys) verified by exact match against
the target's own keyed draw (layers/rejection_sampler.py), so "draft" (the target itself) should still
accept nearly every draft, and the text is plain's, as greedy's is (up to rounding between shapes).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import glob
import shutil
import tempfile
import time

import torch
from safetensors.torch import load_file, save_file

from common import (Report, add_ratios, jit_compiled_since, make_parser, median, parse_args, release_memory,
                    speculation_report)

from asyncllm import LLM, SamplingParams
from asyncllm.chat_template import chat_prompt_ids
from asyncllm.kernels import compiled_variants
from asyncllm.speculative.draft_model import DraftModelProposer

MODES = ("plain", "ngram", "draft", "random-draft", "oracle")
PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lamp, a notebook and a "
    "thermos of tea. From the gallery he watched the ships pass along the coast, wrote down their names, the "
    "direction of the wind and the colour of the sea, and at midnight he trimmed the wick before going to bed.",
    "To bake the bread, mix the flour, water, salt and yeast in a large bowl until no dry flour remains. Cover "
    "the dough and let it rise for two hours, folding it twice. Shape it into a round loaf, let it rest for "
    "forty minutes, then bake it in a very hot oven for thirty-five minutes until the crust is deep brown.",
    "The committee met on Tuesday to review the budget for the new library. After a long discussion about the "
    "cost of the roof, the members agreed to delay the reading garden by one year, to buy more books for "
    "children, and to open the building on Sundays from ten in the morning until four in the afternoon.",
    "Rivers carry sand and small stones from the mountains to the sea. Where the water slows down, near the "
    "mouth of the river, the sand settles and slowly builds a delta: a wide, flat plain cut by many channels, "
    "where birds rest on their long journeys and farmers grow rice in the rich, wet soil.",
]


def copy_prompts(llm: LLM, num: int) -> list[list[int]]:
    """num chat prompts asking to repeat a text (each request its own variant: a numbered copy): all
    PASSAGES, request i's from its i-th on, ~280 tokens, so that a copy fills --output-len's default 256
    (one passage, ~70 tokens, left most of the output to text after it that no lookup predicts)."""
    prompts = []
    for i in range(num):
        passage = "\n\n".join(PASSAGES[(i + j) % len(PASSAGES)] for j in range(len(PASSAGES)))
        messages = [{"role": "user", "content": f"Repeat the following text exactly, word for word "
                                                f"(copy {i + 1}):\n\n{passage}"}]
        prompts.append(chat_prompt_ids(llm.core, messages, {"add_generation_prompt": True}))
    return prompts


def random_draft(model_dir: str, out_dir: str) -> str:
    """A copy of model_dir (its config and tokenizer) whose weights are random, each tensor with its own
    mean and spread: a draft of the target's shape that (almost) never proposes the target's token."""
    generator = torch.Generator().manual_seed(0)
    for name in os.listdir(model_dir):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path) and not name.endswith(".safetensors"):
            shutil.copy(path, out_dir)
    for path in glob.glob(os.path.join(model_dir, "*.safetensors")):
        weights = {}
        for key, tensor in load_file(path).items():
            values = tensor.float()
            noise = torch.randn(values.shape, generator=generator)
            weights[key] = (noise * values.std().nan_to_num(0.0) + values.mean()).to(tensor.dtype) \
                if tensor.numel() > 1 else tensor
        save_file(weights, os.path.join(out_dir, os.path.basename(path)), metadata={"format": "pt"})
    return out_dir


class OracleProposer:
    """A speculative-decoding proposer (asyncllm.speculative.proposer.Proposer) that knows each request's
    greedy output: it drafts the next max_tokens tokens of it, found by the request's prompt once and then
    kept under the request (a slice a step: the proposing cost ~0)."""
    drafts_cost_forwards = False  # the ceiling: k drafts from a request's first step

    def __init__(self):
        self.outputs: dict[tuple[int, ...], list[int]] = {}  # prompt -> prompt + its plain greedy output
        self._known: dict[object, list[int]] = {}  # request -> its entry of outputs

    def learn(self, prompts: list[list[int]], outputs: list[list[int]]) -> None:
        self.outputs.update((tuple(p), list(p) + list(o)) for p, o in zip(prompts, outputs))

    def propose(self, rows) -> list[list[int]]:
        drafts = []
        for row in rows:
            full = self._known.get(row.request)
            if full is None:
                full = self._known[row.request] = self.outputs.get(tuple(row.token_ids[:row.num_prompt_tokens]), [])
            drafts.append(full[len(row.token_ids):len(row.token_ids) + row.max_tokens])  # []: unknown, a miss
        return drafts

    def release(self, request) -> None:
        self._known.pop(request, None)

    def close(self) -> None:
        pass


class DraftMeter:
    """A draft model's share of a run: its proposals' wall time (each ends reading its drafts back, so on
    CUDA it holds the draft's device time; the target's last step was resolved before it: a speculating
    step's predecessor is), and its forwards, eager or CUDA-graph replays."""

    def __init__(self, proposer: DraftModelProposer):
        self.proposals, self.seconds, self.forwards = 0, 0.0, 0
        self.graphs = proposer.runner.graph_runner
        propose, forward = proposer.propose, proposer._forward

        def timed_propose(rows):
            start = time.perf_counter()
            try:
                return propose(rows)
            finally:
                self.seconds += time.perf_counter() - start
                self.proposals += 1

        def counted_forward(*inputs):
            self.forwards += 1
            return forward(*inputs)
        proposer.propose, proposer._forward = timed_propose, counted_forward

    def snapshot(self) -> tuple[int, float, int, int]:
        replays = sum(self.graphs.num_replays.values()) if self.graphs is not None else 0
        return self.proposals, self.seconds, self.forwards, replays

    def report(self, before: tuple[int, float, int, int], reps: int) -> dict:
        proposals, seconds, forwards, replays = (now - then for now, then in zip(self.snapshot(), before))
        return dict(draft_ms_per_proposal=seconds * 1e3 / proposals if proposals else None,
                    draft_proposals_per_rep=proposals / reps, draft_eager_forwards_per_rep=(forwards - replays) / reps,
                    draft_replays_per_rep=replays / reps)


def run_mode(args) -> list[dict]:
    """One mode's rows, in this process."""
    # room for every row's drafts: a step's logits rows (one a row, one a draft) stay within max_num_seqs
    options = dict(device=args.device, dtype=args.dtype, max_num_seqs=max(args.batches) * (args.k + 1),
                   enable_prefix_caching=False)
    if args.mode == "ngram":
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.k,
                                         "prompt_lookup_min": args.lookup[0], "prompt_lookup_max": args.lookup[1]}
    elif args.mode in ("draft", "random-draft"):
        options["speculative_config"] = {"model": args.draft_model_dir, "num_speculative_tokens": args.k}
    elif args.mode == "oracle":  # any method makes the engine speculate; its proposer is replaced just below
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.k}
    llm = LLM(args.model_dir, **options)
    oracle = None
    if args.mode == "oracle":
        oracle = llm.core.speculation.proposer = OracleProposer()
    proposer = llm.core.speculation.proposer if llm.core.speculation is not None else None
    meter = DraftMeter(proposer) if isinstance(proposer, DraftModelProposer) else None
    rows = []
    for batch in args.batches:
        params = [SamplingParams(temperature=args.temperature, seed=i if args.temperature > 0 else None,
                                 max_tokens=args.output_len, ignore_eos=True) for i in range(batch)]
        prompts = copy_prompts(llm, batch)
        if oracle is not None:  # the plain greedy output it proposes from (so the warm-up verifies, too)
            plain_params = [SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                                           speculate=False)] * batch
            oracle.learn(prompts, [out["token_ids"] for out in llm.generate(prompts, plain_params, use_tqdm=False)])
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
        times, outputs = [], None
        stats_before, compiled_before = llm.core.stats(), compiled_variants()
        draft_before = meter.snapshot() if meter is not None else None
        for _ in range(args.reps):
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        seconds = median(times)
        num_tokens = sum(len(out["token_ids"]) for out in outputs)
        row = dict(mode=args.mode, batch=batch, output_tokens=num_tokens, seconds=round(seconds, 4),
                   tok_s=num_tokens / seconds, texts=[out["text"] for out in outputs],
                   jit_compiles=jit_compiled_since(compiled_before))
        if meter is not None:
            row.update(meter.report(draft_before, args.reps))
        rows.append(dict(row, **speculation_report(stats_before, llm.core.stats())))
    llm.close()
    del llm
    release_memory()
    return rows


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup", default="2,4", help="prompt_lookup_min,prompt_lookup_max")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--modes", default=None,
                        help=f"comma-separated, of {MODES} (default: all; with --temperature > 0 all but oracle)")
    parser.add_argument("--draft-model-dir", default=None,
                        help="the draft checkpoint of mode 'draft' (default: the target itself)")
    parser.add_argument("--dtype", default="auto",
                        help="Config.dtype (float32: the oracle's ceiling on random weights, whose near-flat bf16 "
                             "argmax flips between a k+1-row verification and a 1-row decode)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy; > 0: seeded sampling at this temperature")
    parser.add_argument("--mode", default=None, choices=MODES, help="(internal: one mode, here)")
    args = parse_args(parser, argv)
    args.batches = [int(b) for b in str(args.batches).split(",")]
    args.lookup = [int(n) for n in str(args.lookup).split(",")]
    if args.model_dir is None:
        from asyncllm.models.default_model import default_model_path
        args.model_dir = default_model_path()
    if args.mode is not None:  # a child: this mode's rows to --json
        rows = run_mode(args)
        with open(args.json, "w") as f:
            json.dump(rows, f)
        return {"results": rows}
    report = Report("spec", args)
    rows = []
    sampled = args.temperature > 0
    modes = [mode for mode in str(args.modes).split(",") if mode] if args.modes is not None else \
        [mode for mode in MODES if not (sampled and mode == "oracle")]
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown or (sampled and "oracle" in modes):
        parser.error(f"--modes: {unknown} not of {MODES}" if unknown else
                     "--modes: oracle proposes greedy output, so it needs --temperature 0")
    for mode in modes:  # each in its own process: nothing of one warms or fragments the other
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            draft = args.draft_model_dir or args.model_dir
            if mode == "random-draft":
                draft = random_draft(args.model_dir, tempfile.mkdtemp(dir=tmp))
            child = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--json", out, "--device", args.device,
                     "--model-dir", args.model_dir, "--batches", ",".join(map(str, args.batches)),
                     "--output-len", str(args.output_len), "--k", str(args.k), "--lookup",
                     ",".join(map(str, args.lookup)), "--reps", str(args.reps), "--draft-model-dir", draft,
                     "--temperature", str(args.temperature), "--dtype", args.dtype]
            done = subprocess.run(child, check=False)
            if done.returncode != 0:
                rows += [dict(mode=mode, batch=b, error=f"exit {done.returncode}") for b in args.batches]
                continue
            with open(out) as f:
                rows += json.load(f)
    plain = {row["batch"]: row for row in rows if row["mode"] == "plain" and "error" not in row}
    for row in rows:
        reference = plain.get(row["batch"])
        if row["mode"] != "plain" and "error" not in row and reference is not None:
            row["same_text"] = row["texts"] == reference["texts"]
    add_ratios(rows, "speedup", "tok_s", {"mode": "plain"}, same=("batch",))
    for row in rows:
        row.pop("texts", None)
        report.add(row)
    report.finish("Speculative decoding (n-gram, draft models) on the SmolLM2 copy task", [
        ("batch", "batch", "{}"), ("mode", "mode", "{}"), ("tok/s", "tok_s", "{:,.0f}"),
        ("speedup", "speedup", "{:.2f}x"), ("acceptance", "acceptance_rate", "{:.2f}"),
        ("mean accepted length", "mean_accepted_length", "{:.2f}"),
        ("speculating share", "speculating_share", "{:.3f}"), ("same text", "same_text", "{}"),
        ("output tokens", "output_tokens", "{:,}"), ("draft ms a proposal", "draft_ms_per_proposal", "{:.2f}"),
        ("draft proposals a rep", "draft_proposals_per_rep", "{:.1f}"),
        ("draft eager forwards a rep", "draft_eager_forwards_per_rep", "{:.1f}"),
        ("draft graph replays a rep", "draft_replays_per_rep", "{:.1f}"), ("JIT compiles (timed)", "jit_compiles", "{}")])
    return report.data


if __name__ == "__main__":
    main()
