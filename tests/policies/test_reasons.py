"""One vocabulary of decision reasons: every word the policy and the loop give is in
it, and README's table lists each of them."""

from __future__ import annotations

import re
from pathlib import Path

import policies.bandit.commitment
import policies.bandit.policy
from policies.reasons import Reason, reason_of

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_lists_every_reason_and_no_other() -> None:
    text = README.read_text()
    section = text[text.index("### Decision reasons") :]
    section = section[: section.index("\n\n", section.index("| --- |"))]
    listed = re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.MULTILINE)
    assert sorted(listed) == sorted(r.value for r in Reason)


def test_every_reason_the_policy_gives_is_a_word_of_the_vocabulary() -> None:
    for module in (policies.bandit.commitment, policies.bandit.policy):
        source = Path(module.__file__ or "").read_text()
        given = set(re.findall(r'reason = "([a-z_]+)"', source))
        given |= set(re.findall(r'_Commitment\(\s*[\w.]+,\s*[-\w.]+,\s*"([a-z_]+)"', source))
        given |= set(re.findall(r'Decision\(context, \w+, "([a-z_]+)"', source))
        assert given, module
        for word in given:
            assert reason_of(word) == word


def test_an_unknown_word_is_refused_clearly() -> None:
    try:
        reason_of("dwelling")
    except ValueError as exc:
        assert "dwelling" in str(exc) and "policies.reasons" in str(exc)
    else:
        raise AssertionError("an unknown reason was accepted")
