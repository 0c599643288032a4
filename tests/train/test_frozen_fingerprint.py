"""The frozen weights' fingerprint (train/frozen_weights.py): what it is sensitive to, and the refusal's words.

Fast: real torch tensors, no DeepSpeed. The 2-rank resume that uses it is in test_peft_checkpoint.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from slurm_jit.checkpoint.manifest import FROZEN_FINGERPRINT, WEIGHTS_FROZEN_EXCLUDED, WEIGHTS_MASTER_ONLY
from slurm_jit.train import frozen_weights


def _named() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(4, 6, generator=gen)), ("b.weight", torch.randn(4, 6, generator=gen)),
            ("c.bias", torch.randn(3, generator=gen))]


def test_fingerprint_does_not_depend_on_the_order_the_tensors_come_in() -> None:
    named = _named()
    assert frozen_weights.fingerprint(named) == frozen_weights.fingerprint(list(reversed(named)))


def test_fingerprint_changes_when_two_names_swap_their_tensors() -> None:
    (a, ta), (b, tb), c = _named()
    assert frozen_weights.fingerprint([(a, tb), (b, ta), c]).digest != frozen_weights.fingerprint(_named()).digest


@pytest.mark.parametrize("change", ["dtype", "shape", "one_value", "name"])
def test_fingerprint_changes_with_dtype_shape_values_and_names(change: str) -> None:
    named = _named()
    name, tensor = named[0]
    changed = {
        "dtype": (name, tensor.to(torch.bfloat16)),
        "shape": (name, tensor.reshape(6, 4)),  # the same bytes in another shape
        "one_value": (name, tensor.clone().index_put_((torch.tensor(0), torch.tensor(0)), torch.tensor(0.5))),
        "name": ("z.weight", tensor),
    }[change]
    before, after = frozen_weights.fingerprint(named), frozen_weights.fingerprint([changed, *named[1:]])
    assert before.digest != after.digest
    assert before.tensors != after.tensors


def test_fingerprint_of_a_model_covers_only_its_frozen_parameters() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    found = frozen_weights.of_model(model)
    assert sorted(found.tensors) == ["0.bias", "0.weight"]
    with torch.no_grad():
        model[1].weight.add_(1.0)  # a trainable weight: not part of it
    assert frozen_weights.of_model(model) == found


def _manifest(named: list[tuple[str, torch.Tensor]]) -> dict[str, object]:
    return frozen_weights.manifest_fields(WEIGHTS_FROZEN_EXCLUDED, frozen_weights.fingerprint(named))


def test_only_a_save_that_leaves_the_frozen_weights_out_records_them() -> None:
    found = frozen_weights.fingerprint(_named())
    assert frozen_weights.manifest_fields(WEIGHTS_MASTER_ONLY, found) == {}
    assert frozen_weights.manifest_fields(WEIGHTS_FROZEN_EXCLUDED, None) == {}
    recorded = _manifest(_named())[FROZEN_FINGERPRINT]
    assert recorded["count"] == 3 and recorded["digest"] == found.digest  # type: ignore[index]


def test_resume_refusal_names_the_count_and_the_first_differing_tensor() -> None:
    manifest = _manifest(_named())
    same = frozen_weights.fingerprint(_named())
    assert frozen_weights.resume_refusal("ck", manifest, None, same) == (None, True)
    assert frozen_weights.resume_refusal("ck", {}, None, same) == (None, True)  # written before it: unchecked
    named = _named()
    other = frozen_weights.fingerprint([named[0], ("b.weight", named[1][1] + 1), named[2]])
    why, now = frozen_weights.resume_refusal("ck", manifest, None, other)
    assert now, "the same frozen names: refused before the load"
    assert why is not None and "\n" not in why and "HINT:" in why, why
    assert "1 of its 3 frozen tensors differ" in why and "first: 'b.weight' has other values" in why, why
    fewer = frozen_weights.fingerprint(named[:2])
    why, now = frozen_weights.resume_refusal("ck", manifest, None, fewer)
    assert not now, "other frozen names: after the load's own model checks"
    assert why is not None and "3 frozen tensors in the checkpoint, 2 in this model" in why, why
    assert "'c.bias' is not frozen in this model" in why, why


def test_a_malformed_recorded_fingerprint_is_refused_in_one_line() -> None:
    why, _ = frozen_weights.resume_refusal("ck", {FROZEN_FINGERPRINT: {"tensors": [1]}}, None,
                                           frozen_weights.fingerprint(_named()))
    assert why is not None and "malformed" in why and "HINT:" in why, why


def test_frozen_weights_on_the_meta_device_are_refused_in_one_line_at_the_start() -> None:
    """A PEFT base whose frozen weights have no data (built on the meta device, or offloaded by a device_map) cannot
    be fingerprinted nor supplied to a resume: one line with a HINT, on every rank. Before: NotImplementedError
    ("Cannot copy out of meta tensor") from the fingerprint, a traceback at the start of train()."""
    import peft
    import transformers

    from slurm_jit.train.refusals import JitRefusal

    with torch.device("meta"):
        base = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=32, n_embd=8, n_layer=1, n_head=2))
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["c_attn"]))
    for is_rank0 in (True, False):
        with pytest.raises(JitRefusal) as refused:
            frozen_weights.at_start(model, is_rank0)
        why = str(refused.value)
        assert "\n" not in why and "no data (on the meta device)" in why and "HINT:" in why, why


_ZERO_INIT_BASES = """
import os, socket
sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]; sock.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed, torch
from slurm_jit.train import frozen_weights
deepspeed.init_distributed("gloo")
for seed in (0, 1):
    torch.manual_seed(seed)
    with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}, "train_batch_size": 1}):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model.requires_grad_(False)
    found = frozen_weights.of_model(model)
    print("FOUND", found.digest, found.tensors["0.weight"])
"""


@pytest.mark.deepspeed
def test_bases_built_partitioned_by_zero3_init_get_their_own_fingerprints() -> None:
    """from_pretrained under a ZeRO-3 config builds the base inside deepspeed.zero.Init: each parameter's own data
    is empty and its values are in its partition. Two bases (other seeds) must still differ, and the shape be the
    whole tensor's. Before: every tensor was 'float32[0]' with the hash of no bytes, so any base passed."""
    done = subprocess.run([sys.executable, "-c", _ZERO_INIT_BASES], capture_output=True, text=True, timeout=300)
    found = [line.split(" ", 2)[1:] for line in done.stdout.splitlines() if line.startswith("FOUND ")]
    assert done.returncode == 0 and len(found) == 2, done.stderr[-3000:]
    (digest0, entry0), (digest1, entry1) = found
    assert digest0 != digest1, found
    assert entry0.startswith("float32[8, 8]:zero3:") and entry0 != entry1, found
