"""``paged-jax run-batch -i INPUT.jsonl -o OUTPUT.jsonl [engine flags]``: vLLM's ``vllm run-batch``, OpenAI's batch
file format run offline.

Each input line is ``{"custom_id", "method": "POST", "url", "body"}`` with ``url`` one of ``BATCH_URLS``; its body
goes to the server's own route in process (``httpx.ASGITransport`` over ``serving.app.create_app``: the same
validation, engine admission and wire format as ``paged-jax serve``), every line at once, so the engine batches them.
Each output line is ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``, in input
order: ``body`` the route's JSON answer, or ``error`` OpenAI's error object (``body`` null) for a refused request. A
line that is not such a request is answered the same way with a 400, naming the field. A progress bar over the
lines answered goes to stderr (vLLM's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

import httpx
from tqdm import tqdm

from paged_jax.entrypoints.cli import add_engine_args, engine_kwargs, normalize_flag_spelling
from serving.protocol import random_uuid

logger = logging.getLogger(__name__)

# vLLM's batch endpoints (a generative model serves the first two, a pooling model the others).
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score", "/v1/rerank")


def build_run_batch_parser(prog: str = "paged-jax run-batch") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Run an OpenAI batch file (JSONL) offline.")
    parser.add_argument("-i", "--input-file", required=True, help="the batch requests, one JSON object per line")
    parser.add_argument("-o", "--output-file", required=True, help="where the answers go, one JSON line each")
    add_engine_args(parser.add_argument_group("engine (EngineArgs, vLLM names)"))
    return parser


def _error_line(custom_id: Any, status: int, message: str, param: str | None) -> dict:
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": status}
    return {"id": f"batch-{random_uuid()}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"batch-{random_uuid()}", "body": None},
            "error": error}


def _parse_line(line: str) -> tuple[dict | None, dict | None]:
    """``(the request, None)`` of an input line, or ``(None, its error line)`` when it is not one."""
    try:
        request = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, _error_line(None, 400, f"body: invalid JSON ({exc})", "body")
    if not isinstance(request, dict):
        return None, _error_line(None, 400, "body: a batch line is a JSON object", "body")
    custom_id = request.get("custom_id")
    if request.get("method", "POST") != "POST":
        return None, _error_line(custom_id, 400, "method: batch requests are POST", "method")
    if request.get("url") not in BATCH_URLS:
        return None, _error_line(custom_id, 400, f"url: {request.get('url')!r} is not one of "
                                                 f"{', '.join(BATCH_URLS)}", "url")
    body = request.get("body")
    if not isinstance(body, dict):
        return None, _error_line(custom_id, 400, "body: must be a JSON object", "body")
    if body.get("stream"):
        return None, _error_line(custom_id, 400, "stream: a batch request is answered whole", "stream")
    return request, None


async def _answer(client: httpx.AsyncClient, line: str) -> dict:
    request, error = _parse_line(line)
    if error is not None:
        return error
    custom_id = request.get("custom_id")
    response = await client.post(request["url"], json=request["body"])
    body = response.json()
    request_id = f"batch-{random_uuid()}"
    if response.status_code != 200:
        return {"id": f"batch-{random_uuid()}", "custom_id": custom_id,
                "response": {"status_code": response.status_code, "request_id": request_id, "body": None},
                "error": body.get("error")}
    return {"id": f"batch-{random_uuid()}", "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}


async def run_batch(app, lines: Sequence[str], progress: bool = True) -> list[dict]:
    """Answer every batch line (non-empty) through ``app``'s routes, all at once; the output lines in input order.
    ``progress``: a progress bar on stderr over the lines answered (vLLM's "Running batch" bar)."""
    requests = [line for line in lines if line.strip()]
    transport = httpx.ASGITransport(app=app)
    with tqdm(total=len(requests), desc="Running batch", unit="req", file=sys.stderr, disable=not progress) as bar:

        async def answer(client: httpx.AsyncClient, line: str) -> dict:
            output = await _answer(client, line)
            bar.update(1)
            return output

        async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None) as client:
            return list(await asyncio.gather(*(answer(client, line) for line in requests)))


def run_batch_main(argv: Sequence[str] | None = None, prog: str = "paged-jax run-batch") -> int:
    """``paged-jax run-batch``: the exit status (0 once the output file is written, 2 for bad flags)."""
    from paged_jax.config import EngineArgs
    from paged_jax.engine.llm_engine import LLMEngine
    from serving.app import create_app

    parser = build_run_batch_parser(prog)
    args = parser.parse_args(normalize_flag_spelling(list(sys.argv[1:] if argv is None else argv)))
    logging.basicConfig(level=logging.INFO)
    try:
        with open(args.input_file) as f:
            lines = f.read().splitlines()
        engine_args = EngineArgs(**engine_kwargs(args))
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    app = create_app(LLMEngine(engine_args), served_model_name=engine_args.served_model_names or None)
    try:
        outputs = asyncio.run(run_batch(app, lines))
    finally:
        app.state.server.engine.shutdown()
    with open(args.output_file, "w") as f:
        f.writelines(json.dumps(output) + "\n" for output in outputs)
    logger.info("run-batch: %d requests answered into %s", len(outputs), args.output_file)
    return 0
