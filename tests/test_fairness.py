"""The fairness bar (issue 53): while one client's request is the heaviest the server's limits allow, an ordinary
request's time to first token stays within 2x of its unloaded value.

Time to first token is counted in engine steps (from the step after the request is added to the step that samples
its first token), so the test is deterministic; what a step costs on the GPU is measured in benchmarks/fairness.py.
The heaviest allowed request runs as many sequences as one request may (``--max-seqs-per-request``'s default,
``serving.request_limits.default_max_seqs_per_request``: half the engine's ``max_num_seqs``), each as long as the
context allows: long prompts (prefill work) or long outputs (seats held). The ordinary request (16 prompt tokens, one
output token) arrives one step after it.

What keeps the bar (``paged_jax.core.scheduler``): the seats the default leaves free, and long prefills that take
the budget after short prompts, one long prompt partway through its prefill at a time.
"""

from __future__ import annotations

import json

import pytest

from paged_jax.core.scheduler import Scheduler
from paged_jax.sampling_params import SamplingParams
from serving.request_limits import default_max_seqs_per_request
from tests.test_scheduler import make_request, make_scheduler, run_to_completion

MAX_MODEL_LEN = 512  # long_prefill_token_threshold's default: 4% of it, 20 tokens
ORDINARY_PROMPT = list(range(20, 36))
# (prompt tokens, output tokens) of each sequence of the heavy request: the whole context either way.
HEAVY_SHAPES = {"long prompts": (MAX_MODEL_LEN - 8, 7), "long outputs": (16, MAX_MODEL_LEN - 17)}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from models.testing import tiny_config
    from paged_jax.config import EngineArgs
    from paged_jax.engine.llm_engine import LLMEngine

    model_dir = tmp_path_factory.mktemp("tiny")
    (model_dir / "config.json").write_text(json.dumps(tiny_config("llama", max_position_embeddings=MAX_MODEL_LEN)))
    return LLMEngine(EngineArgs(model=str(model_dir), load_format="dummy", dtype="float32",
                                max_model_len=MAX_MODEL_LEN, max_num_seqs=4, max_num_batched_tokens=64, seed=0),
                     use_tqdm=False)


def _steps_to_first_token(engine, request_id: str) -> int:
    """Add the ordinary request, step until it has its first token; -> the steps taken. Then finish everything."""
    engine.add_request(request_id, ORDINARY_PROMPT, SamplingParams(max_tokens=1, ignore_eos=True))
    steps = 0
    while True:
        steps += 1
        outputs = engine.step()
        if any(output.request_id == request_id and output.outputs[0].token_ids for output in outputs):
            break
    while engine.has_unfinished_requests():
        engine.step()
    return steps


@pytest.mark.parametrize("shape", HEAVY_SHAPES)
def test_ordinary_ttft_within_2x_beside_the_heaviest_request(engine, shape):
    unloaded = _steps_to_first_token(engine, f"unloaded-{shape}")
    prompt_len, max_tokens = HEAVY_SHAPES[shape]
    num_seqs = default_max_seqs_per_request(engine)  # the most sequences one request may run by default
    for index in range(num_seqs):  # a batch of distinct prompts: no prefix shared, every prefill computed
        prompt = [3 + index] + [40 + position % 200 for position in range(prompt_len - 1)]
        engine.add_request(f"heavy-{shape}-{index}", prompt,
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    engine.step()
    loaded = _steps_to_first_token(engine, f"loaded-{shape}")
    assert loaded <= 2 * unloaded, (shape, unloaded, loaded)


def _rows(scheduler: Scheduler, runner) -> dict[str, int]:
    """Plan and run one step; -> its new tokens by request id."""
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner.step(out))
    return {row.request_id: row.num_new_tokens for row in out.scheduled_rows()}


def test_short_prompts_go_before_long_prefills_and_jump_queued_long_ones():
    scheduler, runner = make_scheduler(num_blocks=128, max_num_batched_tokens=16, max_model_len=128,
                                       long_prefill_token_threshold=8)
    scheduler.add_request(make_request("long-a", range(1, 41), max_tokens=2))  # 40 tokens: long, 3 steps
    assert _rows(scheduler, runner) == {"long-a": 16}
    scheduler.add_request(make_request("long-b", range(50, 90), max_tokens=2))
    scheduler.add_request(make_request("short", range(100, 106), max_tokens=2))  # 6 tokens: short
    # long-b would stay partway through its prefill beside long-a: the short prompt behind it goes first, and
    # long-a gets at most the threshold in the step that starts the short prompt.
    assert _rows(scheduler, runner) == {"short": 6, "long-a": 8}
    assert _rows(scheduler, runner) == {"short": 1, "long-a": 15}
    # long-a's last prompt token is no long prefill; long-b starts once long-a is past its prefill.
    assert _rows(scheduler, runner) == {"long-a": 1, "long-b": 15}
    run_to_completion(scheduler, runner)
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks


def test_long_prefills_keep_half_the_budget_beside_short_prompts():
    scheduler, runner = make_scheduler(num_blocks=128, max_num_batched_tokens=16, max_model_len=128,
                                       max_num_seqs=8, long_prefill_token_threshold=8)
    scheduler.add_request(make_request("long", range(1, 61), max_tokens=1))
    _rows(scheduler, runner)
    for index in range(3):
        scheduler.add_request(make_request(f"short-{index}", [index + 1] * 7, max_tokens=4))
    # 21 short tokens wait, but the long prefill keeps half the budget (here also the threshold's cap).
    assert _rows(scheduler, runner) == {"short-0": 7, "short-1": 1, "long": 8}


def test_threshold_off_keeps_running_first():
    scheduler, runner = make_scheduler(num_blocks=128, max_num_batched_tokens=16, max_model_len=128)
    scheduler.add_request(make_request("long", range(1, 41), max_tokens=2))
    _rows(scheduler, runner)
    scheduler.add_request(make_request("short", range(100, 106), max_tokens=2))
    assert _rows(scheduler, runner) == {"long": 16}


@pytest.mark.parametrize("limit", [1, 2])
def test_max_long_partial_prefills(limit):
    scheduler, runner = make_scheduler(num_blocks=128, max_num_batched_tokens=16, max_model_len=128,
                                       long_prefill_token_threshold=8, max_long_partial_prefills=limit)
    scheduler.add_request(make_request("long-a", range(1, 41), max_tokens=1))
    scheduler.add_request(make_request("long-b", range(50, 90), max_tokens=1))
    first = _rows(scheduler, runner)
    assert first == {"long-a": 16}  # the budget is gone: long-b waits either way
    second = _rows(scheduler, runner)
    assert second == ({"long-a": 16} if limit == 1 else {"long-b": 8, "long-a": 8})


def test_short_prompt_behind_whole_long_prompts_goes_first():
    """Long prompts that would each fit the step whole still wait for a short prompt queued behind them, and are
    capped at the threshold in the step that starts it."""
    scheduler, runner = make_scheduler(num_blocks=128, max_num_batched_tokens=32, max_model_len=128,
                                       long_prefill_token_threshold=8)
    for index in range(3):
        scheduler.add_request(make_request(f"long-{index}", [index + 1] * 12, max_tokens=1))
    scheduler.add_request(make_request("short", range(100, 106), max_tokens=1))
    assert _rows(scheduler, runner) == {"short": 6, "long-0": 8}
    assert _rows(scheduler, runner) == {"long-0": 4, "long-1": 12, "long-2": 12}


def test_a_long_prompt_with_a_cached_prefix_is_long_by_what_is_left():
    """A prompt over the threshold whose prefix is cached (a chat's next turn) has only its new tokens to compute:
    beside a long prompt partway through its prefill it starts at once, as a short prompt would, instead of waiting
    for the partial prefill to end."""
    scheduler, runner = make_scheduler(num_blocks=128, max_num_batched_tokens=16, max_model_len=128,
                                       long_prefill_token_threshold=8)
    turn = list(range(100, 132))  # 32 tokens: 8 blocks of 4, cached once it has run
    scheduler.add_request(make_request("turn-1", turn, max_tokens=1))
    run_to_completion(scheduler, runner)
    scheduler.add_request(make_request("long", range(1, 41), max_tokens=1))
    assert _rows(scheduler, runner) == {"long": 16}
    scheduler.add_request(make_request("turn-2", turn + [7, 7, 7, 7], max_tokens=1))  # 36 tokens, 32 of them cached
    assert _rows(scheduler, runner) == {"turn-2": 4, "long": 8}
    assert scheduler.kv.prefix_cache_hits == 32
    run_to_completion(scheduler, runner)
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks
