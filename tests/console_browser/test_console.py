"""The operator console in a real browser (headless Chromium) against a real worker, broker,
Postgres and the reference downstream: sign in; filter and group by cause; open a held
operation made by a dropped reply, refuse a wrong receipt with its reason, resolve it with the
downstream's receipt and see it leave the list; bulk-recheck 50 rows with progress; republish a
dead letter after fixing its tool; a tenant sees only its tenant and no action; a forged POST
without the CSRF token is refused; hostile strings render as text; an approver signs in, sees
the exact arguments and approves an intent that waited for approval (a forged post and a
fingerprint other than the one shown are refused). The tests run in file order
on one world and one browser; each page is saved as a screenshot."""

from __future__ import annotations

import json
import os
import shutil
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.common.exceptions import (
    NoAlertPresentException,
    StaleElementReferenceException,
    WebDriverException,
)
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from conftest import REPO, Shots, World

NORTH = "north-shop"
SOUTH = "south-shop"
SCRIPT_ID = "<script>alert(1)</script>"
IMG_ID = '"><img/src=x/onerror=alert(1)>'
HOSTILE_ARGS = {
    "note": "\u001b[31mred\u001b[0m <script>alert(2)</script>",
    "x": '"><img src=x onerror=alert(3)>',
}
HOSTILE_EVIDENCE = '\u001b[1;31mdowngraded"><img src=x onerror=alert(4)> <script>alert(5)</script>'
BULK_ROWS = 50


def wait(driver: webdriver.Chrome, timeout: float = 30.0) -> WebDriverWait:
    return WebDriverWait(
        driver, timeout, poll_frequency=0.1, ignored_exceptions=[StaleElementReferenceException]
    )


def reloading_wait(driver: webdriver.Chrome, timeout: float) -> WebDriverWait:
    """A wait on a page that reloads itself. A read can meet the old document while the new one
    replaces it, and chromedriver reports that as a stale element, a missing element, a
    JavaScript error or an "unknown error" (a node that "does not belong to the document"). Each
    of those is read again on the next poll; the timeout still fails the test."""
    return WebDriverWait(
        driver, timeout, poll_frequency=0.1, ignored_exceptions=[WebDriverException]
    )


def text(driver: webdriver.Chrome) -> str:
    return str(driver.find_element(By.TAG_NAME, "body").text)


def no_alert(driver: webdriver.Chrome) -> None:
    with pytest.raises(NoAlertPresentException):
        driver.switch_to.alert  # noqa: B018


def sign_in(driver: webdriver.Chrome, world: World, token: str, operator: str = "") -> None:
    driver.get(f"{world.base}/ui/login")
    driver.delete_all_cookies()
    driver.get(f"{world.base}/ui/login")
    driver.find_element(By.ID, "token").send_keys(token)
    if operator:
        driver.find_element(By.ID, "operator").send_keys(operator)
    driver.find_element(By.CSS_SELECTOR, "form button[type=submit]").click()
    wait(driver).until(lambda d: d.current_url.endswith("/ui/overview"))


