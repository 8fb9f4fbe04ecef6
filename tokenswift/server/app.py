"""``tokenswift serve``: an OpenAI-compatible HTTP API over one pipeline (Starlette).

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(both streamed as server-sent events with ``"stream": true``), and ``GET /health``
(whether a generation runs, how the last one ended).

Generations run one at a time, in the order they arrive, on one worker thread (the
model is CPU- or GPU-bound: two at once would only share it); the event loop stays free
to answer other requests and to notice a client that goes away, streamed or not, whose
generation then stops after its current step (a queued one never starts). What a
request may cost before it is refused is bounded: its body is read up to
``max_body_bytes`` (a 413 past it, told by Content-Length before reading), and its
prompt is parsed and checked against the context in a thread of its own, a long text
counted in pieces only until the context is exceeded, so that ``/health`` and other
streams never wait on it. No request gets a traceback: bad input is a 4xx naming the
field, and a failure of the server's own a JSON 500 (streamed: an error event, then
``[DONE]``). :meth:`Engine.close` (the first SIGTERM or Ctrl-C of ``tokenswift serve``)
ends the running generation after its step with ``finish_reason`` "cancelled" (each
open stream gets its final chunk and ``[DONE]``) and answers queued requests 503.
A request's temperature/top_p select the pipeline's
``[sampling]`` (pipelines are kept per setting, the model shared); its seed makes the
output exactly what ``Pipeline.generate`` gives with the same seed and prompt or
messages. Every response carries ``usage`` and tokenswift's own statistics under
``"tokenswift"`` (tokens per step, acceptance, tokens/s, the seed).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import secrets
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs

from tokenswift.errors import PromptError, TokenswiftError
from tokenswift.pipeline import GenerationResult, Pipeline
from tokenswift.server.protocol import GenerationRequest, RequestError, StopScanner, parse_request, sampling_overrides

logger = logging.getLogger(__name__)

PIPELINES_KEPT = 2  # pipelines (one per sampling setting) kept built, each with its KV store
DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # a request body's limit: ~1M tokens of text, far past any context
DISCONNECT_POLL_SECONDS = 0.2  # how often a non-streamed request looks whether its client is still there
SHUTTING_DOWN = "the server is shutting down"


@attrs.frozen(kw_only=True)
class Finished:
    """How a generation ended: ``finish_reason`` as OpenAI names it ("stop", "length"),
    "cancelled" (the server shut down: the text so far, sent) or "disconnected" (its
    client went away; recorded, never sent); the result."""

    finish_reason: str
    result: GenerationResult

    def usage(self) -> dict[str, int]:
        prompt, completion = len(self.result.prompt_tokens), len(self.result.tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def statistics(self) -> dict[str, Any]:
        """The run's summary (tokens/step, acceptance, tokens/s, ...) and its seed."""
        summary = self.result.stats.summary()
        summary.pop("finish_reason")  # the choice's finish_reason says how it ended, as OpenAI names it
        return {"seed": self.result.seed, **summary}


