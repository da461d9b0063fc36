"""Render the chat window after a short conversation to a PNG (docs, reviews).

    xvfb-run -s "-screen 0 1280x800x24" env QT_QPA_PLATFORM=xcb \\
        python -m app.screenshot docs/screenshots/chat-minimal.png

Works offscreen too (QT_QPA_PLATFORM=offscreen), minus the window frame.
Uses the real demo engine; exits non-zero if the chat does not complete.
"""

from __future__ import annotations

import sys
from pathlib import Path

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication

from app import style
from app.chat_window import ANSWERING, FAILED, READY, ChatWindow
from engine.protocol.messages import SamplingParams

PROMPTS = ["Hello! What can you tell me about sailing?", "Write a poem about the sea"]
SIZE = (1280, 800)
TIMEOUT_MS = 120_000


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out = Path(argv[0] if argv else "docs/screenshots/chat-minimal.png")
    out.parent.mkdir(parents=True, exist_ok=True)

    app = QApplication.instance() or QApplication([sys.argv[0]])
    app.setStyle("Fusion")
    app.setStyleSheet(style.STYLESHEET)
    window = ChatWindow("demo", "CPU")
    # Short answers: the demo model is random, a wall of noise shows nothing.
    window.sampling = SamplingParams(max_tokens=48)
    window.resize(*SIZE)
    window.show()
    pending = list(PROMPTS)
    result = {"code": 1}

    def on_state(state: str) -> None:
        if state == FAILED:
            print("engine failed to open:", window.status_label.text(), file=sys.stderr)
            app.quit()
        elif state == READY and pending:
            window.prompt.setPlainText(pending.pop(0))
            QTimer.singleShot(50, window.send)
        elif state == READY and window.state != ANSWERING:
            QTimer.singleShot(300, grab)  # let the last repaint land

    def grab() -> None:
        window.grab().save(str(out))
        print(f"saved {out} ({window.width()}x{window.height()}) — {window.status_label.text()}")
        result["code"] = 0
        window.shutdown()

    window.state_changed.connect(on_state)
    window.shut_down.connect(app.quit)
    QTimer.singleShot(TIMEOUT_MS, app.quit)
    app.exec()
    window.runner.wait_for_done(2000)
    return result["code"]


if __name__ == "__main__":
    sys.exit(main())
