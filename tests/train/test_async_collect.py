"""What an async periodic save hands save_pretrained instead of accelerate's cloned state dict
(train/async_save/collect.py), on a real transformers GPT-2 whose weights are views of one flat buffer as ZeRO-1/2
leaves them: transformers' own remove_tied_weights_from_state_dict clones nothing (it cloned the whole model in
training's time), keeps the keys and values of the synchronous path (accelerate's clone), and the collector hands
the staging the views of the flat buffer again."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers.modeling_utils import remove_tied_weights_from_state_dict

from slurm_jit.train.async_save import collect


def _flat_gpt2() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                    eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)  # lm_head.weight is wte.weight (tied)
    params = list(model.parameters())
    flat = torch.empty(sum(p.numel() for p in params))
    offset = 0
    for p in params:  # as DeepSpeed's ZeRO-1/2 optimizer leaves the module: every weight a view of one buffer
        flat[offset:offset + p.numel()].copy_(p.data.flatten())
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return model


def test_save_pretrained_clones_nothing_and_writes_what_the_clone_path_writes(tmp_path: Path) -> None:
    model = _flat_gpt2()
    flat = next(model.parameters()).untyped_storage()
    synchronous = remove_tied_weights_from_state_dict({k: v.clone() for k, v in model.state_dict().items()}, model)
    collector = collect.CollectingEngine(object(), tmp_path, lambda *a, **k: None)
    state = collect.split_views(collect.unaliased(dict(model.state_dict()), collector.sources, collector.made),
                                collector.splits, collector.made)
    clones = 0
    original = torch.Tensor.clone

    def counted(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        nonlocal clones
        clones += 1
        return original(self, *args, **kwargs)

    torch.Tensor.clone = counted  # type: ignore[method-assign]
    try:
        kept = remove_tied_weights_from_state_dict(state, model)
    finally:
        torch.Tensor.clone = original  # type: ignore[method-assign]
    assert clones == 0
    assert list(kept) == list(synchronous)  # lm_head.weight kept, as accelerate's clones keep it
    for name, tensor in kept.items():
        source = collector.sources.get(tensor.untyped_storage()._cdata)
        assert torch.equal(source if source is not None else tensor, synchronous[name]), name
    joined = {name: collector.joined(tensor) for name, tensor in kept.items()}
    on_flat = [n for n, t in joined.items() if t.untyped_storage()._cdata == flat._cdata]
    assert len(on_flat) == len(list(model.parameters()))  # every weight the flat's own; the tied copy a placeholder
    assert all(joined[n].data_ptr() == kept[n].data_ptr() for n in on_flat)  # the same memory: nothing was copied


def test_a_split_view_that_save_pretrained_changed_is_left_as_it_came(tmp_path: Path) -> None:
    """A view of a split view (not the tensor made) is not swapped back: it is staged as it is, copied at the save
    (its storage is among the splits)."""
    model = _flat_gpt2()
    collector = collect.CollectingEngine(object(), tmp_path, lambda *a, **k: None)
    state = collect.split_views(dict(model.state_dict()), collector.splits, collector.made)
    weight = state["transformer.h.0.mlp.c_fc.weight"]
    assert collector.joined(weight).untyped_storage()._cdata != weight.untyped_storage()._cdata
    reshaped = weight.view(-1)
    assert collector.joined(reshaped) is reshaped
    assert reshaped.untyped_storage()._cdata in collector.splits


def test_the_deepspeed_lookup_is_answered_once_and_given_back() -> None:
    from accelerate.utils import other

    original = other.is_deepspeed_available
    with collect.deepspeed_lookup_once():
        assert other.is_deepspeed_available is not original
        assert other.is_deepspeed_available() == original()
    assert other.is_deepspeed_available is original


class _Subclass(torch.Tensor):
    pass


def test_what_dlpack_cannot_carry_is_left_as_it_came(tmp_path: Path) -> None:
    """A view DLPack refuses (the conjugate bit) and a tensor subclass keep their shared storage (save_pretrained
    clones them, as it did before); the plain views beside them are split."""
    flat = torch.zeros(8, dtype=torch.complex64)
    conj, plain, sub = flat[:2].conj(), flat[2:4], flat[4:6].as_subclass(_Subclass)
    collector = collect.CollectingEngine(object(), tmp_path, lambda *a, **k: None)
    state = collect.split_views({"conj": conj, "plain": plain, "sub": sub}, collector.splits, collector.made)
    assert state["conj"] is conj and state["sub"] is sub
    assert state["plain"] is not plain and state["plain"].data_ptr() == plain.data_ptr()
    assert collector.joined(state["plain"]) is collector.splits[state["plain"].untyped_storage()._cdata]


def test_every_module_naming_save_file_is_found_at_every_save(monkeypatch) -> None:
    """namers: a module loaded late, or one that binds the name after an earlier save (a wrapper taken off, a
    reload), is found at the next; a name a module dropped is not handed back. Found by a review: a cache of the
    modules already scanned missed the rebinding, and model.safetensors was written at once with a tied weight's
    placeholder bytes."""
    import sys
    import types

    import safetensors.torch

    save_file = safetensors.torch.save_file
    assert (safetensors.torch, "save_file") in collect.namers(save_file)
    late = types.ModuleType("slurm_jit_test_late")
    monkeypatch.setitem(sys.modules, "slurm_jit_test_late", late)
    late.safe_save_file = lambda *a, **k: None  # a wrapper at first
    assert (late, "safe_save_file") not in collect.namers(save_file)
    late.safe_save_file = save_file  # the original again
    assert (late, "safe_save_file") in collect.namers(save_file)
    del late.safe_save_file
    assert (late, "safe_save_file") not in collect.namers(save_file)


def test_the_trainer_state_is_kept_as_it_was_at_the_save_and_written_as_the_trainer_writes_it(tmp_path: Path) -> None:
    """files.TrainerStateFile.of: what the background writer writes is byte for byte what save_to_json wrote at the
    save, whatever training does to the state afterwards (a new log entry, a step, a callback's state, an entry of
    the log changed in place)."""
    from transformers import TrainerState

    from slurm_jit.train.async_save import files

    state = TrainerState(global_step=7, stateful_callbacks={"TrainerControl": {"args": {"should_save": True}}})
    state.log_history = [{"loss": 4.5 - i / 100, "step": i} for i in range(300)]
    state.save_to_json(str(tmp_path / "at-save.json"))
    kept = files.TrainerStateFile.of(state)
    state.log_history.append({"loss": 1.0, "step": 300})
    state.log_history[0]["loss"] = 0.0
    state.global_step = 8
    state.stateful_callbacks["TrainerControl"]["args"]["should_save"] = False
    files.write(tmp_path / "later.json", kept)
    assert (tmp_path / "later.json").read_bytes() == (tmp_path / "at-save.json").read_bytes()


def test_the_trainers_save_to_json_is_collected_only_for_the_block(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from transformers import TrainerState

    state = TrainerState(global_step=3)
    collector = collect.CollectingEngine(object(), tmp_path / "checkpoint-3", lambda *a, **k: None)
    trainer = SimpleNamespace(state=state)
    with collect.trainer_state_collected(trainer, collector):  # type: ignore[arg-type]
        state.save_to_json(str(tmp_path / "checkpoint-3" / "trainer_state.json"))  # the save's: collected
        (tmp_path / "elsewhere").mkdir()
        state.save_to_json(str(tmp_path / "elsewhere" / "trainer_state.json"))  # not the save's: written now
    assert [p.name for p, _ in collector.collected] == ["trainer_state.json"]
    assert not (tmp_path / "checkpoint-3").exists() and (tmp_path / "elsewhere" / "trainer_state.json").is_file()
    assert "save_to_json" not in vars(state)


def test_the_trainer_state_snapshot_holds_neither_the_collector_nor_a_nested_value_that_changes_later(
        tmp_path: Path) -> None:
    """Found by a review: the snapshot copied the instance's swapped save_to_json (a lambda holding the collector: a
    cycle that kept the save's placeholders alive until a full garbage collection), and a log entry holding a list
    was copied shallowly (a value changed in place after the save reached the file)."""
    import gc
    import weakref
    from types import SimpleNamespace

    from transformers import TrainerState

    state = TrainerState(global_step=3)
    state.log_history = [{"loss": 1.0, "step": 1}, {"per_class": [0.5, 0.25], "step": 2}]
    state.save_to_json(str(tmp_path / "at-save.json"))
    collector = collect.CollectingEngine(object(), tmp_path / "checkpoint-3", lambda *a, **k: None)
    with collect.trainer_state_collected(SimpleNamespace(state=state), collector):  # type: ignore[arg-type]
        state.save_to_json(str(tmp_path / "checkpoint-3" / "trainer_state.json"))
    (_, kept), = collector.collected
    state.log_history[1]["per_class"][0] = 0.0
    from slurm_jit.train.async_save import files

    files.write(tmp_path / "later.json", kept)
    assert (tmp_path / "later.json").read_bytes() == (tmp_path / "at-save.json").read_bytes()
    assert "save_to_json" not in vars(kept.state)
    gone = weakref.ref(collector)
    gc.disable()
    try:
        del collector
        assert gone() is None  # no cycle: freed by its reference count
    finally:
        gc.enable()
