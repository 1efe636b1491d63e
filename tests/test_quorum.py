"""Two-person approval (SPEC section 25): `to: [a, b, c]`, `need: N` and `veto` on an approval. Each
addressee votes once (a deputy as the person they stand for), a refusal vetoes unless `veto: false`,
the first approval's edits stand (a later edit is 409 arguments_changed), events `approval_vote`, the
run shows `approval: {need, votes}`, the starter never votes, an operator's answer is one vote, and
listing by `to` finds the request under each addressee until it ends. Replies in a chat thread vote
as their sender.

End to end over HTTP on SQLite and PostgreSQL, with a real MCP tool server (tests/servers/ops_server.py)
and the example chat server; the page in a real Chromium.
"""
from __future__ import annotations

import pytest

import interactiond as itd
from daemon_kit import person_token, start_daemon
from test_approval import CHAT_RESTART, RESTART, calls, chat_server, ended, history, ops_config
from test_approval import served_ops  # noqa: F401  (a fixture)
from test_web_inbox import CHROMIUM, CHROMIUM_ARGS, _playwright

DEPLOY = RESTART.replace("  to: '{{ input.owner }}'\n", "  to: [ana, ben, cy]\n  need: 2\n").replace(
    "required: [service, owner]", "required: [service]")


@pytest.fixture
async def d(db, tmp_path, aiohttp_client):
    log = tmp_path / "ops-calls.jsonl"
    daemon = await start_daemon(aiohttp_client, db, config=ops_config(log))
    daemon.calls_log = log
    return daemon


def who(d, name: str) -> str:
    key = f"person:{name}"
    if key not in d.tokens:
        d.tokens[key] = person_token(d.db, name)
    return key


async def vote(d, run_id: str, name: str, body: dict) -> tuple[int, dict]:
    return await d.call("POST", f"/runs/{run_id}/answer", {"answer": body}, role=who(d, name))


async def deploy(d, source: str = DEPLOY, service: str = "web") -> str:
    await d.define("deploy", source)
    status, run = await d.run("deploy", {"service": service})
    assert status == 202, run
    return run["run_id"]


async def listed(d, to: str) -> list[str]:
    return [r["run_id"] for r in (await d.call("GET", f"/interactions?to={to}"))[1]["data"]]


async def test_two_of_three_approve_and_the_call_runs_once_with_both_votes_on_the_run(d):
    run_id = await deploy(d)
    for name in ("ana", "ben", "cy"):
        assert await listed(d, name) == [run_id]                       # under each addressee
        assert [r["run_id"] for r in (await d.call("GET", "/interactions", role=who(d, name)))[1]["data"]] == [run_id]
        assert [r["run_id"] for r in (await d.call("GET", "/v2/interactions", role=who(d, name)))[1]["data"]] == [run_id]
    [req] = (await d.call("GET", "/interactions"))[1]["data"]
    assert req["addressees"] == ["ana", "ben", "cy"]
    counts = await (await d.client.get("/web/orgs/local/playbooks/default/counts", headers=d.auth())).json()
    assert counts["total"] == 1 and counts["to"] == [{"to": p, "count": 1} for p in ("ana", "ben", "cy")], counts
    assert (req["approval"]["to"], req["approval"]["need"], req["approval"]["veto"], req["approval"]["votes"]) == \
        (["ana", "ben", "cy"], 2, True, [])
    status, fact = await vote(d, run_id, "ana", {"approved": True, "note": "ok by me"})
    assert status == 200 and fact["answered_by"] == "ana", fact
    run = (await d.call("GET", f"/runs/{run_id}"))[1]
    assert run["status"] == "waiting" and calls(d) == []
    assert run["approval"]["need"] == 2 and [(v["by"], v["approved"], v["note"]) for v in run["approval"]["votes"]] == \
        [("ana", True, "ok by me")]
    # The same vote again is the same fact and no second vote; another from ana is refused.
    assert await vote(d, run_id, "ana", {"approved": True, "note": "ok by me"}) == (200, fact)
    status, problem = await vote(d, run_id, "ana", {"approved": False})
    assert status == 409 and problem["kind"] == "answered"
    assert await listed(d, "cy") == [run_id]                             # still open for the rest
    status, fact = await vote(d, run_id, "ben", {"approved": True})
    assert status == 200 and fact["answered_by"] == "ben"
    status, run = await ended(d, run_id)
    assert status == 200 and run["status"] == "succeeded", run
    assert calls(d) == [{"tool": "restart_service", "arguments": {"service": "web", "force": False}}]
    assert [v["by"] for v in run["approval"]["votes"]] == ["ana", "ben"] and run["output"] == "restarted web"
    events = await history(d, run_id)
    assert [(e["type"], e["payload"].get("by")) for e in events if e["type"].startswith("approval_")] == [
        ("approval_requested", None), ("approval_vote", "ana"), ("approval_vote", "ben"), ("approval_answered", "ben")]
    assert await listed(d, "cy") == []
    status, problem = await vote(d, run_id, "cy", {"approved": False})
    assert status == 409


