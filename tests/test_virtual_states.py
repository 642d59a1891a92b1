"""Virtual models under crashes, by Hypothesis's stateful testing: the choice (``choose``) and
the record of what each target served (``Virtuals``) together, over targets that crash, come
back, load and fill their slots, and conversations that grow a turn at a time.

Invariants, after every step:
* a conversation's next turn goes to the target that served its last turn whenever that
  target can serve: it never moves away from its cache while that cache's target is up;
* a target that cannot serve is never chosen, and a choice is made whenever one can serve;
* ``fallback`` offers every other target that can serve as the rest, none twice;
* the record keeps nothing of a target or virtual model a reload removed.
"""

from __future__ import annotations

from types import MappingProxyType

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from router.config.presets import ModelPreset
from router.edge.virtual import CONVERSATION, Target, Virtuals, choose

NAMES = ("a", "b", "c")
POLICIES = ("warm", "spillover", "fallback")


class VirtualModels(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(POLICIES))
    def start(self, policy: str) -> None:
        self.policy = policy
        self.virtual = ModelPreset(id="v", args=MappingProxyType({}), targets=NAMES,
                                   choose=policy)
        self.virtuals = Virtuals()
        self.up = dict.fromkeys(NAMES, True)
        self.loaded = dict.fromkeys(NAMES, False)
        self.busy = dict.fromkeys(NAMES, False)
        self.turns: dict[int, int] = {}  # conversation -> turns so far
        self.last: dict[int, str] = {}  # conversation -> target of its last turn
        self.broken: list[str] = []

    @rule(name=st.sampled_from(NAMES))
    def crash(self, name: str) -> None:
        self.up[name] = self.loaded[name] = self.busy[name] = False

    @rule(name=st.sampled_from(NAMES))
    def recover(self, name: str) -> None:
        self.up[name] = True

    @rule(name=st.sampled_from(NAMES), busy=st.booleans())
    def fill(self, name: str, busy: bool) -> None:
        self.busy[name] = busy and self.loaded[name]

    @rule(conversation=st.integers(0, 5))
    def turn(self, conversation: int) -> None:
        turns = self.turns.get(conversation, 0) + 1
        keys = tuple(conversation * 100 + k for k in range(1, turns + 1))
        targets = [Target(n, self.up[n], self.loaded[n], self.busy[n], self.busy[n],
                          float(self.busy[n]), self.virtuals.match("v", n, keys))
                   for n in NAMES]
        choice = choose(self.policy, targets)
        able = [n for n in NAMES if self.up[n]]
        if choice is None:
            if able:
                self.broken.append(f"no choice though {able} can serve")
            return
        if not self.up[choice.target]:
            self.broken.append(f"chose {choice.target}, which cannot serve")
        before = self.last.get(conversation)
        if before is not None and self.up[before] and choice.target != before:
            self.broken.append(f"conversation {conversation} moved from {before} (up) to "
                               f"{choice.target} ({choice.reason})")
        if before is not None and self.up[before] and choice.reason != CONVERSATION:
            self.broken.append(f"conversation {conversation}'s turn chosen by {choice.reason}")
        if self.policy == "fallback" or choice.reason == CONVERSATION:
            rest = choice.rest
            if len(set(rest)) != len(rest) or choice.target in rest \
                    or any(not self.up[n] for n in rest):
                self.broken.append(f"rest {rest} of {choice}")
        self.virtuals.chose(self.virtual, choice, keys)
        self.turns[conversation] = turns
        self.last[conversation] = choice.target
        self.loaded[choice.target] = True

    @rule(kept=st.sampled_from([("a", "b", "c"), ("a", "b"), ("b", "c")]))
    def reload(self, kept: tuple[str, ...]) -> None:
        """A reload that gives the virtual model fewer targets: the record drops the others
        (and the conversations they served start over elsewhere)."""
        self.virtuals.keep([ModelPreset(id="v", args=MappingProxyType({}), targets=kept,
                                        choose=self.policy)])
        for gone in set(NAMES) - set(kept):
            if self.virtuals.match("v", gone, (1,)) or gone in self.virtuals._served.get(
                    "v", _EMPTY).tables:
                self.broken.append(f"{gone} kept after a reload removed it")
            self.up[gone] = self.loaded[gone] = self.busy[gone] = False
            for conversation, target in list(self.last.items()):
                if target == gone:
                    del self.last[conversation]

    @invariant()
    def nothing_broken(self) -> None:
        assert not self.broken, self.broken


class _Empty:
    tables: dict[str, object] = {}


_EMPTY = _Empty()

VirtualModels.TestCase.settings = settings(max_examples=300, stateful_step_count=40,
                                           deadline=None)
TestVirtualModels = VirtualModels.TestCase
