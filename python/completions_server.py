"""An OpenAI-style ``/v1/completions`` server over the standard library's asyncio, driving one
``SpeculativeDecoder`` with continuous batching: requests join the running batch as they arrive, stream their text
(``"stream": true``, server-sent events) and leave when they finish or their client disconnects (cancel).

    python python/completions_server.py [--target DIR --draft DIR] [--port 8000]
    python python/completions_server.py --target DIR --draft DIR --device cuda --dtype bfloat16 \
        --max-context 4096 --compile        # static caches for max-batch-size rows, captured steps (CUDA graphs)
    curl -N localhost:8000/v1/completions -d '{"prompt": "def f(x):", "max_tokens": 32, "stream": true}'

Request fields: ``prompt`` (a string), ``max_tokens`` (default 16), ``temperature`` (0 is greedy), ``top_p``,
``top_k``, ``min_p`` and ``repetition_penalty`` (extensions, as vLLM's server takes them), ``seed``,
``stream``, ``stop`` (a string or a list: the decoder's ``stop_strings``, so the decoder needs ``tokenizer=``). A field
set to ``null`` takes its default, as in OpenAI's API, and so do OpenAI's fields this server does not implement
when they ask for nothing (``n`` 1, ``best_of`` 1, ``echo`` false, ``presence_penalty``/``frequency_penalty`` 0,
``logit_bias`` {}, ``suffix`` "", and ``user``, a string). Anything else (``n`` 2, ``logprobs``, ...), a value of the wrong
type or out of range (checked with ``temperature`` 0 too, where the sampling fields do nothing) and a malformed request
are answered 400 naming the field or what is wrong. ``finish_reason`` is ``"stop"`` (EOS or a stop string) or
``"length"``; as with HF's ``stop_strings``, the text includes the stop string.

Defaults of the five sampling fields (``--generation-config``, as vLLM's server): ``auto`` (the default, as vLLM's)
takes those the target's ``generation_config`` sets (its generation_config.json: Qwen's ``temperature`` 0.7,
``top_p`` 0.8, ``top_k`` 20, ``repetition_penalty`` 1.05, say), logged at start; ``vllm`` ignores them. Fields
neither the request nor (with ``auto``) the checkpoint sets take OpenAI's values: ``temperature`` 1, ``top_p`` 1,
no top-k, no min-p, ``repetition_penalty`` 1. As in vLLM and OpenAI's API, ``temperature`` alone decides greedy or
sampled (the checkpoint's ``do_sample`` is not read: a checkpoint that sets ``temperature`` 0.6 and ``do_sample``
false samples at 0.6 here, as in vLLM, where ``model.generate`` would decode greedily). The checkpoint's other
settings (``eos_token_id``, ``no_repeat_ngram_size``, ``bad_words_ids``, ...) apply in both modes, as
``add_request`` takes them from it (vLLM has no such fields).

Two threads: the asyncio event loop accepts connections, parses and answers requests and streams text; one engine
thread owns the decoder and runs its steps (one draft + verify iteration each), so a step never stalls accepting or
streaming. They talk through a thread-safe command queue (event loop -> engine: add a request, cancel one; the engine
runs the commands between two steps) and ``loop.call_soon_threadsafe`` (engine -> event loop: a request's id or its
refusal, each step's tokens into the request's ``asyncio.Queue``, and its final result). Handlers detokenize
incrementally (``IncrementalDetokenizer``). A client that disconnects (its connection reaches EOF, or a write fails)
has its request cancelled at the next step boundary, which frees its row, streamed or not.
"""

import argparse
import asyncio
import dataclasses
import json
import logging
import queue
import threading
import time

from speculative_kernels import IncrementalDetokenizer, SpeculativeDecoder
from speculative_kernels.generation.memory import describes_out_of_memory

logger = logging.getLogger(__name__)

FIELDS = {"prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stream",
          "stop", "model", "user"}
