"""The engine's side of the server: one loop that owns an Engine, in its own process or thread.

The HTTP side (server.py) sends it commands and gets back one message per engine step:

    in:   ("add", rid, token_ids, SamplingParams, extras, stream)   ("abort", rid)   ("stop",)
    out:  ("events", [event, ...], stats)   then, after "stop", ("bye",)
    event ("accepted", rid) | ("rejected", rid, message) | ("token", rid, text) |
          ("done", rid, {finish_reason, error, text, prompt_tokens, completion_tokens,
                         cached_tokens, arrival, token_times})

In a process (`EngineProcess`, what `python superinfer.py serve` runs) the engine's step loop
shares no interpreter lock with the HTTP server, tokenizer or SSE framing; in a thread
(`EngineThread`, for tests and embedding) it shares the process. Either way the loop drains
every command before a step, so an abort frees its request's blocks on both tiers before the
next step runs, and stats go out after every step, abort and idle turn, so gauges stay true.
"""
from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import traceback

from superinfer import Engine, EngineError

class Loop:
    """Owns an Engine: applies commands, steps while there is work, reports each step."""

    def __init__(self, engine: Engine, recv, send):
        self.engine, self.recv, self.send = engine, recv, send
        self.streams: dict[str, bool] = {}   # live requests: rid -> wants token events
        self.stopping = False

    def run(self) -> None:
        last = None
        while not (self.stopping and not self.engine.has_unfinished()):
            busy = self.engine.has_unfinished()
            events = self.drain(timeout=0.0 if busy else 0.05)
            if self.engine.has_unfinished():
                events += self.step()
            stats = self.engine.stats()
            if events or stats != last:
                self.send(("events", events, stats))
                last = stats
        events = []
        for rid in list(self.streams):   # the server stops: what is left is aborted
            self.engine.abort(rid)
            events.append(self.finish(rid))
        self.send(("events", events, self.engine.stats()))
        self.send(("bye",))

    def drain(self, timeout: float) -> list:
        events, cmd = [], self.recv(timeout)
        while cmd is not None:
            events += self.handle(cmd)
            cmd = self.recv(0.0)
        return events

    def handle(self, cmd: tuple) -> list:
        kind = cmd[0]
        if kind == "stop":
            self.stopping = True
            return []
        if kind == "abort":
            if cmd[1] not in self.streams:
                return []
            self.engine.abort(cmd[1])
            return [self.finish(cmd[1])]
        _, rid, ids, params, extras, stream = cmd
        if self.stopping:
            return [("rejected", rid, "the server is shutting down")]
        try:
            self.engine.add_request(ids, params, request_id=rid, **extras)
        except ValueError as e:
            return [("rejected", rid, str(e))]
        self.streams[rid] = stream
        return [("accepted", rid)]

    def step(self) -> list:
        try:
            tokens = self.engine.step()
        except EngineError:
            tokens = []  # the step's requests carry the error; finish() delivers it
        events = [("token", t.request_id, t.text) for t in tokens if self.streams.get(t.request_id)]
        done = [rid for rid in self.streams if self.engine.output(rid).finished]
        return events + [self.finish(rid) for rid in done]

    def finish(self, rid: str) -> tuple:
        """A request's final output, and the engine forgets it."""
        out = self.engine.output(rid)
        del self.streams[rid]
        self.engine.release(rid)
        m = out.metrics
        return ("done", rid, {"finish_reason": out.finish_reason, "text": out.text,
                              "error": None if out.error is None else str(out.error),
                              "prompt_tokens": len(out.prompt_token_ids),
                              "completion_tokens": len(out.token_ids),
                              "cached_tokens": out.num_cached_tokens,
                              "arrival": m.arrival_time, "token_times": m.token_times})


class EngineThread:
    """The loop on a thread of this process, over an Engine built by the caller."""

    def __init__(self, engine: Engine):
        self.engine, self.inbox, self.deliver = engine, queue.Queue(), None
        self.info, self.tokenizer = engine_info(engine), engine.tokenizer
        self.loop = Loop(engine, self._get, lambda msg: self.deliver(msg))
        self.thread = threading.Thread(target=self.loop.run, name="engine-loop", daemon=True)

    def _get(self, timeout: float):
        try:
            return self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait()
        except queue.Empty:
            return None

    def start(self) -> None:
        self.thread.start()

    def send(self, cmd: tuple) -> None:
        self.inbox.put(cmd)

    def stop(self) -> None:
        self.send(("stop",))
        self.thread.join(60)

    def alive(self) -> bool:
        return self.thread.is_alive()


def engine_info(engine: Engine) -> dict:
    return {"max_model_len": engine.max_model_len, "vocab_size": engine.model.cfg.vocab_size,
            "block_bytes": engine.block_bytes,
            "capacity_tokens": engine.bm.device.capacity * engine.cfg.block_size}


def serve_engine(cfg, commands, events) -> None:
    """The engine process: build the Engine, say it is ready (with its tokenizer), run."""
    try:
        engine = Engine(cfg)
    except Exception as e:  # noqa: BLE001 - whatever stops the engine is the server's error
        events.send(("failed", f"{type(e).__name__}: {e}"))
        return
    events.send(("ready", engine_info(engine), engine.tokenizer))
    recv = lambda timeout: commands.recv() if commands.poll(timeout) else None
    try:
        Loop(engine, recv, events.send).run()
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the server went away
    except Exception:  # noqa: BLE001
        events.send(("failed", traceback.format_exc(limit=5)))
    finally:
        engine.close()


class EngineProcess:
    """The loop in a child process that loads the model itself; a reader thread here hands
    its messages to `deliver` (set before start())."""

    def __init__(self, cfg):
        ctx = mp.get_context("spawn")
        cmd_r, self.writer = ctx.Pipe(duplex=False)   # commands: here -> the engine
        self.events, ev_w = ctx.Pipe(duplex=False)    # events: the engine -> here
        self.proc = ctx.Process(target=serve_engine, args=(cfg, cmd_r, ev_w),
                                name="superinfer-engine", daemon=True)
        self.proc.start()
        cmd_r.close()
        ev_w.close()
        self.deliver, self.lock = None, threading.Lock()
        msg = self._recv()
        if msg is None or msg[0] != "ready":
            self.proc.join(5)
            raise RuntimeError(msg[1] if msg else "the engine process exited while starting")
        self.info, self.tokenizer = msg[1], msg[2]
        self.reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)

    def _recv(self):
        try:
            return self.events.recv()
        except (EOFError, OSError):
            return None

    def _read(self) -> None:
        while (msg := self._recv()) is not None:
            self.deliver(msg)
            if msg[0] in ("bye", "failed"):
                return
        self.deliver(("failed", f"the engine process exited (code {self.proc.exitcode})"))

    def start(self) -> None:
        self.reader.start()

    def send(self, cmd: tuple) -> None:
        with self.lock:
            try:
                self.writer.send(cmd)
            except (BrokenPipeError, OSError):
                pass  # the reader reports the dead engine

    def stop(self, timeout: float = 60.0) -> None:
        self.send(("stop",))
        self.reader.join(timeout)
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.terminate()

    def alive(self) -> bool:
        return self.proc.is_alive()
