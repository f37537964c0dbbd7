"""Tokenizers: a character-level one built locally, and loading any local Hugging Face tokenizer.

Nothing here touches the network: :func:`char_tokenizer` builds its vocabulary in memory with the
``tokenizers`` library, and :func:`load_tokenizer` reads a local directory only.
"""
from __future__ import annotations

import os
from pathlib import Path

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
#: special tokens of :func:`char_tokenizer`, in id order (pad = 0, bos = 1, eos = 2, unk = 3)
CHAR_SPECIALS = (PAD, BOS, EOS, UNK)

#: files of which a tokenizer directory needs at least one (fast tokenizer, or a config naming a slow one)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt")

#: ``tokenizer_class`` values (tokenizer_config.json) of a tokenizer that is its tokenizer.json and
#: nothing else: what ``save_pretrained`` writes for :func:`char_tokenizer` or any
#: ``PreTrainedTokenizerFast(tokenizer_object=...)``. :func:`load_tokenizer` loads these as that
#: class: ``AutoTokenizer`` builds the model type's own class instead where transformers 5 forces it
#: (``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS``: qwen2, phi3, ... when config.json sits beside it,
#: as in an exported model directory), and Qwen2Tokenizer rebuilds the pipeline from the vocabulary
#: with its own pre-tokenizer, which for a character vocabulary drops spaces, newlines and
#: non-ASCII characters.
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")

#: what :func:`load_tokenizer` encodes with the loaded tokenizer and with its directory's
#: tokenizer.json (through the ``tokenizers`` library) to check they agree: spaces (single, double,
#: leading), a newline and a tab, digits, punctuation, accented and non-Latin characters
PROBE_TEXT = " Hello,  world!\n\t12 + 34 = 46; café naïve «x» 中文 ok?"


def char_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: every character of ``alphabet`` is one token.

    Ids: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3 (any character outside the alphabet),
    then the alphabet's characters in order. ``encode`` adds no special tokens, so
    ``decode(encode(s)) == s`` for every string over the alphabet (spaces and newlines included).

    Text never encodes to a special token: ``"<eos>"`` written in the text is five characters
    (``<unk>`` for each one outside the alphabet), not EOS. Special tokens enter only as ids, from
    the code that appends EOS or pads; a chat template that writes ``{{ eos_token }}`` into its text
    therefore gets those characters, not the EOS id. With an alphabet holding ``<``, ``>`` and
    letters (``string.printable``), a literal ``"a<eos>b"`` used to become ``a``, EOS, ``b``:
    ``sft_batch`` trained an EOS in the middle of a completion, and decoding with
    ``skip_special_tokens=True`` gave ``"ab"``.

    >>> tok = char_tokenizer("0123456789+=")
    >>> tok.encode("12+3"), tok.decode(tok.encode("12+3"))
    ([5, 6, 14, 7], '12+3')
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    if not isinstance(alphabet, str) or not alphabet:
        raise ValueError(f"char_tokenizer: alphabet must be a non-empty string, got {alphabet!r}")
    seen: set[str] = set()
    duplicates = sorted({c for c in alphabet if c in seen or seen.add(c)})
    if duplicates:
        raise ValueError(f"char_tokenizer: alphabet repeats the characters {duplicates}; give each character once")
    vocab = {tok: i for i, tok in enumerate(CHAR_SPECIALS)}
    for c in alphabet:
        vocab[c] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # [\s\S] matches every character, newlines included: one pre-token per character.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins tokens without the spaces WordLevel's default decoding would insert.
    core.decoder = decoders.Fuse()
    # Hugging Face tokenizers match the special tokens' text in the input before the pre-tokenizer
    # runs, so "<eos>" written in the text became EOS although each of its characters is one
    # token. split_special_tokens=True (transformers' name for the tokenizers library's
    # encode_special_tokens) encodes that text as plain text. It is set here, not on the backend:
    # transformers sets the backend's encode_special_tokens from this attribute on every call (a
    # value set on the backend alone is overwritten), and saves it in tokenizer_config.json, so
    # save_pretrained + PreTrainedTokenizerFast / AutoTokenizer / load_tokenizer keep it.
    # tokenizer.json does not hold it (Tokenizer.from_file alone matches special tokens again);
    # load_tokenizer sets it again on a character tokenizer saved before this fix
    # (_restore_split_specials).
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        # transformers 4.x otherwise adds token_type_ids, which model.generate(**tok(...)) refuses
        model_input_names=["input_ids", "attention_mask"],
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        padding_side="left",
        split_special_tokens=True,
    )
    return tokenizer


