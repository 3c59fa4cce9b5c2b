"""The chat page at / in headless Chromium (Debian's chromium + chromedriver, driven by selenium).

.ci/install-browser.sh installs them when missing. The engine is gated, so the test can see
the reply on screen while the request is still generating: streamed token by token.
"""
import shutil
import tempfile

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from tests.server_fixtures import (
    SCRIPT_TEXT,
    LiveServer,
    default_tokenizer,
    script_ids,
    scripted_engine,
    wait_until,
)

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


@pytest.fixture
def browser():
    profile = tempfile.mkdtemp(prefix="chromium-test-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _reply(driver):
    replies = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")
    return replies[-1] if replies else None


def test_chat_page_streams_reply_token_by_token(browser):
    eng = scripted_engine(gated=True)
    model = eng.model
    num_early = 3
    early_text = default_tokenizer().decode(script_ids()[:num_early])
    model.hold(num_early)  # the prefill samples token 1; two decode ticks give tokens 2 and 3
    try:
        with LiveServer(eng) as live:
            browser.get(live.base_url + "/")
            box = browser.find_element(By.ID, "input")
            box.send_keys("Hello, who are you?")
            box.send_keys(Keys.ENTER)
            wait = WebDriverWait(browser, 30)
            wait.until(lambda d: _reply(d) is not None and _reply(d).text == early_text)
            reply = _reply(browser)
            assert reply.get_attribute("data-state") == "streaming"  # partial text shown mid-generation
            assert browser.find_element(By.ID, "stop").is_enabled()
            model.open()
            wait.until(lambda d: _reply(d).get_attribute("data-state") == "done")
            assert reply.get_attribute("textContent") == SCRIPT_TEXT
            assert int(reply.get_attribute("data-chunks")) > num_early
            assert reply.get_attribute("data-finish") == "stop"
            user = browser.find_elements(By.CSS_SELECTOR, ".msg.user")
            assert [u.text for u in user] == ["Hello, who are you?"]
            assert browser.find_element(By.ID, "send").is_enabled()
    finally:
        model.open()
        eng.close()


def test_chat_page_shows_server_errors(browser):
    eng = scripted_engine(max_model_len=64)
    try:
        with LiveServer(eng) as live:
            browser.get(live.base_url + "/")
            browser.find_element(By.TAG_NAME, "summary").click()  # open the settings
            browser.find_element(By.ID, "max-tokens").clear()
            browser.find_element(By.ID, "max-tokens").send_keys("1000")  # over max_model_len
            box = browser.find_element(By.ID, "input")
            box.send_keys("hi")
            browser.find_element(By.ID, "send").click()
            WebDriverWait(browser, 30).until(lambda d: _reply(d) is not None
                                             and _reply(d).get_attribute("data-state") == "error")
            assert "max_model_len" in _reply(browser).get_attribute("textContent")
    finally:
        eng.close()


def test_stop_button_aborts_the_request_in_the_engine(browser):
    eng = scripted_engine(gated=True, with_eos=False)
    model = eng.model
    model.hold(2)
    try:
        with LiveServer(eng) as live:
            browser.get(live.base_url + "/")
            box = browser.find_element(By.ID, "input")
            box.send_keys("Tell me everything.")
            box.send_keys(Keys.ENTER)
            wait = WebDriverWait(browser, 30)
            wait.until(lambda d: _reply(d) is not None and _reply(d).get_attribute("data-chunks") == "2")
            assert eng.stats()["num_running"] == 1
            browser.find_element(By.ID, "stop").click()
            wait.until(lambda d: _reply(d).get_attribute("data-state") == "stopped")
            for _ in range(20):  # tick by tick until the server notices the closed connection
                if wait_until(lambda: eng.stats()["num_running"] == 0, timeout=0.5):
                    break
                model.allow(1)
            assert eng.stats()["num_running"] == 0 and eng.stats()["kv_usage"] == 0.0
            assert browser.find_element(By.ID, "send").is_enabled()
    finally:
        model.open()
        eng.close()


def test_chat_page_shows_reasoning_apart_from_the_reply(browser):
    from tests.reasoning_fixtures import reasoning_engine

    reasoning = "\nThe user says hi. Greet back.\n"
    with reasoning_engine(f"<think>{reasoning}</think>\n\nHello!") as eng, LiveServer(eng) as live:
        browser.get(live.base_url + "/")
        box = browser.find_element(By.ID, "input")
        box.send_keys("hi")
        box.send_keys(Keys.ENTER)
        WebDriverWait(browser, 30).until(lambda d: _reply(d) is not None
                                         and _reply(d).get_attribute("data-state") == "done")
        assert _reply(browser).get_attribute("textContent") == "\n\nHello!"
        (thought,) = browser.find_elements(By.CSS_SELECTOR, ".msg.reasoning")
        assert thought.get_attribute("textContent") == reasoning