@pytest.fixture(scope="session")
def seeded(world: World) -> World:
    """Fifty held lookup operations whose lookups missed, a held deploy whose reply was lost, a
    held deploy of the other tenant, hostile strings, and a dead letter for a missing tool."""
    world.fault({"kind": "drop_after_commit", "times": BULK_ROWS})
    world.fault({"kind": "lookup_miss", "times": BULK_ROWS})
    world.publish_many(
        [(NORTH, f"ticket-{i:02d}", "tickets", {"title": f"t{i}"}) for i in range(BULK_ROWS)]
    )
    world.wait_until(
        "fifty held tickets",
        lambda: (
            world.query("SELECT count(*) FROM operations WHERE state = 'held'")[0][0] == BULK_ROWS
        ),
    )
    world.clear_faults()
    world.fault({"kind": "drop_after_commit", "key": f"{NORTH}:deploy-1"})
    world.fault({"kind": "drop_after_commit", "key": f"{SOUTH}:deploy-s1"})
    world.fault({"kind": "drop_after_commit", "key": f"{NORTH}:{IMG_ID}"})
    world.publish_many(
        [
            (NORTH, "refund-1", "refund", {"order": "o-1", "amount_cents": 4850}),
            (NORTH, "deploy-1", "deploy", {"service": "api", "version": "1.2.3"}),
            (SOUTH, "deploy-s1", "deploy", {"service": "web", "version": "9"}),
            (NORTH, SCRIPT_ID, "refund", HOSTILE_ARGS),
            (NORTH, IMG_ID, "deploy", HOSTILE_ARGS),
            (NORTH, "ticket-fix-1", "ticket2", {"title": "needs ticket2"}),
        ]
    )
    for tenant, action, state in [
        (NORTH, "deploy-1", "held"),
        (SOUTH, "deploy-s1", "held"),
        (NORTH, IMG_ID, "held"),
        (NORTH, SCRIPT_ID, "succeeded"),
        (NORTH, "refund-1", "succeeded"),
    ]:
        world.wait_until(
            f"{action} {state}", lambda t=tenant, a=action, s=state: world.state(t, a) == s
        )
    # An operator's evidence with an ANSI escape and markup (through the API, as a script would).
    status = world.api(
        "POST",
        f"/v1/operations/{NORTH}/{urllib.request.quote(IMG_ID, safe='')}/fail",
        {"evidence": HOSTILE_EVIDENCE, "operator": "script", "request_id": "hostile-1"},
    )
    assert status == 200, status
    return world


def test_sign_in_shows_the_overview(driver: webdriver.Chrome, seeded: World, shots: Shots) -> None:
    driver.get(f"{seeded.base}/ui")
    wait(driver).until(lambda d: d.current_url.endswith("/ui/login"))
    driver.find_element(By.ID, "token").send_keys("not-the-token")
    shots.take(driver, "sign-in")
    driver.find_element(By.CSS_SELECTOR, "form button[type=submit]").click()
    wait(driver).until(lambda d: "not accepted" in text(d))
    assert driver.get_cookie("iw_session") is None
    sign_in(driver, seeded, seeded.admin_token, "alice")
    cookie = driver.get_cookie("iw_session")
    assert cookie is not None
    assert cookie["httpOnly"] is True and cookie["sameSite"] == "Strict", cookie
    assert cookie["secure"] is False and cookie["path"] == "/ui", cookie
    body = text(driver)
    assert "admin alice" in body and "unresolved" in body
    assert seeded.admin_token not in driver.page_source
    assert "workers ready" in body
    # The worker's heartbeat: one worker, ready.
    wait(driver).until(lambda d: "1 / 1" in text(d) or d.refresh())
    shots.take(driver, "overview")


def test_operations_filter_and_group_by_cause(
    driver: webdriver.Chrome, seeded: World, shots: Shots
) -> None:
    driver.get(f"{seeded.base}/ui/operations")
    state = driver.find_element(By.NAME, "state")
    state.clear()
    state.send_keys("held")
    driver.find_element(By.CSS_SELECTOR, "form.filter button[type=submit]").click()
    wait(driver).until(lambda d: "state=held" in d.current_url)
    assert "ticket-00" in text(driver)
    shots.take(driver, "operations")
    driver.find_element(By.LINK_TEXT, "Group by cause").click()
    wait(driver).until(lambda d: "view=groups" in d.current_url)
    groups = {
        row.find_elements(By.TAG_NAME, "td")[0].text: row.find_elements(By.TAG_NAME, "td")[3].text
        for row in driver.find_elements(By.CSS_SELECTOR, "table.groups tbody tr")
    }
    assert groups.get("lookup_miss") == str(BULK_ROWS), groups
    assert groups.get("no_recovery") == "2", groups
    shots.take(driver, "operations-groups")
    # A group's link is the filtered list, and that URL is the view to share.
    driver.find_element(By.LINK_TEXT, "lookup_miss").click()
    wait(driver).until(lambda d: "cause=lookup_miss" in d.current_url)
    shared = driver.current_url
    driver.get(shared)
    rows = driver.find_elements(By.CSS_SELECTOR, "table.operations tbody tr")
    assert len(rows) == BULK_ROWS, len(rows)
    assert "deploy-1" not in text(driver)


