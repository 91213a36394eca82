"""``python/completions_server.py`` on loopback: concurrent /v1/completions requests (streamed and not, greedy and
seeded sampling) each get the text of their request decoded alone; a client that disconnects mid-stream has its
request cancelled; bad requests are answered 400/404 naming what is wrong."""

import copy
import http.client
import importlib.util
import json
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

import speculative_kernels as sk
from speculative_kernels.demo_pair import load_demo_pair

SERVER_PATH = Path(__file__).resolve().parents[2] / "python" / "completions_server.py"


def _module():
    spec = importlib.util.spec_from_file_location("completions_server", SERVER_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _serve():
    """(server, port, (target, draft, tokenizer)): the demo pair served on loopback."""
    target, draft, tokenizer = load_demo_pair()
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=4, tokenizer=tokenizer)
    server = _module().CompletionsServer(decoder, tokenizer)
    return server, server.start_in_thread(), (target, draft, tokenizer)


@pytest.fixture(scope="module")
def served():
    served = _serve()
    yield served
    served[0].stop()


def _post(port, body):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    data = response.read().decode()
    connection.close()
    return response.status, data


def _events(data):
    lines = [line[len("data: "):] for line in data.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _expected(models, prompt, max_tokens, seed=None, stop=None, **sampling):
    target, draft, tokenizer = models
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    if seed is None:
        stops = {} if stop is None else dict(stop_strings=stop, tokenizer=tokenizer)
        out = target.generate(ids, max_new_tokens=max_tokens, do_sample=False, **stops, **sampling)
    else:
        out = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=4, max_new_tokens=max_tokens,
                          do_sample=True, seed=seed, **sampling)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_concurrent_requests_get_their_own_completions(served):
    server, port, models = served
    requests = [
        dict(prompt="def fibonacci(n):", max_tokens=20, temperature=0),
        dict(prompt="import os\n\nclass Config:", max_tokens=24, temperature=0, stream=True),
        dict(prompt="for line in", max_tokens=16, temperature=0.8, top_k=0, seed=5, stream=True),
        dict(prompt="    return", max_tokens=12, temperature=1.2, top_p=0.9, top_k=0, seed=9),
        dict(prompt="def add(a, b):\n    return", max_tokens=40, temperature=0, stop=["\n"], stream=True),
        dict(prompt="class Stack:", max_tokens=24, temperature=0, repetition_penalty=1.3, stream=True),
        dict(prompt="while True:", max_tokens=16, temperature=0.9, min_p=0.1, repetition_penalty=1.1, top_k=0,
             seed=4),
    ]
    replies = [None] * len(requests)

    def call(index):
        replies[index] = _post(port, requests[index])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for body, (status, data) in zip(requests, replies):
        assert status == 200, data
        sampling = {k: body[k] for k in ("temperature", "top_p", "top_k", "min_p") if k in body and body.get("seed")}
        if "repetition_penalty" in body:
            sampling["repetition_penalty"] = body["repetition_penalty"]
        expected = _expected(models, body["prompt"], body["max_tokens"], body.get("seed"), body.get("stop"),
                             **sampling)
        if body.get("stream"):
            events = _events(data)
            text = "".join(e["choices"][0]["text"] for e in events)
            assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
            assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
            if "stop" in body:  # the token completing the stop string is the last (it may run past the string)
                assert events[-1]["choices"][0]["finish_reason"] == "stop" and "\n" in text
            else:
                assert len(events) > 2  # streamed in pieces, not in one
        else:
            reply = json.loads(data)
            text = reply["choices"][0]["text"]
            assert reply["usage"]["completion_tokens"] <= body["max_tokens"]
        assert text == expected, body


def test_a_client_that_disconnects_has_its_request_cancelled(served):
    server, port, _ = served
    before = len(server.cancelled)
    body = json.dumps(dict(prompt="class Parser:", max_tokens=400, temperature=0.7, seed=1, stream=True)).encode()
    client = socket.create_connection(("127.0.0.1", port), timeout=300)
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    received = b""
    while b"data: " not in received:  # the first streamed piece
        received += client.recv(4096)
    client.close()
    status, _ = _post(port, dict(prompt="x = 1", max_tokens=40, temperature=0))  # the server goes on stepping
    assert status == 200
    assert len(server.cancelled) == before + 1
    request_id = server.cancelled[-1]
    with pytest.raises(ValueError, match="unknown request_id"):  # cancelled, then released by the server
        server.decoder.result(request_id)
    assert request_id not in server.decoder.running


