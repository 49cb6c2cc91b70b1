"""The engine's OpenAI-compatible endpoint (engine/serve.py) through the official `openai` client, against a live
server process on a tiny synthetic checkpoint: plain and streamed completions, stop strings, token-id prompts,
log-probs against the engine's own forward, echo against `forced`, usage, concurrent requests against each alone,
bad requests; and the batching worker in process."""

from __future__ import annotations

import queue
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import yaml

import tinyev
from engine import serve
from engine.checkpoint import load_model
from engine.generate import forced, generate
from engine.serve import held_back, stop_index
from tokenizers import Tokenizer
from workflow import checkpoints

openai = pytest.importorskip("openai")
PROMPT = "Question: what is 12 + 30?\nAnswer:"
PROMPTS = [f"Question: what is {i} + {3 * i}?{' so' * i}\nAnswer:" for i in range(8)]  # 8 lengths
LIMITS = [4 + 2 * i for i in range(len(PROMPTS))]  # their max_tokens: rows end at their own lengths
AS_IDS = {"return_tokens_as_token_ids": True}


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
def engine(server):
    """The served checkpoint's model and tokenizer, in process."""
    return load_model(server[1]), Tokenizer.from_file(str(server[1] / "tokenizer.json"))


@pytest.fixture(scope="module")
def reference(engine):
    """The engine's own greedy text for PROMPT, in process."""
    model, tok = engine
    gen = generate(model, [tok.encode(PROMPT).ids], 16, [1])
    return tok.decode([t for t in gen.tokens[0] if t != 1], skip_special_tokens=True)


@pytest.fixture(scope="module")
def alone(engine) -> list[list[int]]:
    """Each of PROMPTS decoded alone, in process."""
    model, tok = engine
    return [generate(model, [tok.encode(p).ids], n, [1]).tokens[0] for p, n in zip(PROMPTS, LIMITS)]


def completion_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The float32 log-softmax each of tokens was picked from, by one forward over prompt + tokens."""
    full = prompt + tokens
    with torch.inference_mode():  # position p predicts token p + 1
        logits = model(torch.tensor([full]), model.new_cache(1, len(full)))[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), -1)


def complete(client, prompt, **kwargs):
    return client.completions.create(**{"model": "evident-engine", "prompt": prompt, "temperature": 0, **kwargs})


def token_ids(choice) -> list[int]:
    """A choice's tokens, asked with return_tokens_as_token_ids."""
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


def top_ids(top: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in top]


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


def test_token_id_prompts_give_the_text_prompts_completion(client, engine, reference):
    ids = engine[1].encode(PROMPT).ids
    for prompt in (ids, [ids]):
        assert [c.text for c in complete(client, prompt, max_tokens=16).choices] == [reference]
    other = complete(client, PROMPTS[3], max_tokens=16).choices[0].text
    for prompts in ([PROMPT, PROMPTS[3]], [ids, engine[1].encode(PROMPTS[3]).ids]):  # one choice per prompt, in order
        r = complete(client, prompts, max_tokens=16)
        assert [(c.index, c.text) for c in r.choices] == [(0, reference), (1, other)]


def test_logprobs_are_the_engines_own_log_softmax(client, engine):
    model, tok = engine
    ids = tok.encode(PROMPT).ids
    r = complete(client, PROMPT, max_tokens=8, logprobs=5, extra_body=AS_IDS)
    lp, got = r.choices[0].logprobs, token_ids(r.choices[0])
    assert got == generate(model, [ids], 8, [1]).tokens[0]
    for row, t, value, top in zip(completion_logprobs(model, ids, got), got, lp.token_logprobs, lp.top_logprobs):
        assert value == pytest.approx(row[t].item(), abs=1e-5)
        assert top_ids(top) == torch.topk(row, 5).indices.tolist() and top_ids(top)[0] == t  # greedy: the top-1
        assert list(top.values()) == sorted(top.values(), reverse=True)
        assert list(top.values()) == pytest.approx(row[top_ids(top)].tolist(), abs=1e-5)
    # token strings by default; text_offset: where each token starts in the text (echo: after the prompt)
    named = complete(client, PROMPT, max_tokens=8, logprobs=5).choices[0]
    assert named.logprobs.tokens == [tok.decode([t], skip_special_tokens=False) for t in got]
    assert named.logprobs.text_offset[0] == 0 and named.logprobs.text_offset == sorted(named.logprobs.text_offset)
    for i, at in enumerate(named.logprobs.text_offset):
        if "\ufffd" not in (before := tok.decode(got[:i], skip_special_tokens=True)):  # not within a character
            assert named.text[:at] == before
    echoed = complete(client, PROMPT, max_tokens=8, logprobs=0, echo=True).choices[0]
    assert echoed.logprobs.text_offset[len(ids)] == len(PROMPT)


