"""What each slot of one child holds, as far as the router knows, and which slot a request
takes (pure: no I/O, no clock).

llama-server keeps a conversation's KV cache in the slot that computed it, and its RAM prompt
cache keeps a few more until the child stops. The router keeps every conversation worth it on
disk (``conversations``); for that it must know what each slot holds, so it places the
requests itself (``id_slot``) whenever a slot is free:

* a conversation's next turn goes to the free slot that holds its previous turn (the hot
  path: nothing to save, nothing to restore, no extra request to the child);
* a request whose conversation is saved on disk with more of its prompt than any free slot
  holds gets that state restored into a slot first (``Plan.restore``);
* any other request takes the free slot that loses least: an empty one, then one whose
  conversation is saved already or not worth saving, then the least recently used. Taking a
  slot whose conversation is worth keeping and not saved yet saves it first (``Plan.save``).

With no slot free (rare: completions beyond the slots wait in the router's slot queue, but a
request the book does not see may hold one), the child queues the request and picks its slot
itself (``Plan.slot`` is None); the router takes it to go, in arrival order, to the slots as
they free (``end``), as llama-server does. A wrong guess costs a cache miss, never a wrong
answer: llama-server compares the tokens of what a slot holds with every prompt.

A conversation is named by its prefix keys (``affinity``): a saved or held conversation of
``n`` keys covers a request whose key ``n - 1`` is its last key.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Final

EMPTY: Final = 0  # a slot's loss if taken: nothing
KEPT: Final = 1  # what it holds is on disk, or not worth keeping
UNSAVED: Final = 2  # a conversation worth keeping would be lost: saved first


@dataclass(frozen=True, slots=True)
class Conversation:
    """A conversation as a slot holds it: the prefix keys of its last prompt and who may
    have it restored (an owner's digest; None: anyone)."""

    keys: tuple[int, ...]
    owner: str | None = None

    def covers(self, keys: Sequence[int], owner: str | None) -> int:
        """How many of a request's ``keys`` this conversation holds (0: none), for a request
        of ``owner``: only the owner's own requests match a conversation that has one."""
        n = len(self.keys)
        if n == 0 or n > len(keys) or keys[n - 1] != self.keys[-1]:
            return 0
        return n if self.owner is None or self.owner == owner else 0


@dataclass(slots=True)
class Slot:
    """One slot as the router knows it."""

    held: Conversation | None = None  # None: empty, or not known
    tokens: int = 0  # what it holds, prompt and reply (its last response's timings)
    saved: bool = True  # what it holds is on disk already (or there is nothing)
    busy: bool = False
    used: int = 0  # the book's use counter when it last took a request (least recent: lowest)


@dataclass(frozen=True, slots=True)
class Plan:
    """Where a request goes and what comes first: ``save`` the slot's conversation (of
    ``save_tokens``), then restore the saved state that covers ``restore_keys`` of the
    request (0: none), or, when nothing was restored, ``erase`` the slot (it holds another
    owner's conversation: a cached prefix would tell the request's key what another sent),
    and ``erase_also`` the other slots listed, then run it in ``slot`` (None: the child's
    choice)."""

    slot: int | None
    save: Conversation | None = None
    save_tokens: int = 0
    restore_keys: int = 0
    erase: bool = False
    erase_also: tuple[int, ...] = ()


@dataclass(eq=False, slots=True)
class Waiting:
    """A request the child queued (no slot was free): the slot it is taken to have got."""

    conversation: Conversation | None
    slot: int | None = None


@dataclass(eq=False)
class SlotBook:
    """One child's slots (``n_slots``) as the router knows them."""

    n_slots: int
    # the directory of its child's saved states (``statestore``: the fingerprint of what
    # its KV cache was made with, as the child started); None: it keeps none
    fingerprint: str | None = None
    slots: list[Slot] = field(init=False)
    waiting: deque[Waiting] = field(default_factory=deque)
    _uses: int = 0

    def __post_init__(self) -> None:
        self.slots = [Slot() for _ in range(self.n_slots)]

    def holding(self, slot: int, conversation: Conversation | None, tokens: int) -> None:
        """``slot`` holds ``conversation`` as saved on disk (a restore at the child's start;
        None: a state without its conversation's label, whose owner is not known)."""
        self.slots[slot] = Slot(conversation, tokens, saved=True)

    def plan(self, keys: Sequence[int], owner: str | None, stored: int,
             worth: Callable[[int], bool], wanted: int | None = None,
             pinned: bool = True) -> Plan:
        """Where a request of prefix ``keys`` from ``owner`` goes, given how many of its keys
        the best saved state on disk covers (``stored``), and which slot sizes are worth
        saving (``worth(tokens)``). Takes the slot at once (``end`` frees it). A request that
        names its slot (``wanted``, its ``id_slot``) gets it only when it is free and holds
        nothing or the owner's own conversation (``honours``); else the book chooses.

        A request of an owner is recorded with its owner even when it has no prefix keys (a
        short prompt, a body too large to key), so that another owner's next request in that
        slot erases it first. One whose endpoint does not pass its ``id_slot`` to the child
        (not ``pinned``: llama-server's Anthropic Messages) may run in any free slot: each
        free slot that may hold another owner's conversation is erased first (``Plan.
        erase_also``), and each that the request may then fill is taken to hold a
        conversation of unknown owner, erased in turn before another owner's request."""
        plan = self._plan(keys, owner, stored, worth, wanted)
        if pinned or owner is None or plan.slot is None:
            return plan
        others = [i for i, s in enumerate(self.slots) if not s.busy]
        foreign = tuple(i for i in others if self._foreign(self.slots[i], owner))
        for i in others:
            slot = self.slots[i]
            if slot.held is None or slot.held.owner != owner:
                slot.held, slot.tokens, slot.saved = None, max(slot.tokens, 1), True
        return replace(plan, erase_also=foreign)

    def _plan(self, keys: Sequence[int], owner: str | None, stored: int,
              worth: Callable[[int], bool], wanted: int | None) -> Plan:
        conversation = Conversation(tuple(keys), owner) if keys or owner is not None else None
        if wanted is not None and self.honours(wanted, owner):
            return self._take(wanted, conversation, Plan(wanted))
        free = [i for i, s in enumerate(self.slots) if not s.busy]
        if not free:
            self.waiting.append(Waiting(conversation))
            return Plan(None)
        matches = [(s.held.covers(keys, owner) if s.held is not None else 0, i)
                   for i, s in ((i, self.slots[i]) for i in free)]
        held, holder = max(matches, key=lambda m: (m[0], -self.slots[m[1]].used))
        if held and held >= stored:  # its next turn, where it is: the hot path
            return self._take(holder, conversation, Plan(holder))
        if not keys and owner is not None:  # a prompt not keyed (a body too large to parse):
            own = [i for i in free if (h := self.slots[i].held) is not None  # its owner's
                   and h.owner == owner]  # latest slot, where llama-server finds its prefix
            if own:  # if it continues that conversation
                latest = max(own, key=lambda i: self.slots[i].used)
                return self._take(latest, conversation, Plan(latest))
        restore = stored if stored > held else 0
        if held:  # what it holds is a prefix of the state restored over it: nothing lost
            target, loss = holder, KEPT
        else:
            target, loss = min(((self._loss(i, worth), i) for i in free),
                               key=lambda c: (c[0], self.slots[c[1]].used))[::-1]
        slot = self.slots[target]
        erase = self._foreign(slot, owner)
        if loss == UNSAVED and slot.held is not None:
            return self._take(target, conversation,
                              Plan(target, slot.held, slot.tokens, restore, erase))
        return self._take(target, conversation, Plan(target, restore_keys=restore, erase=erase))

    def honours(self, wanted: int, owner: str | None) -> bool:
        """Whether a request of ``owner`` naming slot ``wanted`` may run there as it asks: the
        slot is free and holds nothing, or a conversation of the same owner."""
        if not 0 <= wanted < self.n_slots:
            return False
        slot = self.slots[wanted]
        return not slot.busy and not self._foreign(slot, owner)

    @staticmethod
    def _foreign(slot: Slot, owner: str | None) -> bool:
        """Whether ``slot`` may hold a conversation that a request of ``owner`` must not be
        served from: another owner's, or, for an owner's request, one of unknown owner (a
        state restored at a child's start without its label)."""
        if slot.held is not None:
            return slot.held.owner != owner
        return owner is not None and slot.tokens > 0

    def _loss(self, index: int, worth: Callable[[int], bool]) -> int:
        slot = self.slots[index]
        if slot.held is None or slot.tokens <= 0:
            return EMPTY
        if not slot.held.keys:  # nothing names it: no request could have it restored
            return KEPT
        return KEPT if slot.saved or not worth(slot.tokens) else UNSAVED

    def _take(self, index: int, conversation: Conversation | None, plan: Plan) -> Plan:
        self._uses += 1
        slot = self.slots[index]
        assert not slot.busy, "a slot holds one request at a time"
        slot.busy = True
        slot.used = self._uses
        if conversation != slot.held:
            slot.held, slot.saved = conversation, False
        return plan

    def saved(self, index: int, conversation: Conversation) -> None:
        """``conversation``, saved from ``index``, is on disk now (a save at a stop, or before
        a request took its slot)."""
        slot = self.slots[index]
        if slot.held == conversation:
            slot.saved = True

    def restored(self, index: int, tokens: int) -> None:
        """A saved state of ``tokens`` went into ``index`` (still taken by its request)."""
        self.slots[index].tokens = tokens

    def end(self, index: int | None, tokens: int | None,
            waiting: Waiting | None = None) -> None:
        """A request in ``index`` (None: one the child placed, ``waiting``) ended, its slot
        holding ``tokens`` (None: not known: nothing worth keeping). The oldest request the
        child queued is taken to get the slot freed."""
        if index is None and waiting is not None:
            index = waiting.slot
            if waiting in self.waiting:
                self.waiting.remove(waiting)
        if index is None:
            return
        slot = self.slots[index]
        slot.tokens = tokens or 0
        slot.saved = not tokens  # what it holds now is newer than any save of it
        if self.waiting:
            queued = self.waiting.popleft()
            queued.slot = index
            self._uses += 1
            slot.used = self._uses
            slot.held, slot.saved = queued.conversation, False
            return
        slot.busy = False
