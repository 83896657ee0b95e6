"""The chat page (static/chat.html) in headless Chromium driven by Selenium, against serve.py with an API
key and conftest's serve_demo model: the server's 401 shows until the key is typed in; replies stream in
and equal the API's at temperature 0, turn after turn; a refused request shows the server's error.
Needs chromium, chromium-driver and selenium, else the tests skip; GPT_TESTS_BROWSER=required (.ci/run
sets it) makes that a failure."""

import contextlib
import os
import shutil
import tempfile
import threading

import httpx
import pytest
from conftest import running, watching
from processes import load_script

pytestmark = pytest.mark.slow  # a browser, and the chat demo model trained once per run
page_tools = load_script("scripts/chat_screenshot.py")  # open_browser, set_field, type_message
KEY = "browser-test-key"


@pytest.fixture(scope="module")
def browser():
    missing = [path for path in (page_tools.CHROMIUM, page_tools.CHROMEDRIVER) if not os.path.exists(path)]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium (pip install selenium)")
    if missing:
        reason = f"missing {', '.join(missing)}: apt-get install chromium chromium-driver to run the chat page's browser test"
        if os.environ.get("GPT_TESTS_BROWSER") == "required":
            pytest.fail(reason)
        pytest.skip(reason)
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    driver = page_tools.open_browser(profile)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def served(serve_demo):  # keyed: open_page types the key in, but for test_the_api_key_field
    with running(f"--out_dir={serve_demo[0]}", f"--api_key={KEY}", "--batch_size=4") as s:
        yield s


# ---------------------------------------------------------------------------- helpers


def open_page(driver, s, temperature="0", key=KEY):
    """The page, loaded afresh, once it shows the model's name (GET /v1/models) or an error; the key typed in."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(s.url + "/")
    WebDriverWait(driver, 30).until(lambda d: text(d, "#model").startswith("model:") or text(d, "#error"))
    page_tools.set_field(driver, "temperature", temperature)
    if key:
        page_tools.set_field(driver, "api-key", key + "\t")  # leaving the field (change) asks for the models again
        WebDriverWait(driver, 30).until(lambda d: text(d, "#model") == f"model: {s.server.name}")


def text(driver, selector):
    return driver.execute_script(
        "const e = document.querySelector(arguments[0]); return e ? e.textContent : null", selector
    )


def log(driver):
    """The conversation on the page: [(role, text)]; role is 'user' or 'assistant'."""
    script = "return [...document.querySelectorAll('#log .message')].map(m => [m.classList.contains('user') ? "
    script += "'user' : 'assistant', m.querySelector('.text').textContent])"
    return [tuple(m) for m in driver.execute_script(script)]


def api(s, messages, key=KEY):
    """The server's own answer to the conversation at temperature 0: (status, JSON body)."""
    body = {"model": s.server.name, "messages": messages, "temperature": 0}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(s.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    return r.status_code, r.json()


def api_reply(s, messages, key=KEY):
    status, body = api(s, messages, key)
    assert status == 200, body
    return body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]


@contextlib.contextmanager
def engine_held(engine, after_steps):
    """The engine stops before its decoding step `after_steps` (the reply then has that many tokens)
    until the block ends; yields an Event set once it has stopped there."""
    count, reached, release = [0], threading.Event(), threading.Event()

    def hold(step):
        count[0] += bool(step.decoding)  # a decoding step (a pass of prompts alone is not one)
        if count[0] == after_steps and step.decoding:
            reached.set()
            release.wait(60)

    with watching(engine, hold):
        try:
            yield reached
        finally:
            release.set()


# ---------------------------------------------------------------------------- the tests


def test_a_conversation_streams_and_matches_the_api(browser, served):
    """Turn one streams in (partly shown while the engine is held) and equals the API's reply, with its
    token count; turn two equals the API's reply to both turns; after "New chat" the same question
    gets the API's reply to it alone, another reply."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    first, second = "My name is Dovaki.", "What is my name?"
    expected_first, n_first = api_reply(served, [{"role": "user", "content": first}])
    open_page(browser, served)
    with engine_held(served.engine, after_steps=3) as reached:
        browser.find_element(By.ID, "input").send_keys(first + "\n")
        assert reached.wait(30), "the engine never reached its third step"
        WebDriverWait(browser, 30).until(lambda d: text(d, "#log .message.assistant .text"))
        partial = text(browser, "#log .message.assistant .text")
        busy = browser.find_elements(By.CSS_SELECTOR, "#log .message.assistant[aria-busy=true]")
    assert busy and partial and expected_first.startswith(partial) and len(partial) < len(expected_first), partial
    WebDriverWait(browser, 60).until(lambda d: not d.find_elements(By.CSS_SELECTOR, "#log [aria-busy]"))
    assert log(browser) == [("user", first), ("assistant", expected_first)]
    assert text(browser, "#stats").startswith(f"Last reply: {n_first} tokens in "), text(browser, "#stats")

    two_turns = [
        {"role": "user", "content": first},
        {"role": "assistant", "content": expected_first},
        {"role": "user", "content": second},
    ]
    expected_second, _ = api_reply(served, two_turns)
    assert page_tools.type_message(browser, second) == expected_second
    both_turns = [("user", first), ("assistant", expected_first), ("user", second), ("assistant", expected_second)]
    assert log(browser) == both_turns

    browser.find_element(By.ID, "new-chat").click()
    assert log(browser) == [] and browser.find_element(By.ID, "input").get_attribute("value") == ""
    alone, _ = api_reply(served, [{"role": "user", "content": second}])
    assert page_tools.type_message(browser, second) == alone != expected_second
    assert log(browser) == [("user", second), ("assistant", alone)]


def test_a_refused_request_shows_the_servers_error(browser, served):
    """A message longer than the context: the error line shows the message the API gives for it,
    the turn is taken back and its text is back in the box to edit."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    message = "Repeat after me: " + "sule pova " * 80
    status, body = api(served, [{"role": "user", "content": message}])
    assert status == 400 and "context" in body["error"]["message"]
    open_page(browser, served)
    browser.find_element(By.ID, "input").send_keys(message + "\n")
    WebDriverWait(browser, 30).until(lambda d: text(d, "#error"))
    assert text(browser, "#error") == f"Error 400: {body['error']['message']}"
    assert log(browser) == [] and browser.find_element(By.ID, "input").get_attribute("value") == message


def test_the_api_key_field(browser, served):
    """Against a server with --api_key, the page shows the server's 401 until the key is typed in, then
    replies. Markup in messages and replies is shown as text, never made into elements."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    first, second = "My name is <b>Zuvaki</b>.", "<img src=x onerror=alert(1)>"
    status, body = api(served, [{"role": "user", "content": first}], key=None)
    assert status == 401
    open_page(browser, served, key=None)
    assert text(browser, "#error").startswith(f"Error 401: {body['error']['message']}")
    assert "API key" in text(browser, "#error") and not text(browser, "#model").startswith("model:")
    page_tools.set_field(browser, "api-key", KEY + "\t")  # leaving the field (change) asks for the models again
    WebDriverWait(browser, 30).until(lambda d: text(d, "#model") == f"model: {served.server.name}")
    assert text(browser, "#error") == ""
    conversation = []
    for message in (first, second):
        conversation.append({"role": "user", "content": message})
        expected, _ = api_reply(served, conversation)
        assert page_tools.type_message(browser, message) == expected  # an empty reply stays on the page too
        conversation.append({"role": "assistant", "content": expected})
    assert log(browser) == [(m["role"], m["content"]) for m in conversation]
    assert browser.find_elements(By.CSS_SELECTOR, "#log img, #log b") == []
