"""The API's access rule (engine/serve/auth.py): no key on loopback, a key required beyond it --
the one given, else one generated once into the keys folder (owner-only) and kept -- unless
--no-auth, which warns naming the address."""

from __future__ import annotations

import os
import stat

import pytest

from engine.serve.auth import KEY_FILE, decide, is_loopback


@pytest.mark.parametrize("host,loop", [("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("[::1]", True),
                                       ("localhost", True), ("0.0.0.0", False), ("::", False),
                                       ("192.168.1.20", False), ("10.213.7.2", False), ("mypc.local", False),
                                       ("", False)])
def test_only_loopback_addresses_count_as_this_pc(host, loop):
    assert is_loopback(host) is loop


def test_loopback_needs_no_key_but_enforces_one_given(tmp_path):
    a = decide("127.0.0.1", 8000, None, False, tmp_path)
    assert (a.api_key, a.notice) == (None, None) and not (tmp_path / KEY_FILE).exists()
    assert decide("127.0.0.1", 8000, "k1", False, tmp_path).api_key == "k1"


def test_beyond_loopback_a_key_is_generated_once_kept_owner_only_and_shown(tmp_path):
    first = decide("0.0.0.0", 8000, None, False, tmp_path)
    assert first.api_key and first.generated and first.key_file == tmp_path / KEY_FILE
    assert first.api_key in first.notice and "0.0.0.0:8000" in first.notice and str(first.key_file) in first.notice
    mode = stat.S_IMODE(os.stat(first.key_file).st_mode)
    assert mode == 0o600, oct(mode)
    again = decide("192.168.1.20", 8001, None, False, tmp_path)
    assert again.api_key == first.api_key and not again.generated  # apps configured once keep working
    assert decide("192.168.1.20", 8001, None, False, tmp_path / "other").api_key != first.api_key  # random


def test_beyond_loopback_a_given_key_wins_and_no_auth_warns(tmp_path):
    given = decide("0.0.0.0", 8000, "mine", False, tmp_path)
    assert given.api_key == "mine" and given.key_file is None and not (tmp_path / KEY_FILE).exists()
    open_ = decide("0.0.0.0", 8000, None, True, tmp_path)
    assert open_.api_key is None and open_.notice.startswith("WARNING") and "0.0.0.0:8000" in open_.notice