def load_tokenizer(path: str | os.PathLike, *, pad_to_eos: bool = False) -> PreTrainedTokenizerBase:
    """Load a Hugging Face tokenizer from a LOCAL directory (never the hub).

    A tokenizer without a pad token is refused unless ``pad_to_eos=True``, which sets
    ``pad_token = eos_token`` (the usual choice for decoder-only models; rlkit masks by
    ``response_mask``, never by comparing ids with the pad id).

    The directory's tokenizer.json governs: a tokenizer saved as a plain tokenizers-backed one
    (``tokenizer_class`` in :data:`GENERIC_TOKENIZER_CLASSES`, e.g. :func:`char_tokenizer`) loads
    as that class, whatever model config.json sits beside it; any other loads through
    ``AutoTokenizer``, and is then checked to encode :data:`PROBE_TEXT` as tokenizer.json does
    (the ``tokenizers`` library reading the file). Where it does not, the directory is loaded as
    a ``PreTrainedTokenizerFast`` over tokenizer.json instead, with a warning naming both classes;
    ``ValueError`` if that disagrees too.
    """
    from transformers import AutoTokenizer

    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"load_tokenizer: {str(directory)!r} is not a directory; pass the path of a local tokenizer "
            "directory (one written by tokenizer.save_pretrained(path)); rlkit never downloads from the hub"
        )
    present = [f for f in TOKENIZER_FILES if (directory / f).is_file()]
    if not present:
        raise FileNotFoundError(
            f"load_tokenizer: {str(directory)!r} has none of the tokenizer files {list(TOKENIZER_FILES)} "
            f"(it holds {sorted(p.name for p in directory.iterdir())[:20]}); save one with tokenizer.save_pretrained(path)"
        )
    saved_json = directory / "tokenizer.json"
    if saved_json.is_file() and _declared_class(directory) in GENERIC_TOKENIZER_CLASSES:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    if saved_json.is_file():
        tokenizer = _as_saved(tokenizer, directory)
    _restore_split_specials(tokenizer)
    if tokenizer.pad_token is None:
        if pad_to_eos and tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        elif pad_to_eos:
            raise ValueError(
                f"load_tokenizer: the tokenizer in {str(directory)!r} has neither pad_token nor eos_token; "
                "set tokenizer.pad_token to one of its special tokens before saving it"
            )
        else:
            raise ValueError(
                f"load_tokenizer: the tokenizer in {str(directory)!r} has no pad_token (pad_token=None); "
                "pass pad_to_eos=True to use its eos_token "
                f"({tokenizer.eos_token!r}) as pad_token, or set tokenizer.pad_token and save it again"
            )
    return tokenizer


