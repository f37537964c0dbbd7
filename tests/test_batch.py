import pytest
import torch

from rlkit.batch import BatchError, make_batch, packed, unpack_response, validate, group_size, column


def test_make_batch_pads_prompts_left_and_responses_right():
    b = make_batch([[5, 6], [7]], [[1, 2, 3], [4]], pad_token_id=0, group=[0, 0], rewards=[1.0, 0.0])
    assert b["prompt_ids"].tolist() == [[5, 6], [0, 7]]
    assert b["prompt_mask"].tolist() == [[True, True], [False, True]]
    assert b["response_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert b["response_mask"].tolist() == [[True, True, True], [True, False, False]]
    assert b["rewards"].tolist() == [1.0, 0.0]


def test_columns_follow_rows_through_indexing():
    b = make_batch([[1], [2], [3]], [[4], [5], [6]], columns={"answer": ["a", "b", "c"]})
    sub = b[torch.tensor([2, 0])]
    assert column(sub, "answer") == ["c", "a"]
    assert sub["prompt_ids"].flatten().tolist() == [3, 1]


def test_packed_view_round_trips_responses():
    b = make_batch([[5, 6], [7]], [[1, 2, 3], [4]], pad_token_id=0)
    pk = packed(b)
    assert pk.input_ids.tolist() == [5, 6, 1, 2, 3, 7, 4]
    assert pk.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1]
    assert pk.cu_seqlens.tolist() == [0, 5, 7]
    assert pk.input_ids[pk.response_index].tolist() == [1, 2, 3, 4]
    back = unpack_response(pk.input_ids[pk.response_index], b)
    assert torch.equal(back, b["response_ids"] * b["response_mask"])


def test_packed_view_can_leave_out_each_rows_last_response_token():
    b = make_batch([[5, 6], [7], [8]], [[1, 2, 3], [4], []], pad_token_id=0)
    full, short = packed(b), packed(b, drop_last=True)
    assert short.input_ids.tolist() == [5, 6, 1, 2, 7, 8]
    assert short.position_ids.tolist() == [0, 1, 2, 3, 0, 0]
    assert short.cu_seqlens.tolist() == [0, 4, 5, 6] and short.max_seqlen == 4
    assert short.input_ids[short.response_index].tolist() == [1, 2]
    # both predict every response token from the token before it
    for pk in (full, short):
        assert pk.input_ids[pk.predict_index].tolist() == [6, 1, 2, 7]
    assert full.predict_index.tolist() == (full.response_index - 1).tolist()


def test_validation_names_the_field():
    b = make_batch([[1], [2]], [[3], [4]])
    b.set("advantages", torch.zeros(2, 5))
    with pytest.raises(BatchError, match="advantages"):
        validate(b)
    b = make_batch([[1], [2]], [[3], [4]])
    b.set("rewards", torch.tensor([1.0, float("nan")]))
    with pytest.raises(BatchError, match="rewards.*rows \\[1\\]"):
        validate(b)
    b = make_batch([[1], [2]], [[3], [4]])
    b.set("response_mask", torch.zeros(2, 1, dtype=torch.bool))
    with pytest.raises(BatchError, match="response_mask"):
        validate(b)
    with pytest.raises(BatchError, match="rewards"):
        validate(make_batch([[1]], [[2]]), require=("rewards",))
    with pytest.raises(BatchError, match="prompt_ids has 2 rows"):
        make_batch([[1], [2]], [[3]])
    with pytest.raises(BatchError, match="empty"):
        make_batch([], [])


def test_group_size_rejects_ragged_groups():
    b = make_batch([[1]] * 3, [[2]] * 3, group=[0, 0, 1])
    with pytest.raises(BatchError, match="group"):
        group_size(b)