@pytest.mark.parametrize("body, status, message", [
    (dict(prompt="x", logprobs=2), 400, "logprobs is not supported by this server"),
    (dict(prompt="x", stop=[""]), 400, "stop_strings must be"),
    (dict(prompt="x", n=2), 400, "n is not supported"),
    (dict(prompt=""), 400, "prompt must be a non-empty string"),
    (dict(prompt="x", max_tokens=-1), 400, "max_tokens must be in [0, inf), got -1"),
    (dict(prompt="x", seed=-3), 400, "seed must be in"),
    # (these were accepted: a non-bool stream was read as true, and with temperature 0 the sampling fields were
    # dropped unchecked)
    (dict(prompt="x", max_tokens=4, stream="no"), 400, "stream must be true or false"),
    (dict(prompt="x", max_tokens=4, temperature=0, top_p=7), 400, r"top_p must be in (0, 1], got 7"),
    (dict(prompt="x", max_tokens=4, temperature=0, min_p="x"), 400, "min_p must be a number"),
    (dict(prompt="x", max_tokens=4, temperature=0, top_k=2.5), 400, "top_k must be an integer"),
    (dict(prompt="x", max_tokens="8"), 400, "max_tokens must be an integer"),
    (dict(prompt="x", echo=True), 400, "echo is not supported"),
    (dict(prompt="x", presence_penalty=0.5), 400, "presence_penalty is not supported"),
    (dict(prompt="x", logit_bias={"5": 1}), 400, "logit_bias is not supported"),
    (dict(prompt="x", n=True), 400, "n is not supported"),
    (dict(prompt="x", user=5), 400, "user must be a string"),
    # (a temperature past float32's range was accepted, then failed at the admitting step: a 500)
    (dict(prompt="x", temperature=1e39), 400, "temperature=1e+39 exceeds float32's largest value"),
])
def test_bad_requests_are_refused_by_name(served, body, status, message):
    _, port, _ = served
    got, data = _post(port, body)
    assert got == status and message in json.loads(data)["error"]["message"]


def test_unknown_route(served):
    _, port, _ = served
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("POST", "/v1/chat", "{}")
    response = connection.getresponse()
    assert response.status == 404 and "no route /v1/chat" in response.read().decode()


