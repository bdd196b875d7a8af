"""The code examples of README.md and docs/*.md run as written: an outsider pastes them into a file
or a shell, against the embedded SmolLM2 (CPU), and gets what the docs say.

Convention: a runnable block is named in RUNNABLE below by (doc, its first line), and run here as
written, with two substitutions an outsider makes too: the server these tests start listens on a
free port, so `127.0.0.1:30000` becomes its address, and bash blocks get the `BASE` and `MODEL`
variables that docs/http-api.md defines. A block named here that is no longer in its doc fails the
test (rename the entry with the block). Blocks that need a GPU, a downloaded model, the user's own
path or another package are not run; every `radixserve ...` line in a fenced block is still parsed
by the real command line parser, so a renamed flag or a misplaced override is caught.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from radixserve.cli import main as cli_main
from radixserve.cli import make_parser, parse_command_line
from server_process import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the embedded model's served name (docs/http-api.md)

# (doc, first line of the block): the blocks run as written against the embedded model
RUNNABLE = {
    "readme_engine": ("README.md", "from radixserve import Engine"),
    "chat": ("docs/http-api.md", "curl -s $BASE/v1/chat/completions -H 'Content-Type: application/json' -d '{"),
    "chat_stream": ("docs/http-api.md", "curl -sN $BASE/v1/chat/completions -H 'Content-Type: application/json' -d '{"),
    "completions": ("docs/http-api.md", "curl -s $BASE/v1/completions -H 'Content-Type: application/json' -d '{\n"),
    "models": ("docs/http-api.md", "curl -s $BASE/v1/models"),
    "generate": ("docs/http-api.md", "curl -s $BASE/generate -H 'Content-Type: application/json' -d '{"),
    "health": ("docs/http-api.md", "curl -s -o /dev/null -w '%{http_code}\\n' $BASE/health"),
    "metrics": ("docs/http-api.md", "curl -s $BASE/metrics | grep ^radixserve_"),
    "flush": ("docs/http-api.md", "curl -s -X POST $BASE/flush_cache"),
    "abort": ("docs/http-api.md", "curl -s $BASE/abort_request -H 'Content-Type: application/json' -d '{\"rid\": \"my-request-1\"}'"),
    "server_info": ("docs/http-api.md", "curl -s $BASE/server_info"),
    "tokenize": ("docs/http-api.md", "curl -s $BASE/tokenize -H 'Content-Type: application/json' -d '{\"prompt\""),
    "model_info": ("docs/http-api.md", "curl -s $BASE/get_model_info"),
    "tokenizer_info": ("docs/http-api.md", "curl -s $BASE/tokenizer_info"),
    "prompt_logprobs": ("docs/http-api.md", "curl -s $BASE/v1/completions -H 'Content-Type: application/json' -d '{\"prompt_logprobs\""),
    "responses": ("docs/http-api.md", "curl -s $BASE/v1/responses -H 'Content-Type: application/json' -d '{"),
    "responses_openai": ("docs/http-api.md", "from openai import OpenAI\n"),
    "structured_openai": ("docs/structured-output.md", "from openai import OpenAI"),
    "structured_chat": ("docs/structured-output.md", "curl -s http://127.0.0.1:30000/v1/chat/completions -H 'Content-Type: application/json' -d '{"),
    "structured_generate": ("docs/structured-output.md", "# a JSON schema, as a JSON object or as a string holding one"),
    "tools_curl": ("docs/tools-and-reasoning.md", "curl -s $BASE/v1/chat/completions -H 'Content-Type: application/json' -d '{"),
    "tools_openai": ("docs/tools-and-reasoning.md", "import json, openai"),
    "tools_stream": ("docs/tools-and-reasoning.md", "import openai\n"),
    "stack_speculative": ("docs/speculative.md", "stack:\n  speculative: ngram          # a component of kind \"drafter\""),
    "stack_ngram": ("docs/speculative-drafters.md", "stack:\n  speculative: ngram\nspeculative:\n  num_draft_tokens: 4\n  topk: 1"),
    "stack_impl": ("docs/transformers-fallback.md", "model:\n  impl: transformers"),
}


@dataclass
class Block:
    doc: str
    line: int  # of the opening fence
    lang: str
    text: str


def fenced_blocks(doc: str) -> list[Block]:
    """The fenced code blocks of `doc` (relative to the repository), their indentation removed."""
    blocks, opened = [], None
    for i, line in enumerate((ROOT / doc).read_text().splitlines(), 1):
        m = re.match(r"^(\s*)```(.*)$", line)
        if m and opened is None:
            opened, body = (i, len(m.group(1)), m.group(2).strip()), []
        elif m:
            blocks.append(Block(doc, opened[0], opened[2], "\n".join(x[opened[1]:] for x in body) + "\n"))
            opened = None
        elif opened is not None:
            body.append(line)
    return blocks


def block(name: str) -> Block:
    doc, first = RUNNABLE[name]
    found = [b for b in fenced_blocks(doc) if b.text.startswith(first)]
    assert len(found) == 1, f"{name}: {len(found)} blocks of {doc} start with {first!r} (rename RUNNABLE's entry)"
    return found[0]


def run_python_block(code: str, tmp_path: Path, name: str, timeout: float = 120) -> str:
    """Paste `code` into a file and run it with this interpreter; its stdout (the test fails with
    its stderr when it exits non-zero)."""
    path = tmp_path / f"{name}.py"
    path.write_text(code)
    r = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    assert r.returncode == 0, f"{name} exited {r.returncode}:\n{r.stderr[-3000:]}"
    return r.stdout


def test_block_reader_finds_indented_and_plain_fences(tmp_path, monkeypatch):
    doc = tmp_path / "doc.md"
    doc.write_text("# t\n\n```bash\nradixserve plugins\n```\n- item:\n\n  ```\n  radixserve serve\n  ```\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert [(b.line, b.lang, b.text) for b in fenced_blocks("doc.md")] == [
        (3, "bash", "radixserve plugins\n"), (8, "", "radixserve serve\n")]


def _command_lines() -> list[tuple[str, str]]:
    """Every `radixserve ...` command in a fenced block of the docs: (where, the command), with
    continuation lines joined and the trailing comment dropped."""
    found = []
    for doc in ["README.md", *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").glob("*.md")))]:
        for b in fenced_blocks(doc):
            lines = b.text.splitlines()
            for i, line in enumerate(lines):
                if not line.startswith("radixserve "):
                    continue
                cmd, j = line, i
                while cmd.endswith("\\"):
                    j += 1
                    cmd = cmd[:-1] + " " + lines[j].strip()
                found.append((f"{doc}:{b.line + 1 + i}", re.split(r"\s+#", cmd)[0]))
    return found


def test_every_radixserve_command_line_in_the_docs_parses():
    lines = _command_lines()
    assert len(lines) > 20  # the reader found the docs' commands
    bad = []
    for where, cmd in lines:
        try:
            parse_command_line(make_parser(), shlex.split(cmd)[1:])
        except SystemExit:
            bad.append(f"{where}: {cmd}")
    assert not bad, "command lines the CLI rejects:\n" + "\n".join(bad)


def test_a_missing_prompt_is_the_only_required_argument_named(capsys):
    """`section.key=value` overrides are optional: argparse listed them as required beside the prompt."""
    with pytest.raises(SystemExit):
        parse_command_line(make_parser(), ["generate"])
    error_line = capsys.readouterr().err.strip().splitlines()[-1]  # the usage above it shows them, optional
    assert error_line.endswith("the following arguments are required: prompt"), error_line


def test_overrides_may_follow_flags_after_a_positional():
    # `generate "prompt" --max-tokens 16 section.key=value` is how the docs and users write it
    args = parse_command_line(make_parser(), ["generate", "Hi", "--max-tokens", "4", "stack.policy=lpm", "runtime.seed=1"])
    assert (args.prompt, args.max_tokens, args.overrides) == ("Hi", 4, ["stack.policy=lpm", "runtime.seed=1"])
    with pytest.raises(SystemExit):
        parse_command_line(make_parser(), ["generate", "Hi", "--max-tokens", "4", "--no-such-flag"])
    with pytest.raises(SystemExit):  # a command without overrides takes none
        parse_command_line(make_parser(), ["plugins", "stack.policy=lpm"])


def test_config_show_lines_of_the_docs_run(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # `--config stacks/cpu.yaml` as written: from the repository root
    shows = [(w, c) for w, c in _command_lines() if c.startswith("radixserve config show") and "my-stack" not in c]
    assert len(shows) >= 3
    for where, cmd in shows:
        assert cli_main(shlex.split(cmd)[1:]) == 0, where
        out = capsys.readouterr().out
        assert "resolved_stack:" in out, where
        for override in re.findall(r"stack\.policy=(\S+)", cmd):
            assert f"policy: {override}  # stack.policy" in out, where


@pytest.mark.parametrize("name", [n for n in RUNNABLE if n.startswith("stack_")])
def test_stack_blocks_resolve(name, tmp_path, capsys):
    stack = tmp_path / "stack.yaml"
    stack.write_text(block(name).text)
    assert cli_main(["config", "show", "--config", str(stack)]) == 0
    out = capsys.readouterr().out
    if "speculative: ngram" in block(name).text:
        assert "drafter: ngram  # stack.speculative" in out
    if "impl: transformers" in block(name).text:
        assert "impl: transformers" in out


def test_readme_engine_example(tmp_path):
    out = run_python_block(block("readme_engine").text, tmp_path, "readme_engine")
    assert "Paris" in out and "'completion_tokens': 16" in out, out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # generic_tool_prompt: the embedded SmolLM2's template ignores `tools` (docs/tools-and-reasoning.md)
    srv = ServerProcess(["runtime.num_threads=1", "server.generic_tool_prompt=true"],
                        tmp_path_factory.mktemp("docs-server") / "serve.log", timeout_s=300)
    yield srv
    srv.stop()


def _at(server, text: str) -> str:
    return text.replace("127.0.0.1:30000", f"127.0.0.1:{server.port}")


def run_bash_block(server, name: str) -> str:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    env = {**os.environ, "BASE": server.url, "MODEL": MODEL}
    r = subprocess.run(["bash", "-c", "set -eo pipefail\n" + _at(server, block(name).text)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, f"{name} exited {r.returncode}: {r.stderr}\n{server.logs()}"
    assert r.stdout.strip(), name
    assert not re.search(r'"error":\s*\{', r.stdout), f"{name}: {r.stdout[:2000]}"  # a response's "error": null is none
    return r.stdout


@pytest.mark.parametrize("name", ["chat", "chat_stream", "completions", "models", "generate", "health",
                                  "metrics", "flush", "abort", "server_info", "tokenize", "model_info",
                                  "tokenizer_info", "prompt_logprobs"])
def test_http_api_curl_blocks(server, name):
    out = run_bash_block(server, name)
    if name.endswith("stream"):
        assert out.rstrip().endswith("data: [DONE]"), out[-500:]
    if name == "health":
        assert out.split() == ["200", '{"status":"ok"}']
    if name == "metrics":
        assert "radixserve_requests_total{" in out
    if name == "tokenizer_info":  # what a remote-tokenizer client reads
        info = json.loads(out)
        assert info["eos_token"] and info["chat_template"] and info["model_max_length"] > 0, info
    if name == "prompt_logprobs":  # vLLM's form: per prompt token (null first) its entry and one alternative
        entries = json.loads(out)["choices"][0]["prompt_logprobs"]
        assert entries[0] is None and all(1 <= len(e) <= 2 for e in entries[1:]), entries
    if name == "tokenize":  # the prompt's ids, the chat's, then the prompt's ids back to its text
        prompt, chat, text = (json.loads(part) for part in re.split(r"(?<=\})(?=\{)", out.strip()))
        assert prompt["count"] == len(prompt["tokens"]) == len(prompt["token_strs"]) and chat["count"] > 0
        assert text == {"prompt": "Hello world"}, "the example's ids are 'Hello world' in the embedded model"


def test_responses_blocks(server, tmp_path):
    answer = json.loads(run_bash_block(server, "responses"))
    assert answer["object"] == "response" and answer["output"][0]["type"] == "message", answer
    assert answer["output"][0]["content"][0]["text"] and answer["instructions"] == "Answer in one sentence."
    printed = run_python_block(_at(server, block("responses_openai").text), tmp_path, "responses")
    assert printed.strip(), printed


def test_structured_output_blocks(server, tmp_path):
    person = json.loads(run_python_block(_at(server, block("structured_openai").text), tmp_path, "structured"))
    assert set(person) == {"name", "age"} and isinstance(person["age"], int), person
    chat = json.loads(run_bash_block(server, "structured_chat"))
    assert isinstance(json.loads(chat["choices"][0]["message"]["content"]), dict)
    outs = [json.loads(line) for line in re.split(r"(?<=\})(?=\{)", run_bash_block(server, "structured_generate"))]
    assert [json.loads(outs[0]["text"])["capital"] is not None, outs[1]["text"] in ("yes", "no"),
            outs[2]["text"].isdigit()] == [True, True, True], outs


def test_tool_calling_blocks(server, tmp_path):
    answer = json.loads(run_bash_block(server, "tools_curl"))
    assert answer["choices"][0]["finish_reason"] in ("stop", "tool_calls", "length")
    run_python_block(_at(server, block("tools_openai").text), tmp_path, "tools")
    # the streaming block runs as pasted, alone (docs audit 31: it needed the loop's client, messages and tools)
    run_python_block(_at(server, block("tools_stream").text), tmp_path, "tools_stream")
