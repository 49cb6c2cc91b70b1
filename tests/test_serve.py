"""The engine's OpenAI-compatible endpoint (engine/serve.py) through the official `openai` client, against a live
server process on a tiny synthetic checkpoint: plain and streamed completions, stop strings, token-id prompts,
log-probs against the engine's own forward, echo against `forced`, usage, an event per streamed token, concurrent
requests against each alone, bad requests; and the batching worker in process."""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import tinyev
import torch
import yaml
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from evident.engine import serve
from evident.engine.checkpoint import load_model
from evident.engine.generate import Rows, generate
from evident.engine.serve import held_back, stop_index
from evident.workflow.models import checkpoints

openai = pytest.importorskip("openai")
PROMPT = "Question: what is 12 + 30?\nAnswer:"
PROMPTS = [f"Question: what is {i} + {3 * i}?{' so' * i}\nAnswer:" for i in range(8)]  # 8 lengths
LIMITS = [4 + 2 * i for i in range(len(PROMPTS))]  # their max_tokens: rows end at their own lengths
AS_IDS = {"return_tokens_as_token_ids": True}
# the random-weight model's greedy 8 tokens of these (asserted where used): printable ASCII, a token a character or two;
# and two 2-byte characters, each split over two tokens
ASCII_PROMPT, WIDE_PROMPT = "six of so one two 12", "one of the and no of"
CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}  # vLLM's usage on every event


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cfg = yaml.safe_load((tinyev.REPO / "config/config.yaml").read_text())
    spec = cfg["checkpoint"]
    ckpt = tmp_path_factory.mktemp("serve") / "ckpt"
    checkpoints.write_synthetic(ckpt, spec["config"], spec["seed"], spec["init_std"], "float32")
    from evident.workflow.plan.targets import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "evident.engine.serve", "--checkpoint", str(ckpt), "--port", str(port)],
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


def name(tok, t: int) -> str:
    """A token's name in a response: its text, or (part of a character) its bytes, from the byte-level vocabulary."""
    text = tok.decode([t], skip_special_tokens=False)
    if "\ufffd" not in text:
        return text
    raw = bytes(BYTES[c] for c in tok.id_to_token(t))
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


BYTES = {c: b for b, c in enumerate(checkpoints._bytes_alphabet())}  # the synthetic tokenizer's own table


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


def streamed(client, prompt, **kwargs) -> tuple[list, object]:
    """A stream's events that carry a choice, and its last event."""
    chunks = list(complete(client, prompt, stream=True, **kwargs))
    return [c for c in chunks if c.choices], chunks[-1]


def running(events) -> list[tuple[int, int, int]]:
    return [(e.usage.prompt_tokens, e.usage.completion_tokens, e.usage.total_tokens) for e in events]


def test_a_stream_sends_an_event_per_token_each_with_the_usage_so_far(client, engine):
    n = len(engine[1].encode(ASCII_PROMPT).ids)
    # an unknown key of stream_options is ignored, as vLLM does
    events, last = streamed(client, ASCII_PROMPT, max_tokens=8, stream_options={**CONTINUOUS, "not_an_option": 1})
    texts = [e.choices[0].text for e in events]
    assert all(texts) and "".join(texts).isascii()  # every token completes text here
    assert len(events) == 8 and running(events) == [(n, k, n + k) for k in range(1, 9)]
    assert [e.choices[0].finish_reason for e in events] == [None] * 7 + ["length"]
    assert last.choices == [] and running([last]) == [(n, 8, n + 8)]
    # usage on every event only with both options (vLLM's); the events are the same
    for options in ({"include_usage": True}, {"continuous_usage_stats": True}):
        again, _ = streamed(client, ASCII_PROMPT, max_tokens=8, stream_options=options)
        assert [e.choices[0].text for e in again] == texts and all(e.usage is None for e in again)