@pytest.mark.parametrize("stream", [False, True])
def test_a_failing_step_answers_its_clients_and_the_server_goes_on(served, monkeypatch, stream):
    """A step that raises with its request running reaches its client (500, or an error event on a stream) instead
    of leaving it waiting, and the next request is served. (A request still queued when a step raises waits and is
    served: the decoder ends only the requests of the batch whose step failed.)"""
    server, port, models = served
    step = server.decoder.step
    calls = []

    def failing_step():
        calls.append(1)
        if len(calls) == 2:  # (the first step admits the request: it runs when this one raises)
            raise RuntimeError("the device fell over")
        return step()

    monkeypatch.setattr(server.decoder, "step", failing_step)
    status, data = _post(port, dict(prompt="def f(x):", max_tokens=8, temperature=0, stream=stream))
    if stream:
        assert status == 200
        lines = [line[len("data: "):] for line in data.split("\n\n") if line.startswith("data: ")]
        assert lines[-1] == "[DONE]" and "the device fell over" in json.loads(lines[-2])["error"]["message"]
    else:
        assert status == 500 and "RuntimeError: the device fell over" in json.loads(data)["error"]["message"]
    status, data = _post(port, dict(prompt="def fibonacci(n):", max_tokens=6, temperature=0))
    assert status == 200
    assert json.loads(data)["choices"][0]["text"] == _expected(models, "def fibonacci(n):", 6)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_without_memory_fails_alone(served, monkeypatch, stream):
    """A request the device has no memory for (here: a long prompt, refused by build_loop's free-memory check) gets
    503 with the reason; a request sent with it is served (before, the step's MemoryError failed every client)."""
    from speculative_kernels import continuous

    server, port, models = served
    real_build = continuous.build_loop

    def build_loop(target, draft, input_ids, **kwargs):
        if input_ids.shape[1] > 100:
            raise MemoryError("the caches need more than is free")
        return real_build(target, draft, input_ids, **kwargs)

    monkeypatch.setattr(continuous, "build_loop", build_loop)
    requests = [dict(prompt="x = 1\n" * 60, max_tokens=8, temperature=0, stream=stream),
                dict(prompt="def fibonacci(n):", max_tokens=8, temperature=0)]
    replies = [None, None]
    threads = [threading.Thread(target=lambda i=i: replies.__setitem__(i, _post(port, requests[i]))) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    (status, data), (good_status, good_data) = replies
    if stream:
        lines = [line[len("data: "):] for line in data.split("\n\n") if line.startswith("data: ")]
        assert status == 200 and lines[-1] == "[DONE]"
        assert "MemoryError: the caches need more" in json.loads(lines[0])["error"]["message"]
    else:
        assert status == 503 and "MemoryError: the caches need more" in json.loads(data)["error"]["message"]
    assert good_status == 200
    assert json.loads(good_data)["choices"][0]["text"] == _expected(models, "def fibonacci(n):", 8)


def test_a_running_step_does_not_stall_the_server(served, monkeypatch):
    """Steps run in the engine thread: while one is in progress (held here), the event loop still answers other
    clients (a bad request, an unknown route); the held request completes once the step is let go. With the steps in
    the event-loop thread the answers below would wait for the step and time out."""
    server, port, models = served
    step, started, release = server.decoder.step, threading.Event(), threading.Event()

    def held_step():
        started.set()
        assert release.wait(120)
        return step()

    monkeypatch.setattr(server.decoder, "step", held_step)
    reply = []
    worker = threading.Thread(target=lambda: reply.append(_post(port, dict(prompt="def f(x):", max_tokens=6,
                                                                            temperature=0))))
    worker.start()
    try:
        assert started.wait(60)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        connection.request("POST", "/v1/completions", json.dumps(dict(prompt="x", n=2)))
        response = connection.getresponse()
        assert response.status == 400 and "n is not supported" in response.read().decode()
        connection.close()
        assert not release.is_set() and worker.is_alive()  # the step is still held
    finally:
        release.set()
        worker.join()
    status, data = reply[0]
    assert status == 200 and json.loads(data)["choices"][0]["text"] == _expected(models, "def f(x):", 6)


def _raw(port, data: bytes) -> bytes:
    client = socket.create_connection(("127.0.0.1", port), timeout=60)
    client.sendall(data)
    reply = b""
    while chunk := client.recv(4096):
        reply += chunk
    client.close()
    return reply


@pytest.mark.parametrize("head, body, message", [
    (b"Content-Length: abc", b"{}", "Content-Length must be a non-negative integer"),
    (b"Content-Length: -5", b"{}", "Content-Length must be a non-negative integer"),
    (b"Content-Length: 3", b"\xff\xfe{", "body is not JSON"),  # (not UTF-8: json.loads raised UnicodeDecodeError)
    (b"Transfer-Encoding: chunked", b"5\r\nhello\r\n0\r\n\r\n", "chunked bodies are not supported"),
])
def test_malformed_requests_are_answered_400(served, head, body, message):
    """A malformed Content-Length or a body that is not text made the handler raise: the connection was closed with
    no answer (and a traceback in the server's log)."""
    _, port, _ = served
    reply = _raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n\r\n" + body)
    assert reply.startswith(b"HTTP/1.1 400") and message in reply.decode(errors="replace"), reply


def test_null_fields_take_their_defaults(served):
    """OpenAI's API reads a null field as its default; here max_tokens null generated the model's default length (20
    new tokens) instead of the server's 16."""
    _, port, models = served
    status, data = _post(port, dict(prompt="def f(x):", max_tokens=None, temperature=None, top_p=None, top_k=None,
                                    stop=None, seed=3))
    assert status == 200, data
    reply = json.loads(data)
    assert reply["usage"]["completion_tokens"] == 16
    assert reply["choices"][0]["text"] == _expected(models, "def f(x):", 16, seed=3, temperature=1.0, top_p=1.0,
                                                    top_k=0)


def test_integer_sampling_fields_are_numbers(served):
    """JSON has no float type of its own: a client sends temperature 2 as an integer. The server passes floats on
    (generate refuses an int temperature when sampling, as HF's TemperatureLogitsWarper does: it answered 400)."""
    _, port, models = served
    status, data = _post(port, dict(prompt="def f(x):", max_tokens=6, temperature=2, top_p=1, repetition_penalty=2,
                                    top_k=5, seed=4))
    assert status == 200, data
    assert json.loads(data)["choices"][0]["text"] == _expected(models, "def f(x):", 6, seed=4, temperature=2.0,
                                                               top_p=1.0, top_k=5, repetition_penalty=2.0)


def test_fields_asking_for_nothing_are_accepted(served):
    """Clients that send every optional field send OpenAI's unimplemented ones at their defaults or as null (n 1,
    echo false, penalties 0, logit_bias {}, logprobs null, user): each asks for what the server does, and each was
    answered 400 (the null rule ran after the unknown-field check)."""
    _, port, models = served
    status, data = _post(port, dict(prompt="def f(x):", max_tokens=6, temperature=0, n=1, best_of=1, echo=False,
                                    presence_penalty=0, frequency_penalty=0.0, logit_bias={}, suffix="", user="me",
                                    logprobs=None))
    assert status == 200, data
    assert json.loads(data)["choices"][0]["text"] == _expected(models, "def f(x):", 6)


def test_a_client_that_disconnects_before_its_completion_has_its_request_cancelled(served):
    """Not streamed: nothing is written before the end, so only the connection's EOF tells that the client left; the
    request ran to its max_tokens for nobody."""
    server, port, _ = served
    before = len(server.cancelled)
    body = json.dumps(dict(prompt="class Parser:", max_tokens=400, temperature=0.7, seed=1)).encode()
    client = socket.create_connection(("127.0.0.1", port), timeout=300)
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + str(len(body)).encode()
                   + b"\r\n\r\n" + body)
    deadline = time.monotonic() + 60
    while not server.decoder.running:  # (read from this thread: a snapshot, enough to see it has started)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    client.close()
    while len(server.cancelled) == before:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not server.decoder.running


