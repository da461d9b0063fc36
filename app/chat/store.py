"""Conversations on disk: one SQLite file in the data folder.

WAL mode, so a write never blocks a reader and a crash (of the app, not of the
OS) loses no committed write; synchronous=NORMAL keeps a commit cheap (no
fsync per commit), which matters because the chat saves every streamed token
batch. Every write is its own short transaction on the GUI thread: measured
well under a millisecond, far below a frame.

Plain Python (no Qt): the chat panel owns the rules, this file only the rows.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

DB_NAME = "conversations.sqlite3"
SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY,
    title TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    sampling TEXT NOT NULL DEFAULT '{}',   -- JSON of the sampling settings
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,                  -- order within the conversation
    role TEXT NOT NULL,                    -- user | assistant
    text TEXT NOT NULL,
    state TEXT NOT NULL,                   -- done | streaming | cancelled | error
    note TEXT NOT NULL DEFAULT '',
    stats TEXT NOT NULL DEFAULT '{}'       -- JSON: ttft_s, tok_s, tokens, engine, plan
);
CREATE INDEX IF NOT EXISTS messages_by_conv ON messages(conversation_id, seq);
"""


@dataclass
class StoredMessage:
    id: int
    seq: int
    role: str
    text: str
    state: str
    note: str = ""
    stats: dict = field(default_factory=dict)


@dataclass
class StoredConversation:
    id: str
    title: str
    system_prompt: str
    sampling: dict
    created: float
    updated: float


class ChatStore:
    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / DB_NAME
        # The GUI thread owns the connection; check_same_thread guards that.
        self.db = sqlite3.connect(str(self.path), isolation_level=None, timeout=5.0)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(SCHEMA)
        # A message still "streaming" on open was cut by a crash or a kill:
        # keep its text, say what happened.
        self.db.execute("UPDATE messages SET state='cancelled', note='interrupted (the app closed)' "
                        "WHERE state='streaming'")

    def close(self) -> None:
        self.db.close()

    @property
    def journal_mode(self) -> str:
        return self.db.execute("PRAGMA journal_mode").fetchone()[0]

    # -- conversations --------------------------------------------------------------
    def create(self, title: str = "New chat", system_prompt: str = "", sampling: dict | None = None) -> str:
        cid = uuid.uuid4().hex
        now = time.time()
        self.db.execute("INSERT INTO conversations VALUES (?, ?, ?, ?, ?, ?)",
                        (cid, title, system_prompt, json.dumps(sampling or {}), now, now))
        return cid

    def conversations(self) -> list[StoredConversation]:
        """Most recently used first."""
        rows = self.db.execute("SELECT id, title, system_prompt, sampling, created, updated "
                               "FROM conversations ORDER BY updated DESC").fetchall()
        return [StoredConversation(r[0], r[1], r[2], _json(r[3]), r[4], r[5]) for r in rows]

    def get(self, cid: str) -> StoredConversation | None:
        r = self.db.execute("SELECT id, title, system_prompt, sampling, created, updated "
                            "FROM conversations WHERE id=?", (cid,)).fetchone()
        return StoredConversation(r[0], r[1], r[2], _json(r[3]), r[4], r[5]) if r else None

    def update_conversation(self, cid: str, *, title: str | None = None,
                            system_prompt: str | None = None, sampling: dict | None = None) -> None:
        sets, args = ["updated=?"], [time.time()]
        for col, val in (("title", title), ("system_prompt", system_prompt)):
            if val is not None:
                sets.append(f"{col}=?")
                args.append(val)
        if sampling is not None:
            sets.append("sampling=?")
            args.append(json.dumps(sampling))
        self.db.execute(f"UPDATE conversations SET {', '.join(sets)} WHERE id=?", (*args, cid))

    def delete(self, cid: str) -> None:
        self.db.execute("DELETE FROM conversations WHERE id=?", (cid,))

    # -- messages ---------------------------------------------------------------------
    def messages(self, cid: str) -> list[StoredMessage]:
        rows = self.db.execute("SELECT id, seq, role, text, state, note, stats FROM messages "
                               "WHERE conversation_id=? ORDER BY seq", (cid,)).fetchall()
        return [StoredMessage(r[0], r[1], r[2], r[3], r[4], r[5], _json(r[6])) for r in rows]

    def add_message(self, cid: str, seq: int, role: str, text: str, state: str) -> int:
        cur = self.db.execute("INSERT INTO messages (conversation_id, seq, role, text, state) "
                              "VALUES (?, ?, ?, ?, ?)", (cid, seq, role, text, state))
        self.db.execute("UPDATE conversations SET updated=? WHERE id=?", (time.time(), cid))
        return int(cur.lastrowid)

    def save_message(self, mid: int, text: str, state: str, note: str = "",
                     stats: dict | None = None) -> None:
        """Called for every streamed token batch and once at the end."""
        self.db.execute("UPDATE messages SET text=?, state=?, note=?, stats=? WHERE id=?",
                        (text, state, note, json.dumps(stats or {}), mid))

    def truncate(self, cid: str, from_seq: int) -> None:
        """Drop messages seq >= from_seq (edit-and-resend, regenerate)."""
        self.db.execute("DELETE FROM messages WHERE conversation_id=? AND seq>=?", (cid, from_seq))


def _json(text: str) -> dict:
    try:
        v = json.loads(text)
    except (TypeError, ValueError):
        return {}
    return v if isinstance(v, dict) else {}