async def test_a_refusal_vetoes_unless_veto_is_false(d):
    run_id = await deploy(d)
    assert (await vote(d, run_id, "ana", {"approved": True}))[0] == 200
    assert (await vote(d, run_id, "cy", {"approved": False, "note": "not on a Friday"}))[0] == 200
    status, run = await d.call("POST", f"/runs/{run_id}/wait?timeout=5")
    assert status == 410 and run["kind"] == "declined" and "not on a Friday" in run["problem"]["detail"], run
    assert [(v["by"], v["approved"]) for v in run["approval"]["votes"]] == [("ana", True), ("cy", False)]
    # veto: false - a refusal only fails to approve; too few left to approve ends it declined.
    lenient = await deploy(d, DEPLOY.replace("need: 2", "need: 2\n  veto: false"), service="api")
    assert (await vote(d, lenient, "cy", {"approved": False}))[0] == 200
    assert (await d.call("GET", f"/runs/{lenient}"))[1]["status"] == "waiting"
    assert (await vote(d, lenient, "ana", {"approved": True}))[0] == 200
    assert (await d.call("GET", f"/runs/{lenient}"))[1]["status"] == "waiting"
    assert (await vote(d, lenient, "ben", {"approved": True}))[0] == 200
    status, run = await ended(d, lenient)
    assert status == 200 and run["status"] == "succeeded", run
    hopeless = await deploy(d, DEPLOY.replace("need: 2", "need: 2\n  veto: false"), service="db")
    assert (await vote(d, hopeless, "cy", {"approved": False}))[0] == 200
    assert (await vote(d, hopeless, "ben", {"approved": False}))[0] == 200
    status, run = await d.call("POST", f"/runs/{hopeless}/wait?timeout=5")
    assert status == 410 and run["kind"] == "declined" and "cannot have the 2 approvals" in run["problem"]["detail"]
    await d.advance("PT1M")
    assert [c["arguments"]["service"] for c in calls(d)] == ["api"]


async def test_the_first_approvals_edits_stand_and_a_later_edit_is_refused(d):
    run_id = await deploy(d)
    [req] = (await d.call("GET", "/interactions"))[1]["data"]
    status, _ = await vote(d, run_id, "ana", {"approved": True, "arguments": {"service": "api", "force": True}})
    assert status == 200
    [shown] = (await d.call("GET", "/interactions"))[1]["data"]
    assert shown["approval"]["arguments"] == {"service": "api", "force": True}
    assert shown["digest"] != req["digest"]                          # what it shows changed
    # ben's page still showed the old arguments: his answer with its digest is refused.
    status, problem = await d.call("POST", f"/runs/{run_id}/answer", {"answer": {"approved": True}, "digest": req["digest"]},
                                   role=who(d, "ben"))
    assert status == 409 and problem["type"] == "/problems/digest_mismatch"
    status, problem = await vote(d, run_id, "ben", {"approved": True, "arguments": {"service": "db", "force": True}})
    assert status == 409 and problem["type"] == "/problems/arguments_changed", problem
    status, _ = await d.call("POST", f"/runs/{run_id}/answer",
                             {"answer": {"approved": True, "arguments": {"service": "api", "force": True}},
                              "digest": shown["digest"]}, role=who(d, "ben"))
    assert status == 200
    status, run = await ended(d, run_id)
    assert status == 200 and calls(d) == [{"tool": "restart_service", "arguments": {"service": "api", "force": True}}]
    events = {e["type"]: e["payload"] for e in await history(d, run_id)}
    assert events["approval_answered"]["arguments_digest"] == events["tool_call_started"]["arguments_digest"] \
        == itd.arguments_digest({"service": "api", "force": True})
    assert events["approval_answered"]["patch"] == [{"op": "replace", "path": "/service", "value": "api"},
                                                    {"op": "replace", "path": "/force", "value": True}]


async def test_the_starter_never_votes_an_operator_is_one_vote_and_a_deputy_counts_once(d):
    await d.define("deploy", DEPLOY)
    status, run = await d.call("POST", "/runs", {"type": "interaction", "name": "deploy", "input": {"service": "web"}},
                               role="writer")
    assert status == 202, run
    run_id = run["run_id"]
    status, problem = await d.call("POST", f"/runs/{run_id}/answer", {"answer": {"approved": True}}, role="writer")
    assert status == 403 and problem["type"] == "/problems/approval_not_yours"
    # An operator's answer is one vote, under the token, never all of them.
    status, fact = await d.call("POST", f"/runs/{run_id}/answer", {"answer": {"approved": True}})
    assert status == 200
    assert (await d.call("GET", f"/runs/{run_id}"))[1]["status"] == "waiting"
    # A deputy of ben votes as ben; ben himself then votes no more.
    assert (await d.call("POST", "/deputies", {"for": "ben", "to": "dan"}))[0] == 201
    assert (await d.call("POST", "/deputies", {"for": "cy", "to": "dan"}))[0] == 201
    status, fact = await vote(d, run_id, "dan", {"approved": True})
    assert status == 200 and fact["on_behalf_of"] in ("ben", "cy"), fact
    status, run = await ended(d, run_id)
    assert status == 200 and run["status"] == "succeeded", run
    votes = run["approval"]["votes"]
    assert len(votes) == 2 and votes[1]["by"] == "dan" and votes[1]["on_behalf_of"] in ("ben", "cy")