class Engine:
    """The served model: pipelines per sampling setting and one worker thread that runs
    their generations in turn.

    make_pipeline(sampling_overrides) builds a pipeline over the already-loaded model;
    default_max_tokens: a request's ``max_tokens`` where it gives none."""

    def __init__(self, make_pipeline: Callable[[dict], Pipeline], model_name: str, *, default_max_tokens: int = 256) -> None:
        self.make_pipeline = make_pipeline
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())
        self._pipelines: OrderedDict[str, Pipeline] = OrderedDict()
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenswift-generate")
        self._state = threading.Lock()  # the counters and the last end
        self._building = threading.Lock()  # the pipelines
        self.running = 0  # generations started and not ended
        self.waiting = 0  # generations queued behind them
        self.last: dict[str, Any] | None = None  # the last generation's end, for /health
        self._closing = threading.Event()  # set by close(): running generations stop

    def pipeline(self, overrides: dict) -> Pipeline:
        """The pipeline for these ``[sampling]`` overrides (built once, the model shared)."""
        key = json.dumps(overrides, sort_keys=True)
        with self._building:
            if key not in self._pipelines:
                self._pipelines[key] = self.make_pipeline(overrides)
                while len(self._pipelines) > PIPELINES_KEPT:
                    self._pipelines.popitem(last=False)
            self._pipelines.move_to_end(key)
            return self._pipelines[key]

    def check(self, request: GenerationRequest) -> None:
        """Refuse a request the pipeline would refuse (too long for the context, a chat
        for a model without a template, more tokens than memory holds) before any
        response starts, naming the field at fault. Slow for a long prompt: call it
        off the event loop."""
        pipe = self.pipeline(sampling_overrides(request))
        field = "messages" if request.chat else "prompt"
        try:
            prompt = pipe.chat_prompt(list(request.messages)) if request.chat else request.prompt
        except (ValueError, TypeError, TokenswiftError) as exc:  # e.g. a tokenizer without a chat template
            raise RequestError(str(exc), param=field) from None
        try:
            pipe.check(prompt, self.max_tokens(request), name="max_tokens")
        except PromptError as exc:
            raise RequestError(str(exc), param=field) from None
        except (ValueError, TypeError, TokenswiftError) as exc:  # the run's size: memory
            raise RequestError(str(exc), param="max_tokens" if request.max_tokens is not None else None) from None

    def max_tokens(self, request: GenerationRequest) -> int:
        return request.max_tokens if request.max_tokens is not None else self.default_max_tokens

    def health(self) -> dict[str, Any]:
        with self._state:
            return {"status": "ok", "model": self.model_name, "running": self.running, "waiting": self.waiting, "last": self.last}

    async def generate(self, request: GenerationRequest) -> AsyncIterator[str | Finished]:
        """The request's text as it is committed (pieces of str), then one
        :class:`Finished`. Closing the iterator early (the client went away) stops the
        generation after its current step, or keeps a queued one from starting; the
        next request then starts. Once the engine is closing, a request not yet started
        raises a 503 :class:`RequestError`."""
        if self._closing.is_set():
            raise RequestError(f"{SHUTTING_DOWN}; the request was not started", status=503, type="server_error")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        gone = threading.Event()
        scanner = StopScanner(request.stop)
        seed = request.seed if request.seed is not None else secrets.randbits(63)

        def put(item) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def stream(chunk) -> None:
            text = scanner.push(chunk.text or "")
            if text:
                put(text)

        def work() -> None:
            with self._state:
                self.waiting -= 1
                self.running += 1
            try:
                if gone.is_set():  # its client left while it waited: never started
                    return
                if self._closing.is_set():
                    put(RequestError(f"{SHUTTING_DOWN}; the request was not started", status=503, type="server_error"))
                    return
                pipe = self.pipeline(sampling_overrides(request))
                result = pipe.generate(
                    request.prompt,
                    self.max_tokens(request),
                    seed=seed,
                    stream=stream,
                    messages=list(request.messages) if request.chat else None,
                    cancel=lambda: gone.is_set() or scanner.stopped or self._closing.is_set(),
                )
                tail = scanner.flush()
                if tail:
                    put(tail)
                if gone.is_set():
                    reason = "disconnected"
                elif scanner.stopped or result.stats.finish_reason == "eos":
                    reason = "stop"
                elif result.stats.finish_reason == "cancelled":  # only the shutdown cancels it now
                    reason = "cancelled"
                else:
                    reason = "length"
                finished = Finished(finish_reason=reason, result=result)
                with self._state:
                    self.last = {**finished.usage(), **finished.statistics(), "finish_reason": reason}
                logger.info("%s: %d tokens, %s", reason, len(result.tokens), finished.statistics())
                put(finished)
            except BaseException as exc:  # noqa: BLE001 - handed to the request's task
                put(exc)
            finally:
                with self._state:
                    self.running -= 1

        with self._state:
            self.waiting += 1
        self._worker.submit(work)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, Finished):
                    return
        finally:
            gone.set()  # a no-op once finished; otherwise the client went away

    def close(self) -> None:
        """Stop the running generation after its step (its request ends "cancelled")
        and answer the queued ones 503; refuse new ones. Idempotent."""
        if self._closing.is_set():
            return
        logger.info("closing: the running generation stops after its step, queued requests get 503")
        self._closing.set()
        self._worker.shutdown(wait=False)  # queued work runs, sees the flag and answers at once

    @property
    def closing(self) -> bool:
        return self._closing.is_set()


def _chunk_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _too_large(limit: int, size: int | None = None) -> RequestError:
    got = f"it has {size}" if size is not None else "it has more"
    return RequestError(
        f"the request body is larger than this server's limit of {limit} bytes ({got}); "
        "the limit is tokenswift serve --max-body-bytes",
        status=413, code="request_too_large",
    )


