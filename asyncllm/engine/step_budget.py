"""Latency under load: how many prefill tokens a step may take so that it ends within a target time.

While streams decode, every step's time is every stream's inter-token gap. A step that takes a
whole long prompt stalls them all for it (Sarathi-Serve's "generation stall"). So the scheduler
takes the decodes first and then prefill chunks only up to a budget that follows from a target
step time and a model of what a step costs, measured at start-up (CUDA) and learned online from
the engine's own steps that prefill:

    predicted_ms(p, d) = a + b * p + c * d      p: prefill tokens, d: decoding sequences

    prefill_budget = clamp((target_ms - a - c * (d + w)) / b, share * target_ms / b, max_num_batched_tokens)

w counts the prompts not yet decoding (being prefilled or waiting; d + w at most max_num_seqs):
the budget is planned for the decodes the engine is about to run, not only those it runs now.
Sized for today's decodes alone, it is largest exactly when a burst arrives (few streams decode
yet), so the burst is prefilled faster than a full engine can go on prefilling; the streams then
finish, and their follow-ups (a chat's next turn, a client's next request) come back as a wave
at that faster pace, which the smaller budget of the full engine cannot absorb: the queue, and
with it the time to first token, grows with every wave. Planned for d + w, the pace is the same
from a burst's first step to the steady state, and arrivals find a short queue.

The floor, share (1/2) of the target's time, keeps prefill moving when the decodes alone cost more
than the target (the target cannot hold then; the queue must not stall behind it), and never less
than one chunk (min_chunk), so a waiting prefill advances every step. The cost of the KV read per
decode grows with context length; the model has no term for it: its exponential forgetting lets c
follow the current mix of contexts instead, which costs nothing per step.
"""
from __future__ import annotations

import collections
import math
import time

import torch

# AsyncLLMEngine's default Config.target_step_ms. With overlapped steps a stream's inter-token gap is
# one step, plus the jitter of the host's part and of event-loop wake-ups (1-2 ms at p99). The
# issue's goal for streaming apps is ITL p99 <= 10 ms (64 streams, 1,024-token prompts), so the
# step aims at 8 ms; the offline LLM keeps None (throughput first).
STREAMING_TARGET_STEP_MS = 8.0