async def test_a_quorum_on_execute_and_its_bad_shapes(d):
    status, run = await d.call("POST", "/tools/ops/restart_service",
                               {"arguments": {"service": "web"}, "approve": {"to": ["ana", "ben"], "need": 2}})
    assert status == 202, run
    for body, pointer in (({"to": ["ana", "ben"], "need": 3}, "/approve/need"),
                          ({"to": ["ana", ""], "need": 1}, "/approve/to/1"),
                          ({"to": "ana", "need": 2}, "/approve/need"),
                          ({"to": ["ana", "ben"], "veto": "no"}, "/approve/veto")):
        status, problem = await d.call("POST", "/tools/ops/restart_service", {"arguments": {"service": "web"}, "approve": body})
        assert status == 422 and pointer in [e["pointer"] for e in problem["errors"]], (body, problem)
    assert (await vote(d, run["run_id"], "ben", {"approved": True}))[0] == 200
    assert (await vote(d, run["run_id"], "ana", {"approved": True}))[0] == 200
    status, done = await ended(d, run["run_id"])
    assert status == 200 and [v["by"] for v in done["approval"]["votes"]] == ["ben", "ana"]


async def test_a_document_with_a_bad_quorum_is_refused_with_its_line(d):
    status, body = await d.call("POST", "/definitions", {"type": "interaction", "name": "bad",
                                                         "source": DEPLOY.replace("need: 2", "need: 4")})
    assert status == 422 and [e["field"] for e in body["errors"]] == ["approve.need"], body
    assert body["errors"][0]["line"] == 6


async def test_replies_in_the_thread_vote_as_their_sender(db, tmp_path, aiohttp_client):
    log, chat_db = tmp_path / "ops-calls.jsonl", str(tmp_path / "chat.db")
    d = await start_daemon(aiohttp_client, db, config=ops_config(log, chat_db=chat_db))
    d.calls_log = log
    await d.define("restart", CHAT_RESTART.replace("  to: '{{ input.owner }}'\n", "  to: [ana, ben]\n  need: 2\n"))
    status, run = await d.run("restart", {"service": "web", "owner": "ana"})
    assert status == 202, run
    run_id = run["run_id"]
    await d.advance("PT0S")                                  # the delivery is due at once
    [posted] = chat_server.messages(chat_db, "ops")
    chat_server.say(chat_db, "ops", "ana", "approve looks fine", thread_ts=posted["ts"])
    await d.advance("PT30S")
    run = (await d.call("GET", f"/runs/{run_id}"))[1]
    assert run["status"] == "waiting" and [v["by"] for v in run["approval"]["votes"]] == ["ana"], run
    chat_server.say(chat_db, "ops", "ana", "reject", thread_ts=posted["ts"])           # ana again: told, not counted
    chat_server.say(chat_db, "ops", "ben", "approve go", thread_ts=posted["ts"])
    await d.advance("PT1M")
    status, run = await ended(d, run_id)
    assert status == 200 and run["status"] == "succeeded", run
    assert [(v["by"], v["note"]) for v in run["approval"]["votes"]] == [("ana", "looks fine"), ("ben", "go")]
    assert calls(d) == [{"tool": "restart_service", "arguments": {"service": "web"}}]
    told = [m["text"] for m in chat_server.messages(chat_db, "ops") if m["user"] == "interactiond" and m["thread_ts"]]
    assert any("voted on this approval already" in t for t in told), told


async def test_the_guides_two_person_deploy_with_a_deputy(d):
    """docs/teams.md's function, as the guide tells it: Dan stands in for Ana, Ben approves too."""
    from pathlib import Path
    guide = (Path(__file__).resolve().parent.parent / "docs" / "teams.md").read_text()
    source = guide.split("```yaml\n", 1)[1].split("```", 1)[0]
    await d.define("deploy", source)
    status, run = await d.run("deploy", {"service": "web"})
    assert status == 202, run
    run_id = run["run_id"]
    await d.advance("PT1H")
    now = (await d.call("GET", f"/runs/{run_id}"))[1]["created_at"]
    status, dep = await d.call("POST", "/deputies", {"for": "ana", "to": "dan", "from": now, "until": "2099-01-01T00:00:00Z"})
    assert status == 201 and dep["open"], dep
    [item] = (await d.call("GET", "/interactions", role=who(d, "dan")))[1]["data"]
    status, fact = await d.call("POST", f"/runs/{run_id}/answer", {"answer": {"approved": True, "note": "for ana"},
                                                                  "digest": item["digest"]}, role=who(d, "dan"))
    assert status == 200 and (fact["answered_by"], fact["on_behalf_of"]) == ("dan", "ana"), fact
    assert (await vote(d, run_id, "ana", {"approved": True}))[0] == 409       # counted once
    assert (await vote(d, run_id, "ben", {"approved": True}))[0] == 200
    status, run = await ended(d, run_id)
    assert status == 200 and run["status"] == "succeeded", run
    assert [(v["by"], v.get("on_behalf_of")) for v in run["approval"]["votes"]] == [("dan", "ana"), ("ben", None)]
    events = {e["type"]: e["payload"] for e in await history(d, run_id)}
    assert events["approval_answered"]["arguments_digest"] == events["tool_call_started"]["arguments_digest"]


