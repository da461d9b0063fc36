"""The transcript renders answers as Markdown and user text exactly."""

from __future__ import annotations

from app import style
from app.chat.transcript import ChatView
from app.chat.conversation import DONE, Conversation, Turn

ANSWER = "Here is **bold** text and code:\n\n```python\nprint('hi')\n    x = 2\n```\n\n- one\n- two\n"


def test_markdown_answer_and_literal_user_text(qtbot) -> None:
    conv = Conversation()
    conv.turns = [Turn("user", "**not bold** <b>tags</b>\tkept"), Turn("assistant", ANSWER, DONE)]
    view = ChatView(conv)
    qtbot.addWidget(view)
    view.resize(800, 600)
    view.render_now()
    user, answer = view.bubble_texts()
    assert user == "**not bold** <b>tags</b>\tkept"  # shown exactly, never parsed
    assert "**" not in answer and "```" not in answer
    assert "print('hi')" in answer and "    x = 2" in answer and "bold" in answer
    html = view.toHtml()
    assert style.CODE_BG in html  # code blocks have their own background
    assert "act:regenerate:1" in view._html() and "act:edit:0" in view._html()


def test_action_links_emit(qtbot) -> None:
    from PySide6.QtCore import QUrl

    conv = Conversation()
    conv.turns = [Turn("user", "hi"), Turn("assistant", "hello", DONE)]
    view = ChatView(conv)
    qtbot.addWidget(view)
    with qtbot.waitSignal(view.action) as sig:
        view.anchorClicked.emit(QUrl("act:copy:1"))
    assert sig.args == ["copy", 1]
