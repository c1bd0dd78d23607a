import multiprocessing as mp
import os

import pytest

from common.config import UsageError
from common.results import COLUMNS, append_row, read_rows

CONTRACT = ("timestamp, script, strategy, precision, world_size, device, model, dataset, image_size, "
            "global_batch_size, epochs, steps, train_time_s, throughput_img_s, peak_allocated_gib, "
            "peak_reserved_gib, peak_nvml_gib, gpu_util_mean, gpu_util_peak, train_loss, test_accuracy, "
            "test_samples, status, torch_version, git_commit").split(", ")


def test_contract_columns_in_order():
    assert COLUMNS[:len(CONTRACT)] == CONTRACT


def test_header_once_then_rows(tmp_path):
    path = str(tmp_path / "sub" / "s.csv")
    append_row(path, {"script": "a", "status": "ok", "train_loss": 1.5})
    append_row(path, {"script": "b", "status": "ok", "peak_allocated_gib": None})
    text = open(path).read().splitlines()
    assert text[0] == ",".join(COLUMNS) and len(text) == 3
    got = read_rows(path)
    assert [r["script"] for r in got] == ["a", "b"] and got[1]["peak_allocated_gib"] == ""


def _writer(args):
    path, i = args
    for j in range(20):
        append_row(path, {"script": f"w{i}", "steps": j, "status": "ok", "error": "comma, \"quote\"\nnewline"})


def test_concurrent_appends_keep_every_row(tmp_path):
    path = str(tmp_path / "s.csv")
    with mp.get_context("spawn").Pool(4) as pool:
        pool.map(_writer, [(path, i) for i in range(4)])
    got = read_rows(path)
    assert len(got) == 80
    expected = sorted((f"w{i}", j) for i in range(4) for j in range(20))
    assert sorted((r["script"], int(r["steps"])) for r in got) == expected
    assert all(r["error"] == "comma, \"quote\"\nnewline" for r in got)


@pytest.mark.parametrize("content, words", [
    ("a,b,c\n1,2,3\n", "another header"),
    ("\x00\x01garbage", "another header"),
    (",".join(COLUMNS) + "\n2026,partial", "cut-off line"),
])
def test_foreign_or_broken_file_is_kept(tmp_path, content, words):
    path = tmp_path / "s.csv"
    path.write_text(content)
    with pytest.raises(UsageError, match=words):
        append_row(str(path), {"script": "x", "status": "ok"})
    assert path.read_text() == content


def test_unknown_column_is_a_bug():
    from common.results import format_row
    with pytest.raises(ValueError):
        format_row({"nope": 1})


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_not_writable(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    with pytest.raises(UsageError, match="not writable"):
        append_row(str(d / "s.csv"), {"script": "x"})


def test_results_folder_cannot_be_made(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UsageError, match="cannot be created"):
        append_row(str(blocker / "s.csv"), {"script": "x"})


def test_a_results_file_of_the_previous_release_is_upgraded_not_refused(tmp_path):
    from common.results import HISTORY

    old = HISTORY[-1]
    path = tmp_path / "summary.csv"
    original = ",".join(old) + "\n" + ",".join("x" if c == "script" else ("ok" if c == "status" else "")
                                              for c in old) + "\n"
    path.write_text(original)
    assert read_rows(str(path))[0]["script"] == "x"  # readable before the upgrade, new columns empty
    append_row(str(path), {"script": "y", "status": "ok", "cuda_version": "13.0"})
    lines = path.read_text().splitlines()
    assert lines[0] == ",".join(COLUMNS) and len(lines) == 3
    got = read_rows(str(path))
    assert [r["script"] for r in got] == ["x", "y"] and got[0]["status"] == "ok" and got[1]["cuda_version"] == "13.0"
    assert (tmp_path / "summary.csv.bak").read_text() == original  # the original kept beside it
    append_row(str(path), {"script": "z", "status": "ok"})  # already current: no second backup
    assert not (tmp_path / "summary.csv.bak1").exists() and len(read_rows(str(path))) == 3


def test_every_older_header_is_a_prefix_free_subset_of_the_current():
    """An upgrade only adds columns: each earlier header's columns are all still written."""
    from common.results import HISTORY

    for old in HISTORY:
        assert set(old) <= set(COLUMNS) and old != COLUMNS


def test_every_released_header_is_still_upgraded():
    """The headers the project's releases wrote, kept literally by version (tests/released_headers.txt): each is
    the release's in common/released_headers.txt, every one but this release's is upgraded, and this release's is
    COLUMNS, so a column added without a new release (or a released header edited) goes red."""
    from common.results import HISTORY, RELEASED, SCHEMA_VERSION

    path = os.path.join(os.path.dirname(__file__), "released_headers.txt")
    lines = [ln.rstrip("\n").split(" ", 1) for ln in open(path) if ln.strip() and not ln.startswith("#")]
    released = {version: header.split(",") for version, header in lines}
    assert list(released) == ["0.2.0", "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.6.1", "0.6.2", "0.7.0", "0.8.0"]
    for version, header in released.items():
        assert RELEASED.get(version) == header, version
        assert header in HISTORY or (version == SCHEMA_VERSION and header == COLUMNS), version
    assert RELEASED[SCHEMA_VERSION] == COLUMNS


def test_the_project_version_is_the_results_schemas_release():
    """pyproject.toml's version names the release whose header COLUMNS is (a new column is a new release)."""
    import re

    from common.results import SCHEMA_VERSION

    with open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "pyproject.toml")) as fh:
        assert re.search(r'^version = "([^"]+)"', fh.read(), re.M).group(1) == SCHEMA_VERSION


def test_a_tree_without_git_takes_the_commit_its_caller_names(monkeypatch):
    """A GPU lease runs a copy of the tree without .git (.gpu/run.sh passes GIT_COMMIT): the rows still name the
    commit; where git answers, git's HEAD wins."""
    from common import runner

    monkeypatch.setenv("GIT_COMMIT", "abc1234")
    monkeypatch.setattr(runner, "_git_head", lambda: "")
    assert runner.git_commit() == "abc1234"
    monkeypatch.setattr(runner, "_git_head", lambda: "0fd9bbe+dirty")
    assert runner.git_commit() == "0fd9bbe+dirty"
