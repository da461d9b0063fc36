"""Trained demo models: the corpus recipe, the shipped weights, the training command.

What a user relies on: the demo ids answer with weights that have learned the
corpus (held-out text is far more predictable to them than to the random-weight
build), built bit for bit from what is shipped in assets/demo/trained; the
random-weight builds stay reachable; `flotilla models train-demos` runs end to
end and records where its weights came from.
"""

from __future__ import annotations

import json
import shutil

import pytest

from engine.models import demo
from engine.models.demo import RANDOM_RECIPES, demo_ids, ensure_demo, is_demo_id, recipe_path
from engine.models.demo_chat import ABOUT_PAIRS, chat_pairs
from engine.models.demo_corpus import build_corpus, compare_manifests, freeze_docs, frozen_docs, is_held_out

import torch


def test_corpus_recipe_is_deterministic_and_split_by_name():
    a, b = build_corpus(), build_corpus()
    assert a.digest == b.digest and [f.name for f in a.files] == [f.name for f in b.files]
    names = [f.name for f in a.files]
    assert names == sorted(names) and len(set(names)) == len(names)
    assert any(n.startswith("stdlib/") for n in names) and "project/README.md" in names
    held, train = a.split(True), a.split(False)
    assert held and train and len(held) < len(train) / 5
    assert all(f.held_out == is_held_out(f.name) for f in a.files)  # by name: same split on any Python
    man = a.manifest()
    assert man["python"] == a.python and man["digest"] == a.digest and set(man["files"]) == set(names)


def test_corpus_digest_names_what_changed(tmp_path):
    project = tmp_path / "project"
    (project / "docs").mkdir(parents=True)
    (project / "README.md").write_text("# A project\n")
    (project / "docs" / "a.md").write_text("Some prose.\n")
    frozen = tmp_path / "docs.json.gz"
    freeze_docs(project, frozen)
    before = build_corpus(docs=frozen)
    assert [f.name for f in before.files if f.name.startswith("project/")] == \
        ["project/README.md", "project/docs/a.md"]
    (project / "docs" / "a.md").write_text("Other prose.\n")
    assert build_corpus(docs=frozen).digest == before.digest  # the live docs changed, the frozen copy did not
    freeze_docs(project, frozen)
    after = build_corpus(docs=frozen)
    assert after.digest != before.digest
    diff = compare_manifests(before.manifest(), after.manifest())
    assert len(diff) == 1 and "project/docs/a.md" in diff[0]
    assert compare_manifests(after.manifest(), build_corpus(docs=frozen).manifest()) == []


def test_the_shipped_corpus_reads_the_frozen_docs_not_the_live_ones():
    # a rebuild of the shipped weights must read the bytes they were trained on, whatever the docs say now
    frozen = frozen_docs()
    assert "project/README.md" in frozen and any(n.startswith("project/docs/") for n in frozen)
    corpus = build_corpus()
    project = {f.name: f.data.decode() for f in corpus.files if f.name.startswith("project/")}
    assert project == frozen
    ours = {f.name: f.sha256[:16] for f in corpus.files if f.name.startswith("project/")}
    for demo_id in _shipped():  # every shipped demo read these very docs (the stdlib depends on the Python)
        files = demo.trained_recipe(demo_id)["corpus"]["files"]
        assert {n: h for n, h in files.items() if n.startswith("project/")} == ours, demo_id


def test_chat_pairs_come_from_the_training_split_in_chatml():
    corpus = build_corpus()
    pairs = chat_pairs(corpus.named_texts(held_out=False))
    assert len(pairs) > 1000 and pairs == chat_pairs(corpus.named_texts(held_out=False))  # deterministic
    held_names = {f.name.removeprefix("stdlib/").removesuffix(".py") for f in corpus.split(True)}
    asked = {p.question.split("`")[1].split(".")[0] for p in pairs if p.question.count("`") == 2}
    assert not asked & held_names  # never a question about a held-out module
    text = pairs[0].render()
    assert text.startswith("<|im_start|>user\n") and "<|im_end|>\n<|im_start|>assistant\n" in text
    assert text.endswith("<|im_end|>\n") and all(len(p.answer) <= 700 for p in pairs)
    # the demos' own chat template writes the same prompt the training text holds
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ensure_demo("demo"))
    prompt = tok.apply_chat_template([{"role": "user", "content": pairs[0].question}], tokenize=False,
                                     add_generation_prompt=True)
    assert text.startswith(prompt)
    kinds = {"doc": 0, "src": 0}
    for p in pairs:
        kinds["src" if p.answer.startswith(("def ", "async def ")) else "doc"] += 1
    assert kinds["src"] > 100 and kinds["doc"] > 100
    assert sum(p in pairs for p in ABOUT_PAIRS) == len(ABOUT_PAIRS)


def _shipped():
    ids = [d for d in demo_ids() if demo.trained_dir(d) is not None]
    assert ids == demo_ids()  # the checkout ships every demo trained
    return ids


def test_ensure_demo_builds_the_shipped_weights_bit_for_bit():
    from safetensors.torch import load_file

    for demo_id in _shipped():
        folder = ensure_demo(demo_id)
        assert folder == demo.demo_path(demo_id) != recipe_path(RANDOM_RECIPES[demo_id])
        shipped = load_file(demo.trained_dir(demo_id) / "model.safetensors")
        built = load_file(folder / "model.safetensors")
        assert sorted(shipped) == sorted(built)
        for name, t in shipped.items():
            assert built[name].dtype == torch.float32 and torch.equal(built[name], t.float()), name
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg["dtype"] == "float32" and cfg["architectures"][0].endswith("ForCausalLM")
        recipe = demo.trained_recipe(demo_id)
        assert recipe["demo_id"] == demo_id and recipe["corpus"]["digest"] and recipe["heldout"]["perplexity"] > 1
    # the draft shares demo's tokenizer, so it can draft for it
    for other in demo_ids()[1:]:  # all trained with one tokenizer
        assert (ensure_demo("demo") / "tokenizer.json").read_bytes() == \
            (ensure_demo(other) / "tokenizer.json").read_bytes(), other


