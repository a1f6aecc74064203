"""The runner's persistent batch (InputBatch) and the step packing's sampling fast path, on the host alone: rows
made, updated by diffs and compacted on removal must hold exactly what a from-scratch rebuild would; the
precomputed sampling words must pack exactly as the general path packs them."""

import random

import numpy as np
import pytest

from paged_jax.worker import sampler as sampler_lib
from paged_jax.core.sched_output import CachedRequestData, NewRequestData
from paged_jax.sampling_params import SamplingParams
from paged_jax.worker.input_batch import InputBatch
from paged_jax.core.sched_output import PLACEHOLDER_TOKEN
from paged_jax.worker import step_packing
from paged_jax.worker.step_io import StepLayout
from paged_jax.worker.step_packing import StepRows, _pack_sampling, _pack_whole, pack_step

MAX_LEN, MAX_BLOCKS, VOCAB = 64, 8, 1000


def new_request(req_id, rng, **params):
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))]
    outputs = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 3))]
    blocks = [rng.randrange(1, 100) for _ in range(rng.randint(0, 4))]
    return NewRequestData(req_id=req_id, prompt_token_ids=prompt, output_token_ids=outputs,
                          params=SamplingParams(**params), seed=rng.randrange(1 << 40), block_ids=blocks,
                          num_computed_tokens=0, lora_int_id=rng.randrange(3), prompt_logprobs=rng.random() < 0.3)


def test_rows_follow_diffs_and_stay_dense_on_removal():
    rng = random.Random(1)
    batch = InputBatch(8, MAX_LEN, MAX_BLOCKS, eos_token_ids=[2], vocab_size=VOCAB)
    truth = {}  # req_id -> (tokens, blocks, lora, prompt_logprobs)
    for step in range(60):
        for req_id in rng.sample(sorted(truth), k=min(len(truth), rng.randint(0, 2))):
            batch.remove(req_id)
            del truth[req_id]
        while batch.num_rows < 8 and rng.random() < 0.5:
            new = new_request(f"r{step}-{batch.num_rows}", rng, temperature=rng.choice([0.0, 0.7]))
            batch.add(new)
            truth[new.req_id] = (new.prompt_token_ids + new.output_token_ids, list(new.block_ids),
                                 new.lora_int_id, new.prompt_logprobs)
        cached = CachedRequestData()
        column = rng.random() < 0.3  # a decode step's form: one token per row, as one column
        for req_id, (tokens, blocks, _, _) in truth.items():
            if rng.random() < 0.3 or (column and len(tokens) == MAX_LEN):
                continue
            new_tokens = [rng.randrange(VOCAB) for _ in range(1 if column else rng.choice([0, 1, 1, 3]))]
            if len(tokens) + len(new_tokens) > MAX_LEN:
                new_tokens = []
            start = rng.randint(0, len(blocks)) if rng.random() < 0.2 else len(blocks)  # a copy-on-write rewrite
            new_blocks = [rng.randrange(1, 100) for _ in range(rng.randint(0 if start == len(blocks) else 1, 2))]
            if start + len(new_blocks) > MAX_BLOCKS:
                start, new_blocks = len(blocks), []
            cached.req_ids.append(req_id)
            cached.new_token_ids.append(new_tokens)
            cached.new_block_ids.append(new_blocks)
            cached.block_starts.append(start)
            cached.num_computed_tokens.append(0)
            tokens += new_tokens
            if new_blocks:
                del blocks[start:]
                blocks += new_blocks
        if column:
            cached.decode_token_ids = [new_tokens for new_tokens, in cached.new_token_ids]
            cached.new_token_ids = []
        rows = batch.apply_cached(cached)
        assert [batch.req_ids[r] for r in rows] == cached.req_ids
        assert sorted(batch.req_ids) == sorted(truth) and len(batch.row_of) == batch.num_rows
        assert batch.num_prompt_logprob_rows == sum(wants for *_, wants in truth.values())
        for req_id, (tokens, blocks, lora, prompt_logprobs) in truth.items():
            row = batch.row_of[req_id]
            assert batch.req_ids[row] == req_id
            assert batch.token_ids[row, :batch.num_tokens[row]].tolist() == tokens
            assert batch.block_table[row, :batch.num_blocks[row]].tolist() == blocks
            assert (batch.lora_int_id[row], batch.prompt_logprobs[row]) == (lora, prompt_logprobs)


