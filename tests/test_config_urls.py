"""vllm_server_base_url: one http(s) URL, refused at construction when it is several or malformed."""

import pytest

from asyncgrpo.config import AsyncGRPOConfig


def make(**kwargs):
    kwargs.setdefault("use_cpu", True)
    return AsyncGRPOConfig(**kwargs)


def test_a_comma_joined_list_of_urls_is_refused_with_the_fix():
    with pytest.raises(ValueError) as info:
        make(vllm_server_base_url="http://a:1,http://b:2")
    message = str(info.value)
    assert "vllm_server_base_url='http://a:1,http://b:2'" in message
    assert "one server" in message and "'http://a:1'" in message  # what to pass today
    assert "list of URLs" in message  # and that several servers come later


@pytest.mark.parametrize(
    "url, hint",
    [
        ("http://localhost:abc", "port"),
        ("http://localhost:99999", "port"),
        ("http://local host:8000", "space"),
        ("http://[::1:8000", "IPv6"),
        (" http://localhost:8000", "space"),
    ],
)
def test_a_malformed_url_is_refused_naming_what_is_wrong(url, hint):
    with pytest.raises(ValueError) as info:
        make(vllm_server_base_url=url)
    message = str(info.value)
    assert f"vllm_server_base_url={url!r}" in message
    assert hint in message
    assert "http://localhost:8000" in message  # an example of a good one


@pytest.mark.parametrize(
    "url", ["http://localhost:8000", "https://host.example/v1/", "http://[::1]:8000", "http://10.0.0.2"]
)
def test_well_formed_urls_still_pass(url):
    assert make(vllm_server_base_url=url).vllm_server_base_url == url