def test_the_page_shows_who_has_voted_and_redraws_what_the_first_approver_changed(served_ops, tmp_path):
    import json
    from test_people_page import link_for
    served = served_ops
    sync_api = _playwright()
    expect = sync_api.expect
    expect.set_options(timeout=10_000)
    served.define("deploy", RESTART.replace("  to: '{{ input.owner }}'\n", "  to: [ana, ben]\n  need: 2\n")
                  .replace("edit: [/service, /force]", "edit: [/service]"))
    run_id = served.run("deploy", {"service": "web", "owner": "ana"})
    db = tmp_path / "inbox.db"
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            ben = browser.new_context(viewport={"width": 1000, "height": 900}).new_page()
            broken: list[str] = []
            ben.on("pageerror", lambda exc: broken.append(str(exc)))
            ben.goto(link_for(db, "ben"))
            ben_item = ben.locator(f'li[data-run-id="{run_id}"]')
            expect(ben_item.locator(".votes")).to_have_text("Needs 2 of ana, ben; one refusal refuses it. No votes yet.")
            expect(ben_item.locator("h2 .to")).to_have_text("for ana and ben")
            ana = browser.new_context(viewport={"width": 1000, "height": 900}).new_page()
            ana.goto(link_for(db, "ana"))
            ana_item = ana.locator(f'li[data-run-id="{run_id}"]')
            ana_item.get_by_label("service (may change)").fill("api")
            ana_item.get_by_role("button", name="Approve").click()
            expect(ana_item).to_have_count(0)
            # Ben's page hears of the vote, and draws the call again as ana left it, with its votes.
            expect(ben_item.locator(".votes")).to_contain_text("Voted: ana approved.")
            expect(ben_item.get_by_label("service (may change)")).to_have_value("api")
            ben_item.get_by_role("button", name="Approve").click()
            expect(ben_item).to_have_count(0)
            status, run = served.call("POST", f"/runs/{run_id}/wait?timeout=10")
            assert status == 200 and run["output"] == "restarted api", run
            assert [v["by"] for v in run["approval"]["votes"]] == ["ana", "ben"]
            assert [json.loads(x) for x in served.calls_log.read_text().splitlines()] == [
                {"tool": "restart_service", "arguments": {"service": "api", "force": False}}]
            assert broken == []
        finally:
            browser.close()


async def test_the_operators_gate_may_need_two(db, tmp_path, aiohttp_client):
    log = tmp_path / "ops-calls.jsonl"
    policy = itd.ApprovalPolicy(("restart_service",), "ana", itd.parse_duration("PT1H"), ("ben",), 2)
    d = await start_daemon(aiohttp_client, db, config=ops_config(log, policy=policy))
    d.calls_log = log
    status, run = await d.call("POST", "/tools/ops/restart_service", {"arguments": {"service": "web"}})
    assert status == 202, run
    assert (await vote(d, run["run_id"], "ana", {"approved": True}))[0] == 200
    assert (await d.call("GET", f"/runs/{run['run_id']}"))[1]["status"] == "waiting" and calls(d) == []
    assert (await vote(d, run["run_id"], "ben", {"approved": True}))[0] == 200
    status, done = await ended(d, run["run_id"])
    assert status == 200 and calls(d) == [{"tool": "restart_service", "arguments": {"service": "web"}}]
    # In the configuration: to as a list, need and veto, each checked with its key path.
    config = {"servers": {"ops": {"command": ["python", "ops.py"], "approve": {
        "tools": ["restart_service"], "to": ["ana", "ben"], "need": 2, "veto": False}}}}
    path = tmp_path / "c.yaml"
    path.write_text(itd.dumps(config))
    loaded = itd.load_config(str(path), environ={})
    assert loaded.servers["ops"].approve == itd.ApprovalPolicy(("restart_service",), "ana", itd.parse_duration("P1D"),
                                                               ("ben",), 2, False)
    config["servers"]["ops"]["approve"]["need"] = 3
    path.write_text(itd.dumps(config))
    with pytest.raises(Exception) as refused:
        itd.load_config(str(path), environ={})
    assert "servers.ops.approve.need" in str(refused.value)


async def test_each_addressee_has_their_own_answer_link_and_votes_as_themselves_with_it(d):
    run_id = await deploy(d)
    links = {}
    for name in ("ana", "ben", "cy"):
        [item] = (await d.call("GET", "/interactions", role=who(d, name)))[1]["data"]
        links[name] = "/a/" + item["answer_url"].rsplit("/a/", 1)[1]
    assert links["ana"] != links["ben"]
    page = await d.client.get(links["ben"])
    assert 'id="votes">Needs 2 of ana, ben, cy; one refusal refuses it. No votes yet.<' in await page.text()
    for name in ("ana", "ben"):
        resp = await d.client.post(links[name], json={"answer": {"approved": True}})
        fact = await resp.json()
        assert resp.status == 200 and fact["answered_by"] == name, fact
        if name == "ana":
            page = await d.client.get(links["cy"])
            assert "Voted: ana approved.</p>" in await page.text()
    status, run = await ended(d, run_id)
    assert status == 200 and [v["by"] for v in run["approval"]["votes"]] == ["ana", "ben"], run


