"""Profiles and request policies in presets (``profile-of``, ``params.``, ``force.``,
``strip``): read, refused with file, line and key, kept out of the models the core runs, and
applied to a body as ``RequestPolicy.apply`` says."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import MappingProxyType

import pytest
from test_policy_matrix import BODY, SHAPES, decisions, read

from router.config.policy import RequestPolicy
from router.config.presets import ModelPreset, PresetsInvalid
from router.config.sources import Catalogue, build_catalogue
from router.edge.forward import _with_policy
from router.edge.virtual import Choice, Target, Virtuals, choose
from router.errors import BadRequest
from router.http.requests import SMALL_JSON_BYTES
from router.llama.flags import FlagTable


def catalogue(tmp_path: Path, table: FlagTable, text: str) -> Catalogue:
    (tmp_path / "m.gguf").touch()
    path = tmp_path / "presets.ini"
    path.write_text(text.replace("MODEL", str(tmp_path / "m.gguf")), encoding="utf-8")
    return build_catalogue([path], [], table, [], hf_cache=False)


def problems(tmp_path: Path, table: FlagTable, text: str) -> list[str]:
    with pytest.raises(PresetsInvalid) as info:
        catalogue(tmp_path, table, text)
    return [str(problem) for problem in info.value.problems]


BASE = "[qwen]\nmodel = MODEL\nalias = q\n"


def test_a_profile_is_a_name_of_its_base_with_its_own_policy(tmp_path: Path,
                                                             help_table: FlagTable) -> None:
    found = catalogue(tmp_path, help_table, BASE + (
        "[qwen-code]\nprofile-of = q\nalias = coder\nparams.temperature = 0.2\n"
        'params.chat_template_kwargs = {"enable_thinking": false}\n'
        "force.top_k = 20\nforce.stop = END\nstrip = logit_bias, n_probs\n"))
    assert list(found.models) == ["qwen"]  # no model of its own: the core runs none
    assert found.resolve("qwen-code") is None
    profile = found.profile("coder")
    assert profile is not None and profile is found.profile("qwen-code")
    assert profile.profile_of == "qwen"  # its base by id, also when named by an alias
    assert profile.args == {}
    assert profile.policy == RequestPolicy(
        MappingProxyType({"temperature": 0.2, "chat_template_kwargs": {"enable_thinking": False}}),
        MappingProxyType({"top_k": 20, "stop": "END"}), ("logit_bias", "n_probs"))
    assert "qwen-code" in found.close_matches("qwen-cod")


def test_an_ordinary_model_has_a_policy_too_with_the_defaults_under_it(
        tmp_path: Path, help_table: FlagTable) -> None:
    found = catalogue(tmp_path, help_table,
                      "[*]\nforce.seed = 1\nparams.top_p = 0.9\nstrip = a\n"
                      + BASE + "params.top_p = 0.5\nstrip = b\n")
    policy = found.models["qwen"].policy
    assert policy == RequestPolicy(MappingProxyType({"top_p": 0.5}),
                                   MappingProxyType({"seed": 1}), ("a", "b"))
    plain = catalogue(tmp_path, help_table, BASE)
    assert plain.models["qwen"].policy is None and plain.names == {}


@pytest.mark.parametrize(("text", "says"), [
    ("[p]\nprofile-of = p2\n[p2]\nprofile-of = qwen\n",
     "presets.ini:5: [p] profile-of: 'p2' is itself a profile or a virtual model"),
    ("[p]\nprofile-of = nobody\n", "presets.ini:5: [p] profile-of: no model named 'nobody'"),
    ("[p]\nprofile-of = qwen\nmodel = MODEL\n",
     "presets.ini:5: [p] profile-of: 'profile-of' cannot be set together with 'model' (line 6)"),
    ("[p]\nprofile-of = qwen\nupstream = http://127.0.0.1:1\n",
     "'profile-of' cannot be set together with 'upstream'"),
    ("[p]\nprofile-of = qwen\nctx-size = 512\n",
     "presets.ini:6: [p] ctx-size: a profile runs on its base's children"),
    ("[p]\nprofile-of = qwen\nttl = 5\n", "presets.ini:6: [p] ttl: a profile runs on its base's"),
    ("[p]\nprofile-of = qwen\nforce.model = x\n",
     "presets.ini:6: [p] force.model: 'model' cannot be set by a preset"),
    ("[p]\nprofile-of = qwen\nparams.stream = true\n",
     "presets.ini:6: [p] params.stream: 'stream' cannot be set by a preset"),
    ("[p]\nprofile-of = qwen\nparams. = 1\n",
     "presets.ini:6: [p] params.: 'params.' names no field"),
    ("[p]\nprofile-of = qwen\nalias = q\n", "'q' is already the name or an alias"),
    ("[*]\nprofile-of = qwen\n", "'profile-of' cannot be a default for every model"),
    ("[p]\nprofile-of = qwen\nparams.temperature = NaN\n",
     "presets.ini:6: [p] params.temperature: 'NaN': NaN is not a JSON value"),
    ("[p]\nprofile-of = qwen\nforce.logit_bias = [[1, -Infinity]]\n",
     "presets.ini:6: [p] force.logit_bias: '[[1, -Infinity]]': -Infinity is not a JSON value"),
    ("[p]\nprofile-of = qwen\nparams.top_p = 1e999\n",
     "presets.ini:6: [p] params.top_p: '1e999': 1e999 is past the largest number"),
])
def test_a_bad_profile_is_refused_with_file_line_and_key(
        tmp_path: Path, help_table: FlagTable, text: str, says: str) -> None:
    found = problems(tmp_path, help_table, BASE + text if not text.startswith("[*]")
                     else text + BASE)
    assert any(says in problem and "presets.ini" in problem for problem in found), found


def test_the_policy_sets_defaults_replaces_and_removes_only_what_it_names() -> None:
    policy = RequestPolicy(MappingProxyType({"temperature": 0.2, "top_p": 0.9}),
                           MappingProxyType({"top_k": 20}), ("n_probs",))
    body = {"model": "m", "temperature": 1.5, "top_k": 40, "n_probs": 3, "prompt": "x"}
    assert policy.apply(body) == {"model": "m", "temperature": 1.5, "top_k": 20, "prompt": "x",
                                  "top_p": 0.9}
    assert body["top_k"] == 40  # the request's own reading is not written
    assert policy.apply({"temperature": 0, "top_p": 1, "top_k": 20}) is None  # nothing to do
    assert policy.apply({"temperature": 0, "top_p": 1, "top_k": 20.0}) is not None
    assert RequestPolicy(force=MappingProxyType({"x": 1})).apply({"x": True}) == {"x": 1}
    assert not RequestPolicy() and policy.describe() == {
        "params": {"temperature": 0.2, "top_p": 0.9}, "force": {"top_k": 20},
        "strip": ["n_probs"]}


# --- applied at the edge, on every body shape -------------------------------------------------

POLICY = RequestPolicy(MappingProxyType({"temperature": 0.2}),
                       MappingProxyType({"n_predict": 5}), ("pad", "logit_bias"))


@pytest.mark.parametrize("shape", SHAPES)
def test_the_policy_is_applied_to_every_shape_before_any_decision(shape: str) -> None:
    """Small, large (scanned, not parsed), no content type, a form's media type, chunked: the
    child gets the policy's body, and every later decision (the limit a quota reserves, the
    streaming) reads the body as rewritten."""
    content_type, large, chunks = SHAPES[shape]
    fields = {**BODY, "logit_bias": {"1": 2}}
    if large:
        fields["pad"] = "p" * SMALL_JSON_BYTES
    request = read(json.dumps(fields).encode(), content_type, chunks)
    request.model_id = "m-code"
    body = asyncio.run(_with_policy(request, POLICY, request.body or b""))
    sent = json.loads(body)
    assert sent == {**BODY, "n_predict": 5, "temperature": 0.2}
    assert request.body == body and request.fields["n_predict"] == 5
    assert decisions(request, False)[3] == 5  # the quota's limit: the forced one


def test_a_body_no_rule_changes_goes_byte_for_byte_and_others_are_refused() -> None:
    raw = b'{"model": "m",  "temperature": 0.7, "n_predict": 5}'
    request = read(raw, "application/json")
    assert asyncio.run(_with_policy(request, POLICY, raw)) is raw
    form = (b'--zz\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n--zz--\r\n')
    request = read(form, "multipart/form-data; boundary=zz")
    request.model_id = "m-code"
    with pytest.raises(BadRequest, match=r"model 'm-code' sets request fields .* JSON object "
                                         "body"):
        asyncio.run(_with_policy(request, POLICY, form))


# --- virtual models ----------------------------------------------------------------------------

def test_a_virtual_model_is_read_and_checked(tmp_path: Path, help_table: FlagTable) -> None:
    found = catalogue(tmp_path, help_table, BASE + (
        "[qwen-code]\nprofile-of = qwen\n[assistant]\ntargets = qwen-code, q, peer-model\n"
        "choose = spillover\nalias = helper\n"))
    virtual = found.virtual("helper")
    assert virtual is not None and virtual.targets == ("qwen-code", "q", "peer-model")
    assert virtual.choose == "spillover" and found.profile("assistant") is None
    assert list(found.models) == ["qwen"] and found.resolve("assistant") is None
    for text, says in [
        ("[v]\ntargets = qwen\nmodel = MODEL\n", "[v] targets: 'targets' cannot be set "
                                                 "together with 'model'"),
        ("[v]\ntargets = qwen\nctx-size = 5\n", "[v] ctx-size: a virtual model runs on its "
                                                "targets' children"),
        ("[v]\ntargets = qwen\nchoose = random\n", "[v] choose: bad choice 'random'"),
        ("[v]\nchoose = warm\nmodel = MODEL\n", "[v] choose: 'choose' needs 'targets'"),
        ("[v]\ntargets = qwen, qwen\n", "[v] targets: a target is listed twice"),
        ("[v]\ntargets = w\n[w]\ntargets = qwen\n", "'w' is itself a virtual model"),
        ("[p]\nprofile-of = v\n[v]\ntargets = qwen\n", "'v' is itself a profile or a "
                                                       "virtual model"),
    ]:
        assert any(says in p for p in problems(tmp_path, help_table, BASE + text)), (text, says)


def test_each_choice_picks_as_its_policy_says() -> None:
    a = Target("a", True)
    b_warm = Target("b", True, loaded=True)
    assert choose("warm", [a, b_warm]) == Choice("b", "warm")
    assert choose("warm", [a, Target("b", True)]) == Choice("a", "first")
    busy = Target("a", True, loaded=True, busy=True, load=1.0)
    assert choose("spillover", [busy, Target("b", True, load=0.0)]) == Choice("b", "spillover")
    assert choose("spillover", [busy, Target("b", True, busy=True, load=2.0)]) == Choice(
        "a", "least_loaded")
    assert choose("spillover", [Target("a", True, deep=True, load=3.0), b_warm]) == Choice(
        "b", "spillover")
    down = Target("a", False)
    assert choose("fallback", [a, b_warm]) == Choice("a", "first", ("b",))
    assert choose("fallback", [down, b_warm]) == Choice("b", "fallback")
    assert choose("warm", [down, Target("b", False)]) is None
    # A conversation stays where its earlier turns are, whatever the policy, while it can.
    held = Target("b", True, match=3)
    for policy in ("warm", "spillover", "fallback"):
        assert choose(policy, [Target("a", True, loaded=True), held]).reason == "conversation"
    assert choose("warm", [Target("a", True, loaded=True), Target("b", False, match=3)]) \
        == Choice("a", "warm")


def test_the_targets_served_lately_follow_a_conversation() -> None:
    virtuals = Virtuals()
    virtual = catalogue_free_virtual()
    virtuals.chose(virtual, Choice("b", "spillover"), (11, 22))
    assert virtuals.match("v", "b", (11, 22, 33)) == 2 and virtuals.match("v", "a", (11,)) == 0
    assert virtuals.describe("v") == {"last_target": "b", "last_reason": "spillover",
                                      "choices": {"b:spillover": 1}}
    assert Virtuals().describe("v") == {}


def catalogue_free_virtual() -> ModelPreset:
    return ModelPreset(id="v", args=MappingProxyType({}), targets=("a", "b"))


def test_a_reload_drops_what_it_removed_and_a_flood_of_conversations_stays_bounded() -> None:
    from router.serving.affinity import TABLE_KEYS
    virtuals = Virtuals()
    virtual = catalogue_free_virtual()
    other = ModelPreset(id="w", args=MappingProxyType({}), targets=("a",))
    # A flood of distinct conversations: the prefix keys kept per target stay bounded.
    for n in range(TABLE_KEYS * 3):
        virtuals.chose(virtual, Choice("b", "warm"), (n * 7 + 1, n * 7 + 2))
    virtuals.chose(other, Choice("a", "warm"), (5,))
    served = virtuals._served["v"].tables["b"]
    assert len(served) <= TABLE_KEYS
    assert virtuals.describe("v")["choices"] == {"b:warm": TABLE_KEYS * 3}
    # A reload that removes w and takes b out of v's targets: nothing of either is kept.
    virtuals.keep([ModelPreset(id="v", args=MappingProxyType({}), targets=("a", "c"))])
    assert len(virtuals) == 1 and virtuals.describe("w") == {}
    assert virtuals.match("v", "b", (1, 2)) == 0 and "b" not in virtuals._served["v"].tables
    virtuals.keep([])
    assert len(virtuals) == 0


def test_the_reload_signal_reaches_what_keeps_tables_per_name() -> None:
    from router.events import MODELS_RELOADED, EventBus
    bus, seen = EventBus(), []
    bus.on_reloaded(lambda: seen.append(1))
    bus.publish("*", MODELS_RELOADED, {"added": [], "removed": ["v"], "changed": []})
    bus.publish_payload({"model": "*", "event": MODELS_RELOADED, "node": "peer-1"})  # a peer's
    bus.publish("*", "models_reload_failed", {"errors": []})
    assert seen == [1]
