"""The teams' parts on their own: who a request is for, the fair-share order, the quotas,
the usage ledger and its SQLite file."""

from __future__ import annotations

import json
import math
import random
from collections import deque
from pathlib import Path
from typing import Any

import pytest

from router.config.keyfile import PRIORITIES, QUOTA_FIELDS, KeyPolicy, parse_file
from router.teams.fairshare import GENERATED_WEIGHT, FairQueue, Turn, service_bound
from router.teams.members import (
    FAIRNESS_HEADER,
    PRIORITY_HEADER,
    MemberError,
    member_of,
)
from router.teams.quotas import QUOTA_KINDS, OverQuota, Quotas
from router.teams.usage import Usage, UsageStore, jain

BATCH = KeyPolicy("etl", PRIORITIES.index("batch"))
ALICE = KeyPolicy("alice", PRIORITIES.index("interactive"))


# ------------------------------------------------------------------------ the key file

def test_a_key_files_policy_fields_are_read() -> None:
    keys = parse_file("sk-a name=alice priority=interactive\n"
                      "sk-b name=etl priority=batch max-concurrent=4 tokens-per-minute=2000\n"
                      "sk-c\n")
    assert [k.policy for k in keys] == [
        ALICE, KeyPolicy("etl", 2, {"max-concurrent": 4, "tokens-per-minute": 2000}),
        KeyPolicy("key-3")]
    assert "sk-b" not in repr(keys[1]) and "name=etl" in repr(keys[1])
    # the quotas in the key file's order, whatever order they were given in
    swapped = parse_file("sk-b tokens-per-minute=2000 priority=batch max-concurrent=4 "
                         "name=etl")[0].policy
    assert swapped == keys[1].policy and hash(swapped) == hash(keys[1].policy)
    assert swapped.describe() == \
        "name=etl priority=batch max-concurrent=4 tokens-per-minute=2000"


def test_the_key_files_quota_fields_are_the_quota_kinds() -> None:
    """The key file's grammar (config, below teams) lists the quotas' fields; the kinds of
    quota (teams) give each its meaning: one kind a field, in the same order."""
    assert [kind.field for kind in QUOTA_KINDS] == list(QUOTA_FIELDS)


