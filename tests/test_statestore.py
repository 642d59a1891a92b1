"""The router's directory of saved slot states (router/warm/statestore.py), on tmp_path: files are
written the way llama-server writes them (``--slot-save-path DIR`` plus the filename sent in
``POST /slots/{id}?action=save``), the child's answers are made up; no process starts."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.llama.flags import FlagTable
from router.warm import statestore
from router.warm.statestore import (
    KV_ARGS,
    MAX_SLOT,
    MODEL_ID_MAX_BYTES,
    PREFIX_MAX_BYTES,
    Commit,
    PendingSave,
    SavedState,
    StateStore,
    fingerprint,
    kv_args,
    model_dir_name,
)

MODEL = "org/model:Q4_K_M"
BUILD = "b11434"
STORE_NAME = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*")


class Clock:
    """A wall clock the test moves."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def accepted_by_llama_server(name: str) -> bool:
    """llama-server's slot filename rules (``fs_validate_filename``), as the contract tests
    found them: no path separators, no ``..``, no control characters, none of ``:*?"<>|``, no
    leading or trailing space, no trailing dot, at most 255 bytes. And the store's own:
    never a leading dot."""
    raw = name.encode("utf-8", "surrogatepass")
    return (0 < len(raw) <= 255 and ".." not in name
            and not any(ord(c) < 0x20 or ord(c) == 0x7F or c in '/\\:*?"<>|' for c in name)
            and name[0] not in " ." and name[-1] not in " .")


def safe(name: str) -> bool:
    return accepted_by_llama_server(name) and bool(STORE_NAME.fullmatch(name))


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "models" / "model.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF" + bytes(60))
    return path


def content(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def fp(model_file: Path) -> str:
    return fingerprint([content(model_file)], {"ctx-size": "4096", "parallel": "2"}, BUILD)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def store(root: Path, clock: Clock) -> StateStore:
    return StateStore(root, 1 << 20, clock=clock)


def write_like_the_child(pending: PendingSave, data: bytes) -> None:
    """llama-server opens ``slot_save_path + filename`` and writes it directly."""
    with open(str(pending.directory) + "/" + pending.filename, "wb") as handle:
        handle.write(data)


def answer(pending: PendingSave, data: bytes, n_saved: int = 12) -> dict[str, Any]:
    return {"id_slot": pending.slot, "filename": pending.filename, "n_saved": n_saved,
            "n_written": len(data), "timings": {"save_ms": 0.5}}


def save(store: StateStore, fp: str, slot: int = 0, data: bytes = b"K" * 100,
         model: str = MODEL, prefix: Any = None) -> Commit:
    pending = store.begin_save(model, fp, slot)
    write_like_the_child(pending, data)
    return store.commit(pending, answer(pending, data), prefix=prefix)


def kept(commit: Commit) -> SavedState:
    assert commit.state is not None, commit.problem
    return commit.state


def store_files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")
            if p.is_file() or p.is_symlink()}


# ---- round trip --------------------------------------------------------------------------

def test_a_saved_state_round_trips(store: StateStore, fp: str, root: Path) -> None:
    directory = store.directory(MODEL, fp)
    assert directory.is_dir() and directory.parent.parent == root
    assert (root.stat().st_mode & 0o777) == 0o700
    pending = store.begin_save(MODEL, fp, 1)
    assert pending.directory == directory and not pending.path.exists()
    data = os.urandom(4096)
    write_like_the_child(pending, data)
    state = kept(store.commit(pending, answer(pending, data), prefix={"keys": [1, 2, 3]}))
    assert not pending.path.exists()
    assert state.path.parent == directory and state.path.read_bytes() == data
    assert (state.model_id, state.fingerprint, state.slot) == (MODEL, fp, 1)
    assert (state.n_saved, state.n_written) == (12, 4096) and safe(state.filename)
    manifest = json.loads(state.manifest.read_text())
    assert manifest["model_id"] == MODEL and manifest["prefix"] == {"keys": [1, 2, 3]}
    assert store.states(MODEL, fp) == [state]
    assert store.usage() == {MODEL: (1, 4096)}


