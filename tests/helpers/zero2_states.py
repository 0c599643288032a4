"""States shaped as one ZeRO-2 rank's checkpoint files hold them, without DeepSpeed ranks: the model-states file's
module state dict (every parameter a view of one flat bf16 buffer, DeepSpeed's bit16_groups_flat) and the
optimizer-states file's ``optimizer_state_dict`` (``DeepSpeedZeroOptimizer.state_dict()``: the flat fp32 partition
whose unpadded views are saved, the inner Adam's ``exp_avg``/``exp_avg_sq`` of that flat partition, the live loss
scaler object, the parameter slice mappings), with DeepSpeed's own key names and classes."""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from deepspeed.checkpoint import constants as ds
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address


def flat_module(hidden: int) -> torch.nn.Module:
    """A two-layer model whose parameters are views of one flat bf16 buffer (as ZeRO-2 leaves the module)."""
    model = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.Linear(hidden, 4)).to(torch.bfloat16)
    params = list(model.parameters())
    flat = torch.empty(sum(p.numel() for p in params), dtype=torch.bfloat16)
    offset = 0
    for p in params:
        flat[offset:offset + p.numel()].copy_(p.data.flatten())
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return model


def zero2_states(model: torch.nn.Module, padding: int = 8) -> dict[str, Any]:
    """{file key: state} of one rank's files: model states and ZeRO-2 optimizer states (DeepSpeed's keys)."""
    names = [n for n, _ in model.named_parameters()]
    numel = sum(p.numel() for p in model.parameters())
    fp32_flat = torch.randn(numel + padding)  # this rank's partition, padded for alignment
    fp32_flat[numel:] = 0
    exp_avg, exp_avg_sq = torch.randn(numel + padding), torch.rand(numel + padding)
    adam = {"state": {0: {"step": torch.tensor(7.0), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": [0]}]}
    offsets, mappings = 0, OrderedDict()
    for name, p in zip(names, model.parameters(), strict=True):
        mappings[name] = fragment_address(numel=p.numel(), start=offsets)
        offsets += p.numel()
    optimizer = {
        ds.LOSS_SCALER: LossScaler(1.0), "dynamic_loss_scale": False, "overflow": False, ds.CLIP_GRAD: 1.0,
        ds.BASE_OPTIMIZER_STATE: adam,
        ds.SINGLE_PARTITION_OF_FP32_GROUPS: [fp32_flat.narrow(0, 0, numel)],  # the unpadded view of the partition
        ds.ZERO_STAGE: ZeroStageEnum.gradients, ds.GROUP_PADDINGS: [padding], ds.PARAM_ALIGNMENT_PADDINGS: [0],
        ds.PARTITION_COUNT: [2], ds.DS_VERSION: "0.19.8", ds.PARAM_SLICE_MAPPINGS: [mappings],
    }
    return {
        "mp_rank_00_model_states.pt": {"module": model.state_dict(), "global_steps": 7, "ds_version": "0.19.8",
                                       "buffer_names": [], "param_shapes": [OrderedDict(
                                           (n, p.shape) for n, p in model.named_parameters())]},
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt": {"optimizer_state_dict": optimizer,
                                                           "ds_version": "0.19.8"},
        "rng_state_0.pth": {"python": random.getstate(), "numpy": np.random.get_state(),
                            "cpu": torch.random.get_rng_state()},
    }


def mutate_in_place(model: torch.nn.Module, states: dict[str, Any]) -> None:
    """What the next training steps do to the originals: parameters, moments, the step, the loss scale, the lr."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    optimizer = states["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"]["optimizer_state_dict"]
    adam = optimizer[ds.BASE_OPTIMIZER_STATE]
    for moment in adam["state"][0].values():
        moment.mul_(3).add_(1)
    optimizer[ds.SINGLE_PARTITION_OF_FP32_GROUPS][0].add_(5)
    optimizer[ds.LOSS_SCALER].cur_scale = 1024.0
    adam["param_groups"][0]["lr"] = 0.5
    optimizer[ds.GROUP_PADDINGS].append(99)
