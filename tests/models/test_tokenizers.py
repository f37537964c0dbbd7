import json

import pytest

from rlkit.models.tokenizers import char_tokenizer, load_tokenizer

ALPHABET = "0123456789+-*= abc\n"


def test_char_tokenizer_ids_and_round_trip():
    tok = char_tokenizer(ALPHABET)
    # specials first, then the alphabet in order
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert len(tok) == 4 + len(ALPHABET)
    assert tok.encode("12+3") == [5, 6, 14, 7]
    for s in ["", "0", "12 + 34 = 46", "a\nb  c", "==**--"]:
        ids = tok.encode(s)
        assert len(ids) == len(s)  # one token per character, no specials added
        assert tok.decode(ids) == s
    # an unknown character maps to <unk> (id 3) instead of failing
    assert tok.encode("x1") == [3, 5]


def test_char_tokenizer_batch_padding_is_left_and_uses_pad():
    tok = char_tokenizer(ALPHABET)
    enc = tok(["1", "22"], padding=True)
    assert enc["input_ids"] == [[0, 5], [6, 6]]
    assert enc["attention_mask"] == [[0, 1], [1, 1]]


def test_char_tokenizer_rejects_bad_alphabets():
    with pytest.raises(ValueError, match="non-empty"):
        char_tokenizer("")
    with pytest.raises(ValueError, match=r"repeats the characters \['1'\]"):
        char_tokenizer("0121")


def test_save_and_load_round_trip(tmp_path):
    tok = char_tokenizer(ALPHABET)
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    s = "12*3 = 36\nabc"
    assert loaded.encode(s) == tok.encode(s)
    assert loaded.decode(tok.encode(s)) == s
    assert loaded.pad_token_id == 0 and loaded.eos_token_id == 2
    assert len(loaded) == len(tok)


def test_load_tokenizer_missing_directory_and_files(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope.*not a directory"):
        load_tokenizer(missing)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json.*notes\.txt"):
        load_tokenizer(tmp_path)


def _without_pad(tmp_path):
    tok = char_tokenizer(ALPHABET)
    tok.save_pretrained(tmp_path)
    # drop the pad token from the saved config (the fast tokenizer keeps its vocabulary)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("pad_token", None)
    config_path.write_text(json.dumps(config))
    return tmp_path


def test_load_tokenizer_without_pad(tmp_path):
    path = _without_pad(tmp_path)
    with pytest.raises(ValueError, match="pad_token.*pad_to_eos=True"):
        load_tokenizer(path)
    tok = load_tokenizer(path, pad_to_eos=True)
    assert tok.pad_token == "<eos>" and tok.pad_token_id == tok.eos_token_id == 2


@pytest.mark.parametrize("parallel_from", [10**9, 1])  # per-sequence decode / the library's decode_batch
def test_decode_batch_gives_transformers_batch_decode_text(monkeypatch, parallel_from):
    from rlkit.models import tokenizers as T
    from rlkit.models.tokenizers import decode_batch

    monkeypatch.setattr(T, "PARALLEL_DECODE_TOKENS", parallel_from)
    tok = char_tokenizer("0123456789+= .,'")
    seqs = [tok.encode("12 + 3 = 15 ."), [1] + tok.encode("7 ,") + [2, 0, 0], [], tok.encode("it's")]
    assert decode_batch(tok, seqs) == tok.batch_decode(seqs, skip_special_tokens=True)
    assert decode_batch(tok, seqs)[1] == "7 ,"  # special tokens dropped
    # with transformers' space clean-up on (" ." -> "."), the fast path would differ: it is not taken
    tok.clean_up_tokenization_spaces = True
    cleaned = tok.batch_decode(seqs, skip_special_tokens=True)
    assert cleaned[0] != tok._tokenizer.decode(seqs[0], skip_special_tokens=True)  # what the fast path gives
    assert decode_batch(tok, seqs) == cleaned
