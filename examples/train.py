"""A plain Hugging Face training script with the README's two-line change: the quickstart's ``train.py``.

Tiny GPT-2 from a config on random tokens, DeepSpeed ZeRO-2 on CPU ranks (``use_cpu=True``), one process per rank::

    srun python -m slurm_jit.launch.task -- python examples/train.py OUT_DIR
"""

from __future__ import annotations

import logging
import sys

import torch
import transformers

from slurm_jit import JitTrainer  # change 1 of 2: was `from transformers import Trainer`

SEQ_LEN = 32
VOCAB = 128


class RandomTokens(torch.utils.data.Dataset):
    """Fixed random token sequences (seeded): the labels are the inputs, as for causal language modelling."""

    def __init__(self, samples: int) -> None:
        self.tokens = torch.randint(0, VOCAB, (samples, SEQ_LEN), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def main(out_dir: str, max_steps: int = 8000) -> None:
    handler = logging.StreamHandler()  # optional: slurm_jit's INFO lines (each save, its sizes) in the job log
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("slurm_jit").addHandler(handler)
    logging.getLogger("slurm_jit").setLevel(logging.INFO)
    transformers.set_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=64, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)  # GPT-2's 50256 is past this vocabulary
    args = transformers.TrainingArguments(
        output_dir=out_dir, max_steps=max_steps, per_device_train_batch_size=4, logging_steps=500,
        save_steps=1000, use_cpu=True, report_to=[], disable_tqdm=True,
        deepspeed={"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
                   "gradient_accumulation_steps": "auto"},
    )
    trainer = JitTrainer(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=RandomTokens(4096))
    trainer.train(resume_from_checkpoint=True)  # change 2 of 2: the newest resumable checkpoint, or a fresh start


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
