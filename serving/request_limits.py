"""Limits that keep one request from stalling the server: the request body size (``--max-request-body-size``,
413 before the body is read), the prompt text length before tokenization (``max_prompt_chars``), the size of the
fields rendered into the prompt or compiled into a grammar (``check_field_sizes``), and how many
sequences a request may run (``check_num_seqs``: every sequence of every prompt, n, best_of or the beam width,
counts against ``--max-seqs-per-request``, by default half the engine's ``max_num_seqs``, and ``--max-waiting-requests``).

Each limit answers OpenAI's error body (``serving.errors``) naming what is too large.
"""

from __future__ import annotations

import json
from typing import Any

from paged_jax.sampling_params import num_sequences
from serving.errors import APIError

# Default of --max-request-body-size: far above any body of a prompt that fits a context (a 128k-token prompt is
# about 1 MB of JSON as token ids), far below what would take the event loop seconds to parse.
DEFAULT_MAX_REQUEST_BODY_SIZE = 32 * 1024 * 1024


class _BodyTooLarge(Exception):
    pass


class BodySizeLimitMiddleware:
    """Pure ASGI middleware: a request body over ``max_bytes`` is answered 413 (OpenAI's error body). A declared
    ``Content-Length`` over the limit is refused before any of the body is read; a chunked body is counted as it
    arrives and refused once it passes the limit (whatever the app would have answered is dropped).

    Not FastAPI's ``max_body_size``: for a declared ``Content-Length`` over the limit (what clients send) that one
    replaces every answer, ours included, by a plain-text "Content Too Large", not OpenAI's error body."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_request_body_size must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    def _error(self) -> APIError:
        return APIError(413, f"body: the request body is larger than {self.max_bytes} bytes "
                             f"(--max-request-body-size)", param="body")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_bytes:
            await self._error().response()(scope, receive, send)
            return
        received = 0
        too_large = False
        response_started = False

        async def counting_receive():
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = True
                    raise _BodyTooLarge()
            return message

        async def guarded_send(message):
            nonlocal response_started
            if too_large:
                return  # the app's answer to a cut-off body; the 413 goes out instead
            response_started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except _BodyTooLarge:
            pass
        except Exception:
            if not too_large:
                raise
        if too_large and not response_started:
            await self._error().response()(scope, receive, send)


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int | None:
    """Most characters a prompt text of at most ``max_model_len`` tokens can have: no token stands for more
    characters than its vocabulary string has (byte-level vocabularies spell one byte per character, and a
    character is at least one byte), so a longer text is refused before it is tokenized. Tokenizers whose
    normalizer may shrink text (Unicode composition, whitespace clean-up) get 4x headroom. None without a tokenizer.
    """
    if tokenizer is None:
        return None
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary view: no pre-check
        return None
    longest = max((len(token) for token in vocab), default=0)
    if longest == 0:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    headroom = 1 if backend is not None and backend.normalizer is None else 4
    return max_model_len * longest * headroom


# Request fields whose text becomes part of the prompt (tools, documents, template variables) or a grammar the engine
# parses and compiles (the structured-output specs; a tool choice's schema comes from tools).
SIZED_FIELDS = ("tools", "documents", "chat_template_kwargs", "response_format", "structured_outputs", "guided_json",
                "guided_regex", "guided_choice", "guided_grammar", "structural_tag")


def check_field_sizes(body: Any, max_chars: int | None) -> None:
    """Refuse (400 naming the field) a ``SIZED_FIELDS`` value whose JSON text is longer than ``max_chars`` (the
    server's ``max_prompt_chars``: the longest text a prompt within the context can have), before it is rendered
    into the prompt or compiled into a grammar: such a value could never fit the context, and what it costs to
    render or compile grows with its size. None: no check (a model without a tokenizer serves neither)."""
    if max_chars is None:
        return
    for name in SIZED_FIELDS:
        value = getattr(body, name, None)
        if value is None:
            continue
        size = len(value) if isinstance(value, str) else len(json.dumps(value, ensure_ascii=False))
        if size > max_chars:
            raise APIError(400, f"{name}: {size} characters of JSON, more than the {max_chars} the longest prompt "
                                f"within this model's context can have", param=name)


def default_max_seqs_per_request(engine: Any) -> int | None:
    """``--max-seqs-per-request``'s default: half the engine's ``max_num_seqs`` (as resolved: its default depends on
    the platform; else as given in its ``EngineArgs``), at least 1, so the heaviest request one client may send
    leaves seats for everyone else's; None when ``max_num_seqs`` is not known."""
    resolved = getattr(engine, "max_num_seqs", None)
    max_num_seqs = int(resolved) if resolved else getattr(getattr(engine, "engine_args", None), "max_num_seqs", None)
    return max(1, max_num_seqs // 2) if max_num_seqs else None


def check_num_seqs(body: Any, num_prompts: int, *, max_waiting_requests: int | None,
                   max_seqs_per_request: int | None) -> None:
    """Refuse (400 naming the field that multiplied the work: ``best_of``, ``n`` or ``prompt``) a request whose
    sequences could never be admitted, before any of its prompts is tokenized: more than one request may run
    (``--max-seqs-per-request``, by default half the engine's ``max_num_seqs``) or more than the waiting queue holds at
    once. Each of the ``num_prompts`` prompts runs ``num_sequences(n, best_of)`` sequences (n choices, best_of
    candidates or a beam search's width n)."""
    per_prompt = num_sequences(body.n, getattr(body, "best_of", None))
    total = per_prompt * num_prompts
    if per_prompt > body.n:
        field, factor = "best_of", f"best_of={per_prompt}"
    else:
        field, factor = "n", f"beam width n={body.n}" if getattr(body, "use_beam_search", False) else f"n={body.n}"
    if per_prompt == 1 and num_prompts > 1:
        field = "prompt"
    what = f"this request asks for {total} sequences ({num_prompts} prompt(s) x {factor})"
    if max_seqs_per_request is not None and total > max_seqs_per_request:
        raise APIError(400, f"{field}: {what}, more than the {max_seqs_per_request} one request may run "
                            f"(--max-seqs-per-request; default: half the engine's --max-num-seqs)", param=field)
    if max_waiting_requests is not None and total > max_waiting_requests:
        raise APIError(400, f"{field}: {what}, more than the {max_waiting_requests} the server queues at once "
                            f"(--max-waiting-requests), so it could never be admitted; send fewer", param=field)
