"""The kernels package as it was at a past git revision, imported beside today's: the baseline of
targets set against the kernels of their day (issue 25's ">= 1.25x today's" attention forward).

    kernels_at("7b2e7b7").flash_attention(q, k, v, causal=True)

Its files come from ``git archive`` of this checkout's history into a temporary folder, the package
renamed ``kernels_<revision>`` and its custom ops' namespace ``horse_<revision>``, so that neither
clashes with today's. Needs git and the repository's .git (the device tool carries it when asked:
``carry=[".git"]``); without them a bench baseline built on it is unavailable, not an error.
"""

import importlib
import io
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from bench import suite

ROOT = Path(__file__).resolve().parents[1]


def kernels_at(revision: str):
    """The kernels package at revision (a commit the repository's history holds)."""
    name = f"kernels_{revision}"
    if name in sys.modules:
        return sys.modules[name]
    folder = Path(tempfile.gettempdir()) / "horse-revisions" / revision
    if not folder.exists():
        try:
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", revision, "kernels"], capture_output=True, check=True
            ).stdout
        except (OSError, subprocess.CalledProcessError) as error:
            detail = getattr(error, "stderr", b"").decode().strip() or error
            message = f"kernels at {revision} need git and this checkout's .git: {detail}"
            raise suite.UnavailableError(message) from error
        folder.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(dir=folder.parent))  # renamed whole: a reader never sees half
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.startswith("kernels/"):
                    text = tar.extractfile(member).read().decode()
                    if member.name.endswith(".py"):
                        text = re.sub(r"\b(from|import) kernels\b", rf"\1 {name}", text)
                        text = text.replace("horse::", f"horse_{revision}::")
                    path = scratch / name / member.name.removeprefix("kernels/")
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(text)
        try:
            scratch.rename(folder)
        except OSError:  # another process got there first, with the same files
            shutil.rmtree(scratch)
    sys.path.insert(0, str(folder))
    return importlib.import_module(name)