def test_bad_diffs_are_refused_by_name():
    rng = random.Random(2)
    batch = InputBatch(1, MAX_LEN, MAX_BLOCKS, eos_token_ids=[2], vocab_size=VOCAB)
    batch.add(new_request("a", rng))
    with pytest.raises(ValueError, match="'a' already has a row"):
        batch.add(new_request("a", rng))
    with pytest.raises(ValueError, match="batch is full"):
        batch.add(new_request("b", rng))
    with pytest.raises(ValueError, match="'ghost' is scheduled as running but has no row"):
        batch.apply_cached(CachedRequestData(["ghost"], [[1]], [[]], [0], [0]))
    with pytest.raises(ValueError, match="decode_token_ids has 2 entries for 1 running"):
        batch.apply_cached(CachedRequestData(["a"], [], [[]], [0], [0], decode_token_ids=[1, 2]))
    with pytest.raises(ValueError, match="block table of 9 blocks"):
        batch.apply_cached(CachedRequestData(["a"], [[]], [list(range(9))], [0], [0]))
    batch.remove("nobody")  # ids without a row are nothing to drop
    assert batch.req_ids == ["a"]


@pytest.mark.parametrize("seed", range(5))
def test_precomputed_sampling_words_pack_as_the_general_path(seed):
    """Rows without bans: ``pack_sampling_rows`` over ``sampling_row_words`` == ``pack_sampling_tensors`` over
    ``build_sampling_tensors``, and the mode the rows' ranks give is the general path's."""
    rng = random.Random(seed)
    rows, words, ranks = [], [], []
    for _ in range(rng.randint(1, 7)):
        params = SamplingParams(temperature=rng.choice([0.0, 0.5, 1.3]), top_k=rng.choice([0, 5, 40, 5000]),
                                top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.05]),
                                logprobs=rng.choice([None, 0, 3]))
        seed_value, prompt_len = rng.randrange(1 << 62), rng.randint(1, 30)
        step = rng.randint(0, 20)
        rows.append((params, seed_value, step, [0] * prompt_len, [0] * step))
        row_words, rank, general = sampler_lib.sampling_row_words(params, seed_value, prompt_len, eos_token_ids=[2],
                                                                 vocab_size=VOCAB)
        assert not general
        words.append(row_words)
        ranks.append(rank)
    num_padded = len(rows) + rng.randint(0, 3)
    tensors, mode = sampler_lib.build_sampling_tensors(rows, num_padded, eos_token_ids=[2], vocab_size=VOCAB)
    # The general path leaves prompt_len 0 for rows without penalties; the sampler reads it only with penalties.
    tensors = tensors._replace(prompt_len=np.asarray([len(r[3]) for r in rows] + [0] * (num_padded - len(rows)),
                                                     np.int32))
    expected = np.zeros(num_padded * sampler_lib.SAMPLING_WORDS_PER_ROW, np.int32)
    sampler_lib.pack_sampling_tensors(tensors, expected)
    fast = np.full_like(expected, 12345)
    steps = np.asarray([r[2] for r in rows], np.int32)
    sampler_lib.pack_sampling_rows(np.stack(words), steps, sampler_lib.padding_row_words(), fast)
    np.testing.assert_array_equal(fast, expected)
    assert sampler_lib.MODE_ORDER[max(ranks)] == mode


def test_rows_with_penalties_or_bias_take_the_general_path():
    for params in (SamplingParams(presence_penalty=0.5), SamplingParams(logit_bias={5: 1.0}),
                   SamplingParams(allowed_token_ids=[1, 2])):
        _, rank, general = sampler_lib.sampling_row_words(params, 0, 4, eos_token_ids=[2], vocab_size=VOCAB)
        assert general, params


def test_min_tokens_bans_eos_only_below_it():
    """A min_tokens row takes the general path (EOS and stop ids banned) while below min_tokens, the fast path after;
    the other rows' words are the same either way."""
    rng = random.Random(3)
    batch = InputBatch(4, MAX_LEN, MAX_BLOCKS, eos_token_ids=[2], vocab_size=VOCAB)
    for req_id, params in (("a", SamplingParams(temperature=0.7, min_tokens=2, stop_token_ids=[7])),
                           ("b", SamplingParams(temperature=0.0))):
        new = new_request(req_id, rng)
        new.params, new.output_token_ids = params, []
        batch.add(new)
    rows = np.arange(2)
    sampled = np.ones(2, bool)
    for num_outputs, banned in ((0, [2, 7]), (1, [2, 7]), (2, []), (5, [])):
        ends = batch.num_prompt_tokens[rows] + num_outputs
        out = np.zeros(2 * sampler_lib.SAMPLING_WORDS_PER_ROW, np.int32)
        packed = _pack_sampling(batch, rows, sampled, ends, out, 2, max_logprobs=5)
        bans = out[len(sampler_lib.SAMPLING_WIRE_FIELDS) * 2:].reshape(2, sampler_lib.BANNED_WIDTH)
        assert sorted(b for b in bans[0].tolist() if b >= 0) == banned
        assert (bans[1] == -1).all()
        assert packed["mode"] == (sampler_lib.SamplingMode.FULL if banned
                                  else sampler_lib.SamplingMode.GREEDY_OR_TEMPERATURE)


