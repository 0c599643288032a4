"""JIT on any Trainer subclass (issue 19): ``class X(JitTrainer, SFTTrainer)`` or ``slurm_jit.with_jit(SFTTrainer)``;
the other order refused when the class is defined; the hooks the subclass's other classes override checked at
construction against what JitTrainer needs; and the drop-in (``transformers.Trainer = JitTrainer`` before a
framework imports it) constructed for real. Fast: no training (the stop/resume of TRL's SFTTrainer on DeepSpeed is
tests/train/test_trl_sft_resume.py)."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import transformers

import slurm_jit
from slurm_jit.train.refusals import JitRefusal
from slurm_jit.train.trainer import JitTrainer

ROOT = Path(__file__).resolve().parents[2]
STACKS_DOC = ROOT / "docs" / "stacks.md"
TRL_TRAINERS = ("SFTTrainer", "DPOTrainer", "GRPOTrainer", "RewardTrainer", "RLOOTrainer", "KTOTrainer")
DROP_IN_TIMEOUT_S = 100  # a fresh interpreter imports torch, transformers, TRL and builds one tiny SFTTrainer


def _subclassing() -> Any:
    from slurm_jit.train import subclassing  # here, not at the top: each test fails alone without the module

    return subclassing


def _tiny_args(tmp_path: Path) -> dict[str, Any]:
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16,
                                                                 n_layer=1, n_head=2))
    return dict(model=model, args=transformers.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True,
                                                                 report_to=[]))


class Framework(transformers.Trainer):
    """A third-party Trainer subclass that overrides hooks cooperatively, as TRL's do."""

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)


def _one_line(exc: BaseException) -> str:
    message = str(exc)
    assert "\n" not in message and "HINT:" in message, message
    return message


def test_only_another_trainer_subclass_before_jittrainer_is_refused_when_the_class_is_defined(
        tmp_path: Path) -> None:
    with pytest.raises(JitRefusal) as err:
        class Wrong(Framework, JitTrainer):
            pass
    message = _one_line(err.value)
    assert "HINT: class Wrong(JitTrainer, Framework), or slurm_jit.with_jit(Framework)" in message, message

    class Right(JitTrainer, Framework):
        pass

    class Mine(JitTrainer):
        pass

    class MineToo(Mine, Framework):  # the user's JitTrainer subclass before the framework: JitTrainer still first
        pass

    assert MineToo.__mro__.index(JitTrainer) < MineToo.__mro__.index(Framework)
    assert isinstance(Right(**_tiny_args(tmp_path)), Framework)


def test_with_jit_returns_one_jit_class_per_trainer_class() -> None:
    made = slurm_jit.with_jit(Framework)
    assert made.__name__ == "JitFramework" and made.__mro__[1:3] == (JitTrainer, Framework)
    assert slurm_jit.with_jit(Framework) is made
    assert slurm_jit.with_jit(made) is made and slurm_jit.with_jit(JitTrainer) is JitTrainer


@pytest.mark.parametrize("bad", [int, "SFTTrainer", None])
def test_with_jit_of_something_that_is_no_trainer_class_is_refused_in_one_line(bad: Any) -> None:
    with pytest.raises(JitRefusal) as err:
        slurm_jit.with_jit(bad)
    assert "not a transformers.Trainer subclass" in _one_line(err.value)


def test_a_framework_hook_that_never_calls_super_is_refused_at_construction(tmp_path: Path) -> None:
    """Its _save_checkpoint would write no DeepSpeed shards under JitTrainer's manifest."""
    class OwnSave(transformers.Trainer):
        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            self.save_model()

    with pytest.raises(JitRefusal) as err:
        slurm_jit.with_jit(OwnSave)(**_tiny_args(tmp_path))
    assert "OwnSave._save_checkpoint() never calls super()" in _one_line(err.value)


def test_a_framework_hook_that_cannot_take_jittrainers_call_is_refused_at_construction(tmp_path: Path) -> None:
    class Narrow(transformers.Trainer):
        def _load_rng_state(self) -> None:  # JitTrainer hands on _load_rng_state(checkpoint)
            super()._load_rng_state(None)

    with pytest.raises(JitRefusal) as err:
        slurm_jit.with_jit(Narrow)(**_tiny_args(tmp_path))
    assert "Narrow._load_rng_state() cannot take JitTrainer's call _load_rng_state(checkpoint)" in \
        _one_line(err.value)


