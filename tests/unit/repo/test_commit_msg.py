"""The commit-message rule (.ci/commit_msg), run by CI on new commits and usable as a git commit-msg hook."""

import importlib.machinery
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / ".ci" / "commit_msg"


def checker():
    loader = importlib.machinery.SourceFileLoader("commit_msg", str(SCRIPT))
    spec = importlib.util.spec_from_loader("commit_msg", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_a_good_message_passes_and_each_rule_is_named():
    problems = checker().problems
    assert problems("Heal the whole training state\n\nWhy and what.\n") == []
    assert problems("Merge branch 'x'\n") == []
    assert problems("x" * 73 + "\n\nbody\n") == ["the subject has 73 characters; allowed: at most 72"]
    assert problems("Fix it.\n\nbody\n") == ["the subject ends with a period"]
    assert problems("Fixed the loader\n\nbody\n")[0].startswith("the subject starts with a past tense (Fixed)")
    assert problems("Fix the loader\n") == ["no body: a blank line after the subject, then what changed and why"]
    assert problems("Fix the loader\nbody right after\n") == [
        "no body: a blank line after the subject, then what changed and why"]
    assert problems("# a comment git strips\n\n") == ["the subject is empty"]


def test_the_commits_since_the_rule_began_pass():
    assert checker().main(["--new"]) == 0
