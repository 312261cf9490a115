"""The settings' checks (``trtllm_diffkv.validators``): what each allows, what it refuses, and the words it uses."""
from __future__ import annotations

import math

import numpy as np
import pytest

from trtllm_diffkv import validators as v


@pytest.mark.parametrize("value, plain, integral", [
    (3, True, True), (0, True, True), (-2, True, True), (np.int64(3), False, True),
    (True, False, False), (np.bool_(True), False, False), (2.0, False, False), ("3", False, False), (None, False, False),
])
def test_is_int(value, plain, integral):
    assert v.is_int(value) is plain
    assert v.is_int(value, integral=True) is integral


@pytest.mark.parametrize("value, ok", [(1, True), (0.5, True), (-3, True), (math.inf, True), (10 ** 400, True),
                                       (math.nan, False), (True, False), ("1", False), (None, False)])
def test_is_number(value, ok):
    assert v.is_number(value) is ok


@pytest.mark.parametrize("value", [1, 7, 2 ** 40])
def test_positive_int_allows(value):
    assert v.positive_int("n", value) == value


@pytest.mark.parametrize("value", [0, -1, True, False, 2.0, "2", None, np.int64(2)])
def test_positive_int_refuses_naming_the_field(value):
    with pytest.raises(ValueError) as info:
        v.positive_int("max_batch_size", value)
    assert str(info.value) == f"max_batch_size={value!r} must be a positive integer"


def test_integral_positive_int_takes_numpy_integers_and_custom_words():
    assert v.positive_int("n", np.int32(4), integral=True) == 4
    with pytest.raises(ValueError, match=r"^max_new_tokens=0 must be an integer >= 1$"):
        v.positive_int("max_new_tokens", 0, allowed="an integer >= 1")


def test_optional_variants():
    assert v.optional_positive_int("n", None) is None and v.optional_non_negative_int("n", None) is None
    assert v.optional_non_negative_int("n", 0) == 0
    with pytest.raises(ValueError, match=r"^max_seq_len=0 must be a positive integer \(or None\)$"):
        v.optional_positive_int("max_seq_len", 0)
    with pytest.raises(ValueError, match=r"^chunk_staging_bytes=-1 must be an integer >= 0 \(or None\)$"):
        v.optional_non_negative_int("chunk_staging_bytes", -1)


@pytest.mark.parametrize("value", [-1, True, 0.0, "0"])
def test_non_negative_int(value):
    assert v.non_negative_int("n", 0) == 0 and v.non_negative_int("n", 5) == 5
    with pytest.raises(ValueError, match=r"must be an integer >= 0$"):
        v.non_negative_int("n", value)


@pytest.mark.parametrize("value", [1, 0, "yes", None, np.bool_(True)])
def test_boolean_refuses_what_is_not_a_bool(value):
    assert v.boolean("flag", True) is True and v.boolean("flag", False) is False
    with pytest.raises(ValueError) as info:
        v.boolean("enable_chunked_prefill", value)
    assert str(info.value) == f"enable_chunked_prefill={value!r} must be True or False"


def test_optional_boolean():
    assert [v.optional_boolean("f", x) for x in (True, False, None)] == [True, False, None]
    with pytest.raises(ValueError, match=r"^split_mixed_steps='no' must be True, False or None$"):
        v.optional_boolean("split_mixed_steps", "no")


@pytest.mark.parametrize("value, ok", [(1.0, True), (1, True), (0.25, True), (1e-9, True), (0.0, False), (-0.5, False),
                                       (1.0000001, False), (math.nan, False), (math.inf, False), (True, False),
                                       ("0.5", False), (None, False)])
def test_number_in_range_half_open(value, ok):
    if ok:
        assert v.number_in_range("kv_memory_fraction", value, 0.0, 1.0, low_open=True) == value
    else:
        with pytest.raises(ValueError) as info:
            v.number_in_range("kv_memory_fraction", value, 0, 1, low_open=True)
        assert str(info.value) == f"kv_memory_fraction={value!r} must be in (0, 1]"


def test_number_in_range_closed_and_open_ends():
    assert v.number_in_range("x", 0, 0, 2) == 0 and v.number_in_range("x", 2, 0, 2) == 2
    with pytest.raises(ValueError, match=r"^x=2 must be in \[0, 2\)$"):
        v.number_in_range("x", 2, 0, 2, high_open=True)
    with pytest.raises(ValueError, match=r"^x=-inf must be in \[-5, 5\]$"):
        v.number_in_range("x", -math.inf, -5, 5)


def test_choice():
    assert v.choice("page_manager", "cpu", ("auto", "cpu", "triton")) == "cpu"
    for bad in ("gpu", None, ["cpu"]):
        with pytest.raises(ValueError) as info:
            v.choice("page_manager", bad, ("auto", "cpu", "triton"))
        assert str(info.value) == f"page_manager={bad!r}; allowed: 'auto', 'cpu', 'triton'"
