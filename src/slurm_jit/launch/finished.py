"""Whether the training in an output directory already reached its end, for the launcher's ``resume:`` lines: the
plan of a resubmission and ``status`` (issue #41 item 6).

The stop record (train/stop_record.py) says ``finished`` once ``train()`` returned at its end. The gate's "resume
from checkpoint-2000" then reads as if work were left: the line says the training finished, and what a new run of
the same command does (resume and stop at once; or, where the last checkpoint is older, train those steps again).
"""

from __future__ import annotations

import os

from slurm_jit.checkpoint import names
from slurm_jit.launch import gate
from slurm_jit.train import stop_record


def resume_line(out_dir: str | os.PathLike[str], checked: gate.GateResult) -> str:
    """The ``resume:`` line's text: the gate's, said as the end of a finished training where the record says so."""
    message = checked.message.removeprefix("ckpt-check gate: ")
    record = stop_record.read(out_dir)
    step = record.get("step") if record and record.get("state") == "finished" else None
    if not checked.ok or not isinstance(step, int) or isinstance(step, bool):
        return message
    point = checked.resume_point
    _, _, rest = message.partition("; ")  # the gate's further parts (passed over, quarantined, in use)
    more = f"; {rest}" if rest else ""
    found = names.CHECKPOINT_RE.fullmatch(os.path.basename(point)) if point else None
    at = int(found.group(1)) if found else None
    if point and at == step:
        return (f"training finished at step {step}: a new run resumes from {point} and trains only if its command "
                f"asks for more steps{more}")
    if point and at is not None and at < step:
        return (f"training finished at step {step}, past the newest resumable checkpoint: a new run resumes from "
                f"{point} and trains steps {at + 1}-{step} again{more}")
    return f"training finished at step {step} (its stop record); {message}"
