"""Warm swaps: a model's slots are saved before its children stop and restored into its next
children, so that a conversation's next turn comes from the prompt cache after an eviction,
an unload or the idle TTL (``--state-dir``; the files: ``statestore``).

* A child of a model with warm swaps starts with ``--slot-save-path`` set to the store's
  directory of its model and configuration (``slot_dir``; the fingerprint of its weight
  files' content (``weights``: computed before the load, once per file version, within a
  bound), the arguments that shape its KV cache and the
  llama-server build), so a state is never restored into another configuration or other
  weights; the states of another fingerprint are dropped (counted as refused) when it
  loads. A preset that sets ``slot-save-path`` itself, a remote upstream, or a model without
  a model file gets none, nor does a preset with ``warm-swaps = false`` (its states saved
  before are removed when it is applied, by a reload or at the router's start, and what a
  stop under way writes is not kept).
* ``save`` (the executor, before it stops the children for an eviction, an unload, the idle
  TTL or the router's shutdown): every slot worth it (``GET /slots``; ``worth_saving``) is
  written (``POST /slots/{id}?action=save``) under a name the store makes, then committed
  (checked against the child's answer and checksummed) in the background while the children
  stop (``keep_soon``): the model's next load and the router's own stop wait for it.
* **Decided by cost** (``worth_saving``): a slot is saved when computing its tokens again
  would take longer than saving and restoring them: its child's prompt speed (its
  ``llamacpp:prompt_tokens_seconds``, read once per save) against the model's measured bytes
  per token and milliseconds per byte of earlier saves and restores (the children's
  ``timings.save_ms`` and ``restore_ms``). Until both are known, every slot of at least
  ``MIN_TOKENS`` tokens is saved; below that, none. All of a stop's saves together get
  ``SAVE_BOUND_S``: a save that takes longer is abandoned, its temp file removed, and the
  stop goes on; a save never holds a swap longer than that.
* ``restore`` (the loader, once every new child is healthy and before the model is
  ``loaded``): the model's verified states (``restorable``, checked while the children
  start), newest first, one per slot, each into the slot it was saved from, within
  ``RESTORE_BOUND_S`` in all. A state the child refuses is discarded
  with a warning; it is never served again.
* A model removed from the configuration takes its saved states with it (``forget``).
* Prefix routing learns what a restore put in a replica: a state saved from a replica of a
  model routed by prefix (``replica-routing = prefix``, ``affinity``) keeps the replica's
  ``PREFIX_KEYS`` most recent prefix keys (``SlotHolder.recent``), and the restore hands them
  back for the replica it went into (``Restored.learned``), which starts with them, so that a
  restored conversation's next turn goes where its cache is.
* A state's slot number covers its replica: ``replica * n_slots + slot``, so that the
  replicas of a model never overwrite each other's states.

What to save, what fits and where a state goes back are pure decisions (``choice``); this
module applies them. The children are asked through the router's client for its children;
nothing here runs without a bound, and nothing it does is answered to a client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from ..children.backend import Backend
from ..config.presets import ModelPreset
from ..events import EventBus
from ..host.memory import kv_bytes_per_token
from .choice import (
    PREFIX_KEYS,
    Io,
    destinations,
    label,
    labelled,
    learn,
    prefix_keys,
    supersedes,
    timing,
    within_budget,
    worth_saving_of,
)
from .digests import CACHE_NAME, Digests
from .slotbook import Conversation, SlotBook
from .slots import SlotEndpoints
from .statestore import Commit, PendingSave, SavedState, StateStore
from .weights import Fingerprints, covers

log = logging.getLogger("router.warm")

SAVE_BOUND_S = 10.0  # all the saves of one stop together
RESTORE_BOUND_S = 10.0  # all the restores of one load together, with waiting for its states
COMMIT_BOUND_S = 30.0  # the router's stop waits for the commits under way
RECENT_WAITS = 64  # displacement waits kept per model, for their median


@dataclass
class Counts:
    """What warm swaps did for one model since the router started (``/metrics``)."""

    saved: int = 0  # states kept
    saved_bytes: int = 0
    restored: int = 0  # states a new child took
    restored_tokens: int = 0
    refused: int = 0  # states discarded: not kept at commit, refused on restore, or made
    # with other weights or settings (dropped when the model loads)
    slow_saves: int = 0  # stops whose saves were cut by SAVE_BOUND_S
    slow_restores: int = 0  # loads whose restores were cut by RESTORE_BOUND_S
    displaced: int = 0  # of ``saved``: saved before another conversation took the slot
    on_demand: int = 0  # of ``restored``: restored for the request of its conversation
    hits: int = 0  # restores whose next request found its tokens in the cache
    misses: int = 0  # restores whose next request did not (the child recomputed them)
    missed_in_row: int = 0  # of ``misses``: since the last hit
    spared_tokens: int = 0  # prompt tokens the hits took from the cache
    displace_wait_s: float = 0.0  # what displacement saves held their requests, in all
    # the last ``RECENT_WAITS`` of those waits, in seconds (for their median in ``/models``)
    recent_waits: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_WAITS))

    def waited(self, seconds: float) -> None:
        """A displacement save held its request ``seconds``."""
        self.displace_wait_s += seconds
        self.recent_waits.append(seconds)

    def kept(self, state: SavedState, displaced: bool) -> None:
        """A state was kept (``displaced``: saved before another conversation took its slot)."""
        self.saved += 1
        self.displaced += displaced
        self.saved_bytes += state.n_written

    def took(self, state: SavedState, on_demand: bool) -> None:
        """A child took a state (``on_demand``: for the request of its conversation)."""
        self.restored += 1
        self.restored_tokens += state.n_saved
        self.on_demand += on_demand

    def judged(self, hit: bool, cached: int) -> int:
        """A restore's next response found ``cached`` of its prompt tokens in the cache: enough
        (``hit``) or not. The restores missed in a row, while none has ever hit (else 0)."""
        if hit:
            self.hits += 1
            self.spared_tokens += cached
            self.missed_in_row = 0
        else:
            self.misses += 1
            self.missed_in_row += 1
        return 0 if self.hits else self.missed_in_row

    def wait_ms_p50(self) -> float | None:
        """The median of the recent displacement waits, in milliseconds; None: none yet."""
        if not self.recent_waits:
            return None
        ordered = sorted(self.recent_waits)
        return round(ordered[len(ordered) // 2] * 1000.0, 1)


class Ledger:
    """Per model, what warm swaps know of its states: what they did (``Counts``), what its
    saves and restores cost (``Io``), and the configuration whose restores do not hit (found
    out by ``Conversations``): none of that configuration's states is saved or restored any
    more, at stops, loads and displacements alike. A model forgotten starts from nothing."""

    def __init__(self) -> None:
        self.counts: dict[str, Counts] = {}
        self.io: dict[str, Io] = {}  # per model: what its saves and restores cost
        self._unrestorable: dict[str, tuple[str | None, str]] = {}  # fingerprint, why

    def counts_of(self, model_id: str) -> Counts:
        """The model's counters (made at first use)."""
        return self.counts.setdefault(model_id, Counts())

    def restores(self, model_id: str, fingerprint: str | None) -> bool:
        """Whether the model's states of ``fingerprint`` are worth saving and restoring: not
        once their restores did not hit (``do_not_restore``); another configuration (a reload
        that changes the KV settings, a new child's fingerprint) tries again."""
        off = self._unrestorable.get(model_id)
        return off is None or off[0] != fingerprint

    def do_not_restore(self, model_id: str, fingerprint: str | None, why: str) -> None:
        """Stop saving and restoring the model's states of ``fingerprint``; said once in the
        log and in ``/models`` (``unrestorable``)."""
        self._unrestorable[model_id] = (fingerprint, why)
        log.warning("conversations not kept: %s", why,
                    extra={"event": "conversations_off", "model": model_id})

    def unrestorable(self, model_id: str) -> str | None:
        """Why the model's states are not saved or restored now, if so."""
        found = self._unrestorable.get(model_id)
        return None if found is None else found[1]

    def forget(self, model_id: str) -> None:
        self.counts.pop(model_id, None)
        self.io.pop(model_id, None)
        self._unrestorable.pop(model_id, None)