def test_a_restart_finds_the_states_with_their_prefix_and_use(
        store: StateStore, fp: str, root: Path, clock: Clock) -> None:
    state = kept(save(store, fp, prefix=[[1, 2], [3]]))
    clock.now += 10
    touched = store.touch(state)
    assert touched is not None and touched.last_used == clock.now
    again = StateStore(root, 1 << 20, clock=clock)
    assert again.states(MODEL, fp) == [touched]
    assert again.states(MODEL, fp)[0].prefix == [[1, 2], [3]]


def test_one_state_per_slot_newest_first(store: StateStore, fp: str, clock: Clock) -> None:
    first = kept(save(store, fp, slot=0))
    clock.now += 1
    other = kept(save(store, fp, slot=1))
    clock.now += 1
    second = save(store, fp, slot=0, data=b"V" * 50)  # supersedes the earlier one
    assert second.dropped == (first,)
    assert not first.path.exists() and not first.manifest.exists()
    assert store.states(MODEL, fp) == [kept(second), other]


@pytest.mark.parametrize("case", ["empty", "missing", "short", "long", "no_counts", "bool",
                                  "other_name", "symlink", "directory", "nothing_written"])
def test_a_save_that_does_not_match_the_answer_is_not_kept(
        store: StateStore, fp: str, tmp_path: Path, case: str) -> None:
    pending = store.begin_save(MODEL, fp, 0)
    data = b"x" * 64
    reply = answer(pending, data)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(data)
    if case == "symlink":
        os.symlink(outside, pending.path)
    elif case == "directory":
        pending.path.mkdir()
    elif case == "nothing_written":
        write_like_the_child(pending, b"")
        reply["n_written"] = 0
    elif case != "missing":
        write_like_the_child(pending, data)
    changes: dict[str, dict[str, Any]] = {
        "empty": {"n_saved": 0}, "short": {"n_written": 65}, "long": {"n_written": 63},
        "no_counts": {"n_written": None}, "bool": {"n_saved": True},
        "other_name": {"filename": "slot-0-0000000000000000.bin"}}
    reply |= changes.get(case, {})
    commit = store.commit(pending, reply)
    assert commit.state is None and commit.problem
    assert case != "empty" or "empty" in commit.problem
    assert store.usage() == {} and store.states(MODEL, fp) == []
    assert outside.read_bytes() == data
    assert case == "directory" or not os.path.lexists(pending.path)


def test_abandon_removes_the_temp_file(store: StateStore, fp: str) -> None:
    pending = store.begin_save(MODEL, fp, 0)
    write_like_the_child(pending, b"partial")
    store.abandon(pending)
    store.abandon(pending)  # twice, or before the child wrote anything: nothing to do
    assert list(pending.directory.iterdir()) == []


@pytest.mark.parametrize("prefix", ["x" * (PREFIX_MAX_BYTES + 1), object(), float("nan")])
def test_a_prefix_that_cannot_be_kept_is_refused(store: StateStore, fp: str,
                                                  prefix: object) -> None:
    pending = store.begin_save(MODEL, fp, 0)
    write_like_the_child(pending, b"x" * 10)
    with pytest.raises(ValueError, match="prefix"):
        store.commit(pending, answer(pending, b"x" * 10), prefix=prefix)
    assert not pending.path.exists()