async def ask(d, input_: dict, role: str = "operator") -> tuple[int, dict]:
    return await d.call("POST", "/runs", {"type": "interaction", "name": "ask-approval", "input": input_}, role=role)


async def test_an_approval_ask_of_three_needs_two_and_reminds_only_those_who_have_not_voted(d):
    status, run = await ask(d, {"prompt": "Ship **2.4** today?", "to": ["ana", "ben", "cy"], "need": 2,
                                "remind_after": ["PT1H", "PT2H"], "expires": "PT4H"}, role="writer")
    assert status == 202 and run["status"] == "started", run
    run_id = run["run_id"]
    for name in ("ana", "ben", "cy"):
        assert await listed(d, name) == [run_id]
        [mine] = (await d.call("GET", "/interactions", role=who(d, name)))[1]["data"]
        assert mine["answer_url"]
    [req] = (await d.call("GET", "/interactions"))[1]["data"]
    assert req["addressees"] == ["ana", "ben", "cy"] and req["to"] == "ana"
    assert req["approval"] == {"to": ["ana", "ben", "cy"], "need": 2, "veto": True, "votes": []}
    # The starter never votes; a writer's token that is nobody's is not an addressee either.
    status, problem = await d.call("POST", f"/runs/{run_id}/answer", {"answer": {"approved": True}}, role="writer")
    assert status == 403 and problem["type"] == "/problems/approval_not_yours", problem
    status, fact = await vote(d, run_id, "ben", {"approved": True, "comment": "tests are green"})
    assert status == 200 and fact["answered_by"] == "ben", fact
    assert await vote(d, run_id, "ben", {"approved": True, "comment": "tests are green"}) == (200, fact)
    assert (await vote(d, run_id, "ben", {"approved": False}))[0] == 409
    run = (await d.call("GET", f"/runs/{run_id}"))[1]
    assert run["status"] == "waiting" and run["approval"]["votes"][0]["note"] == "tests are green", run
    # The reminder is for the addressees who have not voted: not ben.
    await d.advance("PT1H")
    [reminded] = [e for e in await history(d, run_id) if e["type"] == "request_reminded"]
    assert reminded["payload"]["n"] == 1 and reminded["payload"]["to"] == ["ana", "cy"], reminded
    status, fact = await vote(d, run_id, "cy", {"approved": True})
    assert status == 200
    status, run = await d.call("POST", f"/runs/{run_id}/wait?timeout=5")
    assert status == 200 and run["status"] == "succeeded" and run["output"] == {"approved": True}, run
    assert [(v["by"], v["approved"], v["note"]) for v in run["approval"]["votes"]] == [
        ("ben", True, "tests are green"), ("cy", True, None)]
    assert (run["approval"]["to"], run["approval"]["need"], run["approval"]["veto"]) == (["ana", "ben", "cy"], 2, True)
    events = await history(d, run_id)
    assert [(e["type"], e["payload"].get("by")) for e in events if e["type"] == "approval_vote"] == [
        ("approval_vote", "ben"), ("approval_vote", "cy")]
    assert [e["payload"]["answer"] for e in events if e["type"] == "request_answered"] == [{"approved": True}]
    await d.advance("PT2H")                                   # an ended request is reminded no more
    assert len([e for e in await history(d, run_id) if e["type"] == "request_reminded"]) == 1
    for name in ("ana", "ben", "cy"):
        assert await listed(d, name) == []
    assert (await vote(d, run_id, "ana", {"approved": False}))[0] == 409


async def test_an_approval_ask_is_vetoed_by_one_refusal_unless_veto_is_false(d):
    status, run = await ask(d, {"prompt": "Rotate the keys?", "to": ["ana", "ben"], "need": 2})
    assert status == 202, run
    assert (await vote(d, run["run_id"], "ana", {"approved": True}))[0] == 200
    assert (await vote(d, run["run_id"], "ben", {"approved": False, "comment": "not during the freeze"}))[0] == 200
    status, done = await d.call("POST", f"/runs/{run['run_id']}/wait?timeout=5")
    assert status == 200 and done["output"] == {"approved": False, "comment": "not during the freeze"}, done
    assert [(v["by"], v["approved"]) for v in done["approval"]["votes"]] == [("ana", True), ("ben", False)]
    status, run = await ask(d, {"prompt": "Rotate the keys?", "to": ["ana", "ben", "cy"], "need": 1, "veto": False})
    assert (await vote(d, run["run_id"], "ana", {"approved": False}))[0] == 200
    assert (await d.call("GET", f"/runs/{run['run_id']}"))[1]["status"] == "waiting"
    assert (await vote(d, run["run_id"], "cy", {"approved": True}))[0] == 200
    status, done = await d.call("POST", f"/runs/{run['run_id']}/wait?timeout=5")
    assert status == 200 and done["output"] == {"approved": True}, done


