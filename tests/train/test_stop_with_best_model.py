"""JitTrainer hardening (issue 7): upstream never deletes a checkpoint, rotation by write time, JIT saves always
resumable under save_only_model, jit_stop recorded right after the manifest, on_save before the manifest, no stop
at the last step, the owed evaluation run on resume, refusals, the side group closed after a failure.

Real DeepSpeed ranks (2 CPU ranks over gloo) with a real SIGTERM that each rank sends itself at the end of a known
step (``--signal-self-at-step``), so that the stop lands at a known step. About 5 minutes on an idle machine: the
runs are shared between the assertions.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from jit_helpers import (
    START_TIMEOUT_S,
    assert_same_losses,
    ckpt_check,
    losses,
    run_to_end,
    start_demo,
    wait_for_path,
)

from slurm_jit.checkpoint import protocol
from slurm_jit.train import stop_record
from slurm_jit.train.refusals import refused_settings

pytestmark = pytest.mark.deepspeed

# The scenario: eval_steps = save_steps = 2, metric_for_best_model="loss", save_total_limit=1; with
# save_only_model (periodic saves model-only, the JIT save full) and an on_save callback that writes a file into
# every checkpoint and rewrites config.json (a file the manifest lists).
BEST_LIMIT_1 = ["--max-steps", "10", "--eval-steps", "2", "--save-steps", "2", "--metric-for-best", "loss",
                "--save-total-limit", "1", "--save-only-model", "--on-save-file", "extra.txt", "--kill-wait", "0"]
SLOW_END_S = 60  # an on_train_end callback this slow after a stop: the SIGKILL comes while it sleeps


def _evals(out: Path) -> list[tuple[int, float]]:
    path = out / "evals-rank0.jsonl"
    return [(r["step"], r["eval_loss"]) for r in map(json.loads, path.read_text().splitlines())] if path.exists() \
        else []


def _manifest(ckpt: Path) -> dict:
    return json.loads((ckpt / protocol.MANIFEST_NAME).read_text())


def _dirs(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))


@pytest.fixture(scope="module")
def best_limit_1(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The reference run; a run that stops at step 6 (SIGTERM at the end of step 5) and is SIGKILLed 2 s after
    the JIT manifest, inside a slow on_train_end; and its resume."""
    root = tmp_path_factory.mktemp("best-limit-1")
    ref, out = root / "ref", root / "out"
    assert run_to_end(ref, BEST_LIMIT_1) == [0, 0]
    ranks = start_demo(out, [*BEST_LIMIT_1, "--signal-self-at-step", "5", "--slow-train-end", str(SLOW_END_S)])
    wait_for_path(ranks, out / "checkpoint-6" / protocol.MANIFEST_NAME)
    time.sleep(2.0)
    assert all(p.poll() is None for p in ranks.procs), ranks.log(0)[-3000:]  # still in the slow cleanup
    for rank in (0, 1):
        ranks.signal(rank, signal.SIGKILL)
    ranks.wait(10)
    stopped = {"record": stop_record.read(out), "dirs": _dirs(out), "log": ranks.log(0) + ranks.log(1),
               "check": ckpt_check(out, "--deep"),
               "manifests": {d: _manifest(out / d) for d in _dirs(out) if (out / d / protocol.MANIFEST_NAME).is_file()},
               "sizes": {d: (out / d / "config.json").stat().st_size for d in _dirs(out)
                         if (out / d / "config.json").is_file()},
               "status": {d: protocol.inspect(out / d, int(d.split("-")[1]), deep=True).status for d in _dirs(out)}}
    codes = run_to_end(out, [*BEST_LIMIT_1, "--resume"])
    resume_log = (root / "logs-out" / "rank0.log").read_text(errors="replace")
    return {"ref": ref, "out": out, "stopped": stopped, "codes": codes, "resume_log": resume_log}


def test_sigkill_after_the_manifest_leaves_jit_stop(best_limit_1: dict) -> None:
    """Item 4: jit_stop is recorded right after the manifest, before upstream's end-of-training work."""
    record = best_limit_1["stopped"]["record"]
    assert record is not None and record["state"] == "jit_stop", record
    assert Path(record["checkpoint"]).name == "checkpoint-6" and record["step"] == 6


def test_upstream_end_of_training_cleanup_keeps_the_jit_checkpoint(best_limit_1: dict) -> None:
    """Item 1 (and the README's rotation claims): with save_total_limit=1 and a best model, the JIT checkpoint
    and the best one survive; rotation deleted the older periodic checkpoint only after the new one was whole."""
    stopped = best_limit_1["stopped"]
    out = best_limit_1["out"]
    assert stopped["dirs"] == ["checkpoint-4", "checkpoint-6"], stopped["dirs"]  # 4 is the best (eval loss)
    check = stopped["check"]
    assert check.returncode == 0 and check.stdout.splitlines()[-1].endswith("checkpoint-6"), check.stdout
    state = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
    assert Path(state["best_model_checkpoint"]).name == "checkpoint-4"


