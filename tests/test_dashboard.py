"""The dashboard in a real browser (headless Chromium, Selenium) against a live daemon with real runners."""

from __future__ import annotations

import os
import signal
import socket
import time
import urllib.parse

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from browser_harness import click, console_errors, open_page, screenshot, until
from daemon_harness import ready_daemon, runner_pid, runner_pids, start_daemon

MODEL = "exod/tiny-qwen2"
OTHER = "exod/tiny-other"  # in the cache, not placed: the page places it
CONFIG = """
[daemon]
port = {port}
offline = true

[retry]
initial = 0.2
cap = 1.0

[[place]]
model = "exod/tiny-qwen2"
ranks = 2
"""
KEY = "dashboard-test-key"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dashboard")
    with ready_daemon(tmp, CONFIG.format(port=0), {MODEL: 0, OTHER: 1}) as (url, _hf):
        yield url
    assert runner_pids() == []


@pytest.fixture
def page(browser, daemon):
    """The dashboard, loaded afresh, with its instance Ready."""
    open_page(browser, daemon + "/")
    until(lambda: card(browser, MODEL, state="ready"), what="the instance Ready on the page")
    return browser


def card(driver, model: str, state: str | None = None):
    """The card of the (newest) instance of ``model``, if it is on the page (in ``state``)."""
    cards = [c for c in driver.find_elements(By.CSS_SELECTOR, "article[data-instance]") if model in c.text]
    if cards and (state is None or cards[-1].get_attribute("data-state") == state):
        return cards[-1]
    return None


def timeline(driver) -> list[dict[str, str]]:
    keys = ("seq", "machine", "event", "from", "to", "generation")
    rows = driver.find_elements(By.CSS_SELECTOR, "#timeline li")
    return [{k: row.get_attribute(f"data-{k}") for k in keys} for row in rows][::-1]  # the page shows newest first


def test_the_page_shows_the_cluster_live_and_loads_nothing_from_elsewhere(page, daemon) -> None:
    instance = card(page, MODEL, state="ready")
    assert "generation\n1" in instance.text
    runners = instance.find_elements(By.CSS_SELECTOR, "tr[data-runner]")
    assert [r.find_element(By.CSS_SELECTOR, ".runner-state").text for r in runners] == ["ready · available"] * 2
    assert page.find_element(By.ID, "connection").text == "live"
    assert page.find_element(By.ID, "nodes").text == "local (controller)"
    assert not page.find_element(By.ID, "banner").is_displayed()

    click(lambda: card(page, MODEL))  # the machines, with this instance's live states marked
    until(lambda: page.find_elements(By.CSS_SELECTOR, "#diagram-instance g.live"), what="a live state in the diagram")
    live = {
        machine: sorted(
            g.find_element(By.TAG_NAME, "title").get_attribute("textContent")
            for g in page.find_elements(By.CSS_SELECTOR, f"#diagram-{machine} g.node.live")
        )
        for machine in ("instance", "runner", "download")
    }
    assert live == {"instance": ["ready"], "runner": ["available"], "download": ["completed"]}
    screenshot(page, "dashboard")

    resources = page.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert resources, "the page loaded its script, style sheet and API"
    assert all(
        urllib.parse.urlsplit(name)._replace(path="", query="", fragment="").geturl() == daemon for name in resources
    )
    assert console_errors(page) == []
    csp = httpx.get(daemon + "/").headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp


