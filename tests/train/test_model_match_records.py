"""The comparison before a DeepSpeed resume load (train/model_match.py) on plain dicts, as DeepSpeed 0.19.8 writes
them into its model-states file: no ranks. The same checks on real 2-rank runs: test_resume_model_match.py."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch

from slurm_jit.train import model_match
from slurm_jit.train.model_match import ModelRecord

WTE, WPE = "transformer.wte.weight", "transformer.wpe.weight"
FC_W, FC_B = "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_fc.bias"
PROJ_W = "transformer.h.0.mlp.c_proj.weight"
LM_HEAD = "lm_head.weight"
SHAPES = {WTE: (128, 16), WPE: (64, 16), FC_W: (16, 24), FC_B: (24,), PROJ_W: (24, 16)}


def _states(stage: int = 2, shapes: dict[str, tuple[int, ...]] | None = None, frozen: tuple[str, ...] = (),
            tied: bool = True, dtype: torch.dtype = torch.float32, slim: bool = True) -> dict[str, Any]:
    """A model-states dict as engine._common_checkpoint_state writes it (ZeRO-2: two optimizer groups)."""
    shapes = dict(SHAPES if shapes is None else shapes)
    held = [name for name in shapes if name not in frozen]
    groups = [OrderedDict((n, torch.Size(shapes[n])) for n in held if not n.endswith("bias")),
              OrderedDict((n, torch.Size(shapes[n])) for n in held if n.endswith("bias"))]
    module = {n: torch.zeros(s, dtype=dtype) for n, s in shapes.items() if not (slim and n in held)}
    if tied and not slim:
        module[LM_HEAD] = module[WTE]
    return {"module": module, "buffer_names": [], "param_shapes": groups,
            "frozen_param_shapes": OrderedDict((n, torch.Size(shapes[n])) for n in frozen) if stage >= 2 else None,
            "shared_params": {LM_HEAD: WTE} if tied else {}, "ds_config": {"zero_optimization": {"stage": stage}}}


def _record(**kwargs: Any) -> ModelRecord:
    record = model_match.record_of_states(_states(**kwargs))
    assert record is not None
    return record


def _live(**kwargs: Any) -> ModelRecord:
    """The engine's side: what it would save now (a full state dict: every tensor's shape and dtype)."""
    return _record(slim=False, **kwargs)


def test_the_same_model_matches_in_every_layout() -> None:
    for stage in (1, 2):
        for slim in (True, False):
            assert model_match.difference(_record(stage=stage, slim=slim), _live(stage=stage)) is None
    assert model_match.difference(_record(frozen=(WPE,)), _live(frozen=(WPE,))) is None
    assert model_match.difference(_record(stage=1), _live(stage=2)) is None  # the same optimizer and partitions


def test_a_checkpoint_that_records_nothing_is_not_refused() -> None:
    """An older checkpoint, or another layout: what is not recorded is not compared."""
    assert model_match.difference(model_match.record_of_states({"module": {}}), _live()) is None  # type: ignore[arg-type]
    assert model_match.record_of_states(["not", "a", "dict"]) is None


@pytest.mark.parametrize(("saved", "live", "needles"), [
    ({}, {"shapes": {**SHAPES, FC_W: (24, 16)}},
     [f"'{FC_W}' has shape [16, 24] in the checkpoint and [24, 16] in this model", "HINT: resume with the model"]),
    ({}, {"shapes": {**SHAPES, WTE: (136, 16)}}, [f"'{WTE}' has shape [128, 16] in the checkpoint and [136, 16]"]),
    ({}, {"shapes": {(PROJ_W.replace("c_proj", "proj_out") if n == PROJ_W else n): s for n, s in SHAPES.items()}},
     [f"is '{PROJ_W}' in the checkpoint and 'transformer.h.0.mlp.proj_out.weight' in this model", "renamed"]),
    ({}, {"shapes": {WPE: SHAPES[WPE], WTE: SHAPES[WTE], **SHAPES}}, ["parameter #0 is", "order changed"]),
    ({}, {"tied": False}, [f"'{LM_HEAD}' was tied to '{WTE}' in the checkpoint and is a parameter of its own",
                           "HINT: resume with the parameters tied as they were (tie_word_embeddings"]),
    ({"tied": False}, {}, [f"'{LM_HEAD}' is tied to '{WTE}' in this model and was a parameter of its own"]),
    ({}, {"frozen": (WPE,)}, [f"'{WPE}' is frozen in this run and was trained", "HINT: resume with the same"]),
    ({"frozen": (WPE,)}, {}, [f"'{WPE}' is trained in this run (held by the optimizer) and was frozen"]),
    ({"frozen": (WPE,), "shapes": {**SHAPES, WPE: (32, 16)}}, {"frozen": (WPE,)},
     [f"'{WPE}' has shape [32, 16] in the checkpoint and [64, 16]"]),
    ({"stage": 3}, {}, ["written under ZeRO stage 3, and this run uses ZeRO stage 2",
                        "HINT: resume with zero_optimization.stage 3 (as written), or start a new run"]),
    ({"slim": False, "dtype": torch.int64}, {}, [f"'{WTE}' is torch.int64 in the checkpoint and torch.float32",
                                                 "HINT: resume with the model the checkpoint was written with"]),
])
def test_the_first_difference_is_one_line_with_a_hint(saved: dict[str, Any], live: dict[str, Any],
                                                      needles: list[str]) -> None:
    why = model_match.difference(_record(**saved), _live(**live))
    assert why is not None and "\n" not in why and "HINT:" in why, why
    for needle in needles:
        assert needle in why, why


def test_another_floating_point_precision_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """bf16 switched on after an fp32 stop: DeepSpeed's load casts the module's tensors and restores the fp32 master
    exactly, so the weights are right; before, a full checkpoint was refused (a slim one, whose module holds no
    trained weight, was not)."""
    with caplog.at_level("WARNING", logger="slurm_jit.train.model_match"):
        assert model_match.difference(_record(slim=False), _live(dtype=torch.bfloat16)) is None
    assert f"'{WTE}' is torch.float32 in the checkpoint and torch.bfloat16 in this model" in caplog.text
    assert len(caplog.records) == 1, caplog.text


def test_a_zero1_checkpoint_tells_frozen_from_held_by_its_module_entries() -> None:
    """ZeRO-1 records no frozen_param_shapes: the frozen parameters are the module's entries that are neither
    held, buffers nor tied aliases."""
    why = model_match.difference(_record(stage=1, frozen=(WPE,)), _live(stage=1))
    assert why is not None and f"'{WPE}' is trained in this run (held by the optimizer) and was frozen" in why, why


@pytest.mark.parametrize(("written", "now", "refused"), [
    (3, 2, True), (2, 3, True), (1, 3, True), (3, 1, True), (0, 2, True),
    (2, 2, False), (1, 2, False), (2, 1, False), (3, 3, False), (None, 3, False), (2, None, False),
])
def test_stage_refusal_from_the_manifest(written: int | None, now: int | None, refused: bool) -> None:
    ds_config = {"zero_optimization": {"stage": now}} if now is not None else None
    why = model_match.stage_refusal("ckpt", {"zero_stage": written}, ds_config)
    assert (why is not None) == refused, why
    if why:
        assert why.startswith(f"ckpt: written under ZeRO stage {written}, and this run uses ZeRO stage {now}")
        assert "HINT:" in why and "\n" not in why


def test_a_universal_copy_is_compared_by_name() -> None:
    """elastic.py's universal copy is loaded parameter by parameter by name, in any stage and grouping: another
    order, stage or trainable set is the elastic path's to handle; a shape or a tie that differs is still refused."""
    moved = {WPE: SHAPES[WPE], WTE: SHAPES[WTE], **SHAPES}
    for saved, live in (({}, {"shapes": moved}), ({"stage": 3}, {}), ({}, {"frozen": (WPE,)})):
        assert model_match.difference(_record(**saved), _live(**live), by_name=True) is None
    why = model_match.difference(_record(), _live(shapes={**SHAPES, FC_W: (24, 16)}), by_name=True)
    assert why is not None and f"'{FC_W}' has shape [16, 24] in the checkpoint and [24, 16]" in why, why
    why = model_match.difference(_record(stage=3), _live(tied=False), by_name=True)
    assert why is not None and "was tied to" in why, why


def test_a_tie_under_names_the_checkpoint_lacks_is_reported_as_another_model_not_as_a_tie() -> None:
    """A LoRA-wrapped model (every name prefixed) on the plain model's checkpoint: the first difference named must
    be the parameters, not "tied ... was a parameter of its own in the checkpoint", which it never had."""
    prefix = "base_model.model."
    states = _states(slim=False)
    live_states = {**states, "module": {prefix + n: t for n, t in states["module"].items()},
                   "param_shapes": [OrderedDict((prefix + n, s) for n, s in g.items()) for g in states["param_shapes"]],
                   "shared_params": {prefix + LM_HEAD: prefix + WTE}}
    live = model_match.record_of_states(live_states)
    assert live is not None
    why = model_match.difference(_record(), live)
    assert why is not None and "tied" not in why and prefix in why and "HINT:" in why, why