def test_save_only_model_jit_save_is_full_and_periodic_saves_say_model_only(best_limit_1: dict) -> None:
    """Item 3 under DeepSpeed ZeRO-2: the JIT save holds the optimizer shards whatever save_only_model says."""
    manifests = best_limit_1["stopped"]["manifests"]
    jit = manifests["checkpoint-6"]
    assert jit["kind"] == "jit" and jit["contents"] == "full" and jit["deepspeed_tag"] == "global_step6"
    assert any("optim_states" in rel for rel in jit["files"]), sorted(jit["files"])
    assert manifests["checkpoint-4"]["contents"] == "model_only"
    assert isinstance(jit["run_id"], str) and jit["run_id"]


def test_on_save_runs_on_every_save_before_the_manifest(best_limit_1: dict) -> None:
    """Item 5: what on_save writes (extra.txt, a rewritten config.json) is in the manifest; nothing turns corrupt."""
    stopped = best_limit_1["stopped"]
    for name in ("checkpoint-4", "checkpoint-6"):
        files = stopped["manifests"][name]["files"]
        assert "extra.txt" in files, (name, sorted(files))
        assert files["config.json"]["size"] == stopped["sizes"][name]
        assert stopped["status"][name] is not protocol.Status.CORRUPT, name


def test_resume_runs_the_owed_evaluation_first_and_matches_the_uninterrupted_run(best_limit_1: dict) -> None:
    """Item 7: the evaluation skipped at step 6 runs first on resume; every evaluation and loss is the
    uninterrupted run's, bitwise; the run ends finished."""
    assert best_limit_1["codes"] == [0, 0], best_limit_1["resume_log"][-3000:]
    assert "running the evaluation owed from step 6" in best_limit_1["resume_log"]
    ref, out = best_limit_1["ref"], best_limit_1["out"]
    assert [s for s, _ in _evals(ref)] == [2, 4, 6, 8, 10]
    assert _evals(out) == _evals(ref)
    assert_same_losses(losses(out), losses(ref))
    record = stop_record.read(out)
    assert record is not None and record["state"] == "finished", record


def test_signal_at_the_last_step_finishes_normally(tmp_path: Path) -> None:
    """Item 6 (and the README's "no JIT stop at the last step", stop.json reaching finished): max_steps=6,
    SIGTERM at step 5: the final evaluation runs once, the final save is written, the record says finished."""
    out = tmp_path / "out"
    args = ["--max-steps", "6", "--eval-steps", "2", "--save-steps", "2", "--metric-for-best", "loss",
            "--kill-wait", "0", "--signal-self-at-step", "5"]
    assert run_to_end(out, args) == [0, 0]
    assert [s for s, _ in _evals(out)] == [2, 4, 6]
    record = stop_record.read(out)
    assert record is not None and record["state"] == "finished" and record["step"] == 6, record
    info = protocol.inspect(out / "checkpoint-6", 6, deep=True)
    assert info.status is protocol.Status.COMPLETE and info.kind == "final"
    assert "aborted" not in (tmp_path / "logs-out" / "rank0.log").read_text()


def test_rotation_keeps_the_checkpoint_just_written_and_resume_picks_it(tmp_path: Path, copy_run,
                                                                        jit_zero2_run: Path) -> None:
    """Item 2: checkpoint-6 of an earlier run is there; resume from checkpoint-3 (a rollback) with
    save_total_limit=1 and SIGTERM at the end of step 4: a round read at that boundary (blocking during the
    resumed run's warm-up) stops there; checkpoint-4 survives rotation and is what resume=True picks next."""
    out = copy_run(jit_zero2_run)
    args = ["--max-steps", "10", "--save-total-limit", "1", "--kill-wait", "0", "--signal-self-at-step", "4",
            "--resume-from", str(out / "checkpoint-3")]
    assert run_to_end(out, args) == [0, 0]
    record = stop_record.read(out)
    assert record is not None and record["state"] == "jit_stop" and record["step"] == 4, record
    assert (out / "checkpoint-4").is_dir(), _dirs(out)
    resolution = protocol.find_resumable(out)
    assert resolution.checkpoint is not None and resolution.checkpoint.step == 4, resolution
    assert _manifest(out / "checkpoint-4")["run_id"] == _manifest(jit_zero2_run / "checkpoint-3")["run_id"]


def test_plain_ddp_save_only_model_jit_save_resumes_exactly(tmp_path: Path) -> None:
    """Item 3 without DeepSpeed: the JIT checkpoint has optimizer, scheduler and RNG files; the resumed run's
    learning rates and losses are the uninterrupted run's (a fresh optimizer or a restarted schedule would not)."""
    args = ["--zero-stage", "0", "--max-steps", "8", "--save-steps", "2", "--save-only-model", "--kill-wait", "0"]
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert run_to_end(ref, args) == [0, 0]
    # SIGTERM at the end of step 4, during its model-only periodic save: the stop moves to step 5, full
    assert run_to_end(out, [*args, "--signal-self-at-step", "4"]) == [0, 0]
    jit = out / "checkpoint-5"
    assert _manifest(jit)["contents"] == "full" and _manifest(out / "checkpoint-4")["contents"] == "model_only"
    assert _manifest(jit)["kind"] == "jit"
    for name in ("optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"):
        assert (jit / name).is_file(), name
    assert run_to_end(out, [*args, "--resume"]) == [0, 0]
    assert_same_losses(losses(out), losses(ref))
    lrs = [json.loads(line)["lr"] for line in (out / "losses-rank0.jsonl").read_text().splitlines()]
    assert lrs == [json.loads(line)["lr"] for line in (ref / "losses-rank0.jsonl").read_text().splitlines()]