def test_a_held_operation_is_resolved_with_the_downstreams_receipt(
    driver: webdriver.Chrome, seeded: World, shots: Shots
) -> None:
    driver.get(f"{seeded.base}/ui/operations?q=deploy-1")
    driver.find_element(By.LINK_TEXT, "deploy-1").click()
    wait(driver).until(lambda d: "/ui/operations/" in d.current_url)
    assert "no_recovery" in text(driver)
    shots.take(driver, "operation", full=True)
    page = driver.current_url
    wrong = {"receipt_id": "rcpt-999", "idempotency_key": f"{NORTH}:someone-else"}
    driver.find_element(By.ID, "receipt").send_keys(json.dumps(wrong))
    driver.find_element(By.ID, "resolve-reason").send_keys("pasted from the deploy service")
    driver.find_element(By.CSS_SELECTOR, "button[value=resolve]").click()
    wait(driver).until(lambda d: "resolve refused" in text(d))
    assert "is for another operation" in text(driver)
    assert seeded.state(NORTH, "deploy-1") == "held"
    shots.take(driver, "operation-wrong-receipt")
    receipt = seeded.query(
        "SELECT receipt FROM downstream.mutations WHERE idem_key = %s", f"{NORTH}:deploy-1"
    )[0][0]
    driver.get(page)
    driver.find_element(By.ID, "receipt").send_keys(json.dumps(receipt))
    driver.find_element(By.ID, "resolve-reason").send_keys("the deploy service shows it ran")
    driver.find_element(By.CSS_SELECTOR, "button[value=resolve]").click()
    wait(driver).until(lambda d: "done=resolve" in d.current_url)
    assert "Resolved" in text(driver)
    assert "operator:alice" in text(driver)
    shots.take(driver, "operation-resolved")
    assert seeded.state(NORTH, "deploy-1") == "succeeded"
    driver.get(f"{seeded.base}/ui/operations?state=held&tool=deploy")
    assert "deploy-1" not in text(driver) and "deploy-s1" in text(driver)


def test_bulk_recheck_of_fifty_rows_shows_progress(
    driver: webdriver.Chrome, seeded: World, shots: Shots
) -> None:
    driver.get(f"{seeded.base}/ui/operations?cause=lookup_miss")
    driver.find_element(By.PARTIAL_LINK_TEXT, "Recheck or fail all of these").click()
    wait(driver).until(lambda d: "/ui/bulk" in d.current_url)
    assert f"{BULK_ROWS} unresolved operations match now" in text(driver)
    Select(driver.find_element(By.ID, "action")).select_by_value("recheck")
    driver.find_element(By.ID, "reason").send_keys(
        "the ticket service's reads are consistent again"
    )
    assert driver.find_element(By.ID, "cap").get_attribute("value") == str(BULK_ROWS)
    shots.take(driver, "bulk-dry-run")
    driver.find_element(By.CSS_SELECTOR, "form.bulk button[type=submit]").click()
    wait(driver).until(lambda d: "/ui/jobs/" in d.current_url)
    shots.take(driver, "bulk-job-started")
    job_url = driver.current_url
    # The page reloads itself every second while the job runs.
    reloading_wait(driver, 60).until(
        lambda d: d.find_element(By.CSS_SELECTOR, "p.job-status strong").text == "finished"
    )
    assert driver.find_element(By.ID, "done").text == str(BULK_ROWS)
    assert driver.find_element(By.ID, "skipped").text == "0"
    progress = driver.find_element(By.TAG_NAME, "progress")
    assert progress.get_attribute("value") == progress.get_attribute("max") == str(BULK_ROWS)
    shots.take(driver, "bulk-job-finished")
    # Progress lives in the ledger: a reload (any worker) shows the same.
    driver.get(job_url)
    assert driver.find_element(By.ID, "done").text == str(BULK_ROWS)
    done = seeded.query(
        "SELECT count(*) FROM operations WHERE tool = 'tickets' AND state = 'succeeded'"
    )
    assert done[0][0] == BULK_ROWS
    driver.get(f"{seeded.base}/ui/operations?cause=lookup_miss")
    assert "No operation matches" in text(driver)


