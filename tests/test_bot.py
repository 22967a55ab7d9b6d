"""examples/bot.py driven through a pseudo-terminal (pexpect): streaming, Ctrl-C per answer, history, quitting."""
from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest

pexpect = pytest.importorskip("pexpect", reason="the bot test needs pexpect (test extras)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOT = os.path.join(ROOT, "examples", "bot.py")
STOPPED = re.compile(r"\[stopped after (\d+) tokens; KV blocks in use: (\d+); (\d+) prompt tokens\]")
# Every wait is for an event the bot prints, bounded only to end a hung bot: on a busy 2-core
# machine loading the model, the first token or the reply to Ctrl-C can take minutes.
PATIENCE = 600


def spawn(model: str) -> "pexpect.spawn":
    # --ignore-eos with 2000 tokens: every answer runs until it is stopped
    # started with SIGINT ignored, as a shell's background job (CI run with `&`) passes it on: the bot
    # must take Ctrl-C all the same (without its own handler every Ctrl-C did nothing, and these tests hung)
    child = pexpect.spawn(sys.executable, [BOT, "--model", model, "--max-tokens", "2000", "--ignore-eos",
                                           "--num-kvcache-blocks", "64", "--stats"],
                          encoding="utf-8", codec_errors="replace", timeout=PATIENCE, dimensions=(40, 200),
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    child.expect_exact("you> ", timeout=PATIENCE)  # loading the model first
    return child


def read_streaming_answer(child, min_chars: int = 8) -> str:
    """The answer's text so far, once it has streamed `min_chars` visible characters."""
    child.expect_exact("bot> ", timeout=PATIENCE)
    text = ""
    while len(text.split()) == 0 or len("".join(text.split())) < min_chars:
        child.expect(r"\S+", timeout=PATIENCE)  # returns as soon as more text arrives
        text += child.before + child.after
    return text


def stop_answer(child) -> tuple[int, int, int]:
    child.sendintr()  # Ctrl-C through the terminal: SIGINT to the bot
    child.expect(STOPPED, timeout=PATIENCE)
    tokens, blocks, prompt_tokens = map(int, child.match.groups())
    child.expect_exact("you> ", timeout=PATIENCE)  # still running, asking for the next message
    return tokens, blocks, prompt_tokens


def test_ctrl_c_stops_the_answer_not_the_bot(tiny_qwen3):
    child = spawn(tiny_qwen3)
    try:
        child.sendline("Tell me a story.")
        assert read_streaming_answer(child).strip()
        tokens1, blocks1, prompt1 = stop_answer(child)
        assert 0 < tokens1 < 2000 and blocks1 == 0  # aborted: its KV blocks are back

        child.sendline("Tell me a tale.")  # the same length as the first message, in tokens
        assert read_streaming_answer(child).strip()
        tokens2, blocks2, prompt2 = stop_answer(child)
        assert 0 < tokens2 < 2000 and blocks2 == 0
        # the second prompt holds the first turn: message, partial answer, and their template tokens
        assert prompt2 > prompt1 + 6, (prompt1, tokens1, prompt2)

        child.sendeof()  # Ctrl-D at the prompt quits
        child.expect_exact("bye", timeout=PATIENCE)
        child.expect(pexpect.EOF, timeout=PATIENCE)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, (child.exitstatus, child.signalstatus)


def test_ctrl_c_at_the_prompt_quits(tiny_qwen3):
    child = spawn(tiny_qwen3)
    try:
        # A SIGINT that lands after input() printed its prompt but before it blocks in read() stays
        # pending until the next key (a CPython race no user is fast enough to hit): pause, and if
        # the bot still waits, press Ctrl-C again, as a user would.
        for attempt in range(3):
            time.sleep(0.5)
            child.sendintr()
            if child.expect_exact(["bye", pexpect.TIMEOUT], timeout=10) == 0:
                break
        else:
            raise AssertionError(f"the bot did not quit on Ctrl-C at the prompt; output: {child.before!r}")
        child.expect(pexpect.EOF, timeout=30)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, (child.exitstatus, child.signalstatus)
