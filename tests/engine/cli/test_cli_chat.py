"""`flotilla chat` streams the same answer the engine gives, in one-shot and REPL mode."""

from __future__ import annotations


from engine.protocol.messages import ChatMessage, GenerateRequest, SamplingParams

from cli_helpers import REPO, run_cli


def _engine_answer(engine, turns: list[ChatMessage], max_tokens: int) -> str:
    req = GenerateRequest(request_id=f"ref-{len(turns)}", messages=tuple(turns),
                          sampling=SamplingParams(max_tokens=max_tokens))
    return "".join(ev.text for ev in engine.generate(req))


def test_one_shot_prompt_matches_engine(demo_engine_f32):
    proc = run_cli("chat", "--model", "demo", "--precision", "f32", "-p", "Tell me a story about a robot.",
                   "--max-tokens", "16")
    assert proc.returncode == 0, proc.stderr
    req = GenerateRequest(request_id="ref-n", messages=(ChatMessage("user", "Tell me a story about a robot."),),
                          sampling=SamplingParams(max_tokens=16))
    events = list(demo_engine_f32.generate(req))
    assert proc.stdout == "".join(ev.text for ev in events) + "\n"
    # the trained demo may end its turn before the limit: the stats line counts what it wrote
    final = events[-1]
    assert "tok/s" in proc.stderr and f"[{final.usage.completion_tokens} tokens" in proc.stderr
    assert f"· {final.finish_reason}]" in proc.stderr


def test_repl_keeps_the_conversation(demo_engine_f32):
    proc = subprocess_repl(["What is two plus two?", "And three times three?", "/exit"])
    assert proc.returncode == 0, proc.stderr
    first = _engine_answer(demo_engine_f32, [ChatMessage("user", "What is two plus two?")], 12)
    second = _engine_answer(demo_engine_f32, [ChatMessage("user", "What is two plus two?"),
                                              ChatMessage("assistant", first),
                                              ChatMessage("user", "And three times three?")], 12)
    assert proc.stdout == first + "\n" + second + "\n"


def subprocess_repl(lines: list[str]):
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "engine.cli.main", "chat", "--model", "demo",
                           "--precision", "f32", "--max-tokens", "12"],
                          input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=180,
                          env=env, cwd=REPO)
