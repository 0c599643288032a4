"""Property: whatever the directory holds, ckpt-check answers in time, without a traceback, with an exit status in
{0, 1, 2, 3}, and never names a checkpoint this test broke. Random trees of crafted checkpoints (with and without
manifest, with DeepSpeed or not, 1-3 ranks), each left whole or broken by one of many damages: FIFOs, sockets,
symlinks in and out (to a FIFO outside too: following it would block), truncated, oversized (sparse) and
undecodably named files, JSON of every shape as trainer state or manifest, absurd rank numbers. About 20 s.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import ckpt_factory
from ckpt_factory import run_ckpt_check
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_jit.checkpoint import formats, manifest, protocol

EXAMPLES = 120  # ~0.1 s each
SUBPROCESS_EXAMPLES = 4  # ~0.7 s each: the real process under PYTHONIOENCODING=utf-8:strict
SUBPROCESS_TIMEOUT_S = 60  # a hang detector
EXITS = {0, 1, 2, 3}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=True)
    | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
odd_names = st.sampled_from([b"\xff\xfe.json", b"\x80", b"a\nb.pt", b"rng_state_99999999999999.pth",
                             b"rng_state_7.pth", b"zero_pp_rank_123456789012_mp_rank_00_optim_states.pt",
                             b" .safetensors", b"\xed\xa0\x80.bin", b"-", b"checkpoint-is-incomplete.txt.bak"])


class Tree:
    """The directory under test and the sandbox around it (outside/: where links out point)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.out = root / "out"
        self.outside = root / "outside"
        self.out.mkdir()
        self.outside.mkdir()
        os.mkfifo(self.outside / "fifo")  # opening it for reading blocks until a writer comes: none will
        (self.outside / "state.json").write_text('{"global_step": 1}')
        self.sockets: list[socket.socket] = []
        self.broken: set[str] = set()  # checkpoint names this test damaged: never to be chosen
        self.whole: set[str] = set()  # checkpoint names left whole: one of them (or an unsure one) must be chosen
        self.unsure: set[str] = set()  # damaged in a way that may leave them whole

    def bind(self, path: Path) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(os.fsencode(path))
        self.sockets.append(sock)


@contextmanager
def sandbox() -> Iterator[Tree]:
    root = Path(tempfile.mkdtemp(prefix="ckpt-prop-", dir="/tmp"))  # short: AF_UNIX paths are limited to 108
    tree = Tree(root)
    try:
        yield tree
    finally:
        for sock in tree.sockets:
            sock.close()
        shutil.rmtree(root, ignore_errors=True)


def _victim(ckpt: Path, data: st.DataObject) -> Path:
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and not p.is_symlink())
    return data.draw(st.sampled_from(files), label="victim")


def _replace(path: Path) -> None:
    path.unlink()


def damage_fifo(tree: Tree, ckpt: Path, data: st.DataObject) -> None:
    path = _victim(ckpt, data)
    _replace(path)
    os.mkfifo(path)


def damage_socket(tree: Tree, ckpt: Path, data: st.DataObject) -> None:
    path = _victim(ckpt, data)
    _replace(path)
    tree.bind(path)


def damage_link_out(tree: Tree, ckpt: Path, data: st.DataObject) -> None:
    path = _victim(ckpt, data)
    target = data.draw(st.sampled_from([tree.outside / "fifo", Path("/dev/zero"), tree.outside / "state.json",
                                        tree.outside / "missing", path]), label="link target")
    _replace(path)
    path.symlink_to(target)


def damage_truncate(tree: Tree, ckpt: Path, data: st.DataObject) -> None:
    path = _victim(ckpt, data)
    size = path.stat().st_size
    os.truncate(path, data.draw(st.integers(min_value=0, max_value=max(0, size - 1)), label="cut"))


def damage_oversize(tree: Tree, ckpt: Path, data: st.DataObject) -> None:
    path = _victim(ckpt, data)  # sparse: costs no disk, but a reader that trusts sizes would read it all
    os.truncate(path, data.draw(st.sampled_from([formats.JSON_MAX_BYTES + 1, manifest.MANIFEST_MAX_BYTES + 1,
                                                 2**40]), label="size"))


def damage_json(tree: Tree, ckpt: Path, data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(["trainer_state.json", protocol.MANIFEST_NAME]), label="json file")
    value = data.draw(json_values, label="json")
    (ckpt / name).write_text(json.dumps(value))


def damage_manifest_field(tree: Tree, ckpt: Path, data: st.DataObject) -> None:
    if not (ckpt / protocol.MANIFEST_NAME).exists():
        (ckpt / "trainer_state.json").unlink()
        return
    field = data.draw(st.sampled_from(["step", "files", "world_size", "deepspeed_tag", "version", "contents",
                                       "format"]), label="field")
    current = json.loads((ckpt / protocol.MANIFEST_NAME).read_text()).get(field)
    value = data.draw(json_values.filter(lambda v: v is not None and v != current), label="value")
    ckpt_factory.edit_manifest(ckpt, **{field: value})


