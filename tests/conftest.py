"""Shared pytest setup. JAX runs on CPU with 8 virtual devices (for sharding tests); set before jax is imported."""

import contextlib
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# transformers references run on torch: one intra-op thread each (xdist runs a worker per core; torch's OpenMP threads
# spin-waiting on an oversubscribed CPU make it several times slower than one thread). Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Engines here compile every step executable before serving, so no test's steps depend on how far background
# compilation has got (tests/test_background_compile.py and test_first_minutes.py turn it on explicitly).
os.environ.setdefault("PAGED_JAX_BACKGROUND_COMPILATION", "0")

import pytest  # noqa: E402

# The files whose tests take longest on CI's two cores, longest first. `--dist loadfile` hands whole files to the
# workers, most tests first (pytest-xdist's loadscope reorder), in collection order among files of equal counts: one
# of these collected last (alphabetically, the speculative-decoding files) could run alone at the end while the
# other worker idles.
LONGEST_FILES = ("test_engine.py", "test_spec_decode_models.py", "test_spec_decode.py", "test_moe.py",
                 "test_benchmarks.py", "test_quantization.py", "test_quantized_kernels.py",
                 "test_structured_outputs.py", "test_routed_experts.py", "test_docs_examples.py")


def pytest_collection_modifyitems(config, items):
    """Collect ``LONGEST_FILES`` first (in that order); every other file keeps its place after them."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session")
def smollm2_dir():
    """Directory of the locally built SmolLM2-135M-Instruct fp32 HF checkpoint (built once, then cached)."""
    from models.smollm2 import ensure_smollm2

    return ensure_smollm2()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    """The SmolLM2 HF tokenizer (with its chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="session")
def hf_smollm2_model(smollm2_dir):
    """transformers fp32 SmolLM2 model in eval mode, shared by all test files."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    model.eval()
    return model


@contextlib.contextmanager
def _one_torch_thread():
    """Run torch with one intra-op thread: on a shared, oversubscribed CPU, OpenMP threads spin-waiting on each other
    make torch several times slower than a single thread."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.set_num_threads(threads)


# Prompts per batched transformers generate (``hf_greedy.many``): a decode step of one row reads every weight from
# memory for one token; eight rows share that read. Prompts are grouped by length, so little of a batch is padding.
HF_GREEDY_BATCH = 8


@pytest.fixture(scope="session")
def hf_greedy(hf_smollm2_model):
    """``hf_greedy(prompt_ids, max_new_tokens, repetition_penalty=1.0) -> list[int]``: transformers fp32 greedy
    continuation of one prompt (stops after EOS id 2, which is included), memoized for the session so engine and LLM
    tests share it. ``hf_greedy.many(prompts, max_new_tokens)``: the same for many prompts (no repetition penalty: it
    would count the padding), generated in left-padded batches of prompts of similar lengths (transformers' batched
    generate, attention mask and positions from the padding; on CPU several times faster than one prompt at a
    time)."""
    import torch

    cache = {}

    def run(prompt_ids, max_new_tokens, repetition_penalty=1.0):
        key = (tuple(prompt_ids), max_new_tokens, repetition_penalty)
        if key not in cache:
            with _one_torch_thread():
                out = hf_smollm2_model.generate(
                    torch.tensor([list(prompt_ids)]), max_new_tokens=max_new_tokens, do_sample=False,
                    num_beams=1, eos_token_id=2, pad_token_id=2, repetition_penalty=repetition_penalty)
            cache[key] = out[0, len(prompt_ids):].tolist()
        return cache[key]

    def many(prompts, max_new_tokens):
        keys = [(tuple(prompt_ids), max_new_tokens, 1.0) for prompt_ids in prompts]
        todo = sorted({key for key in keys if key not in cache}, key=lambda key: (len(key[0]), key[0]))
        for start in range(0, len(todo), HF_GREEDY_BATCH):
            group = todo[start:start + HF_GREEDY_BATCH]
            width = max(len(key[0]) for key in group)
            ids = torch.tensor([[2] * (width - len(key[0])) + list(key[0]) for key in group])
            mask = torch.tensor([[0] * (width - len(key[0])) + [1] * len(key[0]) for key in group])
            with _one_torch_thread():
                out = hf_smollm2_model.generate(
                    ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                    eos_token_id=2, pad_token_id=2)
            for key, row in zip(group, out[:, width:].tolist()):
                # A row that ended is padded with the pad id 2 (EOS): cut after its first EOS, as generate stops.
                cache[key] = row[:row.index(2) + 1] if 2 in row else row
        return [cache[key] for key in keys]

    run.many = many
    return run


@pytest.fixture(scope="session")
def hf_logits(hf_smollm2_model):
    """``hf_logits(token_ids) -> float32 numpy [len(token_ids), vocab]``: transformers fp32 logits of one sequence."""
    import torch

    def run(token_ids):
        with _one_torch_thread():
            return hf_smollm2_model(torch.tensor([list(token_ids)])).logits[0].float().numpy()

    return run


@pytest.fixture(scope="session")
def serving_engine(smollm2_dir):
    """One real LLMEngine (SmolLM2 fp32 on CPU, small settings) shared by the serving test files.

    Settings the serving tests rely on: max_model_len 256, 4 sequences per step. Each test file wraps it in its own
    app (and engine thread) and shuts that thread down before the next file starts.
    """
    from paged_jax.config import EngineArgs
    from paged_jax.engine.llm_engine import LLMEngine

    return LLMEngine(EngineArgs(model=str(smollm2_dir), dtype="float32", max_model_len=256, max_num_seqs=4,
                                max_num_batched_tokens=64, num_gpu_blocks_override=80, seed=0), use_tqdm=False)