def test_shallow_copy_shares_fields_but_not_the_key_set():
    import torch

    from rlkit.batch import column, make_batch, shallow_copy

    b = make_batch([[1, 2], [3]], [[4], [5, 6]], columns={"answer": ["x", "y"]})
    b.set_non_tensor("note", {"k": 1})
    c = shallow_copy(b)
    c.set("rewards", torch.tensor([1.0, 2.0]))
    c.set("response_ids", torch.zeros_like(b["response_ids"]))
    assert "rewards" not in b.keys() and b["response_ids"].tolist() == [[4, 0], [5, 6]]
    assert c["prompt_ids"] is b["prompt_ids"]  # shared, not copied
    assert column(c, "answer") == ["x", "y"] and c.get_non_tensor("note") == {"k": 1}
    assert c.batch_size == b.batch_size


def test_row_tokens_equals_per_row_masking_for_right_and_left_padding():
    from rlkit.batch import row_tokens

    b = make_batch([[3, 4, 5], [6]], [[7, 8], [9, 10, 11]], pad_token_id=0)
    for ids, mask in ((b["response_ids"], b["response_mask"]), (b["prompt_ids"], b["prompt_mask"])):
        expected = [[int(t) for t, m in zip(r, mk) if m] for r, mk in zip(ids.tolist(), mask.tolist())]
        assert row_tokens(ids, mask) == expected
    assert row_tokens(b["response_ids"], b["response_mask"]) == [[7, 8], [9, 10, 11]]
    assert row_tokens(b["prompt_ids"], b["prompt_mask"]) == [[3, 4, 5], [6]]


def test_pad_left_and_right_equal_a_row_by_row_reference():
    # ragged rows (lists or tensors, some empty) padded to the longest: ids and masks equal a
    # plain per-row copy
    import random

    from rlkit.batch import _pad_left, _pad_right

    def reference(rows, pad, left):
        width = max((len(r) for r in rows), default=0)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, r in enumerate(rows):
            if len(r):
                cols = slice(width - len(r), None) if left else slice(0, len(r))
                ids[i, cols] = torch.as_tensor(list(r))
                mask[i, cols] = True
        return ids, mask

    rng = random.Random(0)
    for trial in range(100):
        rows = [[rng.randrange(100) for _ in range(rng.randrange(0, 9))] for _ in range(rng.randrange(0, 6))]
        if trial % 3 == 0:
            rows = [torch.tensor(r, dtype=torch.long) for r in rows]
        for left, pad_fn in ((True, _pad_left), (False, _pad_right)):
            ids, mask = pad_fn(rows, 7)
            want_ids, want_mask = reference(rows, 7, left)
            assert torch.equal(ids, want_ids) and torch.equal(mask, want_mask) and mask.dtype == torch.bool


def test_make_batch_names_a_per_row_argument_of_the_wrong_length():
    """A ``rewards`` list one short used to surface as tensordict's "batch dimension mismatch"."""
    for kw, name in ((dict(rewards=[1.0]), "rewards"), (dict(group=[0]), "group"), (dict(logprobs=[[0.1]]), "logprobs"),
                     (dict(columns={"answer": ["1"]}), "columns\\['answer'\\]")):
        with pytest.raises(BatchError, match=f"{name} has 1 values for 2 rows; give one per response"):
            make_batch([[1], [2]], [[2], [3]], **kw)
    ok = make_batch([[1], [2]], [[2], [3]], rewards=[1.0, 0.0], group=[0, 0], columns={"answer": ["1", "2"]})
    assert ok["rewards"].tolist() == [1.0, 0.0] and column(ok, "answer") == ["1", "2"]


@pytest.mark.parametrize("kwargs, match", [
    ({"group": [0.5, 0.7]}, "group row 0 is float 0.5"),  # was truncated to [0, 0]: two prompts merged
    ({"group": ["a", "b"]}, "group row 0 is str 'a'"),
    ({"rewards": [1.0, None]}, "rewards row 1 is NoneType"),
    ({"prompt_ids": [5, 6]}, "prompt_ids row 0 is int 5; give a list of token ids per row"),
    ({"prompt_ids": ["ab", "cd"]}, "prompt_ids row 0 is str 'ab'"),
    ({"response_ids": [[7.0], [8]]}, "response_ids row 0 holds 7.0; token ids are ints >= 0"),  # was truncated
    ({"response_ids": [[7], [-1]]}, "response_ids row 1 holds -1"),
])
def test_make_batch_names_rows_it_cannot_take(kwargs, match):
    args = {"prompt_ids": [[5], [6]], "response_ids": [[7], [8]], **kwargs}
    with pytest.raises(BatchError, match=match):
        make_batch(args.pop("prompt_ids"), args.pop("response_ids"), **args)


