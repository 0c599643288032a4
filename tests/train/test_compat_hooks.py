"""The Trainer hooks JitTrainer relies on are checked at construction (issue 12): a transformers without one
fails there with one line naming the supported range, never at the first stop on a cluster."""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import transformers

from slurm_jit.train import compat
from slurm_jit.train.refusals import JitRefusal
from slurm_jit.train.trainer import JitTrainer

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _tiny_trainer(tmp_path: Path) -> JitTrainer:
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16,
                                                                 n_layer=1, n_head=2))
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
    return JitTrainer(model=model, args=args)


def test_the_installed_trainer_has_every_hook(tmp_path: Path) -> None:
    compat.check_trainer_hooks()
    assert isinstance(_tiny_trainer(tmp_path), JitTrainer)


def test_every_private_trainer_method_jittrainer_overrides_is_checked() -> None:
    overridden = {name for name, value in vars(JitTrainer).items()
                  if name.startswith("_") and not name.startswith("__") and callable(value)
                  and hasattr(transformers.Trainer, name)}
    missing = overridden - set(compat.TRAINER_HOOKS)
    assert not missing, f"add to compat.TRAINER_HOOKS: {missing}"


def test_a_missing_hook_fails_construction_with_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(transformers.Trainer, "_maybe_log_save_evaluate")
    with pytest.raises(JitRefusal) as err:
        _tiny_trainer(tmp_path)
    message = str(err.value)
    assert "\n" not in message and "HINT:" in message, message
    assert "has no Trainer._maybe_log_save_evaluate()" in message and compat.SUPPORTED_RANGE in message, message
    # inside the range and still broken: the hint names the version that works, not the range it is already in
    assert "HINT: pip install 'transformers==5.24.0'" in message, message


def test_a_changed_signature_fails_construction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def renamed(self: Any, model: Any, hp_trial: Any) -> None:  # a parameter renamed upstream
        raise AssertionError("never called: the check refuses first")

    monkeypatch.setattr(transformers.Trainer, "_save_checkpoint", renamed)
    with pytest.raises(JitRefusal, match=r"Trainer\._save_checkpoint\(model, hp_trial\) is not "):
        _tiny_trainer(tmp_path)


def _upstream_with(*params: inspect.Parameter) -> type:
    """A stand-in Trainer whose _evaluate has exactly ``params`` after self."""
    def _evaluate(self: Any, *args: Any, **kwargs: Any) -> None: ...

    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    _evaluate.__signature__ = inspect.Signature([self_param, *params])  # type: ignore[attr-defined]
    return type("Upstream", (), {"_evaluate": _evaluate})


def _param(name: str, default: Any = inspect.Parameter.empty,
           kind: inspect._ParameterKind = inspect.Parameter.POSITIONAL_OR_KEYWORD) -> inspect.Parameter:
    return inspect.Parameter(name, kind, default=default)


@pytest.mark.parametrize(("params", "ok"), [
    ((_param("trial"), _param("ignore_keys_for_eval"), _param("skip_scheduler", False)), True),
    ((_param("trial"), _param("ignore_keys_for_eval"), _param("skip_scheduler", False), _param("new", 1)), True),
    ((_param("trial"), _param("ignore_keys_for_eval"), _param("skip_scheduler", False),
      _param("new", kind=inspect.Parameter.KEYWORD_ONLY)), False),  # a new required parameter
    ((_param("trial"), _param("skip_scheduler", False)), False),  # one gone
    ((_param("ignore_keys_for_eval"), _param("trial"), _param("skip_scheduler", False)), False),  # reordered
], ids=["same", "new-optional", "new-required", "gone", "reordered"])
def test_hook_problem_accepts_only_compatible_signatures(params: tuple[inspect.Parameter, ...], ok: bool) -> None:
    problem = compat.hook_problem(_upstream_with(*params), "_evaluate", compat.TRAINER_HOOKS["_evaluate"])
    assert (problem is None) == ok, problem


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_pyproject_declares_the_supported_range() -> None:
    import tomllib

    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    for requirement in compat.SUPPORTED_RANGE.split(", "):
        name = re.match(r"[a-z]+", requirement)
        assert name and requirement.replace(" ", "") in deps, (requirement, deps)


def test_the_lowest_version_tested_is_the_lower_bound_of_the_range() -> None:
    """tests/train/test_compat_versions.py runs the stop/resume scenario on LOWEST_TRANSFORMERS: it must be the range's
    lowest (a widened range whose new lower end is not tested fails here)."""
    lowest = re.search(r"transformers>=([0-9.]+)", compat.SUPPORTED_RANGE)
    assert lowest and compat.LOWEST_TRANSFORMERS in (lowest.group(1), f"{lowest.group(1)}.0"), compat.SUPPORTED_RANGE


