"""The test-data fetcher's own errors (tests/fetch_testdata.py)."""
from __future__ import annotations

import sys

import pytest
from fetch_testdata import pip_download


def test_a_failed_pip_download_names_pips_own_error(tmp_path):
    """Not a guess at the cause (a full disk once read as 'the registry must be reachable'):
    pip's last error line, offline here (--no-index)."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-index", "--no-deps", "--dest",
               str(tmp_path), "no-such-package-for-this-test==1.0"]
    with pytest.raises(SystemExit) as failed:
        pip_download(command)
    message = str(failed.value)
    assert "pip download" in message and "no-such-package-for-this-test" in message
    assert "registry must be reachable" not in message
    assert "No matching distribution" in message
