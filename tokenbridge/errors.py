"""Typed errors of the THL. Each message is one sentence naming the field, path or token at fault."""

from __future__ import annotations


class TokenizerLoadError(ValueError):
    """A tokenizer name or directory could not be turned into a fast tokenizer."""


class UnsupportedTokenizerError(ValueError):
    """A tokenizer the bridge cannot use as a source (its decode is not a concatenation of token bytes)."""


class BridgeError(ValueError):
    """Base of every bad-input outcome of `Bridge.__call__`; catch this to drop and count an experience."""


class EmptyCompletionError(BridgeError):
    """The completion has no tokens (or decodes to no text and has no EOS)."""


class InvalidTokenIdError(BridgeError):
    """A source id is negative, not an integer, or outside the source vocabulary."""


class LengthMismatchError(BridgeError):
    """Log-probs or mask do not have one entry per source token."""


class InvalidMaskError(BridgeError):
    """A loss mask that is not booleans (or the numbers 0 and 1)."""


class InvalidLogprobError(BridgeError):
    """Behaviour log-probs that are not numbers."""


class NonFiniteLogprobError(InvalidLogprobError):
    """A behaviour log-prob is NaN or infinite, or an aligned group's log-probs sum beyond float64."""


class SpecialTokenError(BridgeError):
    """A special (control) token appears where it has no text meaning, e.g. mid-completion."""


class UndecodableTextError(BridgeError):
    """The source bytes are not valid UTF-8 (e.g. the completion was cut inside a character)."""


class AlignmentError(BridgeError):
    """The destination tokens do not reproduce the text; raised instead of a silent misalignment."""
