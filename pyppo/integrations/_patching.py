"""Swapping pyppo's adapters into an installed peer package, and back.

A peer's function is reachable under more names than the module that defines it: other modules
of the package import it by name (``from .utils import masked_mean``), and registries hold it in
dicts (veRL's ``ADV_ESTIMATOR_REGISTRY["gae"]``). :func:`patch` replaces every one of those
references that is loaded when it runs, inside the peer's own package; modules the package
imports later read the attribute of the defining module, which is by then the adapter. Modules
outside the package (a user's own ``from verl... import f``) are left alone: patching them behind
the user's back could turn a comparison against the peer into a comparison of pyppo with itself.

Version policy: the adapters reproduce one release of each peer. Any other release gets a
:class:`PeerVersionWarning` naming both versions and is not patched unless ``force=True``; with
``force``, a function whose signature differs from the one the adapter was written for is still
skipped, with a warning that names it. Nothing is ever replaced silently.

Besides replacing, a peer can list :class:`Registration` s: functions pyppo adds to a registry of
the peer under a new key (veRL's ``ADV_ESTIMATOR_REGISTRY["pyppo_gae"]``). :func:`patch` adds one
only where the key is free (a key held by another function is left alone, with a warning), and
:func:`unpatch` removes exactly the entries it added. A peer's ``optional_targets`` are targets
whose defining module may fail to import where the rest of the peer imports (veRL's trainer module
needs packages its math does not): such a target is then skipped and named in
:attr:`Patch.skipped`, without a warning, since nothing in that process can call it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "PeerVersionWarning",
    "Target",
    "targets",
    "Registration",
    "Peer",
    "Replacement",
    "Added",
    "Patch",
    "patch",
    "unpatch",
    "patched",
    "active",
    "original",
]


class PeerVersionWarning(UserWarning):
    """The installed peer is not a release pyppo's adapters were written for, or a function's
    signature differs from the one they reproduce."""


@dataclass(frozen=True)
class Target:
    """One peer function and the pyppo adapter that replaces it."""

    module: str  # the defining module, e.g. "verl.trainer.ppo.core_algos"
    name: str  # its attribute there
    adapter: Callable[..., Any]


def targets(module: str, *adapters: Callable[..., Any]) -> tuple[Target, ...]:
    """One :class:`Target` per adapter, each replacing the function of ``module`` that has the
    adapter's own name."""
    return tuple(Target(module, adapter.__name__, adapter) for adapter in adapters)


@dataclass(frozen=True)
class Registration:
    """One entry pyppo adds to a peer's registry: ``module.<registry>[key] = fn``."""

    module: str  # the module holding the registry, e.g. "verl.trainer.ppo.core_algos"
    registry: str  # the registry dict's attribute there, e.g. "ADV_ESTIMATOR_REGISTRY"
    key: Any
    fn: Callable[..., Any]

    @property
    def where(self) -> str:
        return f"{self.module}.{self.registry}[{self.key!r}]"


@dataclass(frozen=True)
class Peer:
    """A peer package: how to find it, which releases the adapters reproduce, what to replace."""

    name: str  # as users say it: "verl", "openrlhf", "trl"
    distribution: str  # the pip distribution whose version is checked
    package: str  # the import package whose modules are patched
    versions: tuple[str, ...]  # releases the adapters were written against
    targets: tuple[Target, ...]
    import_help: str = ""  # appended to the error when a defining module fails to import
    registrations: tuple[Registration, ...] = ()  # entries added to the peer's registries
    # Patched like ``targets`` where their module imports; skipped (Patch.skipped) where it does not.
    optional_targets: tuple[Target, ...] = ()

    @classmethod
    def named(
        cls,
        name: str,
        versions: tuple[str, ...],
        targets: tuple[Target, ...],
        import_help: str = "",
        registrations: tuple[Registration, ...] = (),
        optional_targets: tuple[Target, ...] = (),
    ) -> Peer:
        """The peer ``name`` whose pip distribution and import package are both called ``name``."""
        return cls(name, name, name, versions, targets, import_help, registrations, optional_targets)


@dataclass(frozen=True)
class Replacement:
    """One reference that :func:`patch` replaced: ``container[key]`` (a module's namespace or a
    registry dict) held ``original`` and now holds ``adapter``."""

    where: str  # "verl.trainer.ppo.core_algos.kl_penalty" or "...core_algos.ADV_ESTIMATOR_REGISTRY['gae']"
    original: Callable[..., Any]
    adapter: Callable[..., Any]
    container: Any = field(repr=False, compare=False)
    key: Any = field(repr=False, compare=False)
    is_attribute: bool = field(repr=False, compare=False, default=True)

    def current(self) -> Any:
        if self.is_attribute:
            return getattr(self.container, self.key, None)
        return self.container.get(self.key)

    def put(self, value: Any) -> None:
        _put(self.container, self.key, self.is_attribute, value)


