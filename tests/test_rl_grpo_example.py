"""examples/rl_grpo.py's short form: rollouts from LLM, scores from score_tokens, updates through update_weights,
sleep / wake_up between the phases; the engine's logprobs stay the trainer's after every update."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("optax")


def test_rl_grpo_example_short_form(capsys):
    path = Path(__file__).resolve().parents[1] / "examples" / "rl_grpo.py"
    spec = importlib.util.spec_from_file_location("rl_grpo", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    history = example.run(example.parse_args(["--tiny", "--steps", "3", "--prompts", "2", "--samples", "2",
                                              "--max-tokens", "6", "--max-model-len", "64",
                                              "--learning-rate", "1e-2"]))
    assert [h["step"] for h in history] == [0, 1, 2]
    # Steps 1 and 2 sample from the weights step 0 and 1 trained: their logprobs are the trainer's.
    assert all(h["logprob_gap"] < 1e-4 for h in history)
    assert all(0.0 <= h["reward"] <= 1.0 and np.isfinite(h["loss"]) for h in history)
    assert "engine/trainer logprob gap" in capsys.readouterr().out
