"""The character tokenizer encodes special tokens' text ("<eos>", "<pad>", ...) as characters.

Hugging Face tokenizers match special tokens' text before the pre-tokenizer runs: with an
alphabet holding ``<``, ``>`` and letters, "a<eos>b" was ``a``, EOS, ``b``, so sft_batch trained an
EOS in the middle of a completion and decoding with skip_special_tokens=True gave "ab"."""
import json
import string

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import rlkit as rk
from rlkit.models.tokenizers import char_tokenizer, check_known_characters, decode_batch, load_tokenizer
from rlkit.sft import sft_batch

PRINTABLE = string.printable


def _chars(tok, text):
    return tok.convert_tokens_to_ids(list(text))


def _assert_splits(tok):
    for text in ("a<eos>b", "<pad>", "x<unk>", "<bos>1", "<eos><eos>"):
        assert tok.encode(text) == _chars(tok, text), text
        assert tok(text, add_special_tokens=False)["input_ids"] == _chars(tok, text), text
    assert tok.tokenize("a<eos>b") == list("a<eos>b")


def test_special_token_text_is_encoded_as_its_characters():
    tok = char_tokenizer(PRINTABLE)
    _assert_splits(tok)
    ids = tok.encode("a<eos>b")
    assert tok.eos_token_id not in ids and len(ids) == len("a<eos>b")
    # the backend tokenizer (what decode_batch and callers of backend_tokenizer use) agrees
    assert tok.backend_tokenizer.encode("a<eos>b", add_special_tokens=False).ids == ids
    # a literal "<unk>" over an alphabet holding its characters is no unknown token
    assert tok.unk_token_id not in tok.encode("see <unk> here")


def test_ids_of_ordinary_text_and_special_ids_are_unchanged():
    tok = char_tokenizer("0123456789+=")
    assert tok.encode("12+3") == [5, 6, 14, 7] and tok.decode([5, 6, 14, 7]) == "12+3"
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.convert_tokens_to_ids(["<pad>", "<bos>", "<eos>", "<unk>"]) == [0, 1, 2, 3]
    assert tok.encode("1 2") == [5, 3, 6]  # a character outside the alphabet is still <unk>
    printable = char_tokenizer(PRINTABLE)
    assert printable.encode("hello") == [4 + PRINTABLE.index(c) for c in "hello"]


def test_decode_with_and_without_skip_special_tokens():
    tok = char_tokenizer(PRINTABLE)
    ids = tok.encode("a<eos>b")
    assert tok.decode(ids) == "a<eos>b"
    assert tok.decode(ids, skip_special_tokens=True) == "a<eos>b"  # was "ab"
    assert decode_batch(tok, [ids]) == ["a<eos>b"]
    # special tokens given as ids still decode as before
    a, b = _chars(tok, "ab")
    assert tok.decode([a, tok.eos_token_id, b]) == "a<eos>b"
    assert tok.decode([a, tok.eos_token_id, b], skip_special_tokens=True) == "ab"
    assert decode_batch(tok, [[tok.pad_token_id, a, tok.eos_token_id]]) == ["a"]


def test_batch_padding_is_left_with_pad_ids():
    tok = char_tokenizer(PRINTABLE)
    enc = tok(["a<eos>b", "x"], padding=True)
    assert enc["input_ids"] == [_chars(tok, "a<eos>b"), [0] * 6 + _chars(tok, "x")]
    assert enc["attention_mask"] == [[1] * 7, [0] * 6 + [1]]


def test_sft_batch_appends_the_only_eos_and_accepts_a_literal_unk():
    tok = char_tokenizer(string.ascii_letters + string.digits + "<>=+ ")
    batch = sft_batch(tok, [("x=", "a<eos>b")])
    response = batch["response_ids"][0][batch["response_mask"][0]].tolist()
    assert response == _chars(tok, "a<eos>b") + [tok.eos_token_id]
    batch = sft_batch(tok, [("x=", "see <unk> here")])  # was refused as unknown characters
    assert tok.unk_token_id not in batch["response_ids"][0][batch["response_mask"][0]].tolist()