async def test_an_approval_ask_with_a_bad_quorum_ends_invalid_input_with_its_pointer(d):
    for input_, pointer in (({"to": ["ana", "ben"], "need": 3}, "/input/need"),
                            ({"to": ["ana", ""]}, "/input/to/1"),
                            ({"to": "ana", "need": 2}, "/input/need"),
                            ({"to": ["ana", "ben"], "veto": "no"}, "/input/veto")):
        status, run = await ask(d, {"prompt": "Ship?", **input_})
        assert status == 422 and run["status"] == "invalid_input", (input_, run)
        assert pointer in [e["pointer"] for e in run["problem"]["errors"]], (input_, run)
    status, run = await d.call("POST", "/runs", {"type": "interaction", "name": "ask-text",
                                                 "input": {"prompt": "Why?", "to": ["ana", "ben"]}})
    assert run["status"] == "invalid_input", run
    # One person, as ever: no quorum, anyone with a writer's token answers.
    status, run = await ask(d, {"prompt": "Ship?", "to": "ana"})
    [req] = [r for r in (await d.call("GET", "/interactions"))[1]["data"] if r["run_id"] == run["run_id"]]
    assert req["approval"] is None and req["addressees"] == ["ana"]
    assert (await d.call("POST", f"/runs/{run['run_id']}/answer", {"answer": {"approved": True}}, role="writer"))[0] == 200


async def test_the_mcp_ask_tool_asks_a_quorum(d):
    from test_mcp import connect
    async with connect(d, "http") as c:
        r = await c.call_tool("ask", {"type": "approval", "prompt": "Ship it?", "to": ["ana", "ben"], "need": 2,
                                      "veto": False})
        assert not r.is_error, r.structured_content
        run_id = r.structured_content["run_id"]
        [item] = (await c.call_tool("list_interactions", {"to": "ben"})).structured_content["data"]
        assert item["run_id"] == run_id and item["approval"]["need"] == 2 and item["approval"]["veto"] is False
        r = await c.call_tool("ask", {"type": "approval", "prompt": "Ship it?", "to": ["ana"], "need": 2})
        assert r.is_error and r.structured_content["problem"]["errors"][0]["pointer"] == "/input/need", r
    assert (await vote(d, run_id, "ana", {"approved": True}))[0] == 200
    assert (await vote(d, run_id, "ben", {"approved": True}))[0] == 200
    status, run = await d.call("POST", f"/runs/{run_id}/wait?timeout=5")
    assert status == 200 and [v["by"] for v in run["approval"]["votes"]] == ["ana", "ben"], run


async def test_an_approval_ask_of_two_over_v2_each_responds_once(d):
    status, run = await ask(d, {"prompt": "Ship it?", "to": ["ana", "ben"], "need": 2})
    assert status == 202, run
    [x] = (await d.call("GET", f"/v2/interactions?run_id={run['run_id']}", role=who(d, "ana")))[1]["data"]
    responses = []
    for name in ("ana", "ben"):
        resp = await d.client.post(f"/v2/interactions/{x['id']}/responses", json={"type": "approval", "approved": True},
                                   headers={**d.auth(who(d, name)), "Idempotency-Key": f"k-{name}"})
        responses.append((resp.status, await resp.json()))
    assert [s for s, _ in responses] == [200, 200], responses
    status, done = await d.call("POST", f"/runs/{run['run_id']}/wait?timeout=5")
    assert status == 200 and done["output"] == {"approved": True} and \
        [v["by"] for v in done["approval"]["votes"]] == ["ana", "ben"], done


async def test_once_a_quorum_has_ended_only_a_voter_s_own_answer_again_is_its_fact(d):
    """The same answer again by the same person is the same fact; by someone who had not voted, 409 -
    even when it is the answer that decided it."""
    run_id = await deploy(d)
    _, ana = await vote(d, run_id, "ana", {"approved": True, "note": "ok"})
    _, ben = await vote(d, run_id, "ben", {"approved": True})
    status, run = await ended(d, run_id)
    assert status == 200 and run["status"] == "succeeded", run
    status, problem = await vote(d, run_id, "cy", {"approved": True})               # the deciding answer, by cy
    assert status == 409 and problem["type"] == "/problems/not_open" and "before cy voted" in problem["detail"], problem
    assert await vote(d, run_id, "ben", {"approved": True}) == (200, ben)           # the decider's retry
    assert await vote(d, run_id, "ana", {"approved": True, "note": "ok"}) == (200, ana)  # an earlier voter's
    status, problem = await vote(d, run_id, "ana", {"approved": True})
    assert status == 409 and problem["type"] == "/problems/answered", problem
    assert [v["by"] for v in (await d.call("GET", f"/runs/{run_id}"))[1]["approval"]["votes"]] == ["ana", "ben"]
    # Vetoed: the refusal again by another is refused; the approver's own vote again is still hers.
    vetoed = await deploy(d, service="api")
    _, ana = await vote(d, vetoed, "ana", {"approved": True})
    _, cy = await vote(d, vetoed, "cy", {"approved": False})
    assert (await vote(d, vetoed, "ben", {"approved": False}))[0] == 409
    assert await vote(d, vetoed, "ana", {"approved": True}) == (200, ana)
    assert await vote(d, vetoed, "cy", {"approved": False}) == (200, cy)
    # An approval ask, and a deputy's vote counted as the person they stood for.
    status, run = await ask(d, {"prompt": "Ship?", "to": ["ana", "ben", "cy"], "need": 2})
    assert status == 202, run
    assert (await d.call("POST", "/deputies", {"for": "ben", "to": "dan"}))[0] == 201
    _, ana = await vote(d, run["run_id"], "ana", {"approved": True})
    _, dan = await vote(d, run["run_id"], "dan", {"approved": True})
    assert dan["on_behalf_of"] == "ben", dan
    status, problem = await vote(d, run["run_id"], "cy", {"approved": True})
    assert status == 409 and problem["type"] == "/problems/not_open", problem
    assert (await vote(d, run["run_id"], "ben", {"approved": True}))[0] == 200      # counted as dan's vote for him
    assert await vote(d, run["run_id"], "dan", {"approved": True}) == (200, dan)
    assert await vote(d, run["run_id"], "ana", {"approved": True}) == (200, ana)