async def read_body(request, limit: int) -> bytes:
    """The request's body, at most ``limit`` bytes: a larger Content-Length is refused
    (413) before anything is read, and a body without one (chunked) as soon as it has
    passed the limit."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise RequestError(f"the Content-Length header is not a number of bytes: {declared[:40]!r}")
        if int(declared) > limit:
            raise _too_large(limit, int(declared))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(engine: Engine, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
    """The Starlette application serving ``engine``; a request body may have at most
    ``max_body_bytes`` bytes."""
    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    def error(exc: RequestError) -> Response:
        # json.dumps escapes what is not ASCII: a lone surrogate echoed from the request
        # cannot break the response (JSONResponse would fail to encode it: a 500)
        return Response(json.dumps(exc.body()), status_code=exc.status, media_type="application/json")

    def internal(exc: BaseException) -> RequestError:
        logger.error("a request failed inside the server", exc_info=exc)
        return RequestError(
            f"the server failed on this request ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            "see the server's log", status=500, type="server_error",
        )

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({
            "object": "list",
            "data": [{"id": engine.model_name, "object": "model", "created": engine.created, "owned_by": "tokenswift"}],
        })

    async def health(request: Request) -> JSONResponse:
        return JSONResponse(engine.health())

    def parse(raw: bytes, chat: bool) -> GenerationRequest:
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise RequestError(f"the request body is not valid JSON: {str(exc)[:200]}") from None
        parsed = parse_request(body, chat=chat, served_model=engine.model_name)
        engine.check(parsed)
        return parsed

    async def read(request: Request, chat: bool) -> GenerationRequest:
        raw = await read_body(request, max_body_bytes)
        # parsing, the chat template and counting the prompt's tokens take a while for a
        # long body: in a thread, so that the event loop goes on serving the others
        return await asyncio.to_thread(parse, raw, chat)

    def choice(chat: bool, text: str, finish_reason: str | None, *, delta: bool) -> dict[str, Any]:
        if not chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if delta:
            return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish_reason}

    async def whole(request: Request, parsed: GenerationRequest) -> tuple[str, Finished] | None:
        """A non-streamed generation's text and end; None where its client went away
        first (looked at every DISCONNECT_POLL_SECONDS): the generation is then
        stopped, or never started where it was still queued."""

        async def collect() -> tuple[str, Finished]:
            pieces: list[str] = []
            async for item in engine.generate(parsed):
                if isinstance(item, Finished):
                    return "".join(pieces), item
                pieces.append(item)
            raise RuntimeError("the generation ended without its end")  # pragma: no cover

        task = asyncio.ensure_future(collect())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
                if not task.done() and await request.is_disconnected():
                    logger.info("a client left before its response: its generation stops")
                    return None
            return task.result()
        finally:
            if not task.done():
                task.cancel()  # closes engine.generate: the worker stops it after its step
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def complete(request: Request, chat: bool):
        try:
            parsed = await read(request, chat)
        except RequestError as exc:
            return error(exc)
        except ClientDisconnect:
            return Response(status_code=400)  # nobody reads it
        except Exception as exc:  # noqa: BLE001 - a bug of ours: an error in OpenAI's shape, the connection kept
            return error(internal(exc))
        ident, created = _chunk_id(chat), int(time.time())
        head = {"id": ident, "created": created, "model": engine.model_name}
        if not parsed.stream:
            try:
                ended = await whole(request, parsed)
            except RequestError as exc:
                return error(exc)
            except Exception as exc:  # noqa: BLE001 - a bug of ours: an error in OpenAI's shape, the connection kept
                return error(internal(exc))
            if ended is None:
                return Response(status_code=499)  # the client is gone: nobody reads it
            text, finished = ended
            return JSONResponse({
                **head, "object": "chat.completion" if chat else "text_completion",
                "choices": [choice(chat, text, finished.finish_reason, delta=False)],
                "usage": finished.usage(), "tokenswift": finished.statistics(),
            })

        async def events() -> AsyncIterator[str]:
            kind = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
            if chat:
                yield _sse({**kind, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
            try:
                async for item in engine.generate(parsed):
                    if isinstance(item, Finished):
                        yield _sse({**kind, "choices": [choice(chat, "", item.finish_reason, delta=True)], "tokenswift": item.statistics()})
                        if parsed.include_usage:
                            yield _sse({**kind, "choices": [], "usage": item.usage()})
                        break
                    yield _sse({**kind, "choices": [choice(chat, item, None, delta=True)]})
            except RequestError as exc:  # e.g. the server began shutting down before it started
                yield _sse(exc.body())
            except Exception as exc:  # noqa: BLE001 - the stream still ends as a stream does
                yield _sse(internal(exc).body())
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def completions(request: Request):
        return await complete(request, chat=False)

    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    async def not_found(request: Request, exc) -> Response:
        return error(RequestError(f"no route {request.method} {request.url.path}; routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health", status=404))

    async def not_allowed(request: Request, exc) -> Response:
        return error(RequestError(f"{request.method} is not allowed on {request.url.path}", status=405))

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
    ]
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        engine.close()

    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed}, lifespan=lifespan)
    app.state.engine = engine
    return app