def test_split_survives_save_and_every_way_of_loading(tmp_path):
    tok = char_tokenizer(PRINTABLE)
    tok.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["split_special_tokens"] is True
    for loaded in (
        PreTrainedTokenizerFast.from_pretrained(str(tmp_path), local_files_only=True),
        AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True),
        load_tokenizer(tmp_path),
    ):
        _assert_splits(loaded)
        assert loaded.encode("hello") == tok.encode("hello")
        assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
        assert loaded.decode(loaded.encode("a<eos>b"), skip_special_tokens=True) == "a<eos>b"


def test_load_tokenizer_splits_a_char_tokenizer_saved_before_the_fix(tmp_path):
    """A directory saved without split_special_tokens (by rlkit before this fix) loads splitting,
    and saving it again keeps that."""
    char_tokenizer(PRINTABLE).save_pretrained(tmp_path / "old")
    config_path = tmp_path / "old" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("split_special_tokens", None)
    config_path.write_text(json.dumps(config))
    assert AutoTokenizer.from_pretrained(str(tmp_path / "old")).encode("a<eos>b")[1] == 2  # as old directories load
    loaded = load_tokenizer(tmp_path / "old")
    _assert_splits(loaded)
    loaded.save_pretrained(tmp_path / "again")
    _assert_splits(AutoTokenizer.from_pretrained(str(tmp_path / "again"), local_files_only=True))


def test_load_tokenizer_leaves_other_tokenizers_matching_their_special_tokens(tmp_path):
    """Other tokenizers' chat templates write special tokens as text: not split."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["<s>", "</s>", "<unk>", *"ab<>/s"])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="</s>").save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode("a</s>b") == [3, 1, 4] and not loaded.split_special_tokens


def test_chat_template_renders_as_before_and_writes_special_tokens_as_text():
    tok = char_tokenizer("0123456789+=: abcdefghijklmnopqrstuvwxyz<>")
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}:{{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}")
    messages = [{"role": "user", "content": "1+1="}]
    assert rk.load_prompts([messages], tok).ids == [_chars(tok, "user:1+1= assistant:")]
    # documented: a template writing {{ eos_token }} gets its characters, not the EOS id
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    out = tok.apply_chat_template(messages, tokenize=True)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    assert list(ids) == _chars(tok, "1+1=<eos>")


def test_arithmetic_tokenizer_ids_unchanged_and_written_specials_refused():
    tok = rk.tasks.arithmetic(n_train=8, n_test=2).tokenizer
    assert tok.encode("12+34=") == [5, 6, 14, 7, 8, 17]
    # the arithmetic alphabet lacks "<", "e", "o", "s", ">": a written EOS was an EOS in the
    # middle of the completion, trained in silence; now unknown characters, refused by name
    with pytest.raises(ValueError, match=r"completion '1<eos>2' has characters the tokenizer does not know: \['<eos>'\]"):
        sft_batch(tok, [("1+1=", "1<eos>2")])
    with pytest.raises(ValueError, match=r"completion '4<unk>' .*\['<unk>'\]"):
        sft_batch(tok, [("1+3=", "4<unk>")])


def test_unknown_characters_suggest_an_alphabet_without_repeats():
    tok = char_tokenizer("0123456789")
    text = "4<unk> <"
    with pytest.raises(ValueError, match=r"\['<unk>', ' ', '<'\] .*char_tokenizer\(alphabet \+ '<unk> '\)\)") as info:
        check_known_characters(tok, text, tok.encode(text), "x:")
    suggested = "0123456789" + "<unk> "
    char_tokenizer(suggested)  # the suggestion is an alphabet char_tokenizer accepts
    assert tok.unk_token_id not in char_tokenizer(suggested).encode(text), info.value
