"""What the server tests share: the check that the ``serve`` extra is installed (imported by
tests/integration/test_serve.py and tests/unit/test_serve_limits.py; not a test module itself).

    pytest tests/unit/test_serve_limits.py tests/integration/test_serve.py
"""

from __future__ import annotations

import importlib.util
import os

import pytest

SERVE_MODULES = ("fastapi", "uvicorn", "httpx")


def require_serve_extra() -> None:
    """Skip the calling test when the ``serve`` extra (and httpx, in ``dev``) is missing; fail instead
    when ``ELASTICMEM_REQUIRE_SERVE=1`` (set by .ci/run), so that CI cannot pass without the server tests."""
    missing = [m for m in SERVE_MODULES if importlib.util.find_spec(m) is None]
    if not missing:
        return
    why = (f"the server tests need {', '.join(missing)}: pip install 'elasticmem[serve,dev]' "
           "(ELASTICMEM_REQUIRE_SERVE=1 turns this skip into a failure)")
    if os.environ.get("ELASTICMEM_REQUIRE_SERVE") == "1":
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture
def serve_extra() -> None:
    """A test that takes this fixture runs only with the serve extra installed (see require_serve_extra)."""
    require_serve_extra()