def test_the_largest_id_and_prefix_fit_a_manifest(store: StateStore, fp: str,
                                                  root: Path) -> None:
    """JSON escapes a control character as six bytes: the bounds on the id and the prefix
    keep the manifest within MANIFEST_MAX_BYTES, so that a restart reads it back."""
    model_id, prefix = "\x01" * MODEL_ID_MAX_BYTES, "\x01" * (PREFIX_MAX_BYTES // 6 - 1)
    state = kept(save(store, fp, model=model_id, prefix=prefix))
    assert state.manifest.stat().st_size <= statestore.MANIFEST_MAX_BYTES
    assert StateStore(root, 1 << 20).states(model_id, fp) == [state]


@pytest.mark.parametrize("bad", [dict(fingerprint="../x"), dict(fingerprint="A" * 64),
                                 dict(slot=-1), dict(slot=MAX_SLOT + 1), dict(slot=True),
                                 dict(model_id="x" * (MODEL_ID_MAX_BYTES + 1))])
def test_bad_names_are_refused(store: StateStore, fp: str, bad: dict[str, Any]) -> None:
    call: dict[str, Any] = {"model_id": MODEL, "fingerprint": fp, "slot": 0} | bad
    with pytest.raises(ValueError):
        store.begin_save(**call)


def test_commits_from_many_threads_keep_the_books(root: Path, fp: str) -> None:
    store = StateStore(root, 1000)
    errors: list[BaseException] = []

    def work(slot: int) -> None:
        try:
            for _ in range(5):
                save(store, fp, slot=slot, data=bytes([slot]) * 90)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(slot,)) for slot in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    count, size = store.usage()[MODEL]
    states = store.states(MODEL, fp)
    assert size <= 1000 and count == len(states) == 8
    on_disk = {p.name for p in store.directory(MODEL, fp).iterdir()}
    assert on_disk == {s.filename for s in states} | {s.manifest.name for s in states}


# ---- the fingerprint ---------------------------------------------------------------------

KV_CASES: dict[str, tuple[str, str]] = {
    "ctx-size": ("4096", "8192"), "parallel": ("1", "4"), "kv-unified": ("true", "false"),
    "kv-unified-per-slot": ("1024", "2048"), "cache-type-k": ("f16", "q8_0"),
    "cache-type-v": ("f16", "q8_0"), "flash-attn": ("on", "off"),
    "swa-full": ("true", "false"), "rope-scaling": ("linear", "yarn"),
    "rope-scale": ("1", "2"), "rope-freq-base": ("10000", "500000"),
    "rope-freq-scale": ("1", "0.5"), "yarn-orig-ctx": ("4096", "8192"),
    "yarn-ext-factor": ("-1", "1"), "yarn-attn-factor": ("1", "0.7"),
    "yarn-beta-slow": ("1", "2"), "yarn-beta-fast": ("32", "16"),
    "override-kv": ("llama.rope.freq_base=float:10000", "llama.rope.freq_base=float:20000"),
    "lora": ("/a.gguf", "/b.gguf"), "lora-scaled": ("/a.gguf:1.0", "/a.gguf:0.5"),
    "lora-init-without-apply": ("true", "false"), "control-vector": ("/c.gguf", "/d.gguf"),
    "control-vector-scaled": ("/c.gguf:1", "/c.gguf:2"),
    "control-vector-layer-range": ("1 10", "1 12"),
}


def test_every_kv_argument_has_a_case() -> None:
    assert set(KV_CASES) == {arg.name for arg in KV_ARGS}


@pytest.mark.parametrize("key", sorted(KV_CASES))
def test_each_kv_argument_changes_the_fingerprint(model_file: Path, key: str) -> None:
    one, other = KV_CASES[key]
    base = {"threads": "4"}
    prints = {fingerprint([content(model_file)], base, BUILD),
              fingerprint([content(model_file)], base | {key: one}, BUILD),
              fingerprint([content(model_file)], base | {key: other}, BUILD)}
    assert len(prints) == 3


@pytest.mark.parametrize("extra", [{"threads": "8"}, {"n-gpu-layers": "99"}, {"port": "9000"},
                                   {"host": "0.0.0.0"}, {"threads-http": "4"},
                                   {"batch-size": "512"}, {"cache-ram": "0"},
                                   {"kv-offload": "false"}, {"temp": "0.1"},
                                   {"frobnicate": "1"}, {"model": "/elsewhere.gguf"}])
def test_other_arguments_do_not_count(model_file: Path, extra: dict[str, str]) -> None:
    base = {"ctx-size": "4096"}
    weights = [content(model_file)]
    assert fingerprint(weights, base, BUILD) == fingerprint(weights, base | extra, BUILD)


