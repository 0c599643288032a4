"""demo_train's callbacks: the loss/eval logs the tests compare, the sleeps that pace a run for Slurm's time
limit, the step-time log, the exact-state dumps and the test hooks (writes into checkpoints, a stop or a failure at
a known step, a stalled step, a slow end of training)."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any


def step_sleep_s(args: argparse.Namespace) -> float:
    """--step-sleep, or --step-sleep-requeued in a requeued run: a test that waits for a time-limit warning slows
    the first run only, and the requeued run finishes the rest at full speed."""
    requeued = os.environ.get("SLURM_RESTART_COUNT", "0").strip() not in ("", "0")
    if requeued and args.step_sleep_requeued is not None:
        return float(args.step_sleep_requeued)
    return float(args.step_sleep)


def callbacks(args: argparse.Namespace, rank: int) -> list[Any]:
    import transformers

    out_dir = args.output_dir

    class LossLog(transformers.TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            logs = kwargs.get("logs")
            if rank == 0 and logs and "loss" in logs:
                with open(os.path.join(out_dir, "losses-rank0.jsonl"), "a", encoding="utf-8") as f:
                    f.write(json.dumps({"step": state.global_step, "loss": logs["loss"],
                                        "lr": logs.get("learning_rate")}) + "\n")
            if rank == 0 and logs:  # every value logged but the timings: what a tracker shows, compared bitwise
                kept = {k: v for k, v in logs.items() if "runtime" not in k and "per_second" not in k}
                with open(os.path.join(out_dir, "logs-rank0.jsonl"), "a", encoding="utf-8") as f:
                    f.write(json.dumps({"step": state.global_step, **kept}) + "\n")
            if rank == 0 and logs and "eval_loss" in logs:
                with open(os.path.join(out_dir, "evals-rank0.jsonl"), "a", encoding="utf-8") as f:
                    f.write(json.dumps({"step": state.global_step, "eval_loss": logs["eval_loss"]}) + "\n")

    sleep_s = step_sleep_s(args)

    class Sleep(transformers.TrainerCallback):
        def on_step_end(self, *a: Any, **kw: Any) -> None:
            if sleep_s:
                time.sleep(sleep_s)

        def on_prediction_step(self, *a: Any, **kw: Any) -> None:
            if args.eval_sleep:
                time.sleep(args.eval_sleep)

    class StepTimes(transformers.TrainerCallback):
        def on_step_end(self, *a: Any, **kw: Any) -> None:
            if args.step_times and rank == 0:
                with open(os.path.join(out_dir, "step-times-rank0.jsonl"), "a", encoding="utf-8") as f:
                    f.write(json.dumps({"time": time.monotonic()}) + "\n")

    callbacks = [LossLog(), Sleep(), StepTimes(), *_test_callbacks(args, rank)]
    if args.dump_state_at:
        callbacks.append(_state_dump_callback(args, rank))
    return callbacks


def _state_dump_callback(args: argparse.Namespace, rank: int) -> Any:
    import transformers

    from slurm_jit import exactness

    steps = {int(s) for s in args.dump_state_at.split(",") if s}
    state_dir = os.path.join(args.output_dir, "exact-state")

    class DumpState(transformers.TrainerCallback):
        trainer: Any = None  # set once the trainer exists

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            # a resume at a listed step: the state right after the load (RNGs are restored later, at the epoch)
            if state.global_step in steps:
                exactness.dump(self.trainer, state_dir, state.global_step, rank)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step in steps:
                exactness.dump(self.trainer, state_dir, state.global_step, rank)

    return DumpState()


def _test_callbacks(opts: argparse.Namespace, rank: int) -> list[Any]:
    """What the tests need: a callback that writes into checkpoints, a stop at a known step, slow cleanup, a
    failure."""
    import signal

    import transformers

    class SaveHooks(transformers.TrainerCallback):
        """An on_save of the user's own (it may write into the checkpoint: told before the manifest, the save
        synchronous); only where a test asks for it, so that async saves stay async otherwise."""

        stalled_in_save = False

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if (opts.stall_in == "save" and 0 <= opts.stall_at_step <= state.global_step
                    and opts.stall_rank in (-1, rank) and not SaveHooks.stalled_in_save):
                SaveHooks.stalled_in_save = True
                time.sleep(opts.stall_s)  # a stuck writer inside the save, before its manifest
            if opts.on_save_file and rank == 0:
                ckpt = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
                with open(os.path.join(ckpt, opts.on_save_file), "w", encoding="utf-8") as f:
                    f.write(f"written by on_save at step {state.global_step}\n")
                if os.path.isfile(os.path.join(ckpt, "config.json")):  # rewrite a file the manifest lists
                    with open(os.path.join(ckpt, "config.json"), "a", encoding="utf-8") as f:
                        f.write("\n")

    class TestHooks(transformers.TrainerCallback):
        failed = False

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if opts.stall_in == "step" and state.global_step == opts.stall_at_step and opts.stall_rank in (-1, rank):
                time.sleep(opts.stall_s)  # user code that blocks (a hang when --stall-s is huge)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            stall_here = opts.stall_in == "step_end" and state.global_step == opts.stall_at_step
            if stall_here and opts.stall_rank in (-1, rank):
                time.sleep(opts.stall_s)  # this rank's side-group stop round comes late
            if opts.signal_self_at_step and state.global_step == opts.signal_self_at_step:
                os.kill(os.getpid(), signal.SIGTERM)
            if (opts.fail_at_step and state.global_step == opts.fail_at_step and not TestHooks.failed
                    and opts.fail_rank in (-1, rank)):
                TestHooks.failed = True
                raise RuntimeError(f"demo_train: failure injected at step {state.global_step}")

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if opts.slow_train_end and state.global_step < state.max_steps:
                time.sleep(opts.slow_train_end)
            stall_here = opts.stall_in == "train_end" and 0 <= opts.stall_at_step <= state.global_step
            if stall_here and opts.stall_rank in (-1, rank):
                time.sleep(opts.stall_s)  # this rank ends late (an upload, a slow tracker): its peers wait for it

    return [TestHooks(), *([SaveHooks()] if opts.on_save_file or opts.stall_in == "save" else [])]
