"""The documentation runs: every python code block of the site (docs/**/*.md) and of README.md, page by page.

Each page's python blocks run in order in a process of its own, in one namespace (a later block may use what an
earlier one made), in a temporary working directory, with tracebacks naming the page and its line. The process is
forked from a server that imported torch, tpkit and transformers' modeling core once (`tpkit.launch.preload`: the
one `tpkit.launch` forks its ranks from), so a page does not pay those imports again; otherwise it starts as a fresh
interpreter would (its own environment, `__name__ == "__main__"`, nothing of the test process). A block whose
first line is a comment starting `# not run:` is skipped (it needs torchrun, several machines or a GPU); the
comment says why, and `test_few_blocks_are_skipped` keeps them few. Every `tpkit ...` command line in the pages'
shell blocks must parse with tpkit's own parser (a renamed flag fails here), and the generated CLI page
(docs/hooks/cli_reference.py) names every subcommand and option.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shlex
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "hooks" not in p.relative_to(DOCS).parts[:1]) + [ROOT / "README.md"]
CLI_EXAMPLES = DOCS / "hooks" / "cli_examples.md"  # included in the generated CLI page
SKIP = "# not run:"
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)[^\n]*$")

RUNNER = r"""
import json, sys
blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
for label, line, source in blocks:
    code = compile("\n" * (line - 1) + source, label, "exec")
    exec(code, namespace)
"""


def blocks(path: pathlib.Path) -> list[tuple[str, int, str, int]]:
    """(language, first line of the code, code, indent) of every fenced block of `path`."""
    out, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, start = len(m["indent"]), m["fence"], i + 1
        j = start
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        body = "\n".join(line[indent:] for line in lines[start:j])
        out.append((m["lang"].lower(), start + 1, body, indent))
        i = j + 1
    return out


def python_blocks(path: pathlib.Path) -> list[tuple[int, str]]:
    return [(line, code) for lang, line, code, _ in blocks(path) if lang in ("python", "py")]


def runnable(path: pathlib.Path) -> list[tuple[int, str]]:
    return [(line, code) for line, code in python_blocks(path) if not code.lstrip().startswith(SKIP)]


def _name(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


RUN_PAGES = [p for p in PAGES if runnable(p)]


@pytest.mark.parametrize("page", RUN_PAGES, ids=_name)
def test_python_blocks_run(page, tmp_path):
    todo = [(f"{_name(page)}", line, code) for line, code in runnable(page)]
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps(todo))
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               TPKIT_NO_PROGRESS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", MPLBACKEND="Agg")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_SIZE"):
        env.pop(var, None)  # the pages' blocks run as a plain script: a world of one unless they launch ranks
    log = tmp_path / "output.txt"
    code = _forked(_run_page, str(spec), str(work), env, str(log), timeout=600)
    assert code == 0, f"{_name(page)}: a python block failed (exit code {code})\n{log.read_text()[-8000:]}"


def _forked(target, *args, timeout: float) -> int:
    """`target(*args)` in a process forked from the preloaded server; its exit code."""
    import multiprocessing

    from tpkit.launch import preload

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(preload())  # read when the server starts (tpkit.launch may have started it)
    proc = ctx.Process(target=target, args=args)
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
    return proc.exitcode


def _run_page(spec: str, work: str, env: dict, log: str) -> None:
    """The page's blocks as RUNNER runs them, in `work`, with `env`, their output (and a traceback) in `log`."""
    os.chdir(work)
    os.environ.clear()
    os.environ.update(env)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    for fd in (1, 2):
        os.dup2(out, fd)
    sys.argv = ["blocks", spec]
    try:
        exec(RUNNER, {"__name__": "docs_runner"})
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def test_python_blocks_are_found_and_not_hidden():
    """Blocks inside admonitions or lists (indented fences) would be skipped silently: none may hold python."""
    hidden = [f"{_name(p)}:{line}" for p in PAGES for lang, line, _, indent in blocks(p)
              if lang in ("python", "py") and indent]
    assert not hidden, f"indented python blocks are not run; move them to the top level: {hidden}"
    assert len(RUN_PAGES) >= 10, [_name(p) for p in RUN_PAGES]


