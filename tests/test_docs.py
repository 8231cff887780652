"""The docs stay true: every relative link in them resolves (the file, and the heading an anchor
names), every command they show answers ``--help``, and every ``--flag`` they name is one that its
command accepts.

The docs are README.md, docs/, the README of a top-level folder and those inside horse/ (the
kernels'). A command is ``python -m MODULE`` (``.venv/bin/python``, ``python3``), ``python
path/to/script.py`` or ``torchrun``, in a code block or an inline code span; its flags are those on
its line, the line's comment included. A flag written outside a command (``--tp N`` in a sentence)
must be accepted by one of the commands shown on the same page: a page that speaks of a flag shows
the command it belongs to.

What a command accepts is read from its ``--help``, asked once per session: the modules one after
another in one process (torch is imported once), each script in a process of its own (it runs with
its own folder first on sys.path, as a user's does), side by side.
"""

import concurrent.futures
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# python -m bench hands the flags it does not know to pytest (pytest-benchmark's, --durations).
PASSES_UNKNOWN_FLAGS_TO = {"bench": "pytest"}
# pytest is asked without tests/conftest.py, which adds no flags but imports torch and Triton's
# interpreter: 1.1 CPU-seconds instead of 5.6.
HELP_ARGS = {"pytest": ["--noconftest"]}
# Programs whose flags are theirs to keep: a line or code span that runs one holds no flag of ours.
OTHER_PROGRAMS = {"bash", "git", "pip", "ruff"}

FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
INLINE_CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
COMMENT = re.compile(r"(?:^|\s)#(?:\s|$)")
# argparse's lines for options ("  -h, --help  show ...") and for subcommands ("  {export,verify}")
OPTION_LINE = re.compile(r"^ {2,6}(-\S.*?)(?: {2,}|$)", re.MULTILINE)
SUBCOMMANDS = re.compile(r"^ {2,6}\{([\w,-]+)\}\s*$", re.MULTILINE)

pytestmark = pytest.mark.xdist_group("docs")  # one worker asks every command for its --help, once


@dataclass(frozen=True)
class Target:
    """What a command runs: a module (``python -m``) or a script (a path from the root)."""

    kind: str  # "module" or "script"
    name: str

    def __str__(self) -> str:
        return f"python -m {self.name}" if self.kind == "module" else f"python {self.name}"


@dataclass
class Command:
    target: Target
    words: list[str]  # what follows the module or script
    where: str  # page:line
    flags: list[str] = field(default_factory=list)  # its --flags, those of the line's comment too

    def subcommands_named(self) -> list[str]:
        """The first word, if it is one ("attention|mlp": either)."""
        if not self.words or self.words[0].startswith("-"):
            return []
        return self.words[0].split("|")


@dataclass
class Page:
    path: Path
    commands: list[Command] = field(default_factory=list)
    prose_flags: list[tuple[str, str]] = field(default_factory=list)  # (flag, page:line)
    links: list[tuple[str, str]] = field(default_factory=list)  # (link, page:line)
    headings: list[str] = field(default_factory=list)


def flags_in(text: str) -> list[str]:
    return FLAG.findall(text)


def invocations(code: str, where: str) -> list[Command] | None:
    """The python and torchrun commands of one shell command (no &&, no comment); None if it runs
    no program (prose), [] if it runs one of OTHER_PROGRAMS."""
    try:
        words = shlex.split(code)
    except ValueError:  # an unbalanced quote
        words = code.split()
    while words and ENV_ASSIGNMENT.match(words[0]):
        words.pop(0)
    if not words:
        return None
    program = Path(words[0]).name
    if program in OTHER_PROGRAMS:
        return []
    if program in ("python", "python3") and len(words) >= 3 and words[1] == "-m":
        commands = [Command(Target("module", words[2]), words[3:], where)]
    elif program in ("python", "python3") and len(words) >= 2 and words[1].endswith(".py"):
        commands = [Command(Target("script", words[1]), words[2:], where)]
    elif program == "torchrun":
        script = next((i for i, word in enumerate(words) if word.endswith(".py")), len(words))
        commands = [Command(Target("module", "torch.distributed.run"), words[1:script], where)]
        if script < len(words):
            commands.append(Command(Target("script", words[script]), words[script + 1 :], where))
    else:
        return None
    for command in commands:
        command.flags = flags_in(" ".join(command.words))
    return commands