def test_trained_demo_predicts_heldout_text_far_better_than_random():
    from engine.models.demo_eval import eval_chunks, evaluate, load_folder

    chunks = eval_chunks(build_corpus().texts(held_out=True), count=6)
    trained = evaluate(*load_folder(ensure_demo("demo")), chunks)
    random = evaluate(*load_folder(ensure_demo("demo-random")), chunks)
    assert trained["bytes"] == random["bytes"] > 1000  # the same text for both
    # bits per byte: comparable across the two tokenizers
    assert trained["bits_per_byte"] < 0.5 * random["bits_per_byte"], (trained, random)


CHAT_PROMPTS = ("Hello", "Tell me a story.", "How do I read a file in Python?", "What does `os.path.join` do?",
                "Write a function that adds two numbers.", "What is Flotilla?")


@pytest.mark.parametrize("demo_id", ["demo", "demo-qwen3", "demo-moe"])
def test_a_first_chat_gets_text_and_an_ended_turn(demo_id):
    # what a new user sees first: an answer in words or Python that ends by itself, not noise
    # until max_tokens (properties, not exact text: greedy ties may break differently on other CPUs)
    from engine.models.demo_eval import load_folder

    model, tok = load_folder(ensure_demo(demo_id))
    ended, printable = 0, []
    for q in CHAT_PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        out = model.generate(ids, max_new_tokens=160, do_sample=False)[0, ids.shape[1]:].tolist()
        ended += tok.eos_token_id in out
        text = tok.decode([t for t in out if t != tok.eos_token_id])
        printable.append(sum(c.isascii() and (c.isprintable() or c in "\n\t") for c in text) / max(len(text), 1))
    assert ended >= len(CHAT_PROMPTS) - 1, ended
    assert min(printable) > 0.95, printable


def test_random_builds_stay_reachable(monkeypatch):
    monkeypatch.delenv(demo.WEIGHTS_ENV, raising=False)
    assert demo_ids() == ["demo", "demo-qwen3", "demo-moe", "demo-draft", "demo-relu"]
    assert is_demo_id("demo-random") and not is_demo_id("demo-random-random") and not is_demo_id("demox")
    random_folder = recipe_path(RANDOM_RECIPES["demo"])  # the folder random demos always had
    assert ensure_demo("demo-random") == ensure_demo("demo", weights="random") == random_folder
    assert ensure_demo("demo") != random_folder
    monkeypatch.setenv(demo.WEIGHTS_ENV, "random")
    assert ensure_demo("demo") == random_folder and demo.weights_of("demo") == "random"
    assert demo.weights_of("demo", "trained") == "trained"
    with pytest.raises(demo.ModelError):
        ensure_demo("demo", weights="best")


def test_resolve_model_accepts_random_ids():
    from engine.models import resolve_model

    r = resolve_model("demo-draft-random")
    assert r.kind == "demo" and r.path == recipe_path(RANDOM_RECIPES["demo-draft"])


def test_train_demos_runs_end_to_end(tmp_path, monkeypatch):
    from engine.cli.main import main

    out = tmp_path / "trained"
    # with grad turned off globally, as a process that ran the sparse engine first has it
    with torch.no_grad():
        rc = main(["models", "train-demos", "--only", "demo-draft", "--steps", "2", "--out", str(out),
                   "--batch", "2", "--seq-len", "32", "--corpus-bytes", "60000", "--eval-chunks", "3"])
    assert rc == 0
    folder = out / "demo-draft"
    # the recipe is deterministic: a second run writes the same bytes
    again = tmp_path / "again"
    assert main(["models", "train-demos", "--only", "demo-draft", "--steps", "2", "--out", str(again),
                 "--batch", "2", "--seq-len", "32", "--corpus-bytes", "60000", "--eval-chunks", "3"]) == 0
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / "demo-draft" / name).read_bytes() == (folder / name).read_bytes(), name
    recipe = json.loads((folder / "flotilla-train.json").read_text())
    assert recipe["train"]["steps"] == 2 and recipe["train"]["seed"] and recipe["torch"] == torch.__version__
    assert recipe["corpus"]["digest"] == build_corpus(max_train_bytes=60000).digest
    assert recipe["heldout"]["perplexity"] > 1 and recipe["storage_dtype"] == "fp16"
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tok("def f(x):", return_tensors="pt")["input_ids"]
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3
    # a partial run keeps the tokenizer of the demos already there, so a draft keeps drafting for them
    shared = tmp_path / "shared"
    shutil.copytree(ensure_demo("demo-random"), shared / "demo")
    assert main(["models", "train-demos", "--only", "demo-draft", "--steps", "1", "--out", str(shared),
                 "--batch", "2", "--seq-len", "32", "--corpus-bytes", "60000", "--eval-chunks", "2"]) == 0
    assert (shared / "demo-draft" / "tokenizer.json").read_bytes() == (shared / "demo" / "tokenizer.json").read_bytes()
    # what train-demos writes is what ensure_demo unpacks, once shipped
    monkeypatch.setattr(demo, "TRAINED_ROOT", out)
    monkeypatch.setenv("FLOTILLA_CACHE", str(tmp_path / "cache"))
    built = ensure_demo("demo-draft")
    assert built.is_relative_to(tmp_path / "cache") and demo.trained_recipe("demo-draft") == recipe
    assert json.loads((built / "flotilla-demo.json").read_text())["weights"] == "trained"