@pytest.mark.parametrize("spelled", [
    {"c": "4096", "np": "2", "ctk": "q8_0", "ctv": "q8_0", "fa": "on", "kvu": "true"},
    {"-c": "4096", "-np": "2", "-ctk": "q8_0", "-ctv": "q8_0", "-fa": "on", "-kvu": "1"},
    {"--ctx-size": "4096", "--parallel": "2", "--cache-type-k": "q8_0",
     "--cache-type-v": "q8_0", "--flash-attn": "on", "--kv-unified": ""},
    {"LLAMA_ARG_CTX_SIZE": "4096", "LLAMA_ARG_N_PARALLEL": "2",
     "LLAMA_ARG_CACHE_TYPE_K": "q8_0", "LLAMA_ARG_CACHE_TYPE_V": "q8_0",
     "LLAMA_ARG_FLASH_ATTN": "on", "LLAMA_ARG_KV_UNIFIED": "on"},
    {"ctx-size": " 4096 ", "parallel": "02", "cache-type-k": "Q8_0", "cache-type-v": "q8_0",
     "flash-attn": "true", "no-kv-unified": "false"},
])
def test_short_long_and_env_spellings_agree(model_file: Path,
                                            spelled: dict[str, str]) -> None:
    canonical = {"ctx-size": "4096", "parallel": "2", "cache-type-k": "q8_0",
                 "cache-type-v": "q8_0", "flash-attn": "on", "kv-unified": "true"}
    assert kv_args(spelled) == kv_args(canonical)
    weights = [content(model_file)]
    assert fingerprint(weights, spelled, BUILD) == fingerprint(weights, canonical, BUILD)


@pytest.mark.parametrize("negative", [{"no-kv-unified": "true"}, {"-no-kvu": "on"},
                                      {"LLAMA_ARG_NO_KV_UNIFIED": "1"}])
def test_negative_spellings_invert(negative: dict[str, str]) -> None:
    assert kv_args(negative) == {"kv-unified": "false"}


def test_numbers_are_compared_as_numbers() -> None:
    assert kv_args({"rope-freq-base": "1e4"}) == kv_args({"rope-freq-base": "10000"})
    assert kv_args({"-c": "4096", "ctx-size": "2048"}) == {"ctx-size": "2048"}  # later wins


def test_the_spellings_are_llama_servers(help_table: FlagTable) -> None:
    """Each KV argument's spellings and environment name are exactly those of b11434's
    --help (tests/data/llama-server-help.txt), and each of them counts."""
    for arg in KV_ARGS:
        option = help_table.by_canonical(arg.name)
        assert option is not None and option.key == arg.name, arg.name
        assert {s.lstrip("-") for s in option.spellings} == {arg.name, *arg.shorts}
        assert {s.lstrip("-") for s in option.negatives} == set(arg.negatives)
        assert option.env == arg.env
        for spelling in option.spellings:
            assert arg.name in kv_args({spelling: "1"}), spelling


def test_weights_by_content_and_the_build_count(tmp_path: Path, model_file: Path) -> None:
    args = {"ctx-size": "4096"}
    before = fingerprint([content(model_file)], args, BUILD)
    assert fingerprint([content(model_file)], args, BUILD) == before
    assert fingerprint([content(model_file)], args, "b11435") != before
    mmproj = tmp_path / "mmproj.gguf"
    mmproj.write_bytes(b"GGUF")
    assert fingerprint([content(model_file), content(mmproj)], args, BUILD) != before
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(model_file.read_bytes())
    assert fingerprint([content(copy)], args, BUILD) == before  # the same weights
    other = model_file.read_bytes()[:-1] + b"\1"  # another model, the same size
    assert fingerprint([hashlib.sha256(other).hexdigest()], args, BUILD) != before


# ---- verification ------------------------------------------------------------------------

def _truncate(state: SavedState) -> None:
    os.truncate(state.path, state.n_written - 7)


def _garble(state: SavedState) -> None:
    state.path.write_bytes(b"G" * state.n_written)


def _remove_file(state: SavedState) -> None:
    state.path.unlink()


def _corrupt_manifest(state: SavedState) -> None:
    state.manifest.write_bytes(b'{"version": 1, "model_id": ')


def _huge_manifest(state: SavedState) -> None:
    manifest = json.loads(state.manifest.read_text())
    manifest["prefix"] = "p" * 70_000
    state.manifest.write_text(json.dumps(manifest))