REMINDED = DEPLOY.replace("  need: 2\n", "  need: 2\n  remind: {after: [PT30M, PT1H], message: 'Still waiting: {{ input.service }}'}\n")


async def test_a_quorums_escalation_names_who_has_not_voted_and_its_person_votes_once(d):
    status, run = await ask(d, {"prompt": "Pay the invoice?", "to": ["ana", "ben", "cy"], "need": 2,
                                "escalate_to": "boss", "escalate_after": "PT1H", "expires": "PT4H"}, role="writer")
    assert status == 202, run
    run_id = run["run_id"]
    assert (await vote(d, run_id, "ben", {"approved": True}))[0] == 200
    assert await listed(d, "boss") == []
    await d.advance("PT1H")
    [escalated] = [e for e in await history(d, run_id) if e["type"] == "request_escalated"]
    assert escalated["payload"]["to"] == "boss" and escalated["payload"]["waiting_on"] == ["ana", "cy"], escalated
    assert await listed(d, "boss") == [run_id]
    status, fact = await vote(d, run_id, "boss", {"approved": True, "comment": "approved for ana"})
    assert status == 200 and fact["answered_by"] == "boss", fact
    status, run = await d.call("POST", f"/runs/{run_id}/wait?timeout=5")
    assert status == 200 and run["status"] == "succeeded", run
    assert [(v["by"], v["approved"]) for v in run["approval"]["votes"]] == [("ben", True), ("boss", True)]
    assert (await vote(d, run_id, "boss", {"approved": False}))[0] == 409


async def test_a_gated_calls_quorum_reminds_only_those_who_have_not_voted(d):
    run_id = await deploy(d, REMINDED)
    events = await history(d, run_id)
    [requested] = [e for e in events if e["type"] == "interaction_requested"]
    assert len(requested["payload"]["reminds_at"]) == 2, requested
    assert (await vote(d, run_id, "ana", {"approved": True}))[0] == 200
    await d.advance("PT30M")
    [reminded] = [e for e in await history(d, run_id) if e["type"] == "request_reminded"]
    assert (reminded["payload"]["n"], reminded["payload"]["to"], reminded["payload"]["message"]) == \
        (1, ["ben", "cy"], "Still waiting: web"), reminded
    assert (await vote(d, run_id, "cy", {"approved": True}))[0] == 200       # decided: no more reminders
    status, run = await ended(d, run_id)
    assert status == 200 and run["status"] == "succeeded", run
    await d.advance("PT1H")
    assert len([e for e in await history(d, run_id) if e["type"] == "request_reminded"]) == 1


