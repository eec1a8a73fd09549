"""The offload cache folder: where conversions are kept (`$OFFLOAD_CACHE_DIR`, else
`$XDG_CACHE_HOME/offload`, else `~/.cache/offload`), and whether an entry in it may be
used: a whole conversion whose signature checks (`memory.cache_digest`). The folder is
made and checked as the user's own by `memory.cache_trust`."""

from __future__ import annotations

from pathlib import Path

from offload.memory.cache_digest import NotSigned, check_entry
from offload.memory.cache_trust import cache_root


def cache_dir() -> Path:
    """`$OFFLOAD_CACHE_DIR`, else `$XDG_CACHE_HOME/offload`, else `~/.cache/offload` (only
    named: `cache_trust.cache_folder` makes and checks it)."""
    return cache_root()


def entry_not_usable(target: Path) -> str | None:
    """None where `target` is a whole conversion signed in this cache; else what is wrong
    with it, for a warning ("" where there is none)."""
    if not target.exists() and not target.is_symlink():
        return ""
    if not (target / "config.json").is_file():
        return "is not a whole conversion (no config.json)"
    try:
        check_entry(target)
    except NotSigned as why:
        return f"is not used ({why})"
    except OSError as error:
        return f"is not used (it cannot be read: {error.strerror or error})"
    return None
