"""A tiny, real training job: GPT-2 (or Llama) built from a config, DeepSpeed ZeRO on CPU ranks over gloo.

Used by the demo, the tests and the benchmarks. Run one process per rank (srun, or tests/ranks.py), e.g.::

    python -m slurm_jit.demo_train --output-dir out --max-steps 20 --save-steps 10 --resume

``--device cuda``: the model on the rank's GPU in bf16 (DeepSpeed's ``"bf16"`` section, ``bf16=True``), NCCL for
the model's collectives (``--dist-backend gloo``: gloo, so that ranks may share a GPU), the JitTrainer's agreement
on its gloo side group as on CPU, deterministic algorithms (a resume bitwise). ``tools/gpu-check`` runs it.

Per-step training losses go to ``OUT/losses-rank0.jsonl`` (rank 0), so that runs can be compared bitwise.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from slurm_jit.demo_callbacks import callbacks as _callbacks
from slurm_jit.demo_callbacks import step_sleep_s as _step_sleep_s  # noqa: F401 - the name tests call
from slurm_jit.demo_device import CUBLAS_WORKSPACE, cuda_setup
from slurm_jit.train import dist_env

VOCAB = 128
SEQ_LEN = 32
STALL_PLACES = ("step", "step_end", "save", "worker", "train_end")  # --stall-in
VARIANTS = ("transposed", "renamed")  # --variant: what a library upgrade may change in a model's layout
DEVICES = ("cpu", "cuda", "auto")  # --device


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--save-steps", type=int, default=0, help="periodic save every N steps (0: none)")
    p.add_argument("--save-total-limit", type=int, default=None)
    p.add_argument("--eval-steps", type=int, default=0, help="evaluate every N steps (0: never)")
    p.add_argument("--eval-samples", type=int, default=16)
    p.add_argument("--zero-stage", type=int, default=2, choices=(0, 1, 2, 3))
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--workers", type=int, default=0, help="dataloader_num_workers")
    p.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    p.add_argument("--width", type=int, default=64, help="hidden size (bigger: slower steps, bigger saves)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--iterable", action="store_true",
                   help="the training samples as a torch IterableDataset (in order: no sampler, no shuffle)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per training step")
    p.add_argument("--step-sleep-requeued", type=float, default=None,
                   help="extra seconds per training step in a requeued run (SLURM_RESTART_COUNT > 0); "
                        "default: --step-sleep")
    p.add_argument("--eval-sleep", type=float, default=0.0, help="extra seconds per evaluation batch")
    p.add_argument("--resume", action="store_true", help="train(resume_from_checkpoint=True)")
    p.add_argument("--trainer", choices=("jit", "plain"), default="jit",
                   help="slurm_jit.JitTrainer, or transformers.Trainer for comparison")
    p.add_argument("--upstream-jit", action="store_true", help="TrainingArguments(enable_jit_checkpoint=True)")
    p.add_argument("--kill-wait", type=float, default=3.0)
    p.add_argument("--workers-take-signals", action="store_true",
                   help="JitConfig(ignore_signals_in_workers=False), to show what the default prevents")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--mp-context", choices=("fork", "spawn", "forkserver"), default=None,
                   help="start method of the DataLoader workers (default: the platform's)")
    p.add_argument("--signals", default="TERM", help="JitConfig(signals=...), comma-separated, e.g. TERM,USR1")
    p.add_argument("--own-handler", action="store_true",
                   help="install a SIGTERM handler before train() that appends to OUT/own-handler-rank<R>.txt")
    p.add_argument("--after-train-sleep", type=float, default=0.0,
                   help="seconds to stay alive after train() returned (it logs 'train() returned' first)")
    p.add_argument("--return-after-stop", action="store_true",
                   help="JitConfig(exit_after_jit_stop=False): train() returns after a JIT stop (final-state.json "
                        "and --after-train-sleep then follow it)")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="Llama's attention_dropout (GPT-2 always has 0.1): makes an exact resume depend on the RNG")
    p.add_argument("--resume-from", default=None, help="train(resume_from_checkpoint=PATH)")
    p.add_argument("--metric-for-best", default=None, help="metric_for_best_model, e.g. loss")
    p.add_argument("--save-only-model", action="store_true", help="TrainingArguments(save_only_model=True)")
    p.add_argument("--save-on-each-node", action="store_true", help="TrainingArguments(save_on_each_node=True)")
    p.add_argument("--on-save-file", default=None,
                   help="a callback writes this file into every checkpoint in on_save (rank 0)")
    p.add_argument("--signal-self-at-step", type=int, default=0,
                   help="each rank sends itself SIGTERM at the end of this step (a stop at a known step)")
    p.add_argument("--slow-train-end", type=float, default=0.0,
                   help="seconds an on_train_end callback sleeps after a stop (slow user cleanup)")
    p.add_argument("--side-group-timeout", type=float, default=None, help="JitConfig(side_group_timeout_s=...)")
    p.add_argument("--refuse-batch-change", action="store_true",
                   help="JitConfig(keep_global_batch=False): a resume whose samples per optimizer step differ "
                        "(another world size, another --batch-size or --grad-accum) is refused")
    p.add_argument("--hang-timeout", default="auto", help="JitConfig(hang_timeout_s=...): seconds, auto or none")
    p.add_argument("--stall-at-step", type=int, default=-1,
                   help="on_step_begin sleeps --stall-s when global_step is this (0: the first step)")
    p.add_argument("--stall-s", type=float, default=0.0)
    p.add_argument("--stall-in", choices=STALL_PLACES, default="step",
                   help="where the stall is: 'step' (on_step_begin), 'step_end' (on_step_end: just before the stop "
                        "round in the side group), 'save' (on_save, inside the first save at or "
                        "after --stall-at-step: a stuck writer), 'worker' (the DataLoader worker's item fetch for "
                        "that step, with --workers 1), 'train_end' (on_train_end, once --stall-at-step is reached: "
                        "a rank slow to end)")
    p.add_argument("--stall-rank", type=int, default=-1, help="the rank that stalls (-1: every rank)")
    p.add_argument("--fail-at-step", type=int, default=0, help="the first train() raises at this step")
    p.add_argument("--fail-rank", type=int, default=-1, help="the rank that raises at --fail-at-step (-1: every rank)")
    p.add_argument("--train-again", action="store_true", help="after a failed train(), call train() again")
    p.add_argument("--ds-optimizer", choices=("AdamW",), default=None,
                   help='an "optimizer" section in the DeepSpeed config (default: none, the Trainer\'s AdamW)')
    p.add_argument("--offload", action="store_true", help="ZeRO-Offload: optimizer on CPU (DeepSpeedCPUAdam)")
    p.add_argument("--jit-save-weights", action="store_true",
                   help="JitConfig(jit_save_model_weights=True): JIT saves also write model.safetensors (ZeRO-3: "
                        "the consolidated 16-bit gather)")
    p.add_argument("--freeze-embeddings", action="store_true", help="the input embeddings do not train")
    p.add_argument("--lora", action="store_true",
                   help="wrap the model in a LoRA adapter (peft.get_peft_model): only the adapters train")
    p.add_argument("--lora-rank", type=int, default=LORA_RANK, help="with --lora: LoraConfig.r")
    p.add_argument("--lora-targets", default="",
                   help="with --lora: comma-separated target modules (default: the attention projections)")
    p.add_argument("--lora-modules-to-save", default="",
                   help="with --lora: comma-separated modules that train whole beside it (LoraConfig.modules_to_save)")
    p.add_argument("--full-jit-save", action="store_true",
                   help="JitConfig(slim_jit_save=False): JIT saves write DeepSpeed's full model-states file")
    p.add_argument("--async-periodic-saves", action="store_true",
                   help="JitConfig(async_periodic_saves=True): periodic saves written in the background")
    p.add_argument("--step-times", action="store_true",
                   help="rank 0 appends each step's end time to OUT/step-times-rank0.jsonl (the benchmarks)")
    p.add_argument("--device", choices=DEVICES, default="cpu",
                   help="cpu (fp32, gloo); cuda (bf16, NCCL unless --dist-backend gloo, deterministic algorithms: "
                        "CUBLAS_WORKSPACE_CONFIG=" + CUBLAS_WORKSPACE + "); auto: cuda where torch sees a GPU")
    p.add_argument("--dist-backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="with --device cuda: the model's collectives (auto: nccl); gloo lets ranks share a GPU "
                        "(NCCL refuses two ranks on one), their CUDA tensors staged through host memory")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=1.0, help='max_grad_norm (DeepSpeed "gradient_clipping": "auto")')
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=2, help="Llama only")
    p.add_argument("--untie-embeddings", action="store_true",
                   help="tie_word_embeddings=False: the output layer is a parameter of its own (GPT-2 ties it)")
    p.add_argument("--variant", choices=VARIANTS, default=None,
                   help="GPT-2 only, the same function in another layout: 'transposed': layer 0's MLP input is an "
                        "nn.Linear (its weight stored transposed, as a Conv1D->Linear change); 'renamed': layer "
                        "0's MLP output projection is registered as 'proj_out' (as a renamed module)")
    p.add_argument("--dump-state-at", default="",
                   help="comma-separated steps: write the complete training state of each rank to "
                        "OUT/exact-state/step-N/ (compare two runs with python -m slurm_jit.exactness)")
    p.add_argument("--targ", action="append", default=[], metavar="KEY=JSON",
                   help='any other TrainingArguments field, its value as JSON, e.g. --targ eval_on_start=true')
    p.add_argument("--loss-func", action="store_true", help="Trainer(compute_loss_func=...): token cross-entropy")
    p.add_argument("--metrics", action="store_true",
                   help="Trainer(compute_metrics=..., preprocess_logits_for_metrics=...): eval token accuracy")
    p.add_argument("--metrics-sleep", type=float, default=0.0, help="extra seconds in compute_metrics (--metrics)")
    return p.parse_args(argv)


def _extra_training_args(pairs: list[str]) -> dict[str, Any]:
    """``--targ KEY=JSON`` pairs as TrainingArguments keyword arguments."""
    extra: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"demo_train: --targ {pair!r}. HINT: KEY=JSON, e.g. --targ eval_on_start=true")
        extra[key] = json.loads(value)
    return extra


class _Tokens:
    """Deterministic random token sequences (a torch Dataset without importing torch at module level).
    ``stall_after_items``: a DataLoader worker's fetch sleeps ``stall_s`` once it has fetched that many items."""

    def __init__(self, n: int, seed: int, vocab: int = VOCAB, stall_after_items: int = -1,
                 stall_s: float = 0.0) -> None:
        import torch

        gen = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab, (n, SEQ_LEN), generator=gen)
        self.stall_after_items, self.stall_s, self.fetched = stall_after_items, stall_s, 0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch.utils.data

        self.fetched += 1
        if 0 <= self.stall_after_items < self.fetched and torch.utils.data.get_worker_info() is not None:
            time.sleep(self.stall_s)  # a worker stuck in I/O (a hung network file system, a blocked read)
        return {"input_ids": self.data[i], "labels": self.data[i]}


