"""The Triton versions the kernels take: the floor, its error, and setup.py's agreement with it."""

import re
from pathlib import Path

import pytest
import torch

from horse.kernels import runtime

ROOT = Path(__file__).resolve().parents[1]


def test_versions_read_as_major_and_minor():
    assert runtime.major_minor("3.4.0") == (3, 4)
    assert runtime.major_minor("3.10.1+git1a2b3c4") == (3, 10)  # compared as numbers: 3.10 > 3.9
    assert runtime.major_minor("3.10.1") > runtime.major_minor("3.9.0")


def test_a_triton_older_than_the_floor_is_refused_by_name():
    refusal = r"need triton>=3\.5; this environment has triton 3\.4\.0\. .*pip install 'torch>=2\.9'"
    with pytest.raises(ImportError, match=refusal):
        runtime.check_triton_version("3.4.0")
    for version in ("3.5.0", "3.6.0", "3.10.0+gitabcdef"):
        runtime.check_triton_version(version)


def test_setup_asks_for_the_triton_the_kernels_need():
    setup = (ROOT / "setup.py").read_text()
    triton_floor = re.search(r'"triton>=(\d+)\.(\d+)"', setup).groups()
    assert tuple(map(int, triton_floor)) == runtime.MIN_TRITON
    # PyTorch pins its Triton, and 2.9 is the first release that brings 3.5: a new floor moves both.
    assert runtime.MIN_TRITON == (3, 5) and '"torch>=2.9"' in setup


def test_grids_past_cudas_limits_raise_naming_the_axis():
    runtime.check_grid((2**31 - 1, 65535, 65535))
    for grid, axis in (((2**31,), 0), ((1, 65536), 1), ((1, 1, 65536), 2)):
        with pytest.raises(ValueError, match=rf"my_kernel: grid .* on axis {axis}, past CUDA's limit"):
            runtime.check_grid(grid, "my_kernel")


def test_every_kernel_launch_goes_through_the_grid_check():
    # kernel[grid](...) anywhere in the package would skip runtime.launch and its check.
    direct = re.compile(r"\b\w+\[[^\[\]]+\]\(")
    package = ROOT / "horse" / "kernels"
    for path in sorted(set(package.rglob("*.py")) - {package / "runtime.py"}):
        code = "\n".join(line.split("#")[0] for line in path.read_text().splitlines())
        assert not direct.findall(code), f"{path.name} launches a kernel without runtime.launch"
    assert "runtime.launch(" in (package / "attention" / "launch.py").read_text()


def test_a_launch_building_descriptors_has_an_allocator_and_leaves_the_callers():
    # Triton asks its allocator for the memory of descriptors built on the device; it has none by
    # default, and one the caller set must stay theirs after our launch.
    import contextvars
    from types import SimpleNamespace

    import triton
    from triton.runtime import _allocation

    seen = []

    class Kernel:
        fn = SimpleNamespace(__name__="kernel")

        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(_allocation._allocator.get()(256, 128, None))

    def callers(size, alignment, stream):
        raise AssertionError("the caller's allocator was asked")

    def run():
        triton.set_allocator(callers)
        runtime.launch_building_descriptors(Kernel(), (4,))
        assert _allocation._allocator.get() is callers

    contextvars.copy_context().run(run)  # the test's own allocator stays out of later tests
    assert seen[0].dtype == torch.int8 and seen[0].numel() == 256


def test_config_files_load_as_tables_and_ship_with_the_package():
    from horse.kernels import mlp
    from horse.kernels.attention import configs as attention_configs

    path = attention_configs.CONFIG_FILE
    assert path == ROOT / "horse" / "kernels" / "attention" / "configs.json"
    tables = runtime.load_configs(path, attention_configs.AttnConfig)
    for name in ("FWD_CONFIGS", "BWD_DKDV_CONFIGS", "BWD_DQ_CONFIGS"):  # sm90's as well
        assert set(tables[name]) == set(runtime.ARCHS) and tables[name] == getattr(attention_configs, name)
        for family in runtime.ARCHS:  # head dims as ints, in order: attn_config looks them up by number
            assert list(tables[name][family]) == [16, 32, 64, 128, 256, 512]
            assert all(isinstance(cfg, attention_configs.AttnConfig) for cfg in tables[name][family].values())
    # The MLP's file, beside its kernels, holds every family's GEMM tables, sm90's too.
    config_file = mlp.configs.CONFIG_FILE
    assert config_file.parent == Path(mlp.__file__).parent
    gemms = runtime.load_configs(config_file, mlp.configs.GemmConfig)["GEMM_CONFIGS"]
    assert gemms == mlp.configs.GEMM_CONFIGS and set(gemms) == set(runtime.ARCHS)
    assert all(
        list(classes) == ["large", "medium", "small"] for gemm in gemms.values() for classes in gemm.values()
    )