# features are scaled so that the normal equations stay well conditioned (p reaches 16k, d 512)
_P_SCALE = 1e-3
_D_SCALE = 1e-2


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting for the k x k (k <= 3) normal equations."""
    k = len(rhs)
    m = [row[:] + [r] for row, r in zip(matrix, rhs)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, k):
            f = m[r][col] / m[col][col]
            for c in range(col, k + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * k
    for r in range(k - 1, -1, -1):
        x[r] = (m[r][k] - sum(m[r][c] * x[c] for c in range(r + 1, k))) / m[r][r]
    return x


class StepTimeModel:
    """predicted step ms = a + b * prefill_tokens + c * num_decodes, fitted by exponentially
    weighted least squares (each step's weight decays by `decay` per later step, so the model
    follows drifts in context length or clocks within ~1 / (1 - decay) steps).

    Robustness: the first `skip_first` observations are dropped (a fresh engine's first steps
    include kernel JIT compiles); once fitted, an observation is clipped at 3x its prediction
    (a GC pause or a compile must not drag the model for hundreds of steps); coefficients are kept
    non-negative (a negative one is pinned at 0 and the others refitted); a small ridge keeps the
    fit defined while the steps do not yet vary in both p and d.
    """

    def __init__(self, decay: float = 0.98, min_observations: int = 8, skip_first: int = 3):
        self.decay = decay
        self.min_observations = min_observations
        self.skip_first = skip_first
        self.num_observations = 0  # all of them, skipped ones included
        # weighted sums of x x^T, x y for x = (1, p * _P_SCALE, d * _D_SCALE): the online steps'
        # (decaying) and the start-up calibration's (kept, see calibrate)
        self._xx = [[0.0] * 3 for _ in range(3)]
        self._xy = [0.0] * 3
        self._prior_xx = [[0.0] * 3 for _ in range(3)]
        self._prior_xy = [0.0] * 3
        self.a = self.b = self.c = 0.0  # ms, ms per prefill token, ms per decoding sequence
        self.fitted = False
        self.last_step_ms: float | None = None  # the latest measured step, unclipped

    @property
    def ready(self) -> bool:
        """Fitted on enough steps, with a positive cost per prefill token (so, some prefill steps)."""
        return self.fitted

    def predict(self, num_prefill_tokens: int, num_decodes: int) -> float:
        return self.a + self.b * num_prefill_tokens + self.c * num_decodes

    def observe(self, num_prefill_tokens: int, num_decodes: int, step_ms: float) -> None:
        self.num_observations += 1
        self.last_step_ms = step_ms
        if self.num_observations <= self.skip_first or not step_ms > 0:
            return
        if self.fitted:
            step_ms = min(step_ms, 3.0 * self.predict(num_prefill_tokens, num_decodes) + 0.5)
        self._add(num_prefill_tokens, num_decodes, step_ms)
        if self.num_observations - self.skip_first >= self.min_observations:
            self._fit()

    # weight of each calibration step in every later fit, against the online steps' ~1 / (1 - decay)
    CALIBRATION_WEIGHT = 1.0

    def calibrate(self, steps: list[tuple[int, int, float]]) -> None:
        """Start from measured steps, (prefill tokens, decodes, ms) of varied shapes taken after a
        warm-up (calibration_shapes): the costs are then known before the first request, so a burst
        that arrives at a fresh engine is paced as the full engine will be. (Learned online alone,
        the first prefill steps are the skipped ones, which compile kernels, and the cost per decode
        stays unknown while a burst is prefilled: its prompts went in faster than the engine could
        keep up once they decoded, and came back as a wave that queued.)

        The calibration stays in every later fit, never forgotten: under load the online steps'
        prefill sizes barely vary (the budget sets them), which leaves the cost per token and the
        fixed cost inseparable online; the calibration's varied shapes keep the slope, and the
        online steps move the fit where the engine runs now."""
        for num_prefill_tokens, num_decodes, step_ms in steps:
            self._add(num_prefill_tokens, num_decodes, step_ms, prior=True)
        self.num_observations = max(self.num_observations, self.skip_first)
        self._fit()

    def _add(self, num_prefill_tokens: int, num_decodes: int, step_ms: float, prior: bool = False) -> None:
        x = (1.0, num_prefill_tokens * _P_SCALE, num_decodes * _D_SCALE)
        keep, weight = (1.0, self.CALIBRATION_WEIGHT) if prior else (self.decay, 1.0)
        xx, xy = (self._prior_xx, self._prior_xy) if prior else (self._xx, self._xy)
        for i in range(3):
            row = xx[i]
            for j in range(3):
                row[j] = keep * row[j] + weight * x[i] * x[j]
            xy[i] = keep * xy[i] + weight * x[i] * step_ms

    def _fit(self) -> None:
        sums = [[self._xx[i][j] + self._prior_xx[i][j] for j in range(3)] for i in range(3)]
        rhs = [self._xy[i] + self._prior_xy[i] for i in range(3)]
        ridge = 1e-6 * (sums[0][0] + sums[1][1] + sums[2][2])
        active = [0, 1, 2]
        coef = [0.0, 0.0, 0.0]
        while active:
            matrix = [[sums[i][j] + (ridge if i == j else 0.0) for j in active] for i in active]
            solution = _solve(matrix, [rhs[i] for i in active])
            if solution is None:
                return
            negative = [i for i, v in zip(active, solution) if v < 0]
            if not negative:
                coef = [0.0, 0.0, 0.0]
                for i, v in zip(active, solution):
                    coef[i] = v
                break
            active = [i for i in active if i not in negative]  # pinned at 0, the rest refitted
        if coef[1] <= 0:
            # a prefill token always costs something: a fit that says otherwise comes from too few or
            # too noisy prefill steps (decode-only stretches); the previous fit stays
            return
        self.a, self.b, self.c = coef[0], coef[1] * _P_SCALE, coef[2] * _D_SCALE
        self.fitted = True


def calibration_shapes(max_num_batched_tokens: int, max_num_seqs: int) -> list[tuple[int, int]]:
    """(prefill tokens, decodes) of the steps measured at start-up: prefill alone and beside decodes,
    around where a loaded engine runs (a chunk or two of prefill beside many decodes). Only steps
    that prefill: the budget is decided for them, and a decode costs more in a mixed step (the
    varlen kernel) than in a decode-only one (split-KV), so decode-only steps would mislead the fit
    (StepTimer does not learn from them either)."""
    prefill = sorted({min(n, max_num_batched_tokens) for n in (256, 1024, 2048)})
    decodes = sorted({min(n, max_num_seqs) for n in (0, 16, 64)})
    return [(p, d) for p in prefill for d in decodes if p + d <= max_num_batched_tokens]


def calibration_fits(steps, shapes: list[tuple[int, int]]) -> bool:
    """Whether steps (as the start-up cache gives them back) are a calibration of these shapes: per
    shape (prefill tokens p, decodes d) a [prefill tokens, d, ms], the prefill tokens those of
    whole prompts (time_steps: at most p, none only where p is 0), the ms positive and finite."""
    return isinstance(steps, list) and len(steps) == len(shapes) and all(
        isinstance(step, list) and len(step) == 3 and all(type(v) is int for v in step[:2])
        and type(step[2]) in (int, float) and 0 < step[2] < math.inf
        and step[1] == decodes and (0 < step[0] <= prefill if prefill else step[0] == 0)
        for step, (prefill, decodes) in zip(steps, shapes))


class StepBudget:
    """The per-step prefill token budget that keeps a step within target_ms (see the module doc).

    Until the model is ready the budget is max_num_batched_tokens, today's throughput-first
    budget: the engine's first steps are its warm-up, and large, varied prefill steps teach the
    model the cost per prefill token sooner than small ones would.
    """

    # the least time of a step that prefill gets while anything waits, as a share of the target
    PREFILL_SHARE = 0.5

    def __init__(self, target_ms: float, max_num_batched_tokens: int, min_chunk: int,
                 model: StepTimeModel | None = None, max_num_seqs: int | None = None):
        self.target_ms = target_ms
        self.max_tokens = max_num_batched_tokens
        self.min_chunk = min(min_chunk, max_num_batched_tokens)
        self.max_num_seqs = max_num_seqs
        self.model = model if model is not None else StepTimeModel()
        self.last_budget = max_num_batched_tokens

    def prefill_budget(self, num_decodes: int, num_prompts: int) -> int:
        """Called once per step by the scheduler, after it took the decodes: a few multiplications.
        num_prompts: the prompts not yet decoding (being prefilled or waiting)."""
        model = self.model
        if not model.ready:
            budget = self.max_tokens
        else:
            planned = num_decodes + num_prompts
            if self.max_num_seqs is not None:
                planned = min(planned, self.max_num_seqs)
            tokens = max(self.target_ms - model.a - model.c * planned, self.PREFILL_SHARE * self.target_ms) / model.b
            budget = self.max_tokens if tokens >= self.max_tokens else max(self.min_chunk, int(tokens))
        self.last_budget = budget
        return budget


class StepTimer:
    """Measures each step's time where it is honest, and feeds it to a StepTimeModel.

    On CUDA the device is the bottleneck and the host runs ahead of it (overlapped steps), so a
    step is timed by CUDA events recorded before and after its launch: the device's time from the
    end of the previous step's work to the end of this one's. The events are read once they have
    completed, when a later step is resolved: the hot path never waits on them. On CPU a forward
    runs synchronously inside the launch, so the host's wall clock around it is the step.
    """

    def __init__(self, model: StepTimeModel, device: torch.device):
        self.model = model
        self.cuda = device.type == "cuda"
        self._pending: collections.deque = collections.deque()  # (start, end, p, d), oldest first
        self._spare: list = []  # events read and done with, recorded again (making one costs the host more)
        # the steps' time summed (those observed so far): against wall time, how busy the device was
        self.total_ms = 0.0

    def _event(self, stream):
        event = self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)
        event.record(stream)  # None: the current stream (cheaper than looking it up)
        return event

    def start(self, stream=None):
        """stream: the one the step's work is queued on (None: the current one)."""
        return self._event(stream) if self.cuda else time.perf_counter()

    def stop(self, started, num_prefill_tokens: int, num_decodes: int, stream=None) -> None:
        if self.cuda:
            self._pending.append((started, self._event(stream), num_prefill_tokens, num_decodes))
        else:
            self._observe(num_prefill_tokens, num_decodes, (time.perf_counter() - started) * 1e3)

    def collect(self) -> None:
        """Feed the model the steps whose events have completed (they complete in order)."""
        pending = self._pending
        while pending and pending[0][1].query():
            start, end, num_prefill_tokens, num_decodes = pending.popleft()
            self._observe(num_prefill_tokens, num_decodes, start.elapsed_time(end))
            self._spare += (start, end)

    def _observe(self, num_prefill_tokens: int, num_decodes: int, step_ms: float) -> None:
        self.total_ms += step_ms
        if num_prefill_tokens:
            self.model.observe(num_prefill_tokens, num_decodes, step_ms)
        else:  # decode-only: shown in stats, not learned (see calibration_shapes)
            self.model.last_step_ms = step_ms

    def reset(self) -> None:
        """Forget steps in flight (after a failed step, whose events may never complete)."""
        self._pending.clear()
