"""Which saved slot states a model's child may take: the files its KV cache depends on
(``weight_files``) and the fingerprint of its configuration (``Fingerprints``), for warm
swaps (``warm``).

A state is valid only in the weights and settings that computed it: the fingerprint covers
the *content* of the model (every shard), its projector, each LoRA adapter and control vector
(``digests``: once per file version), the arguments that shape the KV cache
(``statestore.kv_args``) and the llama-server build. A load learns the digests first
(``prepare``, bounded by ``DIGEST_BOUND_S``); until they are known the model has no
fingerprint, and a child started then gets no warm swaps.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path

from ..config.presets import ModelPreset
from ..host.memory import shard_paths
from .digests import Digests
from .statestore import StateStore, fingerprint, kv_args

log = logging.getLogger("router.warm")

DIGEST_BOUND_S = 3.0  # a load waits this long for its weight files' digests (``prepare``)
# The arguments naming files whose content the KV cache depends on: comma lists, the scaled
# ones of ``FILE:SCALE``.
_FILE_ARGS = ("lora", "control-vector", "lora-scaled", "control-vector-scaled")


def covers(preset: ModelPreset) -> bool:
    """Whether the preset's model can have warm swaps at all (no file is read)."""
    return preset.warm_swaps and preset.upstream is None \
        and preset.model_path is not None and "slot-save-path" not in preset.args


def weight_files(preset: ModelPreset) -> list[Path]:
    """The files whose content a child's KV cache depends on: the model (every shard of a
    split GGUF), its multimodal projector, and each LoRA adapter and control vector
    (``--lora``, ``--lora-scaled``, ``--control-vector``, ``--control-vector-scaled``)."""
    assert preset.model_path is not None
    files = shard_paths(Path(preset.model_path))
    if preset.args.get("mmproj"):
        files.append(Path(preset.args["mmproj"]))
    counted = kv_args(preset.args)
    for name in _FILE_ARGS:
        for item in counted.get(name, "").split(","):
            item = item.strip()
            if name.endswith("scaled"):
                item = item.rpartition(":")[0] or item
            if item:
                files.append(Path(item))
    return files


class Fingerprints:
    """The fingerprint of each preset's configuration, by its weights' content."""

    def __init__(self, store: StateStore, build: str, digests: Digests) -> None:
        self.store = store
        self.digests = digests
        self._build = build
        self._known: dict[str, tuple[ModelPreset, tuple[str, ...], str]] = {}
        self._unreadable: set[str] = set()  # models whose files were found missing (logged)

    def of(self, preset: ModelPreset) -> str | None:
        """The preset's fingerprint; None when it gets no warm swaps (``covers``), its files
        cannot be read, or their content is not known yet (``prepare``). A few ``stat``
        calls: a file replaced since the last call is another version, whose digest is not
        known until it is computed."""
        if not covers(preset):
            return None
        files = weight_files(preset)
        digests = self.digests.known_all(files)
        if digests is None:
            self._missing(preset, files)
            return None
        known = self._known.get(preset.id)
        if known is not None and known[0] is preset and known[1] == tuple(digests):
            return known[2]
        try:
            found = fingerprint(digests, preset.args, self._build)
            self.store.directory(preset.id, found)
        except (OSError, ValueError) as exc:
            log.warning("no warm swaps for this model: %s", exc, extra={"model": preset.id})
            return None
        self._known[preset.id] = (preset, tuple(digests), found)
        return found

    async def prepare(self, preset: ModelPreset) -> None:
        """Before a load of the preset's model: the content of its weight files, computed
        now if it is not known (a new file, or one replaced since), within
        ``DIGEST_BOUND_S``; past that the load goes on without warm swaps and the digests are
        finished in the background, for its next load."""
        if self.of(preset) is not None or not covers(preset):
            return
        try:
            async with asyncio.timeout(DIGEST_BOUND_S):
                await self.digests.compute(weight_files(preset))
        except TimeoutError:
            log.info("reading the model's files to fingerprint them takes longer than %g s: "
                     "this load goes without warm swaps, the next one has them",
                     DIGEST_BOUND_S, extra={"model": preset.id})

    def forget(self, model_id: str) -> None:
        self._known.pop(model_id, None)
        self._unreadable.discard(model_id)

    def _missing(self, preset: ModelPreset, files: Sequence[Path]) -> None:
        """Say once why a model whose files cannot be read gets no warm swaps."""
        gone = [str(path) for path in files if not path.is_file()]
        if gone and preset.id not in self._unreadable:
            self._unreadable.add(preset.id)
            log.warning("no warm swaps for this model: cannot read %s", ", ".join(gone),
                        extra={"model": preset.id})
        elif not gone:
            self._unreadable.discard(preset.id)