def test_echo_gives_the_prompts_forced_log_probs(client, engine, reference):
    model, tok = engine
    ids = tok.encode(PROMPT).ids
    seen = []
    forced(model, [ids], [[]], lambda logits: seen.append(torch.log_softmax(logits[0].float(), -1)))
    r = complete(client, PROMPT, max_tokens=0, echo=True, logprobs=3, extra_body=AS_IDS)
    c = r.choices[0]
    assert c.text == PROMPT and token_ids(c) == ids
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None  # as OpenAI and vLLM
    for p in range(1, len(ids)):
        assert c.logprobs.token_logprobs[p] == pytest.approx(seen[0][p - 1, ids[p]].item(), abs=1e-5)
        top = torch.topk(seen[0][p - 1], 3).indices.tolist()
        assert top_ids(c.logprobs.top_logprobs[p]) == top + ([ids[p]] if ids[p] not in top else [])
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 0, len(ids))
    assert complete(client, PROMPT, max_tokens=16, echo=True).choices[0].text == PROMPT + reference


def test_usage_counts_plain_and_streamed(client, engine):
    prompts = [PROMPT, PROMPTS[5]]
    r = complete(client, prompts, max_tokens=6, logprobs=0, extra_body=AS_IDS)
    n_prompt = sum(len(engine[1].encode(p).ids) for p in prompts)
    n_new = sum(len(token_ids(c)) for c in r.choices)
    usage = (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens)
    assert usage == (n_prompt, n_new, n_prompt + n_new)
    chunks = list(complete(client, prompts, max_tokens=6, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage == r.usage
    for c in r.choices:  # each prompt's stream, by index
        assert "".join(k.choices[0].text for k in chunks if k.choices and k.choices[0].index == c.index) == c.text


def test_concurrent_requests_are_token_identical_to_each_alone(client, alone):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        rs = list(pool.map(lambda pn: complete(client, pn[0], max_tokens=pn[1], logprobs=0, extra_body=AS_IDS),
                           zip(PROMPTS, LIMITS)))
    assert [token_ids(r.choices[0]) for r in rs] == alone


def test_the_worker_decodes_concurrent_rows_in_one_batch(engine, alone, monkeypatch):
    model, tok = engine
    calls = []

    def recorded(model, prompts, *args, **kwargs):
        calls.append(len(prompts))
        return generate(model, prompts, *args, **kwargs)

    monkeypatch.setattr(serve, "generate", recorded)
    eng = serve.Engine(model, tok, [1], "tiny", window_s=600)  # the batch closes when its 8 rows have arrived
    out = queue.Queue()
    jobs = [serve.Job(i, tok.encode(p).ids, n, [], 2, False, False, out)
            for i, (p, n) in enumerate(zip(PROMPTS, LIMITS))]
    eng.submit(jobs)
    events = [out.get(timeout=120) for _ in jobs]
    assert calls == [len(jobs)] and {kind for _, kind, _ in events} == {"done"}
    assert [j.tokens for j in jobs] == alone
    for j in jobs:  # each row's log-probs are its own
        want = completion_logprobs(model, j.ids, j.tokens)
        got = [lp for _, lp, _ in j.entries]
        assert got == pytest.approx([want[step, t].item() for step, t in enumerate(j.tokens)], abs=1e-5)
    # each row is answered when it ends, not when its batch does
    assert [i for i, _, _ in events] == sorted(range(len(jobs)), key=lambda i: (len(jobs[i].tokens), i))


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": 0.7}, "temperature"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 100000}, "max_tokens"),
    ({"prompt": [PROMPT, "x" * 300]}, "max_tokens"),
    ({"n": 2}, "n"),
    ({"extra_body": {"bogus": 1}}, "bogus"),
    ({"prompt": [0, 512]}, "prompt"),  # the tiny model's vocabulary is 512 ids
    ({"prompt": [[0, 5], [0, -1]]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [0, "a"]}, "prompt"),
    ({"logprobs": serve.MAX_LOGPROBS + 1}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"echo": True, "stream": True}, "echo"),
    ({"logprobs": 2, "stream": True}, "logprobs"),
])
def test_bad_requests_get_a_4xx_json_error(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, **{"prompt": PROMPT, "max_tokens": 4, **kwargs})
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
