"""One srun task = one rank: ``python -m slurm_jit.launch.task --spec JSON`` (or ``SPEC.json``, or
``-- PROGRAM ARGS...``).

The spec (in the batch script ``python launch/submit.py`` writes) holds the training entry as data, never as
shell text, so that arguments with spaces, quotes, ``$()`` or ``;`` reach the training process unchanged:

- ``{"argv": ["python", "train.py", "--lr", "3e-4"]}``: exec'd in place (this process becomes the rank, so Slurm's
  signals reach it directly; no wrapper in between that could swallow or forward them);
- ``{"function": "package.module:function", "args": [...]}``: imported and called with no arguments, ``sys.argv``
  set to ``[module, *args]``.

The raw sbatch scripts use the second form, ``srun python -m slurm_jit.launch.task -- python train.py ...``.
Before any of them, RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT are set from
Slurm's variables (:func:`slurm_jit.train.dist_env.from_slurm`).
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import sys
from collections.abc import MutableMapping, Sequence
from typing import Any

from slurm_jit.train import dist_env

EXIT_BAD_SPEC = 2


def set_rank_env(env: MutableMapping[str, str] | None = None) -> None:
    """torch.distributed's variables, LOCAL_WORLD_SIZE included, from Slurm's (:func:`dist_env.from_slurm`)."""
    dist_env.from_slurm(os.environ if env is None else env)


def load(spec_path: str) -> dict[str, Any]:
    with open(spec_path, encoding="utf-8") as handle:
        return parse(handle.read())


def parse(text: str) -> dict[str, Any]:
    """The spec from its JSON text; ValueError when it is not one."""
    spec = json.loads(text)
    if not isinstance(spec, dict):
        raise ValueError("the spec is not a JSON object")
    argv, function = spec.get("argv"), spec.get("function")
    if (argv is None) == (function is None):
        raise ValueError("the spec needs exactly one of argv or function")
    if argv is not None and (not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv)):
        raise ValueError("argv must be a non-empty list of strings")
    if function is not None and (not isinstance(function, str) or ":" not in function):
        raise ValueError("function must be 'module:function'")
    return dict(spec)


def cannot_run(program: str, exc: OSError) -> str:
    """One line for a program execvp refused (missing, no exec bit, not a program), with what to do."""
    hint = "give the program's path"
    if isinstance(exc, PermissionError) and os.path.isfile(program):
        hint = f"make it executable (chmod +x {program}), or run it through its interpreter (-- python {program})"
    elif isinstance(exc, PermissionError) or exc.errno == errno.ENOEXEC:
        hint = "give a program file (not a directory), executable, with a #! line if it is a script"
    return f"slurm-jit task: cannot run {program}: {exc.strerror or exc}. HINT: {hint}"


def _exec(argv: list[str]) -> None:
    set_rank_env()
    try:
        os.execvp(argv[0], argv)  # replaces this process: the rank is the srun task itself
    except OSError as exc:
        print(cannot_run(argv[0], exc), file=sys.stderr)
        sys.exit(EXIT_BAD_SPEC)


def run(spec: dict[str, Any]) -> None:
    if spec.get("argv"):
        _exec(list(spec["argv"]))
    set_rank_env()
    module_name, _, function_name = spec["function"].partition(":")
    sys.argv = [module_name, *[str(a) for a in spec.get("args", [])]]
    function = getattr(importlib.import_module(module_name), function_name)
    result = function()
    sys.exit(result if isinstance(result, int) else 0)


def call_function(target: str, args: Sequence[str]) -> Any:
    """``python launch/submit.py --function module:function -- ARGS``, as JitExecutor submits it (pickled by
    reference, called in every srun task): ``sys.argv`` set to ``[module, *args]``, the function called with no
    arguments; a non-zero int it returns is the task's exit status, as with ``--spec``."""
    module_name, _, function_name = target.partition(":")
    sys.argv = [module_name, *[str(a) for a in args]]
    result = getattr(importlib.import_module(module_name), function_name)()
    if isinstance(result, int) and not isinstance(result, bool) and result != 0:
        raise SystemExit(result)
    return result


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"] and len(args) > 1:
        _exec(args[1:])
    inline = args[:1] == ["--spec"]
    if len(args) != 1 + inline:
        print("usage: python -m slurm_jit.launch.task --spec JSON | SPEC.json | -- PROGRAM ARGS...",
              file=sys.stderr)
        sys.exit(EXIT_BAD_SPEC)
    try:
        spec = parse(args[1]) if inline else load(args[0])
    except (OSError, ValueError) as exc:
        print(f"slurm-jit task: bad spec {args[-1][:200]}: {exc}. HINT: write it with python launch/submit.py",
              file=sys.stderr)
        sys.exit(EXIT_BAD_SPEC)
    try:
        run(spec)
    except (ImportError, AttributeError) as exc:
        print(f"slurm-jit task: cannot load {spec.get('function')}: {exc}. HINT: is the module on PYTHONPATH?",
              file=sys.stderr)
        sys.exit(EXIT_BAD_SPEC)


if __name__ == "__main__":
    main()
