"""Helpers several test files share (fixtures shared by all of them are in conftest.py); the tiny
checkpoints tests and benchmarks both build are in asyncllm/testing.py."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from asyncllm import SamplingParams


@pytest.fixture(params=["asyncio", "trio"], name="anyio_backend")
def anyio_asyncio_and_trio(request):
    """Import into a test file to run its async tests on both (conftest's anyio_backend: asyncio only)."""
    return request.param


def seed_every_test(seed: int):
    """An autouse fixture seeding torch before each test of the file that assigns it."""
    @pytest.fixture(autouse=True)
    def _seed():
        torch.manual_seed(seed)
    return _seed


class ManualClock:
    """A fake clock for an engine core's deadlines (SamplingParams.timeout) that moves only when the
    test sets `now`. install() puts it in (through monkeypatch where given: undone after the test)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def install(self, core, monkeypatch=None):
        _set(monkeypatch, core.deadlines, "clock", self)
        return self


class StepClock(ManualClock):
    """A fake deadline clock that moves one second after each step the core launches: a timeout
    counts steps, whatever the machine's speed."""

    def install(self, core, monkeypatch=None):
        super().install(core, monkeypatch)
        launch = core.launch_step

        def launch_and_tick() -> None:
            launch()
            self.now += 1.0
        _set(monkeypatch, core, "launch_step", launch_and_tick)
        return self


def _set(monkeypatch, target, name: str, value) -> None:
    if monkeypatch is None:
        setattr(target, name, value)
    else:
        monkeypatch.setattr(target, name, value)


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "asyncllm-engine" and t.is_alive()]


def assert_all_blocks_free(engine) -> None:
    """Every KV block of an LLM (or an EngineCore) is back in the free pool, none referenced, and
    the runner keeps nothing of any request."""
    core = getattr(engine, "core", engine)
    bm = core.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks
    assert all(block.ref_count == 0 for block in bm.blocks)
    sampling = getattr(core.runner, "sampling_inputs", None)  # None once closed
    if sampling is not None:  # and the runner's request table has let every request go, penalty slots too
        assert len(sampling.table) == 0, sampling.table.entries
        assert len(sampling.token_counts.free_slots) == sampling.token_counts.capacity


def serve_command() -> list[str]:
    script = shutil.which("asyncllm", path=os.path.dirname(sys.executable))
    return [script] if script else [sys.executable, "-m", "asyncllm.cli"]


