"""API keys (frontend/auth.py): every header form clients send, and where keys come from."""

from __future__ import annotations

import pytest

from ardiff_server.frontend.auth import ENV_VAR, ApiKeys, Unauthorized, gather_api_keys


@pytest.mark.parametrize("header", ["Api-Key k1", "api-key k1", "Bearer k1", "BEARER k1", "  Bearer   k1  "])
def test_both_schemes_in_any_case_name_the_key(header):
    assert ApiKeys(["k0", "k1"]).check([header]) == "key1"


def test_no_keys_configured_means_no_authentication():
    keys = ApiKeys([])
    assert not keys.enabled
    assert keys.check([]) is None and keys.check(["Bearer anything"]) is None


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ([], "no Authorization header"),
        (["Bearer k0", "Bearer k0"], "2 Authorization headers"),
        (["Basic k0"], "unsupported scheme"),
        (["Bearer"], "unsupported scheme|empty token"),
        (["Bearer    "], "empty token"),
        (["Bearer k2"], "wrong key"),
        (["Bearer k0\udcff"], "wrong key"),  # undecodable header bytes: a mismatch, never an exception
        (["Bearer ключ"], "wrong key"),
    ],
)
def test_malformed_or_wrong_credentials_are_unauthorized_with_a_loggable_reason(headers, reason):
    with pytest.raises(Unauthorized, match=reason):
        ApiKeys(["k0"]).check(headers)


def test_a_key_sent_without_a_scheme_never_reaches_the_log():
    with pytest.raises(Unauthorized) as caught:
        ApiKeys(["sk-live-0123456789abcdef"]).check(["sk-live-0123456789abcdef"])
    assert "unsupported scheme of 24 characters (not shown)" in str(caught.value) and "0123" not in str(caught.value)
    with pytest.raises(Unauthorized, match="unsupported scheme 'Basic'"):  # a registered scheme is worth naming
        ApiKeys(["k0"]).check(["Basic k0"])


@pytest.mark.parametrize("key", ["Tulipsecret", "abc", "Token2", "hunter-two", "Z"])
def test_a_short_alphabetic_key_without_a_scheme_is_not_logged_either(key):
    """A key that looks like a scheme word (the attack run's 'Tulipsecret') is still a key."""
    with pytest.raises(Unauthorized) as caught:
        ApiKeys(["k0"]).check([key])
    assert key not in str(caught.value) and f"unsupported scheme of {len(key)} characters (not shown)" in str(caught.value)


def test_keys_come_from_the_command_line_a_file_and_the_environment(tmp_path):
    key_file = tmp_path / "keys.txt"
    key_file.write_text("# lab keys\nfile-key-1\n\n  file-key-2  \n")
    keys = gather_api_keys(["cli-key"], str(key_file), environ={ENV_VAR: "env-1, env-2"})
    assert keys == ["cli-key", "file-key-1", "file-key-2", "env-1", "env-2"]
    assert gather_api_keys([], None, environ={}) == []


def test_an_empty_key_file_is_refused_not_read_as_no_authentication(tmp_path):
    key_file = tmp_path / "keys.txt"
    key_file.write_text("# nothing yet\n\n")
    with pytest.raises(ValueError, match="no keys in it"):
        gather_api_keys([], str(key_file), environ={})


def test_an_empty_environment_entry_is_kept_so_validation_can_refuse_it():
    assert gather_api_keys([], None, environ={ENV_VAR: "a,,b"}) == ["a", "", "b"]