def _put(container: Any, key: Any, is_attribute: bool, value: Any) -> None:
    if is_attribute:
        setattr(container, key, value)
    else:
        container[key] = value


@dataclass(frozen=True)
class Added:
    """One registry entry that :func:`patch` added: ``registry[key]`` was free and now holds ``fn``."""

    where: str  # "verl.trainer.ppo.core_algos.ADV_ESTIMATOR_REGISTRY['pyppo_gae']"
    fn: Callable[..., Any]
    registry: dict = field(repr=False, compare=False)
    key: Any = field(repr=False, compare=False)


@dataclass
class Patch:
    """What one :func:`patch` call did. ``originals`` maps each replaced reference's dotted name
    to the peer function it held; ``added`` lists the registry entries it added; ``skipped``
    names the optional targets left alone, and why; ``version`` is the peer's installed release."""

    peer: str
    version: str
    replacements: list[Replacement] = field(default_factory=list)
    added: list[Added] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def originals(self) -> dict[str, Callable[..., Any]]:
        return {r.where: r.original for r in self.replacements}

    def __len__(self) -> int:
        return len(self.replacements) + len(self.added)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __repr__(self) -> str:
        added = f", {len(self.added)} registry entries added" if self.added else ""
        return f"Patch({self.peer} {self.version}: {len(self.replacements)} references replaced{added})"


_ACTIVE: dict[str, Patch] = {}


def active(peer: Peer) -> Patch | None:
    """The patch currently applied to ``peer``, or None."""
    return _ACTIVE.get(peer.name)


def original(peer: Peer | str, module: str, name: str) -> Callable[..., Any]:
    """The peer's own ``module.name``: the function the active patch replaced there, or (not
    patched, or that target skipped) the module's current attribute. An adapter that handles
    some calls itself hands the others to this. ``peer``: the :class:`Peer` or its name (an
    adapter module cannot import the package that defines the peer from it). Raises ImportError
    if ``module`` does not import."""
    current = _ACTIVE.get(peer if isinstance(peer, str) else peer.name)
    if current is not None:
        where = f"{module}.{name}"
        for r in current.replacements:
            if r.where == where:
                return r.original
    return getattr(importlib.import_module(module), name)


