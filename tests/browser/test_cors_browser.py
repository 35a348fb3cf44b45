"""CORS as a real browser sees it (Debian's Chromium driven by Selenium): a page on another origin calls
the gateway with `fetch`, as a browser app with the OpenAI SDK would: a bearer key and a JSON body (so a
preflight first), a reply and a stream it reads, the exposed headers, a 401 it can read; a page on an
origin not allowed gets nothing (the browser's `TypeError: Failed to fetch`)."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.remote.webdriver import WebDriver

from testkit.harness import free_port, run_gateway, write_config

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
MODEL = "llava-1.5-7b"
USER, ADMIN = "user-secret", "admin-secret"

# Runs in the page: one fetch to the gateway; what the page can read of it, or the error.
FETCH = """
const [url, key, body, done] = arguments;
// as the OpenAI JavaScript SDK sends them
const headers = {"content-type": "application/json", "x-stainless-os": "Linux", "x-stainless-retry-count": "0"};
if (key) headers["authorization"] = "Bearer " + key;
fetch(url, {method: "POST", headers, body: JSON.stringify(body)})
  .then(async r => done({status: r.status, text: await r.text(), requestId: r.headers.get("x-request-id"),
                         backend: r.headers.get("x-heterogate-backend")}))
  .catch(e => done({error: String(e)}));
"""


@contextmanager
def browser() -> Iterator[WebDriver]:
    """Headless Chromium, as tests/browser/test_dashboard.py starts it."""
    assert CHROMIUM and CHROMEDRIVER, "the browser tests need Debian's chromium and chromium-driver (see README)"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@contextmanager
def page_server(port: int) -> Iterator[None]:
    """An empty page on 127.0.0.1:`port`: the app's origin."""

    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<!doctype html><title>app</title>"
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


def test_a_page_on_an_allowed_origin_calls_the_gateway_and_another_cannot(tmp_path: Path) -> None:
    app_port = free_port()
    (tmp_path / "user.keys").write_text(f"{USER}\n")
    (tmp_path / "admin.keys").write_text(f"{ADMIN}\n")
    (tmp_path / "cluster.token").write_text("cluster-secret\n")
    config = write_config(tmp_path, {
        "model": MODEL,
        "gateway": {"auth": {"api_keys_file": str(tmp_path / "user.keys"),
                             "admin_keys_file": str(tmp_path / "admin.keys"),
                             "cluster_token_file": str(tmp_path / "cluster.token")},
                    "cors": {"allow_origins": [f"http://127.0.0.1:{app_port}"]}},
        "backends": [{"id": "h100-0", "role": "language", "gpu": "H100", "launch": {"time_scale": 0.1}}],
    })
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with run_gateway(config, admin_key=ADMIN) as gw, page_server(app_port), browser() as driver:
        url = f"{gw.url}/v1/chat/completions"
        driver.get(f"http://127.0.0.1:{app_port}/")
        reply = driver.execute_async_script(FETCH, url, USER, chat)
        assert reply.get("status") == 200, reply
        assert '"choices"' in reply["text"] and reply["requestId"] and reply["backend"] == "h100-0"
        streamed = driver.execute_async_script(FETCH, url, USER, {**chat, "stream": True})
        assert streamed.get("status") == 200 and streamed["text"].rstrip().endswith("data: [DONE]"), streamed
        assert streamed["backend"] == "h100-0"
        refused = driver.execute_async_script(FETCH, url, None, chat)
        assert refused.get("status") == 401 and "authentication_error" in refused["text"], refused
        assert refused["requestId"]

        driver.get(f"http://localhost:{app_port}/")   # the same page on another origin: not allowed
        assert driver.title == "app" and driver.execute_script("return location.origin") == \
            f"http://localhost:{app_port}"
        other = driver.execute_async_script(FETCH, url, USER, chat)
        assert "Failed to fetch" in other.get("error", ""), other
