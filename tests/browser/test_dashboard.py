"""/dashboard in a real headless browser (Debian's Chromium driven by Selenium): the page renders the backends
of a running demo gateway, shows the requests it serves, and updates when an engine is killed; with admin keys
on, it asks for a key and shows nothing until given one."""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from testkit.harness import demo_config, run_gateway, write_config

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
MODEL = "llava-1.5-7b"
WAIT_S = 30
SCREENSHOT_DIR = os.environ.get("HETEROGATE_SCREENSHOT_DIR")

@contextmanager
def browser() -> Iterator[WebDriver]:
    assert CHROMIUM and CHROMEDRIVER, "the browser tests need Debian's chromium and chromium-driver (see README)"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()


def table(driver: WebDriver, selector: str) -> list[list[str]]:
    """A table's body as the page shows it, read in one script call (the page re-renders every poll)."""
    cells: list[list[str]] = driver.execute_script(
        "return [...document.querySelectorAll(arguments[0] + ' tbody tr')]"
        ".map(tr => [...tr.cells].map(td => td.textContent))", selector)
    return cells


def rows(driver: WebDriver) -> dict[str, dict[str, str]]:
    """The backends table: id -> {column header: cell text}."""
    heads = [th.text for th in driver.find_elements(By.CSS_SELECTOR, "#backends thead th")]
    return {cells[0]: dict(zip(heads, cells, strict=True)) for cells in table(driver, "#backends")}


def two_engines(tmp: Path, **gateway: Any) -> Path:
    """h100-0 and l40s-0, managed simulated language engines; `gateway`: settings added."""
    return write_config(tmp, {"model": MODEL, "gateway": {"heartbeat_interval_ms": 100, **gateway}, "backends": [
        {"id": b, "role": "language", "gpu": gpu, "launch": {"time_scale": 0.1}}
        for b, gpu in (("h100-0", "H100"), ("l40s-0", "L40S"))]})


def test_dashboard_renders_backends_and_updates_when_an_engine_is_killed(tmp_path: Path) -> None:
    config = demo_config(tmp_path, heartbeat_interval_ms=100, per_backend={"l40s-2": {"min_priority": 0}})
    with run_gateway(config) as gw, browser() as driver:
        backends = {b["id"]: b for b in gw.backends()}
        driver.get(f"{gw.url}/dashboard")
        wait = WebDriverWait(driver, WAIT_S, poll_frequency=0.2)
        wait.until(lambda d: set(rows(d)) == set(backends))
        shown = rows(driver)
        for backend_id, b in backends.items():
            assert shown[backend_id]["GPU"] == b["gpu"] and shown[backend_id]["role"] == b["role"]
            assert shown[backend_id]["models"] == ", ".join(b["models"])
            assert shown[backend_id]["state"] == "healthy" and shown[backend_id]["restarts"] == "0"
            assert shown[backend_id]["kept for"] == ("class ≥ 0" if backend_id == "l40s-2" else "all")

        with gw.client() as client:
            for _ in range(5):   # streamed: each gives its mean inter-token time too
                resp = client.post("/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4,
                    "stream": True})
                assert resp.status_code == 200
        wait.until(lambda d: ["200", "5"] in table(d, "#outcomes"))
        wait.until(lambda d: "–" not in d.find_element(By.ID, "ttft").text)   # three percentiles, in ms or s
        wait.until(lambda d: "–" not in d.find_element(By.ID, "itl").text)    # p50 / p99 of heterogate_itl_seconds
        # the language backends that served: the engine's prefix-cache hit rate, or the index's prediction
        served = [b["id"] for b in gw.backends() if b["prefix_cache"] and b["prefix_cache"]["predicted_query_tokens"]]
        assert served
        wait.until(lambda d: all(re.fullmatch(r"\d+%( \(predicted\))?", rows(d)[i]["prefix hits"]) for i in served))
        assert {rows(driver)[b]["prefix hits"] for b in backends if b.startswith("rtx4090")} == {"–"}   # none routed
        shot = tmp_path / "dashboard.png"
        assert driver.save_screenshot(str(shot)) and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if SCREENSHOT_DIR:   # README's picture: HETEROGATE_SCREENSHOT_DIR=docs python -m pytest tests/browser
            shutil.copy(shot, Path(SCREENSHOT_DIR) / "dashboard.png")

        victim = next(b for b in backends.values() if b["gpu"] == "H100")
        os.kill(victim["pid"], signal.SIGKILL)
        wait.until(lambda d: rows(d)[victim["id"]]["restarts"] == "1")
        wait.until(lambda d: rows(d)[victim["id"]]["state"] == "healthy")   # the supervisor brought it back
        assert "error" not in driver.find_element(By.ID, "status").get_attribute("class")