def installed_version(peer: Peer) -> str:
    try:
        return importlib.metadata.version(peer.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(
            f"pyppo.integrations.{peer.name}.patch: {peer.distribution} is not installed "
            f"(the adapters were written for {peer.distribution}=={peer.versions[-1]})"
        ) from None


def _parameters(fn: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    sig = inspect.signature(fn)
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def _same_signature(original: Callable[..., Any], adapter: Callable[..., Any]) -> bool:
    """Names, kinds and defaults agree (annotations may differ)."""
    try:
        a, b = _parameters(original), _parameters(adapter)
    except (TypeError, ValueError):
        return False
    if len(a) != len(b):
        return False
    for (na, ka, da), (nb, kb, db) in zip(a, b):
        if na != nb or ka != kb:
            return False
        try:
            if not (da is db or da == db):
                return False
        except Exception:  # a default without a usable == (a tensor)
            return False
    return True


def _package_modules(package: str) -> list[Any]:
    prefix = package + "."
    return [
        m for name, m in list(sys.modules.items()) if m is not None and (name == package or name.startswith(prefix))
    ]


def _find_references(modules: list[Any], original: Callable[..., Any]) -> Iterator[tuple[str, Any, Any, bool]]:
    """(dotted name, container, key, is_attribute) of every reference to ``original``."""
    for mod in modules:
        namespace = getattr(mod, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            if value is original:
                yield f"{mod.__name__}.{attr}", mod, attr, True
            elif isinstance(value, dict) and not attr.startswith("__"):
                try:
                    items = list(value.items())
                except Exception:
                    continue
                for key, v in items:
                    if v is original:
                        yield f"{mod.__name__}.{attr}[{key!r}]", value, key, False


def patch(peer: Peer, *, force: bool = False) -> Patch:
    """Replace ``peer``'s functions with pyppo's adapters; see the module docstring.

    Returns the :class:`Patch` (what was replaced and added). Calling it again while patched
    returns the active patch unchanged. Raises ImportError when the peer or one of its defining
    modules cannot be imported (an optional target's module is skipped instead, see
    :attr:`Patch.skipped`); warns (:class:`PeerVersionWarning`) for an unsupported release, a
    changed signature, or a registration whose key is taken.
    """
    current = _ACTIVE.get(peer.name)
    if current is not None:
        return current
    version = installed_version(peer)
    result = Patch(peer.name, version)
    if version not in peer.versions:
        written = ", ".join(peer.versions)
        if not force:
            warnings.warn(
                f"pyppo.integrations.{peer.name}: the adapters were written for {peer.distribution} "
                f"{written}, but {peer.distribution} {version} is installed. Nothing was patched; "
                f"pass force=True to patch the functions whose signatures still match.",
                PeerVersionWarning,
                stacklevel=3,
            )
            return result
        warnings.warn(
            f"pyppo.integrations.{peer.name}: patching {peer.distribution} {version} with adapters "
            f"written for {written} (force=True); their results match only what that release computes.",
            PeerVersionWarning,
            stacklevel=3,
        )

    defining: dict[str, Any] = {}
    failed: dict[str, str] = {}  # optional modules that did not import: the error
    # Required modules first, so that a failing one raises before an optional one is tried.
    required = [t.module for t in peer.targets] + [r.module for r in peer.registrations]
    for module, optional in [(m, False) for m in required] + [(t.module, True) for t in peer.optional_targets]:
        if module in defining:
            continue
        try:
            with warnings.catch_warnings():
                if optional:  # a peer's trainer module announces at import the engines it lacks: not ours to show
                    warnings.simplefilter("ignore")
                defining[module] = importlib.import_module(module)
        except ImportError as e:
            if optional:
                failed[module] = str(e)
                continue
            raise ImportError(
                f"pyppo.integrations.{peer.name}.patch: cannot import {module} ({e})."
                + (f" {peer.import_help}" if peer.import_help else "")
            ) from e

    modules = _package_modules(peer.package)
    skipped: list[str] = []
    for target in peer.targets + peer.optional_targets:
        if target.module not in defining:
            result.skipped.append(
                f"{target.module}.{target.name} (cannot import {target.module}: {failed[target.module]})"
            )
            continue
        original = getattr(defining[target.module], target.name, None)
        where = f"{target.module}.{target.name}"
        if original is None:
            skipped.append(f"{where} (absent)")
            continue
        if not _same_signature(original, target.adapter):
            skipped.append(f"{where}{inspect.signature(original)}")
            continue
        for name, container, key, is_attribute in _find_references(modules, original):
            r = Replacement(name, original, target.adapter, container, key, is_attribute)
            r.put(target.adapter)
            result.replacements.append(r)
    if skipped:
        warnings.warn(
            f"pyppo.integrations.{peer.name}: left unpatched, their signatures differ from "
            f"{peer.distribution} {', '.join(peer.versions)}: " + "; ".join(skipped),
            PeerVersionWarning,
            stacklevel=3,
        )
    _register(peer, defining, result)
    if result:
        _ACTIVE[peer.name] = result
    return result


def _register(peer: Peer, defining: dict[str, Any], result: Patch) -> None:
    """Add ``peer``'s registrations whose key is free; warn about the others."""
    refused: list[str] = []
    for reg in peer.registrations:
        registry = getattr(defining[reg.module], reg.registry, None)
        if not isinstance(registry, dict):
            refused.append(f"{reg.where} (no such registry)")
            continue
        held = registry.get(reg.key, reg.fn)
        if held is not reg.fn:
            # Overwriting would silently change what the key means to whoever registered it.
            refused.append(f"{reg.where} (held by {held!r})")
        elif reg.key not in registry:
            registry[reg.key] = reg.fn
            result.added.append(Added(reg.where, reg.fn, registry, reg.key))
    if refused:
        warnings.warn(
            f"pyppo.integrations.{peer.name}: not registered: " + "; ".join(refused), PeerVersionWarning, stacklevel=4
        )


def unpatch(peer: Peer) -> Patch | None:
    """Put back what :func:`patch` replaced and remove the registry entries it added; returns
    that patch (None if none was active).

    A reference that something else re-assigned since is left as it is (with a warning):
    restoring it would undo someone else's change. The same holds for a registry entry that
    :func:`patch` added: it is removed only while it still holds pyppo's function.
    """
    current = _ACTIVE.pop(peer.name, None)
    if current is None:
        return None
    moved = []
    for a in reversed(current.added):
        if a.registry.get(a.key) is a.fn:
            del a.registry[a.key]
        else:
            moved.append(a.where)
    for r in reversed(current.replacements):
        if r.current() is r.adapter:
            r.put(r.original)
        else:
            moved.append(r.where)
    # A module of the package imported while patched bound the adapter by name: give it the
    # original too, or it would keep running pyppo after unpatch().
    originals = {id(r.adapter): r.original for r in current.replacements}
    adapters = {id(r.adapter): r.adapter for r in current.replacements}
    modules = _package_modules(peer.package)
    for key, adapter in adapters.items():
        for _, container, attr, is_attribute in _find_references(modules, adapter):
            _put(container, attr, is_attribute, originals[key])
    if moved:
        warnings.warn(
            f"pyppo.integrations.{peer.name}.unpatch: left as found, re-assigned after patch(): " + ", ".join(moved),
            PeerVersionWarning,
            stacklevel=3,
        )
    return current


@contextmanager
def patched(peer: Peer, *, force: bool = False) -> Iterator[Patch]:
    """``with patched(peer): ...`` patches for the block and restores on exit (if it patched)."""
    already = _ACTIVE.get(peer.name) is not None
    result = patch(peer, force=force)
    try:
        yield result
    finally:
        if not already and result:
            unpatch(peer)
