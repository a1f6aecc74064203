"""SmolLM2-135M-Instruct perplexity on a fixed text, per weight format (issue 17's quality check).

Formats, all from the same bf16 checkpoint and computed in bf16 (fp32 logits):
  * ``bf16``: the checkpoint itself, the reference;
  * ``int8``, ``fp8``: quantized at load (``--quantization int8|fp8``: per-channel weights). ``fp8`` runs XLA's
    float8 dot with dynamic per-token activation scales on the q/k/v and gate/up inputs and o_proj / down_proj
    weight-only (``matmul_impl="xla"``: what ``auto`` runs off the GPU, and on one GPU from
    ``FP8_DOT_MIN_ROWS`` rows); ``fp8-weight-only`` the same weights against bf16 activations
    (``matmul_impl="xla_native"``, the dot on upcast weights: the products ``auto`` runs on one GPU below that many
    rows, and what a tensor-parallel FP8 model runs); ``fp8-w8a8-all`` the float8 dot on every projection (what an
    FP8 checkpoint declaring dynamic activations runs);
  * ``awq-int4-g64``, ``gptq-int4-g64``, ``gptq-int8-g64``: checkpoints written in AutoAWQ's / AutoGPTQ's on-disk
    packing (``models.quantization.testing``, group size 64: SmolLM2's hidden size 576 is not a multiple of 128) and
    loaded as a user's would be. Their weights are rounded to nearest (min / max per group), with none of the
    calibration real AWQ / GPTQ checkpoints get, so these are upper bounds on what those methods lose;
  * ``fp8-checkpoint``: a compressed-tensors float-quantized checkpoint (per-channel weights, dynamic per-token
    activations), written by the compressed-tensors library, run W8A8 on every projection, like ``fp8-w8a8-all``.
Perplexity = exp(mean negative log-likelihood of each token of ``TEXT`` given the ones before it), one causal forward
over the whole text. Runs on the CPU in about two minutes (needs the test extras: torch, compressed-tensors).

    python -m benchmarks.perplexity [--out FILE]

Prints one JSON object: per format the perplexity and its change against bf16. Figures: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based ink and a wooden press adapted from those used to make wine. Within a few decades "
    "printers were working in more than two hundred cities across Europe, and the price of books fell so far that "
    "ordinary merchants could afford them. Scholars exchanged corrected editions, governments printed laws, and "
    "reformers spread pamphlets faster than any authority could suppress them.")
# The rest of the text: with it the W8A8 float8 dot on every projection loses more than on TEXT alone
# (benchmarks/RESULTS.md).
MORE_TEXT = (
    " Paper mills multiplied along the rivers that could turn their wheels, and the trade in rags became a business "
    "of its own. Typefounders learned to cast letters that wore evenly, so that a page printed at the end of a long "
    "run looked like the first. Booksellers travelled to the great fairs at Frankfurt and Leipzig, where catalogues "
    "listed the new titles of the season and printers bargained over the rights to reprint them.\n\n"
    "The consequences reached far beyond the workshop. Spelling and grammar settled into national standards, because "
    "a printer who sold across a whole kingdom needed a language that readers everywhere would accept. Maps, tables "
    "and diagrams could be copied without the errors that crept into every hand-made copy, which helped astronomers, "
    "navigators and physicians build on one another's work. Newspapers appeared in the seventeenth century, first as "
    "weekly sheets of foreign news and later as daily papers that argued about politics at home.\n\n"
    "Steam power changed the press again in the nineteenth century. A cylinder press driven by an engine could print "
    "thousands of sheets an hour, and cheap paper made from wood pulp replaced paper made from rags. Publishers sold "
    "novels in weekly parts, libraries lent books to readers who could not buy them, and the number of people who "
    "could read rose in every country that built schools.")

FORMATS = ("bf16", "int8", "fp8", "fp8-weight-only", "fp8-w8a8-all", "awq-int4-g64", "gptq-int4-g64",
           "gptq-int8-g64", "fp8-checkpoint")


def perplexity(model, token_ids) -> float:
    """exp(mean NLL) of ``token_ids`` (int32[T]) under ``model`` (a ``LlamaForCausalLM``), one causal forward."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from models.attention import dense_causal_attention

    ids = jnp.asarray(token_ids, jnp.int32)
    num_tokens = ids.shape[0]
    attention = dense_causal_attention(np.zeros((num_tokens,), np.int32), model.config.head_dim ** -0.5)
    hidden, _ = model(ids, jnp.arange(num_tokens, dtype=jnp.int32), None, attention)
    logprobs = jax.nn.log_softmax(model.compute_logits(hidden[:-1]), axis=-1)
    return float(jnp.exp(-jnp.mean(jnp.take_along_axis(logprobs, ids[1:, None], axis=1))))


