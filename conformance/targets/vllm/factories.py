"""vLLM's factories, by name: what ``--impl vllm``, ``vllm@X`` and ``vllm-v0@X`` build.

A factory picks the pool adapter (``adapter``) or the request level's
(``manager``) per ``config.level``, over the installed vLLM or a release loaded
in light mode. ``make_adapter`` uses light mode for the release named by
``$KVSPEC_VLLM_VERSION`` when it is set, else the installed vLLM;
``factory_for("vllm@0.24.0")`` builds the same from an impl name. The
registry finds this module through the ``kvspec.targets`` entry points
(``kvspec.conformance.targets.catalog``).
"""

from __future__ import annotations

import os
from pathlib import Path

from kvspec.conformance.core.adapter import AdapterConfig, AdapterFactory, BlockManagerAdapter, KVCacheManagerAdapter
from kvspec.conformance.targets.vllm.adapter import (
    VERSION_ENV,
    VllmRelease,
    _installed_spec_hashing,
    _selected_spec_hashing,
    has_null_block,
    installed_release,
    light_release,
    make_pool_adapter,
    spec_hashing_for,
    tree_release,
)
from kvspec.conformance.targets.vllm.lightmode import NEWEST, LightModeError, fetch_release, newest_release
from kvspec.conformance.targets.vllm.manager import make_manager_adapter
from kvspec.conformance.targets.vllm.releases import RELEASES, facts_for
from kvspec.conformance.targets.vllm.v0 import V0_RELEASES, make_v0_light_adapter

__all__ = ["factory_for", "make_adapter", "make_installed_adapter", "make_light_adapter", "make_release_adapter"]


def make_release_adapter(release: VllmRelease, config: AdapterConfig) -> BlockManagerAdapter | KVCacheManagerAdapter:
    """The adapter for ``config.level`` over one vLLM.

    Raises:
        LevelNotProvided: the request level of a release loaded in light mode (its pool only).
        ValueError: the pool cannot be built for this vLLM (the message says why).
    """
    if config.level == "pool":
        return make_pool_adapter(release, config)
    return make_manager_adapter(release, config)


def make_light_adapter(version: str) -> AdapterFactory:
    """A factory for one release loaded in light mode.

    Args:
        version: e.g. ``"0.24.0"``.

    Returns:
        A factory; the release is fetched (once) and loaded on its first call.
    """

    def factory(config: AdapterConfig) -> BlockManagerAdapter | KVCacheManagerAdapter:
        return make_release_adapter(light_release(version), config)

    factory.__qualname__ = factory.__name__ = f"vllm@{version}"
    # The hash function and seed the spec hashes with: the release's own where its chain is kvspec's.
    factory.spec_hashing = lambda: spec_hashing_for(version)  # type: ignore[attr-defined]
    # Releases without a null block cannot build the spec's one-block pool (it
    # would have no block at all): the harness starts them at two blocks, and so a
    # release the table does not declare, whose null block is not known before it loads.
    declared = version in RELEASES and facts_for(version).has_null_block
    factory.min_num_gpu_blocks = 1 if declared else 2  # type: ignore[attr-defined]
    return factory


def make_installed_adapter(config: AdapterConfig) -> BlockManagerAdapter | KVCacheManagerAdapter:
    """The installed vLLM (``import vllm``) as an implementation under test."""
    return make_release_adapter(installed_release(), config)


make_installed_adapter.spec_hashing = _installed_spec_hashing  # type: ignore[attr-defined]


def make_adapter(config: AdapterConfig) -> BlockManagerAdapter | KVCacheManagerAdapter:
    """vLLM as an implementation under test: light mode for ``$KVSPEC_VLLM_VERSION``, else the installed one.

    Raises:
        ImportError: ``$KVSPEC_VLLM_VERSION`` is unset and vLLM is not installed.
    """
    version = os.environ.get(VERSION_ENV)
    if version:
        return make_light_adapter(loadable_release(version))(config)
    try:
        release = installed_release()
    except ImportError as e:
        raise ImportError(
            f"vLLM is not installed here ({e}); install it, or set {VERSION_ENV}=<release> "
            "to load that release's BlockPool from its wheel (light mode)"
        ) from e
    return make_release_adapter(release, config)


