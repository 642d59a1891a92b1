"""Which node serves a model (``router/peers/placement.py``): the order nodes are tried in, a
conversation sent back to the node that has its prompt cached, where a load or unload goes."""

from __future__ import annotations

from typing import Any

import pytest
from standin_peer import StubPeer, StubPeers

from router.errors import BadRequest
from router.peers.placement import Candidate, admin_targets, rank


def test_rank_loaded_then_least_outstanding_then_local() -> None:
    local_cold = Candidate("gw", loaded=False, outstanding=0)
    busy = Candidate("a", loaded=True, outstanding=2, peer=object())  # type: ignore[arg-type]
    idle = Candidate("b", loaded=True, outstanding=0, peer=object())  # type: ignore[arg-type]
    local_idle = Candidate("gw", loaded=True, outstanding=0)
    assert [c.node for c in rank([local_cold, busy, idle])] == ["b", "a", "gw"]
    assert rank([idle, local_idle])[0] is local_idle  # a tie: no network hop


def test_where_load_and_unload_go() -> None:
    a = StubPeer("node-a", {"m": "loaded"})
    b = StubPeer("node-b", {"m": "unloaded"})
    holders: Any = StubPeers(a, b).holders("m")
    local: Any = type("Local", (), {"status": None, "in_flight": 0, "waiting": 0})()
    assert admin_targets(holders, "m", None, "gw", None, "load") == [b]  # not running there
    assert admin_targets(holders, "m", local, "gw", None, "load") == [None]  # this router's
    assert admin_targets(holders, "m", None, "gw", "node-a", "load") == [a]
    assert admin_targets(holders, "m", None, "gw", None, "unload") == [a]  # where it runs
    with pytest.raises(BadRequest, match="no-such-node"):
        admin_targets(holders, "m", None, "gw", "no-such-node", "load")


def test_a_conversation_goes_back_to_the_node_that_has_its_prefix() -> None:
    from router.peers.placement import NODE_SLOTS, by_prefix
    from router.serving.affinity import PrefixTable, chat_keys

    first_turn = [{"role": "system", "content": "long"}, {"role": "user", "content": "q1"}]
    follow_up = chat_keys([*first_turn, {"role": "assistant", "content": "a1"},
                           {"role": "user", "content": "q2"}])
    b_table = PrefixTable()
    b_table.record(chat_keys(first_turn))
    tables = {"b": b_table}
    a = Candidate("a", loaded=True, outstanding=0, peer=object())  # type: ignore[arg-type]
    b = Candidate("b", loaded=True, outstanding=2, peer=object())  # type: ignore[arg-type]
    cold = Candidate("gw", loaded=False, outstanding=0)
    order = rank([cold, a, b])
    assert [c.node for c in order] == ["a", "b", "gw"]
    chosen, decision = by_prefix(order, tables, follow_up)
    assert [c.node for c in chosen] == ["b", "a", "gw"] and decision == "prefix_hit"
    # The holder saturated while another node has room: the other node.
    busy = Candidate("b", loaded=True, outstanding=NODE_SLOTS, peer=b.peer)
    chosen, decision = by_prefix(rank([a, busy]), tables, follow_up)
    assert chosen[0].node == "a" and decision == "override"
    # A new conversation: the least busy; no keys, or one loaded node: the order as it was.
    chosen, decision = by_prefix(order, tables, chat_keys([{"role": "user", "content": "x"}]))
    assert chosen[0].node == "a" and decision == "miss"
    assert by_prefix(order, tables, ()) == (order, None)
    assert by_prefix([a, cold], tables, follow_up) == ([a, cold], None)


def _conversation() -> tuple[list[dict[str, str]], Any]:
    from router.serving.affinity import request_prefix

    first_turn = [{"role": "system", "content": "s" * 4000}, {"role": "user", "content": "q1"}]
    follow_up = request_prefix({"messages": [*first_turn, {"role": "assistant", "content": "a"},
                                             {"role": "user", "content": "q2"}]})
    return first_turn, follow_up


