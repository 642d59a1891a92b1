"""Every conversation keeps its cache, in process: which slot a request takes and what comes
first (``warm/slotbook.py``), how a saved state is labelled and found by its conversation
(``warm/choice.py``, ``warm/conversations.py``), whose it is, and how restores are proven.
Against the real llama-server: ``test_conversations_real.py``."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from router.children.backend import Backend
from router.config.presets import ModelPreset
from router.serving.affinity import request_prefix
from router.warm.choice import covers, label, labelled, supersedes
from router.warm.conversations import MISSES_TO_STOP, SECRET_NAME, Conversations
from router.warm.slotbook import Conversation, SlotBook
from router.warm.statestore import StateStore
from router.warm.swaps import WarmSwaps, conversation_of

A = (11, 12, 13)  # a conversation's keys after three messages
A5 = (11, 12, 13, 14, 15)  # its next turn
B = (21, 22)


def always(tokens: int) -> bool:
    return tokens >= 64


# -- the book -------------------------------------------------------------------------------

def test_a_new_request_takes_an_empty_slot_and_nothing_comes_first() -> None:
    book = SlotBook(2)
    plan = book.plan(A, None, 0, always)
    assert (plan.slot, plan.save, plan.restore_keys) == (0, None, 0)
    assert book.slots[0].busy and book.slots[0].held == Conversation(A)


def test_the_next_turn_goes_where_its_conversation_is_and_pays_nothing() -> None:
    book = SlotBook(2)
    first = book.plan(A, None, 0, always)
    book.end(first.slot, 500)
    other = book.plan(B, None, 0, always)
    book.end(other.slot, 500)
    assert other.slot == 1  # the empty one, not A's
    again = book.plan(A5, None, 0, always)
    assert (again.slot, again.save, again.restore_keys) == (0, None, 0)


def test_a_conversation_worth_keeping_is_saved_before_another_takes_its_slot() -> None:
    book = SlotBook(1)
    book.end(book.plan(A, None, 0, always).slot, 500)
    plan = book.plan(B, None, 0, always)
    assert plan.slot == 0 and plan.save == Conversation(A) and plan.save_tokens == 500
    book.saved(0, Conversation(A))  # the save of A: B holds the slot now, nothing changes
    assert book.slots[0].held == Conversation(B) and not book.slots[0].saved


def test_a_small_or_saved_slot_is_taken_without_a_save() -> None:
    book = SlotBook(2)
    book.end(book.plan(A, None, 0, always).slot, 10)  # not worth saving
    book.end(book.plan(B, None, 0, always).slot, 500)
    plan = book.plan((31,), None, 0, always)
    assert (plan.slot, plan.save) == (0, None)  # A's slot loses least
    book.end(plan.slot, 500)
    book.slots[1].saved = True  # B is on disk already
    plan = book.plan((41,), None, 0, always)
    assert (plan.slot, plan.save) == (1, None)


def test_the_least_recently_used_conversation_gives_way() -> None:
    book = SlotBook(2)
    book.end(book.plan(A, None, 0, always).slot, 500)
    book.end(book.plan(B, None, 0, always).slot, 500)
    book.end(book.plan(A5, None, 0, always).slot, 600)  # A used again: B is the older
    plan = book.plan((31,), None, 0, always)
    assert plan.slot == 1 and plan.save == Conversation(B)


def test_a_longer_saved_state_is_restored_over_what_a_slot_holds() -> None:
    book = SlotBook(1)
    book.end(book.plan(A, None, 0, always).slot, 500)
    plan = book.plan((*A5, 16, 17), None, 5, always)  # disk holds A up to key 5
    assert (plan.slot, plan.save, plan.restore_keys) == (0, None, 5)  # A's turn 3: no loss


def test_a_saved_state_of_another_conversation_displaces_the_slot_with_a_save() -> None:
    book = SlotBook(1)
    book.end(book.plan(B, None, 0, always).slot, 500)
    plan = book.plan(A5, None, 3, always)
    assert (plan.slot, plan.save, plan.restore_keys) == (0, Conversation(B), 3)


def test_with_no_free_slot_the_child_chooses_and_the_book_follows() -> None:
    book = SlotBook(1)
    first = book.plan(A, None, 0, always)
    queued = book.plan(B, None, 0, always)
    assert queued.slot is None and len(book.waiting) == 1
    waiting = book.waiting[0]
    book.end(first.slot, 500)  # the queued request takes the freed slot
    assert book.slots[0].busy and book.slots[0].held == Conversation(B)
    assert waiting.slot == 0
    book.end(None, 300, waiting)
    assert not book.slots[0].busy and book.slots[0].tokens == 300 and not book.waiting


def test_another_owners_conversation_is_not_matched() -> None:
    book = SlotBook(2)
    book.end(book.plan(A, "alice", 0, always).slot, 500)
    plan = book.plan(A5, "bob", 0, always)
    assert plan.slot == 1  # a slot of its own, never alice's
    assert Conversation(A, "alice").covers(A5, "bob") == 0
    assert Conversation(A, "alice").covers(A5, "alice") == 3
    assert Conversation(A).covers(A5, "bob") == 3  # shared


def test_every_slot_taken_exactly_once_and_freed_by_its_end() -> None:
    book = SlotBook(3)
    plans = [book.plan((i,), None, 0, always) for i in range(5)]
    assert [p.slot for p in plans] == [0, 1, 2, None, None]
    waiting = list(book.waiting)
    for plan in plans[:3]:
        book.end(plan.slot, 100)
    assert [w.slot for w in waiting] == [0, 1]
    for w in waiting:
        book.end(None, 100, w)
    assert not any(s.busy for s in book.slots) and not book.waiting


# -- labels ---------------------------------------------------------------------------------

def test_a_label_names_the_conversation_and_its_owner() -> None:
    prefix = label(Conversation(A, "o"), [1, 2])
    assert prefix == {"conversation": {"n": 3, "key": 13, "owner": "o"}, "recent": [1, 2]}
    assert labelled(prefix) == (3, 13, "o")
    assert covers(prefix, A5, "o") == 3 and covers(prefix, A5, "x") == 0
    assert covers(prefix, (11, 12), "o") == 0 and covers(prefix, (11, 12, 99), "o") == 0
    assert label(None, [1]) == [1] and label(None, None) is None
    restored = conversation_of(prefix)
    assert restored is not None and restored.covers(A5, "o") == 3


@pytest.mark.parametrize("bad", [None, [1, 2], {"conversation": []},
                                 {"conversation": {"n": 0, "key": 1}},
                                 {"conversation": {"n": True, "key": 1}},
                                 {"conversation": {"n": 2, "key": "1"}},
                                 {"conversation": {"n": 2, "key": 1, "owner": 5}}])
def test_a_malformed_label_names_nothing(bad: Any) -> None:
    assert labelled(bad) is None and covers(bad, A5, None) == 0


def test_a_later_turn_supersedes_the_earlier_of_the_same_owner_only() -> None:
    earlier = label(Conversation(A, "o"), None)
    assert supersedes(Conversation(A5, "o"), earlier)
    assert not supersedes(Conversation(A5, "x"), earlier)
    assert not supersedes(Conversation(B, "o"), earlier)


def test_a_text_prompt_keys_its_whole_blocks_for_its_next_turn() -> None:
    first = request_prefix({"prompt": "x" * 1100})
    second = request_prefix({"prompt": "x" * 1100 + "y" * 400})
    assert len(first.keys) == 3 and first.stable == first.keys[:2]
    assert second.keys[:2] == first.stable
    chat = request_prefix({"messages": [{"role": "user", "content": "hi"}]})
    assert chat.stable == chat.keys


@pytest.mark.process
def test_keys_are_the_same_in_every_process() -> None:
    keys = request_prefix({"messages": [{"role": "user", "content": "hello"}]}).keys
    code = ("from router.serving.affinity import request_prefix;"
            "print(request_prefix({'messages':[{'role':'user','content':'hello'}]}).keys)")
    outputs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**os.environ, "PYTHONHASHSEED": seed},
                              check=True).stdout for seed in ("1", "2")}
    assert outputs == {f"{keys}\n"}


# -- Conversations: the index, the owners, the proof -------------------------------------------

class Child:
    base_url = "http://child"


def conversations(root: Path, preset: ModelPreset) -> Conversations:
    swaps = WarmSwaps(StateStore(root, 1 << 20), "test", cast(httpx.AsyncClient, None))
    swaps.fingerprint_of = lambda p: "0" * 64  # type: ignore[method-assign]
    return Conversations(swaps)


def saved(found: Conversations, preset: ModelPreset, conversation: Conversation,
          slot: int = 0) -> None:
    store = found.swaps.store
    pending = store.begin_save(preset.id, "0" * 64, slot)
    with open(pending.path, "wb") as handle:
        handle.write(b"K" * 64)
    commit = store.commit(pending, {"filename": pending.filename, "n_saved": 100,
                                    "n_written": 64}, label(conversation, None))
    assert commit.state is not None


@pytest.fixture
def preset(tmp_path: Path) -> ModelPreset:
    return ModelPreset(id="m", args={"model": str(tmp_path / "m.gguf")})


def test_the_longest_saved_conversation_of_the_owner_is_found(tmp_path: Path,
                                                              preset: ModelPreset) -> None:
    found = conversations(tmp_path / "s", preset)
    assert found.stored(preset, "0" * 64, A5, None) == (None, 0)
    saved(found, preset, Conversation(A[:2], "o"))
    saved(found, preset, Conversation(A, "o"), slot=1)
    saved(found, preset, Conversation(A5, "x"), slot=2)
    state, n = found.stored(preset, "0" * 64, (*A5, 16), "o")
    assert n == 3 and state is not None and labelled(state.prefix) == (3, 13, "o")
    assert found.stored(preset, "0" * 64, (*A5, 16), "x")[1] == 5
    assert found.stored(preset, "0" * 64, (*A5, 16), "y") == (None, 0)


def test_an_owner_is_a_digest_kept_across_restarts(tmp_path: Path, preset: ModelPreset) -> None:
    first = conversations(tmp_path / "s", preset)
    owner = first.owner_of(b"sk-alice", preset)
    assert owner is not None and "alice" not in owner and len(owner) == 32
    assert first.owner_of(b"", preset) is None
    shared = ModelPreset(id="m", args={}, shared_conversations=True)
    assert first.owner_of(b"sk-alice", shared) is None
    again = conversations(tmp_path / "s", preset)
    assert again.owner_of(b"sk-alice", preset) == owner
    assert again.owner_of(b"sk-bob", preset) != owner
    secret = tmp_path / "s" / SECRET_NAME
    assert (secret.stat().st_mode & 0o777) == 0o600
    assert conversations(tmp_path / "other", preset).owner_of(b"sk-alice", preset) != owner


def test_restores_that_keep_missing_turn_the_model_off(tmp_path: Path,
                                                       preset: ModelPreset) -> None:
    found = conversations(tmp_path / "s", preset)
    book = SlotBook(1, "0" * 64)
    placement = found.plan(preset, book, A, None)
    placement.restored = 400
    found.learn(preset, placement, 10, 390, 5)
    counts = found.swaps.ledger.counts["m"]
    assert counts.hits == 1 and counts.spared_tokens == 390
    assert placement.tokens == 405
    for _ in range(MISSES_TO_STOP):
        placement.restored = 400
        found.learn(preset, placement, 410, 0, 5)
    assert found.keeps(preset, "0" * 64)  # it hit once: a miss may be a changed prompt
    fresh = conversations(tmp_path / "t", preset)
    for _ in range(MISSES_TO_STOP):
        placement.restored = 400
        fresh.learn(preset, placement, 410, 0, 5)
    assert not fresh.keeps(preset, "0" * 64) and "do not restore" in (
        fresh.swaps.ledger.unrestorable("m") or "")
    assert fresh.keeps(preset, "1" * 64)  # another configuration tries again
    assert fresh.swaps.ledger.counts["m"].misses == MISSES_TO_STOP


async def test_a_displacement_save_that_hangs_holds_the_request_only_its_bound(
        tmp_path: Path, preset: ModelPreset, monkeypatch: pytest.MonkeyPatch) -> None:
    found = conversations(tmp_path / "s", preset)
    hung = asyncio.Event()

    async def hang(*args: Any) -> None:
        hung.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(found.swaps, "write_slot", hang)
    book = SlotBook(1, "0" * 64)
    book.end(book.plan(A, None, 0, always).slot, 500)
    placement = found.plan(preset, book, B, None)
    assert placement.plan is not None and placement.plan.save == Conversation(A)
    async with asyncio.timeout(5):
        await found.prepare(preset, placement, cast(Backend, Child()), 0, prefill_s=0.05)
    assert hung.is_set() and not found._keeping  # A lost (nothing kept), the request goes on
    Conversations.end(placement)
    assert not book.slots[0].busy


def test_a_slot_of_another_owner_is_erased_before_a_request_runs_there() -> None:
    book = SlotBook(1)
    book.end(book.plan(A, "alice", 0, always).slot, 10)  # not worth saving
    plan = book.plan(A5, "bob", 0, always)
    assert plan.slot == 0 and plan.erase and plan.save is None
    book.end(plan.slot, 500)
    plan = book.plan(B, "alice", 0, always)  # bob's is worth keeping: saved, then erased
    assert plan.save == Conversation(A5, "bob") and plan.erase
    book.end(plan.slot, 500)
    assert not book.plan((21, 22, 23), "alice", 0, always).erase  # her own
    book.end(0, 500)
    plan = book.plan(A5, "bob", 3, always)  # bob's own restored over alice's: erased only
    assert plan.restore_keys == 3 and plan.erase  # if that restore does not happen


def test_an_owners_request_without_keys_is_recorded_and_erased_for_another() -> None:
    """A short prompt (or a body too large to key) has no prefix keys: its slot still records
    its owner, so that another owner's request there erases it first."""
    book = SlotBook(1)
    book.end(book.plan((), "alice", 0, always).slot, 300)
    assert book.slots[0].held == Conversation((), "alice")
    plan = book.plan((), "bob", 0, always)
    assert plan.slot == 0 and plan.erase and plan.save is None  # nothing to save: no keys
    book.end(plan.slot, 300)
    assert not book.plan((), "bob", 0, always).erase  # his own


