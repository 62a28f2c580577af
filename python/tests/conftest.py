"""pytest fixtures: the devices to run on (cpu, and cuda when torch sees one) and a fresh
random seed per run (printed; SPARSEKIT_TEST_SEED replays one)."""

import os
import random
import sys
import zlib

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SEED = int(os.environ.get("SPARSEKIT_TEST_SEED", random.SystemRandom().randrange(1 << 31)))


def pytest_report_header(config):
    return [f"sparsekit tests: seed {SEED} (SPARSEKIT_TEST_SEED={SEED} replays), devices {DEVICES}"]


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture
def gen(request):
    """A torch.Generator seeded from the run's seed and the test's name."""
    g = torch.Generator()
    g.manual_seed((SEED * 1_000_003 + zlib.crc32(request.node.name.encode())) % (1 << 62))
    return g