# OpenAI's fields this server does not implement, at the values that ask for nothing more (one completion, no echo,
# no penalties or biases, no log probabilities; user is an identifier for OpenAI's own monitoring): accepted
NO_OP_DEFAULTS = {"n": 1, "best_of": 1, "echo": False, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {},
                  "suffix": ""}


def _same_value(value, default) -> bool:
    """``value`` is ``default`` as JSON gives it (1 and 1.0 alike; true is not 1)."""
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float)) and value == default
    return type(value) is type(default) and value == default


# numeric fields: (whether an int is required, the lowest value, whether it is excluded, the highest value)
RANGES = {"max_tokens": (True, 0, False, None), "temperature": (False, 0, False, None), "top_p": (False, 0, True, 1),
          "top_k": (True, 0, False, None), "min_p": (False, 0, False, 1), "repetition_penalty": (False, 0, True, None)}
MAX_BODY = 1 << 20
# the sampling fields' defaults where neither the request nor (with --generation-config auto) the checkpoint sets them:
# OpenAI's (top_k 0 and min_p 0: none)
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
GENERATION_CONFIG_MODES = ("auto", "vllm")


def sampling_defaults(generation_config, mode: str = "auto") -> dict:
    """The defaults of ``OPENAI_DEFAULTS``' fields for requests that omit them. mode ``"auto"`` (vLLM's default):
    OpenAI's, overridden by each one ``generation_config`` (the target's) sets; ``"vllm"``: OpenAI's. A checkpoint's
    value out of the request field's range is refused by name (ValueError), as the same value in a request is."""
    if mode not in GENERATION_CONFIG_MODES:
        raise ValueError(f"generation_config must be one of {GENERATION_CONFIG_MODES}, got {mode!r}")
    defaults = dict(OPENAI_DEFAULTS)
    if mode == "auto" and generation_config is not None:
        for name in OPENAI_DEFAULTS:
            value = getattr(generation_config, name, None)
            if value is None:
                continue
            try:
                _check_fields({name: value})
            except HTTPError as error:
                raise ValueError(f"the target's generation_config: {error} (serve with generation_config=\"vllm\" "
                                 "to ignore it)") from None
            defaults[name] = value
    return defaults


class HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class StepFailed(Exception):
    """What a request's queue receives when the decoder's step raised, or when its request could not be admitted
    (finish_reason "error"): its client gets the message with ``status`` (503 for a request the device has no memory
    for now, 500 otherwise)."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass
class Finished:
    """The last item of a request's queue: its final ``RequestResult`` (the engine has released it)."""

    result: object


