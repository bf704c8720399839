"""web_search and web_extract against the local website and search stand-ins."""

from __future__ import annotations

import time

import pytest

from hermes_batch import ConfigError, ModelSettings, UsageError
from hermes_batch.testing import ToolsetHarness
from hermes_batch_toolbox.net import FetchError, PublicOnlyResolver, address_blocked, check_url
from hermes_batch_toolbox.urls import allowed_addresses, allowed_entry
from hermes_batch_toolbox.testing import BraveStandIn, SearxngStandIn
from hermes_batch_toolbox.web import WebExtractTool, WebSearchTool

SETTINGS = ModelSettings(model="m", base_url="http://127.0.0.1:9/v1")


def web_runtime(options: dict):
    return ToolsetHarness("unused").build("web", options, settings=SETTINGS)


@pytest.fixture
async def web(toolsets, searxng, sandbox):
    runtime = await toolsets.start("web", {"provider": "searxng", "url": searxng.url, "allow_private": True})
    return toolsets.context(sandbox, web=runtime)


async def test_searxng_search_returns_titles_urls_and_positions(web, searxng, site):
    result = await WebSearchTool().call({"query": "lighthouse history"}, web)
    assert result["success"] is True
    assert result["data"]["web"] == [
        {"title": "The Quiet Lighthouse", "url": f"{site.url}/article", "description": "A page about lighthouse history.", "position": 1},
        {"title": "Gallery", "url": f"{site.url}/gallery", "description": "Two squares, red and blue.", "position": 2},
    ]
    assert searxng.queries[-1] == "lighthouse history"


async def test_searxng_without_json_enabled_says_how_to_enable_it(toolsets, sandbox, site):
    with SearxngStandIn(site.url) as stand_in:
        runtime = await toolsets.start("web", {"provider": "searxng", "url": stand_in.url + "/not-searxng"})
        result = await WebSearchTool().call({"query": "x"}, toolsets.context(sandbox, web=runtime))
    assert result["success"] is False and "HTTP 404" in result["error"]


async def test_brave_sends_the_key_from_the_environment_and_cleans_snippets(toolsets, sandbox, monkeypatch):
    monkeypatch.setenv("HB_TEST_BRAVE_KEY", "brave-secret-123")
    with BraveStandIn(key="brave-secret-123") as brave:
        runtime = await toolsets.start("web", {"provider": "brave", "url": brave.url, "api_key_env": "HB_TEST_BRAVE_KEY", "max_results": 2})
        result = await WebSearchTool().call({"query": "tea & cakes"}, toolsets.context(sandbox, web=runtime))
    assert result == {"success": True, "data": {"web": [
        {"title": "About tea & cakes", "url": "https://example.org/1", "description": "Result 1 for tea & cakes & more.", "position": 1},
        {"title": "About tea & cakes", "url": "https://example.org/2", "description": "Result 2 for tea & cakes & more.", "position": 2},
    ]}}
    assert brave.requests == [{"q": "tea & cakes", "count": "2"}]


async def test_a_refused_brave_key_fails_the_call(toolsets, sandbox, monkeypatch):
    monkeypatch.setenv("BRAVE_API_KEY", "wrong")
    with BraveStandIn(key="right") as brave:
        runtime = await toolsets.start("web", {"provider": "brave", "url": brave.url})
        result = await WebSearchTool().call({"query": "x"}, toolsets.context(sandbox, web=runtime))
    assert result == {"success": False, "error": "The Brave Search API refused the key (HTTP 401)."}


def test_a_provider_without_its_key_or_address_is_unavailable(monkeypatch):
    monkeypatch.delenv("BRAVE_API_KEY", raising=False)
    assert "BRAVE_API_KEY is not set" in web_runtime({"provider": "brave"}).unavailable_reason()
    assert "-T web.url=" in web_runtime({"provider": "searxng"}).unavailable_reason()
    assert "no search provider" in web_runtime({}).unavailable_reason()
    monkeypatch.setenv("BRAVE_API_KEY", "k")
    assert web_runtime({"provider": "brave"}).unavailable_reason() is None


def test_a_misspelt_provider_or_option_is_an_error():
    with pytest.raises(ConfigError, match="provider must be one of brave, searxng, got 'serxng'"):
        web_runtime({"provider": "serxng"})
    with pytest.raises(ConfigError, match="web toolset"):
        web_runtime({"max_result": 3})
    with pytest.raises(UsageError, match="not installed"):
        ToolsetHarness("unused").build("wbe", {"provider": "brave"}, settings=SETTINGS)


