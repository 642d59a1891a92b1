"""Every conversation keeps its cache: a model's conversations, not only those in a slot when
its child stops, come back warm after slot churn, a swap or a restart.

llama-server keeps a conversation's KV cache in its slot, and in its RAM prompt cache once
another takes the slot, until the child stops. The router keeps the conversations worth it on
disk, in the store of warm swaps (``statestore``), each labelled with the prefix keys of its
last prompt and its owner (``choice.label``). For a request to a replica whose slots it knows
(``slotbook.SlotBook``), ``place`` decides before the request goes:

* **Its conversation is in a free slot**: it runs there (``id_slot``); nothing else happens
  (the hot path: no extra request to the child, no wait).
* **Another conversation worth keeping would lose its slot**: that slot is saved first
  (``POST /slots/{id}?action=save``), within the request's bound: ``DISPLACE_BOUND_S``, and
  never longer than computing the request's own prompt is expected to take (its replica's
  pace). A save that fails or runs past it loses that state, never the request.
* **Its conversation is on disk with more of its prompt than any free slot holds** (the
  longest saved prefix, ``stored``): that state is checked (``StateStore.verify``) and
  restored into the slot first, within ``RESTORE_BOUND_S``.
* **No slot is free** (rare: the router's slot queue forwards a completion only to a free
  slot): the child queues it and chooses (the book follows, ``SlotBook.end``).

A restore is proven by the next response (``learn``): its ``timings.cache_n`` must cover at
least ``HIT_SHARE`` of the tokens restored. A model whose restores keep missing
(``MISSES_TO_STOP`` in a row with no hit: llama.cpp's sliding-window and hybrid models can
restore a state and still compute the whole prompt again) stops saving and restoring
conversations, at its stops too (``WarmSwaps.do_not_restore``); it says why once in the log
and in ``/models`` (``off``).

Privacy: with API keys, a state's owner is a keyed digest of the key that made it
(``owner_of``: an HMAC under a secret kept in the state directory, so that it holds across
restarts and says nothing elsewhere); it is restored only for that key. A preset with
``shared-conversations = true`` shares its states among keys (a common system prompt): a
shared prompt cache lets one key learn from a faster answer that another sent the same prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from .. import otel
from ..children.backend import Backend
from ..config.presets import ModelPreset
from .choice import Io, covers, labelled, worth_saving
from .slotbook import Conversation, Plan, SlotBook, Waiting
from .statestore import SavedState, open_regular
from .swaps import WarmSwaps, Written

log = logging.getLogger("router.conversations")

DISPLACE_BOUND_S: Final = 2.0  # a displacement save holds the request that takes the slot
RESTORE_BOUND_S: Final = 10.0  # a restore on demand: checking the file and the child's read
HIT_SHARE: Final = 0.5  # of the restored tokens, the share the next response must find cached
MISSES_TO_STOP: Final = 3  # restores in a row that missed, with none ever hitting
SECRET_NAME: Final = "owners.key"  # under the state directory, 0600


@dataclass(eq=False, slots=True)
class SlotUse:
    """Where one request ran and what was done for it, for ``learn`` and ``end``."""

    book: SlotBook
    slot: int | None  # None: the child chose (``waiting``)
    waiting: Waiting | None = None
    plan: Plan | None = None
    state: SavedState | None = None  # the saved state to restore first
    keeping: asyncio.Task[int] | None = None  # or the commit of its state, to wait for first
    keys: tuple[int, ...] = ()
    owner: str | None = None
    restored: int = 0  # tokens restored into the slot for it
    tokens: int | None = None  # what the slot holds after it (its timings), once known


class Conversations:
    """The conversations of the models with warm swaps, kept on disk (module docstring)."""

    def __init__(self, swaps: WarmSwaps) -> None:
        self.swaps = swaps
        self._secret: bytes | None = None  # read at the first request with a key
        self._index: dict[str, tuple[object, dict[int, list[SavedState]]]] = {}
        # per model: the conversations saved on displacement whose commit is under way
        self._keeping: dict[str, dict[Conversation, asyncio.Task[int]]] = {}

    def keeps(self, preset: ModelPreset, fingerprint: str | None = None) -> bool:
        """Whether the model can keep its conversations (warm swaps cover it), and with a
        child's ``fingerprint``, whether that child does: not when the restores of that
        configuration did not hit (another configuration, a reload, tries again)."""
        return self.swaps.covers(preset) and (
            fingerprint is None or self.swaps.ledger.restores(preset.id, fingerprint))

    def forget(self, model_id: str) -> None:
        """A removed model (``EventBus.on_removed``): nothing of its conversations stays."""
        self._index.pop(model_id, None)
        self._keeping.pop(model_id, None)

    def owner_of(self, credential: bytes, preset: ModelPreset) -> str | None:
        """Who may have a request's conversation restored: None (anyone) without a key or
        for a preset that shares them; else a digest of the key that says nothing elsewhere."""
        if not preset.private_to(bool(credential)):
            return None
        if self._secret is None:
            self._secret = _secret(self.swaps.store.root)
        return hmac.new(self._secret, credential, hashlib.sha256).hexdigest()[:32]

    def stored(self, preset: ModelPreset, fingerprint: str | None, keys: Sequence[int],
               owner: str | None) -> tuple[SavedState | None, int]:
        """The saved state of ``fingerprint`` (a child's: ``SlotBook.fingerprint``) that
        covers most of a request's ``keys`` for ``owner`` (most recently used first among
        equals), and how many keys; (None, 0) when none does."""
        if fingerprint is None:
            return None, 0
        index = self._states(preset.id, fingerprint)
        for position in range(len(keys) - 1, -1, -1):
            for state in index.get(keys[position], ()):
                if covers(state.prefix, keys, owner):
                    return state, position + 1
        return None, 0

    def _being_kept(self, preset: ModelPreset, keys: Sequence[int], owner: str | None
                    ) -> tuple[asyncio.Task[int] | None, int]:
        """The commit under way of a state saved on displacement that covers most of the
        request's ``keys``, and how many: its request waits for it rather than compute it
        all again."""
        best: tuple[asyncio.Task[int] | None, int] = (None, 0)
        for conversation, task in self._keeping.get(preset.id, {}).items():
            n = conversation.covers(keys, owner)
            if n > best[1]:
                best = (task, n)
        return best

    def _states(self, model_id: str, fingerprint: str) -> dict[int, list[SavedState]]:
        """The model's states of ``fingerprint`` by the last key of their conversation, as the
        store holds them now (rebuilt when the store changed)."""
        version = (self.swaps.store.version, fingerprint)
        cached = self._index.get(model_id)
        if cached is not None and cached[0] == version:
            return cached[1]
        index: dict[int, list[SavedState]] = {}
        for state in sorted(self.swaps.store.listed(model_id, fingerprint),
                            key=lambda s: -s.last_used):
            label = labelled(state.prefix)
            if label is not None:
                index.setdefault(label[1], []).append(state)
        self._index[model_id] = (version, index)
        return index

    def plan(self, preset: ModelPreset, book: SlotBook, keys: Sequence[int],
             owner: str | None, wanted: int | None = None, pinned: bool = True
             ) -> SlotUse:
        """A request's slot, taken at once (no await: nothing can take it meanwhile), and
        what must happen before it runs there (``prepare``); ``wanted``: the slot it names,
        ``pinned``: whether the child runs it in the slot it is sent to (``SlotBook.plan``)."""
        state, stored = self.stored(preset, book.fingerprint, keys, owner) if keys \
            else (None, 0)
        keeping, kept = self._being_kept(preset, keys, owner) if keys else (None, 0)
        io = self.swaps.ledger.io.get(preset.id) or Io()
        plan = book.plan(keys, owner, max(stored, kept),
                         lambda tokens: worth_saving(tokens, None, io), wanted, pinned)
        waiting = None if plan.slot is not None else book.waiting[-1]
        if not plan.restore_keys:
            return SlotUse(book, plan.slot, waiting, plan)
        if kept > stored:  # its state is being kept: restored once it is
            return SlotUse(book, plan.slot, waiting, plan, None, keeping, tuple(keys), owner)
        return SlotUse(book, plan.slot, waiting, plan, state)

    async def prepare(self, preset: ModelPreset, slot_use: SlotUse, child: Backend,
                      number: int, prefill_s: float | None) -> None:
        """Do what the request's slot needs first (module docstring): save the conversation
        it displaces, restore its own. ``number``: the first state number of this replica's
        slots (``replica * n_slots``); ``prefill_s``: how long computing the request's prompt
        is expected to take (None: not known). Never raises but a cancel."""
        slot, plan = slot_use.slot, slot_use.plan
        if slot is None or plan is None:
            return
        written = None
        if plan.save is not None:
            bound = DISPLACE_BOUND_S if prefill_s is None else min(DISPLACE_BOUND_S, prefill_s)
            log.info("saving slot %d before another conversation takes it (%d tokens, "
                     "%.3g s at most)", slot, plan.save_tokens, bound,
                     extra={"event": "state_displacing", "model": preset.id})
            began = time.perf_counter()
            try:
                with contextlib.suppress(TimeoutError), otel.span(
                        "warm save", attributes={"llama_router.model": preset.id,
                                                 "llama_router.warm.displaced": True,
                                                 "llama_router.slot": slot}):
                    async with asyncio.timeout(bound):
                        written = await self.swaps.write_slot(
                            preset, slot_use.book.fingerprint, child, slot, number + slot,
                            plan.save)
            finally:
                self.swaps.displaced_wait(preset.id, time.perf_counter() - began)
        try:
            await self._restore_for(preset, slot_use, child, slot)
            if plan.erase and not slot_use.restored:  # another owner's conversation: its
                await self._bounded(self.swaps.erase_slot(child, slot),  # prefix must not
                                    RESTORE_BOUND_S)  # serve this request
            for other in plan.erase_also:  # the child may choose these too (not pinned)
                await self._bounded(self.swaps.erase_slot(child, other), RESTORE_BOUND_S)
        finally:  # kept once the restore read its own state: its budget may drop that one
            if written is not None:
                self._keep(preset, written)

    async def _restore_for(self, preset: ModelPreset, slot_use: SlotUse, child: Backend,
                           slot: int) -> None:
        """Restore the request's own conversation into ``slot``, if it has one saved that
        covers more than the slot holds: found at its plan, or once its commit ends."""
        state = slot_use.state
        if slot_use.keeping is not None:  # its own state, saved a moment ago
            await asyncio.wait([slot_use.keeping], timeout=RESTORE_BOUND_S)
            state, _ = self.stored(preset, slot_use.book.fingerprint, slot_use.keys,
                                   slot_use.owner)
        if state is None:
            return
        with otel.span("warm restore", attributes={"llama_router.model": preset.id,
                                                   "llama_router.warm.on_demand": True,
                                                   "llama_router.slot": slot}) as span:
            if await self._bounded(self._restore(preset, child, slot, state), RESTORE_BOUND_S):
                slot_use.restored = state.n_saved
                slot_use.book.restored(slot, state.n_saved)
            if span is not None:
                span.set_attribute("llama_router.warm.states", 1 if slot_use.restored else 0)

    def _keep(self, preset: ModelPreset, written: Written) -> None:
        """Commit a state saved on displacement in the background; it is known as under way
        until it ends (``_being_kept``)."""
        conversation = written.conversation
        task = self.swaps.keep_soon(preset, [written])
        if conversation is None:
            return
        keeping = self._keeping.setdefault(preset.id, {})
        keeping[conversation] = task
        task.add_done_callback(
            lambda done: keeping.pop(conversation) if keeping.get(conversation) is done
            else None)

    @staticmethod
    async def _bounded(work: Coroutine[Any, Any, bool], bound: float) -> bool:
        """``work`` within ``bound`` seconds: False when it ran past it (cut off) or failed."""
        try:
            async with asyncio.timeout(bound):
                return await work
        except TimeoutError:
            return False

    async def _restore(self, preset: ModelPreset, child: Backend, slot: int,
                       state: SavedState) -> bool:
        if not await asyncio.to_thread(self.swaps.store.verify, state):
            return False
        return await self.swaps.restore_one(preset.id, child, slot, state, on_demand=True)

    def learn(self, preset: ModelPreset, slot_use: SlotUse, computed: int, cached: int,
              generated: int) -> None:
        """What the request's response says of its slot (its ``timings``: prompt tokens
        ``computed`` and ``cached``, tokens ``generated``): the tokens it holds now, and for a
        restore, whether it hit (module docstring)."""
        slot_use.tokens = computed + cached + generated
        if not slot_use.restored:
            return
        wanted = min(slot_use.restored, computed + cached)
        missed = self.swaps.restore_judged(preset.id, cached >= HIT_SHARE * wanted, cached)
        fingerprint = slot_use.book.fingerprint
        if missed >= MISSES_TO_STOP and self.keeps(preset, fingerprint):
            self.swaps.do_not_restore(preset.id, fingerprint, (
                f"{missed} restores in a row found none of their tokens cached: "
                "this model's states do not restore (llama.cpp: sliding-window or hybrid "
                "models)"))

    @staticmethod
    def end(slot_use: SlotUse) -> None:
        """The request's response ended: its slot is free (or taken by the oldest queued)."""
        slot_use.book.end(slot_use.slot, slot_use.tokens, slot_use.waiting)


def _secret(root: Path) -> bytes:
    """The state directory's secret for owners' digests (made once, 0600; read as a regular
    file only: ``statestore.open_regular``)."""
    path = root / SECRET_NAME
    try:
        fd = open_regular(path)  # a link, a FIFO...: refused at once, never waited on
        with os.fdopen(fd, "rb") as handle:
            secret = handle.read(64)
        if len(secret) == 32:
            return secret
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot read the owners' secret %s (%s): making another", path,
                    exc.strerror)
    secret = secrets.token_bytes(32)
    temp = root / f".{SECRET_NAME}.{secrets.token_hex(4)}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(secret)
    os.replace(temp, path)
    return secret