def commands_in(line: str, where: str) -> list[Command] | None:
    """The commands of a shell line (None if it runs no program); the flags of its comment go to
    its last command."""
    code, *comment = COMMENT.split(line, maxsplit=1)
    found = [invocations(part, where) for part in re.split(r"&&|\|\||;", code)]
    if all(commands is None for commands in found):
        return None
    commands = [command for commands in found if commands for command in commands]
    if commands and comment:
        commands[-1].flags += flags_in(comment[0])
    return commands


def read_page(path: Path) -> Page:
    page, fence, continued = Page(path), None, ""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        where = f"{path.relative_to(ROOT)}:{number}"
        if line.lstrip().startswith("```"):
            fence = line.strip()[3:].strip() if fence is None else None
            continue
        if fence is not None:  # a code block: shell lines, unless it is Python
            if fence == "python":
                continue
            if line.endswith("\\"):
                continued += line[:-1] + " "
                continue
            line, continued = continued + line, ""
            commands = commands_in(line, where)
            if commands is None:
                page.prose_flags += [(flag, where) for flag in flags_in(line)]
            else:
                page.commands += commands
            continue
        if line.startswith("#"):
            page.headings.append(line.lstrip("#").strip())
        page.links += [(link, where) for link in LINK.findall(INLINE_CODE.sub("", line))]
        for span in INLINE_CODE.findall(line):
            commands = commands_in(span, where)
            if commands is None:
                page.prose_flags += [(flag, where) for flag in flags_in(span)]
            else:
                page.commands += commands
    return page


def anchors(page: Page) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to hyphens,
    a repeated one numbered."""
    seen, result = {}, set()
    for heading in page.headings:
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        result.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return result


# --- what each command accepts, from its --help ---

HELP_DRIVER = r"""
import contextlib, io, json, re, runpy, sys, warnings

# runpy warns when a module to run was imported already (by one asked before it): nothing to see here.
warnings.filterwarnings("ignore", "'.*' found in sys.modules after import of package", RuntimeWarning)
subcommands, help_args = re.compile(sys.argv[1], re.MULTILINE), json.loads(sys.argv[3])