def test_few_blocks_are_skipped():
    skipped = {f"{_name(p)}:{line}": code.lstrip().splitlines()[0] for p in PAGES for line, code in python_blocks(p)
               if code.lstrip().startswith(SKIP)}
    total = sum(len(python_blocks(p)) for p in PAGES)
    assert len(skipped) <= max(6, total // 5), f"{len(skipped)} of {total} python blocks are not run: {skipped}"
    for where, first in skipped.items():
        assert len(first) > len(SKIP) + 5, f"{where}: say why the block is not run"


def _command_lines(path: pathlib.Path) -> list[tuple[int, list[str]]]:
    """`tpkit ...` command lines of the shell blocks of `path`, continuation lines joined, comments dropped."""
    out = []
    for lang, line, code, _ in blocks(path):
        if lang not in ("bash", "sh", "shell", "console"):
            continue
        joined = code.replace("\\\n", " ")
        for k, text in enumerate(joined.splitlines()):
            text = text.strip().removeprefix("$ ")
            if text.startswith("tpkit "):
                out.append((line + k, shlex.split(text, comments=True)[1:]))
    return out


def test_cli_lines_parse():
    from tpkit.cli import build_parser

    parser = build_parser()
    lines = [(f"{_name(p)}:{n}", argv) for p in PAGES + [CLI_EXAMPLES] for n, argv in _command_lines(p)]
    assert len(lines) >= 10
    for where, argv in lines:
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{where}: `tpkit {' '.join(argv)}` does not parse with tpkit's parser")


def _cli_hook():
    spec = importlib.util.spec_from_file_location("cli_reference", DOCS / "hooks" / "cli_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_cli_page_names_every_command_and_option():
    import argparse

    from tpkit.cli import SUBCOMMANDS, build_parser

    page = _cli_hook().render()
    subs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(subs) == set(SUBCOMMANDS)
    for name, sub in subs.items():
        assert f"## `tpkit {name}`" in page
        for action in sub._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help") and action.help != argparse.SUPPRESS:
                    assert f"`{flag}`" in page, f"tpkit {name} {flag} is missing from the CLI page"
    assert CLI_EXAMPLES.read_text().strip() in page


def test_example_scripts_and_flags_exist():
    """Every `examples/NAME.py --flag` in the pages' shell blocks names a script that exists and a flag it defines."""
    seen = 0
    for page in PAGES:
        for lang, line, code, _ in blocks(page):
            if lang not in ("bash", "sh", "shell", "console"):
                continue
            for k, text in enumerate(code.replace("\\\n", " ").splitlines()):
                words = shlex.split(text, comments=True)
                scripts = [w for w in words if re.fullmatch(r"examples/\w+\.py", w)]
                for script in scripts:
                    path = ROOT / script
                    assert path.exists(), f"{_name(page)}:{line + k}: {script} does not exist"
                    source = path.read_text()
                    after = words[words.index(script) + 1:]
                    for flag in (w.split("=")[0] for w in after if w.startswith("--")):
                        seen += 1
                        assert f'"{flag}"' in source, f"{_name(page)}:{line + k}: {script} has no {flag}"
    assert seen >= 10


def test_every_extra_is_named_where_installing_is_explained():
    """Each extra pyproject.toml defines is named in the README's install line (`... (extras: hf, ...)`) and in the
    getting-started page's paragraph "The extras: ..." (issue 49: the README left out `lora`, so a newcomer found
    and installed PEFT by hand)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    assert {"hf", "lora", "dev"} <= extras
    readme = (ROOT / "README.md").read_text()
    assert "(extras:" in readme, "README.md's install line no longer lists the extras"
    readme_named = set(re.findall(r"[\w-]+", readme.split("(extras:", 1)[1].split(")", 1)[0]))
    start = (DOCS / "getting-started.md").read_text()
    assert "The extras:" in start, "docs/getting-started.md no longer lists the extras"
    paragraph = start.split("The extras:", 1)[1].split("\n\n", 1)[0]
    page_named = set(re.findall(r"`([\w-]+)`", paragraph))
    assert not extras - readme_named, f"README.md's install line leaves out the extras {sorted(extras - readme_named)}"
    assert not extras - page_named, f"docs/getting-started.md's list of extras leaves out {sorted(extras - page_named)}"
