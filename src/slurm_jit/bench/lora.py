"""The LoRA rows (issue 19): what a JIT save of a LoRA model writes over the trainable state's minimum, and how
long it takes beside the full fine-tune of the same model (row save_zero2's run)."""

from __future__ import annotations

from pathlib import Path

from slurm_jit.bench import runs, save
from slurm_jit.bench.rows import NO_TARGET, Row, measured

LORA_ARGS = ("--lora",)  # demo_train: a LoRA of rank 4 on the attention projections, the base frozen


def rows(out: Path, model: runs.Model, full: save.JitSave) -> list[Row]:
    lora = save.run_ours(out, model, 2, *LORA_ARGS)
    return [
        save.bytes_row("bytes_over_needed_lora", lora, "ZeRO-2, LoRA r=4 (frozen base left out)"),
        measured("lora_save_over_full", lora.save_s / full.save_s, "ratio", NO_TARGET,
                 "ZeRO-2: a LoRA model's JIT save time over the full fine-tune's of the same model (row "
                 "bytes_over_needed_zero2's run), from the timing log",
                 lora_save_s=round(lora.save_s, 3), full_save_s=round(full.save_s, 3),
                 lora_bytes=lora.total_bytes, full_bytes=full.total_bytes,
                 lora_bytes_over_full=round(lora.total_bytes / full.total_bytes, 5)),
    ]
