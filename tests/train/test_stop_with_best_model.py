"""A JIT stop under eval_steps = save_steps = 2, metric_for_best_model, save_total_limit=1, save_only_model and an
on_save callback (issue 7): jit_stop recorded right after the manifest, upstream's end-of-training cleanup keeps
the JIT checkpoint, the JIT save is full, on_save runs before the manifest, the owed evaluation runs first on
resume. Real DeepSpeed ranks (2 CPU ranks over gloo), a real SIGTERM each rank sends itself at a known step; one
run shared by the assertions.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from jit_helpers import assert_same_losses, ckpt_check, losses, run_to_end, start_demo, wait_for_path
from run_outputs import checkpoint_names as _dirs
from run_outputs import eval_losses as _evals
from run_outputs import manifest_of as _manifest

from slurm_jit.checkpoint import protocol
from slurm_jit.train import stop_record

pytestmark = pytest.mark.deepspeed

# The scenario: eval_steps = save_steps = 2, metric_for_best_model="loss", save_total_limit=1; with
# save_only_model (periodic saves model-only, the JIT save full) and an on_save callback that writes a file into
# every checkpoint and rewrites config.json (a file the manifest lists).
BEST_LIMIT_1 = ["--max-steps", "10", "--eval-steps", "2", "--save-steps", "2", "--metric-for-best", "loss",
                "--save-total-limit", "1", "--save-only-model", "--on-save-file", "extra.txt", "--kill-wait", "0"]


SLOW_END_S = 60  # an on_train_end callback this slow after a stop: the SIGKILL comes while it sleeps


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
