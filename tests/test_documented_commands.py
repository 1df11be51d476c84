"""The commands the documentation tells a user to run, and the ones the screenshot script runs,
are accepted by the command line as it is: every command, option and argument parses (nothing is
connected to)."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path
from types import ModuleType

import click
import pytest

from outbox_bridge.cli import main

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def documented_commands(text: str) -> list[str]:
    """The ``outbox-bridge`` command lines of a page: each line of a shell code block, and each
    inline code span with an option (a bare ``outbox-bridge skip`` in prose names a command)."""
    found = [" ".join(span.split()) for span in re.findall(r"`(outbox-bridge [^`]+)`", text)]
    found = [line for line in found if " --" in line]
    for block in re.findall(r"```(?:sh|bash|console)\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith("outbox-bridge "):
                found.append(line)
    return found


def parse(argv: list[str]) -> None:
    """Parse ``outbox-bridge ARGV`` as the command line would, without running the command."""
    command: click.Command = main
    context = click.Context(main, info_name="outbox-bridge")
    name = "outbox-bridge"
    while isinstance(command, click.Group):
        name, *argv = argv
        found = command.get_command(context, name)
        if found is None:
            raise click.UsageError(f"no command {name!r}")
        if isinstance(found, click.Group):
            context = click.Context(found, info_name=name, parent=context)
        command = found
    with command.make_context(name, argv, parent=context):
        pass


DOCUMENTED = [
    pytest.param(line, id=f"{page.relative_to(ROOT)}: {line}")
    for page in PAGES
    for line in documented_commands(page.read_text())
]


def test_the_pages_show_commands() -> None:
    pages = {str(page.relative_to(ROOT)) for page in PAGES if documented_commands(page.read_text())}
    assert {"README.md", "docs/quickstart.md", "docs/how-to/operate.md"} <= pages
    assert len(DOCUMENTED) >= 20


@pytest.mark.parametrize("line", DOCUMENTED)
def test_a_documented_command_parses(line: str, tmp_path: Path) -> None:
    history = tmp_path / "history.json"
    history.write_text("{}")
    # A glob is the shell's: it reaches the command as the files it matches.
    argv = [str(history) if "*" in arg else arg for arg in shlex.split(line, comments=True)[1:]]
    parse(argv)


def screenshot_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("screenshots", ROOT / "scripts/screenshots.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_screenshot_script_s_commands_parse() -> None:
    script = screenshot_script()
    assert [command[0] for command in script.COMMANDS] == ["skip", "resume", "status"]
    for command in script.COMMANDS:
        parse(script.cli_argv(*command, temporal_port=7233))


def test_a_removed_option_does_not_parse() -> None:
    with pytest.raises(click.NoSuchOption):
        parse(["skip", "ORGANIZATION:7", "--reason", "down", "--no-such-option", "1"])
