"""The conversation store: WAL, every batch saved, interrupted answers kept."""

from __future__ import annotations

from app.chat.store import ChatStore


def test_wal_and_round_trip(tmp_path) -> None:
    store = ChatStore(tmp_path)
    assert store.journal_mode == "wal"
    cid = store.create("Sailing", system_prompt="Be brief", sampling={"temperature": 0.5})
    store.add_message(cid, 0, "user", "Hello", "done")
    mid = store.add_message(cid, 1, "assistant", "", "streaming")
    store.save_message(mid, "Hi the", "streaming")
    store.save_message(mid, "Hi there", "done", "12 tokens", {"tok_s": 100.0})
    conv = store.get(cid)
    assert (conv.title, conv.system_prompt, conv.sampling) == ("Sailing", "Be brief", {"temperature": 0.5})
    assert [(m.role, m.text, m.state, m.stats) for m in store.messages(cid)] == [
        ("user", "Hello", "done", {}), ("assistant", "Hi there", "done", {"tok_s": 100.0})]
    store.truncate(cid, 1)
    assert len(store.messages(cid)) == 1
    store.close()


def test_streaming_message_survives_a_crash(tmp_path) -> None:
    store = ChatStore(tmp_path)
    cid = store.create()
    mid = store.add_message(cid, 0, "assistant", "", "streaming")
    store.save_message(mid, "partial answer", "streaming")
    # No close(): as if the process died mid-answer. A new store finds the text.
    again = ChatStore(tmp_path)
    (msg,) = again.messages(cid)
    assert msg.text == "partial answer" and msg.state == "cancelled"
    assert "interrupted" in msg.note
    again.close()
    store.close()


def test_delete_cascades(tmp_path) -> None:
    store = ChatStore(tmp_path)
    cid = store.create()
    store.add_message(cid, 0, "user", "x", "done")
    store.delete(cid)
    assert store.conversations() == [] and store.messages(cid) == []
