"""The environment's settings registry: sizes and their units, typed values, and one
clear line naming the variable for a bad value."""

import os
import re

import pytest

from sparsekv.daemon.config import Config, env_name
from sparsekv.proto.settings import (
    CLIENT_DEVICE_WAIT,
    KERNEL_CACHE_DIR,
    RUN_DIR,
    STOP_TIMEOUT_S,
    Setting,
    SettingError,
    format_size,
    parse_bool,
    parse_size,
    size_text,
)


@pytest.mark.parametrize(
    "text, nbytes",
    [("256MiB", 256 << 20), ("64GiB", 64 << 30), ("1.5GiB", 3 << 29), ("4096B", 4096), (" 8 KiB ", 8192),
     ("1TiB", 1 << 40), ("10b", 10), ("2gib", 2 << 30),
     ("1GB", 10**9), ("2gb", 2 * 10**9), ("1.1GB", 1_100_000_000), ("3KB", 3000), ("1TB", 10**12)],
)
def test_binary_units_are_powers_of_1024_and_decimal_ones_of_1000(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text, binary, decimal", [("1G", "1GiB", "1GB"), ("64g", "64GiB", "64GB"),
                                                   ("512M", "512MiB", "512MB"), ("2k", "2KiB", "2KB")])
def test_a_bare_unit_letter_is_refused_as_ambiguous_with_both_spellings(text, binary, decimal):
    with pytest.raises(ValueError, match=f"ambiguous: write {binary} .* or {decimal} "):
        parse_size(text)


@pytest.mark.parametrize("text, bytes_text", [("1Mb", "1MB"), ("64Gib", "64GiB"), ("2.5Tb", "2.5TB"), ("8Kib", "8KiB")])
def test_an_upper_case_prefix_before_a_lower_case_b_is_refused_as_bits(text, bytes_text):
    with pytest.raises(ValueError, match=f"reads as bits .*write {re.escape(bytes_text)} for bytes"):
        parse_size(text)


@pytest.mark.parametrize("text", [" -5MiB", "-0B", "-1"])
def test_a_negative_size_says_so(text):
    with pytest.raises(ValueError, match="is negative"):
        parse_size(text)


@pytest.mark.parametrize("text", ["", "12XB", "-5MiB", "MiB", "1.2.3GiB", "5 Mi B", True, 1.5])
def test_parse_size_rejects_bad_text_with_an_example(text):
    with pytest.raises(ValueError, match="256MiB"):
        parse_size(text)


@pytest.mark.parametrize("text", ["1073741824", 1073741824, " 64 ", 0])
def test_a_size_without_a_unit_is_an_error(text):
    with pytest.raises(ValueError, match="has no unit"):
        parse_size(text)


@pytest.mark.parametrize("nbytes, text", [(1 << 30, "1GiB"), (3 << 20, "3MiB"), (64 << 30, "64GiB"), (1 << 40, "1TiB"),
                                          (64 * 10**9, "64GB"), (10**9, "1GB"), (1536, "1.5KiB"), (100, "100B"),
                                          (0, "0B"), (3 * 10**9 + 1, "2.8GiB"), (1536 << 20, "1.5GiB")])
def test_sizes_print_in_the_largest_unit_that_holds_them(nbytes, text):
    assert format_size(nbytes) == text


def test_every_whole_size_printed_reads_back_as_itself():
    for n in (1 << 30, 5 << 20, 64 * 10**9, 1536, 100, 7 << 40, 3 * 10**6):
        assert parse_size(format_size(n)) == n


@pytest.mark.parametrize("text, value", [("1", True), ("true", True), (" Yes ", True), ("on", True),
                                         ("0", False), ("False", False), ("no", False), ("off", False)])
def test_bool_text(text, value):
    assert parse_bool(text) is value


def test_a_setting_reads_its_one_variable_and_an_empty_one_is_unset():
    s = Setting("some_limit", int, 7, "a limit")
    assert s.env == "SPARSEKV_SOME_LIMIT"
    assert s.get({}) == 7 and s.lookup({}) is None
    assert s.get({"SPARSEKV_SOME_LIMIT": ""}) == 7
    assert s.get({"SPARSEKV_SOME_LIMIT": "9"}) == 9


@pytest.mark.parametrize("setting, text, words", [
    (CLIENT_DEVICE_WAIT, "maybe", "1 or 0 (true or false) is needed, got 'maybe'"),
    (STOP_TIMEOUT_S, "abc", "a number is needed, got 'abc'"),
    (STOP_TIMEOUT_S, "inf", "inf is not a finite number"),
])
def test_a_bad_value_is_one_line_naming_the_variable(setting, text, words):
    with pytest.raises(SettingError) as ei:
        setting.get({setting.env: text})
    msg = str(ei.value)
    assert msg.startswith(f"environment {setting.env}: bad value for {setting.name}: ") and words in msg
    assert "\n" not in msg


def test_the_run_dir_is_the_variable_else_systemds_runtime_directory_else_run_sparsekv():
    assert RUN_DIR.get({"SPARSEKV_RUN_DIR": "/x", "RUNTIME_DIRECTORY": "/run/a"}) == "/x"
    assert RUN_DIR.get({"RUNTIME_DIRECTORY": "/run/a:/run/b"}) == "/run/a"  # colon-separated when several
    assert RUN_DIR.get({}) == "/run/sparsekv"


def test_the_kernel_cache_dir_is_shared_with_the_daemon_setting():
    assert KERNEL_CACHE_DIR.env == env_name("kernel_cache_dir")
    assert os.path.expanduser(KERNEL_CACHE_DIR.default) == Config().kernel_cache_dir  # used absolute


@pytest.mark.parametrize("text, words", [("1.5B", "not a whole number of bytes"), ("0.1KiB", "not a whole number"),
                                         ("9223372036854775808B", "too large"), ("1" * 400 + "B", "too long"),
                                         ("8388608TiB", "too large")])
def test_a_fraction_of_a_byte_or_a_size_past_int64_is_refused_not_rounded(text, words):
    with pytest.raises(ValueError, match=words):
        parse_size(text)
    assert parse_size("9223372036854775807B") == (1 << 63) - 1


def test_a_size_past_int64_in_the_environment_is_one_setting_error():
    s = Setting("pool_size", parse_size, 0, "a size")
    with pytest.raises(SettingError, match="environment SPARSEKV_POOL_SIZE: bad value for pool_size: .*too long"):
        s.lookup({"SPARSEKV_POOL_SIZE": "1" * 400 + "B"})


@pytest.mark.parametrize("n", [3 * 10**9 + 1, 67108863, 1536, 1 << 40, 0])
def test_size_text_reads_back_exactly(n):
    assert parse_size(size_text(n)) == n


@pytest.mark.parametrize("nbytes, text", [(1 << 30, "1GiB"), (64 * 10**9, "64GB"), (1536, "1536B"), (100, "100B"),
                                          (0, "0B"), (3 * 10**9 + 1, "3000000001B"), (2 << 40, "2TiB"),
                                          # found by an operator's review: --print-config wrote 1.5GiB
                                          (1536 << 20, "1536MiB"), (2304 << 20, "2304MiB"), (1000, "1KB")])
def test_setting_text_is_in_the_largest_unit_that_holds_it_whole(nbytes, text):
    assert size_text(nbytes) == text
