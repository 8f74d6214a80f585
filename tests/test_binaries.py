"""Which builds a change altered (harness.compile_check.binaries): each tree compiled by its own code,
a planted kernel edit found in exactly the builds it reaches, a comment edit in none."""

import shutil
from pathlib import Path

import pytest

from harness import settings
from harness.compile_check import binaries
from harness.compile_check.binaries import Build, compare, digests

ROOT = Path(__file__).resolve().parents[1]
# The Hopper kernel's 128-token bf16 builds: 8 builds, a few seconds of NVRTC a tree.
BUILDS = "mm4-*-bf16-*-m128-*@sm_90"


def _tree_copy(dest: Path) -> Path:
    for part in ("harness", "kernels"):
        shutil.copytree(ROOT / part, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"the planted edit's anchor is gone from {path.name}: {old!r}"
    path.write_text(text.replace(old, new))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A compile cache of the test's own, inherited by the trees' processes."""
    monkeypatch.setenv(settings.CACHE_DIR.name, str(tmp_path / "cache"))


def test_the_statuses_of_two_sides():
    base = {"a@sm_90": "1", "b@sm_90": "2", "gone@sm_90": "3"}
    candidate = {"a@sm_90": "1", "b@sm_90": "9", "new@sm_90": "4"}
    assert compare(base, candidate) == [
        Build("b@sm_90", "changed"),
        Build("gone@sm_90", "only in base"),
        Build("new@sm_90", "only in candidate"),
        Build("a@sm_90", "same"),
    ]
    text = binaries.report(compare(base, candidate))
    assert "b@sm_90" in text and "a@sm_90" not in text
    assert text.endswith("4 builds: 1 changed, 1 only in base, 1 only in candidate, 1 same")


def test_a_planted_edit_changes_exactly_the_builds_it_reaches_and_a_comment_none(tmp_path, cache):
    """The wgmma kernel's deep build (three stages, 4 slices a commit) given to the plain 8-warp
    128-token builds too: those two builds' cubins change, the nested and 12-warp ones' stay; a comment
    added to the header every kernel includes changes no cubin."""
    base = digests(ROOT, ("sm_90",), BUILDS)
    assert len(base) == 8, sorted(base)

    planted = _tree_copy(tmp_path / "planted")
    _edit(planted / "harness" / "runtime" / "matmul_kernel.py", "            and self.nested\n", "")
    changed = {b.name for b in compare(base, digests(planted, ("sm_90",), BUILDS)) if b.status != "same"}
    assert changed == {"mm4-nf4-bf16-plain-m128-w8@sm_90", "mm4-fp4-bf16-plain-m128-w8@sm_90"}

    comment = _tree_copy(tmp_path / "comment")
    header = comment / "kernels" / "matmul_4bit_common.cuh"
    header.write_text(header.read_text() + "\n// a comment changes the source, not the binary\n")
    assert {b.status for b in compare(base, digests(comment, ("sm_90",), BUILDS))} == {"same"}


def test_each_tree_is_compiled_by_its_own_code(tmp_path, cache):
    """A tree whose harness cannot compile (here: its op registry broken) fails as that tree's
    error, never falling back on another harness on the path."""
    broken = _tree_copy(tmp_path / "broken")
    _edit(broken / "harness" / "runtime" / "ops.py", "def compile_specs(", "def _no_compile_specs(")
    with pytest.raises(binaries.TreeError, match="compiling its builds failed"):
        digests(broken, ("sm_90",), BUILDS)
    with pytest.raises(binaries.TreeError, match="not a checkout"):
        digests(tmp_path, ("sm_90",), BUILDS)


def test_the_command_lists_the_changed_builds(tmp_path, cache, capsys):
    assert (
        binaries.main(
            [
                "--base-dir",
                str(ROOT),
                "--candidate-dir",
                str(ROOT),
                "--arch",
                "sm_90",
                "-k",
                "mm4-nf4-bf16-nested-m128-*@sm_90",
                "--json",
                str(tmp_path / "b.json"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "no cubin differs" in out and out.rstrip().endswith("2 same")
    assert binaries.main(["--base-dir", str(tmp_path), "--arch", "sm_90", "-k", "none"]) == 2
