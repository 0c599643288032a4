"""demo_train with a test-only proxy around torch.distributed: every collective that slurm_jit's own code calls is
appended, one JSON line per call, to ``$TRACE_COLLECTIVES_DIR/collectives-rank<R>.jsonl`` (tests/train/
test_golden_traces.py). Run as a script with demo_train's arguments.

A call counts as slurm_jit's when the nearest frame outside torch and this file is in the slurm_jit package:
DeepSpeed's, transformers' and accelerate's own collectives (the per-step gradient reductions, DeepSpeed's save
barriers) are theirs, not ours. A line holds what does not depend on timing or on where the code lives: the op, the
group (``world`` or ``side:<size>:<backend>``), each tensor's dtype and shape, the reduce op, src/dst, async_op, the
object list's length, the side group's timeout, and whether the training thread made the call; never a module or
function name (the trainer's rooms may move), never a tensor's values. The first line names the slurm_jit that this
rank imported. Each line is one ``os.write`` to an O_APPEND file: a SIGKILLed rank or an ``os._exit`` loses none.

``TRACE_ARGS_RANK<R>``: more demo_train arguments for rank R only (the last of an option wins), e.g. a longer
``--hang-timeout`` on the rank that only waits for the hung one.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import slurm_jit
from slurm_jit import demo_train

TRACE_DIR_ENV = "TRACE_COLLECTIVES_DIR"
RANK_ARGS_ENV = "TRACE_ARGS_RANK%s"
# Every torch.distributed function that slurm_jit calls (grep src/slurm_jit for "dist.") and the other collectives
# and group calls it might come to call after a move: a new one shows up in the trace instead of slipping past.
TRACED = ("all_reduce", "broadcast", "barrier", "all_gather", "all_gather_object", "broadcast_object_list",
          "gather", "gather_object", "scatter", "scatter_object_list", "reduce", "reduce_scatter",
          "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv",
          "isend", "irecv", "monitored_barrier", "new_group", "destroy_process_group", "init_process_group")
TORCH_DIR = str(Path(torch.__file__).parent)
SLURM_JIT_DIR = str(Path(slurm_jit.__file__).parent)
_inside = threading.local()  # a traced function calling another (broadcast_object_list -> broadcast): once


def _group(group: Any) -> str:
    if group is None or group is dist.group.WORLD:
        return "world"
    return f"side:{dist.get_world_size(group)}:{dist.get_backend(group)}"


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"list[{len(value)}]" if not any(isinstance(v, torch.Tensor) for v in value) else \
            [_describe(v) for v in value]
    if isinstance(value, dist.ReduceOp.RedOpType):
        return str(value).rsplit(".", 1)[-1]
    if hasattr(value, "total_seconds"):
        return f"{value.total_seconds():g}s"
    return type(value).__name__  # an object (a node name, a verdict): its type, never its value


def _ours() -> bool:
    frame = sys._getframe(2)  # the caller of the traced function
    while frame is not None and (frame.f_code.co_filename == __file__
                                 or frame.f_code.co_filename.startswith(TORCH_DIR)):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(SLURM_JIT_DIR)


def _write(fd: int, line: dict[str, Any]) -> None:
    os.write(fd, (json.dumps(line) + "\n").encode())


def _traced(fd: int, op: str, call: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(call)
    def proxy(*args: Any, **kwargs: Any) -> Any:
        if getattr(_inside, "depth", 0) or not _ours():
            return call(*args, **kwargs)
        line: dict[str, Any] = {"op": op}
        if op != "init_process_group":
            line["group"] = _group(kwargs.get("group", args[0] if op == "destroy_process_group" and args else None))
        for i, value in enumerate(args):
            line[f"arg{i}"] = None if value is None else _describe(value)
        for key, value in sorted(kwargs.items()):  # backend, async_op, src, dst: the call's own constants
            if key != "group":
                plain = isinstance(value, (bool, int, str)) or value is None
                line["reduce_op" if key == "op" else key] = value if plain else _describe(value)
        if threading.current_thread() is not threading.main_thread():
            line["thread"] = "background"
        _write(fd, line)
        _inside.depth = 1
        try:
            return call(*args, **kwargs)
        finally:
            _inside.depth = 0

    return proxy


def install(trace_dir: str) -> None:
    """Wrap every TRACED function of torch.distributed; the trace goes to trace_dir/collectives-rank<RANK>.jsonl."""
    Path(trace_dir).mkdir(parents=True, exist_ok=True)
    path = Path(trace_dir) / f"collectives-rank{os.environ.get('RANK', '0')}.jsonl"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    _write(fd, {"slurm_jit": SLURM_JIT_DIR})
    for op in TRACED:
        setattr(dist, op, _traced(fd, op, getattr(dist, op)))


if __name__ == "__main__":
    install(os.environ[TRACE_DIR_ENV])
    sys.argv += os.environ.get(RANK_ARGS_ENV % os.environ.get("RANK", "0"), "").split()
    demo_train.main()
