"""Error types. Every message is one line that names what was wrong and what is allowed."""


class OffloadError(Exception):
    """Base class of the errors `offload` raises for bad input."""


class ConfigError(OffloadError, ValueError):
    """An offload configuration value is out of range or of the wrong type."""


class ModelError(OffloadError, ValueError):
    """The model cannot be offloaded as given (no layer stack, meta tensors, ...)."""


class NonFiniteLogits(ModelError):
    """A forward's logits hold nan or inf: a damaged checkpoint or an overflowing dtype."""


def shown(value: object) -> str:
    """`value`'s repr, cut short: an error stays one readable line whatever was passed."""
    try:
        text = repr(value)
    except ValueError:  # an int of more digits than Python writes out (10**5000)
        if not isinstance(value, int):
            raise
        return f"an integer of {value.bit_length()} bits"
    return text if len(text) <= 60 else f"{text[:45]}...({len(text)} characters)"


def did_you_mean(name: str, choices: object) -> str:
    """ " (did you mean 'x'?)" for the choice closest to a mistyped `name`, or ""."""
    import difflib

    close = difflib.get_close_matches(name, [str(c) for c in choices], n=1, cutoff=0.6)  # type: ignore[attr-defined]
    return f" (did you mean {close[0]!r}?)" if close else ""


class UntrustedCacheError(OffloadError):
    """A cache folder (or its key) that another user could have written: nothing in it is
    read. The message names the folder, what is wrong (owner, mode) and the fix."""
