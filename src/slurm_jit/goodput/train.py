"""The training every ``tools/goodput`` system runs: ``slurm_jit.demo_train`` (its model, data and flags) with the
probe's callback, one process per rank::

    python -m slurm_jit.goodput.train EVENTS_DIR --output-dir OUT --max-steps 1800 ... [--trainer plain]

With ``--trainer plain`` (systems (a) and (b)) it resumes as a user's script does: ``resume_from_checkpoint`` of
the newest ``checkpoint-*`` directory (transformers' ``get_last_checkpoint``), or a fresh start; the JitTrainer
(system (c)) is given ``--resume`` and picks its newest complete checkpoint itself. demo_train takes no extra
callback, so the probe is added at its one seam, the function that lists its callbacks.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the imports below: they are part of the restart

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

from slurm_jit.goodput import probe  # noqa: E402

USAGE = "usage: python -m slurm_jit.goodput.train EVENTS_DIR [demo_train options]"


def newest_checkpoint(output_dir: str) -> str | None:
    """What a plain Trainer user resumes from: the highest-numbered checkpoint directory, complete or not."""
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0].startswith("-"):
        raise SystemExit(f"goodput.train: no events directory. HINT: {USAGE}")
    events_dir, rest = args[0], args[1:]
    rank = int(os.environ.get("SLURM_PROCID", os.environ.get("RANK", "0")))
    log = probe.EventLog(events_dir, rank)
    log.write("start", t_process=probe.process_start_time(), t_module=STARTED)
    import deepspeed  # noqa: F401 - the imports every start pays, timed apart from the engine
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from slurm_jit import demo_train

    log.write("imports")
    options = demo_train.parse_args(rest)
    if options.trainer == "plain" and options.resume_from is None:
        newest = newest_checkpoint(options.output_dir)
        if newest is not None:
            rest += ["--resume-from", newest]
    listed = demo_train._callbacks

    def with_probe(args: argparse.Namespace, rank: int) -> list[Any]:
        return [*listed(args, rank), probe.callback(events_dir, log)]

    demo_train._callbacks = with_probe
    demo_train.main(rest)


if __name__ == "__main__":
    main()
