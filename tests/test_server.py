"""``tokenswift serve``: a real server on loopback, driven by real clients (the openai
package, httpx, curl). Its generations equal ``Pipeline.generate`` with the same seed,
bad requests get one-line 4xx errors, and a client that disconnects stops its run."""

import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tokenswift import Pipeline, hookimpl  # noqa: E402
from tokenswift.server.app import Engine, create_app  # noqa: E402
from tokenswift.server.protocol import StopScanner  # noqa: E402
from tokenswift.testing import FIXED_TREE, tiny_model_for, word_tokenizer  # noqa: E402

NAME = "tiny"
# Plain words of the tiny vocabulary (roles are <unk>): a template the word tokenizer can
# encode, closing turns with text, so the reply ends at max_tokens.
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}a dog {% endif %}"
)
MESSAGES = [{"role": "system", "content": "the cat"}, {"role": "user", "content": "the dog sat on a mat"}]


class Slow:
    """A step hook that makes runs slow enough to disconnect from in the middle; it
    counts the generations that start."""

    delay = 0.0
    started = 0

    @hookimpl
    def tokenswift_generation_start(self, pipeline, prompt_ids, max_new_tokens):
        self.started += 1

    @hookimpl
    def tokenswift_step_end(self, pipeline, step):
        if self.delay:
            time.sleep(self.delay)


@pytest.fixture(scope="module")
def served():
    model = tiny_model_for("llama-gqa", dtype="float32")
    tokenizer = word_tokenizer()
    tokenizer.chat_template = TEMPLATE
    slow = Slow()

    def make_pipeline(sampling):
        overrides = {**FIXED_TREE, "sampling": sampling} if sampling else FIXED_TREE
        pipe = Pipeline.from_spec("tokenswift", model, tokenizer, overrides=overrides)
        pipe.plugin_manager.register(slow)
        return pipe

    engine = Engine(make_pipeline, NAME, default_max_tokens=16)
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield {"url": f"http://127.0.0.1:{port}", "model": model, "tokenizer": tokenizer, "slow": slow, "engine": engine}
    server.should_exit = True
    thread.join(timeout=10)
    engine.close()


def reference(served, *, prompt=None, messages=None, max_tokens=16, seed=0, sampling=None, steps=None):
    """``Pipeline.generate`` as the server runs it; ``steps``: a list to append each
    step's text to (the server sends one event per step)."""
    overrides = {**FIXED_TREE, "sampling": sampling} if sampling else FIXED_TREE
    pipe = Pipeline.from_spec("tokenswift", served["model"], served["tokenizer"], overrides=overrides)
    stream = (lambda chunk: steps.append(chunk.text) if chunk.text else None) if steps is not None else None
    return pipe.generate(prompt, max_tokens, seed=seed, messages=messages, stream=stream)


def client(served):
    return openai.OpenAI(base_url=served["url"] + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(served):
    assert [m.id for m in client(served).models.list()] == [NAME]


def test_streamed_chat_completion_equals_pipeline_generate(served):
    steps: list[str] = []
    expected = reference(served, messages=MESSAGES, max_tokens=24, seed=5, steps=steps)
    stream = client(served).chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=24, seed=5, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert deltas == steps and len(steps) > 3  # step by step, as the pipeline committed them
    assert "".join(deltas) == expected.text
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage.completion_tokens == len(expected.tokens) == 24
    assert chunks[-1].usage.prompt_tokens == len(expected.prompt_tokens)
    stats = [c.model_extra["tokenswift"] for c in chunks if c.model_extra and "tokenswift" in c.model_extra]
    assert stats[0]["seed"] == 5 and stats[0]["tokens_per_step"] == round(expected.stats.tokens_per_step, 3)


def test_completion_and_chat_without_streaming_equal_pipeline_generate(served):
    openai_client = client(served)
    expected = reference(served, prompt="the cat sat on", max_tokens=12, seed=9)
    response = openai_client.completions.create(model=NAME, prompt="the cat sat on", max_tokens=12, seed=9)
    assert response.choices[0].text == expected.text
    assert response.usage.completion_tokens == 12 and response.choices[0].finish_reason == "length"
    assert response.model_extra["tokenswift"]["new_tokens"] == 12

    expected = reference(served, messages=MESSAGES, max_tokens=10, seed=2)
    response = openai_client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=10, seed=2)
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].message.role == "assistant"