async def test_extract_reads_the_article_as_text_with_its_title(web, site):
    result = await WebExtractTool().call({"urls": [f"{site.url}/article"]}, web)
    assert result["success"] is True
    [page] = result["results"]
    assert page["url"] == f"{site.url}/article" and page["title"] == "The Quiet Lighthouse" and page["error"] is None
    assert "granite quarried on the island" in page["content"] and "Fresnel lens" in page["content"]


async def test_extract_follows_redirects_and_reports_the_final_url(web, site):
    [page] = (await WebExtractTool().call({"urls": [f"{site.url}/redirect"]}, web))["results"]
    assert page["url"] == f"{site.url}/article" and "lighthouse" in page["content"].lower()


async def test_extract_reports_each_url_on_its_own(web, site):
    urls = [f"{site.url}/notes.txt", f"{site.url}/missing", f"{site.url}/binary", f"{site.url}/redirect-loop", "ftp://x/y"]
    result = await WebExtractTool().call({"urls": urls}, web)
    assert result["success"] is True
    notes, missing, binary, loop, ftp = result["results"]
    assert notes["content"] == "Plain notes: bring a lamp.\n" and notes["error"] is None
    assert missing["error"] == "The page answered HTTP 404."
    assert "application/octet-stream, which is not text" in binary["error"]
    assert "redirects more than 5 times" in loop["error"]
    assert ftp["error"] == "Only http and https URLs can be fetched, not 'ftp'."


async def test_extract_of_a_huge_page_reads_a_bounded_prefix(toolsets, sandbox, site):
    runtime = await toolsets.start("web", {"provider": "searxng", "url": site.url, "allow_private": True,
                                           "max_page_bytes": 300_000, "max_chars": 5000})
    started = time.monotonic()
    [page] = (await WebExtractTool().call({"urls": [f"{site.url}/huge"]}, toolsets.context(sandbox, web=runtime)))["results"]
    assert time.monotonic() - started < 20
    assert page["error"] is None and "All work and no play" in page["content"]
    assert len(page["content"]) < 5200
    assert "only the first 300000 bytes of the page were read; the text was cut to 5000 characters" in page["content"]


async def test_extract_of_a_slow_page_times_out(toolsets, sandbox, site):
    runtime = await toolsets.start("web", {"provider": "searxng", "url": site.url, "allow_private": True, "timeout": 0.5})
    started = time.monotonic()
    result = await WebExtractTool().call({"urls": [f"{site.url}/slow?delay=20"]}, toolsets.context(sandbox, web=runtime))
    assert time.monotonic() - started < 5
    assert result["success"] is False and result["results"][0]["error"].endswith("did not answer within 0.5 s.")


async def test_private_addresses_are_refused_unless_allowed(toolsets, sandbox, site, searxng):
    runtime = await toolsets.start("web", {"provider": "searxng", "url": searxng.url})
    ctx = toolsets.context(sandbox, web=runtime)
    before = site.hits["/article"]
    result = await WebExtractTool().call({"urls": [f"{site.url}/article", "http://localhost:1/"]}, ctx)
    assert [r["error"] for r in result["results"]] == [
        "127.0.0.1 is a private or local address; only public addresses can be fetched.",
        "localhost is a private or local address; only public addresses can be fetched.",
    ]
    assert site.hits["/article"] == before
    # the search provider itself may live on this machine (a self-hosted SearXNG): only pages are checked
    assert (await WebSearchTool().call({"query": "q"}, ctx))["success"] is True


async def test_more_than_five_urls_are_refused(web):
    result = await WebExtractTool().call({"urls": ["http://a.example/"] * 6}, web)
    assert result == {"success": False, "results": [], "error": "At most 5 URLs per call; got 6."}


@pytest.mark.parametrize("address, blocked", [
    ("127.0.0.1", True), ("10.1.2.3", True), ("192.168.0.1", True), ("169.254.169.254", True), ("::1", True),
    ("::ffff:127.0.0.1", True), ("100.64.0.1", True), ("0.0.0.0", True), ("224.0.0.1", True),
    ("93.184.216.34", False), ("2606:4700::1111", False),
    # IPv6 addresses that carry an IPv4 address are judged by it: IPv4-compatible, NAT64, 6to4, SIIT
    ("::127.0.0.1", True), ("64:ff9b::7f00:1", True), ("64:ff9b::a00:1", True), ("2002:7f00:1::", True),
    ("::ffff:0:127.0.0.1", True), ("64:ff9b:1::808:808", True), ("64:ff9b::808:808", False), ("::ffff:8.8.8.8", False),
])
def test_which_addresses_are_blocked(address, blocked):
    assert address_blocked(address) is blocked