class CompletionsServer:
    """decoder: a ``SpeculativeDecoder`` (continuous batching: ``add_request``/``step``); tokenizer: its HF
    tokenizer. ``serve`` runs it in the current event loop (and starts the engine thread); ``start_in_thread`` runs
    the event loop in a thread of its own too. Only the engine thread touches the decoder once serving.
    generation_config: ``"auto"`` or ``"vllm"``, the defaults of the sampling fields (``sampling_defaults``; the
    module's docstring)."""

    def __init__(self, decoder: SpeculativeDecoder, tokenizer, model_name: str = "speculative-kernels",
                 generation_config: str = "auto"):
        self.decoder, self.tokenizer, self.model_name = decoder, tokenizer, model_name
        self.defaults = sampling_defaults(decoder.target.generation_config, generation_config)
        self._checkpoint_min_p = getattr(decoder.target.generation_config, "min_p", None) is not None
        taken = {name: value for name, value in self.defaults.items() if value != OPENAI_DEFAULTS[name]}
        if taken:  # (as vLLM logs it: a server whose sampling changed with its checkpoint should say so)
            logger.warning("completions server: default sampling fields from the target's generation_config: %s "
                           "(generation_config=\"vllm\" ignores them)", taken)
        self._queues: dict[int, asyncio.Queue] = {}  # engine thread only: request id -> its handler's queue
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # callables the engine runs between steps
        self._stopping = False
        self.cancelled: list[int] = []  # request ids cancelled because their client went away
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._engine: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------- engine thread
    def _run_engine(self) -> None:
        while True:
            self._run_commands(wait=not self.decoder.has_work())
            if self._stopping:
                return
            if self.decoder.has_work():
                try:
                    new = self.decoder.step()
                except Exception as error:  # noqa: BLE001 -- its clients are told; the engine keeps serving
                    # (the decoder ends the requests of a batch whose step raised with "error": answered below, 503
                    # when out of memory; one it left running cannot go on and is failed here; queued ones wait)
                    self._fail_running(error)
                    new = {}
                for request_id, tokens in new.items():
                    if request_id in self._queues:
                        self._post(self._queues[request_id], tokens)
            # (also after commands alone: a cancel that raised ended the running requests, whose clients wait)
            live = set(self.decoder.running) | set(self.decoder.queued)
            for request_id in [r for r in self._queues if r not in live]:
                self._finish(request_id)  # after its last tokens

    def _run_commands(self, wait: bool) -> None:
        """Run the queued commands (blocking for the first one when ``wait``: nothing to step). A command that
        raises (a cancel whose row removal ran out of memory: the decoder then ends the running requests with
        "error", answered by the engine's next pass) is logged; the engine goes on serving."""
        try:
            command = self._commands.get(block=wait)
            while True:
                try:
                    command()
                except Exception:  # noqa: BLE001 -- one client's command must not stop the engine thread
                    logger.exception("completions server: a command failed")
                command = self._commands.get_nowait()
        except queue.Empty:
            pass

    def _post(self, handler_queue: asyncio.Queue, item) -> None:
        self._loop.call_soon_threadsafe(handler_queue.put_nowait, item)

    def _finish(self, request_id: int) -> None:
        """Send a finished request's result (or why it could not be admitted) to its handler and forget it."""
        result = self.decoder.result(request_id)
        if result.finish_reason == "error":  # (other requests are unaffected)
            out_of_memory = describes_out_of_memory(result.error)
            item = StepFailed(result.error, 503 if out_of_memory else 500)
        else:
            item = Finished(result)
        self._post(self._queues.pop(request_id), item)
        self.decoder.release(request_id)

    def _fail_running(self, error: Exception) -> None:
        """A step raised and left requests running (the decoder ends its batch's requests itself): each is cancelled
        and its client gets the error (500), instead of waiting for tokens that will never come."""
        failure = StepFailed(f"{type(error).__name__}: {error}")
        for request_id in self.decoder.running:
            if request_id in self._queues:
                self._post(self._queues.pop(request_id), failure)
                try:
                    self.decoder.cancel(request_id)
                except Exception:  # noqa: BLE001 -- (the decoder then ends its running requests itself)
                    logger.exception("completions server: cancelling request %d failed", request_id)
                if self.decoder.result(request_id).finished:
                    self.decoder.release(request_id)

    def _add(self, ids: list[int], kwargs: dict, handler_queue: asyncio.Queue, future: asyncio.Future) -> None:
        """Command: add a request; its id (or the refusal) goes to ``future``."""
        try:
            request_id = self.decoder.add_request(ids, **kwargs)
        except (TypeError, ValueError) as error:
            self._loop.call_soon_threadsafe(_settle, future, None, HTTPError(400, str(error)))
            return
        except Exception as error:  # noqa: BLE001 -- the client is told; the engine keeps serving
            self._loop.call_soon_threadsafe(_settle, future, None,
                                            HTTPError(500, f"{type(error).__name__}: {error}"))
            return
        self._queues[request_id] = handler_queue
        self._loop.call_soon_threadsafe(_settle, future, request_id, None)
        if self.decoder.result(request_id).finished:  # max_tokens 0
            self._finish(request_id)

    def _cancel_now(self, request_id: int) -> None:
        """Command: the client went away; cancel its request (if still running) and forget it."""
        if request_id not in self._queues:  # finished meanwhile (its result was sent and released)
            return
        del self._queues[request_id]
        try:
            if self.decoder.cancel(request_id):
                self.cancelled.append(request_id)
        finally:  # (a cancel that raised ended the request with "error": forgotten all the same)
            if self.decoder.result(request_id).finished:
                self.decoder.release(request_id)

    # ------------------------------------------------------------------------------------------- event loop
    async def _submit(self, body: dict) -> tuple[int, asyncio.Queue]:
        body = {name: value for name, value in body.items() if value is not None}  # null: the default, as OpenAI's
        # OpenAI fields set to their defaults ask for what this server does (clients that send every field send them)
        body = {name: value for name, value in body.items()
                if not (name in NO_OP_DEFAULTS and _same_value(value, NO_OP_DEFAULTS[name]))}
        unknown = sorted(set(body) - FIELDS)
        if unknown:
            raise HTTPError(400, f"{unknown[0]} is not supported by this server")
        _check_fields(body)
        if not isinstance(body.get("user", ""), str):
            raise HTTPError(400, "user must be a string")
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise HTTPError(400, "prompt must be a non-empty string")
        fields = {**self.defaults, **{name: body[name] for name in self.defaults if name in body}}
        temperature = float(fields["temperature"])  # (JSON's 2 is an int: generate takes floats, as HF's)
        kwargs = {"max_new_tokens": body.get("max_tokens", 16), "seed": body.get("seed"),
                  "repetition_penalty": float(fields["repetition_penalty"])}  # (1: none, the checkpoint's too)
        if body.get("stop") is not None:
            kwargs["stop_strings"] = body["stop"]
        if temperature == 0:
            kwargs["do_sample"] = False
        else:
            kwargs.update(do_sample=True, temperature=temperature, top_p=float(fields["top_p"]),
                          top_k=fields["top_k"])
            if fields["min_p"] or self._checkpoint_min_p:  # (0 over the checkpoint's min_p: none, as HF's warper at 0)
                kwargs["min_p"] = float(fields["min_p"])
        ids = self.tokenizer(prompt)["input_ids"]
        handler_queue, future = asyncio.Queue(), self._loop.create_future()
        self._commands.put(lambda: self._add(ids, kwargs, handler_queue, future))
        return await future, handler_queue

    def _cancel(self, request_id: int) -> None:
        self._commands.put(lambda: self._cancel_now(request_id))

    # ------------------------------------------------------------------------------------------- HTTP
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                method, path, body = await _read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionError):  # the client went away mid-request
                writer.close()
                return
            if path != "/v1/completions":
                raise HTTPError(404, f"no route {path}")
            if method != "POST":
                raise HTTPError(405, "use POST")
            request_id, handler_queue = await self._submit(body)
        except HTTPError as error:
            await _respond(writer, error.status, {"error": {"message": str(error)}})
            return
        try:
            if body.get("stream"):
                await self._stream(request_id, handler_queue, reader, writer)
            else:
                await self._complete(request_id, handler_queue, reader, writer)
        except (ConnectionError, asyncio.CancelledError):
            self._cancel(request_id)
        except BaseException:  # any other failure of this handler (e.g. detokenizing): nobody reads the request now
            self._cancel(request_id)
            raise
        finally:
            writer.close()

    async def _complete(self, request_id, handler_queue, reader, writer) -> None:
        gone = asyncio.ensure_future(_disconnected(reader))
        try:
            while not isinstance(item := await self._next(request_id, handler_queue, gone), Finished):
                if item is None:  # disconnected while waiting
                    return
                if isinstance(item, StepFailed):
                    await _respond(writer, item.status, {"error": {"message": str(item)}})
                    return
        finally:
            gone.cancel()
        result = item.result
        text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        await _respond(writer, 200, self._body(request_id, text, _reason(result.finish_reason), result))

    async def _stream(self, request_id, handler_queue, reader, writer) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                     b"Connection: close\r\n\r\n")
        await writer.drain()
        gone = asyncio.ensure_future(_disconnected(reader))
        detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True)
        streamed = 0  # tokens pushed so far
        try:
            while True:
                tokens = await self._next(request_id, handler_queue, gone)
                if tokens is None:  # disconnected while waiting
                    return
                if isinstance(tokens, Finished):
                    break
                if isinstance(tokens, StepFailed):  # headers are out: the error goes as an event, then [DONE]
                    await _event(writer, {"error": {"message": str(tokens)}})
                    writer.write(b"data: [DONE]\n\n")
                    await writer.drain()
                    return
                piece = detokenizer.push(tokens)
                streamed += len(tokens)
                if piece:
                    await _event(writer, self._body(request_id, piece, None))
            result = tokens.result
            # the result holds every token; a step that raised after collecting its tokens returned none of them
            last = detokenizer.push(result.token_ids[streamed:]) if len(result.token_ids) > streamed else ""
            text = last + detokenizer.flush()
            await _event(writer, self._body(request_id, text, _reason(result.finish_reason), result))
            writer.write(b"data: [DONE]\n\n")
            await writer.drain()
        finally:
            gone.cancel()

    async def _next(self, request_id, handler_queue, gone):
        """The next item of the request's queue, or None (its request cancelled) if its client disconnects first."""
        item = asyncio.ensure_future(handler_queue.get())
        await asyncio.wait([item, gone], return_when=asyncio.FIRST_COMPLETED)
        if item.done():
            return item.result()
        item.cancel()
        self._cancel(request_id)
        return None

    def _body(self, request_id, text, finish_reason, result=None) -> dict:
        body = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": [{"index": 0, "text": text, "finish_reason": finish_reason}]}
        if result is not None:
            body["usage"] = {"prompt_tokens": len(result.prompt_ids), "completion_tokens": len(result.token_ids),
                             "total_tokens": len(result.prompt_ids) + len(result.token_ids)}
        return body

    # ------------------------------------------------------------------------------------------- running
    async def serve(self, host: str = "127.0.0.1", port: int = 8000) -> asyncio.AbstractServer:
        """Start listening in the running event loop and the engine thread; returns the asyncio server."""
        self._loop = asyncio.get_running_loop()
        self._engine = threading.Thread(target=self._run_engine, name="completions-engine", daemon=True)
        self._engine.start()
        self._server = await asyncio.start_server(self._handle, host, port)
        return self._server

    def start_in_thread(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Run the server in a daemon thread with its own event loop; returns the bound port (port 0: any free)."""
        started = threading.Event()
        bound = []

        def run():
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            server = loop.run_until_complete(self.serve(host, port))
            bound.append(server.sockets[0].getsockname()[1])
            started.set()
            loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        started.wait()
        return bound[0]

    def stop(self) -> None:
        """Stop a server started with ``start_in_thread``."""
        async def shutdown():
            self._server.close()

        self._stopping = True
        self._commands.put(lambda: None)  # wakes an idle engine; a busy one stops after its step
        self._engine.join()
        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()


def _settle(future: asyncio.Future, value, error: Exception | None) -> None:
    """In the event loop: resolve ``future`` (unless its handler has gone)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


async def _disconnected(reader: asyncio.StreamReader) -> None:
    """Returns when the client has closed its connection (EOF, or a reset). Bytes it sends after its request (a
    stray CRLF after the body, as some clients send) are read and ignored: they are no disconnection."""
    try:
        while await reader.read(1024):
            pass
    except ConnectionError:
        pass


def _check_fields(body: dict) -> None:
    """HTTPError 400 naming the first field of the wrong type or out of range (``RANGES``; ``stream`` a bool)."""
    if not isinstance(body.get("stream", False), bool):
        raise HTTPError(400, f"stream must be true or false, got {body['stream']!r}")
    for name, (integer, low, open_low, high) in RANGES.items():
        if name not in body:
            continue
        value = body[name]
        kind = int if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kind) or value != value:  # (value != value: NaN)
            raise HTTPError(400, f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}")
        if value < low or (open_low and value == low) or (high is not None and value > high):
            bounds = f"{'(' if open_low else '['}{low}, {'inf)' if high is None else f'{high}]'}"
            raise HTTPError(400, f"{name} must be in {bounds}, got {value!r}")


