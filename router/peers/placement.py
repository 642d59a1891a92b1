"""Which node serves a model: pure decisions over the nodes that hold it, no I/O.

A model that several nodes list (peers, and maybe this router) is one model with replicas
across machines. ``rank`` orders the nodes for a request: those where it is loaded first, then
the fewest requests outstanding from this router, this router before a peer on a tie;
``by_prefix`` puts first the node that holds the longest prefix of a conversation's prompt;
``by_saved_state`` the node that keeps it on disk while the model is not loaded there (it
restores the conversation as it loads). ``admin_targets`` says where a load or unload goes.

What a node's ``/models`` entry says of it (``NodeFacts``: whether it keeps the model's
conversations, how long its last load took, how fast its replicas compute a prompt) is read
once, as its listing arrives (``peerstate.facts_of``, kept in ``Listing.facts``): a request
reads the facts, never the entry.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.scheduler import Status
from ..errors import BadRequest
from ..serving.affinity import SAVED_STATE, Decision, Prefix, PrefixTable, choose
from .peerstate import LOADED, LOADING, NodeFacts

if TYPE_CHECKING:
    from ..core.view import ModelView
    from .peer import Peer

# Requests a node is taken to serve at once for prefix routing across nodes (llama-server's
# default parallel slots): the router does not know a peer's.
NODE_SLOTS = 4
_EMPTY = PrefixTable(0)


@dataclass(frozen=True)
class Candidate:
    """A node that can serve a request's model; ``peer`` None is this router."""

    node: str
    loaded: bool
    outstanding: int
    peer: Peer | None = None
    peer_model: str | None = None  # the peer's own id for the model
    facts: NodeFacts | None = None


def candidate_of(peer: Peer, model_id: str) -> Candidate:
    """The peer as a node that can serve ``model_id`` (one it lists)."""
    return Candidate(peer.node, peer.status_of(model_id) == LOADED,
                     peer.outstanding.get(model_id, 0), peer, peer.peer_ids[model_id],
                     peer.facts.get(model_id))


def rank(candidates: Iterable[Candidate]) -> list[Candidate]:
    """The order to try nodes in: loaded first (no cold load), then the fewest requests
    outstanding, then this router before a peer (no network hop)."""
    return sorted(candidates, key=lambda c: (not c.loaded, c.outstanding, c.peer is not None))


def by_prefix(order: list[Candidate], tables: dict[str, PrefixTable], keys: Sequence[int]
              ) -> tuple[list[Candidate], Decision | None]:
    """``order`` with the node that holds the longest prefix of the prompt (``keys``) first,
    among the nodes where the model is loaded (``affinity.choose``, each node taken to serve
    ``NODE_SLOTS`` requests at once: a holder with that many outstanding yields to a node with
    fewer), and the decision; unchanged (None) when fewer than two such nodes or no keys."""
    loaded = [c for c in order if c.loaded]
    if len(loaded) < 2 or not keys:
        return order, None
    index, decision = choose([(c.outstanding, NODE_SLOTS) for c in loaded],
                             [tables.get(c.node) or _EMPTY for c in loaded], keys)
    chosen = loaded[index]
    return [chosen, *(c for c in order if c is not chosen)], decision


def by_saved_state(order: list[Candidate], tables: dict[str, PrefixTable], prefix: Prefix
                   ) -> tuple[list[Candidate], Decision] | None:
    """``order`` with a node first that keeps the conversation on disk while the model is not
    loaded there (``NodeFacts.keeps``; the node was sent a longer prefix of the prompt than
    any node where the model is loaded), when that is worth a load there: no node has the
    model loaded (a load comes anyway), or computing that prefix on the fastest loaded node
    (its measured pace) would take longer than the node's last load. None: no such node, or
    nothing says the load is worth it (then ``by_prefix`` decides among the loaded)."""
    keys = prefix.keys
    if not keys:
        return None

    def held(c: Candidate) -> int:
        return (tables.get(c.node) or _EMPTY).longest(keys)

    keeping = [c for c in order if not c.loaded and c.facts is not None and c.facts.keeps]
    best = max(keeping, key=held, default=None)  # the first of the longest: ranked order
    matched = held(best) if best is not None else 0
    loaded = [c for c in order if c.loaded]
    if best is None or matched == 0 or any(held(c) >= matched for c in loaded):
        return None
    if loaded:
        rates = [c.facts.prompt_s_per_char for c in loaded
                 if c.facts is not None and c.facts.prompt_s_per_char is not None]
        load_s = best.facts.load_s if best.facts is not None else None
        if not rates or load_s is None or prefix.sizes[matched - 1] * min(rates) <= load_s:
            return None
    return [best, *(c for c in order if c is not best)], SAVED_STATE


def local_facts(local: ModelView) -> NodeFacts:
    """This router's facts of its model, as its own ``/models`` entry gives them."""
    return NodeFacts(local.keeps_states, local.snapshot.last_load_s, local.prompt_s_per_char)


def candidates(holders: Sequence[Peer], model: str, local: ModelView | None, node: str
               ) -> list[Candidate]:
    """Every node that can serve ``model`` (the peers ``holders``, and ``local``, this
    router's own), in the order to try them."""
    found = [candidate_of(peer, model) for peer in holders]
    if local is not None:
        found.append(Candidate(node, local.status is Status.LOADED,
                               local.in_flight + local.waiting, facts=local_facts(local)))
    return rank(found)


def admin_targets(holders: list[Peer], model: str, local: ModelView | None, node: str,
                  asked: str | None, action: str) -> list[Peer | None]:
    """Where ``POST /models/load|unload`` goes (None: this router); ``holders``: the peers
    that list the model, less those the request passed through.

    ``"node"`` in the body names one node. Otherwise a load goes to this router if it has the
    model, else to the first node (``rank``) where it is not running, else to the first; an
    unload goes to every node where the model is running (this router included)."""
    if asked is not None:
        if asked == node and local is not None:
            return [None]
        chosen = [p for p in holders if p.node == asked]
        if not chosen:
            raise BadRequest(f"model '{model}' is not on a node named '{asked}' that is up")
        return [chosen[0]]
    if action == "load":
        if local is not None:
            return [None]
        order = [c.peer for c in candidates(holders, model, None, node)]
        idle = [p for p in order if p is not None and p.status_of(model) == "unloaded"]
        return [idle[0] if idle else order[0]]
    running: list[Peer | None] = [p for p in holders
                                  if p.status_of(model) in (LOADED, LOADING)]
    if local is not None and (local.status is not Status.UNLOADED or not running):
        running.insert(0, None)
    return running or [holders[0]]