def test_a_dead_letter_is_republished_after_its_tool_is_fixed(
    driver: webdriver.Chrome, seeded: World, shots: Shots
) -> None:
    driver.get(f"{seeded.base}/ui/dead-letters")
    wait(driver).until(lambda d: "ticket-fix-1" in text(d) or d.refresh())
    letter = driver.find_element(By.CSS_SELECTOR, "details.letter")
    letter.find_element(By.TAG_NAME, "summary").click()
    assert "unknown_tool" in letter.text and 'unknown tool "ticket2"' in letter.text
    shots.take(driver, "dead-letters")
    # The fix: the tool is configured and the worker restarted (the session survives it).
    seeded.restart_worker(fixed=True)
    driver.get(f"{seeded.base}/ui/dead-letters?reason=unknown_tool")
    letter = driver.find_element(By.CSS_SELECTOR, "details.letter")
    letter.find_element(By.TAG_NAME, "summary").click()
    form = letter.find_element(By.CSS_SELECTOR, "form:has(button.republish-one)")
    form.find_element(By.NAME, "note").send_keys("ticket2 is configured now")
    form.find_element(By.CSS_SELECTOR, "button.republish-one").click()
    wait(driver).until(lambda d: "republished" in text(d))
    shots.take(driver, "dead-letter-republished")
    seeded.wait_until(
        "the republished intent succeeded",
        lambda: seeded.state(NORTH, "ticket-fix-1") == "succeeded",
    )
    driver.get(f"{seeded.base}/ui/dead-letters")
    assert "ticket-fix-1" not in text(driver).split("Recent dead-letter actions")[0]
    assert "republish" in text(driver).split("Recent dead-letter actions")[1]


def test_hostile_strings_render_as_text(
    driver: webdriver.Chrome, seeded: World, shots: Shots
) -> None:
    driver.get(f"{seeded.base}/ui/operations?scope=all&q=alert")
    no_alert(driver)
    body = text(driver)
    assert SCRIPT_ID in body and IMG_ID in body, body
    assert not driver.find_elements(By.CSS_SELECTOR, "main img, main script, main svg")
    shots.take(driver, "hostile-list")
    driver.find_element(By.LINK_TEXT, IMG_ID).click()
    wait(driver).until(lambda d: "/ui/operations/" in d.current_url)
    no_alert(driver)
    body = text(driver)
    assert "\\x1b[1;31mdowngraded" in body, body
    assert "<img src=x onerror=alert(4)>" in body and "<script>alert(5)</script>" in body
    assert "\\u001b[31mred" in body
    assert "\u001b" not in driver.page_source
    assert not driver.find_elements(By.CSS_SELECTOR, "main img, main script")
    shots.take(driver, "hostile-operation")


