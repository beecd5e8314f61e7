"""patch() / unpatch() on a throw-away peer package written to tmp_path: what is replaced, what is
restored, and how an unsupported release or a changed signature is refused. Needs no real peer;
the real veRL / OpenRLHF / TRL are patched in tests/test_integration_*.py."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest

import pyppo.integrations as integrations
from pyppo.integrations import _patching
from pyppo.integrations._patching import Peer, PeerVersionWarning, Target

PACKAGE = "pyppo_fakepeer"


def adapter(x, y=1):
    return ("adapter", x, y)


def _write_peer(root, version="1.0"):
    pkg = root / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .core import f\n")
    (pkg / "core.py").write_text(
        textwrap.dedent(
            """
            def f(x, y=1):
                return ("peer", x, y)

            def g(x):
                return ("peer-g", x)

            REGISTRY = {"f": f, "other": len}
            """
        )
    )
    (pkg / "user.py").write_text("from .core import f\n\ndef call(x):\n    return f(x)\n")
    (pkg / "late.py").write_text("from .core import f\n")
    (root / "pyppo_fakepeer_outside.py").write_text(f"from {PACKAGE}.core import f\n")
    dist = root / f"{PACKAGE}-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {version}\n")


def _forget():
    for name in list(sys.modules):
        if name.startswith(PACKAGE):
            del sys.modules[name]


@pytest.fixture
def peer_root(tmp_path, monkeypatch):
    _write_peer(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    _forget()
    yield tmp_path
    _patching._ACTIVE.pop("fake", None)
    _forget()


def _peer(versions=("1.0",), adapter_fn=adapter, **kw):
    return Peer("fake", PACKAGE, PACKAGE, versions, (Target(f"{PACKAGE}.core", "f", adapter_fn),), **kw)


def test_patch_replaces_every_reference_in_the_package_and_unpatch_restores(peer_root):
    core = importlib.import_module(f"{PACKAGE}.core")
    user = importlib.import_module(f"{PACKAGE}.user")
    outside = importlib.import_module("pyppo_fakepeer_outside")
    original = core.f
    peer = _peer()

    p = _patching.patch(peer)
    assert set(p.originals) == {
        f"{PACKAGE}.f",
        f"{PACKAGE}.core.f",
        f"{PACKAGE}.user.f",
        f"{PACKAGE}.core.REGISTRY['f']",
    }
    assert all(fn is original for fn in p.originals.values())
    assert p.version == "1.0" and len(p) == 4
    assert core.f is adapter and core.REGISTRY["f"] is adapter and core.REGISTRY["other"] is len
    assert user.call(3) == ("adapter", 3, 1)
    assert outside.f is original  # outside the peer's package: left alone
    assert _patching.patch(peer) is p  # idempotent

    late = importlib.import_module(f"{PACKAGE}.late")  # imported while patched
    assert late.f is adapter

    assert _patching.unpatch(peer) is p
    assert core.f is original and core.REGISTRY["f"] is original and user.call(3) == ("peer", 3, 1)
    assert late.f is original
    assert _patching.unpatch(peer) is None


def test_unsupported_version_warns_with_both_versions_and_patches_nothing(peer_root):
    core = importlib.import_module(f"{PACKAGE}.core")
    original = core.f
    peer = _peer(versions=("0.9",))
    with pytest.warns(PeerVersionWarning, match=r"written for pyppo_fakepeer 0\.9.*pyppo_fakepeer 1\.0 is installed"):
        p = _patching.patch(peer)
    assert not p and core.f is original and _patching.active(peer) is None

    with pytest.warns(PeerVersionWarning, match="force=True"):
        p = _patching.patch(peer, force=True)
    assert core.f is adapter and len(p) == 3
    _patching.unpatch(peer)
    assert core.f is original


@pytest.mark.parametrize(
    "other",
    [
        lambda x, y=2: None,  # another default
        lambda x, z=1: None,  # another name
        lambda x, *, y=1: None,  # another kind
        lambda x: None,  # fewer parameters
    ],
)
def test_a_changed_signature_is_not_patched_and_is_named(peer_root, other):
    core = importlib.import_module(f"{PACKAGE}.core")
    original = core.f
    with pytest.warns(PeerVersionWarning, match=rf"{PACKAGE}\.core\.f\(x, y=1\)"):
        p = _patching.patch(_peer(adapter_fn=other))
    assert not p and core.f is original


def test_missing_peer_and_broken_import_raise_importerror(peer_root, monkeypatch):
    absent = Peer("fake", "pyppo-no-such-dist", PACKAGE, ("1.0",), ())
    with pytest.raises(ImportError, match=r"pyppo-no-such-dist is not installed.*pyppo-no-such-dist==1\.0"):
        _patching.patch(absent)
    broken = Peer(
        "fake", PACKAGE, PACKAGE, ("1.0",), (Target(f"{PACKAGE}.nope", "f", adapter),), import_help="Install the thing."
    )
    with pytest.raises(ImportError, match=rf"cannot import {PACKAGE}\.nope.*Install the thing\."):
        _patching.patch(broken)


def test_a_reference_reassigned_after_patch_is_left_alone_with_a_warning(peer_root):
    core = importlib.import_module(f"{PACKAGE}.core")
    user = importlib.import_module(f"{PACKAGE}.user")
    original = core.f
    peer = _peer()
    _patching.patch(peer)

    def mine(x, y=1):
        return "mine"

    user.f = mine
    with pytest.warns(PeerVersionWarning, match=rf"re-assigned after patch\(\): {PACKAGE}\.user\.f"):
        _patching.unpatch(peer)
    assert user.f is mine and core.f is original


def test_patched_context_restores_on_error(peer_root):
    core = importlib.import_module(f"{PACKAGE}.core")
    original = core.f
    peer = _peer()
    with pytest.raises(RuntimeError, match="boom"):
        with _patching.patched(peer) as p:
            assert core.f is adapter and p
            raise RuntimeError("boom")
    assert core.f is original and _patching.active(peer) is None

    # Inside an outer patch, the inner block must not undo it.
    outer = _patching.patch(peer)
    with _patching.patched(peer) as inner:
        assert inner is outer
    assert core.f is adapter
    _patching.unpatch(peer)


def test_unknown_peer_name_is_a_valueerror():
    with pytest.raises(ValueError, match=r"peer must be one of verl, openrlhf, trl, rlox; got 'deepspeed'"):
        integrations.patch("deepspeed")


def test_adapter_modules_do_not_import_their_peer():
    # The adapters must be usable where the peer is absent (and patch() must then fail cleanly):
    # importing an adapter module must not import the peer package.
    code = (
        "import sys, importlib\n"
        "for peer in ('verl', 'openrlhf', 'trl', 'rlox'):\n"
        "    mod = importlib.import_module('pyppo.integrations.' + peer)\n"
        "    assert peer not in sys.modules, peer\n"
        "    assert mod.PEER.name == peer and mod.PEER.targets\n"
        "    for t in mod.PEER.targets:\n"
        "        assert t.module.split('.')[0] == mod.PEER.package, t\n"
        "        assert t.adapter.__module__ == mod.__name__ and t.adapter.__doc__, t\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