def wait_healthy(base: str, proc: subprocess.Popen, log_path: str, timeout: float = 180.0) -> None:
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}:\n{open(log_path).read()[-4000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"the server was not healthy after {timeout} s:\n{open(log_path).read()[-4000:]}")


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment_without_api_key() -> dict[str, str]:
    """This process's environment less ASYNCLLM_API_KEY: for a server that must run without a key."""
    return {k: v for k, v in os.environ.items() if k != "ASYNCLLM_API_KEY"}


def stop_process(proc) -> None:
    """Stop a server subprocess as Ctrl-C would, and kill it if it does not exit in 20 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class LiveServer:
    """A running `asyncllm serve` subprocess: its base URL, port, process (for signals) and log file."""

    def __init__(self, proc: subprocess.Popen, port: int, log_path: str):
        self.proc, self.port, self.log_path = proc, port, log_path
        self.base = f"http://127.0.0.1:{port}"

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()


@contextlib.contextmanager
def live_server(model: str | None, log_dir, *options: str, env: dict | None = None,
                healthy_within: float | None = 180.0, exit_codes: tuple[int, ...] = (0,),
                launcher: list[str] | None = None):
    """`asyncllm serve MODEL --port <free port> *options` with its output in log_dir/server.log, as a
    LiveServer once /health answers 200 (healthy_within None: at once, for a test that watches the
    start-up itself). On leaving, the server is stopped as Ctrl-C would (if it still runs) and its exit
    status must be one of exit_codes. model None: the server's default model. env: the server's
    whole environment (None: this one's). launcher: what runs in place of the `asyncllm` command."""
    port = free_port()
    log_path = os.path.join(str(log_dir), "server.log")
    cmd = (launcher or serve_command()) + ["serve", *([model] if model else []), "--port", str(port), *options]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = LiveServer(proc, port, log_path)
    try:
        if healthy_within is not None:
            wait_healthy(server.base, proc, log_path, timeout=healthy_within)
        yield server
    finally:
        stop_process(proc)
    assert proc.returncode in exit_codes, f"the server exited with {proc.returncode}:\n{server.log()[-4000:]}"


def read_until_closed(sock: socket.socket, limit: float) -> bytes:
    """What the server sends until it closes the connection; fails if it is still open after `limit` s."""
    sock.settimeout(limit)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        raise AssertionError(f"the connection was still open after {limit} s; got {data[:200]!r}") from None
    return data


# ---- comparing two engines' greedy runs (GPU tests: bf16, tensor parallelism) --------------------
def generate_with_logits(llm, prompts: list[list[int]], params, outputs: list | None = None
                          ) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """llm.generate(prompts, params), plus the logits each request sampled from at each of its steps
    (float32, on the device), in prompt order; outputs, if given, receives generate's outputs. A step recomputed after preemption keeps the logits it
    first had. Prompts must differ from each other: requests are matched to prompts by their ids.
    Not for constrained requests (their steps sample later, outside ModelRunner.sample)."""
    runner = llm.core.runner
    captured: dict[tuple[tuple[int, ...], int], torch.Tensor] = {}
    launch, sample = runner.launch, runner.sample

    def capturing_launch(plan, prev, **kwargs):
        # before the launch, a sequence's length counts the token this step samples from these logits
        rows = [item.seq for item in plan.engine_step.scheduled if item.samples]  # one row each (no drafts)

        def capture(logits, sampling):
            for row, seq in enumerate(rows):
                key = (tuple(seq.token_ids[:seq.num_prompt_tokens]), len(seq) - seq.num_prompt_tokens)  # in flight counted
                captured.setdefault(key, logits[row].float().clone())
            return sample(logits, sampling)  # the sampler graphs' path too, where the step takes it
        runner.sample = capture
        try:
            return launch(plan, prev, **kwargs)
        finally:
            del runner.sample  # the bound method again

    if len({tuple(p) for p in prompts}) != len(prompts):
        raise ValueError("prompts: every prompt must differ (requests are matched to prompts by their ids)")
    runner.launch = capturing_launch
    try:
        results = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del runner.launch  # the bound method again
    if outputs is not None:
        outputs.extend(results)
    tokens = [o["token_ids"] for o in results]
    logits = [[captured[(tuple(p), step)] for step in range(len(t))] for p, t in zip(prompts, tokens)]
    return tokens, logits


def random_prompts(n: int, seed: int, lo: int = 5, hi: int = 300) -> list[list[int]]:
    """n prompts of random ids below 100,000, with lengths drawn from [lo, hi)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 100000, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first token where a and b differ (the shorter length if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def assert_greedy_runs_match(reference: tuple, other: tuple, logits_rtol: float) -> dict:
    """Two greedy runs of the same prompts (tokens, logits per step, from generate_with_logits) agree
    up to rounding: at every step both saw the same tokens so far, the logits differ by at most
    logits_rtol (relative L2 norm), and where the chosen tokens differ the reference ranked the two
    within a near-tie (a gap under 5 * logits_rtol of its logits' standard deviation) -- rounding
    may flip such a choice, a real bug moves the logits past the tolerance. Returns statistics."""
    ref_tokens, ref_logits = reference
    tokens, logits = other
    if len(ref_tokens) != len(tokens):
        raise AssertionError(f"{len(ref_tokens)} reference sequences, {len(tokens)} compared")
    problems, divergences, worst_rtol = [], [], 0.0
    for i, (ra, rl, oa, ol) in enumerate(zip(ref_tokens, ref_logits, tokens, logits)):
        if len(ra) != len(oa):
            problems.append(f"sequence {i}: {len(ra)} tokens vs {len(oa)}")
            continue
        diverge = first_divergence(ra, oa)
        divergences.append(diverge)
        for step in range(min(diverge + 1, len(ra))):  # the steps where both had the same context
            rtol = ((ol[step] - rl[step]).norm() / rl[step].norm()).item()
            worst_rtol = max(worst_rtol, rtol)
            if not rtol <= logits_rtol:
                problems.append(f"sequence {i} step {step}: logits differ by {rtol:.2e} (relative), "
                                f"over {logits_rtol:.0e}")
                break
        else:
            if diverge < len(ra):
                ref_logits_there = rl[diverge]
                gap = (ref_logits_there[ra[diverge]] - ref_logits_there[oa[diverge]]).item()
                scale = ref_logits_there.std().item()
                if gap > 5 * logits_rtol * scale:
                    problems.append(f"sequence {i} step {diverge}: token {oa[diverge]} instead of {ra[diverge]}, "
                                    f"which led by {gap:.3g} (logits' std {scale:.3g}): not a near-tie")
    if problems:
        raise AssertionError("greedy runs differ beyond rounding:\n  " + "\n  ".join(problems))
    total = sum(len(t) for t in ref_tokens)
    num_identical = sum(d == len(t) for d, t in zip(divergences, tokens))
    return dict(num_sequences=len(tokens), num_identical=num_identical, first_divergences=divergences,
                worst_logits_rtol=worst_rtol,
                token_agreement=sum(x == y for a, b in zip(ref_tokens, tokens) for x, y in zip(a, b)) / max(total, 1),
                summary=f"{num_identical}/{len(tokens)} sequences identical, first divergences {divergences}, "
                        f"worst logits error {worst_rtol:.1e}")


class LaunchRecorder:
    """Stands in for a Triton kernel: `kernel[grid](*args, **kwargs)` appends (kernel, args, kwargs) to
    launches instead of launching (the sm_90 compile-only tests build each recorded launch)."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


def compile_for_sm90_in_subprocess(module: str, function: str) -> int:
    """tests/<module>.<function>() in a fresh interpreter where Triton compiles for real
    (TRITON_INTERPRET=0, ASYNCLLM_KERNELS_AOT=1): the CPU interpreter never compiles, so compile-only
    errors surface on CPU this way. Returns the count the function printed; skips where Triton ships
    no ptxas."""
    import triton  # here, not at the top: test modules choose Triton's interpreter before its first import
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("triton ships no ptxas here")
    env = dict(os.environ, TRITON_INTERPRET="0", ASYNCLLM_KERNELS_AOT="1")
    script = f"import sys; sys.path.insert(0, sys.argv[1]); import {module}; print({module}.{function}())"
    result = subprocess.run([sys.executable, "-c", script, os.path.dirname(os.path.abspath(__file__))], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return int(result.stdout.split()[-1])


# ---- a local stand-in for the Hugging Face hub ---------------------------------------------------
def lay_out_in_hub_cache(checkpoint_dir: str, hub_cache: str, repo_id: str, revision: str = "main",
                         commit: str = "0123456789abcdef0123456789abcdef01234567") -> str:
    """Put a checkpoint directory's files into huggingface_hub's cache layout, as a download leaves
    them: models--ORG--NAME/blobs/<hash> (the files), snapshots/<commit>/<name> (symlinks into
    blobs/) and refs/<revision> (the commit). Returns the snapshot directory."""
    import hashlib
    repo = os.path.join(hub_cache, "models--" + repo_id.replace("/", "--"))
    blobs, snapshot = os.path.join(repo, "blobs"), os.path.join(repo, "snapshots", commit)
    os.makedirs(blobs, exist_ok=True)
    os.makedirs(snapshot, exist_ok=True)
    for name in os.listdir(checkpoint_dir):
        with open(os.path.join(checkpoint_dir, name), "rb") as f:
            data = f.read()
        blob = hashlib.sha256(data).hexdigest()
        with open(os.path.join(blobs, blob), "wb") as f:
            f.write(data)
        os.symlink(os.path.join("..", "..", "blobs", blob), os.path.join(snapshot, name))
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", revision), "w") as f:
        f.write(commit)  # no newline: huggingface_hub reads the file whole
    return snapshot


# ---- a random model made to write a reasoning block (tests/test_reasoning.py, test_server_reasoning.py) ----
MESSAGES_SAY_HI = [{"role": "user", "content": "Say hi."}]
WORDS = [" apple", " banana", " cherry"]
ANSWER_WORD = " done"
THINKING = ["<think>", *WORDS, "</think>", ANSWER_WORD]  # Qwen3's tags: single tokens


def chat_prompt(tokenizer, messages=MESSAGES_SAY_HI, **template_kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def token(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def forced(tokenizer, sequence: list[str], **kwargs):
    """SamplingParams under which greedy sampling emits the single tokens of `sequence` in order, then
    repeats the first: logit biases 100, 92, ..., 60, and a repetition penalty of 2 that halves a
    token's biased logit once it has appeared (the first, at 50, stays under the last's 60; the
    model's own logits, within a few units, never reorder biases 8 apart). 6 tokens at most."""
    bias = {token(tokenizer, text): 100.0 - 8 * i for i, text in enumerate(sequence)}
    assert len(bias) == len(sequence) <= 6
    return SamplingParams(**{"temperature": 0, "max_tokens": 10, "logit_bias": bias, "repetition_penalty": 2.0,
                             **kwargs})


def live_server_client(base: str, timeout: float = 120, api_key: str = "none"):
    """The official openai client for a real `asyncllm serve` that module-scoped fixtures share
    between tests: no kept-alive connections, so a gap between two tests longer than the server's
    keep-alive timeout (a busy machine, a slow fixture) cannot hand the next request a connection
    the server is closing; and no retries, so every error a test provokes reaches it."""
    import httpx
    import openai
    http = httpx.Client(timeout=timeout, limits=httpx.Limits(max_keepalive_connections=0))
    return openai.OpenAI(base_url=base + "/v1", api_key=api_key, max_retries=0, http_client=http)


class ScriptedProposer:
    """A speculative-decoding proposer (asyncllm.speculative.proposer.Proposer) that drafts from known
    outputs (the plain engine's), every third draft with its second token changed: drafts accepted
    whole, and drafts rejected after their first token."""
    drafts_cost_forwards = False  # k drafts from a request's first step, as n-gram's

    def __init__(self, prompts_and_outputs):
        self.expected = [(list(p), list(p) + list(o)) for p, o in prompts_and_outputs]
        self.num_calls = 0

    def propose(self, rows) -> list[list[int]]:
        drafts = []
        for row in rows:
            self.num_calls += 1
            full = next(full for prompt, full in self.expected if row.token_ids[:len(prompt)] == prompt)
            draft = full[len(row.token_ids):len(row.token_ids) + row.max_tokens]
            if self.num_calls % 3 == 0 and len(draft) > 1:
                draft[1] = (draft[1] + 1) % 1000
            drafts.append(draft)
        return drafts

    def release(self, request) -> None:
        pass

    def close(self) -> None:
        pass
