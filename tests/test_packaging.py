"""What the distribution installs, and that it lives beside transformers and Hugging Face's `kernels`.

The kernels are ``horse.kernels``: a top-level ``kernels`` would be the import name of Hugging Face's
package, which transformers (5.25 and newer) imports whenever one of its model modules is imported.
"""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run_python(code: str, cwd: Path) -> str:
    run = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_importing_horse_kernels_brings_no_model_trainer_or_distributed_code():
    # torch itself imports a few torch.distributed modules: only what horse.kernels adds counts.
    code = """
import sys
import torch
before = set(sys.modules)
import horse.kernels
added = sorted(set(sys.modules) - before)
heavy = ("horse.model", "horse.train", "horse.parallel", "horse.hf", "horse.data", "torch.distributed",
         "transformers", "kernels")
print("\\n".join(name for name in added if name.startswith(heavy)))
"""
    assert _run_python(code, ROOT).strip() == ""


def test_hugging_faces_kernels_and_ours_in_one_process(tmp_path):
    pytest.importorskip("kernels", reason="Hugging Face's kernels package is not installed")
    transformers = pytest.importorskip("transformers")
    version = transformers.__version__
    assert tuple(int(part) for part in version.split(".")[:2]) >= (5, 25), f"transformers {version}"
    # From the repository's root, where a top-level kernels/ folder would hide theirs, and from outside it.
    code = """
import kernels, torch
from horse.kernels import rms_norm
from transformers import LlamaConfig, LlamaForCausalLM
assert hasattr(kernels, "kernelize"), kernels.__file__  # Hugging Face's, not ours
x = torch.randn(3, 8)
torch.testing.assert_close(rms_norm(x, (8,), torch.ones(8)), torch.nn.functional.rms_norm(x, (8,)))
config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1)
print(LlamaForCausalLM(config)(torch.tensor([[1, 2, 3]])).logits.shape)
"""
    for cwd in (ROOT, tmp_path):
        env_code = f"import sys; sys.path.insert(0, {str(ROOT)!r})\n" + code
        assert _run_python(env_code, cwd).strip() == "torch.Size([1, 3, 32])"


def test_the_wheel_installs_horse_alone_with_its_data(tmp_path):
    pytest.importorskip("setuptools", reason="the wheel is built without build isolation (no network needed)")
    # Built from a copy: setuptools reuses a build/ folder it finds, so a stale one could hide a change.
    source = tmp_path / "source"
    shutil.copytree(ROOT / "horse", source / "horse", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-w", str(tmp_path)],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    [wheel] = tmp_path.glob("little_horse-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top_level == {"horse"}
    for data in ("horse/kernels/attention/configs.json", "horse/kernels/mlp/configs.json"):
        assert data in names
    assert "horse/corpus/tinyshakespeare.txt" in names
    packages = {str(path.parent.relative_to(ROOT)) for path in (ROOT / "horse").rglob("__init__.py")}
    assert packages <= {name.rsplit("/", 1)[0] for name in names}, "a horse subpackage is missing"


def test_the_trainer_as_a_script_leaves_top_level_kernels_to_hugging_face():
    # `python horse/train.py` (the README's command) puts horse/ first on sys.path, where horse/kernels
    # would be found as the top-level `kernels` that transformers imports. Run as that command starts.
    code = f"""
import importlib.util, runpy, sys
sys.path.insert(0, {str(ROOT / "horse")!r})
sys.argv = ["horse/train.py", "--help"]
try:
    runpy.run_path({str(ROOT / "horse" / "train.py")!r}, run_name="__main__")
except SystemExit:
    pass
spec = importlib.util.find_spec("kernels")
print(spec and spec.origin)
"""
    origin = _run_python(code, ROOT).strip().splitlines()[-1]
    assert not origin.startswith(str(ROOT / "horse")), origin