def _reason(finish_reason: str | None) -> str | None:
    return {"eos": "stop", "stop": "stop", "length": "length"}.get(finish_reason, finish_reason)


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, dict]:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise HTTPError(400, "request head too large") from None
    lines = head.decode("latin-1").split("\r\n")
    try:
        method, path, _ = lines[0].split(" ", 2)
    except ValueError:
        raise HTTPError(400, "malformed request line") from None
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise HTTPError(400, "chunked bodies are not supported: send Content-Length")
    length = headers.get("content-length", "0") or "0"
    if not length.isdigit():  # (isdigit: no sign, no spaces; int() would take "-5" and " 5")
        raise HTTPError(400, f"Content-Length must be a non-negative integer, got {length!r}")
    if int(length) > MAX_BODY:
        raise HTTPError(413, "body too large")
    raw = await reader.readexactly(int(length)) if int(length) else b""
    if method != "POST":
        return method, path, {}
    try:
        body = json.loads(raw or b"{}")
    except ValueError as error:  # (JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8/16/32)
        raise HTTPError(400, f"body is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "body must be a JSON object")
    return method, path, body


async def _respond(writer, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 413: "Too Large",
              500: "Internal Server Error", 503: "Service Unavailable"}
    writer.write(f"HTTP/1.1 {status} {reason.get(status, '')}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    await writer.drain()
    writer.close()


async def _event(writer, body: dict) -> None:
    writer.write(b"data: " + json.dumps(body).encode() + b"\n\n")
    await writer.drain()


def main() -> None:
    from speculative_kernels.demo_pair import demo_model_paths
    from speculative_kernels.model_loading import load_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="local HF folder with a tokenizer (default: the bundled demo target)")
    parser.add_argument("--draft", help="local HF folder (default: the bundled demo draft)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--device", default="cpu", help="where the models run (e.g. cuda)")
    parser.add_argument("--dtype", default="float32", help="the models' dtype (e.g. bfloat16 on a GPU)")
    parser.add_argument("--max-context", type=int, help="run on static caches allocated once for max-batch-size rows "
                        "of this many tokens (prompt plus max_tokens; longer requests are answered 400)")
    parser.add_argument("--compile", action="store_true", help="capture the batch's steps (CUDA graphs on a GPU); "
                        "needs --max-context")
    parser.add_argument("--generation-config", choices=GENERATION_CONFIG_MODES, default="auto",
                        help="auto (as vLLM's default): requests that omit temperature, top_p, top_k, min_p or "
                        "repetition_penalty take the target's generation_config values; vllm: OpenAI's defaults")
    args = parser.parse_args()
    if bool(args.target) != bool(args.draft):
        parser.error("give both --target and --draft, or neither")
    if args.compile and args.max_context is None:
        parser.error("--compile needs --max-context (the captured steps run on static caches)")
    target_dir, draft_dir = (args.target, args.draft) if args.target else demo_model_paths()
    target, tokenizer = load_model(target_dir, device=args.device, dtype=args.dtype)
    draft, _ = load_model(draft_dir, device=args.device, dtype=args.dtype)
    static = {} if args.max_context is None else dict(cache_implementation="static", max_context=args.max_context)
    decoder = SpeculativeDecoder(target, draft, num_speculative_tokens=4, max_batch_size=args.max_batch_size,
                                 tokenizer=tokenizer, compile=args.compile, **static)
    server = CompletionsServer(decoder, tokenizer, generation_config=args.generation_config)

    async def run():
        listening = await server.serve(args.host, args.port)
        print(f"listening on http://{args.host}:{listening.sockets[0].getsockname()[1]}/v1/completions")
        await asyncio.Event().wait()

    asyncio.run(run())


if __name__ == "__main__":
    main()