def test_a_token_within_a_character_gets_an_event_of_no_text(client, engine):
    model, tok = engine
    tokens = generate(model, [tok.encode(WIDE_PROMPT).ids], 8, [1]).tokens[0]
    plain = complete(client, WIDE_PROMPT, max_tokens=8).choices[0]
    assert not plain.text.isascii() and "\ufffd" not in plain.text  # whole characters, not all of one byte
    events, _ = streamed(client, WIDE_PROMPT, max_tokens=8, stream_options=CONTINUOUS)
    texts = [e.choices[0].text for e in events]
    assert len(events) == len(tokens) and [e.usage.completion_tokens for e in events] == list(range(1, len(tokens) + 1))
    # each event has the text its token completed: "" for a character's first byte, the character with its last
    decoder = DecodeStream(skip_special_tokens=True)
    assert texts == [decoder.step(tok, t) or "" for t in tokens] and "" in texts
    assert "".join(texts) == plain.text


def test_text_held_back_for_a_stop_string_still_gets_its_events(client):
    texts = [e.choices[0].text for e in streamed(client, ASCII_PROMPT, max_tokens=8)[0]]
    stop, cut = texts[5] + texts[6], "".join(texts[:5])  # the stop string is the text of tokens 6 and 7
    assert stop_index("".join(texts), [stop]) == len(cut)
    plain = complete(client, ASCII_PROMPT, max_tokens=8, stop=stop)
    assert (plain.choices[0].text, plain.usage.completion_tokens) == (cut, 7)
    events, _ = streamed(client, ASCII_PROMPT, max_tokens=8, stop=stop, stream_options=CONTINUOUS)
    # token 6's text waits (it could start the stop string), token 7 completes the stop string: both are cut
    assert [e.choices[0].text for e in events] == texts[:5] + ["", ""]
    assert [e.usage.completion_tokens for e in events] == list(range(1, 8))
    assert events[-1].choices[0].finish_reason == "stop"


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
    assert named.logprobs.tokens == [name(tok, t) for t in got]
    assert named.logprobs.text_offset[0] == 0 and named.logprobs.text_offset == sorted(named.logprobs.text_offset)
    for i, at in enumerate(named.logprobs.text_offset):
        if "\ufffd" not in (before := tok.decode(got[:i], skip_special_tokens=True)):  # not within a character
            assert named.text[:at] == before
    echoed = complete(client, PROMPT, max_tokens=8, logprobs=0, echo=True).choices[0]
    assert echoed.logprobs.text_offset[len(ids)] == len(PROMPT)


def test_echo_gives_the_prompts_forced_log_probs(client, engine, reference):
    model, tok = engine
    ids = tok.encode(PROMPT).ids
    want = completion_logprobs(model, ids[:1], ids[1:])  # one plain forward: row p - 1 predicts token p
    r = complete(client, PROMPT, max_tokens=0, echo=True, logprobs=3, extra_body=AS_IDS)
    c = r.choices[0]
    assert c.text == PROMPT and token_ids(c) == ids
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None  # as OpenAI and vLLM
    for p in range(1, len(ids)):
        assert c.logprobs.token_logprobs[p] == pytest.approx(want[p - 1, ids[p]].item(), abs=1e-5)
        top = torch.topk(want[p - 1], 3).indices.tolist()
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
    chunks = list(complete(client, prompts, max_tokens=6, stream=True, stream_options=CONTINUOUS))
    assert chunks[-1].choices == [] and chunks[-1].usage == r.usage
    for c, p in zip(r.choices, prompts):  # each prompt's stream, by index; its events count its own tokens (vLLM's)
        own = [k for k in chunks if k.choices and k.choices[0].index == c.index]
        assert "".join(k.choices[0].text for k in own) == c.text
        n = len(engine[1].encode(p).ids)
        assert running(own) == [(n, k, n + k) for k in range(1, len(token_ids(c)) + 1)]


def test_concurrent_requests_are_token_identical_to_each_alone(client, alone):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        rs = list(pool.map(lambda pn: complete(client, pn[0], max_tokens=pn[1], logprobs=0, extra_body=AS_IDS),
                           zip(PROMPTS, LIMITS)))
    assert [token_ids(r.choices[0]) for r in rs] == alone


