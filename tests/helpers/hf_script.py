"""A training script in the shape of transformers' examples (run_clm.py), ported by the docs' recipe: arguments read
with ``HfArgumentParser``, ``Trainer`` -> ``JitTrainer``, the resume, and the work every example does after
``train()`` (the final model, ``train_results.json``, the log history). Tiny GPT-2 from a config on fixed random
tokens; one process, or the ranks of ``local_ranks`` with ``--deepspeed ds.json``.

``--signal_at_step K`` sends this process SIGTERM at step K (rank 0 only with ``--signal_rank0_only``), as Slurm's
warning would. ``--return_after_stop``: ``JitConfig(exit_after_jit_stop=False)`` and the quickstart's check of
``trainer.jit_stopped``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import dataclass, field

import torch
import transformers

from slurm_jit import JitConfig, JitTrainer

SEQ_LEN = 16
VOCAB = 64


@dataclass
class ScriptArguments:
    signal_at_step: int = field(default=0, metadata={"help": "SIGTERM to this process at this step (0: none)"})
    return_after_stop: bool = field(default=False, metadata={"help": "JitConfig(exit_after_jit_stop=False)"})
    samples: int = field(default=256)
    user_train_loss_every: int = field(default=0, metadata={"help": "compute_loss logs its own train_loss"})


class Tokens(torch.utils.data.Dataset):
    def __init__(self, samples: int) -> None:
        self.tokens = torch.randint(0, VOCAB, (samples, SEQ_LEN), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class SignalAt(transformers.TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class OwnTrainLoss(JitTrainer):
    """A subclass that logs a value of its own named train_loss (a user's metric, not the training's summary)."""

    every = 0

    def compute_loss(self, model, inputs, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.every and self.model.training and self.state.global_step % self.every == 0:
            self.log({"train_loss": 123.0})
        return super().compute_loss(model, inputs, *args, **kwargs)


def main() -> None:
    parser = transformers.HfArgumentParser((ScriptArguments, transformers.TrainingArguments))
    script_args, training_args = parser.parse_args_into_dataclasses()
    transformers.set_seed(training_args.seed)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=32, n_layer=1, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    OwnTrainLoss.every = script_args.user_train_loss_every
    trainer = OwnTrainLoss(
        model=transformers.GPT2LMHeadModel(config), args=training_args, train_dataset=Tokens(script_args.samples),
        callbacks=[SignalAt(script_args.signal_at_step)] if script_args.signal_at_step else None,
        jit_config=JitConfig(kill_wait_s=0, exit_after_jit_stop=not script_args.return_after_stop),
    )
    # the recipe's resume: the script's own --resume_from_checkpoint, else the newest resumable checkpoint
    train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint or True)
    if trainer.jit_stopped:  # reached only with exit_after_jit_stop=False: the job is on its way out
        if trainer.is_world_process_zero():
            open(os.path.join(training_args.output_dir, "returned-after-stop"), "w").close()
        return
    # the end of every example script: none of it may run in a JIT stop's grace period
    trainer.save_model()
    metrics = train_result.metrics
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    if trainer.is_world_process_zero():
        with open(os.path.join(training_args.output_dir, "log-history.json"), "w", encoding="utf-8") as f:
            json.dump(trainer.state.log_history, f)


if __name__ == "__main__":
    sys.exit(main())
