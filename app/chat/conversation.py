"""The state of one chat: the turns shown and the messages sent.

Plain Python (no Qt), so the rules for what goes into the next request are
easy to test and to read: every turn is shown, but a user turn whose answer
failed is left out of the context together with that failed answer, so that
retrying does not send two user turns in a row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.protocol.messages import ChatMessage

STREAMING, DONE, CANCELLED, ERROR = "streaming", "done", "cancelled", "error"


@dataclass
class Turn:
    role: str  # "user" | "assistant"
    text: str = ""  # grows token by token while streaming
    state: str = DONE  # STREAMING, DONE, CANCELLED or ERROR (assistant turns)
    note: str = ""  # shown under the bubble: an error, "stopped", timings
    stats: dict = field(default_factory=dict)  # ttft_s, tok_s, tokens, engine, plan
    message_id: int | None = None  # its row in the ChatStore, once saved


class Conversation:
    def __init__(self, system_prompt: str | None = None, conversation_id: str | None = None,
                 title: str = "New chat") -> None:
        self.system_prompt = system_prompt  # sent first if set, never shown
        self.turns: list[Turn] = []
        self.id = conversation_id  # its ChatStore id (None = not saved)
        self.title = title

    def add_user(self, text: str) -> Turn:
        turn = Turn("user", text)
        self.turns.append(turn)
        return turn

    def start_answer(self) -> Turn:
        turn = Turn("assistant", "", STREAMING)
        self.turns.append(turn)
        return turn

    @property
    def answering(self) -> Turn | None:
        """The assistant turn still streaming, if any."""
        if self.turns and self.turns[-1].state == STREAMING:
            return self.turns[-1]
        return None

    def clear(self) -> None:
        self.turns.clear()

    def last_user_index(self) -> int | None:
        for i in range(len(self.turns) - 1, -1, -1):
            if self.turns[i].role == "user":
                return i
        return None

    def messages(self) -> tuple[ChatMessage, ...]:
        """What the next GenerateRequest carries: the whole conversation."""
        out: list[ChatMessage] = []
        if self.system_prompt:
            out.append(ChatMessage("system", self.system_prompt))
        for i, turn in enumerate(self.turns):
            if turn.state in (STREAMING, ERROR):
                continue
            nxt = self.turns[i + 1] if i + 1 < len(self.turns) else None
            if turn.role == "user" and nxt is not None and nxt.state == ERROR:
                continue
            out.append(ChatMessage(turn.role, turn.text))
        return tuple(out)