def test_dashboard_with_admin_keys_asks_for_a_key(tmp_path: Path) -> None:
    """Two engines, not the demo's ten: what is checked is the key, not the table."""
    config = two_engines(tmp_path, auth={"admin_keys_env": "HG_DASH_ADMIN", "cluster_token_env": "HG_DASH_TOKEN"})
    env = {"HG_DASH_ADMIN": "dash-admin-key", "HG_DASH_TOKEN": "dash-cluster-token-0123456789abcdef"}
    with run_gateway(config, admin_key="dash-admin-key", env=env) as gw, browser() as driver:
        assert httpx.get(f"{gw.url}/admin/backends", timeout=5).status_code == 401
        driver.get(f"{gw.url}/dashboard")
        wait = WebDriverWait(driver, WAIT_S, poll_frequency=0.2)
        wait.until(lambda d: d.find_element(By.ID, "key-form").is_displayed())
        assert rows(driver) == {}, "nothing is shown without the key"
        status = driver.find_element(By.ID, "status")
        assert status.text == "an admin key is needed"
        driver.find_element(By.ID, "key").send_keys("not-a-key")
        driver.find_element(By.CSS_SELECTOR, "#key-form button").click()
        wait.until(lambda d: d.find_element(By.ID, "status").text == "that key was refused: not a key of this gateway")
        wait.until(lambda d: d.find_element(By.ID, "key-form").is_displayed())
        time.sleep(2.5)   # a few more polls (each without the refused key): the page still says why, not only
        assert status.text == "that key was refused: not a key of this gateway"   # "an admin key is needed"
        driver.find_element(By.ID, "key").clear()
        driver.find_element(By.ID, "key").send_keys("dash-admin-key")
        driver.find_element(By.CSS_SELECTOR, "#key-form button").click()
        wait.until(lambda d: len(rows(d)) == len(gw.backends()))


def test_dashboard_shows_a_drained_backend_as_drained_not_down(tmp_path: Path) -> None:
    """Drained through the fleet API, a managed engine stops: the page says so, not that it is down."""
    with run_gateway(two_engines(tmp_path)) as gw, browser() as driver:
        driver.get(f"{gw.url}/dashboard")
        wait = WebDriverWait(driver, WAIT_S, poll_frequency=0.2)
        wait.until(lambda d: set(rows(d)) == {"h100-0", "l40s-0"})
        assert httpx.post(f"{gw.url}/admin/backends/l40s-0/drain", timeout=10).status_code == 202
        wait.until(lambda d: rows(d)["l40s-0"]["state"] == "drained")
        row_class = driver.execute_script("return document.querySelector('tr[data-backend=\"l40s-0\"]').className")
        assert row_class == "draining" and rows(driver)["h100-0"]["state"] == "healthy"


def test_dashboard_totals_keep_a_removed_backends_requests(tmp_path: Path) -> None:
    """A removed backend's series leave /metrics: the page's outcome and decision totals went back by its share."""
    with run_gateway(two_engines(tmp_path)) as gw, browser() as driver:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        served = {httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30).headers["x-heterogate-backend"]
                  for _ in range(12)}
        victim = sorted(served)[0]   # a backend with requests: its series are the ones that leave
        kept = ({"h100-0", "l40s-0"} - {victim}).pop()
        driver.get(f"{gw.url}/dashboard")
        wait = WebDriverWait(driver, WAIT_S, poll_frequency=0.2)
        wait.until(lambda d: dict(map(tuple, table(d, "#outcomes"))) == {"200": "12"})   # type: ignore[arg-type]
        assert httpx.delete(f"{gw.url}/admin/backends/{victim}", timeout=10).status_code == 202
        wait.until(lambda d: set(rows(d)) == {kept})
        time.sleep(2.5)   # polls after the removal
        assert dict(map(tuple, table(driver, "#outcomes"))) == {"200": "12"}   # type: ignore[arg-type]
        assert sum(int(r[2]) for r in table(driver, "#decisions")) == 12
