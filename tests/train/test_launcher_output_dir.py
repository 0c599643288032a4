"""The launcher's --output-dir reaches the ranks (SLURM_JIT_OUTPUT_DIR); a JitTrainer whose output_dir is another
directory is refused at construction, in one line with a HINT (before, a script given two different directories
trained into one while the requeue read the other's stop record)."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from slurm_jit import JitTrainer
from slurm_jit.train.refusals import OUTPUT_DIR_ENV, JitRefusal, output_dir_refusal


def _trainer(out: Path) -> JitTrainer:
    config = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=1)
    args = transformers.TrainingArguments(output_dir=str(out), use_cpu=True, report_to=[], max_steps=1)
    return JitTrainer(model=transformers.GPT2LMHeadModel(config), args=args)


def test_another_output_dir_than_the_launchers_is_refused_in_one_line(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OUTPUT_DIR_ENV, str(tmp_path / "launcher"))
    with pytest.raises(JitRefusal) as refused:
        _trainer(tmp_path / "script")
    message = str(refused.value)
    assert "\n" not in message and "HINT" in message and str(tmp_path / "launcher") in message, message
    assert not (tmp_path / "script").exists() and not (tmp_path / "launcher").exists()


def test_the_same_directory_by_another_path_is_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.setenv(OUTPUT_DIR_ENV, str(tmp_path / "link") + "/")
    monkeypatch.chdir(tmp_path)
    assert _trainer(Path("real")).args.output_dir == "real"
    assert output_dir_refusal("real/./", str(tmp_path / "real")) is None
    assert output_dir_refusal("anything", None) is None and output_dir_refusal("anything", "") is None


def test_no_training_arguments_or_an_empty_output_dir_is_refused_too(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The first review: JitTrainer(model) took upstream's default directory and an empty output_dir was upstream's
    FileNotFoundError; both trained where the launcher's requeue never looks."""
    monkeypatch.setenv(OUTPUT_DIR_ENV, str(tmp_path / "launcher"))
    monkeypatch.chdir(tmp_path)
    config = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=1)
    with pytest.raises(JitRefusal, match="HINT"):
        JitTrainer(model=transformers.GPT2LMHeadModel(config))
    args = transformers.TrainingArguments(output_dir="", use_cpu=True, report_to=[], max_steps=1)
    with pytest.raises(JitRefusal, match="HINT") as empty:
        JitTrainer(model=transformers.GPT2LMHeadModel(config), args=args)
    assert "\n" not in str(empty.value) and f"unset {OUTPUT_DIR_ENV}" in str(empty.value)