@pytest.mark.parametrize("stream", [False, True])
def test_bytes_after_the_request_are_no_disconnection(served, stream):
    """A client that sends a stray CRLF after its body (some do; RFC 9112 asks servers to ignore it) still gets its
    whole completion: any byte read after the request was taken for a disconnection and the request cancelled."""
    server, port, models = served
    before = len(server.cancelled)
    body = json.dumps(dict(prompt="def f(x):", max_tokens=12, temperature=0, stream=stream)).encode()
    reply = _raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body + b"\r\n").decode()
    assert reply.startswith("HTTP/1.1 200") and len(server.cancelled) == before, reply
    data = reply.split("\r\n\r\n", 1)[1]
    text = "".join(e["choices"][0]["text"] for e in _events(data)) if stream else \
        json.loads(data)["choices"][0]["text"]
    assert text == _expected(models, "def f(x):", 12)


def test_a_handler_that_fails_has_its_request_cancelled(served, monkeypatch):
    """An error in a request's handler other than a disconnection (here the detokenizer's) closed the connection but
    left the request running to its max_tokens for nobody."""
    server, port, _ = served
    before = len(server.cancelled)

    class FailingDetokenizer:
        def __init__(self, *args, **kwargs):
            pass

        def push(self, tokens):
            raise RuntimeError("detokenizer failed")

    monkeypatch.setitem(type(server).__init__.__globals__, "IncrementalDetokenizer", FailingDetokenizer)
    body = json.dumps(dict(prompt="class Parser:", max_tokens=400, temperature=0.7, seed=1, stream=True)).encode()
    _raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + str(len(body)).encode()
         + b"\r\n\r\n" + body)
    deadline = time.monotonic() + 60
    while len(server.cancelled) == before:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not server.decoder.running


@pytest.fixture
def own_server():
    """A server of its own, for tests that make the decoder fail (the module's server stays healthy)."""
    served = _serve()
    yield served
    served[0].stop()


def _no_room(self, remaining):
    raise MemoryError("no room to remove the rows")


