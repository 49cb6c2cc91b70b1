"""The reliability suite (issue 7): faults injected one by one, and what survives them. Unit-level tests
are fast; those that run Snakemake are marked slow and share their pipeline runs per module."""
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))  # handbuilt.py, shared with the archive tests