def test_a_killed_runner_shows_on_the_timeline_as_failure_recovery_and_generation_2(page, daemon) -> None:
    click(lambda: card(page, MODEL, state="ready"))
    until(lambda: any(e["to"] == "ready" and e["machine"] == "instance" for e in timeline(page)), what="the timeline")
    os.kill(runner_pid(1), signal.SIGKILL)

    def recovered():
        return any(e["machine"] == "instance" and e["to"] == "ready" and e["generation"] == "2" for e in timeline(page))

    until(recovered, what="Ready with generation 2 on the timeline")
    entries = until(lambda: timeline(page))
    assert len({e["seq"] for e in entries}) == len(entries), "an entry shown twice"
    moves = [(e["machine"], e["to"], e["generation"]) for e in entries]
    failed = moves.index(("runner", "failed", "1"))  # rank 1, killed: the runner's own machine says so first
    recovering = moves.index(("instance", "recovering", "1"), failed)
    backing_off = moves.index(("instance", "backing_off", "1"), recovering)
    starting = moves.index(("instance", "starting", "2"), backing_off)
    assert moves.index(("instance", "ready", "2"), starting) > starting
    instance = until(lambda: card(page, MODEL, state="ready"))
    assert "generation\n2" in instance.text
    assert "failed generations\n1 of 5" in instance.text
    assert "last cause" in instance.text
    screenshot(page, "dashboard-recovered")
    assert console_errors(page) == []


def test_place_and_delete_from_the_page(page, daemon) -> None:
    model, ranks = page.find_element(By.ID, "place-model"), page.find_element(By.ID, "place-ranks")
    model.send_keys(MODEL)
    ranks.clear()
    ranks.send_keys("3")
    click(lambda: page.find_element(By.CSS_SELECTOR, "#place-form button"))
    error = until(lambda: page.find_element(By.ID, "place-error").text, what="the placement check's error")
    assert error == f"model '{MODEL}' cannot be split into 3 ranks (its 2 layers); at most 2"
    assert len(httpx.get(daemon + "/instances").json()["instances"]) == 1, "a refused placement stores nothing"

    model.clear()
    model.send_keys(OTHER)
    ranks.clear()
    ranks.send_keys("1")
    click(lambda: page.find_element(By.CSS_SELECTOR, "#place-form button"))
    until(lambda: not page.find_element(By.ID, "place-error").is_displayed())
    placed = until(lambda: card(page, OTHER, state="ready"), what="the placed instance Ready")
    instance_id = placed.get_attribute("data-instance")
    assert page.find_element(By.ID, "detail-title").text == f"Instance {instance_id}"  # placing selects it
    assert "in memory\nloaded" in placed.text and "kept loaded" in placed.text

    # parked from the page: its runner goes, its card says so; unparked: a new generation, Ready again
    click(lambda: card(page, OTHER, state="ready").find_element(By.CSS_SELECTOR, "button[data-park]"))
    parked = until(lambda: card(page, OTHER, state="parked"), what="the instance parked")
    assert "in memory\nparked" in parked.text
    assert httpx.get(f"{daemon}/instances/{instance_id}").json()["runners"][0]["phase"] == "stopped"
    click(lambda: card(page, OTHER, state="parked").find_element(By.CSS_SELECTOR, "button[data-unpark]"))
    back = until(lambda: card(page, OTHER, state="ready"), what="the instance back")
    assert "generation\n2" in back.text and "failed generations\n0 of" in back.text  # no retry spent

    click(lambda: card(page, OTHER).find_element(By.CSS_SELECTOR, "button.delete"))
    deleted = until(lambda: card(page, OTHER, state="deleted"), what="the instance deleted")
    assert "Deleted: a user asked for it." in deleted.text
    assert page.find_element(By.ID, "deleted-why").text == "Deleted: a user asked for it."
    status = httpx.get(f"{daemon}/instances/{instance_id}").json()
    assert (status["state"], status["delete_reason"]) == ("deleted", "requested")
    # the browser reports the refused placement's 422 itself; the page had no error of its own
    assert [(e["source"], e["message"].split(" - ")[0]) for e in console_errors(page)] == [
        ("network", f"{daemon}/instances")
    ]


