"""An OpenAI-compatible HTTP server over one engine (FastAPI + uvicorn, as vLLM serves).

    python superinfer.py serve --port 8000 [--model M] [--policy P] [engine flags]

Endpoints: /v1/completions and /v1/chat/completions (stream: true gives server-sent events,
stream_options.include_usage a usage chunk, then `data: [DONE]`), /v1/models, /health, and
/metrics in Prometheus text. Extensions to OpenAI's request fields: priority, ttft_slo, tbt_slo
(RotaSched's per-request SLOs, seconds), ignore_eos.

One engine loop runs on a background thread and owns the engine; handlers talk to it through a
queue and get their tokens back on asyncio queues. A client that disconnects aborts its request
(its blocks on both tiers are freed); shutdown lets in-flight requests finish, then aborts what
is left.
"""
from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import uuid
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict

from model import ModelLoadError
from superinfer import Engine, EngineError, Parser, SamplingParams, add_engine_flags, engine_config
from weights.loader import resolve_device


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_body(message: str, kind: str, param: str | None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


# ---------------------------------------------------------------- request bodies

class Body(BaseModel):
    """Fields both endpoints take; unknown fields are ignored, unsupported ones refused."""
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None
    priority: int = 0
    ttft_slo: float | None = None
    tbt_slo: float | None = None
    ignore_eos: bool = False


class CompletionBody(Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None


class ChatBody(Body):
    messages: list[dict]
    logprobs: bool = False


def sampling(body: Body, default_max: int) -> SamplingParams:
    for name, ok in (("n", body.n == 1), ("logprobs", not body.logprobs),
                     ("echo", not getattr(body, "echo", False))):
        if not ok:
            raise ApiError(400, f"{name}: only n=1, without logprobs or echo, is supported", name)
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    try:
        max_tokens = body.max_completion_tokens or body.max_tokens or default_max
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature,
                              top_p=body.top_p, top_k=body.top_k, seed=body.seed, stop=stop,
                              ignore_eos=body.ignore_eos)
    except ValueError as e:
        raise ApiError(400, str(e), str(e).split(" ")[0]) from None


# ---------------------------------------------------------------- the engine loop

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
        self.bytes_moved = Counter("superinfer_kv_bytes_moved", "KV bytes copied between tiers",
                                   registry=r)
        self.tokens = Counter("superinfer_generated_tokens", "tokens generated", registry=r)
        self.finished = Counter("superinfer_requests_finished", "finished requests", ["reason"],
                                registry=r)
        self.ttft = Histogram("superinfer_time_to_first_token_seconds", "TTFT", registry=r,
                              buckets=(.05, .1, .25, .5, 1, 2, 5, 10, 30, 60))
        self.tbt = Histogram("superinfer_inter_token_seconds", "gap between two tokens", registry=r,
                             buckets=(.01, .025, .05, .1, .2, .5, 1, 2, 5))
        self.last = {"rotations": 0, "recomputes": 0, "bytes_moved": 0}

    def observe(self, stats: dict) -> None:
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.rotary.set(stats["rotary"])
        self.kv_usage.labels("device").set(stats["device_usage"])
        self.kv_usage.labels("host").set(stats["host_usage"])
        for name, counter in (("rotations", self.rotations), ("recomputes", self.recomputes),
                              ("bytes_moved", self.bytes_moved)):
            counter.inc(stats[name] - self.last[name])
            self.last[name] = stats[name]


class EngineLoop:
    """The one thread that touches the engine. Handlers call submit() and abort() from the
    event loop; events come back on each request's asyncio queue."""

    def __init__(self, engine: Engine):
        self.engine, self.metrics = engine, Metrics()
        self.inbox: queue.Queue = queue.Queue()
        self.outboxes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="engine-loop", daemon=True)

    async def submit(self, prompt, params: SamplingParams, body: Body) -> tuple[str, asyncio.Queue]:
        loop = asyncio.get_running_loop()
        done, out = loop.create_future(), asyncio.Queue()
        self.inbox.put(("add", (prompt, params, body, loop, out), (loop, done)))
        return await done, out

    def abort(self, rid: str) -> None:
        self.inbox.put(("abort", rid, None))

    def run(self) -> None:
        while not (self.stopping.is_set() and not self.engine.has_unfinished()):
            self.drain(block=not self.engine.has_unfinished())
            if self.engine.has_unfinished():
                self.step()
        for rid in list(self.outboxes):
            self.engine.abort(rid)
            self.finish(rid)

    def drain(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self.handle(*item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def handle(self, kind: str, arg, reply) -> None:
        if kind == "abort":
            if arg in self.outboxes:
                self.engine.abort(arg)
                self.finish(arg)
            return
        prompt, params, body, loop, out = arg
        try:
            if self.stopping.is_set():
                raise ApiError(503, "the server is shutting down", None, "server_error")
            rid = self.engine.add_request(prompt, params, priority=body.priority,
                                          ttft_slo=body.ttft_slo, tbt_slo=body.tbt_slo)
        except (ValueError, ApiError) as e:
            loop.call_soon_threadsafe(resolve, reply[1], None, e)
            return
        self.outboxes[rid] = (loop, out)
        loop.call_soon_threadsafe(resolve, reply[1], rid, None)

    def step(self) -> None:
        try:
            events = self.engine.step()
        except EngineError:
            events = []  # the step's requests carry the error; finish() delivers it
        for ev in events:
            if ev.request_id in self.outboxes:
                loop, out = self.outboxes[ev.request_id]
                loop.call_soon_threadsafe(out.put_nowait, ("token", ev))
        self.metrics.observe(self.engine.stats())
        for rid in [rid for rid in self.outboxes if self.engine.output(rid).finished]:
            self.finish(rid)

    def finish(self, rid: str) -> None:
        """Deliver a request's final output and forget it."""
        out = self.engine.output(rid)
        m = self.metrics
        m.tokens.inc(len(out.token_ids))
        m.finished.labels(out.finish_reason or "abort").inc()
        times = out.metrics.token_times
        if times:
            m.ttft.observe(times[0] - out.metrics.arrival_time)
            for a, b in zip(times, times[1:]):
                m.tbt.observe(b - a)
        loop, q = self.outboxes.pop(rid)
        loop.call_soon_threadsafe(q.put_nowait, ("done", out))
        self.engine.release(rid)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()


def resolve(fut: asyncio.Future, value, err) -> None:
    if not fut.done():
        fut.set_exception(err) if err else fut.set_result(value)


# ---------------------------------------------------------------- the app

def create_app(engine: Engine, model_name: str = "superinfer") -> FastAPI:
    loop_ = EngineLoop(engine)

    @asynccontextmanager
    async def lifespan(app):
        loop_.start()
        yield
        loop_.stop()

    app = FastAPI(title="superinfer", lifespan=lifespan)
    app.state.engine_loop = loop_

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return JSONResponse(error_body(e.message, e.kind, e.param), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        field = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        what = first.get("msg", "invalid body")
        message = f"{field}: {what}" if field else what
        return JSONResponse(error_body(message, "invalid_request_error", field), status_code=422)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": 0, "owned_by": "superinfer",
            "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(loop_.metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    add_completions(app, loop_, engine, model_name)
    return app


def add_completions(app: FastAPI, loop_: EngineLoop, engine: Engine, model_name: str) -> None:
    def check_model(body: Body) -> None:
        if body.model is not None and body.model != model_name:
            raise ApiError(404, f"model: the model {body.model!r} does not exist (this server "
                                f"serves {model_name!r})", "model", "model_not_found")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        check_model(body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, "prompt: one prompt per request (a list of several is not "
                                    "supported)", "prompt")
            prompt = prompt[0]
        params = sampling(body, 16)
        return await respond(loop_, request, prompt, params, body, model_name, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        check_model(body)
        tok = engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ApiError(400, "messages: this model has no chat template", "messages")
        try:
            prompt = tok.apply_chat_template(body.messages, add_generation_prompt=True,
                                             return_dict=False)
        except Exception as e:  # jinja and type errors from malformed messages
            raise ApiError(400, f"messages: cannot apply the chat template ({e})",
                           "messages") from None
        params = sampling(body, engine.max_model_len - len(prompt))
        return await respond(loop_, request, prompt, params, body, model_name, chat=True)


async def respond(loop_: EngineLoop, request: Request, prompt, params: SamplingParams, body: Body,
                  model_name: str, chat: bool):
    try:
        rid, events = await loop_.submit(prompt, params, body)
    except ValueError as e:
        raise ApiError(400, str(e), "prompt" if "prompt" in str(e) else None) from None
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    if body.stream:
        usage = bool((body.stream_options or {}).get("include_usage"))
        events = stream(loop_, rid, events, ident, created, model_name, chat, usage)
        return StreamingResponse(events, media_type="text/event-stream")
    while True:
        try:
            kind, item = await asyncio.wait_for(events.get(), timeout=0.5)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                loop_.abort(rid)
                return JSONResponse({}, status_code=499)
            continue
        if kind == "done":
            return whole(item, ident, created, model_name, chat)


def usage_of(out) -> dict:
    n, m = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


def whole(out, ident: str, created: int, model_name: str, chat: bool):
    if out.error is not None:
        raise ApiError(500, f"the request failed: {out.error}", None, "server_error")
    reason = out.finish_reason if out.finish_reason in ("stop", "length") else out.finish_reason
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                  "finish_reason": reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": out.text, "finish_reason": reason, "logprobs": None}
    return {"id": ident, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model_name, "choices": [choice], "usage": usage_of(out)}


async def stream(loop_: EngineLoop, rid: str, events: asyncio.Queue, ident: str, created: int,
                 model_name: str, chat: bool, usage: bool):
    """Server-sent events: a chunk per token (its text may be empty while a multi-byte character
    is incomplete), the finish reason, usage if asked, then [DONE]."""
    kind_name = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, reason: str | None, first: bool = False) -> str:
        if chat:
            delta = {"role": "assistant", "content": ""} if first else (
                {"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
        return sse({"id": ident, "object": kind_name, "created": created, "model": model_name,
                    "choices": [choice]})

    finished = False
    try:
        if chat:
            yield chunk(None, None, first=True)
        while True:
            kind, item = await events.get()
            if kind == "token":
                yield chunk(item.text, None)
                continue
            finished = True
            if item.error is not None:
                yield sse(error_body(f"the request failed: {item.error}", "server_error", None))
            else:
                yield chunk(None if chat else "", item.finish_reason)
                if usage:
                    yield sse({"id": ident, "object": kind_name, "created": created,
                               "model": model_name, "choices": [], "usage": usage_of(item)})
            yield "data: [DONE]\n\n"
            return
    finally:
        if not finished:  # the client went away: free its blocks
            loop_.abort(rid)


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


# ---------------------------------------------------------------- command line

def main(argv: list[str] | None = None) -> None:
    ap = Parser(prog="superinfer serve",
                description="An OpenAI-compatible server (serving/server.py).")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default=None,
                    help="the name clients ask for (default: the model's file or directory name)")
    add_engine_flags(ap)
    args = ap.parse_args(argv)
    if not 0 < args.port < 65536:
        ap.error(f"--port must be in 1..65535, got {args.port}")
    cfg = engine_config(ap, args)
    try:
        resolve_device(cfg.device)
    except ValueError as e:
        ap.error(str(e))
    try:
        engine = Engine(cfg)
    except (ModelLoadError, ValueError) as e:
        raise SystemExit(f"superinfer serve: error: {e}") from None
    name = args.served_model_name or (cfg.model.rstrip("/").split("/")[-1] if cfg.model
                                      else "SmolLM2-135M-Instruct")
    try:
        uvicorn.run(create_app(engine, name), host=args.host, port=args.port, log_level="info",
                    timeout_graceful_shutdown=30)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