def _rewrite(**fields: Any) -> Callable[[SavedState], None]:
    def rewrite(state: SavedState) -> None:
        manifest = json.loads(state.manifest.read_text())
        state.manifest.write_text(json.dumps(manifest | fields))
    return rewrite


DAMAGE: dict[str, Callable[[SavedState], None]] = {
    "truncated": _truncate, "garbled": _garble, "missing file": _remove_file,
    "corrupt manifest": _corrupt_manifest, "huge manifest": _huge_manifest,
    "another model": _rewrite(model_id="someone/else"),
    "another fingerprint": _rewrite(fingerprint="f" * 64),
    "another slot": _rewrite(slot=3), "another size": _rewrite(n_written=99),
    "another checksum": _rewrite(sha256="0" * 64), "no tokens": _rewrite(n_saved=0),
    "unknown version": _rewrite(version=2),
}


@pytest.mark.parametrize("restart", [False, True], ids=["live", "restart"])
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_state_is_never_returned_and_is_removed(
        store: StateStore, fp: str, root: Path, clock: Clock, damage: str, restart: bool,
        caplog: pytest.LogCaptureFixture) -> None:
    good = kept(save(store, fp, slot=1, data=b"g" * 100))
    bad = kept(save(store, fp, slot=0, data=bytes(range(100))))
    DAMAGE[damage](bad)
    with caplog.at_level(logging.WARNING, logger="router.statestore"):
        if restart:
            store = StateStore(root, 1 << 20, clock=clock)
        assert store.states(MODEL, fp) == [good]
    assert not os.path.lexists(bad.path) and not os.path.lexists(bad.manifest)
    assert good.path.exists() and store.usage() == {MODEL: (1, 100)}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and all(bad.filename[:-4] in r.getMessage() for r in warnings)
    if not restart:  # the live check knows the model; its log names it, never the bytes
        assert all(getattr(r, "model", None) == MODEL for r in warnings)
    assert not any("ggg" in r.getMessage() for r in caplog.records)


# ---- symlinks ----------------------------------------------------------------------------