def test_a_subclass_replacing_the_step_boundary_hook_is_refused(tmp_path: Path) -> None:
    """Above JitTrainer (a user's subclass, or a framework's under the drop-in) a _maybe_log_save_evaluate without
    super() would never reach JitTrainer's: no stop would ever be taken."""
    class NoStops(JitTrainer):
        def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
            pass

    with pytest.raises(JitRefusal) as err:
        NoStops(**_tiny_args(tmp_path))
    assert "NoStops._maybe_log_save_evaluate() replaces JitTrainer._maybe_log_save_evaluate() without super()" \
        in _one_line(err.value)


def test_a_subclass_replacing_a_lesser_hook_gets_one_warning_with_its_cost(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    class OwnPrediction(JitTrainer):
        def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool,
                            ignore_keys: Any = None) -> Any:
            return None, None, None

    with caplog.at_level(logging.WARNING, logger="slurm_jit.train.subclassing"):
        OwnPrediction(**_tiny_args(tmp_path))
        OwnPrediction(**_tiny_args(tmp_path))
    said = [r.getMessage() for r in caplog.records if "OwnPrediction.prediction_step()" in r.getMessage()]
    assert len(said) == 1 and "not aborted by a stop" in said[0] and "HINT:" in said[0], said


def _trl_overrides(cls: type) -> set[str]:
    """The hooks JitTrainer has that TRL's ``cls`` (or its TRL bases) override."""
    below = [k for k in cls.__mro__ if issubclass(k, transformers.Trainer) and k is not transformers.Trainer]
    return {name for name in _subclassing().SUPER_CALLS for k in below if name in vars(k)}


@pytest.mark.parametrize("name", TRL_TRAINERS)
def test_trls_overrides_pass_the_hooks_check_and_each_is_decided_in_the_docs(
        name: str, caplog: pytest.LogCaptureFixture) -> None:
    """JitTrainer first: TRL's overrides sit under JitTrainer's, which hand on through super(); none is refused or
    warned about, and docs/stacks.md says for each what happens (a TRL release overriding a new hook fails here
    until it is decided)."""
    trl = pytest.importorskip("trl")
    cls = getattr(trl, name)
    with caplog.at_level(logging.WARNING, logger="slurm_jit.train.subclassing"):
        _subclassing().check_hooks(slurm_jit.with_jit(cls), JitTrainer)
    assert not caplog.records, caplog.text
    overridden = _trl_overrides(cls)
    assert "_save_checkpoint" in overridden  # every TRL trainer writes its model card there
    documented = set(re.findall(r"^\| `(\w+)`", STACKS_DOC.read_text(), re.MULTILINE))
    assert overridden <= documented, f"decide in {STACKS_DOC.name}: {sorted(overridden - documented)}"


def test_the_drop_in_assignment_builds_trls_trainer_as_a_jittrainer() -> None:
    """``transformers.Trainer = JitTrainer`` before TRL is imported, in a fresh interpreter as a user's script
    does it, then a real SFTTrainer constructed (was: refused by the hooks check, which found JitTrainer's own
    ``_get_dataloader(*args, **kwargs)`` where it looked for the Trainer's)."""
    pytest.importorskip("trl")
    script = (
        "import sys, tempfile\n"
        f"sys.path.insert(0, {str(ROOT / 'examples')!r})\n"
        "import trl_sft\n"
        "from slurm_jit import JitTrainer\n"
        "cls = trl_sft.trainer_class('drop-in')\n"
        "import trl\n"
        "assert cls is trl.SFTTrainer and issubclass(cls, JitTrainer), cls.__mro__\n"
        "import transformers\n"
        "from datasets import Dataset\n"
        "model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=16, n_positions=16, n_embd=16,"
        " n_layer=1, n_head=2))\n"
        "args = trl.SFTConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, report_to=[])\n"
        "data = Dataset.from_dict({'text': ['w3 w4 w5', 'w6 w7']})\n"
        "trainer = cls(model=model, args=args, train_dataset=data, processing_class=trl_sft.tokenizer(16))\n"
        "print('built', type(trainer).__name__, trainer.jit_config.kill_wait_s)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=DROP_IN_TIMEOUT_S, check=False)
    assert done.returncode == 0 and "built SFTTrainer" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("odd", [[], {}, {"a": 1}], ids=["list", "dict", "dict-with-key"])
def test_with_jit_of_an_unhashable_value_is_refused_in_one_line(odd: Any) -> None:
    with pytest.raises(JitRefusal) as refused:
        slurm_jit.with_jit(odd)
    message = str(refused.value)
    assert "\n" not in message and "not a transformers.Trainer subclass" in message and "HINT:" in message, message


def test_with_jit_of_the_trainer_itself_is_jit_trainer() -> None:
    """Not a second class also named JitTrainer (in transformers.trainer) standing between JitTrainer and users."""
    from transformers.trainer import Trainer

    assert slurm_jit.with_jit(Trainer) is JitTrainer
