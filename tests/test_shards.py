"""``DIFFKV_TEST_SHARD=K/N`` (tests/conftest.py): shards 1/N .. N/N split the collected tests into disjoint sets whose
union is the whole collection, through the real collection hook; a malformed spec is a usage error."""
import os
import re
import subprocess
import sys

import pytest

from conftest import shard_items

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_shards_partition_the_items():
    items = list(range(11))
    for n in (1, 2, 3, 11, 12):
        parts = [shard_items(items, f"{k}/{n}")[0] for k in range(1, n + 1)]
        assert sorted(sum(parts, [])) == items
        assert all(sorted(shard_items(items, f"{k}/{n}")[1] + parts[k - 1]) == items for k in range(1, n + 1))
    assert shard_items(items, "2/3")[0] == [1, 4, 7, 10]
    assert shard_items(items, None) == (items, []) and shard_items(items, "") == (items, [])
    for bad in ("0/3", "4/3", "3", "a/b", "1/0", "-1/2"):
        with pytest.raises(pytest.UsageError, match="DIFFKV_TEST_SHARD"):
            shard_items(items, bad)


def _collected(shard):
    env = dict(os.environ, DIFFKV_TEST_SHARD=shard) if shard else {k: v for k, v in os.environ.items()
                                                                  if k != "DIFFKV_TEST_SHARD"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                          "tests/core/test_config.py"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return run.returncode, [line for line in run.stdout.splitlines() if "::" in line], run.stdout + run.stderr


def test_the_collection_hook_applies_the_shard():
    rc, whole, out = _collected(None)
    assert rc == 0 and len(whole) >= 4, out
    shards = []
    for k in (1, 2, 3):
        rc, ids, out = _collected(f"{k}/3")
        assert rc == 0 and re.search(r"\d+ deselected", out), out
        shards.append(ids)
    assert sorted(sum(shards, [])) == sorted(whole) and shards[1] == whole[1::3]
    rc, _, out = _collected("5/3")
    assert rc != 0 and "DIFFKV_TEST_SHARD" in out
