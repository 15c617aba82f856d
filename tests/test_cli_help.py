"""Every option and argument of every `lifecycle` command has help text (issue 24: `--max-rows`, `--timezone`,
`--prefect-port` had none)."""

from __future__ import annotations

import argparse

from lifecycle.cli import _leaves, build_parser


def test_every_option_has_help():
    parser = build_parser([])
    missing, checked = [], 0
    for leaf in _leaves(parser):
        for action in leaf._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            checked += 1
            if not action.help or action.help == argparse.SUPPRESS or not action.help.strip():
                missing.append(f"{leaf.prog} {'/'.join(action.option_strings) or action.dest}")
    assert checked > 60
    assert missing == []


def test_every_subcommand_has_help():
    parser = build_parser([])
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            assert all(choice.help for choice in action._choices_actions), [c.dest for c in action._choices_actions]