def test_a_chat_answer_streams_into_the_page(page, daemon) -> None:
    Select(page.find_element(By.ID, "chat-model")).select_by_value(MODEL)
    for field, value in (("chat-temperature", "0"), ("chat-max-tokens", "40")):
        page.find_element(By.ID, field).clear()
        page.find_element(By.ID, field).send_keys(value)
    page.find_element(By.ID, "chat-input").send_keys("Tell me about state machines.")
    page.find_element(By.ID, "chat-send").click()
    answer = until(
        lambda: page.find_element(By.CSS_SELECTOR, '#chat-log .assistant[data-done="true"]'), what="the answer"
    )
    assert not page.find_element(By.ID, "chat-error").is_displayed()
    assert int(answer.get_attribute("data-chunks")) > 1, "the answer came in pieces"
    messages = [{"role": "user", "content": "Tell me about state machines."}]
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 40}
    expected = httpx.post(f"{daemon}/v1/chat/completions", json=body, timeout=60).json()
    assert answer.get_attribute("textContent") == expected["choices"][0]["message"]["content"]

    # A fresh conversation, sampled (the picture of a real answer is test_real_model's).
    click(lambda: page.find_element(By.ID, "chat-clear"))
    assert page.find_elements(By.CSS_SELECTOR, "#chat-log p") == []
    page.find_element(By.ID, "chat-temperature").clear()
    page.find_element(By.ID, "chat-temperature").send_keys("1")
    page.find_element(By.ID, "chat-input").send_keys("And what is a runner?")
    page.find_element(By.ID, "chat-send").click()
    until(lambda: page.find_element(By.CSS_SELECTOR, '#chat-log .assistant[data-done="true"]'), what="the answer")
    assert [p.get_attribute("class") for p in page.find_elements(By.CSS_SELECTOR, "#chat-log p")] == [
        "user",
        "assistant",
    ]
    assert console_errors(page) == []


def test_the_api_docs_render_offline_from_the_package(browser, daemon) -> None:
    open_page(browser, daemon + "/docs")
    operations = until(lambda: browser.find_elements(By.CSS_SELECTOR, ".opblock-summary-path"), what="Swagger UI")
    assert "/v1/chat/completions" in {op.get_attribute("data-path") for op in operations}
    resources = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert {urllib.parse.urlsplit(name).netloc for name in resources} == {urllib.parse.urlsplit(daemon).netloc}
    assert console_errors(browser) == []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_with_a_key_the_page_shows_only_the_prompt_and_reconnects_after_the_daemon_returns(browser, tmp_path) -> None:
    from exod.host.tiny_model import make_tiny_model

    hf = tmp_path / "hf"
    make_tiny_model(MODEL, layers=2, hf_home=hf, seed=0)
    (tmp_path / "exod.toml").write_text(CONFIG.format(port=free_port()))  # the same port after a restart
    env = {**os.environ, "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"}
    auth = {"Authorization": f"Bearer {KEY}"}

    def ready(url):
        return until(
            lambda: [
                i for i in httpx.get(url + "/instances", headers=auth).json()["instances"] if i["state"] == "ready"
            ],
            what="the instance Ready",
        )

    process, url = start_daemon(tmp_path, env, "--api-key", KEY)
    try:
        ready(url)
        open_page(browser, url + "/")
        until(lambda: browser.find_element(By.ID, "key-prompt").is_displayed(), what="the key prompt")
        assert not browser.find_element(By.ID, "main").is_displayed()
        assert browser.find_elements(By.CSS_SELECTOR, "article[data-instance]") == []
        fetched = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
        assert not [name for name in fetched if "/instances" in name or "/events" in name], "data before the key"
        screenshot(browser, "dashboard-key")

        browser.find_element(By.ID, "key-input").send_keys("not-the-key")
        browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
        refused = until(lambda: browser.find_element(By.ID, "key-error").text, what="the refusal")
        assert refused == "That key was refused: check it and try again."
        assert not browser.find_element(By.ID, "main").is_displayed()

        browser.find_element(By.ID, "key-input").send_keys(KEY)
        browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
        until(lambda: card(browser, MODEL, state="ready"), what="the instance, once the key is given")
        click(lambda: card(browser, MODEL))
        seen = until(lambda: timeline(browser), what="the timeline")

        process.send_signal(signal.SIGTERM)  # the daemon goes away: the page says so and keeps trying
        assert process.wait(timeout=30) == 0
        banner = until(lambda: browser.find_element(By.ID, "banner"), what="the banner")
        until(lambda: banner.is_displayed(), what="the banner shown")
        assert banner.text.startswith("The daemon is not answering")
        assert browser.find_element(By.ID, "connection").text == "reconnecting"
        screenshot(browser, "dashboard-reconnecting")

        process, url2 = start_daemon(tmp_path, env, "--api-key", KEY)  # same state, same port
        assert url2 == url
        ready(url)
        until(lambda: not browser.find_element(By.ID, "banner").is_displayed(), timeout=30, what="the banner gone")
        assert browser.find_element(By.ID, "connection").text == "live"
        # resumed from the last entry it had: nothing shown twice, and the restart's own entries arrive
        after = until(lambda: (t := timeline(browser)) and len(t) > len(seen) and t, what="entries after the restart")
        assert len({e["seq"] for e in after}) == len(after)
        assert after[: len(seen)] == seen

        click(lambda: browser.find_element(By.ID, "forget-key"))  # the key taken back: nothing shown, nothing read
        until(lambda: browser.find_element(By.ID, "key-prompt").is_displayed(), what="the key prompt again")
        assert browser.find_elements(By.CSS_SELECTOR, "article[data-instance], #timeline li") == []
        assert browser.find_element(By.ID, "connection").text == "key needed"
        reads = "return performance.getEntriesByType('resource').filter(e => e.name.includes('/instances')).length"
        before = browser.execute_script(reads)
        time.sleep(3)  # longer than the page's 2 s poll
        assert browser.execute_script(reads) == before
        assert not browser.find_element(By.ID, "banner").is_displayed()
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


