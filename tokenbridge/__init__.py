"""THL, the Tokenizer Heterogeneity Layer: offline tokenizer loading, retokenization of a peer's
completion into the receiver's vocabulary with its token-level traces aligned, and the residual.

Public API (see tokenbridge/README.md):
    load_tokenizer(name_or_path, cache_dir=None) -> PreTrainedTokenizerFast
    Bridge(src_tokenizer, dst_tokenizer, cache_size=4096, dst_eos_id=None)(src_ids, logprobs=None, mask=None)
        -> BridgedCompletion
    Bridge.batch(list_of_src_ids, logprobs=None, masks=None) -> list[BridgedCompletion | BridgeError]
    build_learner_sequence(prompt_ids, bridged) -> (input_ids, loss_mask, behaviour_logprobs)
"""

import importlib

from tokenbridge.errors import (
    AlignmentError,
    BridgeError,
    EmptyCompletionError,
    InvalidLogprobError,
    InvalidMaskError,
    InvalidTokenIdError,
    LengthMismatchError,
    NonFiniteLogprobError,
    SpecialTokenError,
    TokenizerLoadError,
    UndecodableTextError,
    UnsupportedTokenizerError,
)

# The rest loads on first use (PEP 562): transformers and the compiled kernels take seconds, and
# ``tokenbridge.cachedir`` or the errors must not pay for them (a config error is answered at once).
_LAZY = {
    "Groups": "tokenbridge.align",
    "Bridge": "tokenbridge.bridge",
    "BridgedCompletion": "tokenbridge.bridge",
    "BridgeStats": "tokenbridge.bridge",
    "BUILTIN_NAMES": "tokenbridge.loading",
    "default_cache_dir": "tokenbridge.loading",
    "load_tokenizer": "tokenbridge.loading",
    "build_learner_sequence": "tokenbridge.sequence",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'tokenbridge' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AlignmentError",
    "BUILTIN_NAMES",
    "Bridge",
    "BridgeError",
    "BridgeStats",
    "BridgedCompletion",
    "EmptyCompletionError",
    "Groups",
    "InvalidLogprobError",
    "InvalidMaskError",
    "InvalidTokenIdError",
    "LengthMismatchError",
    "NonFiniteLogprobError",
    "SpecialTokenError",
    "TokenizerLoadError",
    "UndecodableTextError",
    "UnsupportedTokenizerError",
    "build_learner_sequence",
    "default_cache_dir",
    "load_tokenizer",
]