def _train_dataset(args: argparse.Namespace, rank: int) -> Any:
    tokens = _Tokens(args.samples, args.seed, args.vocab, *_worker_stall(args, rank))
    if not args.iterable:
        return tokens
    import torch.utils.data

    class _Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            return (tokens[i] for i in range(len(tokens)))

    return _Stream()


def build_model(kind: str, width: int, layers: int, dropout: float = 0.0, vocab: int = VOCAB, heads: int = 2,
                kv_heads: int = 2, untie: bool = False, variant: str | None = None) -> Any:
    import transformers

    tied = {"tie_word_embeddings": False} if untie else {}  # else the config's default (GPT-2: tied)

    if kind == "gpt2":
        cfg: Any = transformers.GPT2Config(vocab_size=vocab, n_positions=SEQ_LEN * 2, n_embd=width, n_layer=layers,
                                           n_head=heads, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                                           **tied)
        return _relayout(transformers.GPT2LMHeadModel(cfg), variant)
    if variant:
        raise SystemExit(f"demo_train: --variant {variant} is GPT-2 only. HINT: --model gpt2")
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=width * 2,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=SEQ_LEN * 2, attention_dropout=dropout, **tied)
    return transformers.LlamaForCausalLM(cfg)


def _relayout(model: Any, variant: str | None) -> Any:
    """``model`` computing the same function with layer 0's MLP in another layout (``--variant``)."""
    import torch

    mlp = model.transformer.h[0].mlp
    if variant == "transposed":  # Conv1D computes x @ W (W: [in, out]); nn.Linear x @ W.T (W: [out, in])
        conv = mlp.c_fc
        with torch.random.fork_rng(devices=[]):  # its initial values are replaced: draw nothing from the seed
            linear = torch.nn.Linear(conv.weight.shape[0], conv.weight.shape[1])
        with torch.no_grad():
            linear.weight.copy_(conv.weight.t())
            linear.bias.copy_(conv.bias)
        mlp.c_fc = linear
    elif variant == "renamed":  # registered as proj_out, in c_proj's place; forward still finds self.c_proj
        mlp._modules = {("proj_out" if k == "c_proj" else k): m for k, m in mlp._modules.items()}
        mlp.__dict__["c_proj"] = mlp._modules["proj_out"]
    return model


