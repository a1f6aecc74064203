"""The offline ``LLM`` API on SmolLM2: input forms, input order, chat template, validation, the CLI."""

import gc

import pytest

from paged_jax.entrypoints.chat import ChatTemplateError, chat_prompt_token_ids, normalize_message, render_chat
from paged_jax.entrypoints.llm import LLM
from paged_jax.sampling_params import SamplingParams
from serving.commands import main as cli_main  # the paged-jax console script

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def llm():
    # Same shapes as tests/test_engine.py's roomy engine, so the persistent compilation cache serves them.
    return LLM(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=128, num_gpu_blocks_override=400,
               use_tqdm=False)


def assert_idle(llm):
    engine = llm.llm_engine
    kv = engine.engine_core.kv_cache_manager
    assert not engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert engine.engine_core.runner.num_compiles_since_warmup == 0


def test_generate_accepts_every_prompt_form_in_input_order(llm, smollm2_tokenizer, hf_greedy):
    texts = ["The capital of France is", "Once upon a time, there was a", "1, 2, 3, 4,"]
    ids = [smollm2_tokenizer.encode(t) for t in texts]
    # Longest first, so completion order differs from input order.
    prompts = [texts[1], ids[0], {"prompt_token_ids": ids[2]}, {"prompt": texts[0]}]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outputs] == [texts[1], None, None, texts[0]]
    assert [o.prompt_token_ids for o in outputs] == [ids[1], ids[0], ids[2], ids[0]]
    for out in outputs:
        assert out.finished
        assert out.outputs[0].token_ids == hf_greedy(out.prompt_token_ids, MAX_NEW)
    single = llm.generate(texts[2], GREEDY, use_tqdm=True)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outputs[2].outputs[0].token_ids
    assert_idle(llm)


def test_per_prompt_sampling_params(llm):
    outs = llm.generate(["Hello", "Hello"], [SamplingParams(temperature=0.0, max_tokens=3),
                                             SamplingParams(temperature=0.0, max_tokens=7)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7]
    assert outs[1].outputs[0].token_ids[:3] == outs[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)
    assert_idle(llm)


def test_generate_steps_with_the_start_heap_frozen(llm, monkeypatch):
    """A generation's steps run with the heap alive at its start frozen (full collections skip it), put back
    afterwards; a heap the caller froze stays frozen."""
    gc.unfreeze()  # (whatever an earlier test froze: only collection times change)
    engine, counts = llm.llm_engine, []
    step = engine.step

    def counting_step(**kwargs):
        counts.append(gc.get_freeze_count())
        return step(**kwargs)

    monkeypatch.setattr(engine, "step", counting_step)
    llm.generate("Hello", GREEDY, use_tqdm=False)
    assert counts and min(counts) > 0 and gc.get_freeze_count() == 0
    gc.freeze()
    try:
        llm.generate("Hello", GREEDY, use_tqdm=False)
        assert gc.get_freeze_count() > 0  # (frozen objects freed meanwhile leave the count)
    finally:
        gc.unfreeze()


def test_chat_applies_template(llm, smollm2_tokenizer, hf_greedy):
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}],
    ]
    outputs = llm.chat(conversations, GREEDY, use_tqdm=False)
    for conversation, out in zip(conversations, outputs):
        prompt_ids = chat_prompt_token_ids(smollm2_tokenizer, conversation)
        assert out.prompt_token_ids == prompt_ids
        assert out.outputs[0].token_ids == hf_greedy(prompt_ids, MAX_NEW)
        assert prompt_ids[-1] != smollm2_tokenizer.eos_token_id  # ends with the assistant header
    one = llm.chat(conversations[0], GREEDY, use_tqdm=False)
    assert one[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    assert llm.get_tokenizer() is llm.llm_engine.tokenizer
    assert_idle(llm)


def test_chat_rendering_normalizes_openai_messages(smollm2_tokenizer):
    """One chat renderer for LLM.chat and the server: OpenAI's text parts, null content and developer role become
    what HF templates know; the tokenizer's own template does the rest."""
    assert normalize_message({"role": "developer", "content": [{"type": "text", "text": "a"},
                                                               {"type": "text", "text": "b"}], "name": None}) == \
        {"role": "system", "content": "a\nb"}
    assert normalize_message({"role": "assistant", "content": None, "name": "bot"}) == \
        {"role": "assistant", "content": "", "name": "bot"}
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    openai_style = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                    {"role": "user", "content": "Hi"}]
    want = smollm2_tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    assert render_chat(smollm2_tokenizer, openai_style) == want
    assert chat_prompt_token_ids(smollm2_tokenizer, openai_style) == \
        smollm2_tokenizer.encode(want, add_special_tokens=False)

    class RejectingTokenizer:
        def apply_chat_template(self, *args, **kwargs):
            raise TypeError("roles must alternate")

    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat(RejectingTokenizer(), plain)