class Written(NamedTuple):
    """A slot file a child wrote: the save, the child's answer, the replica's recent prefix
    keys and the conversation the slot held (as its book knew it) to keep with it, and
    whether it was saved before another conversation took the slot."""

    save: PendingSave
    answer: dict[str, Any]
    keys: list[int] | None
    conversation: Conversation | None = None
    displaced: bool = False


class Commits:
    """The commits under way in the background, one chain per model: each starts after the
    model's one before it; ``settle`` waits for them and never cancels one."""

    def __init__(self) -> None:
        self._last: dict[str, asyncio.Task[int]] = {}

    def start(self, model_id: str, commit: Callable[[], Awaitable[int]]) -> asyncio.Task[int]:
        earlier = self._last.get(model_id)

        async def in_turn() -> int:
            if earlier is not None:
                await asyncio.wait([earlier])
            return await commit()

        task = asyncio.create_task(in_turn(), name=f"keep:{model_id}")
        self._last[model_id] = task
        task.add_done_callback(lambda done: self._ended(model_id, done))
        return task

    def after(self, model_id: str, then: Callable[[], None]) -> bool:
        """Call ``then`` once the model's commits have ended; False (not called) if none is
        under way."""
        last = self._last.get(model_id)
        if last is None:
            return False
        last.add_done_callback(lambda _: then())
        return True

    async def settle(self, model_id: str | None = None, timeout: float | None = None
                     ) -> bool:
        """Wait for the commits under way (of ``model_id``, or all), ``timeout`` seconds at
        most: whether they all ended."""
        try:
            async with asyncio.timeout(timeout):  # asyncio.wait never cancels what it waits on
                while busy := [task for name, task in self._last.items()
                               if model_id is None or name == model_id]:
                    await asyncio.wait(busy)
        except TimeoutError:
            return False
        return True

    def _ended(self, model_id: str, task: asyncio.Task[int]) -> None:
        if self._last.get(model_id) is task:
            del self._last[model_id]
        if not task.cancelled() and task.exception() is not None:
            log.error("keeping the slot states failed", exc_info=task.exception(),
                      extra={"model": model_id})


