"""Chat-form training text for the demo models, made from the corpus itself.

A model that has only read raw files answers a chat turn (`<|im_start|>user ...
<|im_start|>assistant`) with whatever its raw text suggests, and never ends its
turn. So part of every training batch is conversations built deterministically
from the training split (never from held-out files):

- a stdlib function or class with a docstring: "What does `textwrap.dedent` do?"
  -> the docstring's first paragraph; "Write the Python function `dedent`." ->
  its source, when short;
- a topic of the language reference (pydoc_data/topics.py): "Explain the assert
  statement." -> its first paragraph;
- a section of the project's docs: "Tell me about <heading>." -> its first paragraph.

- a few questions about the demo itself ("Who are you?"), answered plainly: a tiny
  demo trained here, not an assistant; repeated through the list so they stick.

Each answer ends with <|im_end|>, so the trained demos stop when they are done.
The questions take one of a few phrasings, picked by a hash of the name (same
pairs on every run).
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from dataclasses import dataclass

from engine.models.demo_corpus import name_bucket

MAX_ANSWER_CHARS = 600  # longer answers are cut at a line or sentence end before this
MAX_SOURCE_CHARS = 700  # functions longer than this are not offered as "write" answers


@dataclass(frozen=True)
class ChatPair:
    """One user question and the assistant's answer."""

    question: str
    answer: str

    def render(self) -> str:
        """ChatML, as the demos' chat template writes it (assistant turn closed)."""
        return (f"<|im_start|>user\n{self.question}<|im_end|>\n"
                f"<|im_start|>assistant\n{self.answer}<|im_end|>\n")


def _pick(name: str, options: tuple[str, ...]) -> str:
    return options[name_bucket(name, len(options))]


def _first_paragraph(text: str) -> str:
    para = text.strip().split("\n\n")[0].strip()
    return _cut(para)


def _cut(text: str, limit: int = MAX_ANSWER_CHARS) -> str:
    """Text up to limit, ended at the last sentence or line end before it."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    end = max(head.rfind(". "), head.rfind(".\n"), head.rfind("\n"))
    return head[: end + 1].rstrip() if end > limit // 3 else head.rstrip()


_ASK_DOC = ("What does `{q}` do?", "Explain `{q}`.", "What is `{q}` for?")
_ASK_SRC = ("Write the Python function `{n}`.", "Show me how `{n}` is written.", "Implement `{n}` in Python.")
_ASK_TOPIC = ("Explain {t} in Python.", "What is {t}?", "Tell me about {t}.")
_ASK_SECTION = ("Tell me about {h}.", "What is {h}?", "Explain {h}.")


# Lines as ast numbers them (\r\n, \r or \n; not str.splitlines, which also splits at form feeds).
_LINES = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$")


def _segment(lines: list[str], node: ast.AST) -> str:
    """What ast.get_source_segment(source, node, padded=True) gives, from lines split once
    (it splits the whole file again on every call: 20 s over the stdlib): the first line
    from its start, so dedent keeps the body's indentation; the last up to the node's end."""
    first, last = node.lineno - 1, node.end_lineno - 1
    if first == last:  # one line: not padded, as get_source_segment
        return lines[first].encode()[node.col_offset:node.end_col_offset].decode()
    return "".join(lines[first:last]) + lines[last].encode()[:node.end_col_offset].decode()


def python_pairs(module: str, source: str) -> list[ChatPair]:
    """Pairs from one stdlib module: its public functions, classes and methods."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    pairs: list[ChatPair] = []
    lines = _LINES.findall(source)

    def visit(node, prefix: str) -> None:
        for child in node.body:
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if child.name.startswith("_"):
                continue
            qual = f"{prefix}.{child.name}"
            doc = ast.get_docstring(child)
            if doc and len(doc) > 20:
                pairs.append(ChatPair(_pick(qual, _ASK_DOC).format(q=qual), _first_paragraph(inspect.cleandoc(doc))))
            if isinstance(child, ast.FunctionDef):
                src = textwrap.dedent(_segment(lines, child))
                if 40 < len(src) <= MAX_SOURCE_CHARS:
                    pairs.append(ChatPair(_pick(qual + "#src", _ASK_SRC).format(n=child.name), src.strip()))
            if isinstance(child, ast.ClassDef) and prefix == module:
                visit(child, qual)

    visit(tree, module)
    return pairs


def topic_pairs(source: str) -> list[ChatPair]:
    """Pairs from pydoc_data/topics.py: the language reference's topics, as prose."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "topics" for t in node.targets):
            topics = ast.literal_eval(node.value)
            break
    else:
        return []
    pairs = []
    for key in sorted(topics):
        lines = topics[key].strip().split("\n")
        # "The "assert" statement\n*****\n\nAssert statements are ..." : title, underline, prose
        if len(lines) < 3 or not re.fullmatch(r"[*=\-]+", lines[1].strip() or "x"):
            continue
        title = lines[0].strip().strip('"').replace('"', "")
        body = "\n".join(lines[2:]).strip()
        answer = _first_paragraph(body)
        if len(answer) > 40:
            pairs.append(ChatPair(_pick(key, _ASK_TOPIC).format(t=title[0].lower() + title[1:]), answer))
    return pairs


def markdown_pairs(name: str, text: str) -> list[ChatPair]:
    """Pairs from a Markdown file: each heading and the first prose paragraph under it."""
    pairs = []
    sections = re.split(r"^#{1,4} +(.+)$", text, flags=re.M)
    # re.split with a group: [before, heading1, body1, heading2, body2, ...]
    for heading, body in zip(sections[1::2], sections[2::2]):
        paras = [p.strip() for p in body.strip().split("\n\n")]
        prose = next((p for p in paras if p and not p.startswith(("|", "```", "<!--", "-", "#"))), "")
        heading = heading.strip().strip("`")
        if len(prose) > 40 and heading:
            h = heading[0].lower() + heading[1:] if not heading[:2].isupper() else heading
            pairs.append(ChatPair(_pick(name + heading, _ASK_SECTION).format(h=h), _cut(prose)))
    return pairs


_ABOUT = ("I am a tiny demo model that Flotilla trained on this computer, on the Python standard library "
          "and Flotilla's own docs. I write text that looks like Python and its documentation, but I know "
          "very little. For real answers, pull a real model with `flotilla models pull`.")
ABOUT_PAIRS = tuple(ChatPair(q, _ABOUT) for q in (
    "Hello", "Hi!", "Who are you?", "What can you do?", "Are you an assistant?", "What are you?"))
ABOUT_REPEATS = 16  # times each about-pair appears, spread evenly through the list


def chat_pairs(named_texts: list[tuple[str, str]]) -> list[ChatPair]:
    """Every pair the recipe makes from (corpus name, text) files, in file order,
    with the about-pairs spread through them."""
    pairs = _corpus_pairs(named_texts)
    about = list(ABOUT_PAIRS) * ABOUT_REPEATS
    step = max(len(pairs) // len(about), 1)
    out: list[ChatPair] = []
    for i, pair in enumerate(about):
        out += pairs[i * step:(i + 1) * step] + [pair]
    return out + pairs[len(about) * step:]


def _corpus_pairs(named_texts: list[tuple[str, str]]) -> list[ChatPair]:
    pairs: list[ChatPair] = []
    for name, text in named_texts:
        if name == "stdlib/pydoc_data/topics.py":
            pairs += topic_pairs(text)
        elif name.startswith("stdlib/") and name.endswith(".py"):
            pairs += python_pairs(name[len("stdlib/"):-3], text)
        elif name.endswith(".md"):
            pairs += markdown_pairs(name, text)
    return pairs
