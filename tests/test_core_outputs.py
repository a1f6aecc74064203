"""The core's column-wise outputs of a steady decode (``paged_jax.engine.core_outputs.TokenOnlyRows``)."""

import numpy as np
import pytest

from models.testing import save_random_hf_checkpoint, tiny_config
from paged_jax.config import EngineArgs
from paged_jax.core.request import Request, RequestStatus
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.core_outputs import TokenOnlyRows
from paged_jax.engine.messages import DecodeTokens, EngineCoreOutput
from paged_jax.sampling_params import SamplingParams


def _running(request_id: str) -> Request:
    request = Request(request_id=request_id, prompt_token_ids=[1, 2, 3])
    request.status = RequestStatus.RUNNING
    return request


def test_token_only_rows_serve_only_the_remembered_running_requests():
    requests = [_running("a::0"), _running("a::1"), _running("b")]
    rows = TokenOnlyRows()
    assert rows.outputs(requests, [4, 5, 6]) is None  # nothing remembered yet
    rows.remember(requests, [EngineCoreOutput("a", 0, [1]), EngineCoreOutput("a", 1, [2]),
                             EngineCoreOutput("b", 0, [3])])
    columns = rows.outputs(list(requests), [4, 5, 6])
    assert columns == DecodeTokens(["a", "a", "b"], [0, 1, 0], [4, 5, 6])
    assert columns.expand() == [EngineCoreOutput("a", 0, [4]), EngineCoreOutput("a", 1, [5]),
                                EngineCoreOutput("b", 0, [6])]
    assert rows.outputs(requests[:2], [4, 5]) is None  # other rows
    assert rows.outputs([requests[1], requests[0], requests[2]], [4, 5, 6]) is None  # another order
    assert rows.outputs(requests[:2] + [_running("b")], [4, 5, 6]) is None  # another request of the same id
    assert rows.outputs(requests, [4, 5, 6], running=list(requests)) == columns  # all in the running list
    requests[2].status = RequestStatus.FINISHED_LENGTH  # its output must carry the finish
    assert rows.outputs(requests, [4, 5, 6]) is None
    assert rows.outputs(requests, [4, 5, 6], running=requests[:2]) is None  # (it left the running list)
    requests[2].status = RequestStatus.RUNNING
    rows.forget()
    assert rows.outputs(requests, [4, 5, 6]) is None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_random_hf_checkpoint(tiny_config("llama", vocab_size=128, bos_token_id=0, eos_token_id=1),
                                     tmp_path_factory.mktemp("tiny") / "ckpt", seed=2)


def _trace(checkpoint, column_wise: bool, monkeypatch) -> tuple[list, int, float]:
    """Every step's outputs of a workload with stop tokens, EOS, mixed lengths, an abort mid-decode and a pool
    small enough to preempt: (trace, steps the column-wise rows answered, preemptions)."""
    answered = []
    with monkeypatch.context() as patch:
        general = TokenOnlyRows.outputs

        def outputs(self, requests, tokens, running=()):
            found = general(self, requests, tokens, running) if column_wise else None
            answered.append(found is not None)
            return found

        patch.setattr(TokenOnlyRows, "outputs", outputs)
        engine = LLMEngine(EngineArgs(model=str(checkpoint), max_model_len=64, max_num_seqs=8,
                                      max_num_batched_tokens=64, num_gpu_blocks_override=12,
                                      background_compilation=False), use_tqdm=False)
        rng = np.random.default_rng(3)
        for i in range(12):
            params = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(20, 45)), ignore_eos=bool(i % 2),
                                    stop_token_ids=[7] if i % 3 == 0 else None)
            engine.add_request(f"q{i}", rng.integers(2, 128, size=int(rng.integers(3, 20))).tolist(), params)
        trace, step = [], 0
        while engine.has_unfinished_requests():
            if step == 8:
                engine.abort_request("q1")
            trace.append([(out.request_id, list(out.outputs[0].token_ids), out.finished, out.outputs[0].finish_reason)
                          for out in engine.step()])
            step += 1
        preemptions = engine.stats()["num_preemptions"]
        engine.close()
    return trace, sum(answered), preemptions


def test_column_wise_outputs_equal_the_general_path(checkpoint, monkeypatch):
    want, answered, _ = _trace(checkpoint, False, monkeypatch)
    assert answered == 0
    got, answered, preemptions = _trace(checkpoint, True, monkeypatch)
    assert got == want
    assert answered > 0 and preemptions > 0  # the path ran, beside preemption
