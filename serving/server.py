"""An OpenAI-compatible HTTP server (FastAPI + uvicorn, as vLLM serves).

    python superinfer.py serve --port 8000 [--model M] [--policy P] [engine flags]

Endpoints: /v1/completions and /v1/chat/completions (stream: true gives server-sent events,
stream_options.include_usage a usage chunk, then `data: [DONE]`), /v1/models, /health, and
/metrics in Prometheus text. Extensions to OpenAI's request fields: top_k, ignore_eos, priority,
ttft_slo, tbt_slo (RotaSched's per-request SLOs, seconds). What is accepted is in protocol.py.

The engine runs in its own process (engine_loop.py; a thread when an Engine is handed to
create_app, as the tests do). This process parses and validates requests, applies the chat
template and tokenizes off the event loop, frames SSE, and keeps the metrics. Every error is
OpenAI's error object with `param` naming the field. A client that hangs up, streaming or not,
aborts its request: its slot and blocks are freed before the engine's next step. Shutdown lets
in-flight requests finish, then aborts what is left.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException

from serving.engine_loop import EngineProcess, EngineThread
from serving.protocol import (ERRORS, NOT_SUPPORTED, Body, ChatBody, ChatCompletion, Completion,
                              CompletionBody, ModelList, error_body)
from superinfer import (KV_COPIES, Engine, Parser, SamplingParams, add_engine_flags,
                        engine_config)

MAX_BODY_BYTES = 1 << 20   # a request body larger than this is a 413
SSE_EVENT = {"type": "object", "required": ["data"],  # OpenAPI 3.1: a schema per event
             "properties": {"data": {"type": "string",
                                     "description": "a JSON chunk, or [DONE] after the last"}}}
SSE_DOC = {"text/event-stream": {"schema": SSE_EVENT,
                                 "description": "with stream: true, chunks of the same shape"}}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (
            status, message, param, kind, code)


# ---------------------------------------------------------------- metrics

class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        gauge = lambda name, text, *labels: Gauge(name, text, labels, registry=r)
        self.running = gauge("superinfer_requests_running", "requests with KV on the device")
        self.waiting = gauge("superinfer_requests_waiting", "requests not yet admitted")
        self.rotary = gauge("superinfer_requests_rotary", "requests with KV parked on host")
        self.kv_usage = gauge("superinfer_kv_usage", "share of KV blocks in use", "tier")
        self.rotations = Counter("superinfer_rotations", "requests rotated out to host", registry=r)
        self.recomputes = Counter("superinfer_recomputes", "preemptions by recompute", registry=r)
        self.kv_bytes = {name: Counter(f"superinfer_kv_{name}_bytes",
                                       f"KV bytes copied between the tiers: {name}", registry=r)
                         for name in KV_COPIES}
        self.tokens = Counter("superinfer_generated_tokens", "tokens generated", registry=r)
        self.finished = Counter("superinfer_requests_finished", "finished requests", ["reason"],
                                registry=r)
        self.ttft = Histogram("superinfer_time_to_first_token_seconds", "TTFT", registry=r,
                              buckets=(.05, .1, .25, .5, 1, 2, 5, 10, 30, 60))
        self.tbt = Histogram("superinfer_inter_token_seconds", "gap between two tokens", registry=r,
                             buckets=(.01, .025, .05, .1, .2, .5, 1, 2, 5))
        # vLLM's names: prompt tokens looked up in the prefix cache, and found there
        self.cache_queries = Counter("vllm:prefix_cache_queries", "prompt tokens looked up in "
                                     "the prefix cache", registry=r)
        self.cache_hits = Counter("vllm:prefix_cache_hits", "prompt tokens found in the prefix "
                                  "cache (either tier)", registry=r)
        self.host_hits = Counter("superinfer_prefix_cache_host_hits", "prompt tokens found in "
                                 "the host tier's prefix cache", registry=r)
        self.counters = {"rotations": self.rotations, "recomputes": self.recomputes,
                         "prefix_cache_queries": self.cache_queries,
                         "prefix_cache_hits": self.cache_hits,
                         "prefix_cache_host_hits": self.host_hits} | {
            f"{name}_bytes": c for name, c in self.kv_bytes.items()}
        self.last = dict.fromkeys(self.counters, 0)

    def observe(self, stats: dict) -> None:
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.rotary.set(stats["rotary"])
        self.kv_usage.labels("device").set(stats["device_usage"])
        self.kv_usage.labels("host").set(stats["host_usage"])
        for name, counter in self.counters.items():
            counter.inc(max(0, stats[name] - self.last[name]))
            self.last[name] = stats[name]

    def done(self, out: dict) -> None:
        self.tokens.inc(out["completion_tokens"])
        self.finished.labels(out["finish_reason"] or "abort").inc()
        times = out["token_times"]
        if times:
            self.ttft.observe(times[0] - out["arrival"])
            for a, b in zip(times, times[1:]):
                self.tbt.observe(b - a)


# ---------------------------------------------------------------- the engine, from here

class EngineClient:
    """This process's side of the engine: a queue per request, fed from the engine's messages
    (which may arrive on any thread), and the tokenizer."""

    def __init__(self, handle):
        self.handle, self.tokenizer, self.info = handle, handle.tokenizer, handle.info
        self.metrics, self.queues, self.failed = Metrics(), {}, None
        self.loop: asyncio.AbstractEventLoop | None = None
        handle.deliver = self.deliver

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.handle.start()

    def deliver(self, msg: tuple) -> None:
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.apply, msg)

    def apply(self, msg: tuple) -> None:
        if msg[0] == "failed":
            self.failed = msg[1]
            for q in self.queues.values():
                q.put_nowait(("failed", msg[1]))
            return
        if msg[0] != "events":
            return
        for event in msg[1]:
            q = self.queues.get(event[1])
            if event[0] == "done":
                self.metrics.done(event[2])
                self.queues.pop(event[1], None)
            if q is not None:
                q.put_nowait((event[0], *event[2:]))
        self.metrics.observe(msg[2])

    def submit(self, rid: str, ids: list[int], params: SamplingParams, body: Body) -> asyncio.Queue:
        if self.failed:
            raise ApiError(503, f"the engine stopped: {self.failed}", None, "server_error")
        self.queues[rid] = q = asyncio.Queue()
        extras = {"priority": body.priority, "ttft_slo": body.ttft_slo, "tbt_slo": body.tbt_slo}
        self.handle.send(("add", rid, ids, params, extras, body.stream))
        return q

    def abort(self, rid: str) -> None:
        self.handle.send(("abort", rid))

    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ApiError(400, "prompt: this model has no tokenizer; send token ids", "prompt")
            return self.tokenizer(prompt).input_ids
        return list(prompt)

    def chat(self, messages: list[dict]) -> list[int]:
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ApiError(400, "messages: this model has no chat template", "messages")
        try:
            return list(tok.apply_chat_template(messages, add_generation_prompt=True,
                                                return_dict=False))
        except Exception as e:  # jinja and type errors from unusual messages
            raise ApiError(400, f"messages: cannot apply the chat template ({e})",
                           "messages") from None


# ---------------------------------------------------------------- requests

def sampling(body: Body, n_prompt: int, max_len: int, default_max: int, what: str
             ) -> SamplingParams:
    """SamplingParams for a request, with the context checked in the numbers it is made of."""
    if n_prompt >= max_len:
        raise ApiError(400, f"{what}: the prompt has {n_prompt} tokens; this model's context is "
                            f"{max_len} tokens", what, code="context_length_exceeded")
    asked = getattr(body, "max_completion_tokens", None) or body.max_tokens
    max_tokens = asked if asked is not None else min(default_max, max_len - n_prompt)
    if n_prompt + max_tokens > max_len:
        raise ApiError(400, f"max_tokens: the prompt has {n_prompt} tokens and max_tokens asks for "
                            f"{max_tokens} more ({n_prompt + max_tokens} in all); this model's "
                            f"context is {max_len} tokens", "max_tokens",
                       code="context_length_exceeded")
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    seed = None if body.seed is None else body.seed % 2**64  # as torch takes a negative seed
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=float(body.temperature),
                              top_p=float(body.top_p), top_k=body.top_k, seed=seed,
                              stop=stop, ignore_eos=body.ignore_eos)
    except ValueError as e:
        raise ApiError(400, str(e), str(e).split(" ")[0]) from None


def usage_of(out: dict) -> dict:
    n, m = out["prompt_tokens"], out["completion_tokens"]
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m,
            "prompt_tokens_details": {"cached_tokens": out["cached_tokens"]}}


def whole(out: dict, ident: str, created: int, model: str, chat: bool) -> dict:
    if out["error"] is not None:
        raise ApiError(500, f"the request failed: {out['error']}", None, "server_error")
    choice = {"index": 0, "finish_reason": out["finish_reason"], "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": out["text"]}
    else:
        choice["text"] = out["text"]
    return {"id": ident, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "choices": [choice], "usage": usage_of(out)}


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def stream(client: EngineClient, rid: str, events: asyncio.Queue, head: dict, chat: bool,
                 options, n_prompt: int):
    """Server-sent events: a chunk per token (its text may be empty while a multi-byte character
    is incomplete), the finish reason, usage if asked (in every chunk too, with vLLM's
    continuous_usage_stats), then [DONE]."""
    usage = bool(options and options.include_usage)
    running = {"prompt_tokens": n_prompt, "completion_tokens": 0, "total_tokens": n_prompt}
    every = bool(options and options.continuous_usage_stats)

    def chunk(text: str | None, reason: str | None, first: bool = False) -> str:
        if chat:
            delta = {"role": "assistant", "content": ""} if first else (
                {"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
        return sse(head | {"choices": [choice]} | ({"usage": dict(running)} if every else {}))

    finished = False
    try:
        if chat:
            yield chunk(None, None, first=True)
        while True:
            kind, item = await events.get()
            if kind == "token":
                running["completion_tokens"] += 1
                running["total_tokens"] += 1
                yield chunk(item, None)
                continue
            finished = True
            if kind == "failed" or item["error"] is not None:
                why = item if kind == "failed" else item["error"]
                yield sse(error_body(f"the request failed: {why}", "server_error"))
            else:
                yield chunk(None if chat else "", item["finish_reason"])
                if usage:
                    yield sse(head | {"choices": [], "usage": usage_of(item)})
            yield "data: [DONE]\n\n"
            return
    finally:
        if not finished:  # the client went away: free its slot and blocks
            client.abort(rid)


async def hung_up(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so this is all that comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def respond(client: EngineClient, request: Request, ids: list[int], params: SamplingParams,
                  body: Body, model: str, chat: bool):
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    events = client.submit(rid, ids, params, body)
    kind, *rest = await events.get()
    if kind != "accepted":
        client.queues.pop(rid, None)
        status = 503 if kind == "failed" or "shutting down" in rest[0] else 400
        param = "max_tokens" if "output tokens" in rest[0] else (
            "prompt" if "prompt" in rest[0] else None)
        raise ApiError(status, rest[0], param,
                       "invalid_request_error" if status == 400 else "server_error")
    head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model}
    if body.stream:
        return StreamingResponse(stream(client, rid, events, head, chat, body.stream_options,
                                        len(ids)), media_type="text/event-stream")
    watch = asyncio.ensure_future(hung_up(request))
    try:
        while True:
            get = asyncio.ensure_future(events.get())
            await asyncio.wait({get, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():  # hung up: stop generating for nobody
                get.cancel()
                client.abort(rid)
                return JSONResponse(error_body("the client disconnected"), status_code=499)
            kind, item = get.result()
            if kind == "failed":
                raise ApiError(503, f"the engine stopped: {item}", None, "server_error")
            if kind == "done":
                return whole(item, rid, head["created"], model, chat)
    finally:
        watch.cancel()


# ---------------------------------------------------------------- the app

class BodyLimit:
    """ASGI middleware: a body over `limit` bytes is a 413 (read before the app sees it)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            chunks.append(msg.get("body", b""))
            size, more = size + len(chunks[-1]), msg.get("more_body", False)
            if size > self.limit:
                text = f"the request body is over {self.limit} bytes (see --max-body-bytes)"
                return await JSONResponse(error_body(text, param="body"), 413)(scope, receive,
                                                                               send)
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay():
            nonlocal body
            msg, body = body, None
            return msg if msg is not None else await receive()
        await self.app(scope, replay, send)


def add_error_handlers(app: FastAPI) -> None:
    """OpenAI's error object for everything: ours, validation, bad JSON, 404, 405, the rest."""
    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return JSONResponse(error_body(e.message, e.kind, e.param, e.code), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":
            where = first.get("loc", (None, "?"))[-1]
            why = first.get("ctx", {}).get("error", "invalid")
            return JSONResponse(error_body(f"the body is not valid JSON ({why} at character "
                                           f"{where})"), 400)
        field, what = describe(e.errors())
        return JSONResponse(error_body(f"{field}: {what}" if field else what, param=field), 400)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        text = {404: f"no such path: {request.url.path}",
                405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code)
        if e.status_code == 400:  # FastAPI could not decode the body
            text = "the body could not be read as JSON (invalid UTF-8, or nested too deeply)"
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(text or str(e.detail), kind), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def crash(request, e: Exception):
        return JSONResponse(error_body(f"internal error: {e!r}", "server_error"), 500)


TYPE_TAGS = {"str", "int", "float", "bool", "none"}
KINDS = {list: "list", str: "str", dict: "dict", int: "int", float: "float", bool: "bool"}


def is_tag(x) -> bool:
    """A union branch's tag in pydantic's error location, not a field name or index."""
    x = str(x)
    return x in TYPE_TAGS or "[" in x or x.startswith(("constrained-", "function-"))


def describe(errors: list[dict]) -> tuple[str | None, str]:
    """(field, what is wrong) from pydantic's errors: the deepest one, preferring the union
    branch of the input's own kind (a list prompt: the token-id list's error), so that a union
    field (prompt, content) names what came closest; branch tags are left out of the field."""
    if not errors:
        return None, "invalid body"

    def score(e):
        tags = [str(x) for x in e.get("loc", ()) if is_tag(x)]
        kind = KINDS.get(type(e.get("input")), "?")
        return len(e.get("loc", ())), any(t.removeprefix("constrained-").startswith(kind)
                                          for t in tags)
    e = max(errors, key=score)  # ties: the first branch
    loc = [str(x) for x in e.get("loc", ())[1:] if not is_tag(x)]
    if loc and loc[0] in NOT_SUPPORTED:
        return loc[0], "not supported by this server (see the schema for the one value taken)"
    return ".".join(loc) or None, e.get("msg", "invalid body")


def openapi_schema(app: FastAPI, vocab_size: int | None) -> dict:
    """FastAPI's document with our 400s in place of its 422s (which this server never sends),
    and the model's vocabulary as the bound of a prompt's token ids."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in doc["paths"].values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            doc.get("components", {}).get("schemas", {}).pop(name, None)
        if vocab_size is not None:
            prompt = doc["components"]["schemas"]["CompletionBody"]["properties"]["prompt"]
            for ids in token_id_schemas(prompt):
                ids["maximum"] = vocab_size - 1
        app.openapi_schema = doc
    return app.openapi_schema


def token_id_schemas(schema):
    """The {"type": "integer"} schemas inside a prompt's schema (its token ids)."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            yield schema
        for value in schema.values():
            yield from token_id_schemas(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from token_id_schemas(value)


def create_app(engine, model_name: str = "superinfer",
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The app over an EngineProcess, or over an Engine of this process (run on a thread)."""
    client = EngineClient(EngineThread(engine) if isinstance(engine, Engine) else engine)

    @asynccontextmanager
    async def lifespan(app):
        client.start()
        yield
        await asyncio.to_thread(client.handle.stop)

    app = FastAPI(title="superinfer", version="0.3", lifespan=lifespan)
    app.state.client = client
    app.openapi = lambda: openapi_schema(app, (client.info or {}).get("vocab_size"))
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    add_error_handlers(app)
    add_routes(app, client, model_name)
    return app


def add_routes(app: FastAPI, client: EngineClient, name: str) -> None:
    max_len = client.info["max_model_len"]
    room = min(max_len, client.info["capacity_tokens"])  # what a default max_tokens may fill
    card = {"id": name, "object": "model", "created": 0, "owned_by": "superinfer",
            "max_model_len": max_len}

    @app.get("/health", responses={503: ERRORS[503]})
    async def health():
        if client.failed:
            raise ApiError(503, f"the engine stopped: {client.failed}", None, "server_error")
        return {"status": "ok"}

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text format"}})
    async def metrics():
        return PlainTextResponse(generate_latest(client.metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    def check(body: Body) -> None:
        if body.model is not None and body.model != name:
            raise ApiError(404, f"model: the model {body.model!r} does not exist (this server "
                                f"serves {name!r})", "model", "not_found_error", "model_not_found")

    ok = {**ERRORS, 200: {"content": SSE_DOC}}

    @app.post("/v1/completions", response_model=Completion, responses=ok)
    async def completions(body: CompletionBody, request: Request):
        check(body)
        prompt = body.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if not prompt:
            raise ApiError(400, "prompt: empty prompt", "prompt")
        ids = await asyncio.to_thread(client.encode, prompt)
        params = sampling(body, len(ids), max_len, 16, "prompt")
        return await respond(client, request, ids, params, body, name, chat=False)

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses=ok)
    async def chat(body: ChatBody, request: Request):
        check(body)
        ids = await asyncio.to_thread(client.chat, body.text_messages())
        params = sampling(body, len(ids), max_len, max(1, room - len(ids)), "messages")
        return await respond(client, request, ids, params, body, name, chat=True)


# ---------------------------------------------------------------- command line

def main(argv: list[str] | None = None) -> None:
    import uvicorn
    ap = Parser(prog="superinfer serve",
                description="An OpenAI-compatible server (serving/server.py).")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default=None,
                    help="the name clients ask for (default: the model's file or directory name)")
    ap.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                    help=f"larger request bodies get a 413 (default {MAX_BODY_BYTES})")
    add_engine_flags(ap)
    args = ap.parse_args(argv)
    if not 0 < args.port < 65536:
        ap.error(f"--port must be in 1..65535, got {args.port}")
    if args.max_body_bytes < 1:
        ap.error("--max-body-bytes must be >= 1")
    cfg = engine_config(ap, args)
    try:
        engine = EngineProcess(cfg)
    except RuntimeError as e:
        raise SystemExit(f"superinfer serve: error: {e}") from None
    name = args.served_model_name or (cfg.model.rstrip("/").split("/")[-1] if cfg.model
                                      else "SmolLM2-135M-Instruct")
    try:
        uvicorn.run(create_app(engine, name, args.max_body_bytes), host=args.host,
                    port=args.port, log_level="info", timeout_graceful_shutdown=30)
    finally:
        if engine.alive():
            engine.stop()


if __name__ == "__main__":  # python superinfer.py serve, or python -m serving.server
    main()