LORA_RANK = 4  # LoraConfig.r, small as the model
LORA_TARGETS = {"gpt2": ["c_attn"], "llama": ["q_proj", "v_proj"]}  # the attention projections, as PEFT's examples


def _with_lora(model: Any, kind: str, modules_to_save: list[str], rank: int, targets: list[str]) -> Any:
    """``model`` wrapped in a LoRA adapter: the base frozen, the adapters (and ``modules_to_save``) trainable."""
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets or LORA_TARGETS[kind],
                             fan_in_fan_out=kind == "gpt2",  # GPT-2's Conv1D stores its weight transposed
                             modules_to_save=modules_to_save or None, task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


# The optimizer section as a user writes it: Trainer fills each "auto" from TrainingArguments.
_DS_OPTIMIZER_PARAMS = {
    "AdamW": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
}


def deepspeed_config(zero_stage: int, optimizer: str | None = None, offload: bool = False,
                     gather_16bit: bool = False, bf16: bool = False) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": zero_stage}
    if gather_16bit:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,
        "zero_optimization": zero,
    }
    if optimizer:
        config["optimizer"] = {"type": optimizer, "params": dict(_DS_OPTIMIZER_PARAMS[optimizer])}
    if bf16:  # bf16 weights and gradients, fp32 master weights in the optimizer (ZeRO's bf16 optimizer)
        config["bf16"] = {"enabled": True}
    return config


