"""The web inbox in a real headless Chromium: log in, see, approve.

Real parts only: a whole gateway on the locked bus, the inbox as its own
process (`... approvals inbox --port N --creds approver.creds`: a client of
the approvals service, nothing else), and Debian's chromium driven by
chromedriver through selenium. The arguments come from a model, so one of
them is a script tag: it must show as text and never run. An approver of
another tenant logs in first and sees nothing of the call.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request
import uuid
import zlib
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from tests.harness import Gateway
from tests.integration.test_approvals_support import (
    approval_requested,
    approvers,
    publish_event,
    service_env,
    wait_for_events,
)
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.events import ApprovalGranted
from toolgate.runtime.creds import connect_options
from toolgate.services.approvals.client import ApprovalsClient
from toolgate.stack.nats_server import free_port

pytestmark = pytest.mark.system

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
SCRIPT = "<script>alert(1)</script>"
ARGS = {
    "task_id": "task_c04",
    "claim": SCRIPT,
    "source_url": 'https://example.org/a?b=1&c="<img src=x onerror=alert(2)>"',
}

needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="/usr/bin/chromium is missing: apt-get install -y chromium chromium-driver "
    "(.ci/run installs it)",
)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[object]:
    # Not importorskip: without selenium (the test extra) this must fail, not skip.
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp_path / 'chromium'}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(
        options=options,
        service=Service(str(CHROMEDRIVER), log_output=str(tmp_path / "chromedriver.log")),
    )
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


@pytest.fixture
def inbox_process(shared_gateway: Gateway, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    port = free_port()
    log_path = tmp_path / "inbox.log"
    env = service_env()
    env.pop("TOOLGATE_NATS_CREDS", None)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "toolgate.cli",
                "approvals",
                "inbox",
                "--port",
                str(port),
                "--nats-url",
                shared_gateway.url,
                "--creds",
                str(shared_gateway.stack.creds_of("inbox")),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=1) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"inbox did not start: {log_path.read_text()[-3000:]}")
        time.sleep(0.1)
    yield url, shared_gateway.data_dir
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@needs_chromium
async def test_approver_logs_in_sees_the_call_safely_and_approves(
    shared_gateway: Gateway, inbox_process: tuple[str, Path], browser: object
) -> None:
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser  # a selenium Chrome driver
    url, data_dir = inbox_process
    tokens = approvers(data_dir, "bob")
    tokens |= approvers(data_dir, "gus", tenants=("globex",))
    admin = shared_gateway.admin
    await publish_event(shared_gateway.url, approval_requested("call_browser", ARGS, n=1), **admin)
    # Wait until the service has it, so what gus does not see is really there.
    async with await ApprovalsClient.connect(
        shared_gateway.url,
        token=tokens["bob"],
        **connect_options(shared_gateway.stack.creds_of("inbox")),
    ) as approvals:
        for _ in range(150):
            if await approvals.get("acme.researcher.call_browser") is not None:
                break
            await asyncio.sleep(0.1)
        else:
            raise TimeoutError("the approvals service never stored call_browser")

    def arrived(element_id: str) -> None:
        """Wait for the page a click navigates to (it has this element)."""
        WebDriverWait(driver, 15).until(  # type: ignore[arg-type]
            expected_conditions.presence_of_element_located((By.ID, element_id))
        )

    # An approver of globex logs in and sees nothing of acme's call.
    driver.get(url + "/")  # type: ignore[attr-defined]
    driver.find_element(By.ID, "token").send_keys(tokens["gus"])  # type: ignore[attr-defined]
    driver.find_element(By.ID, "login").click()  # type: ignore[attr-defined]
    arrived("who")
    assert driver.find_element(By.ID, "who").text == "gus"  # type: ignore[attr-defined]
    assert "globex" in driver.find_element(By.ID, "scope").text  # type: ignore[attr-defined]
    assert driver.find_elements(By.ID, "empty")  # type: ignore[attr-defined]
    assert "call_browser" not in driver.page_source  # type: ignore[attr-defined]
    assert "alert(1)" not in driver.page_source  # type: ignore[attr-defined]
    driver.find_element(By.CSS_SELECTOR, "form[action='/logout'] button").click()  # type: ignore[attr-defined]
    arrived("token")

    def page_shows_call() -> bool:
        driver.get(url + "/")  # type: ignore[attr-defined]
        return bool(
            driver.find_elements(  # type: ignore[attr-defined]
                By.CSS_SELECTOR, "article[data-call-id='call_browser']"
            )
        )

    # A wrong token is refused.
    driver.get(url + "/")  # type: ignore[attr-defined]
    driver.find_element(By.ID, "token").send_keys("tgap_not-a-real-token")  # type: ignore[attr-defined]
    driver.find_element(By.ID, "login").click()  # type: ignore[attr-defined]
    arrived("flash")
    assert "invalid token" in driver.find_element(By.ID, "flash").text  # type: ignore[attr-defined]

    driver.find_element(By.ID, "token").send_keys(tokens["bob"])  # type: ignore[attr-defined]
    driver.find_element(By.ID, "login").click()  # type: ignore[attr-defined]
    arrived("who")
    assert driver.find_element(By.ID, "who").text == "bob"  # type: ignore[attr-defined]
    deadline = time.monotonic() + 15
    while not page_shows_call():
        assert time.monotonic() < deadline, driver.page_source  # type: ignore[attr-defined]
        await asyncio.sleep(0.3)

    call = driver.find_element(By.CSS_SELECTOR, "article[data-call-id='call_browser']")  # type: ignore[attr-defined]
    assert call.find_element(By.CLASS_NAME, "tool").text == "save_evidence"
    assert call.find_element(By.CLASS_NAME, "risk").text == "critical"
    assert call.find_element(By.CLASS_NAME, "sha").text == arguments_sha256(ARGS)
    assert "u-alice" in call.text and "0 of 1" in call.text
    shown = call.find_element(By.CLASS_NAME, "arguments").text
    assert f'"claim": "{SCRIPT}"' in shown  # shown as text...
    assert "<img src=x onerror=alert(2)>" in shown
    # ... and not markup: no element came out of the arguments, nothing ran.
    # (The one script is the inbox's own file, in the head.)
    assert driver.find_elements(By.CSS_SELECTOR, "body script, img") == []  # type: ignore[attr-defined]
    [own] = driver.find_elements(By.CSS_SELECTOR, "script")  # type: ignore[attr-defined]
    assert own.get_attribute("src") == url + "/static/inbox.js"
    with pytest.raises(NoAlertPresentException):
        driver.switch_to.alert.text  # type: ignore[attr-defined]  # noqa: B018

    call.find_element(By.NAME, "reason").send_keys("Claim and source checked by hand.")
    call.find_element(By.CSS_SELECTOR, "button.approve").click()
    WebDriverWait(driver, 15).until(  # type: ignore[arg-type]
        expected_conditions.text_to_be_present_in_element((By.ID, "flash"), "quorum")
    )
    assert "approved" in driver.find_element(By.ID, "flash").text  # type: ignore[attr-defined]
    assert (
        driver.find_elements(  # type: ignore[attr-defined]
            By.CSS_SELECTOR, "article[data-call-id='call_browser']"
        )
        == []
    )

    events = await wait_for_events(
        shared_gateway.url,
        "call_browser",
        lambda es: any(isinstance(e, ApprovalGranted) for e in es),
        **admin,
    )
    [grant] = [e for e in events if isinstance(e, ApprovalGranted)]
    assert grant.approver == "bob" and grant.quorum_reached
    assert grant.reason == "Claim and source checked by hand."
    assert grant.arguments_sha256 == arguments_sha256(ARGS)
    assert grant.call.arguments == ARGS


PHONE = {"width": 360, "height": 780, "deviceScaleFactor": 1, "mobile": True}
DESKTOP = {"width": 1280, "height": 900, "deviceScaleFactor": 1, "mobile": False}
ZONE = "Pacific/Chatham"  # UTC+13:45: no hour of UTC reads the same there


def not_blank(png: Path) -> bool:
    """A PNG whose pixels are not all one colour (decoded here: no image library)."""
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", png
    at, idat = 8, b""
    while at < len(data):
        length = int.from_bytes(data[at : at + 4], "big")
        if data[at + 4 : at + 8] == b"IDAT":
            idat += data[at + 8 : at + 8 + length]
        at += 12 + length
    return len(set(zlib.decompress(idat))) > 16


@needs_chromium
async def test_inbox_fits_a_phone_updates_live_and_shows_the_approvers_time(
    shared_gateway: Gateway,
    inbox_process: tuple[str, Path],
    browser: object,
    tmp_path: Path,
) -> None:
    """At 360 px nothing scrolls sideways (long arguments wrap in their box), a call that
    starts waiting appears without a reload, times show in the browser's zone beside the
    UTC, and screenshots at phone and desktop widths are written and not blank."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    driver: Any = browser
    url, data_dir = inbox_process
    tokens = approvers(data_dir, "hana")
    admin = shared_gateway.admin
    suffix = uuid.uuid4().hex[:8]
    long_args = {
        "task_id": "task_c04",
        "claim": "x" * 1500 + " " + "word " * 200,
        "source_url": "https://example.org/" + "a" * 900,
    }
    first, second = f"call_phone_{suffix}", f"call_live_{suffix}"
    await publish_event(shared_gateway.url, approval_requested(first, long_args, n=1), **admin)
    driver.execute_cdp_cmd("Emulation.setTimezoneOverride", {"timezoneId": ZONE})
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", PHONE)

    def wait_for(css: str, seconds: float = 20) -> Any:
        return WebDriverWait(driver, seconds).until(
            expected_conditions.presence_of_element_located((By.CSS_SELECTOR, css))
        )

    metrics = PHONE

    def fits() -> None:
        # Against the device's width, not innerWidth: a mobile browser widens its layout
        # viewport (and zooms out) to fit a page that overflows.
        width = metrics["width"]
        scroll, inner = driver.execute_script(
            "return [Math.max(document.documentElement.scrollWidth, "
            "document.body.scrollWidth), window.innerWidth]"
        )
        assert scroll <= width and inner == width, (scroll, inner, width)

    def visible_inside(element: Any) -> None:
        assert element.is_displayed()
        right = driver.execute_script("return arguments[0].getBoundingClientRect().right", element)
        assert right <= metrics["width"] + 0.5

    def screenshot(name: str) -> Path:
        path = tmp_path / f"{name}.png"
        assert driver.save_screenshot(str(path))
        assert not_blank(path), path
        return path

    driver.get(url + "/")
    driver.find_element(By.ID, "token").send_keys(tokens["hana"])
    fits()  # the login form too (its token field is 60 characters wide on a desktop)
    driver.find_element(By.ID, "login").click()
    wait_for("#who")
    deadline = time.monotonic() + 20
    while not driver.find_elements(By.CSS_SELECTOR, f"article[data-call-id='{first}']"):
        assert time.monotonic() < deadline
        driver.get(url + "/")
        await asyncio.sleep(0.3)
    card = driver.find_element(By.CSS_SELECTOR, f"article[data-call-id='{first}']")
    fits()
    for element in (
        card.find_element(By.CLASS_NAME, "tool"),
        card.find_element(By.CLASS_NAME, "sha"),
        card.find_element(By.CLASS_NAME, "arguments"),
        card.find_element(By.NAME, "reason"),
        card.find_element(By.CSS_SELECTOR, "button.approve"),
        card.find_element(By.CSS_SELECTOR, "button.deny"),
    ):
        visible_inside(element)
    assert "Save one checked claim" in card.find_element(By.CLASS_NAME, "description").text
    # Times: the UTC stays, the approver's zone is added beside it.
    requested = card.find_element(By.CSS_SELECTOR, "dd time + .local")
    stamp = card.find_element(By.CSS_SELECTOR, "dd time").get_attribute("datetime")
    local = datetime.fromisoformat(stamp).astimezone(ZoneInfo(ZONE))
    assert f"{local:%Y-%m-%d %H:%M:%S} {ZONE}" in requested.text
    assert " UTC" in card.find_element(By.CSS_SELECTOR, "dd time").text
    phone = screenshot("inbox-360")

    # A call that starts waiting now appears on the open page: no reload.
    WebDriverWait(driver, 20).until(
        expected_conditions.text_to_be_present_in_element((By.ID, "live"), "live")
    )
    driver.execute_script("window.notReloaded = true")
    await publish_event(shared_gateway.url, approval_requested(second, ARGS, n=1), **admin)
    arrived = wait_for(f"article[data-call-id='{second}']")
    assert driver.execute_script("return window.notReloaded") is True
    assert arrived.find_element(By.CLASS_NAME, "local").text.endswith(f"{ZONE})")
    fits()

    # The page of one call, and the history once it is decided, fit the phone too.
    key = f"acme.researcher.{first}"
    driver.get(f"{url}/calls/{key}")
    page_card = wait_for(f"article[data-call-key='{key}']")
    fits()
    page_card.find_element(By.NAME, "reason").send_keys("Long, but checked.")
    page_card.find_element(By.CSS_SELECTOR, "button.approve").click()
    wait_for(".decision-granted")
    assert "hana" in driver.find_element(By.CLASS_NAME, "votes-list").text
    fits()
    call_shot = screenshot("call-360")
    driver.get(f"{url}/history?decision=granted&approver=hana")
    wait_for(f"#history article[data-call-key='{key}']")
    fits()
    history_shot = screenshot("history-360")

    metrics = DESKTOP
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", DESKTOP)
    driver.get(url + "/")
    wait_for(f"article[data-call-id='{second}']")
    fits()
    desktop = screenshot("inbox-1280")
    for shot in (phone, call_shot, history_shot, desktop):
        print(f"screenshot: {shot}")
