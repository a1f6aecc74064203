"""Which runner a model gets and, for the pooling runner, its ``PoolerConfig``: vLLM's ``--runner`` / ``--convert``
(and the legacy ``--task``), the checkpoint's head (``models.config.ModelConfig.head``) and its sentence-transformers
files (``modules.json``, ``1_Pooling/config.json``).

Defaults as vLLM's: ``runner="auto"`` pools a checkpoint without an LM head (a ``*Model`` or
``*ForSequenceClassification``) and generates with any other; ``convert="auto"`` classifies with a classification
head and embeds otherwise. A decoder embeds its last token's hidden state, normalized, unless the checkpoint's
sentence-transformers pooling says otherwise; a classifier scores the last token and applies softmax (several labels)
or sigmoid (one).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import msgspec

logger = logging.getLogger(__name__)

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
# The legacy --task values vLLM still accepts -> (runner, convert).
TASKS = {"auto": ("auto", "auto"), "generate": ("generate", "auto"), "embed": ("pooling", "embed"),
         "embedding": ("pooling", "embed"), "classify": ("pooling", "classify"), "score": ("pooling", "classify")}
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' 1_Pooling/config.json mode -> our pooling type (the other modes are refused by name): its
# ``pooling_mode`` (sentence-transformers >= 6), or the flag set among ``pooling_mode_*`` (earlier versions).
_ST_POOLING_MODES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS", "pooling_mode_lasttoken": "LAST",
                     "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
# modules.json module types by class name (``sentence_transformers.models.Pooling``, or where 6.x moved it).
_ST_TRANSFORMER, _ST_POOLING, _ST_NORMALIZE = "Transformer", "Pooling", "Normalize"


class PoolerConfig(msgspec.Struct, frozen=True, gc=False):
    """How the pooling runner turns a prompt's hidden states into its output.

    Attributes:
      task: "embed" (the pooled hidden state) or "classify" (the pooled hidden state through the ``score`` head).
      pooling_type: "LAST" (the last prompt token), "MEAN" (the mean over the prompt) or "CLS" (the first token).
      normalize: an embedding's default L2 normalization (``PoolingParams.normalize`` overrides it).
      width: values per output (hidden size, or the classifier's labels).
      matryoshka_dimensions: the ``dimensions`` an embedding may be truncated to (None: all of 1..width when
        ``is_matryoshka``, else none: as vLLM, ``dimensions`` is refused for a model that is not Matryoshka).
      is_matryoshka: the checkpoint's ``is_matryoshka`` (``config.json``).
      labels: a classifier's label names by index (``id2label``), or None.
      logit_token_ids: a classifier built from an LM (vLLM's ``classifier_from_token``, Qwen3-Reranker-style): its
        classes are these tokens' logits; with ``two_way`` one class, the second token's logit minus the first's
        (vLLM's ``from_2_way_softmax``: its sigmoid is the second token's softmax probability of the two).
    """

    task: str
    pooling_type: str
    normalize: bool
    width: int
    is_matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None
    labels: list[str] | None = None
    logit_token_ids: list[int] | None = None
    two_way: bool = False

    def supports_dimensions(self, dimensions: int) -> bool:
        if self.matryoshka_dimensions is not None:
            return dimensions in self.matryoshka_dimensions
        return self.is_matryoshka and 1 <= dimensions <= self.width  # vLLM refuses any on other models


def resolve_runner(runner: str, convert: str, task: str | None, head: str) -> tuple[str, str]:
    """``(runner, convert)`` with "auto" resolved (vLLM's rules, see the module docstring); ValueError naming
    ``runner``, ``convert`` or ``task`` for a value outside its choices or a combination this model cannot run."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {', '.join(CONVERTS)}, got {convert!r}")
    if task is not None:
        if task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
        task_runner, task_convert = TASKS[task]
        runner = task_runner if runner == "auto" else runner
        convert = task_convert if convert == "auto" else convert
    if runner == "auto":
        runner = "generate" if head == "lm_head" and convert in ("auto", "none") else "pooling"
    if runner == "generate":
        if head != "lm_head":
            raise ValueError(f"runner='generate': the checkpoint has no LM head (head {head!r}); use runner='pooling'")
        if convert not in ("auto", "none"):
            raise ValueError(f"convert={convert!r} needs runner='pooling'")
        return "generate", "none"
    if convert in ("auto", "none"):
        convert = "classify" if head == "score" else "embed"
    if convert == "classify" and head != "score":
        raise ValueError("convert='classify' needs a sequence-classification checkpoint (a score head: "
                         "*ForSequenceClassification); this one has none")
    return "pooling", convert


def read_hf_config(model_path: str | None) -> dict:
    """The checkpoint's ``config.json`` ({} without one)."""
    if model_path is None or not (Path(model_path) / "config.json").is_file():
        return {}
    return json.loads((Path(model_path) / "config.json").read_text())


def checkpoint_head(model_config, hf_config: dict) -> str:
    """The head the runner choice goes by: a classifier built from its LM's token logits (``classifier_from_token``)
    counts as a classification head although its weights are the LM's."""
    return "score" if hf_config.get("classifier_from_token") else model_config.head


def sentence_transformers_pooling(model_path: str | None) -> tuple[str, bool] | None:
    """``(pooling type, normalize)`` from a sentence-transformers checkpoint's ``modules.json`` and its pooling
    module's ``config.json``; None without ``modules.json``. ValueError naming the module or mode not implemented."""
    if model_path is None or not (Path(model_path) / "modules.json").is_file():
        return None
    modules = json.loads((Path(model_path) / "modules.json").read_text())
    pooling_type, normalize = None, False
    for module in modules:
        kind = str(module.get("type")).rsplit(".", 1)[-1]
        if kind == _ST_NORMALIZE:
            normalize = True
        elif kind == _ST_POOLING:
            pooling_type = _pooling_mode(Path(model_path) / module.get("path", "") / "config.json")
        elif kind != _ST_TRANSFORMER:
            raise ValueError(f"modules.json: sentence-transformers module {module.get('type')!r} is unsupported "
                             "(supported: Transformer, Pooling, Normalize)")
    return pooling_type or "LAST", normalize


def _pooling_mode(path: Path) -> str:
    config = json.loads(path.read_text())
    if not config.get("include_prompt", True):
        raise ValueError(f"{path}: include_prompt=false is unsupported (every prompt token is pooled)")
    mode = config.get("pooling_mode")
    modes = ([mode] if isinstance(mode, str) else list(mode) if mode else
             [key for key, value in config.items() if key.startswith("pooling_mode_") and value])
    if len(modes) != 1 or modes[0] not in _ST_POOLING_MODES:
        raise ValueError(f"{path}: pooling mode {modes} is unsupported; one of {', '.join(_ST_POOLING_MODES)}")
    return _ST_POOLING_MODES[modes[0]]


def pooler_config(convert: str, model_config, model_path: str | None, tokenizer=None) -> PoolerConfig:
    """The pooler of a model run by the pooling runner as ``convert`` ("embed" or "classify"); ``tokenizer`` reads
    ``classifier_from_token``'s tokens."""
    hf_config = read_hf_config(model_path)
    st = sentence_transformers_pooling(model_path)
    pooling_type, normalize = st if st is not None else ("LAST", convert == "embed")
    if convert == "classify" and hf_config.get("classifier_from_token"):
        return _token_classifier(hf_config, pooling_type, tokenizer)
    if convert == "classify":
        id2label = hf_config.get("id2label") or {}
        labels = [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(model_config.num_labels)]
        return PoolerConfig("classify", pooling_type, False, model_config.num_labels, labels=labels)
    dims = hf_config.get("matryoshka_dimensions")
    return PoolerConfig("embed", pooling_type, normalize, model_config.hidden_size,
                        is_matryoshka=bool(hf_config.get("is_matryoshka", dims is not None)),
                        matryoshka_dimensions=None if dims is None else [int(d) for d in dims])


def _token_classifier(hf_config: dict, pooling_type: str, tokenizer) -> PoolerConfig:
    """vLLM's ``classifier_from_token`` classifier: the classes are the named tokens' logits at the last token; two
    tokens with ``is_original_qwen3_reranker`` (or ``method: from_2_way_softmax``) are one class, their difference."""
    tokens = list(hf_config["classifier_from_token"])
    if tokenizer is None:
        raise ValueError("classifier_from_token: reading its tokens needs the checkpoint's tokenizer")
    if pooling_type != "LAST":
        raise ValueError(f"classifier_from_token: only with last-token pooling, not {pooling_type}")
    ids = [tokenizer.convert_tokens_to_ids(token) for token in tokens]
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        raise ValueError(f"classifier_from_token: {tokens} are not all tokens of the tokenizer")
    two_way = len(ids) == 2 and bool(hf_config.get("is_original_qwen3_reranker")
                                     or hf_config.get("method") == "from_2_way_softmax")
    return PoolerConfig("classify", "LAST", False, 1 if two_way else len(ids), labels=None if two_way else tokens,
                        logit_token_ids=ids, two_way=two_way)


def pooling_model_config(model_config, pooler: PoolerConfig):
    """The ``ModelConfig`` the pooling runner loads: an embedder keeps no LM head (hidden states only)."""
    if pooler.task == "embed" and model_config.head == "lm_head":
        return dataclasses.replace(model_config, head="none")
    return model_config