async def test_the_operators_gate_reminds_those_who_have_not_voted(db, tmp_path, aiohttp_client):
    log = tmp_path / "ops-calls.jsonl"
    policy = itd.ApprovalPolicy(("restart_service",), "ana", itd.parse_duration("PT1H"), ("ben", "cy"), 2,
                                remind=(itd.parse_duration("PT20M"), itd.parse_duration("PT40M")))
    d = await start_daemon(aiohttp_client, db, config=ops_config(log, policy=policy))
    d.calls_log = log
    status, run = await d.call("POST", "/tools/ops/restart_service", {"arguments": {"service": "web"}})
    assert status == 202, run
    assert (await vote(d, run["run_id"], "ben", {"approved": True}))[0] == 200
    await d.advance("PT20M")
    assert (await vote(d, run["run_id"], "ana", {"approved": True}))[0] == 200
    await d.advance("PT20M")
    reminders = [e["payload"] for e in await history(d, run["run_id"]) if e["type"] == "request_reminded"]
    assert [(p["n"], p["to"], p["message"]) for p in reminders] == [
        (1, ["ana", "cy"], itd.DEFAULT_REMINDER)], reminders          # the second came after the vote ended
    # A function's own approve.remind gives way to the operator's gate, as its to and expires do.
    await d.define("deploy", REMINDED)
    run_id = (await d.run("deploy", {"service": "api"}))[1]["run_id"]
    await d.advance("PT20M")
    [reminded] = [e["payload"] for e in await history(d, run_id) if e["type"] == "request_reminded"]
    assert (reminded["to"], reminded["message"]) == (["ana", "ben", "cy"], itd.DEFAULT_REMINDER), reminded
    # In the configuration: remind with after and message, checked with its key path.
    config = {"servers": {"ops": {"command": ["python", "ops.py"], "approve": {
        "tools": ["restart_service"], "to": ["ana", "ben"], "need": 2, "expires": "PT2H",
        "remind": {"after": ["PT30M", "PT1H"], "message": "Still waiting"}}}}}
    path = tmp_path / "c.yaml"
    path.write_text(itd.dumps(config))
    loaded = itd.load_config(str(path), environ={}).servers["ops"].approve
    assert (loaded.remind, loaded.remind_message) == ((itd.parse_duration("PT30M"), itd.parse_duration("PT1H")),
                                                      "Still waiting")
    for remind, where in (({"after": ["PT1H", "PT30M"]}, "remind.after.1"), ({"after": ["PT2H"]}, "remind.after.0"),
                          ({"after": ["soon"]}, "remind.after.0"), ({"after": ["PT1H"], "say": "x"}, "remind.say"),
                          (["PT1H"], "remind:"), ({"after": ["PT1H"], "message": ""}, "remind.message")):
        config["servers"]["ops"]["approve"]["remind"] = remind
        path.write_text(itd.dumps(config))
        with pytest.raises(itd.ConfigError) as refused:
            itd.load_config(str(path), environ={})
        assert f"servers.ops.approve.{where}" in str(refused.value), (remind, refused.value)


async def test_a_bad_approve_remind_is_refused_with_its_line(d):
    for source, field, line in (
            (REMINDED.replace("[PT30M, PT1H]", "[PT1H, PT30M]"), "approve.remind.after.1", 7),
            (REMINDED.replace("[PT30M, PT1H]", "[PT30M, PT5H]"), "approve.remind.after.1", 7),
            (REMINDED.replace("after: [PT30M, PT1H]", "afterwards: [PT30M]"), "approve.remind.afterwards", 7),
            (REMINDED.replace("Still waiting: {{ input.service }}", "{{ input.nothing }}"), "approve.remind.message", 7)):
        status, body = await d.call("POST", "/definitions", {"type": "interaction", "name": "bad", "source": source})
        assert status == 422 and field in [e["field"] for e in body["errors"]], (field, body)
        assert [e["line"] for e in body["errors"] if e["field"] == field] == [line], body
    # remind beside approve, at the top: it says where it goes.
    source = DEPLOY.replace("approve:\n", "remind: {after: [PT1H]}\napprove:\n")
    status, body = await d.call("POST", "/definitions", {"type": "interaction", "name": "bad", "source": source})
    assert status == 422 and body["errors"][0]["field"] == "remind" and "approve.remind" in body["errors"][0]["message"]
    # A delivered approval reminds in its thread: it needs replies.tell.
    chat = CHAT_RESTART.replace("  expires: PT2H\n", "  expires: PT2H\n  remind: {after: [PT1H]}\n")
    assert (await d.call("POST", "/definitions", {"type": "interaction", "name": "ok", "source": chat}))[0] in (200, 201)
    untold = chat.split("    tell:\n")[0] + "input:" + chat.split("\ninput:", 1)[1]
    status, body = await d.call("POST", "/definitions", {"type": "interaction", "name": "bad", "source": untold})
    assert status == 422 and "replies.tell" in body["errors"][0]["message"], body


async def test_a_delivered_quorum_is_reminded_in_its_thread(db, tmp_path, aiohttp_client):
    log, chat_db = tmp_path / "ops-calls.jsonl", str(tmp_path / "chat.db")
    d = await start_daemon(aiohttp_client, db, config=ops_config(log, chat_db=chat_db))
    d.calls_log = log
    await d.define("restart", CHAT_RESTART.replace("  to: '{{ input.owner }}'\n", "  to: [ana, ben]\n  need: 2\n"
                                                   "  remind: {after: [PT1H], message: 'Two of you, please'}\n"))
    status, run = await d.run("restart", {"service": "web", "owner": "ana"})
    assert status == 202, run
    await d.advance("PT0S")
    [posted] = chat_server.messages(chat_db, "ops")
    chat_server.say(chat_db, "ops", "ben", "approve fine by me", thread_ts=posted["ts"])
    await d.advance("PT30S")
    await d.advance("PT1H")
    [reminded] = [e["payload"] for e in await history(d, run["run_id"]) if e["type"] == "request_reminded"]
    assert reminded["to"] == ["ana"] and reminded["in_thread"] is True, reminded
    told = [m["text"] for m in chat_server.messages(chat_db, "ops") if m["user"] == "interactiond" and m["thread_ts"]]
    assert told == ["Two of you, please"], told
