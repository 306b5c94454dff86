"""THL, the Tokenizer Heterogeneity Layer: offline tokenizer loading, retokenization of a peer's
completion into the receiver's vocabulary with its token-level traces aligned, and the residual.

Public API (see tokenbridge/README.md):
    load_tokenizer(name_or_path, cache_dir=None) -> PreTrainedTokenizerFast
    Bridge(src_tokenizer, dst_tokenizer, cache_size=4096, dst_eos_id=None)(src_ids, logprobs=None, mask=None)
        -> BridgedCompletion
    Bridge.batch(list_of_src_ids, logprobs=None, masks=None) -> list[BridgedCompletion | BridgeError]
    build_learner_sequence(prompt_ids, bridged) -> (input_ids, loss_mask, behaviour_logprobs)
"""

from tokenbridge.align import Groups
from tokenbridge.bridge import Bridge, BridgedCompletion, BridgeStats
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
from tokenbridge.loading import BUILTIN_NAMES, default_cache_dir, load_tokenizer
from tokenbridge.sequence import build_learner_sequence

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