def _is_char_tokenizer(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether ``tokenizer`` is one :func:`char_tokenizer` built: a fast tokenizer over a
    ``WordLevel`` vocabulary of :data:`CHAR_SPECIALS` (ids 0-3) and single characters."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(tokenizer, PreTrainedTokenizerFast) or type(getattr(backend, "model", None)).__name__ != "WordLevel":
        return False
    vocab = backend.get_vocab()
    return all(vocab.get(tok) == i for i, tok in enumerate(CHAR_SPECIALS)) and all(
        len(tok) == 1 for tok in vocab if tok not in CHAR_SPECIALS
    )


def _restore_split_specials(tokenizer: PreTrainedTokenizerBase) -> None:
    """Make a loaded :func:`char_tokenizer` encode special tokens' text as characters.

    A directory saved before :func:`char_tokenizer` set ``split_special_tokens=True`` lacks it in
    tokenizer_config.json, and would encode ``"a<eos>b"`` with EOS in the middle again. Set on the
    instance and in ``init_kwargs`` (what ``save_pretrained`` writes), so saving it again keeps it.
    Other tokenizers are left alone: their chat templates write special tokens as text."""
    if getattr(tokenizer, "split_special_tokens", True) or not _is_char_tokenizer(tokenizer):
        return
    tokenizer.split_special_tokens = True
    tokenizer.init_kwargs["split_special_tokens"] = True
    tokenizer._tokenizer.encode_special_tokens = True


def _declared_class(directory: Path) -> str | None:
    """tokenizer_config.json's ``tokenizer_class`` (None without one, or unreadable)."""
    import json

    try:
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config.get("tokenizer_class") if isinstance(config, dict) else None


def _saved_ids(directory: Path) -> list[int]:
    """:data:`PROBE_TEXT`'s ids under the directory's tokenizer.json, read by the ``tokenizers`` library."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(directory / "tokenizer.json")).encode(PROBE_TEXT, add_special_tokens=False).ids


def _as_saved(tokenizer: PreTrainedTokenizerBase, directory: Path) -> PreTrainedTokenizerBase:
    """``tokenizer`` if it encodes :data:`PROBE_TEXT` as the directory's tokenizer.json does;
    else that tokenizer.json as a ``PreTrainedTokenizerFast`` (warning), or ``ValueError``."""
    import warnings

    expected = _saved_ids(directory)
    got = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    if got == expected:
        return tokenizer
    plain = PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)
    plain_ids = plain.encode(PROBE_TEXT, add_special_tokens=False)
    where = f"load_tokenizer: transformers loads {str(directory)!r} as {type(tokenizer).__name__}, which encodes {PROBE_TEXT!r} as"
    if plain_ids != expected:
        raise ValueError(
            f"{where} {got[:24]}, and as PreTrainedTokenizerFast as {plain_ids[:24]}, while the directory's tokenizer.json "
            f"(read by the tokenizers library) gives {expected[:24]}; neither class reproduces the saved tokenizer. Fix: "
            "save the tokenizer again with tokenizer.save_pretrained(path) from the transformers version that loads it, "
            "or load it yourself and pass it to rk.init(..., tokenizer=...)"
        )
    warnings.warn(
        f"{where} {got[:24]}, not as the directory's tokenizer.json does ({expected[:24]}: the tokenizer the files were "
        f"saved from); loaded it as PreTrainedTokenizerFast over tokenizer.json instead. To keep "
        f"{type(tokenizer).__name__}, load it with transformers.AutoTokenizer.from_pretrained(path) yourself",
        RuntimeWarning, stacklevel=3,
    )
    return plain


#: from this many tokens on, :func:`decode_batch` uses the ``tokenizers`` library's parallel
#: ``decode_batch`` (a Rayon thread pool); below it, one Rust ``decode`` per sequence
PARALLEL_DECODE_TOKENS = 16384


def encode_prompt(tokenizer, text: str) -> list[int]:
    """A text prompt's ids as the model saw prompts in pre-training: with the special tokens the
    tokenizer puts before the text (Llama's and Gemma's BOS), as TRL (``processing_class(text=...)``),
    vLLM and transformers' pipelines tokenize them; without those it puts after (an EOS appended by
    a post-processor would end the prompt). A tokenizer that adds nothing (Qwen, GPT-2, rlkit's
    character tokenizer) gives the plain ids."""
    ids = list(tokenizer(text)["input_ids"])
    plain = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if ids == plain or not plain:
        return ids if plain else plain
    for start in range(len(ids) - len(plain) + 1):
        if ids[start : start + len(plain)] == plain:
            return ids[: start + len(plain)]
    return ids  # the special tokens do not wrap the plain ids (a tokenizer that merges them): as it gives them


def decode_batch(tokenizer, sequences: list[list[int]]) -> list[str]:
    """``tokenizer.batch_decode(sequences, skip_special_tokens=True)``, with less overhead for
    fast tokenizers.

    transformers decodes a batch one sequence at a time through several Python layers; this
    calls the ``tokenizers`` library's Rust decoder directly. Large batches
    (:data:`PARALLEL_DECODE_TOKENS`) go through its parallel ``decode_batch``, small ones through
    ``decode`` per sequence: the parallel one starts a Rayon thread pool that, on a small machine,
    competes with torch's threads for no gain. Measured on 256 responses of 256 tokens on 2
    cores: transformers 20-25 ms, per sequence 15-20 ms, ``decode_batch`` 15-16 ms; on the GPU
    benchmark's 16-core host the rollout's overhead outside the engine was 27 ms with
    ``decode_batch`` and 40 ms per sequence (different runs). Used when it gives the same text:
    a fast tokenizer with no ``clean_up_tokenization_spaces`` post-processing; otherwise the
    transformers call.

    Special tokens are dropped, as TRL and verl decode for their rewards: ``[4, <unk>, 6]``
    decodes to ``"46"``, so a reward scoring this text cannot see that the model emitted an
    unknown, pad or EOS token. ``rollout`` (its ``response_text``) and ``score`` decode with this;
    to score the special tokens too, set the batch's ``response_text`` to
    ``tokenizer.batch_decode(ids, skip_special_tokens=False)`` (see :mod:`rlkit.transforms.score`)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if not (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and hasattr(backend, "decode_batch")
        and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
    ):
        return tokenizer.batch_decode(sequences, skip_special_tokens=True)
    if sum(len(ids) for ids in sequences) >= PARALLEL_DECODE_TOKENS:
        return backend.decode_batch(sequences, skip_special_tokens=True)
    return [backend.decode(ids, skip_special_tokens=True) for ids in sequences]