def test_set_column_refuses_the_batchs_tensor_fields_and_keeps_its_text_columns_settable():
    from rlkit.batch import set_column

    b = make_batch([[1], [2, 3]], [[4, 5], [6]], rewards=[1.0, 0.0])
    for name in ("rewards", "response_mask", "prompt_ids", "reward/exact", "completions"):
        with pytest.raises(BatchError, match=rf"set_column: column name\(s\) \['{name}'\] are reserved"):
            set_column(b, name, ["x", "y"])
    assert isinstance(b.get("rewards"), torch.Tensor) and isinstance(b.get("response_mask"), torch.Tensor)
    validate(b)
    for name in ("prompt_text", "response_text", "answer"):
        set_column(b, name, ["x", "y"])
        assert column(b, name) == ["x", "y"]
    set_column(b, "response_text", ["z", "w"])  # replacing a text column still works
    assert column(b, "response_text") == ["z", "w"]


def test_make_batch_refuses_a_pad_id_that_is_not_a_token_id():
    for bad in (-1, None, 1.0):
        with pytest.raises(BatchError, match=rf"pad_token_id must be a token id \(an int >= 0\), got {bad!r}"):
            make_batch([[1]], [[2, 3], ], pad_token_id=bad)
    assert make_batch([[1], [2, 3]], [[4]] * 2, pad_token_id=9)["prompt_ids"].tolist() == [[9, 1], [2, 3]]


def test_make_batch_refuses_an_empty_prompt_row():
    """The forward predicts a row's first response token from its last prompt token: an empty
    prompt row used to build and then fail in the forward with a message about prompt_mask."""
    with pytest.raises(BatchError, match="prompt_ids row 1 is empty; every row needs at least one prompt token"):
        make_batch([[1], [], [2]], [[3], [4], [5]])
    make_batch([[1], [2]], [[3], []])  # an empty response row is fine (no token to train on)


def test_make_batch_takes_integer_numpy_and_tensor_rows():
    np = pytest.importorskip("numpy")
    b = make_batch([np.array([1, 2]), torch.tensor([3]), [4]], [np.array([5], dtype=np.int32), [6, 7], np.array([8, 9], dtype=np.uint8)])
    assert b["prompt_ids"].tolist() == [[1, 2], [0, 3], [0, 4]]
    assert b["response_ids"].tolist() == [[5, 0], [6, 7], [8, 9]]
    assert b["response_mask"].tolist() == [[True, False], [True, True], [True, True]]
    with pytest.raises(BatchError, match="prompt_ids row 0 is a 1-d float64 ndarray; give 1-d integer token ids"):
        make_batch([np.array([1.0])], [[2]])
    with pytest.raises(BatchError, match="response_ids row 0 is a 2-d int64 ndarray"):
        make_batch([[1]], [np.array([[2]])])
    with pytest.raises(BatchError, match="response_ids row 0 holds -1; token ids are ints >= 0"):
        make_batch([[1]], [np.array([-1])])
    with pytest.raises(BatchError, match="prompt_ids row 0 holds -4"):
        make_batch([torch.tensor([-4])], [[2]])
    with pytest.raises(BatchError, match=r"convert them with list\(\.\.\.\) or \.tolist\(\)"):
        make_batch([{1, 2}], [[3]])


def test_validate_docstring_says_the_mask_layout_is_checked_by_the_forward():
    """validate() checks structure, not the masks' padding direction (scores and advantages take
    masks with holes); its docstring used to claim it checked the masks."""
    b = make_batch([[1], [2, 3]], [[4, 5], [6]])
    b["response_mask"] = torch.tensor([[False, True], [True, False]])
    assert validate(b) is b
    doc = validate.__doc__
    assert "shapes, dtypes and masks" not in doc and "Not checked here: the masks' padding direction" in doc
