"""The README's command block lists exactly the options ``fusion-pass <command> --help`` lists.

The block is the ```` ``` ```` block of README.md whose lines start with ``fusion-pass demo``, ``dump``,
``backends``, ``selftest`` and ``report``; a line starting with spaces continues the command above it, and what
follows ``#`` is a comment. For each command the ``--options`` written there must be the long options of its
usage line (``--help`` left out), and an option written with its values (``--model mla|gqa|all``) must name
exactly the choices the command accepts.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from fusion_pass import cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
COMMANDS = ("demo", "dump", "backends", "selftest", "report")
OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)(?: ([\w.:]+(?:\|[\w.:]+)+))?")


def documented() -> dict[str, str]:
    """Per command, the text of its lines in the README's command block (comments cut)."""
    blocks, fence = [], None
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            if fence is None:
                fence = (line[3:].strip(), [])
            else:
                blocks.append(fence)
                fence = None
        elif fence is not None:
            fence[1].append(line)
    (block,) = ["\n".join(lines) for info, lines in blocks
                if not info and lines and lines[0].startswith("fusion-pass ")]
    commands: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        text = line.split("#", 1)[0]
        if line.startswith("fusion-pass "):
            current = line.split()[1]
            assert current not in commands, f"{current} documented twice"
            commands[current] = ""
        assert current is not None, line
        commands[current] += " " + text
    return commands


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_the_block_lists_every_command():
    assert sorted(documented()) == sorted(COMMANDS) == sorted(subparsers())


@pytest.mark.parametrize("command", COMMANDS)
def test_documented_options_are_those_help_lists(command):
    parser = subparsers()[command]
    usage = parser.format_usage()
    listed = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", usage)) - {"--help"}
    written = dict(OPTION.findall(documented()[command]))
    assert set(written) == listed, (f"README's `fusion-pass {command}` line lists {sorted(written)}, "
                                    f"`fusion-pass {command} --help` lists {sorted(listed)}")
    by_option = {s: a for a in parser._actions for s in a.option_strings}
    for option, values in written.items():
        action = by_option[option]
        if values and action.choices is not None:
            assert values.split("|") == list(action.choices), (command, option, values, action.choices)
    for positional in (a for a in parser._actions if not a.option_strings and a.dest != "help"):
        assert (positional.metavar or positional.dest) in documented()[command].split(), (command, positional)