def ask(module, words):
    sys.argv = [f"python -m {module}", *help_args.get(module, []), *words, "--help"]
    out, code = io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_module(module, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except Exception as e:
            print(f"{type(e).__name__}: {e}")
            code = 1
    return code, out.getvalue()

helps = {}
for module in json.loads(sys.argv[2]):
    helps[module] = {"": ask(module, [])}
    for names in subcommands.findall(helps[module][""][1]):
        for name in names.split(","):
            helps[module][name] = ask(module, [name])
print(json.dumps(helps))
"""


def _ask_modules(modules: list[str]) -> dict[Target, dict[str, tuple[int, str]]]:
    args = [
        sys.executable,
        "-c",
        HELP_DRIVER,
        SUBCOMMANDS.pattern,
        json.dumps(modules),
        json.dumps(HELP_ARGS),
    ]
    run = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"asking {modules} for --help failed:\n{run.stderr}"
    helps = json.loads(run.stdout.splitlines()[-1])
    return {
        Target("module", module): {sub: tuple(answer) for sub, answer in helps[module].items()}
        for module in modules
    }


def _ask_script(script: Target) -> dict[Target, dict[str, tuple[int, str]]]:
    def ask(words: list[str]) -> tuple[int, str]:
        command = [sys.executable, script.name, *words, "--help"]
        run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
        return run.returncode, run.stdout + run.stderr

    helps = {"": ask([])}
    for names in SUBCOMMANDS.findall(helps[""][1]):
        helps |= {name: ask([name]) for name in names.split(",")}
    return {script: helps}


@pytest.fixture(scope="module")
def pages() -> list[Page]:
    folders = sorted(ROOT.glob("*/README.md")) + sorted((ROOT / "horse").rglob("README.md"))
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *dict.fromkeys(folders)]
    return [
        read_page(path) for path in paths if not any(p.startswith(".") for p in path.relative_to(ROOT).parts)
    ]


@pytest.fixture(scope="module")
def helps(pages) -> dict[Target, dict[str, tuple[int, str]]]:
    """Every named command's --help (code, text), and each of its subcommands': {target: {sub: ...}}."""
    targets = {command.target for page in pages for command in page.commands}
    targets |= {Target("module", name) for name in PASSES_UNKNOWN_FLAGS_TO.values()}
    modules = sorted(target.name for target in targets if target.kind == "module")
    scripts = [target for target in targets if target.kind == "script"]
    with concurrent.futures.ThreadPoolExecutor(len(scripts) + 1) as pool:
        jobs = [pool.submit(_ask_modules, modules), *(pool.submit(_ask_script, script) for script in scripts)]
        return {target: answers for job in jobs for target, answers in job.result().items()}


def accepted_flags(helps, target: Target, subcommands: list[str]) -> set[str]:
    """The flags of a command's --help, and of the subcommands named (all of them if none is)."""
    answers = helps[target]
    named = [sub for sub in subcommands if sub in answers] or [sub for sub in answers if sub]
    flags = {
        flag
        for sub in ["", *named]
        for line in OPTION_LINE.findall(answers[sub][1])
        for flag in flags_in(line)
    }
    if target.kind == "module" and target.name in PASSES_UNKNOWN_FLAGS_TO:
        flags |= accepted_flags(helps, Target("module", PASSES_UNKNOWN_FLAGS_TO[target.name]), [])
    return flags


# --- the tests ---


def test_the_readme_shows_the_two_commands_ci_runs(pages):
    # Guards the parser: the README's first two commands are found, whatever else changes.
    readme = next(page for page in pages if page.path == ROOT / "README.md")
    targets = {command.target for command in readme.commands}
    assert {Target("script", "horse/train.py"), Target("module", "pytest")} <= targets, targets


def test_every_relative_link_resolves(pages):
    by_path = {page.path: page for page in pages}
    broken = []
    for page in pages:
        for link, where in page.links:
            if re.match(r"^[a-z][a-z+.-]*:", link):  # https:, mailto:: not ours to check
                continue
            path, _, anchor = link.partition("#")
            target = (page.path.parent / path).resolve() if path else page.path
            if not target.exists():
                broken.append(f"{where}: {link}: no {target}")
            elif anchor and target.suffix == ".md":
                linked = by_path.get(target) or read_page(target)
                if anchor not in anchors(linked):
                    broken.append(f"{where}: {link}: no heading #{anchor} in {target.relative_to(ROOT)}")
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)


def test_every_command_answers_help(pages, helps):
    where = {command.target: command.where for page in pages for command in page.commands}
    silent = []
    for target, answers in helps.items():
        for sub, (code, text) in answers.items():
            if code != 0 or "usage:" not in text.lower():
                asked = " ".join(word for word in (str(target), sub, "--help") if word)
                named_at = where.get(target, "python -m bench passes flags on")
                silent.append(f"{named_at}: `{asked}` exited {code}:\n{text[-500:]}")
    assert not silent, "commands that do not answer --help:\n" + "\n".join(silent)


def test_every_flag_is_one_its_command_accepts(pages, helps):
    unknown = []
    for page in pages:
        for command in page.commands:
            subcommands = sorted(sub for sub in helps[command.target] if sub)
            if subcommands:
                unknown += [
                    f"{command.where}: `{command.target}` has no subcommand {name!r}, only {subcommands}"
                    for name in command.subcommands_named()
                    if name not in subcommands
                ]
            accepted = accepted_flags(helps, command.target, command.subcommands_named())
            unknown += [
                f"{command.where}: `{command.target}` does not accept {flag}"
                for flag in command.flags
                if flag not in accepted
            ]
        on_page = set().union(
            *(accepted_flags(helps, c.target, c.subcommands_named()) for c in page.commands)
        )
        shown = sorted({str(command.target) for command in page.commands})
        unknown += [
            f"{where}: {flag} is accepted by none of the commands this page shows ({', '.join(shown)})"
            for flag, where in page.prose_flags
            if flag not in on_page
        ]
    assert not unknown, "flags that their commands do not accept:\n" + "\n".join(unknown)
