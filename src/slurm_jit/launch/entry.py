"""Check the training entry at submit time, without running the user's code: ``--function module:function``,
or the program of ``-- PROGRAM ARGS`` (:func:`check_program`).

A typo would otherwise fail in every rank at the start of every run of the job. The module is found with
:func:`importlib.util.find_spec` (which imports its parent packages, not the module itself) and its source is
parsed, not executed: a name it does not define at top level is refused, unless the module could define it in
ways a parse cannot see (``from x import *``, ``__getattr__``, no source).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re

from slurm_jit.launch.command import Command

DOTTED_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
HINT = "HINT: module:function, e.g. mypkg.train:main, with the module on PYTHONPATH"


def _top_level_names(tree: ast.Module) -> set[str] | None:
    """Names the module binds at top level; None when it may bind others unseen."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            return None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        else:
            names.update(n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))
    return None if "__getattr__" in names else names


def check_function(target: str, here: bool = True) -> None:
    """Raise ValueError (one line with a HINT) when ``target`` is malformed or, checked ``here`` (the job runs
    this interpreter), its module or function does not exist."""
    module_name, _, function_name = target.partition(":")
    if not DOTTED_NAME.fullmatch(module_name) or not function_name.isidentifier():
        raise ValueError(f"--function {target!r}: not module:function. {HINT}")
    if not here:
        return  # another interpreter (--python): its path is not ours to search
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"--function {target}: cannot find module {module_name} ({exc}). {HINT}") from None
    if found is None:
        raise ValueError(f"--function {target}: no module {module_name} on this Python's path. {HINT}")
    if not found.origin or not found.origin.endswith(".py"):
        return  # a package without __init__ source, or compiled: nothing to parse
    try:
        with open(found.origin, encoding="utf-8") as handle:
            tree = ast.parse(handle.read(), found.origin)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"--function {target}: cannot read {found.origin} ({exc}). {HINT}") from None
    names = _top_level_names(tree)
    if names is not None and function_name not in names:
        raise ValueError(f"--function {target}: {module_name} ({found.origin}) defines no {function_name}. {HINT}")


def check_program(program: str) -> None:
    """Raise ValueError (one line with a HINT) for a training program every rank would fail to exec (as
    :meth:`Command.problem` finds it), before anything is written, in a dry run too."""
    problem = Command([program]).problem()
    if problem is None:
        return
    if os.sep not in program and os.path.isfile(program):  # exec looks a bare name up on PATH, never in "."
        raise ValueError(f"the training program {program}: a file here, but a program without a / is looked up "
                         f"on PATH, not in this directory. HINT: -- ./{program} (with chmod +x {program}), or run "
                         f"it through its interpreter (-- python {program})")
    if os.path.isfile(program) and not os.access(program, os.X_OK):
        raise ValueError(f"the training program {program} is not executable: every rank would fail to start it. "
                         f"HINT: chmod +x {program}, or run it through its interpreter (-- python {program})")
    raise ValueError(f"the training program {problem}, so every rank would fail to start it. HINT: its path "
                     "(e.g. -- ./train.sh), or a program on PATH (e.g. -- python train.py)")