def _install_own_handler(out_dir: str, rank: int) -> None:
    """A user's SIGTERM handler, to show that train() gives it back."""
    path = os.path.join(out_dir, f"own-handler-rank{rank}.txt")

    def handler(signum: int, frame: Any) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{signum}\n")

    os.makedirs(out_dir, exist_ok=True)
    signal.signal(signal.SIGTERM, handler)


def _loss_and_metric_functions(args: argparse.Namespace) -> dict[str, Any]:
    """The Trainer's function arguments that ``--loss-func`` and ``--metrics`` switch on."""
    import torch

    functions: dict[str, Any] = {}
    if args.loss_func:
        def token_cross_entropy(outputs: Any, labels: Any, num_items_in_batch: Any = None) -> Any:
            logits = outputs.logits[:, :-1].flatten(0, 1).float()
            return torch.nn.functional.cross_entropy(logits, labels[:, 1:].flatten())

        functions["compute_loss_func"] = token_cross_entropy
    if args.metrics:
        def argmax(logits: Any, labels: Any) -> Any:
            return logits.argmax(-1)

        def accuracy(pred: Any) -> dict[str, float]:
            time.sleep(args.metrics_sleep)  # a metric over the whole evaluation set (decoding, scoring)
            return {"accuracy": float((pred.predictions[:, :-1] == pred.label_ids[:, 1:]).mean())}

        functions.update(preprocess_logits_for_metrics=argmax, compute_metrics=accuracy)
    return functions