@pytest.mark.parametrize(("text", "problem"), [
    ("sk-a priority=root", "line 1: priority= must be one of interactive, default, batch"),
    ("\nsk-a max-concurrent=0", "line 2: max-concurrent= must be a whole number"),
    ("sk-a tokens-per-minute=1e3", "line 1: tokens-per-minute= must be a whole number"),
    ("sk-a max-concurrent=-1", "line 1: max-concurrent= must be a whole number"),
    ("sk-a name=a/b", "line 1: name= needs 1 to 64 letters"),
    ("sk-a name=", "line 1: name= needs"),
    ("sk-a name=t priority=batch\nsk-b name=t", "line 2: name=t is also the name of line 1"),
    ("sk-a name=admin", "line 1: name=admin is the name of the keys given with --api-key"),
    ("sk-a name=x name=y", "line 1: name= given twice"),
])
def test_a_policy_on_a_bad_line_is_refused_with_its_line(text: str, problem: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_file(text)
    assert str(caught.value).startswith(problem)
    assert "sk-" not in str(caught.value)


def test_keys_sharing_a_name_with_the_same_policy_are_one_team() -> None:
    keys = parse_file("sk-a name=t max-concurrent=2\nsk-b name=t max-concurrent=2\n")
    assert keys[0].policy == keys[1].policy


# ------------------------------------------------------------------------ members

def test_a_request_asks_for_a_lower_class_never_a_higher_one() -> None:
    assert member_of(ALICE, False, {PRIORITY_HEADER: b"batch"}).priority == "batch"
    assert member_of(BATCH, False, {}).priority == "batch"
    for asked in (b"interactive", b"default", b" Default "):
        with pytest.raises(MemberError) as caught:
            member_of(BATCH, False, {PRIORITY_HEADER: asked})
        assert caught.value.status == 403
    with pytest.raises(MemberError) as caught:
        member_of(ALICE, False, {PRIORITY_HEADER: b"urgent"})
    assert caught.value.status == 400


def test_the_fairness_header_counts_only_from_an_admin_key() -> None:
    headers = {FAIRNESS_HEADER: b"user-42"}
    assert member_of(ALICE, False, headers).flow == "alice"  # forged: ignored
    admin = member_of(ALICE, True, headers)
    assert (admin.name, admin.flow) == ("alice", "alice/user-42")
    for bad in (b"", b"a b", b"\xff", b"x" * 257):
        with pytest.raises(MemberError):
            member_of(ALICE, True, {FAIRNESS_HEADER: bad})


def test_a_plain_member_is_made_once_per_policy() -> None:
    assert member_of(ALICE, False, {}) is member_of(ALICE, True, {})


# ------------------------------------------------------------------------ fair share

def test_the_higher_class_goes_first_then_the_least_served_flow() -> None:
    queue = FairQueue()
    queue.start(Turn("a", 1, 100))  # a holds the slot
    # b arrives lifted to a's service (it banks nothing): a tie, which arrival breaks.
    waiting = [Turn("b", 1, 10), Turn("a", 1, 10), Turn("c", 2, 10), Turn("d", 0, 10)]
    for turn in waiting:
        queue.push(turn)
    order = [queue.pop() for _ in waiting]
    assert [t.flow for t in order if t] == ["d", "b", "a", "c"]
    queue = FairQueue()
    queue.start(Turn("a", 1, 100))
    queue.push(Turn("a", 1, 10))
    queue.push(Turn("b", 1, 10))
    queue.end(Turn("x", 1, 0), 0)  # not started: changes nothing
    first = queue.pop()
    assert first is not None and first.flow == "a"  # a tie again, broken by arrival
    second = queue.pop()
    assert second is not None and second.flow == "b"
    assert queue.pop() is None and not queue


def test_a_flow_that_comes_back_late_banks_nothing() -> None:
    queue = FairQueue()
    for _ in range(10):
        turn = Turn("busy", 1, 1000)
        queue.start(turn)
        queue.end(turn, 0)
    running = Turn("busy", 1, 1000)
    queue.start(running)
    late = Turn("late", 1, 10)
    queue.push(late)
    # Alone, busy's history mattered to nobody; the late flow starts where busy stands.
    assert queue.service("late", 1) == queue.service("busy", 1) == 1000
    queue.push(Turn("busy", 1, 1000))
    assert queue.pop() is late


def test_a_waiting_turn_that_leaves_is_forgotten_and_counts_nothing() -> None:
    queue = FairQueue()
    queue.start(Turn("a", 1, 5))
    gone = Turn("b", 1, 5)
    queue.push(gone)
    queue.remove(gone)
    assert (queue.waiting, queue.running) == (0, 1) and queue.service("b", 1) == 0


def test_the_end_of_a_turn_corrects_its_charge() -> None:
    queue = FairQueue()
    turn = Turn("a", 1, 100)
    queue.start(turn)
    other = Turn("a", 1, 1)
    queue.push(other)  # keeps the flow active
    queue.end(turn, 50 + GENERATED_WEIGHT * 10 - 100)
    assert queue.service("a", 1) == 70


@pytest.mark.parametrize("seed", range(20))
def test_two_backlogged_flows_stay_within_vtcs_bound(seed: int) -> None:
    """Flows that always have requests waiting, one slot, random prompt and reply sizes and
    a 3:1 arrival: the service difference never leaves VTC's bound."""
    rng = random.Random(seed)
    queue = FairQueue()
    longest, context = 400, 512
    bound = service_bound(longest, context)
    served = {"a": 0.0, "b": 0.0}
    for flow, count in (("a", 6), ("b", 2)):
        for _ in range(count):
            queue.push(Turn(flow, 1, rng.randint(1, longest)))
    for _ in range(500):
        turn = queue.pop()
        assert turn is not None
        real = turn.cost + GENERATED_WEIGHT * rng.randint(0, context)
        queue.end(turn, real - turn.cost)
        served[turn.flow] += real
        queue.push(Turn(turn.flow, 1, rng.randint(1, longest)))  # a closed loop: it resends
        assert abs(queue.service("a", 1) - queue.service("b", 1)) <= bound
    assert jain(served.values()) > 0.95


# ------------------------------------------------------------------------ quotas

class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_max_concurrent_refuses_the_one_too_many_until_one_ends() -> None:
    quotas = Quotas(Clock())
    policy = KeyPolicy("t", 1, {"max-concurrent": 2})
    holds = [quotas.admit(policy, 10), quotas.admit(policy, 10)]
    with pytest.raises(OverQuota) as caught:
        quotas.admit(policy, 10)
    assert caught.value.retry_after >= 1 and "max-concurrent=2" in str(caught.value)
    holds[0].settle(10)
    holds[0].settle(10)  # once only
    assert quotas.admit(policy, 10) is not None
    with pytest.raises(OverQuota):
        quotas.admit(policy, 10)


def test_tokens_a_minute_reserve_then_settle_and_refill() -> None:
    clock = Clock()
    quotas = Quotas(clock)
    policy = KeyPolicy("t", 1, {"tokens-per-minute": 600})  # 10 a second
    hold = quotas.admit(policy, 500)
    with pytest.raises(OverQuota) as caught:
        quotas.admit(policy, 200)
    assert caught.value.retry_after == 10  # 100 short at 10 a second
    hold.settle(100)  # used less than reserved: 400 back
    assert quotas.admit(policy, 200) is not None
    clock.now += 60
    big = quotas.admit(policy, 10_000)  # more than a minute's worth: reserves a full bucket
    big.settle(1200)  # used twice the bucket: in debt
    clock.now += 30
    with pytest.raises(OverQuota):
        quotas.admit(policy, 1)
    clock.now += 31
    assert quotas.admit(policy, 1) is not None


def test_a_team_without_quotas_holds_nothing() -> None:
    assert Quotas().admit(KeyPolicy("free"), 10**9) is None


def test_a_new_quota_kind_is_one_entry_of_the_list(monkeypatch: pytest.MonkeyPatch) -> None:
    """The newcomer's change (docs/architecture.md): a kind of quota is a ``QuotaKind`` (its
    key-file field; how it admits, counts and settles a request) added to ``QUOTA_KINDS``,
    and its field to the key file's ``QUOTA_FIELDS``; the quotas and the edge's meter ask it
    with the others (429 with its ``Retry-After``, the refusal counted), and nothing else
    changes."""
    from router.config import keyfile
    from router.edge.metering import Meter
    from router.errors import QuotaExceeded
    from router.teams import quotas

    class RequestsPerMinute(quotas.QuotaKind):
        """Requests a minute: when the team's requests of the last minute were admitted."""

        field = "requests-per-minute"

        def __init__(self, now: float) -> None:
            self.admitted: deque[float] = deque()

        def admit(self, team: str, limit: int | None, expected_tokens: float,
                  now: float) -> float:
            while self.admitted and self.admitted[0] <= now - 60:
                self.admitted.popleft()
            if limit is not None and len(self.admitted) >= limit:
                raise OverQuota(f"team {team} is over its requests-per-minute={limit}",
                                math.ceil(self.admitted[0] + 60 - now))
            return 0.0

        def take(self, reserved: float, now: float) -> None:
            self.admitted.append(now)

    monkeypatch.setattr(quotas, "QUOTA_KINDS", (*quotas.QUOTA_KINDS, RequestsPerMinute))
    monkeypatch.setattr(keyfile, "QUOTA_FIELDS", (*keyfile.QUOTA_FIELDS, RequestsPerMinute.field))
    monkeypatch.setattr(keyfile, "FIELDS", (*keyfile.FIELDS, RequestsPerMinute.field))  # (its
    # value at import: the field list the parser checks)
    policy = parse_file("sk-a name=t requests-per-minute=2 max-concurrent=2")[0].policy
    assert policy.describe() == "name=t priority=default max-concurrent=2 requests-per-minute=2"
    clock = Clock()
    quotas_ = Quotas(clock)
    first, second = quotas_.admit(policy, 10), quotas_.admit(policy, 10)
    assert first is not None and second is not None
    with pytest.raises(OverQuota, match="max-concurrent=2"):  # the list's order: the first
        quotas_.admit(policy, 10)
    first.settle(10)
    clock.now += 20
    with pytest.raises(OverQuota, match="requests-per-minute=2") as caught:
        quotas_.admit(policy, 10)  # a place is free, but the minute holds two requests
    assert caught.value.retry_after == 40
    second.settle(10)
    clock.now += 40
    assert quotas_.admit(policy, 10) is not None  # the first one's minute is over

    meter = Meter(Usage(), Quotas(clock))  # the edge, as it is
    request = metered_request(b'{"prompt": "hi"}')
    request.member = member_of(KeyPolicy("t", quotas={"requests-per-minute": 1}), False, {})
    assert meter.begin(request, "m") is not None
    with pytest.raises(QuotaExceeded, match="requests-per-minute=1") as refused:
        meter.begin(request, "m")
    assert refused.value.headers == {"Retry-After": "60"}
    assert [(r.name, r.refusals) for r in meter.usage.rows()] == [("t", 1)]


# ------------------------------------------------------------------------ usage

def test_usage_survives_in_its_file_and_exports_csv(tmp_path: Path) -> None:
    store = UsageStore(tmp_path / "usage.sqlite3")
    usage = Usage(store)
    usage.served("alice", "chat", 12, 30, 0.5)
    usage.served("alice", "chat", 8, 10, 0.0)
    usage.refused("etl", "chat")
    usage.save_now()
    again = Usage(UsageStore(tmp_path / "usage.sqlite3"))
    assert [vars(r) for r in again.rows()] == [
        {"name": "alice", "model": "chat", "requests": 2, "prompt_tokens": 20,
         "completion_tokens": 40, "queue_seconds": 0.5, "refusals": 0},
        {"name": "etl", "model": "chat", "requests": 0, "prompt_tokens": 0,
         "completion_tokens": 0, "queue_seconds": 0.0, "refusals": 1}]
    assert again.csv().splitlines() == [
        "name,model,requests,prompt_tokens,completion_tokens,queue_seconds,refusals",
        "alice,chat,2,20,40,0.5,0", "etl,chat,0,0,0,0.0,1"]


def test_jains_index_counts_the_teams_that_waited() -> None:
    clock = Clock()
    usage = Usage(now=clock)
    usage.served("a", "m", 100, 0, 1.0)
    assert usage.jain() is None  # one team waited: nothing to compare
    usage.served("b", "m", 100, 0, 1.0)
    usage.served("c", "m", 10_000, 0, 0.0)  # never waited: not counted
    assert usage.jain() == pytest.approx(1.0)
    usage.served("a", "m", 200, 0, 1.0)
    assert usage.jain() == pytest.approx(jain([300, 100]))
    clock.now += 61
    assert usage.jain() is None and usage.recent_service() == {}


def test_a_peer_gets_the_decision_never_the_clients_headers() -> None:
    """What this router decided travels to a peer; the client's own priority and fairness
    headers are dropped on the way (a forged fairness id ignored here cannot count there)."""
    from router.http.proxy import upstream_headers
    from router.teams.members import forwarded

    raw = [(b"content-type", b"application/json"), (FAIRNESS_HEADER, b"forged"),
           (PRIORITY_HEADER, b"batch")]
    assert upstream_headers(raw) == [(b"content-type", b"application/json")]
    member = member_of(ALICE, True, {FAIRNESS_HEADER: b"u1", PRIORITY_HEADER: b"default"})
    assert forwarded(member) == [(FAIRNESS_HEADER, b"alice/u1"), (PRIORITY_HEADER, b"default")]
    assert member_of(ALICE, True, dict(forwarded(member))).flow == "alice/alice/u1"


def metered_request(body: bytes) -> Any:
    from router.http.requests import RequestContext

    request = RequestContext({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                              "query_string": b"", "headers": []})
    request.body = body
    return request


def test_what_a_request_is_charged_is_what_the_child_did_or_its_reservation() -> None:
    """Charged what the child's answer counts; where it counts nothing (an answer whose client
    chose its fields, ``/embedding``), the reservation: the prompt's estimate and the limit
    the request set; an error answer nothing; a stream cut short its events."""
    from router.edge.metering import Meter

    meter = Meter(Usage())
    EST = -1  # the prompt's estimate: the body's bytes over 4
    counted = b'{"usage":{"prompt_tokens":7,"completion_tokens":3}}'
    cases = [  # (status, chunks, the body's limit, charged)
        (200, [counted], None, (7, 3)),  # an answer that counts
        (200, [counted], 50, (7, 3)),  # its counts, not its limit
        (200, [b'{"content":"hello"}'], None, (EST, 0)),  # counts nothing: its estimate
        (200, [b'{"content":"hello"}'], 50, (EST, 50)),  # and its limit
        (200, [b'[{"index":0,"embedding":[0.1]}]'], None, (EST, 0)),  # /embedding
        (400, [b'{"error":{"code":400,"message":"too long"}}'], 50, (0, 0)),  # an error
        (200, [b'data: {"choices":[]}\n\n'] * 5, None, (EST, 5)),  # a stream cut short
        (200, [b'data: {"choices":[]}\n\n'] * 5, 64, (EST, 64)),
        (200, [], None, None),  # never answered (its client left while queued)
    ]
    for n, (status, chunks, limit, charged) in enumerate(cases):
        body = b'{"n_predict": %d, "x": "%s"}' % (limit, b"x" * 380) if limit else b"x" * 400
        request = metered_request(body)
        if limit:
            request.parsed = json.loads(body)
        request.member = member_of(KeyPolicy(f"t{n}"), False, {})
        metered = meter.begin(request, "m")
        assert metered is not None and metered.turn.cost == len(body) / 4
        request.status = status
        for chunk in chunks:
            request.sent(chunk)
        metered.end(request, None)
        metered.end(request, None)  # once only
        rows = {r.name: r for r in meter.usage.rows()}
        if charged is None:
            assert f"t{n}" not in rows
        else:
            row = rows[f"t{n}"]
            prompt = round(len(body) / 4) if charged[0] is EST else charged[0]
            assert (row.requests, row.prompt_tokens, row.completion_tokens) == \
                (1, prompt, charged[1]), n


def test_a_teams_tokens_a_minute_cap_one_requests_generation() -> None:
    """A request of a team with tokens a minute cannot overrun them by its generation: one
    with no limit, or one past a minute's worth less its prompt, gets that limit written into
    the body the child gets (the last key, which llama-server reads); one within it is left
    byte for byte."""
    from router.edge.metering import Meter

    meter = Meter(Usage())
    policy = KeyPolicy("tpm", quotas={"tokens-per-minute": 300})
    for path, body, written in [
            ("/completion", b'{"prompt": "hi"}', b', "n_predict": 296}'),
            ("/completion", b'{"prompt": "hi", "n_predict": 5000}', b', "n_predict": 291}'),
            ("/v1/messages", b'{"messages": []}', b', "max_tokens": 296}'),
            ("/completion", b'{"prompt": "hi", "n_predict": 10}', None),
            ("/v1/embeddings", b'{"input": "hi"}', None)]:
        request = metered_request(body)
        request.path = path
        request.parsed = json.loads(body)
        request.member = member_of(policy, False, {})
        metered = meter.begin(request, "m")
        assert metered is not None
        shaped = metered.shaped(request, body)
        if written is None:
            assert shaped is body
        else:
            assert shaped == body[:-1] + written and json.loads(shaped)
        metered.end(request, None)