def test_a_cancel_that_raises_does_not_stop_the_engine(own_server, monkeypatch):
    """A client going away runs decoder.cancel as an engine command; a cancel whose row removal ran out of memory
    raised out of the command runner and killed the engine thread: the running client and every later one waited
    for ever. The failure is now logged, the running request is answered (503: out of memory) and the server
    serves the next request."""
    from speculative_kernels.generation.loop import SpeculativeLoop

    server, port, _ = own_server
    replies = {}
    thread = threading.Thread(target=lambda: replies.update(long=_post(port, dict(
        prompt="def fibonacci(n):", max_tokens=400, temperature=0))))
    thread.start()
    while not server.decoder.running:
        time.sleep(0.05)
    body = json.dumps(dict(prompt="import os", max_tokens=400, temperature=0, stream=True)).encode()
    client = socket.create_connection(("127.0.0.1", port), timeout=300)
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
                   + body)
    received = b""
    while b"data: " not in received:
        received += client.recv(4096)
    monkeypatch.setattr(SpeculativeLoop, "keep_rows", _no_room)
    client.close()
    thread.join(timeout=120)
    assert not thread.is_alive() and replies["long"][0] == 503, replies
    assert server._engine.is_alive()
    monkeypatch.undo()
    status, _ = _post(port, dict(prompt="x = 1", max_tokens=4, temperature=0))
    assert status == 200


def test_a_stream_ends_with_every_token_when_the_step_that_finished_it_raised(own_server, monkeypatch):
    """A step that collected its tokens and then failed to remove a finished row (out of memory in keep_rows)
    raised, and its tokens were never streamed: the request that finished in it was answered 200 with
    finish_reason "length" and a truncated text. The final event now carries the tokens the stream missed."""
    from speculative_kernels.generation.loop import SpeculativeLoop

    server, port, models = own_server
    monkeypatch.setattr(SpeculativeLoop, "keep_rows", _no_room)
    bodies = {"short": dict(prompt="def fibonacci(n):", max_tokens=9, temperature=0, stream=True),
              "long": dict(prompt="import os\n\nclass Config:", max_tokens=60, temperature=0, stream=True)}
    replies, barrier = {}, threading.Barrier(2)

    def call(name):
        barrier.wait()
        replies[name] = _post(port, bodies[name])

    threads = [threading.Thread(target=call, args=(name,)) for name in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    status, data = replies["short"]
    events = _events(data)
    assert status == 200 and events[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(e["choices"][0]["text"] for e in events)
    assert text == _expected(models, bodies["short"]["prompt"], 9)
    assert any("error" in e for e in _events(replies["long"][1]))  # the long one: its batch failed


@pytest.mark.parametrize("mode", ["auto", "vllm"])
def test_sampling_defaults_come_from_the_checkpoint_as_vllms_generation_config(served, mode):
    """vLLM's server (``--generation-config auto``, its default) takes a request's omitted temperature, top_p, top_k,
    min_p and repetition_penalty from the checkpoint's generation_config; ``vllm`` uses OpenAI's. This server used
    OpenAI's top_p and top_k whatever the checkpoint set, but the checkpoint's repetition_penalty: a mix of both."""
    _, _, models = served
    target, draft, tokenizer = models
    saved = target.generation_config
    target.generation_config = copy.deepcopy(saved)
    target.generation_config.update(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.3)  # do_sample: False
    try:
        decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=4, tokenizer=tokenizer)
        server = _module().CompletionsServer(decoder, tokenizer, generation_config=mode)
        port = server.start_in_thread()
        try:
            omitted = _post(port, dict(prompt="def f(x):", max_tokens=8, seed=5))
            given = _post(port, dict(prompt="def f(x):", max_tokens=8, seed=5, top_k=0, temperature=1))
        finally:
            server.stop()
        checkpoint = (dict(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.3) if mode == "auto" else
                      dict(temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0))
        overridden = {**checkpoint, "top_k": 0, "temperature": 1.0}
        for (status, data), expected in ((omitted, checkpoint), (given, overridden)):
            assert status == 200, data
            assert json.loads(data)["choices"][0]["text"] == _expected(models, "def f(x):", 8, seed=5, **expected)
    finally:
        target.generation_config = saved
    with pytest.raises(ValueError, match="generation_config must be one of"):
        _module().CompletionsServer(decoder, tokenizer, generation_config="openai")
