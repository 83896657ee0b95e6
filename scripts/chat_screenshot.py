"""A picture of the chat page mid-conversation (docs/chat.png): headless Chromium on
a running serve.py, a system message, three messages typed into the page.

    python serve.py --out_dir=out-chat-demo --port=8000 &
    python scripts/chat_screenshot.py --url=http://127.0.0.1:8000 --output=docs/chat.png

Needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver) and
selenium. open_browser() is also what tests/test_serve_browser.py drives the page with.
"""

import argparse
import os
import shutil
import sys
import tempfile

# Debian's paths; CHROMIUM and CHROMEDRIVER in the environment name others
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = os.environ.get("CHROMEDRIVER") or shutil.which("chromedriver") or "/usr/bin/chromedriver"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
MESSAGES = ("My name is Dovaki.", "Reverse: sule pova kire", "What is my name?")


def open_browser(profile, size=(1100, 900)):
    """Headless Chromium under chromedriver, with a fresh profile in the directory `profile`."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def set_field(driver, element_id, value):
    """Replace what an input holds, as a user would: select it all, type over it."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    field = driver.find_element(By.ID, element_id)
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(value)


def type_message(driver, text, timeout=60):
    """Type text into the page and wait for its reply to finish: the reply's text."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    before = len(driver.find_elements(By.CSS_SELECTOR, "#log .message.assistant"))
    driver.find_element(By.ID, "input").send_keys(text, Keys.ENTER)
    WebDriverWait(driver, timeout).until(
        lambda d: (
            len(d.find_elements(By.CSS_SELECTOR, "#log .message.assistant")) > before
            and not d.find_elements(By.CSS_SELECTOR, "#log [aria-busy]")
            and d.find_element(By.ID, "send").is_enabled()
        )
    )
    replies = driver.find_elements(By.CSS_SELECTOR, "#log .message.assistant .text")
    return replies[-1].text if len(replies) > before else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="a running serve.py (default: %(default)s)")
    p.add_argument("--output", default="docs/chat.png", help="the PNG to write (default: %(default)s)")
    p.add_argument("--system", default="Answer briefly.", help="the system message typed into the page")
    p.add_argument("--temperature", default="0", help="typed into the page's temperature field (default: %(default)s)")
    args = p.parse_args(argv)
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    driver = open_browser(profile)
    try:
        driver.get(args.url.rstrip("/") + "/")
        WebDriverWait(driver, 30).until(lambda d: d.find_element(By.ID, "model").text.startswith("model:"))
        driver.find_element(By.ID, "system").send_keys(args.system)
        set_field(driver, "temperature", args.temperature)
        for text in MESSAGES:
            print(f"> {text}\n{type_message(driver, text)}", file=sys.stderr)
        driver.execute_script("document.activeElement.blur()")  # no focus ring in the picture
        os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
        driver.save_screenshot(args.output)
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
    print(f"wrote {args.output} ({os.path.getsize(args.output) / 1024:.0f} KB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
