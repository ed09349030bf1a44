"""Outbound URLs are validated and pinned: every form of a private address is refused (issue 16)."""

import pytest

from tasks.outbound import OutboundRefused, is_public, normalise_host, outbound_pin

REFUSED = [
    "http://127.0.0.1/", "http://127.1/", "http://2130706433/", "http://0x7f000001/", "http://0177.0.0.1/",
    "http://0/", "http://0.0.0.0/", "http://localhost/", "http://localhost./", "http://ｌｏｃａｌｈｏｓｔ/",
    "http://LOCALHOST:8000/x", "http://10.0.0.5/", "http://172.16.3.4/", "http://192.168.1.1/", "http://100.64.0.1/",
    "http://169.254.169.254/latest/meta-data/", "http://224.0.0.1/", "http://240.0.0.1/", "http://255.255.255.255/",
    "http://[::1]/", "http://[::ffff:127.0.0.1]/", "http://[::ffff:7f00:1]/", "http://[::127.0.0.1]/", "http://[fe80::1]/",
    "http://[fc00::1]/", "http://[2002:7f00:1::]/", "http://203.0.113.7/", "http://nonexistent-host.invalid/",
    "ftp://93.184.216.34/", "http://user:pw@93.184.216.34/", "http:///nohost", "http://93.184.216.34:99999/",
    "http://" + "a" * 2100 + ".com/",
]


@pytest.mark.parametrize("url", REFUSED)
def test_every_private_or_malformed_form_is_refused(url):
    with pytest.raises(OutboundRefused):
        outbound_pin(url, allow_private=False)


def test_a_public_address_is_pinned_to_what_was_checked():
    pinned = outbound_pin("https://93.184.216.34:8443/hook?x=1", allow_private=False)
    assert pinned.address == "93.184.216.34" and pinned.port == 8443 and pinned.host == "93.184.216.34"
    assert pinned.address_url == "https://93.184.216.34:8443/hook?x=1"


def test_a_name_resolving_to_loopback_is_refused_and_allowed_only_when_asked():
    with pytest.raises(OutboundRefused, match="private, loopback or reserved"):
        outbound_pin("http://localhost:9/hook", allow_private=False)
    pinned = outbound_pin("http://localhost:9/hook", allow_private=True)
    assert pinned.address in ("127.0.0.1", "::1") and pinned.address_url.endswith(":9/hook")


@pytest.mark.parametrize("raw,expected", [("127.1", "127.0.0.1"), ("2130706433", "127.0.0.1"), ("0x7f000001", "127.0.0.1"),
                                          ("0177.0.0.1", "127.0.0.1"), ("0", "0.0.0.0"), ("Example.COM.", "example.com"),
                                          ("ｌｏｃａｌｈｏｓｔ", "localhost"), ("bücher.de", "xn--bcher-kva.de")])
def test_hosts_are_normalised_before_they_are_judged(raw, expected):
    assert normalise_host(raw) == expected


@pytest.mark.parametrize("address,public", [("93.184.216.34", True), ("8.8.8.8", True), ("2606:4700::1111", True),
                                            ("::ffff:8.8.8.8", True), ("::ffff:10.0.0.1", False), ("100.127.255.255", False),
                                            ("198.18.0.1", False), ("127.0.0.1", False)])
def test_addresses_are_judged_with_their_embedded_forms(address, public):
    assert is_public(address) is public
