"""TRL's ``SFTTrainer`` with JIT checkpoints, in each of the three ways docs/stacks.md describes (``--jit-as``):

- ``with_jit``: ``slurm_jit.with_jit(SFTTrainer)`` (the class ``JitSFTTrainer(JitTrainer, SFTTrainer)``);
- ``subclass``: ``class MySFTTrainer(JitTrainer, SFTTrainer)`` written out;
- ``drop-in``: ``transformers.Trainer = JitTrainer`` before TRL is imported (TRL's SFTTrainer then subclasses
  JitTrainer; its constructor takes no ``jit_config``: JitConfig's defaults apply).

The three are one training: a run stopped under one and resumed under another continues bitwise. A tiny GPT-2
from a config, a word-level tokenizer built in memory and an in-memory text dataset, tokenized by TRL itself;
everything else (flags, DeepSpeed config, loss log, launch) is demo_train's. One process per rank::

    srun python examples/trl_sft.py --jit-as with_jit --output-dir OUT --max-steps 40 --resume
    python -m pytest tests/train/test_trl_sft_resume.py   # 2 local CPU ranks, stopped and resumed
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # TRL pings the Hub from rank 0 at construction
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from slurm_jit import demo_train  # noqa: E402 - after the environment above

JIT_AS = ("with_jit", "subclass", "drop-in")
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")


def trainer_class(jit_as: str) -> type:
    """The SFTTrainer with JIT, made the ``jit_as`` way."""
    from slurm_jit import JitTrainer

    if jit_as == "drop-in":
        import transformers  # after slurm_jit's import, which re-creates the transformers module once

        transformers.Trainer = JitTrainer
        from trl import SFTTrainer

        return SFTTrainer
    from trl import SFTTrainer

    if jit_as == "with_jit":
        from slurm_jit import with_jit

        return with_jit(SFTTrainer)

    class MySFTTrainer(JitTrainer, SFTTrainer):
        """SFTTrainer with JIT checkpoints, written out."""

    return MySFTTrainer


def tokenizer(vocab: int) -> Any:
    """A word-level tokenizer over ``w3 .. w<vocab-1>`` and the special tokens, built in memory (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    words.update({f"w{i}": i for i in range(len(SPECIAL_TOKENS), vocab)})
    inner = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def texts(tokens: Any, vocab: int) -> Any:
    """demo_train's deterministic token rows as a ``datasets.Dataset`` of text (TRL tokenizes it)."""
    from datasets import Dataset

    first = len(SPECIAL_TOKENS)
    rows = [" ".join(f"w{first + int(t) % (vocab - first)}" for t in row) for row in tokens.data]
    return Dataset.from_dict({"text": rows})


def build(cls: type, jit_as: str, vocab: int, *, model: Any, args: Any, train_dataset: Any, eval_dataset: Any,
          jit_config: Any, **rest: Any) -> Any:
    """demo_train's Trainer arguments made SFTTrainer's: an SFTConfig, the tokenizer and text datasets."""
    from trl import SFTConfig

    config = SFTConfig(**{**args.to_dict(), "hub_token": args.hub_token, "dataset_text_field": "text"})
    kwargs = dict(model=model, args=config, train_dataset=texts(train_dataset, vocab),
                  eval_dataset=None if eval_dataset is None else texts(eval_dataset, vocab),
                  processing_class=tokenizer(vocab), **rest)
    if jit_as != "drop-in":
        kwargs["jit_config"] = jit_config
    return cls(**kwargs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--jit-as", choices=JIT_AS, default="with_jit")
    parser.add_argument("--vocab", type=int, default=demo_train.VOCAB)
    opts, rest = parser.parse_known_args(argv)
    cls = trainer_class(opts.jit_as)

    def make(**kwargs: Any) -> Any:
        return build(cls, opts.jit_as, opts.vocab, **kwargs)

    demo_train.main([*rest, "--vocab", str(opts.vocab)], trainer_cls=make)


if __name__ == "__main__":
    main(sys.argv[1:])
