"""The engine's OpenAI-compatible endpoint (engine/serve.py) through the official `openai` client, against a live
server process on a tiny synthetic checkpoint: plain and streamed completions, stop strings, bad requests."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

import tinyev
from engine.checkpoint import load_model
from engine.generate import generate
from engine.serve import held_back, stop_index
from tokenizers import Tokenizer
from workflow import checkpoints

openai = pytest.importorskip("openai")
PROMPT = "Question: what is 12 + 30?\nAnswer:"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cfg = yaml.safe_load((tinyev.REPO / "config/config.yaml").read_text())
    spec = cfg["checkpoint"]
    ckpt = tmp_path_factory.mktemp("serve") / "ckpt"
    checkpoints.write_synthetic(ckpt, spec["config"], spec["seed"], spec["init_std"], "float32")
    from workflow.stages.quality import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "engine.serve", "--checkpoint", str(ckpt), "--port", str(port)],
                            cwd=tinyev.REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        for _ in range(600):
            if proc.poll() is not None:
                pytest.fail(proc.stdout.read().decode()[-2000:])
            try:
                urllib.request.urlopen(f"{base}/models", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        yield base, ckpt
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0], api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(server):
    """The engine's own greedy text for PROMPT, in process."""
    ckpt = server[1]
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    gen = generate(load_model(ckpt), [tok.encode(PROMPT).ids], 16, [1])
    return tok.decode([t for t in gen.tokens[0] if t != 1], skip_special_tokens=True)


def test_models_lists_the_engine(client):
    assert [m.id for m in client.models.list().data] == ["evident-engine"]


def test_plain_completion_is_the_engines_greedy_text(client, reference):
    r = client.completions.create(model="evident-engine", prompt=PROMPT, max_tokens=16, temperature=0)
    assert r.choices[0].text == reference
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens <= 16


def test_streamed_completion_equals_the_plain_one(client, reference):
    chunks = list(client.completions.create(model="evident-engine", prompt=PROMPT, max_tokens=16, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_stop_strings_cut_the_text_plain_and_streamed(client, reference):
    assert len(reference) >= 4
    stop = reference[2:4]  # a string the greedy text is known to contain
    cut = reference[:stop_index(reference, [stop])]
    r = client.completions.create(model="evident-engine", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="evident-engine", prompt=PROMPT, max_tokens=16, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": 0.7}, "temperature"),
    ({"temperature": 0, "max_tokens": -1}, "max_tokens"),
    ({"temperature": 0, "max_tokens": 100000}, "max_tokens"),
    ({"temperature": 0, "n": 2}, "n"),
    ({"temperature": 0, "extra_body": {"bogus": 1}}, "bogus"),
])
def test_bad_requests_get_a_4xx_json_error(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="evident-engine", prompt=PROMPT, **{"max_tokens": 4, **kwargs})
    assert e.value.status_code == 400
    assert e.value.body["type"] == "invalid_request_error" and param in (e.value.body.get("param") or e.value.body["message"])


def test_unknown_model_and_missing_prompt(client, server):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2, temperature=0)
    req = urllib.request.Request(f"{server[0]}/completions", data=b'{"max_tokens": 2}',
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400 and b'"error"' in e.value.read()


def test_stop_helpers():
    assert stop_index("abc Question: x", ["Question:", "x"]) == 4
    assert stop_index("abc", ["z"]) is None
    assert held_back("abc Quest", ["Question:"]) == 5
    assert held_back("abc", ["Question:"]) == 0