def damage_odd_name(tree: Tree, ckpt: Path, data: st.DataObject) -> str | None:
    name = data.draw(odd_names, label="odd name")
    path = Path(os.fsdecode(os.fsencode(ckpt) + b"/" + name))
    if os.path.lexists(path):
        path.unlink()
    kind = data.draw(st.sampled_from(["garbage", "fifo", "link-out"]), label="odd kind")
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link-out":
        path.symlink_to(tree.outside / "fifo")
    else:
        path.write_bytes(b"\x00garbage{")
        if not path.name.endswith((".json", ".pt", ".pth", ".bin", ".safetensors")):
            return UNSURE_RESULT  # an extra file of no checked type: the checkpoint is still whole
    return None


def damage_sentinel(tree: Tree, ckpt: Path, data: st.DataObject) -> None:
    (ckpt / protocol.SENTINEL_NAME).write_text("killed mid-save")


UNSURE_RESULT = "may still be whole"
DAMAGES: dict[str, Callable[[Tree, Path, st.DataObject], str | None]] = {
    "fifo": damage_fifo, "socket": damage_socket, "link-out": damage_link_out, "truncate": damage_truncate,
    "oversize": damage_oversize, "manifest-field": damage_manifest_field, "odd-name": damage_odd_name,
    "sentinel": damage_sentinel,
}
# may leave a checkpoint whole by chance (random JSON can be a valid trainer state): neither whole nor broken
UNSURE: dict[str, Callable[[Tree, Path, st.DataObject], None]] = {"json": damage_json}


def add_checkpoint(tree: Tree, step: int, data: st.DataObject) -> None:
    manifest = data.draw(st.booleans(), label="manifest")
    deepspeed = data.draw(st.booleans(), label="deepspeed")
    world = data.draw(st.integers(min_value=1, max_value=3), label="world")
    ckpt = ckpt_factory.checkpoint(tree.out, step, manifest=manifest, world=world, deepspeed=deepspeed,
                                   mtime=1_700_000_000.0 + step, created=1_700_000_000.0 + step)
    damage = data.draw(st.sampled_from(["none", *DAMAGES, *UNSURE]), label="damage")
    if damage == "none":
        tree.whole.add(ckpt.name)
        return
    if damage in UNSURE:
        UNSURE[damage](tree, ckpt, data)
        tree.unsure.add(ckpt.name)
    elif DAMAGES[damage](tree, ckpt, data) == UNSURE_RESULT:
        tree.unsure.add(ckpt.name)
    else:
        tree.broken.add(ckpt.name)


def add_stray(tree: Tree, data: st.DataObject) -> None:
    """An entry of the output directory that is no checkpoint directory of its own."""
    name = data.draw(st.sampled_from(["checkpoint-90", "checkpoint-91\n", "checkpoint-x", "checkpoint-92.incomplete",
                                      "checkpoint-" + "9" * 30, "checkpoint-٣"]), label="stray name")
    kind = data.draw(st.sampled_from(["fifo", "file", "link-out-fifo", "link-loop", "link-inside"]), label="stray")
    path = tree.out / name
    if os.path.lexists(path):
        return
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "file":
        path.write_bytes(b"")
    elif kind == "link-out-fifo":
        path.symlink_to(tree.outside / "fifo")
    elif kind == "link-loop":
        path.symlink_to(path)
    else:
        path.symlink_to(tree.out)
    if protocol.CHECKPOINT_RE.fullmatch(name) and len(name) < 40:
        tree.broken.add(name)


def build(tree: Tree, data: st.DataObject) -> None:
    steps = data.draw(st.lists(st.integers(min_value=1, max_value=60), min_size=0, max_size=4, unique=True),
                      label="steps")
    for step in steps:
        add_checkpoint(tree, step, data)
    for _ in range(data.draw(st.integers(min_value=0, max_value=2), label="strays")):
        add_stray(tree, data)


def assert_sane(tree: Tree, code: int, stdout: bytes, stderr: str, last: bytes) -> None:
    assert code in EXITS, (code, stderr)
    assert "Traceback" not in stderr, stderr
    chosen = Path(os.fsdecode(last)).name if last else None
    assert chosen not in tree.broken, (chosen, stdout)
    if tree.whole:
        assert code == 0 and chosen in tree.whole | tree.unsure, (code, chosen, tree.whole, stdout, stderr)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), deep=st.booleans(), as_json=st.booleans())
def test_ckpt_check_on_random_trees(data: st.DataObject, deep: bool, as_json: bool) -> None:
    with sandbox() as tree:
        build(tree, data)
        args = [tree.out, *(["--deep"] if deep else []), *(["--json"] if as_json else [])]
        run = run_ckpt_check(*args)
        if as_json and run.code != 2:
            resume = json.loads(run.stdout)["resume_from"]
            last = os.fsencode(resume) if resume else b""
        else:
            last = run.last_line if run.code != 2 else b""
        assert_sane(tree, run.code, run.stdout, run.stderr, last)


@settings(max_examples=SUBPROCESS_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_ckpt_check_process_on_random_trees(data: st.DataObject) -> None:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict"}
    with sandbox() as tree:
        build(tree, data)
        proc = subprocess.run([sys.executable, "-m", "slurm_jit.checkpoint.ckpt_check", str(tree.out)],
                              capture_output=True, env=env, timeout=SUBPROCESS_TIMEOUT_S, check=False)
        stderr = proc.stderr.decode("utf-8", "replace")
        last = proc.stdout.splitlines()[-1] if proc.stdout.strip(b"\n") else b""
        assert_sane(tree, proc.returncode, proc.stdout, stderr, last)
