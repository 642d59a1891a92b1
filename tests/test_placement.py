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
    from router.core.affinity import PrefixTable, chat_keys
    from router.peers.placement import NODE_SLOTS, by_prefix

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