def _checkpoint(smollm2_dir: Path, workdir: Path, name: str) -> Path:
    from models.quantization.testing import save_quantized_checkpoint

    settings = {"awq-int4-g64": ("awq", {"bits": 4, "group_size": 64}),
                "gptq-int4-g64": ("gptq", {"bits": 4, "group_size": 64}),
                "gptq-int8-g64": ("gptq", {"bits": 8, "group_size": 64}),
                "fp8-checkpoint": ("fp8", {"weight_strategy": "channel", "activations": "dynamic_token"})}
    method, kwargs = settings[name]
    return save_quantized_checkpoint(smollm2_dir, workdir / name, method, **kwargs)


def model_for(name: str, smollm2_dir: Path, workdir: Path):
    """The SmolLM2 model in format ``name`` (one of ``FORMATS``), in bf16."""
    from flax import nnx

    from models.config import ModelConfig
    from models.loader import load_model
    from models.quantization.config import resolve_quantization
    from models.quantization.load import load_quantized_model, quantize_model

    if name in ("bf16", "int8", "fp8", "fp8-weight-only", "fp8-w8a8-all"):
        model, _ = load_model(smollm2_dir, dtype="bfloat16")
        if name == "bf16":
            return model
        method, impl = {"int8": ("int8", "auto"), "fp8": ("fp8", "xla"), "fp8-weight-only": ("fp8", "xla_native"),
                        "fp8-w8a8-all": ("fp8", "xla")}[name]
        qc = resolve_quantization(method, {})
        if name == "fp8-w8a8-all":
            qc = dataclasses.replace(qc, activation_projections=None)
        return quantize_model(nnx.clone(model), qc, matmul_impl=impl)
    path = _checkpoint(smollm2_dir, workdir, name)
    hf_config = json.loads((path / "config.json").read_text())
    return load_quantized_model(path, ModelConfig.from_pretrained(path), resolve_quantization(None, hf_config),
                                dtype="bfloat16", matmul_impl="xla" if name == "fp8-checkpoint" else "auto")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated subset of {','.join(FORMATS)}")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    if not set(formats) <= set(FORMATS):
        p.error(f"--formats must be a subset of {','.join(FORMATS)}")

    from transformers import AutoTokenizer

    from benchmarks.report import versions, write_json
    from models.smollm2 import ensure_smollm2

    smollm2_dir = ensure_smollm2()
    token_ids = AutoTokenizer.from_pretrained(str(smollm2_dir)).encode(TEXT + MORE_TEXT)
    result: dict = {"model": "SmolLM2-135M-Instruct", "tokens": len(token_ids), "versions": versions(),
                    "perplexity": {}, "change_vs_bf16": {}}
    with tempfile.TemporaryDirectory(prefix="paged_jax_perplexity_") as tmp:
        for name in ["bf16"] + [f for f in formats if f != "bf16"]:
            result["perplexity"][name] = round(perplexity(model_for(name, smollm2_dir, Path(tmp)), token_ids), 4)
    reference = result["perplexity"]["bf16"]
    result["change_vs_bf16"] = {name: f"{100 * (value / reference - 1):+.2f}%"
                                for name, value in result["perplexity"].items() if name != "bf16"}
    print(json.dumps(result, indent=1))
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
