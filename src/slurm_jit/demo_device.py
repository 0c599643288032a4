"""demo_train's device: ``--device cuda|auto`` (bf16, deterministic algorithms, a rank's GPU, the gloo group for
ranks sharing one GPU). The CPU path needs nothing from here."""

from __future__ import annotations

import os
import sys

# cuBLAS's deterministic workspace (CUDA >= 10.2 needs one of :4096:8 or :16:8 for use_deterministic_algorithms;
# https://docs.nvidia.com/cuda/cublas/index.html#results-reproducibility): read when cuBLAS starts, so set first
CUBLAS_WORKSPACE = ":4096:8"


def cuda_setup(device: str, dist_backend: str) -> bool:
    """True when this rank trains on CUDA (``--device cuda``, or ``auto`` with a GPU seen): deterministic
    algorithms on, this rank's GPU chosen (ranks beyond the node's GPUs share them, over gloo only) and, for
    ``--dist-backend gloo``, the model's process group made here, before accelerate would make an NCCL one.
    ``--device cuda`` without CUDA: one line with a HINT (exit 1)."""
    if device == "cpu":
        return False
    import torch

    if not torch.cuda.is_available():
        if device == "auto":
            return False
        built = f"torch {torch.__version__} (CUDA {torch.version.cuda})" if torch.version.cuda \
            else f"torch {torch.__version__}, a build without CUDA"
        raise SystemExit(f"demo_train: --device cuda, but {built} sees no GPU. HINT: run it on a GPU node with a "
                         "CUDA build of torch in this interpreter, or pass --device cpu")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    # warn_only=False: under warn_only, SDPA's flash and memory-efficient backward stay non-deterministic
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    gpus, local_rank = torch.cuda.device_count(), int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank >= gpus:
        if dist_backend != "gloo":
            raise SystemExit(f"demo_train: local rank {local_rank} has no GPU of its own ({gpus} on this node) and "
                             "NCCL refuses two ranks on one GPU. HINT: --dist-backend gloo, or one rank per GPU")
        os.environ["LOCAL_RANK"] = str(local_rank % gpus)  # accelerate and DeepSpeed take cuda:LOCAL_RANK
        print(f"demo_train: rank {os.environ.get('RANK', '0')} shares cuda:{local_rank % gpus} ({gpus} GPU(s), "
              f"{os.environ.get('LOCAL_WORLD_SIZE', '?')} local ranks), the model's collectives over gloo",
              file=sys.stderr, flush=True)
    if dist_backend == "gloo" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist

        # torch's own init (env://), not deepspeed.init_distributed: that binds the group to cuda:LOCAL_RANK
        # (device_id), which ranks sharing a GPU should not; DeepSpeed and accelerate then find it made
        dist.init_process_group(backend="gloo")
    return True