def test_in_a_cluster_a_follower_shows_every_node_and_places_across_them(browser, tmp_path, etcd) -> None:
    """Three nodes on 127.0.0.1-3: the page, opened on a node that is not the controller, lists all three
    and the controller, places a model on 3 ranks (forwarded to the controller), and shows a rank on each."""
    from test_cluster_nodes import nodes, start, stop_all

    from exod.host.tiny_model import make_tiny_model

    hf = tmp_path / "hf"
    make_tiny_model(MODEL, layers=3, hf_home=hf, seed=0)
    env = {**os.environ, "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"}
    daemons = [start(tmp_path, etcd, n, env) for n in (1, 2, 3)]
    try:
        view = until(lambda: (v := nodes(daemons[0][1])) and len(v["nodes"]) == 3 and v["controller"] and v)
        follower = next(n["api_url"] for n in view["nodes"] if not n["controller"])
        open_page(browser, follower + "/")
        shown = until(lambda: browser.find_element(By.ID, "nodes").text, what="the nodes")
        assert shown.endswith(
            ", ".join(f"node-{n}" + (" (controller)" if view["controller"] == f"node-{n}" else "") for n in (1, 2, 3))
        )
        browser.find_element(By.ID, "place-model").send_keys(MODEL)
        browser.find_element(By.ID, "place-ranks").clear()
        browser.find_element(By.ID, "place-ranks").send_keys("3")
        click(lambda: browser.find_element(By.CSS_SELECTOR, "#place-form button"))
        until(lambda: card(browser, MODEL, state="ready"), timeout=120, what="Ready on three nodes")

        def runner_nodes() -> list[str]:  # read again if the card is redrawn meanwhile
            rows = card(browser, MODEL).find_elements(By.CSS_SELECTOR, "tr[data-runner]")
            return sorted(row.find_elements(By.TAG_NAME, "td")[1].text for row in rows)

        assert until(runner_nodes, what="the ranks' nodes") == ["node-1", "node-2", "node-3"]
        screenshot(browser, "dashboard-cluster")
        assert console_errors(browser) == []
    finally:
        assert stop_all(daemons) == [0, 0, 0]