def test_a_request_without_keys_goes_to_its_owners_latest_slot() -> None:
    book = SlotBook(3)
    book.end(book.plan(A, "alice", 0, always).slot, 500)  # slot 0
    book.end(book.plan(B, "bob", 0, always).slot, 500)  # slot 1
    plan = book.plan((), "alice", 0, always)
    assert (plan.slot, plan.erase) == (0, False)


def test_a_named_slot_is_honoured_only_within_its_owners_conversations() -> None:
    book = SlotBook(2)
    book.end(book.plan(A, "alice", 0, always).slot, 500)  # slot 0: alice's
    assert book.honours(0, "alice") and book.honours(1, "bob")  # her own; an empty one
    assert not book.honours(0, "bob") and not book.honours(2, "bob")  # hers; no such slot
    plan = book.plan(B, "bob", 0, always, wanted=0)  # not honoured: the book chooses
    assert plan.slot == 1 and not plan.erase
    book.end(plan.slot, 500)
    plan = book.plan(A5, "alice", 0, always, wanted=0)
    assert plan.slot == 0 and not plan.erase
    assert not book.honours(0, "alice")  # taken now


def test_a_state_restored_without_its_owner_is_erased_for_an_owner() -> None:
    book = SlotBook(1)
    book.holding(0, None, 400)  # a state saved without its conversation's label
    assert book.plan(A, "alice", 0, always).erase


def test_an_unpinned_request_makes_every_slot_it_may_take_safe() -> None:
    """An endpoint whose body reaches the child without its ``id_slot`` (Anthropic's
    Messages): every free slot another owner's conversation may be in is erased first, and
    each free slot it may fill is of unknown owner after it, erased before another owner's."""
    book = SlotBook(3)
    for keys, owner in ((A, "alice"), (B, "bob"), ((31, 32), "carol")):
        book.plan(keys, owner, 0, always)
    for slot in range(3):
        book.end(slot, 500)
    plan = book.plan((41,), "bob", 0, always, pinned=False)  # a new conversation of bob's
    assert plan.slot == 0 and plan.erase  # the least recently used: alice's, erased
    assert plan.erase_also == (2,)  # carol's: the child may choose it; bob's own stays
    book.end(plan.slot, 500)
    for owner in ("alice", "carol"):  # every slot bob's request may have filled
        assert all(book._foreign(slot, owner) for slot in book.slots)
    assert book.plan(A5, "alice", 0, always).erase