def _fields(packed, block_size):
    """A packed step's buffer fields, each row's block table cut to the blocks its tokens use."""
    fields = {name: packed.buf[a:b].tolist() for name, (a, b) in packed.layout.fields.items() if name != "block_tables"}
    a, b = packed.layout.fields["block_tables"]
    tables = packed.buf[a:b].reshape(packed.layout.num_seqs, -1)
    fields["block_tables"] = [tables[i, :-(-kv_len // block_size)].tolist()
                              for i, kv_len in enumerate(fields["kv_lens"])]
    return fields


@pytest.mark.parametrize("seed", range(4))
def test_steady_decode_steps_repack_as_a_whole_pack(seed, monkeypatch):
    """A steady decode step packed from the previous one (``_repack_decode``: rows entering a new block, tokens
    still on the device, a row leaving, a smaller bucket becoming ready) writes what packing it whole writes."""
    repacks = []
    repack = step_packing._repack_decode
    monkeypatch.setattr(step_packing, "_repack_decode", lambda *args: repacks.append(repack(*args)) or repacks[-1])
    rng, block_size = random.Random(seed), 8
    batch = InputBatch(8, MAX_LEN, MAX_BLOCKS, eos_token_ids=[2], vocab_size=VOCAB)
    for i in range(6):
        new = new_request(f"r{i}", rng, temperature=rng.choice([0.0, 0.7]), logprobs=rng.choice([None, 2]))
        new.lora_int_id, new.prompt_logprobs = 0, False
        new.block_ids = list(range(1 + 8 * i, 1 + 8 * i + -(-(len(new.prompt_token_ids) + len(new.output_token_ids))
                                                          // block_size)))
        batch.add(new)
    buckets = [(8, 8)]
    kwargs = dict(layout_for=lambda t, s: StepLayout(t, s, MAX_BLOCKS, s), block_size=block_size, num_blocks=100,
                  max_logprobs=5, block_copies=[], lora_slots=None, lora=False)
    for step in range(24):
        if step == 12:
            batch.remove("r3")
        if step == 16:
            buckets = [(6, 6), (8, 8)]  # a smaller bucket is ready: the next step takes it
        cached = CachedRequestData(list(batch.req_ids))
        cached.decode_token_ids = [rng.choice([rng.randrange(VOCAB), PLACEHOLDER_TOKEN]) for _ in batch.req_ids]
        for req_id in batch.req_ids:
            row = batch.row_of[req_id]
            num_tokens, num_blocks = int(batch.num_tokens[row]), int(batch.num_blocks[row])
            grows = num_tokens + 1 > num_blocks * block_size
            cached.new_block_ids.append([90 + rng.randrange(9)] if grows else [])
            cached.block_starts.append(num_blocks)
            cached.num_computed_tokens.append(num_tokens)
        batch_rows = batch.apply_cached(cached)
        batch.prev_sample[:batch.num_rows] = np.arange(batch.num_rows)[::-1]
        rows = StepRows(batch_rows, np.ones(len(batch_rows), np.int64),
                        np.asarray(cached.num_computed_tokens, np.int64), [])
        packed = pack_step(batch, rows, buckets=buckets, **kwargs)
        whole = _pack_whole(batch, rows, buckets=buckets, **kwargs)
        assert _fields(packed, block_size) == _fields(whole, block_size)
        assert (packed.mode, packed.num_logprobs, packed.wants_logprobs) == (whole.mode, whole.num_logprobs,
                                                                            whole.wants_logprobs)
        assert packed.sampled.tolist() == whole.sampled.tolist()
    # Whole: the first step, the steps after a row left and after the bucket changed.
    assert sum(r is not None for r in repacks) == 21
