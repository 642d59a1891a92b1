"""Resumable streams belong to the API key that started them: another key cannot read, look
up, stop or take over a stream, and a conversation id never moves to another model. The
table alone, then two keys on one model's streams against the real llama-server."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from support import start_router, write_presets

from router.children.backend import Backend
from router.edge.keys import key_hash
from router.edge.resumable import StreamOwners, StreamTaken

A, B = key_hash(b"key-a"), key_hash(b"key-b")
CHILD = object()  # stands for a Backend: the table only keeps it


# --------------------------------------------------------------------------- the table

def child() -> Backend:
    return CHILD  # type: ignore[return-value]


def test_a_key_hash_is_not_the_key_and_differs_per_key() -> None:
    assert key_hash(b"key-a") == A and A != B
    assert "key-a" not in A and len(A) == 32


def test_only_the_owner_finds_or_forgets_a_conversation() -> None:
    owners = StreamOwners()
    owners.claim("conv", "m1", A, child())
    assert owners.owner("conv", A) == ("m1", CHILD)
    assert owners.owner("conv", B) is None  # as for an id nobody uses
    owners.forget("conv", B)
    assert owners.owner("conv", A) == ("m1", CHILD)
    owners.forget("conv", A)
    assert owners.owner("conv", A) is None and len(owners) == 0


def test_a_conversation_id_is_not_taken_over_by_another_key_or_moved_to_another_model(
        ) -> None:
    owners = StreamOwners()
    owners.claim("conv", "m1", A)  # pending: its model loads
    for model, key in (("m1", B), ("m2", A), ("m2", B)):
        with pytest.raises(StreamTaken) as caught:
            owners.claim("conv", model, key, child(), running=lambda m, c: True)
        assert caught.value.status == 409
        assert caught.value.type == "invalid_request_error"
    assert owners.owner("conv", A) == ("m1", None)
    owners.claim("conv", "m1", A, child())  # the same key and model: served now
    with pytest.raises(StreamTaken):
        owners.claim("conv", "m1", B, running=lambda m, c: True)
    assert owners.owner("conv", A) == ("m1", CHILD)


def test_an_id_whose_child_is_gone_is_free_again() -> None:
    owners = StreamOwners()
    owners.claim("conv", "m1", A, child())
    owners.claim("conv", "m2", B, running=lambda m, c: False)  # that child's stream is gone
    assert owners.owner("conv", A) is None and owners.owner("conv", B) == ("m2", None)


def test_conversation_owners_are_bounded_least_recently_used_first() -> None:
    owners = StreamOwners(capacity=2)
    owners.claim("a", "m1", A)
    owners.claim("b", "m2", A)
    assert owners.owner("a", A) == ("m1", None)  # "a" is now the most recently used
    owners.claim("c", "m3", A)
    assert owners.owner("b", A) is None and len(owners) == 2


def test_a_claim_records_the_child_that_serves_it() -> None:
    """A request claims its conversation once (``route.decide``), then records on that
    claim the child (or peer) its lease or the nodes gave it."""
    owners = StreamOwners()
    claim = owners.claim("conv", "m1", A, running=lambda m, c: True)
    assert owners.owner("conv", A) == ("m1", None)
    claim.served_by(child())
    assert owners.owner("conv", A) == ("m1", CHILD)


def test_a_claim_the_table_forgot_is_claimed_anew_and_never_takes_another_keys_id() -> None:
    owners = StreamOwners(capacity=1)
    mine = owners.claim("conv", "m1", A, running=lambda m, c: True)
    owners.claim("other", "m1", A)  # "conv" is forgotten: the table is full
    assert owners.owner("conv", A) is None
    mine.served_by(child())  # claimed again, with its child
    assert owners.owner("conv", A) == ("m1", CHILD)
    owners.claim("flood", "m1", A)  # forgotten again, and then another key takes the id
    owners.claim("conv", "m2", B, child())
    with pytest.raises(StreamTaken):  # its child still serves: B's, not A's
        mine.served_by(child())
    assert owners.owner("conv", B) == ("m2", CHILD) and owners.owner("conv", A) is None


# --------------------------------------------------------------------------- real children

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True}


@pytest.mark.real
def test_two_keys_on_one_models_streams(tmp_path: Path, llama_server: Path,
                                        tiny_models: dict[str, Path]) -> None:
    presets = write_presets(tmp_path / "models.ini",
                            f"[alpha]\nmodel = {tiny_models['alpha']}\nctx-size = 512\n"
                            f"[beta]\nmodel = {tiny_models['beta']}\nctx-size = 512\n")
    key_a, key_b = "sk-owner-a-5e1f0c", "sk-other-b-93d7aa"
    key_file = tmp_path / "api-keys"
    key_file.write_text(f"{key_b}  models=alpha,beta  role=infer\n")
    with start_router(tmp_path, "--presets", str(presets), "--llama-server",
                      str(llama_server), "--api-key", key_a,
                      "--api-key-file", str(key_file)) as router, \
            router.client() as client:
        as_a = {"Authorization": f"Bearer {key_a}"}
        as_b = {"Authorization": f"Bearer {key_b}"}

        def chat(who: dict[str, str], model: str, conv: str) -> httpx.Response:
            return client.post("/v1/chat/completions", json={"model": model, **CHAT},
                               headers={**who, "X-Conversation-Id": conv})

        started = chat(as_a, "alpha", "conv-x")
        assert started.status_code == 200, started.text
        original = started.text
        assert "[DONE]" in original

        def replay(who: dict[str, str], conv: str = "conv-x") -> httpx.Response:
            return client.get("/v1/stream", params={"conv_id": conv, "from": "0"},
                              headers=who)

        assert replay(as_a).text == original
        # Key B: exactly what an id nobody uses gets, on read, lookup and delete.
        unknown = replay(as_b, "conv-nobody")
        assert unknown.status_code == 404
        other = replay(as_b)
        assert (other.status_code, other.json()) == (404, unknown.json())
        lookup = {"conversation_ids": ["conv-x"]}
        assert len(client.post("/v1/streams/lookup", json=lookup, headers=as_a).json()) == 1
        assert client.post("/v1/streams/lookup", json=lookup, headers=as_b).json() == []
        assert client.delete("/v1/stream", params={"conv_id": "conv-x"},
                             headers=as_b).status_code == 204
        assert replay(as_a).text == original  # B's delete stopped and forgot nothing
        # Taking the id over: refused for another key (any model) and for another model,
        # before anything loads; the owner's stream is still there, unchanged.
        for who, model in ((as_b, "alpha"), (as_b, "beta"), (as_a, "beta")):
            taken = chat(who, model, "conv-x")
            assert taken.status_code == 409, (model, taken.text)
            error = taken.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert "X-Conversation-Id is in use" in error["message"]
            assert key_a not in taken.text and "alpha" not in error["message"]
        models = client.get("/models", headers=as_a).json()["data"]
        assert next(m for m in models if m["id"] == "beta")["status"]["value"] == "unloaded"
        assert replay(as_a).text == original
        # The owner's next turn on the same model is its own business: served, kept.
        again = chat(as_a, "alpha", "conv-x")
        assert again.status_code == 200 and replay(as_a).text == again.text
        # Once the owner ends it, the id is free for anyone.
        assert client.delete("/v1/stream", params={"conv_id": "conv-x"},
                             headers=as_a).status_code == 204
        mine = chat(as_b, "alpha", "conv-x")
        assert mine.status_code == 200
        assert replay(as_b).text == mine.text
        assert replay(as_a).status_code == 404
        # No key in the log.
        assert key_a not in router.log() and key_b not in router.log()


@pytest.mark.real
def test_a_second_conversation_id_header_cannot_take_over_a_stream(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    """Key B names a fresh id for the router and the owner's id for llama-server (which keeps
    the stream under the last header): refused with a 400 before the child sees it, and the
    owner's stream is left as it was."""
    presets = write_presets(tmp_path / "models.ini",
                            f"[alpha]\nmodel = {tiny_models['alpha']}\nctx-size = 512\n")
    key_a, key_b = "sk-owner-a-77f0", "sk-other-b-2c4e"
    with start_router(tmp_path, "--presets", str(presets), "--llama-server",
                      str(llama_server), "--api-key", key_a, "--api-key", key_b) as router, \
            router.client() as client:
        as_a = {"Authorization": f"Bearer {key_a}"}
        started = client.post("/v1/chat/completions", json={"model": "alpha", **CHAT},
                              headers={**as_a, "X-Conversation-Id": "conv-a"})
        assert started.status_code == 200 and "[DONE]" in started.text
        original = client.get("/v1/stream", params={"conv_id": "conv-a", "from": "0"},
                              headers=as_a).text
        assert original == started.text
        overwrite = {"model": "alpha", **CHAT, "max_tokens": 2,
                     "messages": [{"role": "user", "content": "something else entirely"}]}
        for ids in (["fresh-b", "conv-a"], ["conv-a", "conv-a"]):
            taken = client.post("/v1/chat/completions", json=overwrite, headers=[
                ("Authorization", f"Bearer {key_b}"),
                *[("X-Conversation-Id", conv) for conv in ids]])
            assert taken.status_code == 400, taken.text
            error = taken.json()["error"]
            assert error["code"] == 400 and error["type"] == "invalid_request_error"
            assert "X-Conversation-Id" in error["message"]
        replay = client.get("/v1/stream", params={"conv_id": "conv-a", "from": "0"},
                            headers=as_a)
        assert replay.status_code == 200 and replay.text == original
        # One header: the owner's id is refused for key B as before (409), a fresh one served.
        assert client.post("/v1/chat/completions", json=overwrite, headers={
            "Authorization": f"Bearer {key_b}", "X-Conversation-Id": "conv-a"}
                           ).status_code == 409
        assert client.post("/v1/chat/completions", json=overwrite, headers={
            "Authorization": f"Bearer {key_b}", "X-Conversation-Id": "fresh-b"}
                           ).status_code == 200