def test_failed_train_closes_the_side_group_and_a_second_train_starts_clean(tmp_path: Path) -> None:
    """Item 14: train() raises at step 3 on both ranks; the side group is closed; train() again runs to the end
    (without DeepSpeed: accelerate cannot train() a DeepSpeed engine twice in one process)."""
    out = tmp_path / "out"
    assert run_to_end(out, ["--zero-stage", "0", "--max-steps", "6", "--fail-at-step", "3", "--train-again"]) == [0, 0]
    log = (tmp_path / "logs-out" / "rank0.log").read_text(errors="replace")
    assert "side group closed: True" in log, log[-3000:]
    assert "terminate called" not in log
    record = stop_record.read(out)
    assert record is not None and record["state"] == "finished" and record["step"] == 6, record


def _refused(tmp_path: Path, out: Path, args: list[str], ranks_n: int = 1) -> str:
    ranks = start_demo(out, args, world_size=ranks_n, log_dir=tmp_path / "logs-refused")
    codes = ranks.wait(START_TIMEOUT_S)
    log = ranks.log(0)
    assert codes == [2] * ranks_n, log[-3000:]
    assert "Traceback" not in log
    lines = [line for line in log.splitlines() if line.startswith("demo_train: slurm_jit:")]
    assert len(lines) == 1 and "HINT:" in lines[0], log[-3000:]
    return lines[0]


def test_resume_with_another_world_size_is_refused_before_training(tmp_path: Path, copy_run,
                                                                   jit_zero2_run: Path) -> None:
    """Item 8 (issue 13): a 2-rank checkpoint resumed by 1 rank with the same per-device batch, i.e. half the
    samples per step: one line with a HINT, nothing trained, nothing touched, nothing converted (1 rank with
    twice the batch is converted and resumed: tests/test_elastic.py)."""
    out = copy_run(jit_zero2_run)
    before = losses(out)
    line = _refused(tmp_path, out, ["--max-steps", "10", "--resume"])
    assert "4 samples per optimizer step when written, 2 in this run" in line, line
    assert losses(out) == before and _dirs(out) == ["checkpoint-3", "checkpoint-6"]
    assert not (out / "checkpoint-6" / "universal").exists()


def test_checkpoint_whose_deepspeed_tag_is_another_step_is_refused(tmp_path: Path, copy_run,
                                                                    plain_zero2_run: Path) -> None:
    """Item 8: checkpoint-6 whose DeepSpeed tag says global_step7, as transformers' enable_jit_checkpoint writes
    when the signal lands in on_pre_optimizer_step (its tag directory renamed here: upstream's off-by-one is
    timing-dependent); resuming it by explicit path is refused with one line on both ranks."""
    out = copy_run(plain_zero2_run)
    ckpt = out / "checkpoint-6"
    (ckpt / "global_step6").rename(ckpt / "global_step7")
    (ckpt / "latest").write_text("global_step7")
    line = _refused(tmp_path, out, ["--max-steps", "10", "--resume-from", str(ckpt)], ranks_n=2)
    assert "DeepSpeed tag 'global_step7' is not global_step6" in line


def test_save_on_each_node_is_refused_at_init(tmp_path: Path) -> None:
    """Item 12, for real: one line with a HINT, before any training."""
    line = _refused(tmp_path, tmp_path / "out", ["--save-on-each-node"])
    assert "save_on_each_node=True" in line


@pytest.mark.parametrize(("ds_config", "needle"), [
    ({"checkpoint": {"writer": {"decoupled": True}}}, "decoupled"),
    ({"datastates_ckpt": {}}, "datastates_ckpt"),
    ({"checkpoint": {"use_node_local_storage": True}}, "use_node_local_storage"),
])
def test_async_and_node_local_deepspeed_engines_are_refused(ds_config: dict, needle: str) -> None:
    """Item 12: the DeepSpeed 0.19.8 keys whose files are committed after save_checkpoint returns, or land on
    node-local storage."""
    why = refused_settings(save_on_each_node=False, ds_config=ds_config)
    assert why is not None and needle in why and "HINT:" in why


def test_synchronous_deepspeed_writers_are_accepted() -> None:
    assert refused_settings(save_on_each_node=False, ds_config={"checkpoint": {"writer": {"type": "fast"}}}) is None
    assert refused_settings(save_on_each_node=False, ds_config={"datastates_ckpt": False}) is None
    assert refused_settings(save_on_each_node=False, ds_config=None) is None