def test_a_forged_post_without_the_csrf_token_is_refused(
    driver: webdriver.Chrome, seeded: World, shots: Shots
) -> None:
    target = seeded.op_id(SOUTH, "deploy-s1")
    cookie = driver.get_cookie("iw_session")
    assert cookie is not None
    # With the session cookie but without the form's token.
    request = urllib.request.Request(
        f"{seeded.base}/ui/operations/{target}/fail",
        data=b"evidence=forged+by+a+script+without+the+token&request_id=forged-1",
        headers={
            "Cookie": f"iw_session={cookie['value']}",
            "Content-Type": "application/x-www-form-urlencoded",
        },
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 403
    # From another site, the browser does not even send the cookie (SameSite=Strict).
    forged = (
        "data:text/html,<form method=post action='"
        f"{seeded.base}/ui/operations/{target}/fail'>"
        "<input name=evidence value='forged by another site'><input name=request_id value=f2>"
        "</form><script>document.forms[0].submit()</script>"
    )
    driver.get(forged)
    wait(driver).until(lambda d: "Signed out" in text(d) or "Refused" in text(d))
    shots.take(driver, "forged-post-refused")
    assert seeded.state(SOUTH, "deploy-s1") == "held"


def test_a_tenant_sees_only_its_tenant_and_no_action(
    driver: webdriver.Chrome, seeded: World, shots: Shots
) -> None:
    sign_in(driver, seeded, seeded.tenant_tokens[SOUTH])
    assert "tenant south-shop (read-only)" in text(driver)
    assert "workers ready" not in text(driver)
    driver.get(f"{seeded.base}/ui/operations?scope=all&tenant={NORTH}")
    body = text(driver)
    assert "deploy-s1" in body and "deploy-1" not in body and "ticket-00" not in body
    shots.take(driver, "tenant-operations")
    driver.find_element(By.LINK_TEXT, "deploy-s1").click()
    wait(driver).until(lambda d: "/ui/operations/" in d.current_url)
    assert not driver.find_elements(By.CSS_SELECTOR, "form.action")
    assert not driver.find_elements(By.LINK_TEXT, "Bulk jobs")
    shots.take(driver, "tenant-operation")
    driver.get(f"{seeded.base}/ui/operations/{seeded.op_id(NORTH, 'refund-1')}")
    assert "Not found" in text(driver)
    driver.get(f"{seeded.base}/ui/dead-letters")
    assert not driver.find_elements(By.CSS_SELECTOR, "details.letter, form.inline")
    _readme_images(shots)


def _post_from_the_page(driver: webdriver.Chrome, url: str, fields: dict[str, str]) -> int:
    """A script on the console's own page posting a form with fetch (the session cookie goes
    with it, as with any same-origin request): what a forgery that got into the page could do."""
    body = urllib.parse.urlencode(fields)
    status = driver.execute_async_script(
        """
        const done = arguments[arguments.length - 1];
        fetch(arguments[0], {
            method: "POST",
            headers: {"Content-Type": "application/x-www-form-urlencoded"},
            body: arguments[1],
            redirect: "manual",
        }).then((r) => done(r.status), (e) => done(String(e)));
        """,
        url,
        body,
    )
    return int(status)


def test_an_approver_approves_through_the_page(
    driver: webdriver.Chrome, seeded: World, shots: Shots
) -> None:
    action = "payout-1"
    args = {
        "amount_cents": 250000,
        "iban": "DE89370400440532013000",
        "note": "<script>alert(6)</script>\"'{}",
        "rtl": "\u202etxe.exe",
    }
    seeded.publish(NORTH, action, "payout", args)
    seeded.wait_until(
        f"{action} awaiting approval",
        lambda: seeded.state(NORTH, action) == "awaiting_approval",
    )
    fingerprint = seeded.query(
        "SELECT fingerprint FROM operations WHERE tenant = %s AND action_id = %s", NORTH, action
    )[0][0]
    # The approver signs in through the form, without a name: the token's is recorded.
    driver.get(f"{seeded.base}/ui/login")
    driver.delete_all_cookies()
    driver.get(f"{seeded.base}/ui/login")
    driver.find_element(By.ID, "token").send_keys(seeded.approver_tokens["alice"])
    driver.find_element(By.CSS_SELECTOR, "form button[type=submit]").click()
    wait(driver).until(lambda d: d.current_url.endswith("/ui/approvals"))
    assert "approver alice" in text(driver)
    nav = [a.text for a in driver.find_elements(By.CSS_SELECTOR, "header nav a")]
    assert nav == ["Approvals"], nav
    shots.take(driver, "approvals")
    driver.find_element(By.LINK_TEXT, action).click()
    wait(driver).until(lambda d: f"/ui/approvals/{NORTH}/{action}" in d.current_url)
    page = driver.current_url
    no_alert(driver)
    assert driver.find_element(By.ID, "fingerprint").text == fingerprint
    shown = driver.find_element(By.ID, "arguments").text
    assert '"note": "<script>alert(6)</script>\\"\'{}"' in shown, shown
    assert "\\u{202e}txe.exe" in shown and "\u202e" not in driver.page_source, shown
    assert '"amount_cents": 250000' in shown, shown
    assert not driver.find_elements(By.CSS_SELECTOR, "main script, main img")
    shots.take(driver, "approval", full=True)

    # A forged post without the CSRF token is refused, and nothing changes.
    forged = {
        "fingerprint": fingerprint,
        "reason": "forged by a script",
        "decision": "approve",
        "request_id": "forged-approval-1",
    }
    assert _post_from_the_page(driver, page, forged) == 403
    # A fingerprint that is not the one shown is refused with its reason.
    driver.execute_script(
        "document.querySelector('form.decision input[name=fingerprint]').value = arguments[0]",
        "0" * len(fingerprint),
    )
    driver.find_element(By.ID, "reason").send_keys("looks right")
    driver.find_element(By.CSS_SELECTOR, "button.approve").click()
    wait(driver).until(lambda d: "approve refused" in text(d))
    assert "fingerprint" in text(driver)
    shots.take(driver, "approval-wrong-fingerprint")
    assert seeded.state(NORTH, action) == "awaiting_approval"

    # Approved through the page's form: sent once, and the page shows it.
    driver.get(page)
    driver.find_element(By.ID, "reason").send_keys("the customer confirmed by phone")
    driver.find_element(By.CSS_SELECTOR, "button.approve").click()
    wait(driver).until(lambda d: "done=approve" in d.current_url)
    assert "Approved" in text(driver)
    seeded.wait_until("the payout sent", lambda: seeded.state(NORTH, action) == "succeeded")
    wait(driver).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, "h1 .state-succeeded") or d.refresh()
    )
    body = text(driver)
    assert "Approved, sent and succeeded" in body and "alice" in body, body
    assert not driver.find_elements(By.CSS_SELECTOR, "form.decision")
    shots.take(driver, "approval-approved")
    sent = seeded.query(
        "SELECT count(*) FROM downstream.mutations WHERE idem_key = %s", f"{NORTH}:{action}"
    )
    assert sent[0][0] == 1, sent
    actors = seeded.query(
        "SELECT actor FROM operation_history WHERE operation_id = %s", seeded.op_id(NORTH, action)
    )
    assert ("operator:alice",) in actors, actors
    # An approver's session opens nothing else.
    driver.get(f"{seeded.base}/ui/operations")
    assert "Approvers only approve" in text(driver) and "deploy-s1" not in text(driver)


def _readme_images(shots: Shots) -> None:
    """With CONSOLE_README_IMAGES=1, the two README screenshots are refreshed from this run."""
    if not os.environ.get("CONSOLE_README_IMAGES"):
        return
    images = REPO / "docs" / "images"
    images.mkdir(exist_ok=True)
    for name, shot in [
        ("console-operations.png", "operations-groups"),
        ("console-operation.png", "operation"),
    ]:
        found = sorted(Path(shots.dir).glob(f"*-{shot}.png"))
        assert found, shot
        shutil.copyfile(found[0], images / name)