def test_the_worker_decodes_concurrent_rows_in_one_batch(engine, alone, monkeypatch):
    model, tok = engine
    batches = recording(monkeypatch)
    eng = serve.Engine(model, tok, [1], "tiny", window_s=600)  # the batch closes when its 8 rows have arrived
    out = queue.Queue()
    jobs = [serve.Job(i, tok.encode(p).ids, n, [], 2, False, False, out.put)
            for i, (p, n) in enumerate(zip(PROMPTS, LIMITS))]
    eng.submit(jobs)
    events = [out.get(timeout=120) for _ in jobs]
    assert [[len(p) for p in b.joins] for b in batches] == [[len(jobs)]]  # one prefill of every row
    assert {kind for _, kind, _ in events} == {"done"}
    assert [j.tokens for j in jobs] == alone
    for j in jobs:  # each row's log-probs are its own
        want = completion_logprobs(model, j.ids, j.tokens)
        got = [lp for _, lp, _ in j.entries]
        assert got == pytest.approx([want[step, t].item() for step, t in enumerate(j.tokens)], abs=1e-5)
    # each row is answered when it ends, not when its batch does
    assert [i for i, _, _ in events] == sorted(range(len(jobs)), key=lambda i: (len(jobs[i].tokens), i))


def test_rows_with_and_without_log_probs_share_a_batch(engine, monkeypatch):
    """While a row asks for log-probs, the batch steps one at a time (its logits reach the host before the pick);
    after it ends, each step is launched before the last one's tokens reach the host, so the other row's slot is
    stepped once more after its last token. Both rows get their tokens alone, and the first its own log-probs."""
    model, tok = engine
    batches = recording(monkeypatch)
    eng = serve.Engine(model, tok, [], "tiny", max_batch=2, window_s=600)  # the batch closes at 2 rows
    out = queue.Queue()
    jobs = [serve.Job(0, tok.encode(PROMPTS[1]).ids, 4, [], 2, False, False, out.put),
            serve.Job(1, tok.encode(PROMPTS[2]).ids, 12, [], None, False, False, out.put)]
    eng.submit(jobs)
    assert sorted(out.get(timeout=120)[:2] for _ in jobs) == [(0, "done"), (1, "done")]
    batch, = settled(batches, 1)
    assert batch.steps == [[0, 1]] * 3 + [[1]] * 9
    assert [j.tokens for j in jobs] == [generate(model, [j.ids], j.max_tokens, []).tokens[0] for j in jobs]
    want = completion_logprobs(model, jobs[0].ids, jobs[0].tokens)
    assert [lp for _, lp, _ in jobs[0].entries] == pytest.approx(
        [want[step, t].item() for step, t in enumerate(jobs[0].tokens)], abs=1e-5)


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
    ({"logprobs": True}, "logprobs"),  # a bool is not a count
    ({"max_tokens": True}, "max_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # as OpenAI: only with stream
    ({"stream": True, "stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
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


def test_max_tokens_null_is_openais_default_of_16(server):
    status, null = post(server[0], {"prompt": PROMPT, "max_tokens": None, "logprobs": 0, **AS_IDS})
    assert status == 200
    sixteen = post(server[0], {"prompt": PROMPT, "max_tokens": 16, "logprobs": 0, **AS_IDS})[1]
    assert null["choices"][0]["logprobs"]["tokens"] == sixteen["choices"][0]["logprobs"]["tokens"]


def test_text_offsets_stay_within_a_text_a_stop_string_cut(client):
    full = complete(client, PROMPT, max_tokens=16, logprobs=0, extra_body=AS_IDS).choices[0]
    ids, at = token_ids(full), full.logprobs.text_offset
    # a stop string from the last character before token i to its first: the cut falls before where token i starts
    i = next(i for i in range(1, len(ids)) if at[i] >= 2 and len(full.text) > at[i])
    stop = full.text[at[i] - 1:at[i] + 1]
    cut = complete(client, PROMPT, max_tokens=16, logprobs=0, stop=[stop]).choices[0]
    assert cut.text == full.text[:stop_index(full.text, [stop])] and cut.finish_reason == "stop"
    assert len(cut.text) < at[i] and max(cut.logprobs.text_offset) <= len(cut.text)


def test_top_logprobs_keep_k_entries_across_a_multi_byte_character(client, engine):
    tok, k = engine[1], serve.MAX_LOGPROBS
    prompt = "Question: what is 12 \u00d7 30 \u2248 \u00e9t\u00e9 \u20ac?\nAnswer:"
    ids = tok.encode(prompt).ids
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # the prompt has tokens within a character
    named = complete(client, prompt, max_tokens=4, echo=True, logprobs=k).choices[0]
    by_id = complete(client, prompt, max_tokens=4, echo=True, logprobs=k, extra_body=AS_IDS).choices[0]
    assert named.logprobs.tokens == [name(tok, t) for t in token_ids(by_id)]
    for top, top_by_id in zip(named.logprobs.top_logprobs[1:], by_id.logprobs.top_logprobs[1:]):
        assert len(top) == len(top_by_id) in (k, k + 1)  # k, and the token itself when not among them
        assert list(top) == [name(tok, t) for t in top_ids(top_by_id)]
    assert any(t.startswith("bytes:") for top in named.logprobs.top_logprobs[1:] for t in top)
    # text_offset: each token where the tokens before it end, a token within a character at the character's start
    offsets = named.logprobs.text_offset
    for i, at in enumerate(offsets[:len(ids)]):
        if "\ufffd" not in (before := tok.decode(ids[:i], skip_special_tokens=True)):
            assert at == len(before) and prompt[:at] == before


# --- the worker and the app in process -------------------------------------------------------------------------------

@contextlib.contextmanager
def live(eng):
    """The app over ``eng`` on a free port, in this process (so that its engine can be instrumented)."""
    import uvicorn

    from evident.workflow.plan.targets import free_port

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(serve.create_app(eng), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        srv.should_exit = True
        thread.join(30)


def post(base: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(f"{base}/completions", json.dumps({"temperature": 0, **body}).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def recording(monkeypatch, before=None) -> list:
    """serve.Rows, recorded: a batch each, in order, with its joins (the prompts of each), the live slots of each step,
    the tokens of each row in the order they joined (``tokens``) and ``ended`` (set when its last row leaves);
    ``before()`` runs first as each batch starts."""
    batches = []

    class Recorded(Rows):
        def __init__(self, *args, **kwargs):
            if before is not None:
                before()
            super().__init__(*args, **kwargs)
            self.joins, self.steps, self.tokens, self.ended, self.row = [], [], [], threading.Event(), {}
            batches.append(self)

        def join(self, prompts):
            slots, logits = super().join(prompts)
            self.joins.append([list(p) for p in prompts])
            for s in slots:
                self.row[s] = len(self.tokens)
                self.tokens.append([])
            return slots, logits

        def step(self):
            live, logits = super().step()
            self.steps.append(live)
            return live, logits

        def _hand(self, slots, joined, ids, margins, take):  # advance's and finish's: every token a row is handed
            def recorded(s, t, margin):
                self.tokens[self.row[s]].append(t)
                return take(s, t, margin)

            return super()._hand(slots, joined, ids, margins, recorded)

        def leave(self, slot):
            super().leave(slot)
            if not any(self.live):
                self.ended.set()

    monkeypatch.setattr(serve, "Rows", Recorded)
    return batches


def settled(batches: list, n: int) -> list:
    """batches once n have started and ended (a row is answered before its batch ends)."""
    deadline = time.monotonic() + 120
    while len(batches) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    for b in batches:
        b.ended.wait(max(0.0, deadline - time.monotonic()))
    return batches


def test_pending_requests_hold_no_thread_and_models_still_answers(engine, monkeypatch):
    model, tok = engine
    release = threading.Event()
    recording(monkeypatch, before=lambda: release.wait(120))  # every batch waits: requests pile up
    eng = serve.Engine(model, tok, [1], "tiny")
    submitted, submit = [], eng.submit
    monkeypatch.setattr(eng, "submit", lambda jobs: (submitted.extend(jobs), submit(jobs))[1])
    n = 45  # more than Starlette's 40 threads, which held one each while waiting
    with live(eng) as base, ThreadPoolExecutor(n) as pool:
        try:
            futures = [pool.submit(post, base, {"prompt": PROMPT, "max_tokens": 2}) for _ in range(n)]
            deadline = time.monotonic() + 60
            while len(submitted) < n and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(submitted) == n  # every request reached the engine, none waits for a thread
            with urllib.request.urlopen(f"{base}/models", timeout=30) as r:
                assert json.loads(r.read())["data"][0]["id"] == "tiny"
        finally:
            release.set()
        results = [f.result() for f in futures]
    assert [status for status, _ in results] == [200] * n
    assert len({doc["choices"][0]["text"] for _, doc in results}) == 1


def test_a_failed_batch_answers_each_row_500_and_the_next_batch_runs(engine, monkeypatch):
    model, tok = engine
    calls = []

    def flaky():
        calls.append(len(calls))
        if len(calls) == 1:
            raise RuntimeError("boom")

    batches = recording(monkeypatch, before=flaky)
    eng = serve.Engine(model, tok, [1], "tiny", max_batch=3, window_s=600)  # a batch closes at 3 rows
    with live(eng) as base:
        with ThreadPoolExecutor(3) as pool:
            failed = list(pool.map(lambda p: post(base, {"prompt": p, "max_tokens": 3}), PROMPTS[:3]))
        ok = post(base, {"prompt": PROMPTS[:3], "max_tokens": 3})
    assert len(calls) == 2 and [[len(p) for p in b.joins] for b in batches] == [[3]]  # the first failed at its start
    assert [status for status, _ in failed] == [500] * 3
    assert all(doc["error"]["type"] == "server_error" and "boom" in doc["error"]["message"] for _, doc in failed)
    assert ok[0] == 200 and len(ok[1]["choices"]) == 3


def test_a_batch_failing_mid_decode_answers_only_its_unfinished_rows_500(engine, monkeypatch):
    """Its second step fails: the row that ended at the first is answered, the other gets the 500, the next runs."""
    model, tok = engine
    steps = []

    class Failing(serve.Rows):
        def step(self):
            steps.append(len(steps))
            if len(steps) == 2:
                raise RuntimeError("boom mid-batch")
            return super().step()

    monkeypatch.setattr(serve, "Rows", Failing)
    eng = serve.Engine(model, tok, [], "tiny", max_batch=2, window_s=600)  # a batch closes at 2 rows
    with live(eng) as base:
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda pn: post(base, {"prompt": pn[0], "max_tokens": pn[1]}),
                                zip(PROMPTS[:2], (2, 6))))
        after = post(base, {"prompt": PROMPTS[:2], "max_tokens": 3})  # two rows: the batch closes
    assert [status for status, _ in got] == [200, 500] and "boom mid-batch" in got[1][1]["error"]["message"]
    assert got[0][1]["choices"][0]["finish_reason"] == "length" and after[0] == 200


def test_a_dead_worker_answers_what_waits_and_then_503(engine, monkeypatch):
    model, tok = engine
    eng = serve.Engine(model, tok, [1], "tiny")

    def broken(jobs):
        raise AssertionError("a bug in the batcher")

    monkeypatch.setattr(eng, "_drain", broken)  # outside the batch's guard: it used to kill the thread silently
    with live(eng) as base:
        pending = post(base, {"prompt": PROMPT, "max_tokens": 2}, timeout=60)
        after = post(base, {"prompt": PROMPT, "max_tokens": 2}, timeout=60)
        with urllib.request.urlopen(f"{base}/models", timeout=30) as r:
            assert r.status == 200
    assert pending[0] == 500 and "a bug in the batcher" in pending[1]["error"]["message"]
    assert after[0] == 503 and after[1]["error"]["type"] == "server_error"


def test_a_cancelled_row_stops_while_its_batchmate_finishes(engine, monkeypatch):
    model, tok = engine
    batches = recording(monkeypatch)
    eng = serve.Engine(model, tok, [], "tiny", max_batch=2, window_s=600)
    out = queue.Queue()
    jobs = [serve.Job(i, tok.encode(p).ids, 24, [], None, False, False, out.put) for i, p in enumerate(PROMPTS[3:5])]
    emitted = eng._emitted

    def client_leaves(job, toks):  # the first row's client goes away after its third token
        if job is jobs[0] and len(toks) == 3:
            job.cancelled = True
        return emitted(job, toks)

    monkeypatch.setattr(eng, "_emitted", client_leaves)
    eng.submit(jobs)
    assert out.get(timeout=120)[:2] == (1, "done")
    batch, = settled(batches, 1)
    assert len(batch.tokens[0]) == 3 and out.empty()  # stopped at once, unanswered
    # its slot stepped for tokens 2 and 3, and once more: the step launched before its third token reached the host
    assert sum(0 in live for live in batch.steps) == 3
    assert batch.tokens[1] == jobs[1].tokens == generate(model, [jobs[1].ids], 24, []).tokens[0]


def test_a_stop_string_ends_only_its_own_row(engine, monkeypatch):
    model, tok = engine
    batches = recording(monkeypatch)
    ids = [tok.encode(p).ids for p in PROMPTS[2:4]]
    alone = [generate(model, [i], 12, []).tokens[0] for i in ids]
    text = tok.decode(alone[0], skip_special_tokens=True)
    assert len(text) >= 3
    stop = text[1:3]
    eng = serve.Engine(model, tok, [], "tiny", max_batch=2, window_s=600)
    out = queue.Queue()
    jobs = [serve.Job(0, ids[0], 12, [stop], None, False, False, out.put),
            serve.Job(1, ids[1], 12, [], None, False, False, out.put)]
    eng.submit(jobs)
    assert [out.get(timeout=120)[:2] for _ in jobs] == [(0, "done"), (1, "done")]
    assert len(settled(batches, 1)) == 1
    assert jobs[0].finish == "stop" and jobs[0].text == text[:stop_index(text, [stop])]
    assert jobs[0].tokens == alone[0][:len(jobs[0].tokens)] and len(jobs[0].tokens) < 12
    assert jobs[1].finish == "length" and jobs[1].tokens == alone[1]


def test_ignore_eos_decodes_past_eos_and_a_streams_last_event_carries_its_finish(engine):
    model, tok = engine
    ids = tok.encode(PROMPT).ids
    free = generate(model, [ids], 6, []).tokens[0]
    eos = free[1]  # the row's second token is EOS here
    eng = serve.Engine(model, tok, [eos], "tiny", max_batch=2, window_s=600)
    out = queue.Queue()
    jobs = [serve.Job(0, ids, 6, [], None, False, True, out.put),
            serve.Job(1, ids, 6, [], None, False, True, out.put, ignore_eos=True)]
    eng.submit(jobs)
    events: dict[int, list] = {0: [], 1: []}
    while sum(kind == "done" for e in events.values() for _, kind, _ in e) < 2:
        i, kind, value = out.get(timeout=120)
        events[i].append((i, kind, value))
    assert (jobs[0].tokens, jobs[0].finish) == (free[:free.index(eos) + 1], "stop")
    assert (jobs[1].tokens, jobs[1].finish) == (free, "length")  # on to max_tokens, as the benchmarks ask
    for j in jobs:  # a text event a token, then the done event with the rest, with the last token (EOS's: no text)
        *texts, (_, kind, rest) = events[j.index]
        assert kind == "done" and all(k == "text" for _, k, _ in texts)
        assert "".join(v for _, _, v in texts) + rest == j.text and len(events[j.index]) == len(j.tokens)


def test_the_decode_path_is_the_servers_choice(server, monkeypatch):
    ckpt = str(server[1])
    # the kernels on the GPU where there is one; a CPU runs them under the interpreter, which conftest sets only there
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert serve.load_engine(ckpt).model.pick_kernel is None
    assert serve.load_engine(ckpt, device, kernels="triton").model.pick_kernel is not None
    assert serve.load_engine(ckpt, device, kernels="graph").model.graph_decode is not None
    if not torch.cuda.is_available():
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(SystemExit, match="TRITON_INTERPRET=1"):
            serve.load_engine(ckpt, kernels="graph")


def test_an_echo_row_of_no_tokens_rides_along_a_decoding_batch(engine, monkeypatch):
    model, tok = engine
    batches = recording(monkeypatch)
    ids = [tok.encode(p).ids for p in PROMPTS[:3]]
    eng = serve.Engine(model, tok, [1], "tiny", max_batch=3, window_s=600)
    out = queue.Queue()
    jobs = [serve.Job(0, ids[0], 0, [], 2, True, False, out.put)] + \
        [serve.Job(i, ids[i], 6, [], None, False, False, out.put) for i in (1, 2)]
    eng.submit(jobs)
    assert out.get(timeout=120)[:2] == (0, "done")  # answered before the others decode
    assert sorted(out.get(timeout=120)[:2] for _ in (1, 2)) == [(1, "done"), (2, "done")]
    batch, = settled(batches, 1)
    assert batch.joins == [ids] and batch.steps and all(0 not in live for live in batch.steps)  # prefilled, gone
    assert [j.tokens for j in jobs[1:]] == [generate(model, [i], 6, [1]).tokens[0] for i in ids[1:]]
    want = completion_logprobs(model, ids[0][:1], ids[0][1:])
    assert jobs[0].tokens == [] and jobs[0].entries[0] == (ids[0][0], None, None)
    assert [lp for _, lp, _ in jobs[0].entries[1:]] == \
        pytest.approx([want[p - 1, t].item() for p, t in enumerate(ids[0]) if p], abs=1e-5)


def test_rows_of_any_lengths_share_one_cache(engine, monkeypatch):
    """Each row's own prompt and max_tokens bound the cache, not the longest prompt plus the largest max_tokens."""
    model, tok = engine
    batches = recording(monkeypatch)
    limit = model.args.max_position_embeddings
    long, short = (tok.encode(PROMPTS[7]).ids * limit)[:limit - 40], tok.encode(PROMPT).ids
    assert len(long) + 60 > limit >= len(short) + 60  # the longest prompt and the largest max_tokens overflow it
    eng = serve.Engine(model, tok, [], "tiny", max_batch=2, window_s=600)
    out = queue.Queue()
    jobs = [serve.Job(0, long, 4, [], None, False, False, out.put),
            serve.Job(1, short, 60, [], None, False, False, out.put)]
    eng.submit(jobs)
    assert [out.get(timeout=120)[:2] for _ in jobs] == [(0, "done"), (1, "done")]
    assert [b.tokens for b in settled(batches, 1)] == [[jobs[0].tokens, jobs[1].tokens]]
    assert [j.tokens for j in jobs] == [generate(model, [j.ids], j.max_tokens, []).tokens[0] for j in jobs]


def arriving(eng, monkeypatch, when, jobs: list) -> None:
    """jobs submitted from within the worker as soon as ``when(job, tokens)`` holds after a row's token: a row
    arriving while the batch decodes, at a known step."""
    emitted = eng._emitted

    def hook(job, toks):
        done = emitted(job, toks)
        if jobs and when(job, toks):
            eng.submit([jobs.pop(0)])
        return done

    monkeypatch.setattr(eng, "_emitted", hook)


@pytest.mark.parametrize("join", serve.JOINS)
def test_a_row_arriving_mid_batch_joins_at_the_next_step_or_waits_for_the_next_batch(engine, monkeypatch, join):
    model, tok = engine
    batches = recording(monkeypatch)
    eng = serve.Engine(model, tok, [], "tiny", max_batch=2, window_s=0, join=join)
    out = queue.Queue()
    first, late = (serve.Job(i, tok.encode(PROMPTS[k]).ids, n, [], None, False, False, out.put)
                   for i, (k, n) in enumerate([(3, 24), (5, 8)]))
    arriving(eng, monkeypatch, lambda job, toks: job is first and len(toks) == 3, [late])
    eng.submit([first])
    assert sorted(out.get(timeout=120)[:2] for _ in range(2)) == [(0, "done"), (1, "done")]
    assert [j.tokens for j in (first, late)] == [generate(model, [j.ids], j.max_tokens, []).tokens[0]
                                                 for j in (first, late)]
    # Each step is launched before the last one's tokens reach the host: a row's slot is stepped once more after its
    # last token (dropped), and the late row joins after the step of the first row's fourth token was launched
    if join == "step":  # prefilled then, and stepped beside the first from the next step on
        batch, = settled(batches, 1)
        assert batch.joins == [[first.ids], [late.ids]]
        assert batch.steps == [[0]] * 3 + [[0, 1]] * 8 + [[0]] * 13
    else:
        assert [b.joins for b in settled(batches, 2)] == [[[first.ids]], [[late.ids]]]
        assert batches[0].steps == [[0]] * 24 and batches[1].steps == [[0]] * 8


def test_a_row_that_does_not_fit_the_running_cache_waits_for_the_next_batch_and_is_not_passed_over(engine,
                                                                                                    monkeypatch):
    """The long row arrives at the first row's second token, a short one that would fit at its third: both wait, and
    start the next batch together."""
    model, tok = engine
    batches = recording(monkeypatch)
    eng = serve.Engine(model, tok, [], "tiny", max_batch=3, window_s=0, join="step", cache_len=0)  # first row's need
    out = queue.Queue()
    first, long, short = (serve.Job(i, tok.encode(PROMPTS[k]).ids, n, [], None, False, False, out.put)
                          for i, (k, n) in enumerate([(1, 6), (7, 30), (0, 3)]))
    assert len(long.ids) + 30 > len(first.ids) + 6 >= len(short.ids) + 3
    arriving(eng, monkeypatch, lambda job, toks: job is first and len(toks) in (2, 3), [long, short])
    eng.submit([first])
    assert sorted(out.get(timeout=120)[:2] for _ in range(3)) == [(0, "done"), (1, "done"), (2, "done")]
    assert [b.joins for b in settled(batches, 2)] == [[[first.ids]], [[long.ids, short.ids]]]
    assert [j.tokens for j in (long, short)] == [generate(model, [j.ids], j.max_tokens, []).tokens[0]
                                                 for j in (long, short)]


def test_a_row_joins_the_slot_an_ended_row_left(engine, monkeypatch):
    """Rows 0 and 1 start together; row 0 ends at its third token, and its slot stays idle among the stepped ones
    until row 2 arrives (at row 1's eighth token) and takes it: every row gets the tokens it gets alone."""
    model, tok = engine
    batches = recording(monkeypatch)
    eng = serve.Engine(model, tok, [], "tiny", max_batch=2, window_s=600, join="step")
    out = queue.Queue()
    jobs = [serve.Job(i, tok.encode(PROMPTS[k]).ids, n, [], None, False, False, out.put)
            for i, (k, n) in enumerate([(2, 3), (4, 20), (6, 6)])]
    arriving(eng, monkeypatch, lambda job, toks: job is jobs[1] and len(toks) == 8, [jobs[2]])
    eng.submit(jobs[:2])
    assert sorted(out.get(timeout=120)[:2] for _ in jobs) == [(0, "done"), (1, "done"), (2, "done")]
    batch, = settled(batches, 1)
    assert batch.joins == [[jobs[0].ids, jobs[1].ids], [jobs[2].ids]] and batch.row == {0: 2, 1: 1}
    assert [1] in batch.steps and batch.tokens == [j.tokens for j in jobs]
    assert [j.tokens for j in jobs] == [generate(model, [j.ids], j.max_tokens, []).tokens[0] for j in jobs]


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_cancels_its_row(engine, monkeypatch, stream):
    model, tok = engine
    batches = recording(monkeypatch)
    eng = serve.Engine(model, tok, [], "tiny")
    emitted = eng._emitted

    def waits_for_the_server(job, toks):  # the row holds at its third token until the server marks it cancelled
        deadline = time.monotonic() + 60
        while job.max_tokens == 50 and len(toks) == 3 and not job.cancelled and time.monotonic() < deadline:
            time.sleep(0.05)
        return emitted(job, toks)

    monkeypatch.setattr(eng, "_emitted", waits_for_the_server)
    with live(eng) as base:
        req = urllib.request.Request(f"{base}/completions", json.dumps(
            {"prompt": PROMPT, "max_tokens": 50, "temperature": 0, "stream": stream}).encode(),
            {"Content-Type": "application/json"})
        if stream:
            urllib.request.urlopen(req, timeout=60).close()  # the headers, then gone
        else:
            with pytest.raises(TimeoutError):
                urllib.request.urlopen(req, timeout=1)
        # the one worker answers a later request after the left row's batch (if it ran: it may end before its start)
        assert post(base, {"prompt": PROMPT, "max_tokens": 5})[0] == 200
        deadline = time.monotonic() + 60
        while not any(len(t) == 5 for b in batches for t in b.tokens) and time.monotonic() < deadline:
            time.sleep(0.05)
    *left, probe = [len(t) for b in batches for t in b.tokens]  # in the order the rows joined
    assert probe == 5 and left in ([], [1], [2], [3])  # ended as soon as the server saw it go, not at 50
