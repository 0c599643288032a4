"""A GRPO-style JitTrainer subclass: ``get_train_dataloader()`` overridden, batch x ``steps_per_generation``.

As in TRL's GRPOTrainer, each loaded batch is ``steps_per_generation`` times the per-step batch (one generation
serves several optimizer steps), and the sampler repeats every generation batch ``steps_per_generation`` times,
so that the Trainer's loop still takes one loaded batch per step. Each step trains on its own slice of the
loaded batch.

What makes it resume right: the Trainer resumes by skipping ``global_step`` loaded batches, which lands on the
right generation batch because of the repeats; the slice is derived from ``state.global_step`` (restored from
the checkpoint), never from a counter kept on the trainer (which restarts at 0 in the resumed job and would pick
the wrong slice whenever the stop falls inside a generation). The loader is built through ``_get_dataloader`` so
that JitTrainer's DataLoader-worker signal masking applies to it.

Runs as it is, one process per rank (tiny GPT-2 from a config; the data, flags and launch are demo_train's)::

    srun python examples/grpo_style.py --steps-per-generation 3 --output-dir OUT --max-steps 20 --resume
    python -m pytest tests/train/test_compat_matrix.py -k grpo   # 2 local CPU ranks, stopped and resumed
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Iterator
from typing import Any

import torch

from slurm_jit import demo_train
from slurm_jit.train.refusals import JitRefusal
from slurm_jit.train.trainer import JitTrainer


class RepeatGenerations(torch.utils.data.Sampler[int]):
    """A seeded permutation, cut into global generation batches, each yielded ``repeats`` times in a row."""

    def __init__(self, size: int, generation_batch: int, repeats: int, seed: int) -> None:
        self.size, self.generation_batch, self.repeats, self.seed = size, generation_batch, repeats, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return (self.size // self.generation_batch) * self.generation_batch * self.repeats

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        for start in range(0, self.size - self.generation_batch + 1, self.generation_batch):
            for _ in range(self.repeats):
                yield from order[start:start + self.generation_batch]


class GRPOStyleTrainer(JitTrainer):
    """JitTrainer whose loaded batches each serve ``steps_per_generation`` steps."""

    def __init__(self, *args: Any, steps_per_generation: int = 2, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.args.gradient_accumulation_steps != 1:
            raise JitRefusal("this example slices per optimizer step. HINT: gradient_accumulation_steps=1")
        if isinstance(steps_per_generation, bool) or not isinstance(steps_per_generation, int) \
                or steps_per_generation < 1:
            raise JitRefusal(f"steps_per_generation={steps_per_generation!r}. HINT: a whole number >= 1, e.g. "
                             "--steps-per-generation 3")
        self.steps_per_generation = steps_per_generation

    def get_train_dataloader(self) -> Any:
        per_device = self._train_batch_size * self.steps_per_generation
        # accelerate deals the loaded batches to the ranks in turn: repeat the global batch, so each rank sees
        # its own part of it steps_per_generation times.
        sampler = RepeatGenerations(len(self.train_dataset), per_device * self.args.world_size,
                                    self.steps_per_generation, self.args.seed)
        return self._get_dataloader(dataset=self.train_dataset, description="Training", batch_size=per_device,
                                    sampler_fn=lambda _: sampler, is_training=True)

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
        piece = self.state.global_step % self.steps_per_generation
        size = self._train_batch_size
        step_inputs = {k: v[piece * size:(piece + 1) * size] if torch.is_tensor(v) else v for k, v in inputs.items()}
        # The Trainer counted the label tokens of the whole loaded batch; this step trains on one slice: None
        # makes the loss the slice's mean (gradient_accumulation_steps is 1).
        return super().training_step(model, step_inputs, None)


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--steps-per-generation", type=int, default=2)
    own, rest = parser.parse_known_args()
    demo_train.main(rest, trainer_cls=functools.partial(GRPOStyleTrainer,
                                                        steps_per_generation=own.steps_per_generation))


if __name__ == "__main__":
    main()
    sys.exit(0)