def check_known_characters(tokenizer, text: str, ids: list[int], where: str) -> None:
    """Raise ``ValueError`` naming the characters of ``text`` that ``tokenizer`` encodes (``ids``)
    as its unknown token.

    A byte-level BPE tokenizer never makes one; rlkit's :func:`~rlkit.models.tokenizers.char_tokenizer`
    makes one for every character outside its alphabet ("46 ✓", "2×3="). Training on it is silent
    damage: all unknown characters look alike to the model, and decoding drops the token, so a model
    taught to emit it emits text that no reward sees. Where the unknown token is also EOS, BOS or pad
    (GPT-2's ``"<|endoftext|>"``), that token written out in ``text`` is not counted."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None or unk not in ids:
        return
    literal = getattr(tokenizer, "unk_token", None)
    shared = unk in {getattr(tokenizer, name, None) for name in ("eos_token_id", "bos_token_id", "pad_token_id")}
    if shared and literal and ids.count(unk) <= text.count(literal):
        return  # GPT-2's "<|endoftext|>" is its unk, eos and bos: written out in the text, it is that special token
    if getattr(tokenizer, "is_fast", False):
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        spans = [(a, b) for i, (a, b) in zip(encoding["input_ids"], encoding["offset_mapping"]) if i == unk]
        pieces = _name_written_specials(tokenizer, text, spans)
    else:  # no offsets: the characters that alone encode to the unknown token
        pieces = [c for c in text if unk in tokenizer(c, add_special_tokens=False)["input_ids"]]
    pieces = list(dict.fromkeys(p for p in pieces if p and not (shared and p == literal)))
    # one character once: a written-out "<unk>" beside a lone "<" must not make the suggested
    # alphabet repeat "<", which char_tokenizer refuses
    missing = "".join(dict.fromkeys("".join(pieces)))
    raise ValueError(
        f"{where} {text!r:.80} has characters the tokenizer does not know: {pieces if pieces else '(not located)'} "
        f"(each is encoded as its unknown token {literal!r}, id {unk}: the model cannot tell them apart, and decoding "
        f"drops it, so a model taught to emit it writes text no reward sees); add them to the tokenizer's vocabulary "
        + (f"(for rlkit's character tokenizer: char_tokenizer(alphabet + {missing!r})) " if pieces else "")
        + "or remove them from the data"
    )


def _name_written_specials(tokenizer, text: str, spans: list[tuple[int, int]]) -> list[str]:
    """The text of each unknown-token span (``(start, end)`` in ``text``), in order; where the
    spans cover a special token written out in full (``"<unk>"`` with an alphabet lacking ``<``,
    ``u``, ``n``, ``k`` and ``>``), that token's text once instead of its characters.

    :func:`char_tokenizer` encodes a written-out special token as its characters, each unknown
    outside the alphabet; naming ``'<unk>'`` tells the user which text in the data to remove,
    where ``['<', 'u', 'n', 'k', '>']`` hides it among the other characters."""
    import re

    unknown = {k for a, b in spans for k in range(a, b)}
    specials = [t for t in getattr(tokenizer, "all_special_tokens", ()) if isinstance(t, str) and t]
    written = [
        (m.start(), m.end())
        for t in specials
        for m in re.finditer(re.escape(t), text)
        if all(k in unknown for k in range(m.start(), m.end()))
    ]
    pieces = []
    for a, b in spans:
        whole = next(((s, e) for s, e in written if s <= a and b <= e), None)
        pieces.append(text[whole[0] : whole[1]] if whole else text[a:b])
    return pieces
