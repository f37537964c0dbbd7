"""``load_prompts`` reads each kind of source as what it is: files by their extension, pandas
DataFrames by rows, chat conversations as one prompt; and refuses, naming the source and the fix,
what it cannot read (a stream, unknown characters, a file of another format)."""
import json

import pytest

from rlkit.data import DataError, as_prompts, load_prompts
from rlkit.models.tokenizers import char_tokenizer

ROWS = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer("0123456789+= abcdefghijklmnopqrstuvwxyz")


@pytest.fixture(scope="module")
def chat_tok():
    t = char_tokenizer("0123456789+=: abcdefghijklmnopqrstuvwxyz")
    t.chat_template = ("{% for m in messages %}{{ m['role'] }}:{{ m['content'] }} {% endfor %}"
                       "{% if add_generation_prompt %}assistant:{% endif %}")
    return t


def _read(source, tok, **kw):
    s = load_prompts(source, tok, **kw)
    return s.text, s.columns


def test_a_pandas_dataframe_is_read_by_rows(tok):
    pd = pytest.importorskip("pandas")
    # iterating a DataFrame yields its column names: they were the prompts
    assert _read(pd.DataFrame(ROWS), tok) == (["1+1=", "2+2="], {"answer": ["2", "4"]})
    frame = pd.DataFrame({"prompt": ["1+1="], "n": [3]})
    n = load_prompts(frame, tok).columns["n"][0]
    assert n == 3 and type(n) is int  # numpy scalars become Python ones


def test_streaming_and_unknown_sources_are_refused_naming_type_and_fix(tok, tmp_path):
    datasets = pytest.importorskip("datasets")
    stream = datasets.IterableDataset.from_generator(lambda: iter(ROWS))
    with pytest.raises(DataError, match="streaming datasets.IterableDataset.*without streaming=True.*take"):
        load_prompts(stream, tok)  # was a bare TypeError (no len())
    with pytest.raises(DataError, match=r"DatasetDict of the splits \['train'\]; pass one split.*data\['train'\]"):
        load_prompts(datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}), tok)
    with pytest.raises(DataError, match="got a set whose item 0 is a int.*give a list of strings"):
        load_prompts({7}, tok)
    with pytest.raises(DataError, match="cannot read a float; give a list of strings"):
        load_prompts(1.5, tok)


def test_prompt_files_are_read_by_their_extension(tok, tmp_path):
    expected = (["1+1=", "2+2="], {"answer": ["2", "4"]})
    (tmp_path / "a.json").write_text(json.dumps(ROWS))  # was one prompt: the array
    (tmp_path / "b.json").write_text(json.dumps(ROWS, indent=2))  # was "line 1 is not valid JSON"
    (tmp_path / "c.json").write_text(json.dumps({"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}))
    (tmp_path / "d.json").write_text("\n".join(map(json.dumps, ROWS)))  # JSON lines named .json, as datasets reads them
    (tmp_path / "e.csv").write_text("prompt,answer\n1+1=,2\n2+2=,4\n")
    (tmp_path / "f.tsv").write_text("prompt\tanswer\n1+1=\t2\n2+2=\t4\n")
    for name in ("a.json", "b.json", "c.json", "d.json", "e.csv", "f.tsv"):
        assert _read(tmp_path / name, tok) == expected, name
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    pd.DataFrame(ROWS).to_parquet(tmp_path / "g.parquet")  # was a raw UnicodeDecodeError
    assert _read(tmp_path / "g.parquet", tok) == expected
    (tmp_path / "h.txt").write_text(json.dumps(ROWS[0]))
    with pytest.raises(DataError, match=r"h.txt' has the extension '.txt'; .*\.jsonl \(JSON lines\).*rename the file"):
        load_prompts(tmp_path / "h.txt", tok)
    (tmp_path / "i.csv").write_text("prompt,answer\n1+1=,2,extra\n")
    with pytest.raises(DataError, match="i.csv line 2 has more values than the 2 columns of its header line"):
        load_prompts(tmp_path / "i.csv", tok)


def test_chat_prompts_must_be_messages_with_role_and_content(chat_tok):
    with pytest.raises(DataError, match=r"prompt row 0: field 'prompt' is a list, so it must be a chat conversation.*message 1 is 'hi'"):
        load_prompts([[{"role": "user", "content": "hi"}, "hi"]], chat_tok)
    with pytest.raises(DataError, match="message 0 is .*'text'.*messages with 'role' and 'content'"):
        load_prompts([{"prompt": [{"text": "hi"}]}], chat_tok)


def test_one_conversation_is_one_prompt(chat_tok):
    messages = [{"role": "user", "content": "hi"}]
    rendered = chat_tok("user:hi assistant:", add_special_tokens=False)["input_ids"]
    one = load_prompts({"prompt": messages, "answer": "x"}, chat_tok)  # was "one list per column" (lengths 1, None)
    assert one.ids == [rendered] and one.columns == {"answer": ["x"]}
    row = as_prompts({"prompt": messages, "answer": "x"}, chat_tok)
    assert row.ids == [rendered] and row.columns == {"answer": ["x"]}
    alone = as_prompts(messages, chat_tok)  # was "prompt row 0 has no 'prompt' field"
    assert len(alone) == 1 and alone.ids == [rendered]
    with pytest.raises(DataError, match="looks like one chat message.*list of conversations"):
        load_prompts(messages, chat_tok)


def test_prompts_with_characters_the_tokenizer_does_not_know_are_refused():
    tok = char_tokenizer("0123456789+=")
    with pytest.raises(DataError, match=r"prompt row 1 '１２\+３=' has characters the tokenizer does not know: \['１', '２', '３'\]"
                                        r".*char_tokenizer\(alphabet \+ '１２３'\)"):
        load_prompts([{"prompt": "1+1=", "answer": "2"}, {"prompt": "１２+３=", "answer": "15"}], tok)
    with pytest.raises(DataError, match=r"prompt row 0 '1 \+ 1=' has characters the tokenizer does not know: \[' '\]"):
        as_prompts(["1 + 1="], tok)


def test_row_errors_name_the_file_and_its_line(tok, tmp_path):
    path = tmp_path / "gap.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", "answer": "4"}\n\n{"question": "3+3=", "answer": "6"}\n')
    with pytest.raises(DataError, match=f"prompt row 2 \\({path} line 5\\) has no 'prompt' field"):
        load_prompts(path, tok)
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", "answer": 4, "x": 1}\n')
    with pytest.raises(DataError, match=f"prompt row 1 \\({path} line 3\\) has columns \\['answer', 'x'\\]"):
        load_prompts(path, tok)
    (tmp_path / "e.csv").write_text("prompt,answer\n1+1=,2\n ,4\n")
    with pytest.raises(DataError, match="prompt row 1 \\(.*e.csv line 3\\): field 'prompt' is empty"):
        load_prompts(tmp_path / "e.csv", tok)

