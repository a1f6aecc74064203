"""Limits that keep one request from stalling the server: the request body size (``--max-request-body-size``,
413 before the body is read), the prompt text length before tokenization (``max_prompt_chars``), and how many
sequences a request may ask for (``check_num_seqs``: ``--max-waiting-requests``, ``--max-seqs-per-request``).

Each limit answers OpenAI's error body (``serving.errors``) naming what is too large.
"""

from __future__ import annotations

from typing import Any

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


def check_num_seqs(num_seqs: int, *, num_prompts: int, n: int, max_waiting_requests: int | None,
                   max_seqs_per_request: int | None) -> None:
    """Refuse (400 naming ``n``) a request whose sequences (prompts x n) could never be admitted, instead of an
    endless 503: more than the waiting queue holds at once, or more than a request's share."""
    what = f"this request asks for {num_seqs} sequences ({num_prompts} prompt(s) x n={n})"
    if max_seqs_per_request is not None and num_seqs > max_seqs_per_request:
        raise APIError(400, f"n: {what}, more than the {max_seqs_per_request} one request may have "
                            f"(--max-seqs-per-request)", param="n")
    if max_waiting_requests is not None and num_seqs > max_waiting_requests:
        raise APIError(400, f"n: {what}, more than the {max_waiting_requests} the server queues at once "
                            f"(--max-waiting-requests), so it could never be admitted; send fewer", param="n")