make_adapter.spec_hashing = _selected_spec_hashing  # type: ignore[attr-defined]


def factory_for(impl: str) -> AdapterFactory:
    """The factory an impl name means: ``vllm`` (see ``make_adapter``), ``vllm@<release>`` (light mode) or
    ``vllm-v0@<release>`` (v0's allocator in light mode, kvspec.conformance.targets.vllm.v0).

    Raises:
        ValueError: ``impl`` is neither form.
    """
    if impl == "vllm":
        version = os.environ.get(VERSION_ENV)
        return make_light_adapter(loadable_release(version)) if version else make_adapter
    name, sep, version = impl.partition("@")
    if name not in ("vllm", "vllm-v0") or not sep or not version:
        raise ValueError(
            f"impl={impl!r} is not 'vllm', 'vllm@<release>' (e.g. vllm@0.24.0) "
            "or 'vllm-v0@<release>' (e.g. vllm-v0@0.6.6)"
        )
    if name == "vllm" and _names_a_folder(version):
        return make_tree_adapter(version)
    if name == "vllm-v0":
        if version not in V0_RELEASES:
            known = f"{V0_RELEASES[0]}..{V0_RELEASES[-1]}"
            raise ValueError(f"vllm=={version} ships no v0 allocator; v0 releases are {known}")
        return make_v0_light_adapter(version)
    return make_light_adapter(loadable_release(version))


def _names_a_folder(where: str) -> bool:
    """Whether ``vllm@<where>`` names a source tree: a release number never holds a path separator."""
    return "/" in where or os.sep in where or where.startswith(("~", ".")) or Path(where).is_dir()


def make_tree_adapter(tree: str) -> AdapterFactory:
    """A factory for a vLLM source tree (the folder that holds ``vllm/``), loaded in light mode where it is.

    Raises:
        ValueError: the folder is not a vLLM source tree (checked now, before anything runs).
    """
    try:
        release = tree_release(Path(tree))
    except LightModeError as e:
        raise ValueError(str(e)) from None
    version = release.version

    def factory(config: AdapterConfig) -> BlockManagerAdapter | KVCacheManagerAdapter:
        return make_release_adapter(tree_release(Path(tree)), config)

    factory.__qualname__ = factory.__name__ = f"vllm@{tree}"
    factory.spec_hashing = lambda: spec_hashing_for(version)  # type: ignore[attr-defined]
    # Read from its code, as a release's is declared: with a null block the spec's one-block pool is buildable.
    try:
        null_block = has_null_block(release, AdapterConfig(level="pool", num_gpu_blocks=2))
    except Exception as e:  # the tree's pool as checked out: a constructor kvspec does not know how to call
        raise ValueError(f"{tree}'s BlockPool does not build: {type(e).__name__}: {e}") from None
    factory.min_num_gpu_blocks = 1 if null_block else 2  # type: ignore[attr-defined]
    return factory


def loadable_release(version: str) -> str:
    """``version``, once light mode has its files: a release of the table, or one it does not declare
    (a newer release), fetched now so that what is missing is said before anything runs.

    ``newest`` is the package registry's newest release, asked now. An
    undeclared release is checked with its API read from its code, under the
    newest declared release's reactions (what it changed diverges).

    Raises:
        ValueError: it is not a release number, or the package registry does not have it (the message says which).
    """
    if version in RELEASES:
        return version
    try:
        if version == NEWEST:
            version = newest_release()
        fetch_release(version)
    except LightModeError as e:
        covered = f"kvspec's release table covers {RELEASES[0]}..{RELEASES[-1]}"
        raise ValueError(f"{e} ({covered}; vllm@<release> loads any release the registry has)") from None
    return version