def test_a_conversation_goes_to_the_node_that_keeps_it_when_no_node_has_its_model_loaded(
        ) -> None:
    from router.peers.placement import NodeFacts, by_saved_state
    from router.serving.affinity import PrefixTable, chat_keys

    first_turn, follow_up = _conversation()
    b_table = PrefixTable()
    b_table.record(chat_keys(first_turn))  # b served the first turn, then swapped it out
    tables = {"b": b_table}
    peer: Any = object()
    a = Candidate("a", loaded=False, outstanding=0, peer=peer, facts=NodeFacts(keeps=True))
    b = Candidate("b", loaded=False, outstanding=1, peer=peer, facts=NodeFacts(keeps=True))
    local = Candidate("gw", loaded=False, outstanding=0, facts=NodeFacts(keeps=True))
    order = rank([a, b, local])
    assert order[0].node == "gw"  # by load alone: this router, where nothing of it is
    chosen = by_saved_state(order, tables, follow_up)
    assert chosen is not None and chosen[0][0].node == "b"
    assert chosen[1] == "saved_state"
    # Not kept there (no --state-dir): nothing to restore, the order stands.
    plain = Candidate("b", loaded=False, outstanding=1, peer=peer, facts=NodeFacts())
    assert by_saved_state(rank([a, plain, local]), tables, follow_up) is None
    # A new conversation, or no prompt: nothing kept anywhere.
    from router.serving.affinity import NO_PREFIX, request_prefix
    fresh = request_prefix({"messages": [{"role": "user", "content": "x"}]})
    assert by_saved_state(order, tables, fresh) is None
    assert by_saved_state(order, tables, NO_PREFIX) is None


def test_a_loaded_node_keeps_the_conversation_unless_a_load_costs_less_than_its_prompt() -> None:
    from router.peers.placement import NodeFacts, by_saved_state
    from router.serving.affinity import PrefixTable, chat_keys

    first_turn, follow_up = _conversation()
    b_table = PrefixTable()
    b_table.record(chat_keys(first_turn))
    tables = {"b": b_table}
    peer: Any = object()
    matched = follow_up.sizes[len(chat_keys(first_turn)) - 1]  # characters b keeps of it

    def loaded_at(s_per_char: float | None) -> Candidate:
        return Candidate("a", loaded=True, outstanding=0, peer=peer,
                         facts=NodeFacts(prompt_s_per_char=s_per_char))

    def kept(load_s: float | None) -> Candidate:
        return Candidate("b", loaded=False, outstanding=0, peer=peer,
                         facts=NodeFacts(keeps=True, load_s=load_s))

    slow = loaded_at(2.0 / matched)  # computing what b keeps takes 2 s on a
    chosen = by_saved_state(rank([slow, kept(1.0)]), tables, follow_up)
    assert chosen is not None and chosen[0][0].node == "b"  # a 1 s load beats it
    assert by_saved_state(rank([slow, kept(3.0)]), tables, follow_up) is None
    # Nothing measured on either side: the loaded node, as before.
    assert by_saved_state(rank([loaded_at(None), kept(1.0)]), tables, follow_up) is None
    assert by_saved_state(rank([slow, kept(None)]), tables, follow_up) is None
    # The loaded node holds as much of it: no load is worth it.
    tables["a"] = b_table
    assert by_saved_state(rank([slow, kept(0.0)]), tables, follow_up) is None


@pytest.mark.parametrize("status", [
    None, "loaded", [], {"states": "yes", "load_s": "1"},
    {"load_s": float("nan")}, {"load_s": -1}, {"load_s": True}, {"load_s": float("inf")},
    {"replicas": "x"}, {"replicas": [None, 1, {"pace": "fast"}]},
    {"replicas": [{"pace": {"prompt_ms_per_kchar": -5}}]},
    {"replicas": [{"pace": {"prompt_ms_per_kchar": 0}}]},
])
def test_a_peers_malformed_facts_are_unknown_never_an_error(status: Any) -> None:
    from router.peers.peerstate import NodeFacts, facts_of

    assert facts_of({"status": status}) == NodeFacts()


def test_a_peers_facts_are_read_from_its_listing() -> None:
    from router.peers.peerstate import NodeFacts, facts_of

    entry = {"status": {"value": "unloaded", "states": {"count": 2, "bytes": 10},
                        "load_s": 0.25, "replicas": [
                            {"pace": {"prompt_ms_per_kchar": 40.0}},
                            {"pace": {"prompt_ms_per_kchar": 20}}, {"pace": None}]}}
    assert facts_of(entry) == NodeFacts(True, 0.25, 20e-6)


def test_this_routers_own_facts_come_from_its_model() -> None:
    from types import SimpleNamespace

    from router.peers.placement import NodeFacts, candidates, local_facts

    local: Any = SimpleNamespace(keeps_states=True, snapshot=SimpleNamespace(last_load_s=0.4),
                                 prompt_s_per_char=2e-5, status=None, in_flight=0, waiting=0)
    assert local_facts(local) == NodeFacts(True, 0.4, 2e-5)
    [me] = candidates([], "m", local, "gw")
    assert me.peer is None and me.facts == NodeFacts(True, 0.4, 2e-5)
