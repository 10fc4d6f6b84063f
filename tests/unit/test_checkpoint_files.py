"""A save replaces whatever ``PATH`` holds: a checkpoint of the other format, a link, a save killed before."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_multids.checkpoint import _move_into_place, old_path


def a_directory_save(path: Path) -> None:
    """What ``checkpoint.save`` does after the ranks wrote ``PATH.partial``."""
    partial = path.with_name(path.name + ".partial")
    partial.mkdir()
    (partial / "lightning.pt").write_bytes(b"new")
    _move_into_place(partial, path)


@pytest.mark.parametrize("before", ["file", "link", "directory"])
def test_a_directory_save_replaces_what_was_there_each_time(tmp_path: Path, before: str) -> None:
    path = tmp_path / "last.ckpt"
    if before == "file":  # a single-file checkpoint of that name (checkpoint_format="file")
        path.write_bytes(b"single file")
    elif before == "link":  # save_last="link"
        (tmp_path / "epoch=0.ckpt").mkdir()
        path.symlink_to(tmp_path / "epoch=0.ckpt")
    else:
        path.mkdir()
    for _ in range(2):  # the second save of the name failed where the first left `last.old.ckpt` behind
        a_directory_save(path)
        assert (path / "lightning.pt").read_bytes() == b"new"
        assert not old_path(path).exists() and not old_path(path).is_symlink()