def test_bad_prompt_leaves_nothing_queued(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["fine", [1, 2, 10**9]], GREEDY, use_tqdm=False)
    assert_idle(llm)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[5] * 300], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="not_an_arg"):
        LLM(not_an_arg=1)
    assert llm.generate("still fine", SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0].finished
    assert_idle(llm)


def test_cli_generate(capsys):
    code = cli_main(["generate", "--prompt", "The capital of France is", "--max-tokens", "4",
                     "--max-model-len", "256", "--max-num-seqs", "16", "--max-num-batched-tokens", "128",
                     "--num-gpu-blocks-override", "400"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "The capital of France is" in printed and "(length)" in printed
    assert cli_main(["frobnicate"]) == 2


def test_cli_serve_dispatches_to_serving(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["serve", "--help"])
    assert exit_info.value.code == 0
    assert "paged-jax serve" in capsys.readouterr().out


def test_serve_and_generate_share_the_engine_flags():
    """Both commands take every EngineArgs field as a flag (one builder, paged_jax.entrypoints.cli.add_engine_args), and the
    engine package never imports the server."""
    import ast
    import dataclasses
    import pathlib

    import paged_jax
    from paged_jax.entrypoints.cli import build_generate_parser
    from paged_jax.config import EngineArgs
    from serving.cli import build_parser
    from serving.settings import engine_args_from_namespace

    def engine_flags(parser):
        return {flag for action in parser._actions if action.dest in {f.name for f in dataclasses.fields(EngineArgs)}
                for flag in action.option_strings}

    assert engine_flags(build_parser()) == engine_flags(build_generate_parser())
    args = build_parser().parse_args(["/ckpt", "-tp", "2", "--no-enable-prefix-caching", "--attention-impl",
                                      "reference", "--served-model-name", "m"])
    assert engine_args_from_namespace(args) == EngineArgs(model="/ckpt", tensor_parallel_size=2,
                                                          enable_prefix_caching=False, attention_impl="reference",
                                                          served_model_name=["m"])
    for path in pathlib.Path(paged_jax.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(name.split(".")[0] == "serving" for name in names), path


def test_default_sampling_params_come_from_the_generation_config(llm, monkeypatch):
    """vLLM's get_default_sampling_params: SamplingParams() plus the generation config's sampling fields (SmolLM2's
    has none); generate / chat without sampling_params use them."""
    assert llm.get_default_sampling_params() == SamplingParams()
    monkeypatch.setattr(llm, "_sampling_defaults", {"temperature": 0.0, "max_tokens": 5})
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
    (default,) = llm.generate("The capital of France is", use_tqdm=False)
    (greedy,) = llm.generate("The capital of France is", GREEDY, use_tqdm=False)
    assert default.outputs[0].token_ids == greedy.outputs[0].token_ids[:5]
    (chat,) = llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)
    assert len(chat.outputs[0].token_ids) <= 5
    assert_idle(llm)
