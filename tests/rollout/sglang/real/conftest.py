"""Fixtures of the tests against real SGLang servers on a CPU (megatron_zcpo/testing/real_sglang_server.py).

One server per release per test session, shared: ``release`` is a session-scoped fixture parametrized by
the served releases, so pytest runs every test of one release before the other's, and ``real_server``
hands out that release's server (started on first use, the other release's stopped first). The last one
stops after the last test of this folder (:func:`pytest_runtest_teardown`), not at the session's end.
Without a venv the tests skip, saying how to enable them; with ``ZCPO_REQUIRE_REAL_SGLANG=1`` (CI) they fail.
"""

from pathlib import Path

import pytest

from megatron_zcpo.testing.real_sglang_server import (
    SERVER_RELEASES,
    RealSGLangUnavailable,
    SharedServers,
    required,
    tiny_model,
    venv_python,
)

HERE = Path(__file__).parent


def available(release: str) -> None:
    """Skip the calling test (fail it under ``ZCPO_REQUIRE_REAL_SGLANG=1``) when ``release``'s venv is missing."""
    try:
        venv_python(release)
    except RealSGLangUnavailable as err:
        if required():
            pytest.fail(f"ZCPO_REQUIRE_REAL_SGLANG is set but {err}", pytrace=False)
        pytest.skip(str(err))


@pytest.fixture(scope="session", params=SERVER_RELEASES)
def release(request):
    """The SGLang release under test (its venv must exist)."""
    available(request.param)
    return request.param


KILLERS = pytest.StashKey[dict]()  # {release: how many tests kill one of its servers}


def pytest_configure(config):
    config.addinivalue_line("markers", "kills_server: the test kills the real server it is given (victim())")


def _release(item):
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("release") if callspec is not None and HERE in Path(str(item.path)).parents else None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """After pytest grouped the tests by release: those that kill their server go last in their release's group."""
    counts = {}
    for release in SERVER_RELEASES:
        group = [item for item in items if _release(item) == release]
        killers = [item for item in group if item.get_closest_marker("kills_server")]
        rest = [item for item in group if item not in killers]
        counts[release] = len(killers)
        if killers and rest:
            for item in killers:
                items.remove(item)
            at = items.index(rest[-1]) + 1
            items[at:at] = killers
    config.stash[KILLERS] = counts


@pytest.fixture(scope="session")
def shared_servers(request, tmp_path_factory):
    servers = SharedServers(tmp_path_factory.mktemp("real-sglang"), killers=request.config.stash.get(KILLERS, {}))
    yield servers
    servers.stop_all()


@pytest.fixture
def real_server(shared_servers, release):
    """``release``'s shared server (:class:`~megatron_zcpo.testing.real_sglang_server.RealSGLangServer`)."""
    return shared_servers.get(release)


@pytest.fixture(scope="session")
def model_dir():
    """The servers' model (the demo's tiny Qwen2 off AMX's tile sizes; :func:`tiny_model`)."""
    return tiny_model()


def pytest_runtest_teardown(item, nextitem):
    """After this folder's last test the shared server stops (it would idle on 2 GB until the session's end)."""
    if nextitem is None or HERE not in Path(str(nextitem.path)).parents:
        shared = item.funcargs.get("shared_servers")
        if shared is not None:
            shared.stop_all()
