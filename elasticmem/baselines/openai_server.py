"""A minimal OpenAI-compatible chat-completions endpoint serving a local model, so that the text-memory
libraries that need an LLM (Mem0, LangMem) run fully offline on the project's base model.

    python -m elasticmem.baselines.openai_server --model smollm2 --port 8011
    curl -s localhost:8011/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

Endpoints: ``POST /v1/chat/completions`` (``messages``, ``max_tokens`` or
``max_completion_tokens``, ``temperature``, ``seed``, ``stop``, ``response_format``), ``GET
/v1/models``, ``GET /v1/usage`` (calls, prompt and completion tokens since start, JSON-mode
answers that did not parse) and ``GET /health``.

``tools``: a function call is always made (``tool_choice`` 'auto' is served as 'required': a small
local model is not left to choose between prose and a call): the function named by
``tool_choice``, else the one the model picks among those offered (decoding constrained to their
names), then its arguments, constrained to its parameters' schema, for up to ``max_parallel``
calls at once (``parallel_tool_calls``); functions whose parameters fall outside the schema
subset below are not offered.

``response_format``: ``json_schema`` constrains decoding to the schema, token by token, with
A-Mem's matcher (``elasticmem.llm.structured``: objects with every key, strings,
string enums, booleans, arrays), so the answer parses by construction; a schema outside that
subset is refused with HTTP 400 naming ``response_format`` (clients then fall back to another
mode); an answer the token budget cut off inside the JSON is counted (``json_schema_unfinished``).
``json_object`` (JSON mode) generates freely: whether the answer parsed as a JSON object is
counted in ``/v1/usage``, never repaired. The model runs one request at a time (one lock):
this is a harness for baselines, not a production server (``elasticmem.serve`` batches).
Needs the ``serve`` extra (FastAPI, uvicorn).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from collections import Counter
from typing import Any

from elasticmem.llm.client import GenRequest, TransformersBackend
from elasticmem.llm.structured import Arr, Enum, Obj, from_json_schema
from elasticmem.utils.common import free_port

DEFAULT_MAX_TOKENS = 256


def _text(content: Any) -> str:
    """A message's content: a string, or OpenAI's list of parts (their text parts joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


class ChatEndpoint:
    """The request handling, apart from HTTP (tests call ``complete`` directly too)."""

    def __init__(self, backend: TransformersBackend, name: str, max_parallel: int = 4):
        """``max_parallel``: most function calls in one answer (``parallel_tool_calls``; 1 = one)."""
        self.backend, self.name, self.max_parallel = backend, name, max_parallel
        self.lock = threading.Lock()
        self.usage: Counter = Counter()
        self.context = int(getattr(backend.model.config, "max_position_embeddings", 0) or 0)

    def complete(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """(HTTP status, response JSON) of one chat-completions request."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return 400, _error("'messages' must be a non-empty list")
        msgs = [{"role": str(m.get("role", "user")), "content": _text(m.get("content"))} for m in messages
                if isinstance(m, dict)]
        max_new = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS
        if not isinstance(max_new, int) or max_new < 1:
            return 400, _error("'max_tokens' must be a positive integer")
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        tools = body.get("tools") or []
        choice = body.get("tool_choice", "auto")
        if tools and choice != "none":
            return self._tool_call(body, msgs, tools, choice, max_new)
        fmt = body.get("response_format") or {"type": "text"}
        kind, schema = fmt.get("type", "text"), None
        if kind == "json_schema":
            spec = (fmt.get("json_schema") or {}).get("schema")
            try:
                schema = from_json_schema(spec)
            except ValueError as e:
                return 400, _error(f"response_format json_schema: {e}", "response_format")
        elif kind not in ("text", "json_object"):
            return 400, _error(f"response_format type {kind!r} is not supported", "response_format")
        req = GenRequest(msgs, max_new, schema, stop=() if schema is not None else stop, kind=kind)
        prompt_len = self.backend.count_tokens(self.backend.render(msgs))
        if self.context and prompt_len + max_new > self.context:
            self.usage["refused_too_long"] += 1
            return 400, _error(f"the prompt has {prompt_len} tokens; with max_tokens={max_new} that is more than "
                               f"the model's context of {self.context}", "messages")
        out = self._generate(req, float(body.get("temperature") or 0.0), int(body.get("seed") or 0))
        if kind == "json_object" and not _is_json_object(out.text):
            self.usage["json_object_unparsed"] += 1
        if schema is not None and not out.finished:  # the budget ran out inside the JSON: it does not parse
            self.usage["json_schema_unfinished"] += 1
        return 200, {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model") or self.name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                         "finish_reason": "stop" if out.finished else "length"}],
            "usage": {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                      "total_tokens": out.prompt_tokens + out.completion_tokens},
        }


    def _generate(self, req: GenRequest, temperature: float, seed: int):
        with self.lock:
            t0 = time.perf_counter()
            out = self.backend.generate([req], temperature=temperature, seed=seed)[0]
            seconds = time.perf_counter() - t0
        u = self.usage
        u["calls"] += 1
        u[f"calls/{req.kind}"] += 1
        u["prompt_tokens"] += out.prompt_tokens
        u["completion_tokens"] += out.completion_tokens
        u["seconds"] += seconds
        return out

    def _tool_call(self, body: dict[str, Any], msgs, tools: list, choice, max_new: int) -> tuple[int, dict[str, Any]]:
        """A forced function call: the function (named by ``tool_choice``, else chosen by the model
        among the offered ones, decoding constrained to their names), then its arguments, decoding
        constrained to its parameters' schema. 'auto' is served as 'required': with tools offered,
        a small local model is not left to decide between prose and a call."""
        specs = {}
        for t in tools:
            f = t.get("function") or {}
            try:
                specs[f["name"]] = from_json_schema(f.get("parameters") or {})
            except (KeyError, ValueError):
                continue  # a function whose arguments this server cannot constrain is not offered
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            if name not in specs:
                return 400, _error(f"tool_choice names {name!r}, which is not an offered function this server "
                                   f"can call (it constrains arguments to {sorted(specs)})", "tool_choice")
            names = [name]
        else:
            names = list(specs)
        if not names:
            return 400, _error("no offered function has arguments this server can constrain", "tools")
        temperature, seed = float(body.get("temperature") or 0.0), int(body.get("seed") or 0)
        listing = "\n".join(f"- {t['function']['name']}: {t['function'].get('description', '')}"
                             for t in tools if (t.get("function") or {}).get("name") in names)
        prompt_tokens = completion_tokens = 0
        name = names[0]
        if len(names) > 1:
            ask = msgs + [{"role": "user", "content": f"Functions:\n{listing}\nWhich function do you call?"}]
            out = self._generate(GenRequest(ask, 32, Obj((("name", Enum(tuple(names))),)), kind="tool_name"),
                                 temperature, seed)
            name = json.loads(out.text)["name"] if out.finished else names[0]
            prompt_tokens, completion_tokens = out.prompt_tokens, out.completion_tokens
        described = next(line for line in listing.splitlines() if line.startswith(f"- {name}:"))[2:]
        parallel = bool(body.get("parallel_tool_calls", True)) and self.max_parallel > 1
        if parallel:  # several calls of the function: a list of argument objects
            ask = msgs + [{"role": "user", "content": f"Call the function {described}\nThe arguments of each call, "
                                                      f"as JSON:"}]
            schema = Obj((("calls", Arr(specs[name], 1, self.max_parallel)),))
        else:
            ask = msgs + [{"role": "user", "content": f"Call the function {described}\nIts arguments as JSON:"}]
            schema = specs[name]
        out = self._generate(GenRequest(ask, max_new, schema, kind="tool_arguments"), temperature, seed)
        if not out.finished:  # the budget ran out inside the JSON: no call can be made of it
            self.usage["tool_arguments_unfinished"] += 1
            args = []
        else:
            args = json.loads(out.text)["calls"] if parallel else [json.loads(out.text)]
        calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                  "function": {"name": name, "arguments": json.dumps(a)}} for a in args]
        return 200, {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model") or self.name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": None if calls else "",
                                                 **({"tool_calls": calls} if calls else {})},
                         "finish_reason": "tool_calls" if calls else "length"}],
            "usage": {"prompt_tokens": prompt_tokens + out.prompt_tokens,
                      "completion_tokens": completion_tokens + out.completion_tokens,
                      "total_tokens": prompt_tokens + out.prompt_tokens + completion_tokens + out.completion_tokens},
        }


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text.strip().removeprefix("```json").removesuffix("```")), dict)
    except ValueError:
        return False


def _error(message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param}}


def create_app(endpoint: ChatEndpoint):
    """The FastAPI app of ``endpoint``."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(title="elasticmem local OpenAI-compatible endpoint")

    @app.post("/v1/chat/completions")
    def chat(body: dict[str, Any]):
        status, data = endpoint.complete(body)
        return JSONResponse(data, status_code=status)

    @app.exception_handler(ValueError)
    async def bad_json(request: Request, exc: ValueError):  # malformed bodies FastAPI lets through
        return JSONResponse(_error(str(exc)), status_code=400)

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": endpoint.name, "object": "model", "owned_by": "local"}]}

    @app.get("/v1/usage")
    def usage():
        return dict(endpoint.usage)

    @app.get("/health")
    def health():
        return {"status": "ok", "model": endpoint.name}

    return app


class ServerThread:
    """The endpoint served by uvicorn in a background thread of this process (what the harness
    starts when no ``api_base`` is given): ``url`` is its ``.../v1``; ``close()`` stops it."""

    def __init__(self, endpoint: ChatEndpoint, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.endpoint = endpoint
        port = port or free_port(host)
        self.url = f"http://{host}:{port}/v1"
        self.server = uvicorn.Server(uvicorn.Config(create_app(endpoint), host=host, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise RuntimeError(f"the local endpoint did not start on {host}:{port}")
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def load_endpoint(model: str, device: str = "auto", dtype: str = "auto", backbone=None) -> ChatEndpoint:
    """An endpoint on ``model`` (elasticmem.backbone names: 'smollm2', a local folder, ...), or on an
    already loaded ``backbone``."""
    from elasticmem.baselines.amem.config import AMemLLMConfig

    backend = TransformersBackend.from_config(AMemLLMConfig(model=model, device=device, dtype=dtype, batch_size=1),
                                              backbone)
    return ChatEndpoint(backend, model)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m elasticmem.baselines.openai_server",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="elasticmem.backbone name or local folder (default smollm2)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    a = p.parse_args(argv)
    import uvicorn

    endpoint = load_endpoint(a.model, a.device, a.dtype)
    print(f"[openai_server] {a.model} on http://{a.host}:{a.port}/v1", flush=True)
    uvicorn.run(create_app(endpoint), host=a.host, port=a.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