async def most_tokens(preset: ModelPreset, io: Io, budget: int) -> int | None:
    """The most tokens a state of the model can hold within ``budget`` bytes, from its bytes
    per token (measured by earlier saves, ``io``, else the KV cache's from the GGUF header,
    ``memory.kv_bytes_per_token``); None when neither is known."""
    per_token = io.bytes_per_token
    if per_token is None and preset.model_path is not None:
        with contextlib.suppress(OSError, ValueError):
            per_token = await asyncio.to_thread(kv_bytes_per_token, preset.model_path,
                                                preset.args)
    return int(budget // per_token) if per_token else None


@dataclass(frozen=True)
class SlotHolder:
    """One replica as warm swaps see it: its child, the prefix keys of the prompts its
    slots served lately (most recent last; empty where the model is not routed by prefix),
    and what its slots hold as the router knows it (None: not known)."""

    child: Backend
    recent: tuple[int, ...] = ()
    book: SlotBook | None = None


@dataclass(frozen=True)
class Restored:
    """What a restore put back: how many states, and for each replica (in order) the prefix
    keys saved with the states it took, for the replica to start with."""

    count: int
    learned: tuple[tuple[int, ...], ...]
    # per replica: (slot, the conversation its state held, its tokens) for each restored
    held: tuple[tuple[tuple[int, Conversation | None, int], ...], ...] = ()


class WarmSwaps:
    def __init__(self, store: StateStore, build: str, client: httpx.AsyncClient,
                 events: EventBus | None = None, digests: Digests | None = None) -> None:
        """``events``: where a model's saved states are announced when they change
        (``slot_states``, on ``/models/sse``); ``digests``: the model files' content
        (default: kept in the store's directory)."""
        self.store = store
        self._child = SlotEndpoints(client)  # the children's slot endpoints
        self._events = events
        self.prints = Fingerprints(store, build, digests if digests is not None
                                   else Digests(store.root / CACHE_NAME))
        self._off: set[str] = set()  # models whose preset now says ``warm-swaps = false``
        self.ledger = Ledger()
        self._keeping = Commits()  # per model: its commit under way

    def usage(self, model_id: str) -> tuple[int, int]:
        """The model's saved states now: how many, and their bytes."""
        return self.store.usage().get(model_id, (0, 0))

    def _announce(self, model_id: str) -> None:
        if self._events is not None:
            count, size = self.usage(model_id)
            self._events.publish(model_id, "slot_states", {"count": count, "bytes": size})

    # ----------------------------------------------------------------- configuration

    covers = staticmethod(covers)

    def fingerprint_of(self, preset: ModelPreset) -> str | None:
        """The fingerprint of the preset's configuration (``weights.Fingerprints``); None when
        it gets no warm swaps, or not yet. A preset with warm swaps turned off has what its
        model saved removed, and what a stop under way writes is not kept (``keep``)."""
        if not preset.warm_swaps:
            self._off.add(preset.id)
            self.forget(preset.id)
            return None
        self._off.discard(preset.id)
        return self.prints.of(preset)

    async def prepare(self, preset: ModelPreset) -> None:
        """Before a load: its weights' content (``weights.Fingerprints.prepare``)."""
        if self.fingerprint_of(preset) is None:
            await self.prints.prepare(preset)

    def drop_turned_off(self, presets: Iterable[ModelPreset]) -> None:
        """Remove what the models with ``warm-swaps = false`` saved while it was on (at the
        router's start; later, ``fingerprint_of`` does it when such a model loads or stops)."""
        for preset in presets:
            if not preset.warm_swaps:
                self.fingerprint_of(preset)

    def slot_dir(self, preset: ModelPreset) -> Path | None:
        """The ``--slot-save-path`` of the preset's children, or None."""
        found = self.fingerprint_of(preset)
        return None if found is None else self.store.directory(preset.id, found)

    def forget(self, model_id: str) -> None:
        """Remove every saved state of a model whose preset is gone (it no longer runs), and
        its counters, its costs and its fingerprint: a model added again under the same id
        starts from nothing (but ``warm-swaps = false``, which its next preset says again).
        What a commit under way keeps goes too, once it is kept."""
        if self._keeping.after(model_id, lambda: self.forget(model_id)):
            return
        self.prints.forget(model_id)
        self.ledger.forget(model_id)
        try:
            removed = self.store.remove_model(model_id)
        except (OSError, ValueError) as exc:
            log.warning("cannot remove the saved slot states: %s", exc,
                        extra={"model": model_id})
            return
        if removed:
            log.info("removed %d saved slot states with the model", removed,
                     extra={"event": "state_removed", "model": model_id})
            self._announce(model_id)

    # ----------------------------------------------------------------- saving

    def keep_soon(self, preset: ModelPreset, written: Sequence[Written]) -> asyncio.Task[int]:
        """``keep`` in the background (after the model's earlier commit, if one is under way):
        the stop that wrote them need not wait, and the model's next load does
        (``restorable``), as does the router's own stop (``settle``); its task."""
        return self._keeping.start(preset.id, lambda: self.keep(preset, written))

    async def settle(self, model_id: str | None = None) -> None:
        """Until the commits under way (of ``model_id``, or all) have ended; the router's stop
        (all of them) waits ``COMMIT_BOUND_S`` at most, then leaves them (a stalled disk: their
        temp files are removed at the next start)."""
        if model_id is not None:
            await self._keeping.settle(model_id)
        elif not await self._keeping.settle(timeout=COMMIT_BOUND_S):
            log.warning("keeping the saved slot states took over %g s; stopping without them",
                        COMMIT_BOUND_S, extra={"event": "state_save_slow"})

    async def save(self, preset: ModelPreset, replicas: Sequence[SlotHolder]) -> int:
        """Save the worthwhile slots of the model's ``replicas`` (in order): ``write`` then
        ``keep``; how many were kept."""
        return await self.keep(preset, await self.write(preset, replicas))

    async def write(self, preset: ModelPreset, replicas: Sequence[SlotHolder]
                    ) -> list[Written]:
        """Have the children write their worthwhile slots, within ``SAVE_BOUND_S``: what they
        wrote, for ``keep``. A save cut off or failed is abandoned (its file removed). The
        children are done with the files once this returns: ``keep`` (checksums, renames) may
        run while they stop."""
        found = self.fingerprint_of(preset)
        if found is None or not replicas or not self.ledger.restores(preset.id, found):
            return []
        written: list[Written] = []
        pending: list[PendingSave] = []
        try:
            async with asyncio.timeout(SAVE_BOUND_S):
                for index, replica in enumerate(replicas):
                    keys = list(replica.recent[-PREFIX_KEYS:]) if preset.prefix_routing \
                        else None
                    await self._save_child(preset, found, index, replica, keys, pending,
                                           written)
        except TimeoutError:
            self.ledger.counts_of(preset.id).slow_saves += 1
            log.warning("saving slot states took over %g s; stopping without the rest",
                        SAVE_BOUND_S, extra={"event": "state_save_slow", "model": preset.id})
        finally:
            for left in pending:  # cut off, or failed: its temp file goes
                await asyncio.to_thread(self.store.abandon, left)
        return written

    async def keep(self, preset: ModelPreset, written: Sequence[Written]) -> int:
        """Commit what the children wrote (checked against their answers, checksummed,
        renamed; ``statestore``); how many were kept. Never raises but a cancel: it runs
        beside the children's stop."""
        model_id = preset.id
        if model_id in self._off:  # turned off since the stop began: its files go
            for save, *_ in written:
                await asyncio.to_thread(self.store.abandon, save)
            return 0
        io = self.ledger.io.setdefault(model_id, Io())
        counts = self.ledger.counts_of(model_id)
        kept: list[SavedState] = []
        try:
            for one in written:
                commit = await _commit(self.store, one)
                if commit.state is not None:
                    kept.append(commit.state)
                    counts.kept(commit.state, one.displaced)
                    learn(io, commit.state.n_saved, commit.state.n_written,
                          timing(one.answer, "save_ms"), "save")
                elif commit.problem:
                    counts.refused += 1
                    log.warning("slot %d not saved: %s", one.save.slot, commit.problem,
                                extra={"model": model_id})
        finally:
            if self.fingerprint_of(preset) is not None:
                self._announce(model_id)
        if kept:
            log.info("saved %d slot states (%d tokens, %d bytes)", len(kept),
                     sum(s.n_saved for s in kept), sum(s.n_written for s in kept),
                     extra={"event": "state_saved", "model": model_id})
        return len(kept)

    async def _save_child(self, preset: ModelPreset, found: str, index: int,
                          replica: SlotHolder, keys: list[int] | None,
                          pending: list[PendingSave], written: list[Written]) -> None:
        """Have the replica's child write the slots worth saving (``choice.worth_saving_of``)
        that its book does not know to be saved already; a slot of more tokens than the whole
        budget holds is never asked for (``within_budget``): its file could never be kept."""
        model_id = preset.id
        child, book = replica.child, replica.book
        slots = await self._child.slots(child)
        io = self.ledger.io.setdefault(model_id, Io())
        speed = await self._child.prompt_speed(child) if io.cost_ms(1) is not None else None
        wanted = [(slot_id, tokens) for slot_id, tokens in worth_saving_of(slots, speed, io)
                  if book is None or slot_id >= book.n_slots
                  or not (book.slots[slot_id].saved and book.slots[slot_id].held)]
        if not wanted:
            return
        fits, over = within_budget(wanted, await most_tokens(preset, io,
                                                             self.store.budget_bytes))
        for slot_id, tokens in over:  # never written, never refused later
            self.ledger.counts_of(model_id).refused += 1
            log.info("slot %s not saved: %d tokens, over the whole state budget", slot_id,
                     tokens, extra={"event": "state_over_budget", "model": model_id})
        for slot_id, _ in fits:
            number = index * len(slots) + slot_id
            save = await asyncio.to_thread(self.store.begin_save, model_id, found, number)
            pending.append(save)
            answer = await self._child.action(child, slot_id, "save", save.filename)
            if answer is None:
                continue  # abandoned with the others
            pending.remove(save)
            held = book.slots[slot_id].held if book is not None and slot_id < book.n_slots \
                else None
            written.append(Written(save, answer, keys or None, held))

    async def write_slot(self, preset: ModelPreset, found: str | None, child: Backend,
                         slot: int, number: int, conversation: Conversation
                         ) -> Written | None:
        """Have ``child`` (whose states are of fingerprint ``found``, as it started) write
        ``slot`` (labelled ``conversation``, numbered ``number``), for another conversation
        about to take it; what it wrote, for ``keep_soon``, or None when it wrote nothing.
        Unbounded: the caller bounds it; cut off, its file goes."""
        if found is None:
            return None
        save = await asyncio.to_thread(self.store.begin_save, preset.id, found, number)
        answer = None
        try:
            answer = await self._child.action(child, slot, "save", save.filename)
        finally:
            if answer is None:  # failed, or cut off (a cancel): its temp file goes
                await asyncio.to_thread(self.store.abandon, save)
        return None if answer is None else Written(save, answer, None, conversation,
                                                   displaced=True)

    def displaced_wait(self, model_id: str, seconds: float) -> None:
        """A displacement save (``write_slot``) held its request ``seconds``."""
        self.ledger.counts_of(model_id).waited(seconds)

    async def erase_slot(self, child: Backend, slot: int) -> bool:
        """Have ``child`` forget what ``slot`` holds (``action=erase``); whether it did."""
        return await self._child.action(child, slot, "erase", "") is not None

    # ----------------------------------------------------------------- restoring

    async def restorable(self, preset: ModelPreset) -> list[SavedState]:
        """The model's states a new child may take, each verified (read and checksummed)
        now: the loader asks while the children start, so that this costs the load nothing.
        Never raises but a cancel: a state directory that cannot be read means a cold load."""
        found = self.fingerprint_of(preset)
        if found is None:
            return []
        await self.settle(preset.id)  # a state its last stop is keeping is among them
        try:
            stale = await asyncio.to_thread(self.store.drop_stale, preset.id, found)
            self.ledger.counts_of(preset.id).refused += stale  # made with other weights or settings
            return await asyncio.to_thread(self.store.states, preset.id, found)
        except (OSError, ValueError) as exc:  # the load goes on, cold
            log.warning("cannot read the saved slot states: %s", exc, extra={"model": preset.id})
            return []

    async def restore(self, preset: ModelPreset, replicas: Sequence[SlotHolder],
                      restorable: Awaitable[list[SavedState]] | None = None) -> Restored:
        """Restore the model's states (``restorable``, started earlier; None: asked now) into
        its new ``replicas`` (in order, not serving yet) within ``RESTORE_BOUND_S``, waiting
        for them included (a commit or a check that stalls never holds the load longer); how
        many were restored, and the prefix keys each replica learned."""
        learned: list[tuple[int, ...]] = [() for _ in replicas]
        held: list[tuple[tuple[int, Conversation | None, int], ...]] = [() for _ in replicas]
        found = self.fingerprint_of(preset)
        if found is None or not replicas or not self.ledger.restores(preset.id, found):
            return Restored(0, tuple(learned), tuple(held))
        restored = 0
        states: list[SavedState] = []
        try:
            async with asyncio.timeout(RESTORE_BOUND_S):
                states = await (restorable or self.restorable(preset))
                n_slots = len(await self._child.slots(replicas[0].child)) if states else 0
                for index, slot, state in destinations(states, [s.slot for s in states],
                                                       n_slots, len(replicas)):
                    if await self.restore_one(preset.id, replicas[index].child, slot, state):
                        restored += 1
                        learned[index] += prefix_keys(state.prefix)
                        held[index] += ((slot, conversation_of(state.prefix),
                                         state.n_saved),)
        except TimeoutError:
            self.ledger.counts_of(preset.id).slow_restores += 1
            log.warning("restoring slot states took over %g s; serving without the rest",
                        RESTORE_BOUND_S, extra={"event": "state_restore_slow",
                                                "model": preset.id})
        if states:
            self._announce(preset.id)
        if restored:
            log.info("restored %d slot states", restored,
                     extra={"event": "state_restored", "model": preset.id})
        return Restored(restored, tuple(learned), tuple(held))

    async def restore_one(self, model_id: str, child: Backend, slot: int,
                          state: SavedState, on_demand: bool = False) -> bool:
        """Restore ``state`` into ``slot`` of ``child`` (``on_demand``: for the request of its
        conversation, ``Conversations``); one the child refuses is discarded."""
        answer = await self._child.action(child, slot, "restore", state.filename)
        counts = self.ledger.counts_of(model_id)
        if answer is None or answer.get("n_restored") != state.n_saved:
            log.warning("slot state %s refused by the child: discarded", state.filename,
                        extra={"event": "state_refused", "model": model_id})
            await asyncio.to_thread(self.store.discard, state)
            counts.refused += 1
            return False
        await asyncio.to_thread(self.store.touch, state)
        learn(self.ledger.io.setdefault(model_id, Io()), state.n_saved, state.n_written,
              timing(answer, "restore_ms"), "restore")
        counts.took(state, on_demand)
        return True

    def restore_judged(self, model_id: str, hit: bool, cached: int) -> int:
        """A restore on demand hit or missed (``Counts.judged``): the misses in a row, none hit."""
        return self.ledger.counts_of(model_id).judged(hit, cached)

    def do_not_restore(self, model_id: str, fingerprint: str | None, why: str) -> None:
        """Save and restore none of the model's states of ``fingerprint`` any more (``Ledger``)."""
        self.ledger.do_not_restore(model_id, fingerprint, why)


def conversation_of(prefix: Any) -> Conversation | None:
    """The conversation a state's label names, as a slot's book holds it: only its last key
    is known (the earlier ones stand as 0: nothing is taken to be an earlier turn of it)."""
    found = labelled(prefix)
    if found is None:
        return None
    n, key, owner = found
    return Conversation((0,) * (n - 1) + (key,), owner)


async def _commit(store: StateStore, written: Written) -> Commit:
    """Commit what a child wrote (``StateStore.commit``); one that cannot be is abandoned, its
    problem said in the ``Commit``: never the stop's failure."""
    save, answer, keys, conversation, _ = written
    try:
        return await asyncio.to_thread(store.commit, save, answer, label(conversation, keys),
                                       _replaces(conversation, save.slot))
    except (OSError, ValueError) as exc:
        await asyncio.to_thread(store.abandon, save)
        return Commit(None, f"cannot keep it ({exc})")


def _replaces(conversation: Conversation | None, number: int
              ) -> Callable[[SavedState], bool]:
    """Which older states a new one of ``conversation`` saved as slot ``number`` makes
    useless: the earlier turns of its conversation, and an unlabelled state of its slot."""
    def replaces(older: SavedState) -> bool:
        if labelled(older.prefix) is None:
            return older.slot == number
        return conversation is not None and supersedes(conversation, older.prefix)
    return replaces
