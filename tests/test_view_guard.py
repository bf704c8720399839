"""Who may read a running `hermes-batch view`: requests for its own address that carry this start's token."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import pytest

from hermes_batch.view.guard import Guard, split_host
from view_rig import (  # noqa: F401 (fixtures)
    CHROMIUM, CHROMIUM_FLAGS, demo_run_dir, needs_chromium, run_copy, shared_viewer, viewer,
)


def _get(v, path: str, host: str = None, headers: dict = None):
    """``(status, headers, body)`` of one GET to the viewer ``v``, with the Host header given."""
    where = urlsplit(v.base)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
    try:
        conn.putrequest("GET", path, skip_host=True)
        conn.putheader("Host", host if host is not None else where.netloc)
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, response.headers, response.read().decode()
    finally:
        conn.close()


def test_a_request_under_another_host_name_reads_nothing(shared_viewer):
    """A DNS-rebinding page (or a model's browser) asks 127.0.0.1 under its own name: refused, token or not."""
    v = shared_viewer
    port = urlsplit(v.base).port
    assert _get(v, f"/api/state?token={v.token}")[0] == 200
    for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1:{port + 1}", "127.0.0.1", f"localhost.:{port}",
                 f"x.localhost:{port}", f"[::1]:{port}", f"127.0.0.2:{port}", ""):
        for path in ("/api/state", "/api/records", "/api/summary", "/api/record?ref=batch_0.jsonl:0", "/"):
            status, _headers, body = _get(v, f"{path}{'&' if '?' in path else '?'}token={v.token}", host=host)
            assert status == 403, (host, path, body[:200])
            assert "kept" not in body and "conversation" not in body
    assert _get(v, f"/api/state?token={v.token}", host=f"localhost:{port}")[0] == 200


def test_every_request_needs_the_token_of_this_start(shared_viewer):
    v = shared_viewer
    for path in ("/", "/api/state", "/api/records", "/api/summary", "/api/record?ref=batch_0.jsonl:0"):
        status, _headers, body = _get(v, path)
        assert status == 403 and "token" in body and "kept" not in body, path
        assert _get(v, path + ("&" if "?" in path else "?") + "token=" + v.token[:-1] + "x")[0] == 403
        assert _get(v, path, headers={"Cookie": f"hermes-batch-view-{urlsplit(v.base).port}=wrong"})[0] == 403
    # a script may send it in the URL or as a header
    state = json.loads(_get(v, f"/api/state?token={v.token}")[2])
    assert state["records"] == 11
    assert _get(v, "/api/records", headers={"Authorization": f"token {v.token}"})[0] == 200


def test_the_printed_url_lets_the_page_in_with_a_cookie_and_leaves_the_token_out_of_its_address(shared_viewer):
    v = shared_viewer
    assert v.url.startswith("http://127.0.0.1:") and "?token=" in v.url
    status, headers, _body = _get(v, f"/?token={v.token}")
    assert status == 302 and headers["Location"] == "/"
    cookie = headers["Set-Cookie"]
    name = f"hermes-batch-view-{urlsplit(v.base).port}"  # the port in the name: two viewers keep their own
    assert cookie.startswith(f"{name}={v.token};")
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie
    for path in ("/", "/api/state", "/api/records?q=times", "/api/summary", "/api/record?ref=batch_0.jsonl:0"):
        status, _headers, body = _get(v, path, headers={"Cookie": f"{name}={v.token}"})
        assert status == 200, (path, body[:200])


def test_each_start_makes_its_own_token(run_copy, viewer):
    first = viewer(run_copy)
    second = viewer(run_copy)
    assert first.token != second.token and len(first.token) >= 40
    assert _get(second, f"/api/state?token={first.token}")[0] == 403
    assert _get(second, f"/api/state?token={second.token}")[0] == 200


@pytest.mark.parametrize("listen, allowed, refused", [
    ("127.0.0.1", ["127.0.0.1:8765", "LOCALHOST:8765"], ["localhost", "localhost.:8765", "a.localhost:8765",
                                                         "[::1]:8765", "10.0.0.1:8765", "127.0.0.1:8766", "x:y:z"]),
    ("::1", ["[::1]:8765", "localhost:8765"], ["127.0.0.1:8765", "[::1]", "::1:8765", "evil:8765"]),
    ("localhost", ["localhost:8765"], ["127.0.0.1.nip.io:8765", "evil:8765"]),
    ("10.1.2.3", ["10.1.2.3:8765"], ["localhost:8765", "10.1.2.4:8765", "evil:8765"]),
    ("0.0.0.0", ["10.1.2.3:8765", "[fe80::1]:8765", "localhost:8765"], ["evil.example:8765", "10.1.2.3:80"]),
])
def test_the_host_names_a_viewer_answers(listen, allowed, refused):
    guard = Guard(listen)
    guard.listening(8765)
    for host in allowed:
        assert guard.host_allowed(host), host
    for host in refused:
        assert not guard.host_allowed(host), host


def test_a_host_header_is_split_into_name_and_port():
    assert split_host("[::1]:8765") == ("::1", 8765)
    assert split_host("Example.COM") == ("example.com", None)
    assert split_host("127.0.0.1:80") == ("127.0.0.1", 80)
    assert split_host("a:b")[1] == -1 and split_host("[::1]x")[1] == -1


@needs_chromium
def test_a_rebound_name_reads_nothing_in_chromium(shared_viewer):
    """Chromium resolves evil.example to 127.0.0.1 (as a rebinding DNS server would): its pages get no record.

    The same browser opened the printed URL first, so it holds the viewer's cookie: it is not sent to evil.example.
    """
    from playwright.sync_api import sync_playwright

    v = shared_viewer
    port = urlsplit(v.base).port
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=[*CHROMIUM_FLAGS, "--host-resolver-rules=MAP evil.example 127.0.0.1"])
        try:
            page = browser.new_page()
            page.goto(v.url)
            page.locator("#list .row").first.wait_for()
            assert page.url == v.base  # the token left the address bar; the cookie carries it
            response = page.goto(f"http://evil.example:{port}/api/state")
            assert response.status == 403 and "kept" not in page.content()
            response = page.goto(f"http://evil.example:{port}/api/state?token={v.token}")
            assert response.status == 403  # even with the token: the name is not the viewer's
            response = page.goto(f"{v.base}api/state")
            assert response.status == 200 and '"records": 11' in page.content()
        finally:
            browser.close()