def _worker_stall(args: argparse.Namespace, rank: int) -> tuple[int, float]:
    """(items a worker fetches before it stalls, seconds) for ``--stall-in worker`` on this rank; (-1, 0) else."""
    if args.stall_in != "worker" or args.stall_at_step < 0 or args.stall_rank not in (-1, rank):
        return -1, 0.0
    return args.stall_at_step * args.batch_size * args.grad_accum, args.stall_s


def _show_info_lines() -> None:
    """slurm_jit's INFO lines (each save, with its sizes) in the job log, as a user enables them."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    package_logger = logging.getLogger("slurm_jit")
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)


def main(argv: Sequence[str] | None = None, trainer_cls: Any = None) -> None:
    """Train; ``trainer_cls`` (a JitTrainer subclass, or a callable making one) replaces JitTrainer."""
    args = parse_args(argv)
    _show_info_lines()
    dist_env.from_slurm()
    cuda = cuda_setup(args.device, args.dist_backend)
    if args.zero_stage:  # --zero-stage 0: no DeepSpeed at all (plain DDP over gloo)
        os.environ.setdefault("ACCELERATE_USE_DEEPSPEED", "true")
    if args.mp_context:
        import multiprocessing

        multiprocessing.set_start_method(args.mp_context, force=True)  # what DataLoader workers use by default
    import transformers

    transformers.set_seed(args.seed)
    rank = int(os.environ.get("RANK", "0"))
    base: dict[str, Any] = dict(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        max_grad_norm=args.clip,
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        save_total_limit=args.save_total_limit,
        eval_strategy="steps" if args.eval_steps else "no",
        eval_steps=args.eval_steps or None,
        dataloader_num_workers=args.workers,
        use_cpu=not cuda,
        bf16=cuda,
        deepspeed=deepspeed_config(args.zero_stage, args.ds_optimizer, args.offload,
                                   args.jit_save_weights, bf16=cuda) if args.zero_stage else None,
        report_to=[],
        seed=args.seed,
        disable_tqdm=True,
        enable_jit_checkpoint=args.upstream_jit,
        metric_for_best_model=args.metric_for_best,
        save_only_model=args.save_only_model,
        save_on_each_node=args.save_on_each_node,
    )
    targs = transformers.TrainingArguments(**{**base, **_extra_training_args(args.targ)})  # --targ wins
    model = build_model(args.model, args.width, args.layers, args.dropout, args.vocab, args.heads, args.kv_heads,
                        untie=args.untie_embeddings, variant=args.variant)
    if args.freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    if args.lora:
        model = _with_lora(model, args.model, [m for m in args.lora_modules_to_save.split(",") if m], args.lora_rank,
                           [m for m in args.lora_targets.split(",") if m])
    common: dict[str, Any] = dict(
        model=model, args=targs, train_dataset=_train_dataset(args, rank),
        eval_dataset=_Tokens(args.eval_samples, args.seed + 1, args.vocab) if args.eval_steps else None,
        callbacks=_callbacks(args, rank), **_loss_and_metric_functions(args),
    )
    from slurm_jit.train.refusals import JitRefusal
    from slurm_jit.train.save_errors import CheckpointWriteError

    try:
        _train(args, common, trainer_cls)
    except JitRefusal as exc:
        print(f"demo_train: {exc}", file=sys.stderr)
        sys.exit(2)
    except CheckpointWriteError as exc:  # a full disk: one line, the earlier checkpoints untouched
        print(f"demo_train: {exc}", file=sys.stderr)
        sys.exit(1)
    import torch.distributed as dist

    if dist.is_initialized():  # a clean teardown, so that no rank aborts at exit while its peer is gone
        try:
            dist.barrier()
        except RuntimeError as exc:  # a peer ended first (e.g. by its watchdog): the training is done all the same
            print(f"demo_train: a peer was gone at the final barrier ({str(exc).strip()[:120]})", file=sys.stderr)
        dist.destroy_process_group()


def _write_final_state(out_dir: str, trainer: Any) -> None:
    """OUT/final-state.json after train(): the step, the best checkpoint and metric, and a digest of the model's
    weights (after load_best_model_at_end: the weights it loaded), to compare a resumed run with an
    uninterrupted one."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for name, param in sorted(trainer.model.named_parameters()):
        digest.update(name.encode())
        # as bytes: numpy has no bfloat16 (a --targ bf16=true run's weights)
        digest.update(param.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    best = trainer.state.best_model_checkpoint
    state = {"global_step": trainer.state.global_step, "best_metric": trainer.state.best_metric,
             "best_model_checkpoint": os.path.basename(best) if best else None, "weights_sha256": digest.hexdigest()}
    with open(os.path.join(out_dir, "final-state.json"), "w", encoding="utf-8") as f:
        json.dump(state, f)


def _hang_timeout(text: str) -> float | str | None:
    return None if text == "none" else text if text == "auto" else float(text)


def _train(args: argparse.Namespace, common: dict[str, Any], trainer_cls: Any = None) -> None:
    import transformers

    if args.trainer == "jit":
        from slurm_jit.train.refusals import JitRefusal
        from slurm_jit.train.trainer import JitConfig, JitTrainer

        try:
            config = JitConfig(kill_wait_s=args.kill_wait, ignore_signals_in_workers=not args.workers_take_signals,
                               signals=tuple(args.signals.split(",")), jit_save_model_weights=args.jit_save_weights,
                               slim_jit_save=not args.full_jit_save, hang_timeout_s=_hang_timeout(args.hang_timeout),
                               keep_global_batch=not args.refuse_batch_change,
                               async_periodic_saves=args.async_periodic_saves,
                               exit_after_jit_stop=not args.return_after_stop,
                               **({"side_group_timeout_s": args.side_group_timeout}
                                  if args.side_group_timeout is not None else {}))
        except ValueError as exc:  # one line with its HINT, as every refusal
            raise JitRefusal(f"JitConfig: {exc}") from None
        trainer: Any = (trainer_cls or JitTrainer)(**common, jit_config=config)
    else:
        trainer = transformers.Trainer(**common)
    for callback in common["callbacks"]:
        if hasattr(callback, "trainer"):  # the state dump reads the DeepSpeed engine through the trainer
            callback.trainer = trainer
    if args.own_handler:
        _install_own_handler(args.output_dir, int(os.environ.get("RANK", "0")))
    resume = args.resume_from or (True if args.resume else None)
    try:
        trainer.train(resume_from_checkpoint=resume)
    except RuntimeError as exc:
        if not (args.train_again and "failure injected" in str(exc)):
            raise
        print(f"demo_train: train() failed ({exc}); side group closed: {not trainer.jit_side_group_open}; "
              "training again", file=sys.stderr)
        trainer.train(resume_from_checkpoint=resume)
    if int(os.environ.get("RANK", "0")) == 0:
        _write_final_state(args.output_dir, trainer)
    if args.after_train_sleep:
        print(f"train() returned on rank {os.environ.get('RANK', '0')}", flush=True)
        time.sleep(args.after_train_sleep)


if __name__ == "__main__":
    main()
