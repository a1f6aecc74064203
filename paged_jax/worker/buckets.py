"""The fixed shapes the model runner compiles: step buckets, sampler row counts and swap-copy sizes.

A step's ragged batch is padded to the smallest ``(num_tokens, num_seqs)`` bucket that holds it; every shape here is
compiled once at start-up (``ModelRunner.warm_up``) and never again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

MIN_TOKEN_BUCKET = 16
MIN_SEQ_BUCKET = 8
SEQ_BUCKET_GROWTH = 4  # sampler row counts grow by 4x: padding rows is cheap, compiles are not
# A token bucket below max_num_seqs whose sampler would run on more rows than this also gets a MIN_SEQ_BUCKET bucket.
FEW_SEQS_SAMPLER_ROWS = 32
# greedy; then with and without top-k logprobs: greedy_or_temperature, top_k, and full with the bias table, with the
# penalty history and the bias table (ModelRunner.sampler_variants)
NUM_SAMPLER_VARIANTS = 9
MAX_SWAP_CHUNK = 64  # swap copies go in chunks of at most this many blocks (one compiled shape per power of 2)
# Copy-on-write block copies per step (forks): the step's copy slots are min(num_seqs, this); every slot costs a
# gather + scatter of one block per layer even as padding, so wide buckets do not get one per sequence. The
# scheduler defers a sequence's first write into a shared block to the next step when they are used up.
MAX_BLOCK_COPIES = 64

def _powers_of_two(start: int, stop: int) -> list[int]:
    values, value = [], start
    while value < stop:
        values.append(value)
        value *= 2
    values.append(stop)
    return sorted(set(values))


def make_buckets(max_num_batched_tokens: int, max_num_seqs: int,
                 num_speculative_tokens: int = 0) -> list[tuple[int, int]]:
    """The (num_tokens, num_seqs) shapes a step is padded to, sorted by tokens then seqs.

    A single-sequence decode gets its own bucket (1 token, 1 sequence): padded into 16 rows, the batch-1 step is
    measurably slower (benchmarks/RESULTS.md, "Batch-1 decode latency"; vLLM likewise captures a CUDA graph for
    batch size 1). It costs one more compile at start-up.

    Token buckets: powers of two from 16 up to ``max_num_batched_tokens`` (which is always included). A token bucket
    T >= ``max_num_seqs`` gets the single seq bucket ``max_num_seqs`` (padding sequences cost little: q_len 0, and
    each extra bucket is a multi-second compile on the GPU, the bulk of a cold start's CPU work); a smaller T gets T
    itself (a step never has more sequences than tokens, so that one always fits) and also ``MIN_SEQ_BUCKET`` when
    T is the smallest token bucket (decodes of a few sequences, where latency counts) or T's sampler would run on
    more than ``FEW_SEQS_SAMPLER_ROWS`` rows (a step of a few long prefill chunks then samples 8 rows instead of a
    whole vocabulary for every one of T slots). E.g. 512 tokens / 16 seqs -> 7 buckets (with the 1-token one);
    2048 / 256 -> 12; 8192 / 256 -> 14.

    With speculative decoding (``num_speculative_tokens`` k > 0), also ``verify_buckets``: S * (1 + k) tokens for
    a seq bucket S. E.g. 8192 / 256 with k = 4 -> 21 (with k = 1 or 3: 15).
    """
    token_buckets = _powers_of_two(min(MIN_TOKEN_BUCKET, max_num_batched_tokens), max_num_batched_tokens)
    few_seqs = min(MIN_SEQ_BUCKET, max_num_seqs)
    buckets = [(1, 1)] if max_num_batched_tokens > 1 else []
    for num_tokens in token_buckets:
        if num_tokens >= max_num_seqs:
            buckets.append((num_tokens, max_num_seqs))
            continue
        if few_seqs < num_tokens and (num_tokens == token_buckets[0]
                                      or sampler_rows_for(num_tokens, max_num_seqs) > FEW_SEQS_SAMPLER_ROWS):
            buckets.append((num_tokens, few_seqs))
        buckets.append((num_tokens, num_tokens))
    return sorted(set(buckets + verify_buckets(buckets, max_num_batched_tokens, num_speculative_tokens)))


def verify_buckets(buckets: Sequence[tuple[int, int]], max_num_batched_tokens: int,
                   num_speculative_tokens: int) -> list[tuple[int, int]]:
    """Buckets ``(S * (1 + k), S)`` for the seq buckets S of ``buckets`` (within ``max_num_batched_tokens``): the
    step where S sequences each verify k drafts, where ``buckets`` would pad its tokens or, for one sequence, pad
    it to several. Padded, such a step runs every layer on up to twice its tokens (the next power of two) and its LM
    head and sampler on the bigger bucket's sample rows; a single sequence's would leave the 1-token bucket's shape
    for 16 tokens and 8 sequences, whose attention runs fewer kv splits (vLLM likewise sizes its CUDA graphs in
    multiples of 1 + k)."""
    if not num_speculative_tokens:
        return []
    shapes = {(seqs * (1 + num_speculative_tokens), seqs) for _, seqs in buckets}
    return sorted((tokens, seqs) for tokens, seqs in shapes if tokens <= max_num_batched_tokens
                  and (seqs == 1 or pick_bucket(buckets, tokens, seqs)[0] > tokens))


def sampler_rows_for(num_seqs: int, max_seq_bucket: int, also: int = 0) -> int:
    """Rows the sampler runs on for a forward seq bucket of ``num_seqs``: the smallest of 8, 32, 128, ... (x4),
    ``also`` (``max_num_seqs``: a full decode step's rows, when speculative decoding's draft rows raise
    ``max_seq_bucket`` past it) or ``max_seq_bucket`` that holds it. Sampler executables are compiled per row count x
    variant, so mapping the forward seq buckets onto this coarser set cuts their compiles; the extra rows are greedy
    padding."""
    rows = min(MIN_SEQ_BUCKET, max_seq_bucket)
    while rows < num_seqs:
        rows *= SEQ_BUCKET_GROWTH
    rows = min(rows, max_seq_bucket)
    return also if num_seqs <= also < rows else rows


def planned_num_compiles(max_num_batched_tokens: int, max_num_seqs: int, *, swap: bool = False,
                         num_blocks: int = 1 << 20, num_speculative_tokens: int = 0) -> int:
    """Executables ``ModelRunner.warm_up`` compiles for this step shape with the default buckets and sampler variants
    (forward buckets + sampler seq buckets x (variants + the grammar bitmask) + prompt logprobs per token bucket +
    a gather and a scatter per swap-copy size when ``swap``)."""
    buckets = make_buckets(max_num_batched_tokens, max_num_seqs, num_speculative_tokens)
    rows = bucket_sample_rows(buckets, num_speculative_tokens)
    num_sampler_buckets = len({sampler_rows_for(r, max(rows), max_num_seqs) for r in rows})
    num_token_buckets = len({t for t, _ in buckets})
    num_swap = 2 * len(swap_sizes_for(num_blocks)) if swap else 0
    return len(buckets) + num_sampler_buckets * (NUM_SAMPLER_VARIANTS + 1) + num_token_buckets + num_swap


def sample_rows_needed(num_tokens: int, num_seqs: int, num_speculative_tokens: int, *, largest: bool = True) -> int:
    """Positions a ``(num_tokens, num_seqs)`` bucket samples: one per sequence, and with speculative decoding one
    more per draft token (each draft is one of the step's tokens, at most ``num_speculative_tokens`` per sequence).
    A decode-shaped bucket (tokens == seqs) other than the ``largest`` keeps one row per sequence: plain decode steps
    land there, and a step whose drafts need more rows takes a bigger bucket (``pick_bucket``'s
    ``num_sample_rows``). The largest bucket holds every step's rows (fork rows sample without tokens of their own)."""
    if not num_speculative_tokens or (num_tokens == num_seqs and not largest):
        return num_seqs
    return min(num_seqs + num_tokens, num_seqs * (1 + num_speculative_tokens))


def bucket_sample_rows(buckets: Sequence[tuple[int, int]], num_speculative_tokens: int) -> list[int]:
    """``sample_rows_needed`` of each bucket of ``buckets`` (sorted, as ``make_buckets`` returns them)."""
    return [sample_rows_needed(t, s, num_speculative_tokens, largest=i == len(buckets) - 1)
            for i, (t, s) in enumerate(buckets)]


def pick_bucket(buckets: Sequence[tuple[int, int]], num_tokens: int, num_seqs: int, *, num_sample_rows: int = 0,
                sample_rows_of: Callable[[tuple[int, int]], int] | None = None) -> tuple[int, int]:
    """Smallest bucket (by tokens, then seqs) that holds the batch, and its ``num_sample_rows`` sampled positions by
    ``sample_rows_of(bucket)`` when that exceeds ``num_seqs`` (speculative decoding: a step's rows plus drafts)."""
    for bucket in buckets:  # sorted by tokens then seqs
        bucket_tokens, bucket_seqs = bucket
        if bucket_tokens >= num_tokens and bucket_seqs >= num_seqs and (
                num_sample_rows <= bucket_seqs or sample_rows_of(bucket) >= num_sample_rows):
            return bucket
    raise ValueError(f"a step of {num_tokens} tokens / {num_seqs} seqs / {num_sample_rows} sample rows exceeds every "
                     f"bucket (largest {buckets[-1]}); the scheduler must respect max_num_batched_tokens / max_num_seqs")


def swap_sizes_for(num_blocks: int) -> list[int]:
    """Padded block counts of one swap copy: powers of two up to min(MAX_SWAP_CHUNK, usable blocks)."""
    cap = min(MAX_SWAP_CHUNK, max(num_blocks - 1, 1))
    return [1 << i for i in range((cap - 1).bit_length() + 1)]