def test_check_url_refuses_schemes_and_hosts():
    assert check_url(" https://example.org/a ", False) == "https://example.org/a"
    for url, message in [
        ("file:///etc/passwd", "not 'file'"), ("javascript:alert(1)", "not 'javascript'"), ("http:///x", "has no host"),
        ("http://[::1]:80/", "private or local"), ("http://app.localhost/", "private or local"),
        ("http://localhost.:80/", "private or local"), ("http://app.localhost./", "private or local"),
        ("http://[::127.0.0.1]/", "private or local"), ("http://[64:ff9b::7f00:1]/", "private or local"),
    ]:
        with pytest.raises(FetchError, match=message):
            check_url(url, False)
    assert check_url("http://127.0.0.1:8/", True) == "http://127.0.0.1:8/"


async def test_an_allowed_address_lets_through_that_address_and_port_only(toolsets, sandbox, site, secret, searxng):
    # the site plays a public site: only its address:port is allowed; the check that refuses the secret
    # service on another port of the same loopback is the production one
    runtime = await toolsets.start("web", {"provider": "searxng", "url": searxng.url, "allow_addresses": [site.address]})
    ctx = toolsets.context(sandbox, web=runtime)
    hits = sum(secret.hits.values())
    port = secret.port
    urls = [f"{site.url}/article", f"http://[::127.0.0.1]:{port}/", f"http://[64:ff9b::7f00:1]:{port}/",
            f"http://localhost.:{port}/", f"{site.url}/redirect-to?url=http://[::127.0.0.1]:{port}/"]
    result = await WebExtractTool().call({"urls": urls}, ctx)
    article, *refused = result["results"]
    assert article["error"] is None and article["title"] == "The Quiet Lighthouse"
    assert [r["error"] for r in refused] == [
        "::127.0.0.1 is a private or local address; only public addresses can be fetched.",
        "64:ff9b::7f00:1 is a private or local address; only public addresses can be fetched.",
        "localhost. is a private or local address; only public addresses can be fetched.",
        "::7f00:1 is a private or local address; only public addresses can be fetched.",  # as the redirect wrote it
    ]
    assert sum(secret.hits.values()) == hits


@pytest.mark.parametrize("entry, network, port", [
    ("127.0.0.1:8080", "127.0.0.1/32", 8080), ("10.0.0.0/8", "10.0.0.0/8", None), ("[::1]:80", "::1/128", 80),
    ("fd00::/8", "fd00::/8", None), (" 192.168.1.5 ", "192.168.1.5/32", None),
])
def test_allow_addresses_entries(entry, network, port):
    [kept] = allowed_addresses(entry)
    parsed, parsed_port = allowed_entry(kept)
    assert (kept, str(parsed), parsed_port) == (entry.strip(), network, port)


def test_allow_addresses_refuses_names_and_bad_ports():
    assert len(allowed_addresses("10.0.0.1, 10.0.0.2:80")) == 2 == len(allowed_addresses(["10.0.0.1", "10.0.0.2:80"]))
    with pytest.raises(ConfigError, match="names are not accepted"):
        web_runtime({"allow_addresses": "intranet.example:80"})
    with pytest.raises(ConfigError, match="outside 1-65535"):
        web_runtime({"allow_addresses": ["10.0.0.1:0"]})


async def test_names_that_resolve_to_private_addresses_are_refused_by_the_resolver():
    # what stops a public-looking name whose DNS answer is loopback (DNS rebinding)
    resolver = PublicOnlyResolver()
    try:
        with pytest.raises(OSError, match="resolves only to private or local addresses"):
            await resolver.resolve("localhost", 80)
    finally:
        await resolver.close()


async def test_hostile_urls_fail_their_own_entry(web, site):
    urls = ["http://exa\udcffmple.org/", "http://127.0.0.1:99999/", "http://" + "a" * 300 + ".org/", f"{site.url}/article"]
    result = await WebExtractTool().call({"urls": urls}, web)
    assert result["success"] is True
    assert [bool(r["error"]) for r in result["results"]] == [True, True, True, False]
