"""The core's column-wise outputs of a steady decode (``paged_jax.engine.core_outputs.TokenOnlyRows``) and the
output processor's direct ``RequestOutput`` of a running token-id request (``paged_jax.outputs.running_token_delta``)."""

from paged_jax.core.request import Request, RequestStatus
from paged_jax.engine.core_outputs import TokenOnlyRows
from paged_jax.engine.messages import EngineCoreOutput
from paged_jax.outputs import CompletionOutput, RequestOutput, running_token_delta


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
    assert rows.outputs(list(requests), [4, 5, 6]) == [EngineCoreOutput("a", 0, [4]), EngineCoreOutput("a", 1, [5]),
                                                        EngineCoreOutput("b", 0, [6])]
    assert rows.outputs(requests[:2], [4, 5]) is None  # other rows
    assert rows.outputs([requests[1], requests[0], requests[2]], [4, 5, 6]) is None  # another order
    assert rows.outputs(requests[:2] + [_running("b")], [4, 5, 6]) is None  # another request of the same id
    requests[2].status = RequestStatus.FINISHED_LENGTH  # its output must carry the finish
    assert rows.outputs(requests, [4, 5, 6]) is None
    requests[2].status = RequestStatus.RUNNING
    rows.forget()
    assert rows.outputs(requests, [4, 5, 6]) is None


def test_running_token_delta_equals_the_dataclass_constructor():
    prompt = [1, 2, 3]
    built = running_token_delta("r", "text", prompt, [7, 8], 16)
    expected = RequestOutput("r", "text", prompt, [CompletionOutput(0, "", [7, 8], None, None)], False, 16)
    assert built == expected
    assert vars(built) == vars(expected) and vars(built.outputs[0]) == vars(expected.outputs[0])
