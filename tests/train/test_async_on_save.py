"""What a callback's ``on_save`` sees with async periodic saves (issue #42 item 7), on 2 real ZeRO-2 ranks: a
callback that only reads the checkpoint (transformers' uploaders: W&B, MLflow, Neptune, ClearML, DVCLive) is told
once the checkpoint is whole, on the training thread, on every rank at the same step, with ``state.global_step``
the checkpoint's; a ``TrainerControl`` flag it sets there acts; a callback that may write into the checkpoint
(anyone's own ``on_save`` that does not say otherwise) makes the save synchronous, its files in the manifest.
A script (``PROGRAM``) wraps demo_train's trainer with the reading callback."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import transformers
from jit_helpers import ckpt_check, losses, run_logged, start_ranks, wait_for

from slurm_jit import timing
from slurm_jit.checkpoint import protocol
from slurm_jit.train import save_callbacks, stop_record
from slurm_jit.train.async_save import fault_points
from slurm_jit.train.trainer import FAULT_SAVE_SLEEP_ENV

PROGRAM = '''
import json, os, sys
import transformers
from slurm_jit import demo_train
from slurm_jit.checkpoint import protocol
from slurm_jit.train.trainer import JitTrainer
RANK, SIDE = int(os.environ.get("RANK", "0")), os.environ["TOLD_OUT"]
STOP_AT = int(os.environ.get("TOLD_STOP_AT", "-1"))

class Uploader(transformers.TrainerCallback):
    """An uploader's on_save: reads checkpoint-<global_step> (here: the protocol's verdict), writes nothing in it."""
    slurm_jit_writes_checkpoint = False
    trainer = None
    def on_save(self, args, state, control, **kw):
        ckpt = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        status = protocol.inspect(ckpt, state.global_step).status.value
        live = self.trainer.model_wrapped.global_steps  # the engine's step: where training is now
        with open(os.path.join(SIDE, f"told-{RANK}.jsonl"), "a") as f:
            f.write(json.dumps({"step": state.global_step, "status": status, "at_engine_step": live}) + "\\n")
        assert status == "complete", f"on_save of checkpoint-{state.global_step}: {status}"
        if state.global_step == STOP_AT:
            control.should_training_stop = True
        return control

def make_trainer(**kwargs):
    cb = Uploader()
    kwargs["callbacks"] = list(kwargs.get("callbacks") or []) + [cb]
    cb.trainer = JitTrainer(**kwargs)
    return cb.trainer

if __name__ == "__main__":
    demo_train.main(trainer_cls=make_trainer)
'''
BACKGROUND_STALL_S = 1.0  # every background write (and the synchronous final save) stalls: on_save must wait
STOP_WITHIN_S = 120  # from the signal to both ranks gone (~10-30 s on 2 loaded cores)


def _program(tmp_path: Path) -> tuple[list[str], Path]:
    script, side = tmp_path / "uploader.py", tmp_path / "side"
    script.write_text(PROGRAM)
    side.mkdir(exist_ok=True)
    return [str(script)], side


def _told(side: Path, rank: int) -> list[dict[str, object]]:
    path = side / f"told-{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.deepspeed
def test_a_reading_callback_is_told_once_per_async_save_when_the_checkpoint_is_complete(tmp_path: Path) -> None:
    """Periodic saves at 2, 4, 6 in the background (their writes stalled), the final one at 7: every rank's
    on_save runs once per checkpoint, each time complete by the protocol, the periodic ones after training went on
    (on_save ran inside the save before, while the background write had written nothing: ``incomplete``)."""
    program, side = _program(tmp_path)
    out = tmp_path / "out"
    result = run_logged(out, ["--max-steps", "7", "--save-steps", "2", "--async-periodic-saves"],
                        {"TOLD_OUT": str(side), FAULT_SAVE_SLEEP_ENV: str(BACKGROUND_STALL_S)}, program)
    assert result.codes == [0, 0], result.log[-4000:]
    for rank in (0, 1):
        told = _told(side, rank)
        assert [(t["step"], t["status"]) for t in told] == [(s, "complete") for s in (2, 4, 6, 7)], (rank, told)
        for t in told[:3]:  # told at a later step boundary (or in the next save's wait), never inside its own save
            assert t["at_engine_step"] > t["step"], (rank, told)  # type: ignore[operator]
    blocked = {r["step"] for r in timing.read_records(out) if r["event"] == "save_blocked"}
    assert blocked == {2, 4, 6}, blocked  # the periodic saves were async
    assert "written synchronously" not in result.log, result.log[-3000:]


@pytest.mark.deepspeed
def test_should_training_stop_set_in_a_deferred_on_save_stops_training(tmp_path: Path) -> None:
    """The callback asks to stop when told about checkpoint-2: training stops at the boundary where it was told (a
    step or a few after 2, not at 40), and every rank stops at the same step."""
    program, side = _program(tmp_path)
    out = tmp_path / "out"
    result = run_logged(out, ["--max-steps", "40", "--save-steps", "2", "--async-periodic-saves"],
                        {"TOLD_OUT": str(side), "TOLD_STOP_AT": "2", FAULT_SAVE_SLEEP_ENV: "0.5"}, program)
    assert result.codes == [0, 0], result.log[-4000:]
    told = {rank: _told(side, rank) for rank in (0, 1)}
    assert told[0][0]["step"] == 2 and told[0][0]["at_engine_step"] == told[1][0]["at_engine_step"], told
    stopped_at = int(told[0][0]["at_engine_step"])  # type: ignore[call-overload]
    assert 2 < stopped_at < 40, told
    saved = sorted(int(p.name.removeprefix("checkpoint-")) for p in out.glob("checkpoint-*"))
    for rank in (0, 1):  # every checkpoint written told once, complete (one still in flight: by the end's wait)
        assert [(t["step"], t["status"]) for t in told[rank]] == [(s, "complete") for s in saved], (rank, told)
    assert max(step for step, _ in losses(out)) == stopped_at, losses(out)
    record = stop_record.read(out)
    assert record is not None and record["state"] == "finished" and record["step"] == stopped_at, record


@pytest.mark.deepspeed
def test_a_jit_stop_tells_the_save_it_waited_for_before_its_own(tmp_path: Path) -> None:
    """SIGTERM while the async save of step 4 is still being written (its first file written, the rest held 5 s; no
    signal lead known: the stop waits for it): before the JIT checkpoint is written, the callbacks are told about
    checkpoint-4, complete; then about the JIT checkpoint. Every rank, once each."""
    program, side = _program(tmp_path)
    out = tmp_path / "out"
    ranks = start_ranks(out, ["--max-steps", "12", "--save-steps", "4", "--async-periodic-saves", "--kill-wait",
                              "0", "--step-sleep", "1.0"],
                        env={"TOLD_OUT": str(side), fault_points.FAULT_ASYNC_ENV: "write:4:5"}, program=program)
    wait_for(ranks, "step 4's write stalled", lambda: all(
        fault_points.STALLED % ("write", 4, r) in ranks.log(r) for r in (0, 1)))
    for rank in (0, 1):
        ranks.signal(rank, signal.SIGTERM)
    codes = ranks.wait(STOP_WITHIN_S)
    assert codes == [0, 0], ranks.log(0)[-3000:]
    record = stop_record.read(out)
    assert record is not None and record["state"] == "jit_stop" and record["step"] > 4, record
    for rank in (0, 1):
        told = [(t["step"], t["status"]) for t in _told(side, rank)]
        assert told == [(4, "complete"), (record["step"], "complete")], (rank, told)


@pytest.mark.deepspeed
def test_a_callback_that_writes_into_the_checkpoint_makes_the_save_synchronous(tmp_path: Path) -> None:
    """demo_train's --on-save-file callback writes a file into the checkpoint and rewrites config.json from its own
    on_save (it does not say it only reads): the periodic saves are synchronous (one line says why), what it wrote
    is in each manifest, and ckpt-check --deep finds every checkpoint complete (after the manifest it would be
    unlisted, and the rewrite ``corrupt``)."""
    out = tmp_path / "out"
    result = run_logged(out, ["--max-steps", "4", "--save-steps", "2", "--async-periodic-saves",
                              "--on-save-file", "extra.txt"])
    assert result.codes == [0, 0], result.log[-4000:]
    assert result.log.count("written synchronously") == 1, result.log[-4000:]  # rank 0, once per train()
    assert not [r for r in timing.read_records(out) if r["event"] == "save_blocked"]
    for step in (2, 4):
        manifest = json.loads((out / f"checkpoint-{step}" / protocol.MANIFEST_NAME).read_text())
        assert "extra.txt" in manifest["files"], manifest["files"].keys()
    check = json.loads(ckpt_check(out, "--deep", "--json").stdout)
    assert {c["step"]: c["status"] for c in check["checkpoints"]} == {2: "complete", 4: "complete"}, check


class _OwnOnSave(transformers.TrainerCallback):
    def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        return control


class _SaysItReads(_OwnOnSave):
    slurm_jit_writes_checkpoint = False


class _NoOnSave(transformers.TrainerCallback):
    pass


def test_which_callbacks_may_write_into_the_checkpoint() -> None:
    from transformers.integrations import integration_utils  # noqa: PLC0415

    uploaders = [getattr(integration_utils, name) for name in
                 ("WandbCallback", "MLflowCallback", "NeptuneCallback", "ClearMLCallback", "DVCLiveCallback")]
    for cls in uploaders:  # transformers' own: they read checkpoint-N (upload it), never write into it
        assert not save_callbacks.class_may_write(cls), cls
    assert not save_callbacks.may_write(_NoOnSave())
    assert not save_callbacks.may_write(_SaysItReads())
    assert save_callbacks.may_write(_OwnOnSave())  # anyone's own on_save: it may write (sync, as before)
    declared = _SaysItReads()
    declared.slurm_jit_writes_checkpoint = True  # an instance may say otherwise than its class
    assert save_callbacks.may_write(declared)
