"""tools/test's two workers (tests/helpers/xdist_units.py): every test that starts DeepSpeed ranks or Slurm jobs
(marked ``slow`` by conftest.py) is in a heavy unit, and every Slurm test in the cluster's, so that no two of them
ever use the cluster at once."""

from __future__ import annotations

from pathlib import Path

import pytest
import xdist_units


def test_every_slow_test_collected_is_in_the_heavy_unit(request: pytest.FixtureRequest) -> None:
    slow = [item for item in request.session.items if item.get_closest_marker("slow")]
    outside = sorted({str(item.path) for item in slow if not xdist_units.is_heavy_file(Path(item.path))})
    assert not outside, f"slow tests in files the scheduler runs beside the heavy ones: {outside}. HINT: add the " \
                        "word that starts their ranks or jobs to xdist_units.HEAVY_WORDS"
    cluster = [item for item in slow if item.get_closest_marker("slurm")]
    elsewhere = sorted({str(i.path) for i in cluster if xdist_units.unit_of(Path(i.path)) != xdist_units.CLUSTER_UNIT})
    assert not elsewhere, f"Slurm tests outside the cluster's unit: {elsewhere}"


def test_a_file_is_heavy_by_its_words(tmp_path: Path) -> None:
    light = tmp_path / "test_light.py"
    light.write_text("def test_pure():\n    assert 1 + 1 == 2\n")
    heavy = tmp_path / "test_heavy.py"
    heavy.write_text("def test_ranks(jit_zero2_run):\n    assert jit_zero2_run\n")
    cluster = tmp_path / "test_cluster.py"
    cluster.write_text("import pytest\n\n@pytest.mark.slurm\ndef test_job(): ...\n")
    assert [xdist_units.unit_of(p) for p in (light, heavy, cluster)] == [
        None, xdist_units.RANKS_UNIT, xdist_units.CLUSTER_UNIT]
