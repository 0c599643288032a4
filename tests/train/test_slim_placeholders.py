"""The module load's check of a PEFT JIT save (slim_save.py): each adapter weight the ZeRO-1/2 optimizer holds is a
zero-element placeholder in the saved module, the frozen base is left out. The placeholders of held weights fit
(they are rebuilt from the fp32 master); a placeholder of a weight the optimizer does not hold (another adapter or
model config: nothing would rebuild it) is refused, naming it; other shapes are still compared.

Fast: the real tiny GPT-2 wrapped by PEFT (demo_train's LoRA config), its real state dict and trainable names; the
saved module as ``slim_model_states(placeholders=True)`` writes it (its own ``placeholder``). The whole path (a
real JIT save, the resume, the plain Trainer's failure) is in test_peft_checkpoint.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from slurm_jit.train import slim_save

LORA_MARK = ".lora_"


@pytest.fixture(scope="module")
def lora_model() -> Any:
    import peft

    from slurm_jit.demo_train import LORA_RANK, LORA_TARGETS, build_model

    config = peft.LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules=LORA_TARGETS["gpt2"],
                             fan_in_fan_out=True, task_type="CAUSAL_LM")
    return peft.get_peft_model(build_model("gpt2", 64, 2), config)


def _held(model: Any) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def _jit_saved(model: Any, held: set[str]) -> dict[str, Any]:
    """What a PEFT JIT save's module holds: a placeholder per held weight, no frozen one."""
    return {name: slim_save.placeholder(t) for name, t in model.state_dict().items() if name in held}


def test_placeholders_of_the_held_adapter_weights_fit_the_model_and_other_shapes_are_still_refused(
        lora_model: Any) -> None:
    """Before: "shape [0] saved, [4, 64] now" (the placeholder taken for a saved weight of another shape). A real
    saved weight of another shape beside the placeholders is still refused, in the same words as before."""
    held = _held(lora_model)
    built = lora_model.state_dict()
    saved = _jit_saved(lora_model, held)
    assert held and all(LORA_MARK in name for name in held) and set(saved) == held
    assert all(tuple(t.shape) == slim_save.PLACEHOLDER_SHAPE for t in saved.values())
    assert slim_save._module_misfit(saved, built, held, strict=False) is None
    name = sorted(held)[0]
    misfit = slim_save._module_misfit({**saved, name: built[name].new_zeros(3, 3)}, built, held, strict=False)
    assert misfit == f"{name}: shape [3, 3] saved, {list(built[name].shape)} now", misfit


def test_a_placeholder_of_a_weight_the_optimizer_does_not_hold_is_refused_naming_it(lora_model: Any) -> None:
    """A frozen base weight saved as a placeholder (the checkpoint's run trained it: modules_to_save): nothing in
    this run's optimizer would rebuild it. Before: refused as another shape, as if a saved weight differed."""
    held = _held(lora_model)
    built = lora_model.state_dict()
    frozen = "base_model.model.lm_head.weight"
    saved = {**_jit_saved(lora_model, held), frozen: slim_save.placeholder(built[frozen])}
    misfit = slim_save._module_misfit(saved, built, held, strict=False)
    assert misfit is not None and "not held by this run's optimizer" in misfit and frozen in misfit, misfit

