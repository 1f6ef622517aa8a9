"""`ferry serve`: an OpenAI-compatible HTTP server (FastAPI): /v1/chat/completions and /v1/completions with
and without streaming (SSE), with OpenAI's logprobs; /v1/models, /health, /metrics; llama-server's `timings` in
responses and its own /completion (n_predict, n_probs, token prompts, stop_type), /tokenize, /detokenize,
/apply-template, /props and /slots. One model is served under any `model` name a request gives, as llama-server
does (clients send fixed ones). Bad requests get a 4xx with a JSON error; the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ferry.runtime.sampling import SamplingParams
from ferry.server.reasoning import FORMATS, Splitter, kind_of
from ferry.server.scheduler import Request, Scheduler
from ferry.tokenizer import BUILTIN_TEMPLATES, TemplateError, render_chat


# a request's sampling where it gives none (llama-server's defaults), also what /props reports
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": -1}


class BadRequest(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code


def _error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": code}}, status_code=status)


def create_app(scheduler: Scheduler, tokenizer, model_name: str, api_key: str | None = None,
               template: str | None = None, reasoning_format: str = "auto") -> FastAPI:
    """`template`: the chat template's Jinja source (tokenizer.chat_template: the file's, --chat-template's or its
    family's); the file's own, else ChatML, when None. reasoning_format: "auto" splits a chat answer's reasoning into
    reasoning_content where the template's format has one (server/reasoning.py), "none" leaves it in content."""
    app = FastAPI(title="ferry")
    app.state.slot_tokens = scheduler.seq_len
    template = template or tokenizer.chat_template or BUILTIN_TEMPLATES["chatml"]
    thinks = kind_of(template)  # the reasoning format of the template's answers, if any
    created = int(time.time())
    bos, eos = tokenizer.special_texts()

    @app.middleware("http")
    async def check_key(request: HttpRequest, call_next):
        if api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return _error(401, "invalid API key: send 'Authorization: Bearer KEY'", "authentication_error",
                              "invalid_api_key")
        return await call_next(request)

    @app.exception_handler(BadRequest)
    async def bad_request(request: HttpRequest, e: BadRequest):
        return _error(e.status, e.message, e.kind, e.code)

    @app.get("/health")
    async def health():
        return {"status": "ok", "slots_idle": len(scheduler.slots) - scheduler.busy, "slots_processing": scheduler.busy}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "ferry"}]}

    @app.get("/metrics")
    async def metrics():
        lines = [
            "# HELP ferry_requests_total Requests received.", "# TYPE ferry_requests_total counter",
            f"ferry_requests_total {scheduler.requests_total}",
            "# HELP ferry_prompt_tokens_total Prompt tokens processed.", "# TYPE ferry_prompt_tokens_total counter",
            f"ferry_prompt_tokens_total {scheduler.prompt_tokens_total}",
            "# HELP ferry_tokens_predicted_total Tokens generated.", "# TYPE ferry_tokens_predicted_total counter",
            f"ferry_tokens_predicted_total {scheduler.predicted_tokens_total}",
            "# HELP ferry_slots_processing Slots generating now.", "# TYPE ferry_slots_processing gauge",
            f"ferry_slots_processing {scheduler.busy}",
            "# HELP ferry_slots_idle Free slots.", "# TYPE ferry_slots_idle gauge",
            f"ferry_slots_idle {len(scheduler.slots) - scheduler.busy}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def body_of(request: HttpRequest) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(400, f"the request body is not valid JSON: {e}")
        if not isinstance(body, dict):
            raise BadRequest(400, "the request body must be a JSON object")
        return body

    def number(body: dict, key: str, default, kind=float, low=None, high=None):
        v = body.get(key, default)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
            raise BadRequest(400, f"'{key}' must be a number, got {v!r}")
        v = kind(v)
        if (low is not None and v < low) or (high is not None and v > high):
            raise BadRequest(400, f"'{key}' must be in [{low}, {high}], got {v}")
        return v

    def flag(body: dict, key: str, default: bool = False) -> bool:
        v = body.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise BadRequest(400, f"'{key}' must be true or false, got {v!r}")
        return v

    def make_request(body: dict, prompt: list[int], default_max: int, logprobs: int = -1,
                     max_key: str = "max_tokens") -> Request:
        """The scheduler's request for `prompt`: sampling, stop strings and the token limit from the body (the limit
        under max_completion_tokens, else `max_key`; -1 none, 0 the prompt into the cache only); `logprobs`: as
        Request's."""
        seq_len = scheduler.seq_len
        if len(prompt) + 1 >= seq_len:
            raise BadRequest(400, f"the prompt has {len(prompt)} tokens; a slot holds {seq_len} (-c / -np): "
                                  "shorten it or start the server with a larger -c", code="context_length_exceeded")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise BadRequest(400, "'stop' must be a string or a list of non-empty strings")
        params = SamplingParams(temp=number(body, "temperature", DEFAULTS["temperature"], low=0, high=100),
                                top_p=number(body, "top_p", DEFAULTS["top_p"], low=1e-9, high=1),
                                top_k=number(body, "top_k", DEFAULTS["top_k"], int, low=0),
                                min_p=number(body, "min_p", DEFAULTS["min_p"], low=0, high=1),
                                seed=number(body, "seed", DEFAULTS["seed"], int))
        if number(body, "n", 1, int, low=1) > 1:
            raise BadRequest(400, f"'n' is {body['n']}: ferry returns one choice per request; send the request that "
                                  "many times (with different seeds) for more")
        max_tokens = number(body, "max_completion_tokens", None, int, low=-1)
        if max_tokens is None:
            max_tokens = number(body, max_key, default_max, int, low=-1)
        loop = asyncio.get_running_loop()
        return Request(prompt, params, max_tokens, stop, loop, asyncio.Queue(),
                       cache_prompt=flag(body, "cache_prompt", True), logprobs=logprobs,
                       ignore_eos=flag(body, "ignore_eos", False))

    def piece(token: int) -> dict:
        text = tokenizer.decode([token])
        return {"token": text, "bytes": list(text.encode("utf-8"))}

    def logprobs_of(records: list[dict], kind: str):
        """OpenAI's logprobs object for these tokens: chat's content list, completions' parallel lists."""
        if not records or "logprob" not in records[0]:
            return None
        if kind == "chat":
            return {"content": [{**piece(r["id"]), "logprob": r["logprob"],
                                 "top_logprobs": [{**piece(i), "logprob": v} for i, v in r.get("top", [])]}
                                for r in records], "refusal": None}
        return {"tokens": [piece(r["id"])["token"] for r in records],
                "token_logprobs": [r["logprob"] for r in records],
                "top_logprobs": [{piece(i)["token"]: v for i, v in r.get("top", [])} for r in records],
                "text_offset": [r["start"] for r in records]}

    async def whole(r: Request) -> tuple[str, list[dict], dict]:
        """A submitted request's whole answer: its text, its tokens' records and the last event's payload (a 500
        where the step failed)."""
        pieces, records = [], []
        try:
            while True:
                what, payload = await r.out.get()
                if what == "text":
                    pieces.append(payload[0])
                    records += payload[1]
                elif what == "error":
                    raise BadRequest(500, payload, "server_error")
                else:
                    return "".join(pieces), records, payload
        finally:
            r.cancelled.set()  # a client gone before the end frees its slot at the next step

    def splitter(body: dict, prompt: str) -> Splitter | None:
        """The chat answer's reasoning splitter, unless the template has no reasoning format or the server or the
        request says "none"."""
        wanted = body.get("reasoning_format", reasoning_format)
        if wanted not in FORMATS:
            raise BadRequest(400, f"'reasoning_format' must be one of {', '.join(FORMATS)}")
        return Splitter(thinks, prompt) if thinks and wanted != "none" else None

    async def respond(body: dict, r: Request, kind: str, split: Splitter | None = None):
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if kind == "chat" else "text_completion"

        def choice(text: str | None, finish: str | None, delta: bool, records: list[dict],
                   reasoning: str = "") -> dict:
            if kind == "chat":
                if delta:  # a piece of reasoning alone carries no content
                    msg = {"content": text} if text or (text is not None and not reasoning) else {}
                else:
                    msg = {"role": "assistant", "content": text}
                if reasoning:
                    msg["reasoning_content"] = reasoning
                return {"index": 0, ("delta" if delta else "message"): msg, "logprobs": logprobs_of(records, kind),
                        "finish_reason": finish}
            return {"index": 0, "text": text or "", "logprobs": logprobs_of(records, kind), "finish_reason": finish}

        scheduler.submit(r)
        if not body.get("stream"):
            text, records, payload = await whole(r)
            reasoning = ""
            if split is not None:
                parts = [split.push(text), split.finish()]
                reasoning, text = ("".join(p[i] for p in parts).rstrip() for i in (0, 1))
            return {"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                    "choices": [choice(text, payload["finish_reason"], False, records, reasoning)],
                    "usage": payload["usage"], "timings": payload["timings"]}

        async def events():
            chunk_obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
            try:
                if kind == "chat":
                    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    yield _sse({"id": rid, "object": chunk_obj, "created": int(time.time()), "model": model_name,
                                "choices": [first]})
                while True:
                    what, payload = await r.out.get()
                    if what == "text":
                        reasoning, text = split.push(payload[0]) if split is not None else ("", payload[0])
                        if text or reasoning or payload[1]:  # held back (a marker's start, or one): nothing to send
                            yield _sse({"id": rid, "object": chunk_obj, "created": int(time.time()),
                                        "model": model_name,
                                        "choices": [choice(text, None, True, payload[1], reasoning)]})
                    elif what == "error":
                        yield _sse({"error": {"message": payload, "type": "server_error"}})
                        break
                    else:
                        if split is not None:  # what was held back, as it stands
                            reasoning, text = split.finish()
                            if text or reasoning:
                                yield _sse({"id": rid, "object": chunk_obj, "created": int(time.time()),
                                            "model": model_name, "choices": [choice(text, None, True, [], reasoning)]})
                        yield _sse({"id": rid, "object": chunk_obj, "created": int(time.time()), "model": model_name,
                                    "choices": [choice(None if kind == "chat" else "", payload["finish_reason"], True,
                                                       [])],
                                    "usage": payload["usage"], "timings": payload["timings"]})
                        yield "data: [DONE]\n\n"
                        break
            finally:
                r.cancelled.set()  # a disconnect ends this generator: the slot is freed at the next step

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/tokenize")
    async def tokenize(http: HttpRequest):
        """llama-server's: {content, add_special, with_pieces} -> {tokens}: ids, or {id, piece} objects."""
        body = await body_of(http)
        content = body.get("content")
        if not isinstance(content, str):
            raise BadRequest(400, "'content' must be a string")
        ids = tokenizer.encode(content, add_bos=flag(body, "add_special"))
        if flag(body, "with_pieces"):
            return {"tokens": [{"id": i, "piece": tokenizer.decode([i])} for i in ids]}
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(http: HttpRequest):
        """llama-server's: {tokens} -> {content}."""
        body = await body_of(http)
        ids = body.get("tokens")
        n_vocab = tokenizer.n_vocab
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise BadRequest(400, "'tokens' must be a list of token ids")
        bad = [i for i in ids if not 0 <= i < n_vocab]
        if bad:
            raise BadRequest(400, f"token ids {bad[:8]} are outside the vocabulary (0..{n_vocab - 1})")
        return {"content": tokenizer.decode(ids)}

    def chat_prompt(body: dict) -> str:
        """The request's `messages` rendered by the chat template (a 400 for malformed ones)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise BadRequest(400, "'messages' must be a non-empty list of {role, content} objects with string content")
        try:
            return render_chat(template, messages, bos, eos)
        except TemplateError as e:
            raise BadRequest(400, str(e)) from None

    @app.post("/apply-template")
    async def apply_template(http: HttpRequest):
        """llama-server's: {messages} -> {prompt}, the text a chat request would prefill, generating nothing."""
        return {"prompt": chat_prompt(await body_of(http))}

    @app.get("/props")
    async def props():
        """llama-server's: what a client reads to set itself up."""
        return {"model_alias": model_name, "total_slots": len(scheduler.slots), "chat_template": template,
                "bos_token": bos, "eos_token": eos, "build_info": "ferry",
                "default_generation_settings": {"n_ctx": scheduler.seq_len, "params": {**DEFAULTS, "n_predict": -1}}}

    @app.get("/slots")
    async def slots():
        """llama-server's: each slot, its context and whether it is generating now."""
        return [{"id": i, "n_ctx": scheduler.seq_len, "is_processing": r is not None}
                for i, r in enumerate(scheduler.slots)]

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        body = await body_of(http)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise BadRequest(400, "'prompt' must be a string")
        logprobs = number(body, "logprobs", None, int, low=0, high=5)  # OpenAI's: the alternatives per token, 0-5
        logprobs = -1 if logprobs is None else logprobs
        return await respond(body, make_request(body, tokenizer.encode(prompt), 16, logprobs), "text")

    @app.post("/v1/chat/completions")
    async def chat(http: HttpRequest):
        body = await body_of(http)
        text = chat_prompt(body)
        split = splitter(body, text)
        top = number(body, "top_logprobs", None, int, low=0, high=20)
        if top is not None and not flag(body, "logprobs"):
            raise BadRequest(400, "'top_logprobs' needs 'logprobs': true")
        logprobs = (top or 0) if flag(body, "logprobs") else -1
        return await respond(body, make_request(body, tokenizer.encode_chat(text), -1, logprobs), "chat", split)

    def completion_prompt(body: dict) -> list[int]:
        """llama-server's /completion prompt: a string, or a list of token ids and strings (a string first gets the
        BOS the model adds)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt or not all(
                isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool)) for p in prompt):
            raise BadRequest(400, "'prompt' must be a string or a list of token ids and strings (one prompt per "
                                  "request)")
        ids: list[int] = []
        for i, p in enumerate(prompt):
            ids += tokenizer.encode(p, add_bos=None if i == 0 else False) if isinstance(p, str) else [p]
        bad = [i for i in ids if not 0 <= i < tokenizer.n_vocab]
        if bad:
            raise BadRequest(400, f"token ids {bad[:8]} are outside the vocabulary (0..{tokenizer.n_vocab - 1})")
        if not ids:
            raise BadRequest(400, "the prompt is empty")
        return ids

    @app.post("/completion")
    async def completion(http: HttpRequest):
        """llama-server's own completion endpoint: {prompt, n_predict, n_probs, stream, return_tokens, sampling, stop,
        cache_prompt} -> {content, tokens, stop, stop_type, stopping_word, tokens_predicted, tokens_evaluated,
        tokens_cached, truncated, timings, completion_probabilities}; streamed as SSE chunks of {content, tokens,
        stop} with the totals in the last."""
        body = await body_of(http)
        prompt = completion_prompt(body)
        n_probs = number(body, "n_probs", 0, int, low=0, high=100)
        key = "n_predict" if "n_predict" in body else "max_tokens"
        r = make_request(body, prompt, -1, n_probs if n_probs > 0 else -1, key)
        want_tokens = flag(body, "return_tokens")

        def probs(records: list[dict]) -> list[dict]:
            return [{"id": rec["id"], **piece(rec["id"]), "logprob": rec["logprob"],
                     "top_logprobs": [{"id": i, **piece(i), "logprob": v} for i, v in rec.get("top", [])]}
                    for rec in records]

        def final(payload: dict, content: str, records: list[dict], streamed: bool) -> dict:
            out = {"content": content, "tokens": [rec["id"] for rec in records] if want_tokens and not streamed else [],
                   "id_slot": r.slot, "stop": True, "model": model_name, "tokens_predicted":
                   payload["usage"]["completion_tokens"], "tokens_evaluated": len(prompt),
                   "tokens_cached": payload["timings"]["cache_n"], "generation_settings": {
                       "n_ctx": scheduler.seq_len, "n_predict": r.max_tokens, "temperature": r.params.temp,
                       "top_k": r.params.top_k, "top_p": r.params.top_p, "min_p": r.params.min_p,
                       "seed": r.params.seed, "stop": r.stop, "n_probs": n_probs, "cache_prompt": r.cache_prompt},
                   "prompt": tokenizer.decode(prompt), "stop_type": payload["stop_type"],
                   "stopping_word": payload["stopping_word"], "truncated": payload["truncated"],
                   "timings": payload["timings"]}
            if n_probs and not streamed:
                out["completion_probabilities"] = probs(records)
            return out

        scheduler.submit(r)
        if not body.get("stream"):
            text, records, payload = await whole(r)
            return final(payload, text, records, False)

        async def events():
            try:
                while True:
                    what, payload = await r.out.get()
                    if what == "text":
                        chunk = {"content": payload[0], "tokens": [rec["id"] for rec in payload[1]], "stop": False}
                        if n_probs:
                            chunk["completion_probabilities"] = probs(payload[1])
                        yield _sse(chunk)
                    elif what == "error":
                        yield _sse({"error": {"message": payload, "type": "server_error"}})
                        break
                    else:
                        yield _sse(final(payload, "", [], True))
                        break
            finally:
                r.cancelled.set()

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


class Loading:
    """The server while its model loads: an ASGI app that answers every request 503 "Loading model" (llama-server's
    /health does so) until `app` is set to the loaded one, which then answers everything."""

    def __init__(self):
        self.app = None

    async def __call__(self, scope, receive, send):
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] == "http":
            await _error(503, "Loading model", "unavailable_error", "loading")(scope, receive, send)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
