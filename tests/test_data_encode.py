"""prepare's document encoder: the same ids as the tokenizer's own encode, whatever the text and whichever
kind of tokenizer (the fast path for byte-level ones, the tokenizer itself for the others)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, normalizers, pre_tokenizers, processors

from llmtrain.data import prepare as prep
from llmtrain.data import tokenizer as toks

AWKWARD = [
    "",
    " ",
    "\n",
    "it's we'll I'd they're you've I'm don't 'S 'RE x's ''s 's",
    "a  b   c\t\td\n\n  e \n   ",
    "12345 x1y2 3.14159 1,000,000 ٣٤٥ ५६ Ⅻ ½ ² 〇",
    "!!! ... ?!? --> <== ''' \"\"\" ``` ~~~",
    "naïve café Ελληνικά русский 東京 한국어 עברית العربية हिन्दी",
    "\u00a0nbsp \u2003em x\u3000y \u0085nel \u200bzwsp \u2028ls \u2029ps \u1680ogham \u180emvs",
    "emoji 🙂🙃👍🏽 e\u0301 combining a\u0308 \ufeffbom",
    "before <|endoftext|> after <|pad|>",
    "\x00\x01\x1c\x1d\x1e\x1f\x7f\x0b\x0c control",
    "\r\n\r\nwindows\r\nlines\r",
    "x" * 3000,
]
ALPHABET = (
    [chr(c) for c in range(128)]
    + list(" " * 20 + "\n" * 5 + "'" * 5 + "sdtmlrev")  # what the pattern's literals and contractions use
    + list("éüßñøłđżΩπЖя中文日本語한글٣५Ⅻ½²\u00a0\u2003\u3000\u0085\u200b\u0301🙂")
)


def random_texts(count: int, seed: int) -> list[str]:
    """Text from ALPHABET and from anywhere in Unicode (surrogates aside), in runs of every length."""
    rng = random.Random(seed)

    def char() -> str:
        if rng.random() < 0.9:
            return rng.choice(ALPHABET)
        code = rng.randrange(0x10FFFF)
        return chr(code) if not 0xD800 <= code < 0xE000 else "?"

    return ["".join(char() for _ in range(rng.randint(0, 300))) for _ in range(count)]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tok.json"
    toks.train_tokenizer(AWKWARD * 3 + random_texts(200, 1), 700, path)
    return path


def encoder(tok: Tokenizer) -> prep._DocumentEncoder:
    return prep._DocumentEncoder(tok, toks.start_ids(tok, toks.eot_id(tok)))


def reference(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    return toks.encode_documents(tok, texts, toks.start_ids(tok, toks.eot_id(tok)))


def test_llmtrains_tokenizer_takes_the_fast_path_and_gets_the_tokenizers_ids(tok_path: Path) -> None:
    tok = toks.load_tokenizer(tok_path)
    enc = encoder(tok)
    assert enc.fast
    texts = AWKWARD + random_texts(400, 2)
    for start in range(0, len(texts), 100):  # batches, as prepare sends them: classes and pieces grow
        batch = texts[start : start + 100]
        assert enc.encode(batch) == reference(tok, batch)
    assert len(enc.classes["L"]) > 52 and len(enc.classes["N"]) > 10  # met beyond ASCII, and classified


def test_remembered_pieces_start_over_at_the_limit(tok_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prep, "PIECE_CACHE", 50)
    tok = toks.load_tokenizer(tok_path)
    enc = encoder(tok)
    for seed in (3, 4, 5):
        texts = random_texts(30, seed)
        assert enc.encode(texts) == reference(tok, texts)
        assert len(enc.pieces) <= max(50, len(set().union(*(enc.split.findall(t) for t in texts))))


def test_a_start_token_goes_before_every_document(tok_path: Path) -> None:
    tok = toks.load_tokenizer(tok_path)
    tok.add_special_tokens(["<|begin_of_text|>"])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
    )
    enc = encoder(tok)
    assert enc.fast and enc.prefix == [bos]
    assert enc.encode(AWKWARD) == reference(tok, AWKWARD)


def _normalized(tok: Tokenizer) -> None:
    tok.normalizer = normalizers.NFKC()


def _prefix_space(tok: Tokenizer) -> None:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)


def _plain_added_token(tok: Tokenizer) -> None:
    tok.add_tokens([AddedToken("café", special=False)])


def _llama3_split(tok: Tokenizer) -> None:
    pattern = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


@pytest.mark.parametrize("change", [_normalized, _prefix_space, _plain_added_token, _llama3_split])
def test_other_tokenizers_are_left_to_encode_their_documents(
    tok_path: Path, change: Callable[[Tokenizer], None]
) -> None:
    tok = toks.load_tokenizer(tok_path)
    change(tok)
    enc = encoder(tok)
    assert not enc.fast
    texts = AWKWARD + random_texts(50, 6)
    assert enc.encode(texts) == reference(tok, texts)


def test_a_character_the_tokenizer_cannot_take_fails_as_it_did(tok_path: Path) -> None:
    tok = toks.load_tokenizer(tok_path)
    enc = encoder(tok)
    bad = ["fine", "a lone surrogate \ud800 here"]
    with pytest.raises(Exception) as theirs:
        reference(tok, bad)
    with pytest.raises(type(theirs.value)):
        enc.encode(bad)
    assert "\ud800" in enc.unclassified
    assert enc.fast and enc.encode(AWKWARD) == reference(tok, AWKWARD)  # the others still go fast
