"""Row 9: the GPU runs (bf16, NCCL for the model, gloo for the agreement side channel)."""

from __future__ import annotations

from slurm_jit.bench.rows import Row, skipped

GPU_ROWS = ("gpu_save_bw_over_disk", "gpu_agreement_overhead_median", "gpu_signal_exit_prediction")


def rows() -> list[Row]:
    import torch

    if torch.cuda.is_available():
        reason = ("a GPU is present but the CUDA variant of the runs is not implemented yet (demo_train is "
                  "CPU-only: use_cpu=True)")
    else:
        reason = "no GPU on this machine (torch.cuda.is_available() is False)"
    return [skipped(name, "ratio", "as the CPU row", "the CPU row's comparison, with CUDA, bf16 and NCCL", reason)
            for name in GPU_ROWS]
