"""The batch notifications NIXL and Mooncake carry for us are signed with the deployment's secret:
their transports deliver a notification from anyone who reaches the port, so one without the
secret's MAC must never be credited (it could complete a request whose KV has not landed)."""

from __future__ import annotations

import pytest

from sglang_disagg.backends.messages import ForgedNotification, notif_text, parse_notif

KEY = b"k" * 32


def test_a_signed_notification_round_trips():
    assert parse_notif(notif_text(7, 3, KEY), KEY) == (7, 3)
    assert parse_notif(notif_text(7, 3, KEY).encode(), KEY) == (7, 3)


@pytest.mark.parametrize("forged", [
    "sgd2 7 3 " + "0" * 32,                        # a guessed MAC
    notif_text(7, 3, b"x" * 32),                   # another deployment's secret
    notif_text(7, 3, None),                        # no secret at all
    notif_text(7, 3, KEY).replace(" 3 ", " 4 "),   # the count changed on the way
])
def test_a_notification_without_the_secrets_mac_is_refused(forged):
    with pytest.raises(ForgedNotification):
        parse_notif(forged, KEY)


def test_without_a_secret_both_ends_accept_unsigned_ones():
    assert parse_notif(notif_text(1, 2, None), None) == (1, 2)


@pytest.mark.parametrize("text", ["sgd2 1 2", "sgd2 x 2 -", "sgd2 -1 2 -"])
def test_a_malformed_one_is_an_error(text):
    with pytest.raises(ValueError):
        parse_notif(text, None)


def test_messages_not_ours_are_ignored():
    assert parse_notif("something else", KEY) is None
