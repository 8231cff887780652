"""The bench suite's one benchmark, parametrized over every case by ``bench.suite.SuitePlugin``.

Collected only by ``python -m bench`` (its name is not ``test_*``), which passes the plugin.
"""

import pytest

from bench import timing

pytestmark = pytest.mark.benchmark(timer=timing.cuda_event_timer, disable_gc=True)


def bench_case(benchmark, case, suite):
    suite.run(benchmark, case)
