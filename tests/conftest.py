"""Without a GPU the Triton kernels run through Triton's interpreter; the switch must be set before any
test module imports Triton (it is read when the kernels' decorators run).

`make test` runs the suite on pytest-xdist workers (`-n 2 --dist loadgroup --no-loadscope-reorder`): the hook below
makes each module one unit of work, so that its module-scoped fixtures (a pipeline run, a server) run once."""
import os

# torch's OpenMP threads sleep, not spin, while they wait for work, here and in every process the tests start (read
# when torch loads): with two workers and Snakemake's jobs on two cores a spinning thread holds a core another process
# needs (a 2-thread training loop beside a busy core: 3-8x slower spinning). The results are the same.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import cluster  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.hookimpl(wrapper=True)  # around xdist's own hook, which puts each test's group in its id
def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):
        return (yield)  # not an xdist worker: the order and the units are the serial session's
    # a test without an xdist_group goes with its module (cluster.shares_default_run groups across modules)
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    slow = {group(item) for item in items if item.get_closest_marker("slow")}
    # units with an end-to-end run first, the longest (the default run's) before all, and last among them those that
    # wait for it: the long ones start early, the short ones fill the workers at the end
    items.sort(key=lambda item: (group(item) not in slow, group(item) != cluster.DEFAULT_RUN,
                                 item.get_closest_marker("waits_for_default_run") is not None))
    result = yield
    # tests that share a working directory must not run on two workers at once: stop if the groups did not take
    if config.getvalue("loadgroup") and not all(item.nodeid.endswith(f"@{group(item)}") for item in items):
        raise pytest.UsageError("pytest-xdist did not group the tests (pytest 9.2 with xdist 3.8: "
                                "pytest-dev/pytest-xdist#1386): install the test extra's pytest, or run with -n 0")
    return result


def group(item) -> str:
    return item.get_closest_marker("xdist_group").args[0]
