"""The serving processes' tokenizer (`radixserve.serving_tokenizer`: the `tokenizers` library and
jinja2, no transformers or torch) encodes, decodes and renders chat templates exactly as the
transformers tokenizer the rest of the runtime uses (`radixserve.tokenizer.load_tokenizer`):
on the default GGUF, on an HF directory with templates that use transformers' template
environment, and on a tokenizer class whose pipeline transformers builds itself."""

from __future__ import annotations

import json
import os
import random
import re

import pytest
from radixserve.serving_tokenizer import ServingTokenizer, load_serving_tokenizer
from radixserve.tokenizer import load_tokenizer, serving_tokenizer_dir

# exercises what transformers adds to jinja: tojson with options and no HTML escaping, loop
# controls, raise_exception, {% generation %}, special tokens and extra kwargs as variables
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<tools>{{ tools | tojson(indent=2) }}</tools>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'skip' %}{% continue %}{% endif %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "<{{ m['role'] }}>{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not enable_thinking %}<think></think>"
    "{% endif %}{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "hi <b>there</b> & \"quotes\" é 日本"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "skip", "content": "x"}, {"role": "user", "content": "and 3+3?"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter <jetzt>",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TEXTS = ["", " ", "Hello world", "  leading and trailing  ", "naïve café — 日本語 🙂", "<|im_start|>user\nhi<|im_end|>",
         "</s> inside </s>", "don't , stop . now !", "tabs\tand\nnewlines\r\n", '{"a": [1, 2, {"b": null}]}']


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A fresh tokenizer cache: every directory below is prepared here, by a short-lived process."""
    path = tmp_path_factory.mktemp("radixserve-cache")
    old = os.environ.get("RADIXSERVE_CACHE_DIR")
    os.environ["RADIXSERVE_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        del os.environ["RADIXSERVE_CACHE_DIR"]
    else:
        os.environ["RADIXSERVE_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def templated_dir(tmp_path_factory):
    """The tiny test tokenizer saved with a single chat template."""
    from radixserve.testing.grammar import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.chat_template = TEMPLATE
    tok.add_special_tokens({"bos_token": "<s>"})
    path = str(tmp_path_factory.mktemp("templated"))
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama_class_dir(tmp_path_factory):
    """A directory whose tokenizer_config names LlamaTokenizer: transformers builds that class's own
    pipeline (Metaspace, byte fallback, BOS added) from the vocabulary, not the file's pipeline."""
    from transformers import LlamaTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3, "a": 4, "b": 5, "c": 6, "▁a": 7, "ab": 8, "▁ab": 9}
    vocab.update({f"<0x{i:02X}>": 10 + i for i in range(256)})
    tok = LlamaTokenizer(vocab=vocab, merges=[("▁", "a"), ("a", "b"), ("▁a", "b")])
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    path = str(tmp_path_factory.mktemp("llama-class"))
    tok.save_pretrained(path)
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        assert json.load(f)["tokenizer_class"] == "LlamaTokenizer"
    with open(os.path.join(path, "tokenizer.json")) as f:
        pipeline = json.load(f)
    pipeline["pre_tokenizer"] = None  # the file's own pipeline now differs from the class's
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(pipeline, f)
    return path


def _pair(cache, model_path):
    serving = load_serving_tokenizer(model_path)
    assert serving.directory.startswith(str(cache))
    return load_tokenizer(model_path), serving


def _assert_same_tokens(hf, serving: ServingTokenizer, extra_texts=()) -> None:
    rng = random.Random(0)
    for text in [*TEXTS, *extra_texts]:
        for special in (True, False):
            assert serving.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special), text
    special_ids = list(hf.all_special_ids)
    for _ in range(300):
        ids = [rng.randrange(len(hf)) for _ in range(rng.randint(1, 10))]
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(special_ids))
        assert serving.decode(ids) == hf.decode(ids), ids  # the defaults the HTTP layer uses
        assert serving.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), ids
    assert serving.decode(ids[0]) == hf.decode(ids[0])
    assert serving.eos_token_id == hf.eos_token_id and serving.bos_token_id == hf.bos_token_id
    assert serving.all_special_ids == list(hf.all_special_ids) and len(serving) == len(hf)
    assert serving.chat_template == hf.chat_template


