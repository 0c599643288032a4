"""TRL's preference and RL trainers with JIT checkpoints (``slurm_jit.with_jit``), the rows of docs/stacks.md's
"Tested matrix" that ``examples/trl_sft.py`` does not run (``--row``):

- ``dpo``: ``DPOTrainer`` with an explicit reference model (a second tiny GPT-2, built from the same seed);
- ``dpo-peft``: ``DPOTrainer`` on a PEFT LoRA model without a reference model (TRL's implicit reference: the
  model with its adapters disabled); give ``--lora``;
- ``grpo``: ``GRPOTrainer`` without vLLM: generation with ``model.generate`` on CPU, a tiny reward function.

A tiny GPT-2 from a config, a word-level tokenizer built in memory (``trl_sft.tokenizer``) and in-memory datasets
made from demo_train's deterministic token rows; everything else (flags, DeepSpeed config, loss log, launch) is
demo_train's. One process per rank::

    srun python examples/trl_matrix.py --row dpo --output-dir OUT --max-steps 8 --resume
    python -m pytest tests/train/test_trl_matrix.py   # 2 local CPU ranks per row, stopped and resumed
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # TRL pings the Hub from rank 0 at construction
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from slurm_jit import demo_train  # noqa: E402 - after the environment above

ROWS = ("dpo", "dpo-peft", "grpo")
PROMPT_WORDS, ANSWER_WORDS = 8, 4  # a prompt and a completion: short, as the tiny model
GRPO_GENERATIONS = 2  # completions per prompt; divides the global batch (2 ranks x --batch-size 2)


def _words(row: Any, vocab: int) -> list[str]:
    from trl_sft import SPECIAL_TOKENS  # examples/ is sys.path[0] when this file runs

    first = len(SPECIAL_TOKENS)
    return [f"w{first + int(t) % (vocab - first)}" for t in row]


def preference_pairs(tokens: Any, vocab: int) -> Any:
    """demo_train's token rows as DPO's prompt / chosen / rejected texts (chosen: the row's continuation,
    rejected: the same words reversed)."""
    from datasets import Dataset

    rows: dict[str, list[str]] = {"prompt": [], "chosen": [], "rejected": []}
    for row in tokens.data:
        words = _words(row, vocab)
        answer = words[PROMPT_WORDS:PROMPT_WORDS + ANSWER_WORDS]
        rows["prompt"].append(" ".join(words[:PROMPT_WORDS]))
        rows["chosen"].append(" ".join(answer))
        rows["rejected"].append(" ".join(reversed(answer)))
    return Dataset.from_dict(rows)


def prompts(tokens: Any, vocab: int) -> Any:
    """demo_train's token rows as GRPO's prompts."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [" ".join(_words(row, vocab)[:PROMPT_WORDS]) for row in tokens.data]})


def distinct_words(completions: list[str], **_: Any) -> list[float]:
    """GRPO's reward: the share of distinct words in a completion (cheap, deterministic, varies by sample)."""
    return [len(set(c.split())) / max(1, len(c.split())) for c in completions]


def _config(cls_name: str, args: Any, **fields: Any) -> Any:
    import trl

    return getattr(trl, cls_name)(**{**args.to_dict(), "hub_token": args.hub_token, **fields})


def build(row: str, vocab: int, keep_dropout: bool, *, model: Any, args: Any, train_dataset: Any, eval_dataset: Any,
          callbacks: Any, jit_config: Any) -> Any:
    """demo_train's Trainer arguments made the TRL trainer's of ``row``, with JIT added by ``with_jit``."""
    import trl
    from trl_sft import tokenizer

    from slurm_jit import with_jit

    common = dict(model=model, processing_class=tokenizer(vocab), callbacks=callbacks, jit_config=jit_config)
    if row == "grpo":
        config = _config("GRPOConfig", args, num_generations=GRPO_GENERATIONS, max_completion_length=ANSWER_WORDS,
                         temperature=1.0, use_vllm=False)
        return with_jit(trl.GRPOTrainer)(args=config, reward_funcs=distinct_words,
                                         train_dataset=prompts(train_dataset, vocab), **common)
    evals = None if eval_dataset is None else preference_pairs(eval_dataset, vocab)
    ref_model = None
    if row == "dpo":
        import torch

        with torch.random.fork_rng(devices=[]):  # the policy's stream as without a reference model
            ref_model = demo_train.build_model("gpt2", model.config.n_embd, model.config.n_layer, vocab=vocab,
                                               heads=model.config.n_head)
    # --keep-dropout: DPOConfig's default disables dropout, and with it every random draw of a training step
    config = _config("DPOConfig", args, max_length=PROMPT_WORDS + ANSWER_WORDS + 2, disable_dropout=not keep_dropout)
    return with_jit(trl.DPOTrainer)(ref_model=ref_model, args=config, train_dataset=preference_pairs(
        train_dataset, vocab), eval_dataset=evals, **common)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--row", choices=ROWS, required=True)
    parser.add_argument("--vocab", type=int, default=demo_train.VOCAB)
    parser.add_argument("--keep-dropout", action="store_true", help="DPO: DPOConfig(disable_dropout=False)")
    opts, rest = parser.parse_known_args(argv)
    if opts.row == "dpo-peft" and "--lora" not in rest:
        raise SystemExit("trl_matrix: --row dpo-peft trains a LoRA model. HINT: add --lora")

    def make(**kwargs: Any) -> Any:
        return build(opts.row, opts.vocab, opts.keep_dropout, **kwargs)

    demo_train.main([*rest, "--vocab", str(opts.vocab)], trainer_cls=make)


if __name__ == "__main__":
    main(sys.argv[1:])
