import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def pytest_addoption(parser):
    parser.addoption("--extended", action="store_true", default=False,
                     help="more cases in the kill matrix and other long parametrisations")
