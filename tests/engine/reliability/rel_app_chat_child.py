"""Child of test_rel_app_crash.py: the app's persistence path with a real engine.

    python rel_app_chat_child.py DATA_FOLDER CONFIG_FOLDER

Does what the chat panel does (app/chat/panel.py): saves settings
(app/settings.py), creates a conversation, adds the user message and an
empty "streaming" assistant message, then for every streamed batch saves the
text (ChatStore.save_message) *and then* shows it -- here: prints it as one
JSON line on stdout. The parent kills this process with SIGKILL mid-answer;
whatever was shown must be in the database.
"""

import json
import sys
from pathlib import Path

from app.settings import AppSettings
from app.chat.store import ChatStore
from engine.protocol.messages import ChatMessage, GenerateRequest, SamplingParams
from engine.scheduler.loop import LocalEngine

data, config = Path(sys.argv[1]), Path(sys.argv[2])
settings = AppSettings(theme="dark", api_port=8123, last_model="demo")
settings.save(config)
store = ChatStore(data)
cid = store.create("Robots", system_prompt="Be brief", sampling={"temperature": 0.0, "max_tokens": 4000})
store.add_message(cid, 0, "user", "Tell me a long story about a robot.", "done")
mid = store.add_message(cid, 1, "assistant", "", "streaming")
engine = LocalEngine.from_spec("demo")
print(json.dumps({"event": "ready", "cid": cid}), flush=True)
rid = engine.submit(GenerateRequest("a", messages=(ChatMessage("system", "Be brief"),
                                                   ChatMessage("user", "Tell me a long story about a robot.")),
                                    sampling=SamplingParams(max_tokens=4000, ignore_eos=True)))
text = ""
for n, ev in enumerate(engine.stream(rid)):
    text += ev.text
    store.save_message(mid, text, "done" if ev.final else "streaming")  # the panel saves, then paints
    print(json.dumps({"event": "shown", "n": n, "text": text}), flush=True)
engine.close()
