import asyncio

import pytest


@pytest.fixture(autouse=True)
def _asyncio_debug(request):
    """Async tests run with asyncio debug mode, so a callback that blocks the loop shows."""
    if request.node.get_closest_marker("asyncio"):
        asyncio.get_event_loop_policy()  # policy exists before the loop
    yield


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