def test_temperature_zero_is_greedy_and_top_p_is_honoured(served):
    openai_client = client(served)
    greedy = reference(served, messages=MESSAGES, max_tokens=12, sampling={"greedy": True})
    response = openai_client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12, temperature=0, seed=4)
    assert response.choices[0].message.content == greedy.text
    nucleus = reference(served, messages=MESSAGES, max_tokens=12, seed=4, sampling={"temperature": 0.7, "top_p": 0.5})
    response = openai_client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=12, temperature=0.7, top_p=0.5, seed=4
    )
    assert response.choices[0].message.content == nucleus.text
    assert nucleus.text != reference(served, messages=MESSAGES, max_tokens=12, seed=4).text  # the setting mattered


def test_stop_strings_end_the_text_before_them(served):
    full = reference(served, prompt="the cat", max_tokens=16, seed=1).text
    words = full.split()
    stop = " " + words[3]  # the 4th word, with its space: the text ends after the 3rd
    expected = full[: full.index(stop)]
    for stream in (False, True):
        response = client(served).completions.create(model=NAME, prompt="the cat", max_tokens=16, seed=1, stop=[stop], stream=stream)
        if stream:
            chunks = list(response)
            text = "".join(c.choices[0].text for c in chunks)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
            assert reason == ["stop"]
        else:
            text = response.choices[0].text
            assert response.choices[0].finish_reason == "stop"
        assert text == expected