@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory outside the store, holding files named as the store names its own."""
    path = tmp_path / "outside"
    path.mkdir()
    for name in ("slot-0-0123456789abcdef.bin", "slot-0-0123456789abcdef.json",
                 "tmp-0-0123456789abcdef.bin", "victim"):
        (path / name).write_text("precious")
    return path


def outside_intact(outside: Path) -> bool:
    return all(p.read_text() == "precious" for p in outside.iterdir()) \
        and len(list(outside.iterdir())) == 4


def test_a_state_file_replaced_by_a_symlink_is_not_followed(
        store: StateStore, fp: str, outside: Path) -> None:
    victim = outside / "victim"
    state = kept(save(store, fp, data=b"precious"))
    state.path.unlink()
    state.path.symlink_to(victim)  # same size, same bytes: only the link gives it away
    assert store.states(MODEL, fp) == []
    assert not os.path.lexists(state.path) and outside_intact(outside)


def test_symlinked_directories_are_not_followed(store: StateStore, fp: str, root: Path,
                                                outside: Path, clock: Clock) -> None:
    other_fp = "e" * 64
    model_dir = root / model_dir_name("linked")
    model_dir.symlink_to(outside, target_is_directory=True)
    real = store.directory(MODEL, fp).parent
    (real / other_fp).symlink_to(outside, target_is_directory=True)
    (root / "foreign-link").symlink_to(outside, target_is_directory=True)
    StateStore(root, 1 << 20, clock=clock)  # scan
    assert outside_intact(outside) and not os.path.lexists(model_dir)
    assert not os.path.lexists(real / other_fp)
    assert (root / "foreign-link").is_symlink()  # not a name of the store's: left alone
    model_dir.symlink_to(outside, target_is_directory=True)
    store.directory(MODEL, fp)  # the scan removed the empty directories
    (real / other_fp).symlink_to(outside, target_is_directory=True)
    assert store.remove_model("linked") == 0 and not os.path.lexists(model_dir)
    assert store.states(MODEL, fp) == []  # drops the other fingerprint: the link only
    assert outside_intact(outside)
    model_dir.symlink_to(outside, target_is_directory=True)
    directory = store.directory("linked", fp)  # the link is replaced by a real directory
    assert not directory.parent.is_symlink() and outside_intact(outside)


def test_a_fifo_at_a_store_name_does_not_hang_the_scan(store: StateStore, fp: str,
                                                       root: Path) -> None:
    directory = store.directory(MODEL, fp)
    os.mkfifo(directory / "slot-0-0123456789abcdef.json")
    (directory / "slot-0-0123456789abcdef.bin").write_bytes(b"x")
    problems = store.scan()
    assert {p.reason for p in problems} == {"not a regular file", "a file without its manifest"}
    assert not directory.exists()  # emptied, then removed


# ---- names -------------------------------------------------------------------------------

HOSTILE_IDS = ["../x", "..", ".", "", " ", "a/b", "/etc/passwd", "a\\b", "a\x00b", "a\nb",
               "模型/量化:Q4", "\u202eevil", "\ud800", "-rf", ".hidden", "trailing.",
               "x" * 5000, "CON", 'q"*?<>|:', "é" * 300]


@pytest.mark.parametrize("model_id", HOSTILE_IDS, ids=range(len(HOSTILE_IDS)))
def test_hostile_model_ids_get_safe_names_inside_the_root(
        store: StateStore, fp: str, root: Path, model_id: str) -> None:
    assert safe(model_dir_name(model_id))
    if len(model_id.encode("utf-8", "surrogatepass")) > MODEL_ID_MAX_BYTES:
        with pytest.raises(ValueError, match="longer"):
            store.directory(model_id, fp)
        return
    pending = store.begin_save(model_id, fp, MAX_SLOT)
    assert pending.directory.resolve().parent.parent == root.resolve()
    assert all(safe(part) for part in pending.path.relative_to(root).parts)
    state = kept(save(store, fp, model=model_id))
    assert all(safe(part) for part in state.path.relative_to(root).parts)
    assert StateStore(root, 1 << 20).states(model_id, fp) == [state]


def test_ids_that_read_alike_get_their_own_directories(store: StateStore, fp: str) -> None:
    ids = ["a/b", "a:b", "a b", "a_b", "a\\b", "a__b", "a/b/", "A/B"]
    names = {model_dir_name(i) for i in ids}
    assert len(names) == len(ids)
    for i, model_id in enumerate(ids):
        save(store, fp, model=model_id, data=bytes([i]) * 10)
    assert store.usage() == {model_id: (1, 10) for model_id in ids}
    for i, model_id in enumerate(ids):
        assert store.states(model_id, fp)[0].path.read_bytes() == bytes([i]) * 10


@given(st.text(st.characters(exclude_categories=()), max_size=400))
def test_any_model_id_gets_a_name_llama_server_accepts(model_id: str) -> None:
    name = model_dir_name(model_id)
    assert safe(name) and len(name.encode()) <= 255


@given(st.text(st.sampled_from("ab/:_ .-é\x00"), max_size=8),
       st.text(st.sampled_from("ab/:_ .-é\x00"), max_size=8))
def test_distinct_ids_get_distinct_directories(one: str, other: str) -> None:
    assert (model_dir_name(one) == model_dir_name(other)) == (one == other)


@given(st.integers(0, MAX_SLOT))
def test_every_slot_gets_a_name_llama_server_accepts(slot: int) -> None:
    pending = PendingSave(MODEL, "0" * 64, slot, Path("/d") / f"tmp-{slot}-{'a' * 16}.bin")
    assert safe(pending.filename) and safe("slot" + pending.filename[3:])
    assert statestore._FILE.fullmatch(pending.filename)


# ---- the budget --------------------------------------------------------------------------

def test_the_least_recently_used_go_first(root: Path, fp: str, clock: Clock) -> None:
    store = StateStore(root, 300, clock=clock)
    states = []
    for slot in range(3):
        clock.now += 1
        states.append(kept(save(store, fp, slot=slot)))
    clock.now += 1
    assert store.touch(states[0]) is not None  # restored: now the most recent
    clock.now += 1
    fourth = save(store, fp, slot=3)
    assert fourth.dropped == (states[1],) and not states[1].path.exists()
    clock.now += 1
    fifth = save(store, fp, slot=4, model="another")
    assert fifth.dropped == (states[2],)
    assert store.usage() == {MODEL: (2, 200), "another": (1, 100)}
    assert [s.slot for s in store.states(MODEL, fp)] == [3, 0]


def test_a_state_over_the_whole_budget_is_not_kept(root: Path, fp: str, clock: Clock) -> None:
    store = StateStore(root, 150, clock=clock)
    small = kept(save(store, fp, slot=0, data=b"s" * 100))
    pending = store.begin_save(MODEL, fp, 1)
    write_like_the_child(pending, b"B" * 151)
    commit = store.commit(pending, answer(pending, b"B" * 151))
    assert commit.state is None and commit.problem and "budget" in commit.problem
    assert commit.dropped == () and not pending.path.exists()
    assert store.states(MODEL, fp) == [small]


def test_a_model_keeps_a_bounded_number_of_states(root: Path, fp: str, clock: Clock,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(statestore, "MAX_STATES_PER_MODEL", 2)
    store = StateStore(root, 1 << 20, clock=clock)
    first = kept(save(store, fp, slot=0))
    clock.now += 1
    save(store, fp, slot=1)
    clock.now += 1
    assert save(store, fp, slot=2).dropped == (first,)
    assert store.usage() == {MODEL: (2, 200)}


def test_the_count_and_the_budget_apply_together(store: StateStore, fp: str, root: Path,
                                                 clock: Clock,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    for slot, size in enumerate([60, 100, 100]):
        clock.now += 1
        save(store, fp, slot=slot, data=b"x" * size)
    monkeypatch.setattr(statestore, "MAX_STATES_PER_MODEL", 2)
    smaller = StateStore(root, 150, clock=clock)
    assert [s.slot for s in smaller.states(MODEL, fp)] == [2]
    assert smaller.usage() == {MODEL: (1, 100)}


def test_a_smaller_budget_applies_at_restart(store: StateStore, fp: str, root: Path,
                                             clock: Clock) -> None:
    for slot in range(3):
        clock.now += 1
        save(store, fp, slot=slot)
    smaller = StateStore(root, 250, clock=clock)
    assert [s.slot for s in smaller.states(MODEL, fp)] == [2, 1]


def test_touch_and_discard(store: StateStore, fp: str) -> None:
    state = kept(save(store, fp))
    store.discard(state)
    assert not state.path.exists() and not state.manifest.exists()
    assert store.touch(state) is None and store.usage() == {}
    store.discard(state)  # again: nothing to do


# ---- models and configurations -----------------------------------------------------------

def test_states_of_another_configuration_are_removed(store: StateStore, model_file: Path,
                                                     fp: str, root: Path) -> None:
    old = kept(save(store, fingerprint([content(model_file)], {"ctx-size": "2048"}, BUILD)))
    unrelated = kept(save(store, fp, model="unrelated"))
    current = kept(save(store, fp))
    assert store.states(MODEL, fp) == [current]
    assert not old.path.parent.exists()
    assert store.states("unrelated", fp) == [unrelated]
    assert store.usage() == {MODEL: (1, 100), "unrelated": (1, 100)}


def test_remove_model(store: StateStore, fp: str, root: Path) -> None:
    save(store, fp, slot=0)
    save(store, fp, slot=1)
    other = kept(save(store, fp, model="other"))
    assert store.remove_model(MODEL) == 2
    assert not (root / model_dir_name(MODEL)).exists()
    assert store.usage() == {"other": (1, 100)} and store.states("other", fp) == [other]
    assert store.remove_model(MODEL) == 0


def test_remove_model_leaves_foreign_files(store: StateStore, fp: str, root: Path) -> None:
    state = kept(save(store, fp))
    notes = state.path.parent / "notes.txt"
    notes.write_text("mine")
    store.remove_model(MODEL)
    assert notes.read_text() == "mine" and not state.path.exists()


# ---- startup -----------------------------------------------------------------------------

def test_the_scan_removes_leftovers_and_nothing_else(store: StateStore, fp: str, root: Path,
                                                     clock: Clock) -> None:
    state = kept(save(store, fp, slot=0))
    directory = state.path.parent
    leftovers = {"tmp-0-aaaaaaaaaaaaaaaa.bin": b"partial", "tmp-1-aaaaaaaaaaaaaaaa.json": b"{",
                 "slot-1-bbbbbbbbbbbbbbbb.bin": b"no manifest",
                 "slot-2-cccccccccccccccc.json": state.manifest.read_bytes(),
                 "slot-3-dddddddddddddddd.bin": b"x", "slot-3-dddddddddddddddd.json": b"junk"}
    for name, data in leftovers.items():
        (directory / name).write_bytes(data)
    foreign = {directory / "notes.txt", root / "README", directory.parent / "keep.me"}
    for path in foreign:
        path.write_text("foreign")
    (root / "lost+found").mkdir()
    empty_model = root / model_dir_name("gone")
    (empty_model / ("1" * 64)).mkdir(parents=True)
    problems = StateStore(root, 1 << 20, clock=clock).scan()  # the constructor scanned too
    assert problems == []
    again = StateStore(root, 1 << 20, clock=clock)
    assert again.states(MODEL, fp) == [state]
    assert {p.name for p in directory.iterdir()} == {state.filename, state.manifest.name,
                                                     "notes.txt"}
    assert all(path.read_text() == "foreign" for path in foreign)
    assert (root / "lost+found").is_dir() and not empty_model.exists()


def test_the_scan_reports_what_it_removed(store: StateStore, fp: str, root: Path) -> None:
    directory = store.directory(MODEL, fp)
    (directory / "tmp-0-aaaaaaaaaaaaaaaa.bin").write_bytes(b"partial")
    (directory / "slot-1-bbbbbbbbbbbbbbbb.bin").write_bytes(b"orphan")
    problems = store.scan()
    assert sorted(p.reason for p in problems) == ["a file without its manifest",
                                                  "an unfinished save"]
    assert all(p.file.startswith(model_dir_name(MODEL) + "/") for p in problems)


# ---- the root ----------------------------------------------------------------------------

def test_a_missing_root_is_created_private(tmp_path: Path) -> None:
    root = tmp_path / "a" / "b" / "state"
    StateStore(root, 0)
    assert root.is_dir() and (root.stat().st_mode & 0o777) == 0o700


def test_a_symlinked_root_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ValueError, match="symbolic link"):
        StateStore(tmp_path / "link", 100)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="symbolic link"):
        StateStore(tmp_path / "dangling", 100)


def test_a_file_root_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        StateStore(tmp_path / "file", 100)
    with pytest.raises(ValueError, match="cannot create"):
        StateStore(tmp_path / "file" / "below", 100)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_an_unwritable_root_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ro").mkdir(mode=0o500)
    with pytest.raises(ValueError, match="not writable"):
        StateStore(tmp_path / "ro", 100)


@pytest.mark.parametrize("budget", [-1, True, 1.5])
def test_a_bad_budget_is_refused(tmp_path: Path, budget: Any) -> None:
    with pytest.raises(ValueError, match="budget"):
        StateStore(tmp_path / "state", budget)


def test_the_public_records_are_plain(store: StateStore, fp: str) -> None:
    state = kept(save(store, fp))
    record: Mapping[str, Any] = json.loads(state.manifest.read_text())
    assert set(record) == {"version", "model_id", "fingerprint", "slot", "file", "n_saved",
                           "n_written", "sha256", "saved_at", "last_used", "prefix"}


def test_one_router_per_state_directory(tmp_path: Path) -> None:
    """``claim_root``: a second claim on the same directory is refused while the first is
    held (another router), and the same directory is free again once it is released."""
    from router.warm.statestore import claim_root

    first = claim_root(tmp_path / "states")
    try:
        with pytest.raises(ValueError, match="in use by another router"):
            claim_root(tmp_path / "states")
        assert claim_root(tmp_path / "other") >= 0  # another directory: its own lock
    finally:
        os.close(first)
    os.close(claim_root(tmp_path / "states"))
