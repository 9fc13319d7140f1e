import os

import pytest


def pytest_configure(config):
    """Under pytest-xdist (the README's `-n auto`), the workers share the machine's cores: each
    one's torch kernels get its share of them. With torch's default (every core) in each of
    them, two workers on 2 cores ran the Hugging Face tests 1.5x slower than one process did:
    each OpenMP team waits on a worker the other process has preempted."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // workers))


def pytest_collection_modifyitems(config, items):
    import torch

    # the few long tests first: under xdist they then run beside the many short ones
    # instead of starting last and leaving one worker alone at the end
    items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