def test_a_new_optional_parameter_reaches_upstream_through_a_pass_through_hook(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A newer Trainer adds an optional parameter and passes it from its own callers: not refused, and JitTrainer's
    override hands it on (before: TypeError at the first call, on a cluster)."""
    seen: list[Any] = []

    def _load_best_model(self: Any, strict: bool = True) -> None:
        seen.append(strict)

    monkeypatch.setattr(transformers.Trainer, "_load_best_model", _load_best_model)
    trainer = _tiny_trainer(tmp_path)
    trainer._load_best_model(strict=False)
    assert seen == [False]


def test_a_new_parameter_jittrainer_cannot_take_fails_construction(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """_save_checkpoint is JitTrainer's own protocol, not a pass-through: a Trainer that would call it with a new
    argument is refused at construction with one line, not a TypeError at the first checkpoint."""
    def _save_checkpoint(self: Any, model: Any, trial: Any, metrics: Any = None) -> None: ...

    monkeypatch.setattr(transformers.Trainer, "_save_checkpoint", _save_checkpoint)
    with pytest.raises(JitRefusal) as err:
        _tiny_trainer(tmp_path)
    message = str(err.value)
    assert "new parameters ['metrics'] that JitTrainer._save_checkpoint() does not take" in message, message
    assert "\n" not in message and "HINT:" in message, message


def test_a_user_subclass_overriding_a_hook_its_own_way_is_not_refused(tmp_path: Path) -> None:
    class Mine(JitTrainer):
        def _save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
            super()._save_checkpoint(*args, **kwargs)

        def _evaluate(self, trial: Any, ignore_keys_for_eval: Any, skip_scheduler: bool = False,
                      extra: int = 0) -> dict[str, float]:
            return super()._evaluate(trial, ignore_keys_for_eval, skip_scheduler)

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16,
                                                                 n_layer=1, n_head=2))
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
    assert isinstance(Mine(model=model, args=args), Mine)


def test_the_job_log_gets_each_logging_step_once_from_the_whole_job(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """stderr a file (pytest's capture, as under Slurm): the bars make way for one printed line per logging step,
    from the world's rank 0 only: under srun every node's output lands in the one job log, and a node's local
    rank 0 (the second node's first rank here) must not print it again. Later callbacks still get total_flos."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback, TrainerState

    trainer = _tiny_trainer(tmp_path)
    callbacks = trainer.callback_handler.callbacks
    assert not any(isinstance(c, ProgressCallback) for c in callbacks)
    printer = next(c for c in callbacks if isinstance(c, PrinterCallback))
    node0, node1 = TrainerState(), TrainerState()
    node0.is_world_process_zero = node0.is_local_process_zero = True
    node1.is_world_process_zero, node1.is_local_process_zero = False, True
    for state in (node0, node1):
        logs = {"loss": 0.5, "total_flos": 1.0}
        printer.on_log(trainer.args, state, trainer.control, logs=logs)
        assert logs == {"loss": 0.5, "total_flos": 1.0}
    assert capsys.readouterr().out.count("'loss'") == 1


def test_a_failing_worker_shutdown_does_not_stop_the_rest_of_the_cleanup(caplog: pytest.LogCaptureFixture) -> None:
    """train()'s finally shuts the persistent workers down before it puts the signal handlers back: a loader whose
    shutdown fails (its index queue closed under it, as after a crash) must neither raise there (masking the
    error train() is raising, leaving the stop signals latched) nor keep the other loaders' workers alive.
    Real DataLoaders with one worker each: ~2 s."""
    from types import SimpleNamespace

    import torch

    data = [torch.tensor([i]) for i in range(4)]
    broken, healthy = (torch.utils.data.DataLoader(data, num_workers=1, persistent_workers=True) for _ in "ab")
    for loader in (broken, healthy):
        next(iter(loader))
    healthy_workers = list(healthy._iterator._workers)
    broken._iterator._index_queues[0].close()
    trainer = SimpleNamespace(callback_handler=SimpleNamespace(train_dataloader=broken, eval_dataloader=healthy))
    with caplog.at_level("WARNING", logger=compat.__name__):
        compat.shut_down_persistent_workers(trainer)
    assert broken._iterator is None and healthy._iterator is None
    assert not any(w.is_alive() for w in healthy_workers)
    assert any("HINT:" in r.getMessage() for r in caplog.records), caplog.text


def test_a_closed_stderr_does_not_break_construction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stderr", None)  # what Python sets when fd 2 is closed at start (daemons, pythonw)
    assert isinstance(_tiny_trainer(tmp_path), JitTrainer)


def test_upstream_taking_kwargs_in_a_hook_jittrainer_overrides_is_not_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def _save_checkpoint(self: Any, model: Any, trial: Any, *args: Any, **kwargs: Any) -> None: ...

    monkeypatch.setattr(transformers.Trainer, "_save_checkpoint", _save_checkpoint)
    assert isinstance(_tiny_trainer(tmp_path), JitTrainer)
