"""vllm_server_base_url: one http(s) URL or a list of distinct ones; anything else is refused at construction
with the fix."""

import pytest
from transformers import HfArgumentParser

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.config_rules import server_urls


def make(**kwargs):
    kwargs.setdefault("use_cpu", True)
    return AsyncGRPOConfig(**kwargs)


def parse(*argv):
    (config,) = HfArgumentParser(AsyncGRPOConfig).parse_args_into_dataclasses(["--use_cpu", *argv])
    return config


def test_a_comma_joined_string_is_refused_naming_the_list_to_pass_instead():
    with pytest.raises(ValueError) as info:
        make(vllm_server_base_url="http://a:1,http://b:2")
    message = str(info.value)
    assert "vllm_server_base_url='http://a:1,http://b:2'" in message
    assert "vllm_server_base_url=['http://a:1', 'http://b:2']" in message  # the list form
    assert "--vllm_server_base_url http://a:1 http://b:2" in message  # and the command line's


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
    config = make(vllm_server_base_url=url)
    assert config.vllm_server_base_url == url
    assert server_urls(config.vllm_server_base_url) == [url]


def test_a_list_of_servers_is_kept_as_given_and_read_as_a_list():
    urls = ["http://gpu-a:8000", "https://gpu-b.example:8443/v1"]
    config = make(vllm_server_base_url=urls)
    assert config.vllm_server_base_url == urls and server_urls(config.vllm_server_base_url) == urls
    assert make(vllm_server_base_url=tuple(urls)).vllm_server_base_url == urls  # a tuple becomes a list
    assert make(vllm_server_base_url=urls[:1]).vllm_server_base_url == urls[:1]  # one server in a list


def test_the_command_line_takes_one_url_or_several_space_separated():
    assert parse().vllm_server_base_url == "http://localhost:8000"  # the default, unchanged
    assert parse("--vllm_server_base_url", "http://a:1").vllm_server_base_url == ["http://a:1"]
    assert parse("--vllm-server-base-url", "http://a:1", "http://b:2").vllm_server_base_url == [
        "http://a:1", "http://b:2"]
    with pytest.raises(ValueError, match=r"vllm_server_base_url\[0\]='http://a:1,http://b:2'.*"
                                         r"--vllm_server_base_url http://a:1 http://b:2"):
        parse("--vllm_server_base_url", "http://a:1,http://b:2")


@pytest.mark.parametrize(
    "urls, first, second",
    [
        (["http://a:8000", "http://b:8000", "http://a:8000"], 0, 2),
        (["http://a:8000", "http://A:8000/"], 0, 1),  # host case and a trailing slash name the same server
        (["http://a", "http://a:80"], 0, 1),  # the scheme's default port
    ],
)
def test_a_server_listed_twice_is_refused_naming_both_entries(urls, first, second):
    with pytest.raises(ValueError) as info:
        make(vllm_server_base_url=urls)
    message = str(info.value)
    assert "lists one server twice" in message
    assert f"[{first}]={urls[first]!r}" in message and f"[{second}]={urls[second]!r}" in message


def test_different_ports_or_paths_of_one_host_are_different_servers():
    urls = ["http://a:8000", "http://a:8001", "http://a:8000/other"]
    assert make(vllm_server_base_url=urls).vllm_server_base_url == urls


@pytest.mark.parametrize(
    "value, words",
    [
        ([], ["vllm_server_base_url=[]", "at least one URL"]),
        (["http://a:1", "b:2"], ["vllm_server_base_url[1]='b:2'", "'http://b:2'"]),
        (["http://a:1", "http://b:port"], ["vllm_server_base_url[1]='http://b:port'", "port"]),
        (["http://a:1", None], ["vllm_server_base_url[1]=None", "URL string"]),
        (8000, ["vllm_server_base_url=8000", "list of them"]),
    ],
)
def test_an_empty_list_or_a_bad_entry_is_refused_naming_the_entry(value, words):
    with pytest.raises(ValueError) as info:
        make(vllm_server_base_url=value)
    for word in words:
        assert word in str(info.value)
