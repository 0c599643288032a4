"""The LoRA rows (issue 19): what a JIT save of a LoRA model writes over the trainable state's minimum, and how
long it takes beside the full fine-tune of the same model (row save_zero2's run)."""

from __future__ import annotations

from pathlib import Path

from slurm_jit.bench import runs, save
from slurm_jit.bench.rows import NO_TARGET, Row, measured

LORA_ARGS = ("--lora",)  # demo_train: a LoRA of rank 4 on the attention projections, the base frozen
RATIO_DIGITS = 4


def rows(out: Path, model: runs.Model, full: save.JitSave) -> list[Row]:
    lora = save.run_ours(out, model, 2, *LORA_ARGS)
    return [
        bytes_row(lora),
        measured("lora_save_over_full", lora.save_s / full.save_s, "ratio", NO_TARGET,
                 "ZeRO-2: a LoRA model's JIT save time over the full fine-tune's of the same model (row "
                 "bytes_over_needed_zero2's run), from the timing log",
                 lora_save_s=round(lora.save_s, 3), full_save_s=round(full.save_s, 3),
                 lora_bytes=lora.total_bytes, full_bytes=full.total_bytes,
                 lora_bytes_over_full=round(lora.total_bytes / full.total_bytes, 5)),
    ]


def bytes_row(lora: save.JitSave) -> Row:
    """The manifest's measure (as every bytes row), with the files it rests on: the optimizer shards (the adapters'
    fp32 master weights and Adam moments: the trainable state's minimum) and the model-states file (placeholders
    for the adapters, DeepSpeed's bookkeeping, no weight)."""
    row = save.bytes_row("bytes_over_needed_lora", lora, "ZeRO-2, LoRA r=4 (frozen base and the adapters' module "
                         "copy left out)")
    tag = [d for d in lora.ckpt.glob("global_step*") if d.is_dir()]
    shards = sum(p.stat().st_size for d in tag for p in d.glob("*optim_states.pt"))
    states = sum(p.stat().st_size for d in tag for p in d.glob("mp_rank_*_model_states.pt"))
    row.details.update(optimizer_shards_bytes=shards, model_states_bytes=states,
                       written_over_shards=round(lora.total_bytes / shards, RATIO_DIGITS) if shards else None)
    return row
