"""A policy option of the wrong type is one error line naming the option, the value and the type
(not Python's "'<' not supported between instances of 'str' and 'int'")."""

from __future__ import annotations

import pytest
from radixserve.cli import main


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
@pytest.mark.parametrize("value, shown", [("abc", "'abc' (str)"), ("1.5", "1.5 (float)"), ("true", "True (bool)")])
def test_wrong_type_of_fcfs_threshold(policy, value, shown, capsys):
    assert main(["config", "show", f"stack.policy={policy}", f"stack.policy_options.fcfs_threshold={value}"]) == 2
    err = capsys.readouterr().err
    assert "stack.policy_options.fcfs_threshold must be an integer, got " + shown in err, err
    assert "not supported between" not in err and len(err.strip().splitlines()) == 1


def test_a_negative_fcfs_threshold_is_still_refused(capsys):
    assert main(["config", "show", "stack.policy=lpm", "stack.policy_options.fcfs_threshold=-1"]) == 2
    assert "stack.policy_options.fcfs_threshold must be >= 0, got -1" in capsys.readouterr().err


def test_a_good_fcfs_threshold_is_shown(capsys):
    assert main(["config", "show", "stack.policy=lpm", "stack.policy_options.fcfs_threshold=7"]) == 0
    assert "fcfs_threshold" in capsys.readouterr().out