def test_stop_scanner_holds_back_what_could_begin_a_stop_string():
    scanner = StopScanner(("END", "xy"))
    assert scanner.push("abc E") == "abc "
    assert scanner.push("N") == ""
    assert scanner.push("Dmore") == ""  # "END" found: nothing of it or after it
    assert scanner.stopped and scanner.push("more") == "" and scanner.flush() == ""
    scanner = StopScanner(("END",))
    assert scanner.push("abE") == "ab" and scanner.push("x") == "Ex" and scanner.flush() == ""
    scanner = StopScanner(("END",))
    assert scanner.push("abEN") == "ab" and scanner.flush() == "EN"


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_streams_server_sent_events(served):
    expected = reference(served, messages=MESSAGES, max_tokens=8, seed=3)
    body = json.dumps({"model": NAME, "messages": MESSAGES, "max_tokens": 8, "seed": 3, "stream": True})
    out = subprocess.run(
        ["curl", "-sS", "-N", "-H", "Content-Type: application/json", "-d", body, served["url"] + "/v1/chat/completions"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    events = [line.removeprefix("data: ") for line in out.splitlines() if line]
    assert all(line.startswith("data: ") for line in out.splitlines() if line)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected.text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "message"),
    [
        ("/v1/chat/completions", {"model": "gpt-4", "messages": MESSAGES}, 404, "model", "unknown model 'gpt-4'; this server serves 'tiny'"),
        ("/v1/chat/completions", {"model": NAME, "messages": MESSAGES, "max_tokens": -1}, 400, "max_tokens", "max_tokens must be at least 1, got -1"),
        ("/v1/completions", {"model": NAME, "prompt": "the", "max_tokens": "ten"}, 400, "max_tokens", "max_tokens must be an integer, got 'ten'"),
        ("/v1/chat/completions", "{not json", 400, None, "the request body is not valid JSON"),
        ("/v1/chat/completions", {"model": NAME, "messages": MESSAGES, "max_token": 5}, 400, "max_token", "unknown field 'max_token'"),
        ("/v1/chat/completions", {"model": NAME, "messages": MESSAGES, "logprobs": True}, 400, "logprobs", "logprobs is not supported by tokenswift: it may only be null, false or 0 (its neutral values), got true"),
        ("/v1/chat/completions", {"model": NAME, "messages": MESSAGES, "seed": 2**64 + 1}, 400, "seed", "seed must be an integer from 0 to 2**64-1 (18446744073709551615), got 18446744073709551617"),
        ("/v1/chat/completions", {"model": NAME, "messages": MESSAGES, "seed": -(2**70)}, 400, "seed", "seed must be an integer from 0 to 2**64-1"),
        ("/v1/chat/completions", {"model": NAME, "messages": MESSAGES, "seed": 10**40}, 400, "seed", "seed must be an integer from 0 to 2**64-1"),
        ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages", "messages[0].content is not valid Unicode text: it has a lone surrogate '\\ud800' at character 0"),
        ("/v1/completions", {"model": NAME, "prompt": "the \udfff cat"}, 400, "prompt", "prompt is not valid Unicode text: it has a lone surrogate '\\udfff' at character 4"),
        ("/v1/chat/completions", {"model": NAME, "messages": MESSAGES, "max_tokens": 10**9}, 400, "max_tokens", "lower max_tokens (1000000000)"),
        ("/v1/chat/completions", {"model": "\ud800", "messages": MESSAGES}, 404, "model", "unknown model '\\ud800'"),
        ("/v1/chat/completions", "[" * 100_000, 400, None, "the request body is not valid JSON"),
        ("/v1/chat/completions", {"model": NAME, "messages": MESSAGES, "n": 2}, 400, "n", "n must be 1"),
        ("/v1/chat/completions", {"model": NAME, "messages": MESSAGES, "temperature": 3}, 400, "temperature", "temperature must be in [0.0, 2.0], got 3"),
        ("/v1/chat/completions", {"model": NAME}, 400, "messages", "messages is required"),
        ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages", "messages[0].role must be one of"),
        ("/v1/completions", {"model": NAME, "messages": MESSAGES}, 400, "messages", "unknown field 'messages'"),
        ("/v1/completions", {"model": NAME, "prompt": ""}, 400, "prompt", "prompt must be a non-empty string"),
        ("/v1/completions", {"model": NAME, "prompt": "the " * 600}, 400, "prompt", "more than the model's context of 512 positions"),
        ("/v1/completions", {"model": NAME, "prompt": "the", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "stop takes at most 4 strings"),
        ("/v1/embeddings", {"model": NAME}, 404, None, "no route POST /v1/embeddings"),
    ],
)
def test_bad_requests_get_a_one_line_4xx(served, path, body, status, param, message):
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(served["url"] + path, content=content, headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"] and "\n" not in error["message"]
    assert error["param"] == param


def test_a_client_that_disconnects_stops_its_generation(served):
    served["slow"].delay = 0.05  # 200 tokens would take 10 s or more
    try:
        body = {"model": NAME, "messages": MESSAGES, "max_tokens": 200, "seed": 1, "stream": True}
        with httpx.stream("POST", served["url"] + "/v1/chat/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            received = [next(lines) for _ in range(6)]  # role chunk, blank, two content chunks...
        assert any('"content"' in line for line in received)
        deadline = time.time() + 20
        while True:
            health = httpx.get(served["url"] + "/health", timeout=5).json()
            if health["running"] == 0 and health["last"] and health["last"]["finish_reason"] == "disconnected":
                break
            assert time.time() < deadline, f"the generation did not stop: {health}"
            time.sleep(0.05)
        assert 0 < health["last"]["completion_tokens"] < 200
    finally:
        served["slow"].delay = 0.0
    # the server goes on serving
    expected = reference(served, prompt="the mat", max_tokens=6, seed=2)
    assert client(served).completions.create(model=NAME, prompt="the mat", max_tokens=6, seed=2).choices[0].text == expected.text


def test_concurrent_requests_run_in_turn_and_each_gets_its_own(served):
    prompts = ["the cat", "a dog sat", "on the mat"]
    results: dict[str, str] = {}

    def ask(prompt):
        results[prompt] = client(served).completions.create(model=NAME, prompt=prompt, max_tokens=10, seed=7).choices[0].text

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {p: reference(served, prompt=p, max_tokens=10, seed=7).text for p in prompts}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--port", "70000"], "--port must be in [0, 65535], got 70000"),
        (["serve", "--default-max-tokens", "0"], "--default-max-tokens must be a positive integer, got 0"),
    ],
)
def test_serve_bad_flags_are_one_line(argv, message, capsys):
    from tokenswift.cli import main

    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == f"tokenswift: error: {message}"


def test_serve_without_the_serve_extra_says_how_to_get_it(monkeypatch, capsys):
    from tokenswift.cli import main

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if it were not installed
    assert main(["serve"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "tokenswift: error: tokenswift serve needs the serve extra (uvicorn is missing): pip install 'tokenswift[serve]'"


# -- a server that survives any request and stops when told (issue 55) ---------------------


def _stream_in_background(served, max_tokens=400):
    """A slow streamed completion read in a thread: the arrival time of each event, and a
    way to leave it. Returns (times, stop, thread)."""
    times: list[float] = []
    stop = threading.Event()

    def read():
        body = {"model": NAME, "prompt": "the cat", "max_tokens": max_tokens, "seed": 1, "stream": True}
        with httpx.stream("POST", served["url"] + "/v1/completions", json=body, timeout=30) as response:
            for line in response.iter_lines():
                if line:
                    times.append(time.perf_counter())
                if stop.is_set() or line == "data: [DONE]":
                    return

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while len(times) < 3:
        assert time.time() < deadline and thread.is_alive(), "the stream did not start"
        time.sleep(0.01)
    return times, stop, thread


def _wait_idle(served, timeout=20):
    deadline = time.time() + timeout
    while True:
        health = httpx.get(served["url"] + "/health", timeout=5).json()
        if health["running"] == 0 and health["waiting"] == 0:
            return health
        assert time.time() < deadline, f"the server did not go idle: {health}"
        time.sleep(0.05)


def test_a_large_body_is_refused_at_once_while_another_stream_flows(served):
    """20 MB is refused by its Content-Length (413) and, sent chunked, once past the limit;
    a body under the limit whose prompt is far past the context is refused after counting
    no more of it than the context holds, in a thread: the other stream and /health never
    wait (a 21 MB prompt was tokenized whole on the event loop: 25.8 s, /health 25.6 s)."""
    huge = json.dumps({"model": NAME, "messages": [{"role": "user", "content": "the cat " * 2_600_000}]}).encode()
    assert len(huge) > 20_000_000
    long_prompt = json.dumps({"model": NAME, "prompt": "the cat sat on the mat " * 150_000})  # 3.4 MB, 900K tokens
    served["slow"].delay = 0.02
    times, stop, thread = _stream_in_background(served, max_tokens=2000)
    try:
        started = time.perf_counter()
        response = httpx.post(served["url"] + "/v1/chat/completions", content=huge,
                              headers={"Content-Type": "application/json"}, timeout=30)
        refused_in = time.perf_counter() - started
        assert response.status_code == 413, response.text
        error = response.json()["error"]
        assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
        assert "larger than this server's limit of 4194304 bytes (it has" in error["message"]
        assert refused_in < 1.0, refused_in

        def chunked():
            for i in range(0, len(huge), 1 << 20):
                yield huge[i : i + (1 << 20)]

        response = httpx.post(served["url"] + "/v1/chat/completions", content=chunked(), timeout=30)
        assert response.status_code == 413 and "limit of 4194304 bytes (it has more)" in response.json()["error"]["message"]

        answered: dict = {}

        def ask():
            began = time.perf_counter()
            answered["response"] = httpx.post(served["url"] + "/v1/completions", content=long_prompt, timeout=30)
            answered["seconds"] = time.perf_counter() - began

        asking = threading.Thread(target=ask)
        asking.start()
        health_waits = []
        while asking.is_alive():
            began = time.perf_counter()
            assert httpx.get(served["url"] + "/health", timeout=5).status_code == 200
            health_waits.append(time.perf_counter() - began)
        asking.join()
        assert answered["response"].status_code == 400, answered["response"].text
        message = answered["response"].json()["error"]["message"]
        assert "more than the model's context of 512 positions" in message and "counted in its first" in message
        # bounds a few times what a quiet machine measures (0.15 s, 0.08 s), far below the 25 s of old
        assert answered["seconds"] < 1.0 and max(health_waits) < 1.0, (answered["seconds"], health_waits)
        time.sleep(max(0.0, started + 1.0 - time.perf_counter()))
        window = [t for t in times if t >= started]
        gaps = [b - a for a, b in zip(window, window[1:])]
        assert len(window) >= 10 and max(gaps) < 1.0, gaps  # the stream kept flowing throughout (0.2 s measured)
    finally:
        stop.set()
        thread.join(timeout=30)
        served["slow"].delay = 0.0
    _wait_idle(served)


def test_a_non_streamed_client_that_leaves_stops_its_generation(served):
    served["slow"].delay = 0.05  # 200 tokens would take 10 s or more
    try:
        body = {"model": NAME, "prompt": "the cat", "max_tokens": 200, "seed": 1}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(served["url"] + "/v1/completions", json=body, timeout=1.0)
        left = time.perf_counter()
        health = _wait_idle(served, timeout=5)
        assert time.perf_counter() - left < 2.0
        assert health["last"]["finish_reason"] == "disconnected" and 0 < health["last"]["completion_tokens"] < 200, health
    finally:
        served["slow"].delay = 0.0


def test_a_queued_request_whose_client_left_never_starts(served):
    served["slow"].delay = 0.05
    try:
        times, stop, thread = _stream_in_background(served, max_tokens=200)
        before = served["slow"].started
        with pytest.raises(httpx.ReadTimeout):  # queued behind the stream, then gone
            httpx.post(served["url"] + "/v1/completions", json={"model": NAME, "prompt": "a dog", "max_tokens": 50}, timeout=0.5)
        time.sleep(2 * 0.2)  # the server looks every 0.2 s
        stop.set()
        thread.join(timeout=30)
        _wait_idle(served)
        assert served["slow"].started == before, "the queued request whose client left was started"
    finally:
        served["slow"].delay = 0.0


WORST_VALUES = [
    "", "\ud800" * 3, -1, 0, 2**64 + 1, -(2**70), 10**40, 1e308, float("nan"), float("-inf"),
    True, [1, "a"], {"a": {"b": [None]}}, json.loads("[" * 500 + "]" * 500),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_no_request_gets_a_500_and_the_connection_survives_each(served, path):
    """Every field the endpoints know, each set to each worst value (typed wrong, out
    of range, empty, huge, deep, a lone surrogate): a 4xx in OpenAI's error shape, or a
    200 where the value is a valid one; never a 500, and the next request on the same
    keep-alive connection is answered (a seed of 2**64+1 was a 500 that dropped it)."""
    import http.client

    from tokenswift.server.protocol import CHAT_FIELDS, COMPLETION_FIELDS, NEUTRAL

    chat = path == "/v1/chat/completions"
    base = {"model": NAME, "max_tokens": 2, **({"messages": MESSAGES} if chat else {"prompt": "the cat"})}
    fields = sorted((CHAT_FIELDS if chat else COMPLETION_FIELDS) | NEUTRAL.keys())
    host, port = served["url"].removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    statuses: dict[int, int] = {}
    try:
        for field in fields:
            for value in WORST_VALUES:
                connection.request("POST", path, body=json.dumps({**base, field: value}), headers={"Content-Type": "application/json"})
                socket_used = connection.sock
                response = connection.getresponse()
                text = response.read().decode()
                statuses[response.status] = statuses.get(response.status, 0) + 1
                assert response.status == 200 or 400 <= response.status < 500, (field, value, response.status, text)
                if response.status != 200:
                    error = json.loads(text)["error"]
                    assert set(error) == {"message", "type", "param", "code"} and "\n" not in error["message"], error
                elif not (field == "stream" and value is True):
                    assert json.loads(text)["usage"]["completion_tokens"] <= 16  # the server's default where None
                connection.request("GET", "/health")
                assert connection.sock is socket_used, f"{field}={value!r:.40} dropped the connection"
                health = connection.getresponse()
                assert health.status == 200 and json.loads(health.read())["status"] == "ok"
    finally:
        connection.close()
    assert statuses.get(400, 0) > len(fields) * 5, statuses


def _serve(model_dir, *extra):
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenswift", "serve", "--model", str(model_dir), "--dtype", "float32", "--preset", "ar",
         "--port", str(port), "--served-name", "mini", *extra],
        stderr=subprocess.PIPE, text=True,
    )
    url, deadline = f"http://127.0.0.1:{port}", time.time() + 120
    while True:
        try:
            httpx.get(url + "/health", timeout=2)
            return process, url
        except httpx.TransportError:
            assert process.poll() is None, process.stderr.read()
            assert time.time() < deadline, "tokenswift serve did not start"
            time.sleep(0.2)


def test_serve_answers_then_a_sigterm_mid_stream_ends_the_stream_cleanly_and_exits_within_3_seconds(model_dir):
    """`tokenswift serve` lists its model under the served name, completes, and answers a
    chat request for a tokenizer without a chat template with a clear 400. Then the first
    SIGTERM cancels the running generation after its step: its stream gets a last chunk
    (finish_reason "cancelled") and [DONE], a stream queued behind it an error event
    (503, not started) and [DONE], and the process exits (it waited for the generation
    to finish: 24 s for a long one). One server for both: each start imports torch and
    transformers (~7 s on two cores)."""
    process, url = _serve(model_dir)
    try:
        models = httpx.get(url + "/v1/models", timeout=2).json()
        assert [m["id"] for m in models["data"]] == ["mini"]
        response = httpx.post(url + "/v1/completions", json={"model": "mini", "prompt": "the cat", "max_tokens": 5, "seed": 1}, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 5
        # the saved tiny model's tokenizer has no chat template: a clear 400, not a crash
        response = httpx.post(url + "/v1/chat/completions", json={"model": "mini", "messages": MESSAGES}, timeout=60)
        assert response.status_code == 400 and "has no chat template" in response.json()["error"]["message"]
    except BaseException:
        process.kill()
        raise
    body = {"model": "mini", "prompt": "the cat", "max_tokens": 50_000, "seed": 1, "stream": True}
    queued: list[str] = []

    def queue_behind():
        with httpx.stream("POST", url + "/v1/completions", json={**body, "max_tokens": 5}, timeout=60) as response:
            queued.extend(line for line in response.iter_lines() if line)

    try:
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            for line in lines:
                if line:
                    events.append(line)
                if len(events) == 5:
                    break
            behind = threading.Thread(target=queue_behind)
            behind.start()
            deadline = time.time() + 10
            while httpx.get(url + "/health", timeout=5).json()["waiting"] == 0:
                assert time.time() < deadline, "the second request was not queued"
                time.sleep(0.02)
            signalled = time.perf_counter()
            process.send_signal(signal.SIGTERM)
            for line in lines:
                if line:
                    events.append(line)
                assert time.perf_counter() - signalled < 10, "the stream went on after SIGTERM"
        process.wait(timeout=30)
        exited_in = time.perf_counter() - signalled
        behind.join(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert events[-1] == "data: [DONE]", events[-3:]
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "cancelled", last
    assert 0 < last["tokenswift"]["new_tokens"] < 50_000
    assert exited_in <= 3.0, exited_in
    assert queued[-1] == "data: [DONE]" and len(queued) == 2, queued
    error = json.loads(queued[0].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and error["message"].startswith("the server is shutting down"), error
    stderr = process.stderr.read()
    assert "Traceback" not in stderr and "serving 'mini' (preset 'ar') on http://127.0.0.1:" in stderr


def test_a_second_signal_exits_at_once(model_dir):
    """After the first SIGTERM the server waits (up to 2 s) for a connection still busy,
    here a client that never sends the rest of its body; a second signal exits at once."""
    process, url = _serve(model_dir)
    try:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as stuck:
            stuck.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"model\":")
            time.sleep(0.2)
            process.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            assert process.poll() is None, "the first signal waits for the busy connection"
            signalled = time.perf_counter()
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)
            exited_in = time.perf_counter() - signalled
    finally:
        if process.poll() is None:
            process.kill()
    assert exited_in < 1.5 and process.returncode == 128 + signal.SIGTERM, (exited_in, process.returncode)
    assert "SIGTERM again: exiting now" in process.stderr.read()


def test_serve_refuses_a_body_limit_that_is_not_positive(capsys):
    from tokenswift.cli import main

    assert main(["serve", "--max-body-bytes", "0"]) == 2
    assert capsys.readouterr().err.strip() == "tokenswift: error: --max-body-bytes must be a positive number of bytes, got 0"
