"""The sizes a sysadmin types for a storage quota, and how they are shown back."""

from __future__ import annotations

import os

import pytest

from gateway.storage import quota


@pytest.mark.parametrize(("text", "expected"), [
    ("20G", 20 << 30), ("20g", 20 << 30), ("20GiB", 20 << 30), ("500M", 500 << 20), ("1.5T", 3 << 39),
    ("123456", 123456), ("64k", 64 << 10), ("none", None), ("0", None), ("off", None),
])
def test_sizes_parse_to_bytes_and_none_lifts_the_limit(text: str, expected: int | None) -> None:
    assert quota.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-5G", "1X", "G", "nan", "inf"])
def test_anything_else_is_refused_with_an_example(text: str) -> None:
    with pytest.raises(ValueError, match="e.g. 20G"):
        quota.parse_size(text)


def test_sizes_read_back_for_people() -> None:
    assert [quota.human(n) for n in (None, 0, 1023, 1536, 5 << 20, 1536 << 20, 3 << 40)] == \
        ["-", "0 B", "1023 B", "1.5 KiB", "5.0 MiB", "1.5 GiB", "3.0 TiB"]


def test_a_directory_off_btrfs_reports_no_quota_and_refuses_one(tmp_path: object) -> None:
    fd = os.open(str(tmp_path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        if quota.fsid(fd) is not None:
            pytest.skip("this temp dir is on btrfs")
        assert quota.usage(fd) == quota.NONE and not quota.enabled(fd) and not quota.is_subvolume(fd)
        with pytest.raises(quota.QuotaError, match="not a btrfs subvolume"):
            quota.set_limit(fd, 1 << 30)
    finally:
        os.close(fd)