def _assert_same_chats(hf, serving: ServingTokenizer, **template_kwargs) -> None:
    for messages in CONVERSATIONS:
        for gen in (True, False):
            for kwargs in ({}, template_kwargs):
                want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kwargs)
                got = serving.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kwargs)
                assert got == want, (messages, gen, kwargs)
                assert serving.apply_chat_template(messages, add_generation_prompt=gen, **kwargs) == hf.encode(
                    want, add_special_tokens=False)


def test_the_default_gguf_tokenizes_and_renders_as_transformers(cache, smollm2_gguf_path):
    hf, serving = _pair(cache, smollm2_gguf_path)
    _assert_same_tokens(hf, serving)
    _assert_same_chats(hf, serving, tools=TOOLS)
    final = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    assert serving.apply_chat_template(final, tokenize=False, continue_final_message=True) == hf.apply_chat_template(
        final, tokenize=False, continue_final_message=True)


def test_an_hf_directory_renders_with_transformers_template_environment(cache, templated_dir):
    hf, serving = _pair(cache, templated_dir)
    _assert_same_tokens(hf, serving)
    _assert_same_chats(hf, serving, tools=TOOLS, enable_thinking=False)
    with pytest.raises(Exception, match="bad role tool"):
        serving.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_a_model_specific_class_keeps_the_pipeline_transformers_built(cache, llama_class_dir):
    hf, serving = _pair(cache, llama_class_dir)
    assert type(hf).__name__ == "LlamaTokenizer" and serving.tokenizer_class == "LlamaTokenizer"
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(os.path.join(llama_class_dir, "tokenizer.json"))
    assert raw.encode("ab a").ids != hf.encode("ab a") == serving.encode("ab a") == [9, 7]  # "▁ab", "▁a"
    _assert_same_tokens(hf, serving, extra_texts=["ab ab aab", "abc cba"])
    messages = CONVERSATIONS[0]
    assert serving.apply_chat_template(messages, tokenize=False) == hf.apply_chat_template(messages, tokenize=False)


