"""No import circle in src/ (STYLE.md: "No import circle, type-only ones included"): every import statement counts,
at module level, under TYPE_CHECKING and inside a function (tests/helpers/import_graph.py builds the graph). Any
circle fails (the last ones, around trainer.py and the async saver, went with issue #43's session)."""

from __future__ import annotations

from pathlib import Path

from import_graph import cycles, import_graph

SRC = Path(__file__).resolve().parents[2] / "src"


def test_src_has_no_import_circle() -> None:
    graph = import_graph(SRC)
    assert len(graph) >= 100 and "slurm_jit.timing" in graph, sorted(graph)  # the tree is where this test thinks
    new = [sorted(c) for c in cycles(graph)]
    assert not new, f"import circles: {new}. HINT: move what both modules need below both (one module per idea)"


def test_the_graph_sees_type_only_and_function_level_imports(tmp_path: Path) -> None:
    """The helper itself: a circle closed only by a TYPE_CHECKING import, or only inside a function, is found; a
    name imported from a package is an edge to the package, a submodule imported from it an edge to that alone."""
    sources = {
        "a": "from pkg import b\n",
        "b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n",
        "c": "import pkg.d\n",
        "d": "def f():\n    from pkg import c\n",
        "e": "from pkg import a, VERSION\n",
        "__init__": "VERSION = 1\n",
    }
    (tmp_path / "pkg").mkdir()
    for name, text in sources.items():
        (tmp_path / "pkg" / f"{name}.py").write_text(text)
    graph = import_graph(tmp_path)
    assert graph["pkg.e"] == {"pkg.a", "pkg"} and graph["pkg.a"] == {"pkg.b"}
    assert cycles(graph) == [frozenset({"pkg.a", "pkg.b"}), frozenset({"pkg.c", "pkg.d"})]