def test_named_templates_pick_tool_use_with_tools_as_transformers(cache, templated_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(templated_dir)
    tok.chat_template = {"default": "D:{{ messages[0]['content'] }}", "tool_use": "T:{{ (tools or []) | length }}"}
    tok.save_pretrained(tmp_path)
    hf, serving = _pair(cache, str(tmp_path))
    messages = CONVERSATIONS[0]
    for kwargs in ({}, {"tools": TOOLS}, {"chat_template": "tool_use"}):
        want = hf.apply_chat_template(messages, tokenize=False, **kwargs)
        assert serving.apply_chat_template(messages, tokenize=False, **kwargs) == want, kwargs


def test_a_directory_is_prepared_once_and_again_when_its_template_changes(cache, templated_dir, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(templated_dir, copy)
    first = serving_tokenizer_dir(templated_dir)
    assert serving_tokenizer_dir(str(copy)) == first  # keyed by content: a fresh copy hits the same entry
    load_serving_tokenizer(str(copy))
    marker = os.path.join(first, "radixserve-tokenizer.json")
    before = os.stat(marker).st_mtime_ns
    assert load_serving_tokenizer(str(copy)).directory == first and os.stat(marker).st_mtime_ns == before
    config = copy / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["chat_template"] = "edited {{ messages | length }}"
    config.write_text(json.dumps(data))
    (copy / "chat_template.jinja").unlink(missing_ok=True)
    edited = load_serving_tokenizer(str(copy))
    assert edited.directory != first
    assert edited.apply_chat_template(CONVERSATIONS[1], tokenize=False) == "edited 5"


def test_a_directory_without_a_tokenizer_names_it(cache, tmp_path):
    """Said from the directory's files, before the preparing process runs (whose transformers error guessed at
    missing sentencepiece); the message says how to point at a tokenizer."""
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match=f"no tokenizer in '{re.escape(str(tmp_path))}'.*model.tokenizer"):
        load_serving_tokenizer(str(tmp_path))


def test_a_hub_id_as_model_tokenizer_is_prepared_on_every_start(cache, templated_dir, tmp_path, monkeypatch):
    """model.tokenizer may be a Hub id, which transformers resolves (it may point at new files):
    unlike a local source, it is prepared again on every load, in the preparing process."""
    import shutil
    import subprocess

    from radixserve import serving_tokenizer

    calls = []

    def prepare(cmd, **kwargs):  # stands in for the Hub: prepares the local copy under the id's key
        calls.append(cmd)
        from radixserve.tokenizer import prepare_serving_tokenizer

        local = prepare_serving_tokenizer(templated_dir)
        target = serving_tokenizer_dir(cmd[3], cmd[4])
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(local, target)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(serving_tokenizer.subprocess, "run", prepare)
    weights = str(tmp_path / "model.rsw")
    for _ in range(2):
        assert load_serving_tokenizer(weights, "org/tok").chat_template == TEMPLATE
    assert [c[-3:] for c in calls] == [[weights, "org/tok", "--again"]] * 2
    assert os.path.basename(serving_tokenizer_dir(weights, "org/tok")).startswith("name-")
    load_serving_tokenizer(templated_dir)
    load_serving_tokenizer(templated_dir)
    assert len(calls) == 2  # a local directory: prepared once (by the stand-in above), then read


def test_a_long_prompt_is_tokenized_off_the_event_loop(cache, templated_dir):
    """An operator's audit: a 3.9 MB prompt held the server's one event loop ~2 s, so /health and every
    other request waited (a liveness probe times out at 1 s). Above LONG_TEXT_CHARS the encode runs in
    a thread and releases the GIL: the loop keeps ticking, and the ids are the inline encode's."""
    import asyncio
    import random

    from radixserve.serving_tokenizer import LONG_TEXT_CHARS, off_the_loop

    serving = load_serving_tokenizer(templated_dir)
    rng = random.Random(0)
    text = " ".join("".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 9))) for _ in range(150_000))
    assert len(text) > LONG_TEXT_CHARS

    async def run() -> tuple[list[int], float, int]:
        gaps: list[float] = []
        done = False

        async def ticker() -> None:
            loop = asyncio.get_running_loop()
            while not done:
                t = loop.time()
                await asyncio.sleep(0.002)
                gaps.append(loop.time() - t)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        start = asyncio.get_running_loop().time()
        ids = await off_the_loop(len(text), serving.encode, text)
        took = asyncio.get_running_loop().time() - start
        done = True
        await task
        return ids, took, max(gaps)

    ids, took, worst_gap = asyncio.run(run())
    assert ids == serving._tokenizer.encode(text).ids  # the batch call's ids are the plain call's
    assert worst_gap < max(0.25, took / 2), (worst_gap, took)  # inline, one gap would be the whole encode


def test_threads_loading_the_tokenizer_at_once_in_a_fresh_process_all_get_it(templated_dir):
    """transformers' first import is not thread-safe (chaos audit 32: a scheduler's first stop-string
    request and its first grammar backend loaded the tokenizer together, and the request failed with
    "cannot import name 'AutoTokenizer'"): load_tokenizer runs its loads one at a time."""
    import subprocess
    import sys

    script = (
        "import sys, threading\n"
        "from radixserve.tokenizer import load_tokenizer\n"
        "gate, errors, got = threading.Barrier(4), [], []\n"
        "def load():\n"
        "    gate.wait()\n"
        "    try:\n"
        "        got.append(load_tokenizer(sys.argv[1]).encode('hi'))\n"
        "    except Exception as e:\n"
        "        errors.append(repr(e))\n"
        "threads = [threading.Thread(target=load) for _ in range(4)]\n"
        "[t.start() for t in threads]\n"
        "[t.join() for t in threads]\n"
        "assert 'transformers' in sys.modules\n"
        "print(errors or len(got))\n"
    )
    for _ in range(2):  # without the lock, 4 of 5 such processes failed here
        done = subprocess.run([sys.executable, "-c", script, templated_dir], capture_output=True, text=True, timeout=120)
        assert done.stdout.strip() == "4", (done.stdout, done.stderr[-2000:])


def test_a_tokenizer_without_a_chat_template_says_what_to_do_instead():
    """Models audit 32: "send a plain prompt instead" named neither the route nor how to give a template."""
    from radixserve.testing.grammar import tiny_tokenizer
    from radixserve.tokenizer import apply_chat_template

    with pytest.raises(ValueError, match=r"no chat template: send a plain prompt instead \(/v1/completions.*--tokenizer"):
        apply_chat_template(tiny_tokenizer(), [{"role": "user", "content": "hi"}])
